//! `warmroute-mock`: run one mock backend instance until SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::process::ExitCode;

use warmroute_mock::{MockConfig, MockServer};

const USAGE: &str = "\
usage: warmroute-mock --listen ADDR --name NAME [options]

OpenAI-compatible LLM backend simulator (prefix cache, TTFT, decode rate, failure knobs).

options:
  --listen ADDR            address to bind, e.g. 127.0.0.1:9001 (port 0 = any)   [required]
  --name NAME              instance name, sent as x-mock-peer                   [required]
  --models M1,M2           served models (default mock-model)
  --ttft-base-ms N         fixed time to first token (default 20)
  --ttft-per-token-us N    prefill cost per uncached prompt token (default 50)
  --decode-tps F           tokens per second while generating, 0 = unpaced (default 200)
  --max-tokens N           completion tokens when the request sets none (default 16)
  --cache-tokens N         prefix cache capacity in tokens, 0 = off (default 1000000)
  --block-tokens N         prefix cache block size (default 16)
  --max-concurrency N      active completion requests allowed, 0 = unlimited (default 0)
  --queue-when-busy        above --max-concurrency, queue (first come, first served; the
                           prefill starts once a slot is free) instead of answering 429
  --fail-status N          answer every completion request with status N
  --health-status N        answer /health with status N
  --hang-ms N              silent wait before the first response byte (default 0)
  --close-after N          close streams after N SSE events
  --slow-start-ms N        extra TTFT decaying linearly to 0 over the first N ms
  --workers N              runtime threads sharing the port (default 1)
  -h, --help               show this help

Per-request header overrides: x-mock-status, x-mock-ttft-ms, x-mock-hang-ms, x-mock-tokens,
x-mock-interval-ms, x-mock-close-after, x-mock-echo: 1, x-mock-no-length: 1.
";

const VALUE_FLAGS: &[&str] = &[
    "--listen",
    "--name",
    "--models",
    "--ttft-base-ms",
    "--ttft-per-token-us",
    "--decode-tps",
    "--max-tokens",
    "--cache-tokens",
    "--block-tokens",
    "--max-concurrency",
    "--fail-status",
    "--health-status",
    "--hang-ms",
    "--close-after",
    "--slow-start-ms",
    "--workers",
];

enum Parsed {
    Help,
    Run(SocketAddr, MockConfig),
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("invalid value for {flag}: {v:?}"))
}

fn parse_args(args: &[String]) -> Result<Parsed, String> {
    let mut cfg = MockConfig::default();
    let mut listen: Option<SocketAddr> = None;
    let mut name: Option<String> = None;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg, None),
        };
        i += 1;
        match flag {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--queue-when-busy" => {
                if inline.is_some() {
                    return Err("--queue-when-busy takes no value".into());
                }
                cfg.busy_429 = false;
                continue;
            }
            f if !VALUE_FLAGS.contains(&f) => return Err(format!("unknown argument {arg:?}")),
            _ => {}
        }
        let value = match inline {
            Some(v) => v,
            None => {
                let v = args
                    .get(i)
                    .ok_or_else(|| format!("missing value for {flag}"))?;
                i += 1;
                v.clone()
            }
        };
        let v = value.as_str();
        match flag {
            "--listen" => listen = Some(num(flag, v)?),
            "--name" => {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err("--name must be non-empty printable ASCII without spaces".into());
                }
                name = Some(v.to_string());
            }
            "--models" => {
                let models: Vec<String> = v
                    .split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect();
                if models.is_empty() {
                    return Err("--models needs at least one model".into());
                }
                cfg.models = models;
            }
            "--ttft-base-ms" => cfg.ttft_base_ms = num(flag, v)?,
            "--ttft-per-token-us" => cfg.ttft_per_uncached_token_us = num(flag, v)?,
            "--decode-tps" => {
                let f: f64 = num(flag, v)?;
                if !f.is_finite() || f < 0.0 {
                    return Err(format!("invalid value for {flag}: {v:?}"));
                }
                cfg.decode_tps = f;
            }
            "--max-tokens" => cfg.max_tokens_default = num(flag, v)?,
            "--cache-tokens" => cfg.cache_capacity_tokens = num(flag, v)?,
            "--block-tokens" => cfg.block_tokens = num(flag, v)?,
            "--max-concurrency" => cfg.max_concurrency = num(flag, v)?,
            "--fail-status" | "--health-status" => {
                let s: u16 = num(flag, v)?;
                if !(200..=599).contains(&s) {
                    return Err(format!("{flag} must be within 200..=599"));
                }
                if flag == "--fail-status" {
                    cfg.fail_status = Some(s);
                } else {
                    cfg.health_status = Some(s);
                }
            }
            "--hang-ms" => cfg.hang_ms = num(flag, v)?,
            "--close-after" => cfg.close_after_events = Some(num(flag, v)?),
            "--slow-start-ms" => cfg.slow_start_ms = num(flag, v)?,
            "--workers" => {
                let n: usize = num(flag, v)?;
                if n == 0 || n > 1024 {
                    return Err("--workers must be within 1..=1024".into());
                }
                cfg.workers = n;
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    let listen = listen.ok_or("--listen is required")?;
    cfg.name = name.ok_or("--name is required")?;
    Ok(Parsed::Run(listen, cfg))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (listen, cfg) = match parse_args(&args) {
        Ok(Parsed::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Run(l, c)) => (l, c),
        Err(e) => {
            eprintln!("warmroute-mock: {e}\n(see --help)");
            return ExitCode::from(2);
        }
    };
    let server = match MockServer::start(listen, cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("warmroute-mock: cannot listen on {listen}: {e}");
            return ExitCode::from(1);
        }
    };
    println!("listening on {}", server.addr());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // Serve until a signal ends the process (default SIGTERM/SIGINT handling).
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_flags() {
        let p = parse_args(&args(
            "--listen 127.0.0.1:0 --name a --models m1,m2 --decode-tps=0 --queue-when-busy \
             --max-concurrency 4 --fail-status 503 --close-after 3 --workers 2",
        ))
        .unwrap();
        let Parsed::Run(addr, c) = p else {
            panic!("expected run")
        };
        assert_eq!(addr.port(), 0);
        assert_eq!(c.name, "a");
        assert_eq!(c.models, vec!["m1", "m2"]);
        assert_eq!(c.decode_tps, 0.0);
        assert!(!c.busy_429);
        assert_eq!(c.max_concurrency, 4);
        assert_eq!(c.fail_status, Some(503));
        assert_eq!(c.close_after_events, Some(3));
        assert_eq!(c.workers, 2);
    }

    #[test]
    fn rejects_bad_flags() {
        assert!(matches!(parse_args(&args("--help")), Ok(Parsed::Help)));
        for bad in [
            "--name a",
            "--listen 127.0.0.1:0",
            "--listen nope --name a",
            "--listen 127.0.0.1:0 --name a --bogus 1",
            "--listen 127.0.0.1:0 --name a --workers 0",
            "--listen 127.0.0.1:0 --name a --fail-status 99",
            "--listen 127.0.0.1:0 --name a --decode-tps -1",
            "--listen 127.0.0.1:0 --name a --hang-ms",
            "--listen 127.0.0.1:0 --name a --bogus",
        ] {
            assert!(parse_args(&args(bad)).is_err(), "{bad}");
        }
    }
}
