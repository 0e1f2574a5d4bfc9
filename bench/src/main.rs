//! `warmroute-bench`: load and replay drivers for warmroute's benchmarks.
//!
//! `warmroute-bench replay` replays multi-turn conversations with growing history against an
//! OpenAI-compatible `/v1/chat/completions` endpoint (a router or a `warmroute-mock`), one
//! keep-alive HTTP/1.1 connection per in-flight session slot, streaming, and reports per-turn
//! TTFT and prefix-cache hit rates (cached / prompt tokens from the final usage frame) next to
//! the ideal hit rate of the same replay. Standard library threads and a small blocking
//! HTTP/1.1 client; no async runtime.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod sse;
mod wake_cost;

const USAGE: &str = "\
usage: warmroute-bench replay --target URL [options]
       warmroute-bench sse --target URL [options]   (concurrent SSE streams; sse --help)
       warmroute-bench wake-cost [options]          (what a wake-up costs; wake-cost --help)

Replay N multi-turn conversations (growing history, streaming) against URL
(http://HOST:PORT/PATH, PATH ending in /v1/chat/completions) and report TTFT and cache hits.

options:
  --target URL          endpoint to POST to                                     [required]
  --sessions N          conversations (default 32)
  --turns T             turns per conversation (default 8)
  --concurrency C       conversations in flight at once (default 4)
  --id header|none      send the session id in a header or not at all (default header)
  --header-name NAME    session id header (default X-Session-ID)
  --turn-header NAME    also send NAME: {\"session_id\":ID,\"turn\":T} (e.g. x-phanrouter-session,
                        which the router's session_prio grades by); off by default
  --turn-tokens K       words per new user message (default 32)
  --system-tokens S     words of each conversation's system prompt (default 256)
  --max-tokens M        completion tokens asked per turn (default 16)
  --think-ms D          pause between a session's turns (default 0)
  --block-tokens B      cache block size for the ideal hit rate (default 16)
  --seed S              prompt seed (default 1)
  --model NAME          model field (default mock-model)
  --max-attempts N      tries per turn on 429/5xx/connection errors (default 40)
  --label TEXT          copied into the output JSON
  --out FILE            write the JSON result here (default: stdout)
  --records FILE        also write one JSON line per turn (session, turn, ttft_ms, tokens)
  --quiet               no progress lines on stderr
";

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Opts {
    target: String,
    host: String,
    addr: SocketAddr,
    path: String,
    sessions: usize,
    turns: usize,
    concurrency: usize,
    send_id: bool,
    header_name: String,
    turn_header: Option<String>,
    turn_tokens: usize,
    system_tokens: usize,
    max_tokens: u32,
    think_ms: u64,
    block_tokens: usize,
    seed: u64,
    model: String,
    max_attempts: u32,
    label: String,
    out: Option<String>,
    records: Option<String>,
    quiet: bool,
}

pub(crate) fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("invalid value for {flag}: {v:?}"))
}

/// `http://HOST:PORT/PATH` → (HOST:PORT, its address, PATH; `/v1/chat/completions` if none).
pub(crate) fn parse_target(url: &str) -> Result<(String, SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("--target must start with http:// (no TLS)")?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/v1/chat/completions"),
    };
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("no address for {hostport}"))?;
    Ok((hostport.to_string(), addr, path.to_string()))
}

/// A subcommand's options as (flag, value) pairs, from `--flag value` or `--flag=value`,
/// and whether `--quiet` (which takes no value) was given. `Ok(None)` for `-h`/`--help`.
pub(crate) type Flags = (Vec<(String, String)>, bool);

pub(crate) fn flag_pairs<'a>(
    mut it: impl Iterator<Item = &'a String>,
) -> Result<Option<Flags>, String> {
    let mut pairs = Vec::new();
    let mut quiet = false;
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        match flag {
            "-h" | "--help" => return Ok(None),
            "--quiet" => {
                quiet = true;
                continue;
            }
            _ => {}
        }
        let v = match inline {
            Some(v) => v,
            None => it
                .next()
                .cloned()
                .ok_or_else(|| format!("missing value for {flag}"))?,
        };
        pairs.push((flag.to_string(), v));
    }
    Ok(Some((pairs, quiet)))
}

/// A subcommand's options ([`flag_pairs`]), each (flag, value) handed to `set`, which
/// rejects the flags it does not know. `Ok(None)` for `-h`/`--help`; otherwise whether
/// `--quiet` was given.
pub(crate) fn each_flag<'a>(
    it: impl Iterator<Item = &'a String>,
    mut set: impl FnMut(&str, String) -> Result<(), String>,
) -> Result<Option<bool>, String> {
    let Some((pairs, quiet)) = flag_pairs(it)? else {
        return Ok(None);
    };
    for (flag, v) in pairs {
        set(&flag, v)?;
    }
    Ok(Some(quiet))
}

fn parse_args(args: &[String]) -> Result<Option<Opts>, String> {
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        Some("replay") => {}
        Some("-h" | "--help") | None => return Ok(None),
        Some(other) => return Err(format!("unknown command {other:?}")),
    }
    let mut o = Opts {
        target: String::new(),
        host: String::new(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        path: String::new(),
        sessions: 32,
        turns: 8,
        concurrency: 4,
        send_id: true,
        header_name: "X-Session-ID".into(),
        turn_header: None,
        turn_tokens: 32,
        system_tokens: 256,
        max_tokens: 16,
        think_ms: 0,
        block_tokens: 16,
        seed: 1,
        model: "mock-model".into(),
        max_attempts: 40,
        label: String::new(),
        out: None,
        records: None,
        quiet: false,
    };
    let Some(quiet) = each_flag(it, |flag, v| {
        match flag {
            "--target" => o.target = v,
            "--sessions" => o.sessions = num(flag, &v)?,
            "--turns" => o.turns = num(flag, &v)?,
            "--concurrency" => o.concurrency = num(flag, &v)?,
            "--id" => {
                o.send_id = match v.as_str() {
                    "header" => true,
                    "none" => false,
                    _ => return Err("--id must be header or none".into()),
                }
            }
            "--header-name" => o.header_name = v,
            "--turn-header" => o.turn_header = Some(v),
            "--turn-tokens" => o.turn_tokens = num(flag, &v)?,
            "--system-tokens" => o.system_tokens = num(flag, &v)?,
            "--max-tokens" => o.max_tokens = num(flag, &v)?,
            "--think-ms" => o.think_ms = num(flag, &v)?,
            "--block-tokens" => o.block_tokens = num(flag, &v)?,
            "--seed" => o.seed = num(flag, &v)?,
            "--model" => o.model = v,
            "--max-attempts" => o.max_attempts = num(flag, &v)?,
            "--label" => o.label = v,
            "--out" => o.out = Some(v),
            "--records" => o.records = Some(v),
            _ => return Err(format!("unknown argument {flag:?}")),
        }
        Ok(())
    })?
    else {
        return Ok(None);
    };
    o.quiet = quiet;
    if o.target.is_empty() {
        return Err("--target is required".into());
    }
    if o.sessions == 0 || o.turns == 0 || o.concurrency == 0 || o.block_tokens == 0 {
        return Err("--sessions, --turns, --concurrency and --block-tokens must be > 0".into());
    }
    if o.max_attempts == 0 {
        return Err("--max-attempts must be > 0".into());
    }
    let (host, addr, path) = parse_target(&o.target)?;
    o.host = host;
    o.addr = addr;
    o.path = path;
    Ok(Some(o))
}

// ---------------------------------------------------------------------------------------------
// Deterministic prompts
// ---------------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

const SYLLABLES: &[&str] = &[
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qui", "dor", "fen", "gal", "hus",
    "jor", "bel", "cym", "wex", "yar",
];

fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        let len = 1 + (rng.next() % 3) as usize;
        for _ in 0..len {
            s.push_str(SYLLABLES[(rng.next() % SYLLABLES.len() as u64) as usize]);
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// A small blocking HTTP/1.1 client
// ---------------------------------------------------------------------------------------------

/// What one streamed request produced.
#[derive(Debug, Default)]
struct Outcome {
    status: u16,
    ttft: Option<Duration>,
    total: Duration,
    content: String,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    /// llama.cpp's `timings.prompt_ms` (the engine's own prefill time, queueing excluded).
    engine_prompt_ms: Option<f64>,
    peer: Option<String>,
    mode: Option<String>,
    error: Option<String>,
}

struct Conn {
    addr: SocketAddr,
    reader: Option<BufReader<TcpStream>>,
}

impl Conn {
    fn new(addr: SocketAddr) -> Self {
        Conn { addr, reader: None }
    }

    fn stream(&mut self) -> std::io::Result<&mut BufReader<TcpStream>> {
        if self.reader.is_none() {
            let s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(120)))?;
            self.reader = Some(BufReader::with_capacity(64 * 1024, s));
        }
        Ok(self.reader.as_mut().expect("connected above"))
    }

    /// POST `body` and read the whole response; SSE frames are parsed as they arrive.
    fn post(&mut self, o: &Opts, sid: Option<&str>, turn: usize, body: &[u8]) -> Outcome {
        let t0 = Instant::now();
        let mut out = Outcome::default();
        let res = self.post_inner(o, sid, turn, body, t0, &mut out);
        out.total = t0.elapsed();
        match res {
            Ok(keep) => {
                if !keep {
                    self.reader = None;
                }
            }
            Err(e) => {
                self.reader = None;
                out.error = Some(e.to_string());
            }
        }
        out
    }

    fn post_inner(
        &mut self,
        o: &Opts,
        sid: Option<&str>,
        turn: usize,
        body: &[u8],
        t0: Instant,
        out: &mut Outcome,
    ) -> std::io::Result<bool> {
        let mut head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {}\r\n",
            o.path,
            o.host,
            body.len()
        );
        if let Some(sid) = sid {
            head.push_str(&format!("{}: {sid}\r\n", o.header_name));
            if let Some(name) = &o.turn_header {
                let v = json!({"session_id": sid, "turn": turn});
                head.push_str(&format!("{name}: {v}\r\n"));
            }
        }
        head.push_str("\r\n");
        // A keep-alive connection the server closed while idle fails on the first read;
        // retry once on a fresh connection when nothing of the response arrived.
        let fresh = self.reader.is_none();
        let r = self.stream()?;
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        r.get_mut().write_all(&req)?;
        let mut line = String::new();
        let n = r.read_line(&mut line)?;
        if n == 0 {
            if fresh {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed before the status line",
                ));
            }
            self.reader = None;
            return self.post_inner(o, sid, turn, body, t0, out);
        }
        out.status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
        let mut chunked = false;
        let mut length: Option<usize> = None;
        let mut close = line.starts_with("HTTP/1.0");
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                return Err(bad("eof in headers".into()));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let Some((k, v)) = l.split_once(':') else {
                continue;
            };
            let v = v.trim();
            match k.trim().to_ascii_lowercase().as_str() {
                "transfer-encoding" => chunked = v.to_ascii_lowercase().contains("chunked"),
                "content-length" => length = v.parse().ok(),
                "connection" => close = v.eq_ignore_ascii_case("close"),
                "x-mock-peer" => out.peer = Some(v.to_string()),
                // A router's own answer (warmroute) when the backend names no peer itself.
                "x-routed-peer" if out.peer.is_none() => out.peer = Some(v.to_string()),
                "x-routed-mode" => out.mode = Some(v.to_string()),
                _ => {}
            }
        }
        let mut sse = Sse::default();
        let mut buf = vec![0u8; 16 * 1024];
        if chunked {
            loop {
                line.clear();
                if r.read_line(&mut line)? == 0 {
                    return Err(bad("eof in chunk size".into()));
                }
                let size_str = line.trim().split(';').next().unwrap_or("");
                let size = usize::from_str_radix(size_str, 16)
                    .map_err(|_| bad(format!("bad chunk size {line:?}")))?;
                if size == 0 {
                    // Trailers, then the empty line.
                    loop {
                        line.clear();
                        if r.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                            break;
                        }
                    }
                    break;
                }
                let mut left = size;
                while left > 0 {
                    let k = left.min(buf.len());
                    r.read_exact(&mut buf[..k])?;
                    sse.feed(&buf[..k], t0, out);
                    left -= k;
                }
                let mut crlf = [0u8; 2];
                r.read_exact(&mut crlf)?;
            }
        } else if let Some(mut left) = length {
            while left > 0 {
                let k = left.min(buf.len());
                r.read_exact(&mut buf[..k])?;
                sse.feed(&buf[..k], t0, out);
                left -= k;
            }
        } else {
            loop {
                let k = r.read(&mut buf)?;
                if k == 0 {
                    break;
                }
                sse.feed(&buf[..k], t0, out);
            }
            close = true;
        }
        sse.finish(t0, out);
        Ok(!close)
    }
}

fn bad(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Incremental SSE frame parser over the decoded body.
#[derive(Default)]
struct Sse {
    pending: Vec<u8>,
}

impl Sse {
    fn feed(&mut self, data: &[u8], t0: Instant, out: &mut Outcome) {
        self.pending.extend_from_slice(data);
        while let Some(end) = find_frame_end(&self.pending) {
            let frame: Vec<u8> = self.pending.drain(..end.1).collect();
            frame_event(&frame[..end.0], t0, out);
        }
    }

    fn finish(&mut self, t0: Instant, out: &mut Outcome) {
        if !self.pending.is_empty() {
            let frame = std::mem::take(&mut self.pending);
            frame_event(&frame, t0, out);
        }
    }
}

/// (end of the frame, end of its delimiter) of the first complete frame.
fn find_frame_end(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, i + 2));
        }
        if i + 3 < b.len() && &b[i..i + 4] == b"\r\n\r\n" {
            return Some((i, i + 4));
        }
        i += 1;
    }
    None
}

fn frame_event(frame: &[u8], t0: Instant, out: &mut Outcome) {
    let text = String::from_utf8_lossy(frame);
    let mut data = String::new();
    for l in text.lines() {
        if let Some(d) = l.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        }
    }
    let data = data.trim();
    if data.is_empty() || data == "[DONE]" {
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return;
    };
    if let Some(c) = v
        .pointer("/choices/0/delta/content")
        .and_then(Value::as_str)
    {
        if !c.is_empty() {
            if out.ttft.is_none() {
                out.ttft = Some(t0.elapsed());
            }
            out.content.push_str(c);
        }
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        out.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
        out.cached_tokens = Some(
            u.pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        );
    }
    if let Some(ms) = v.pointer("/timings/prompt_ms").and_then(Value::as_f64) {
        out.engine_prompt_ms = Some(ms);
    }
}

// ---------------------------------------------------------------------------------------------
// Replay
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct TurnRec {
    session: usize,
    turn: usize,
    status: u16,
    ok: bool,
    attempts: u32,
    n429: u32,
    n5xx: u32,
    nerr: u32,
    ttft_ms: Option<f64>,
    /// TTFT counted from the turn's first attempt (time lost to 429s and retries included).
    ttft_turn_ms: Option<f64>,
    total_ms: f64,
    prompt_words: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    ideal_cached: u64,
    engine_prompt_ms: Option<f64>,
    peer: Option<String>,
    mode: Option<String>,
    /// Modes of the failed attempts before this turn's final one (spills that were refused).
    failed_modes: Vec<String>,
}

fn message_words(messages: &[Value]) -> Vec<String> {
    // The mock's tokenizer: every message's content, whitespace-split, in order.
    let mut w = Vec::new();
    for m in messages {
        if let Some(c) = m.get("content").and_then(Value::as_str) {
            w.extend(c.split_whitespace().map(str::to_string));
        }
    }
    w
}

fn shared_prefix(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn run_session(
    o: &Opts,
    idx: usize,
    conn: &mut Conn,
    recs: &Mutex<Vec<TurnRec>>,
    done: &AtomicUsize,
) {
    let mut rng = Rng(o.seed ^ (idx as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    // UUID-shaped ids, as SDKs send them (sequential ids would flatter crc32, which is linear).
    let mut id_rng = Rng(!o.seed ^ (idx as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25));
    let (a, b) = (id_rng.next(), id_rng.next());
    let sid = format!(
        "{:08x}-{:04x}-4{:03x}-a{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    );
    let mut messages = vec![json!({
        "role": "system",
        "content": format!("conversation {sid} {}", words(&mut rng, o.system_tokens.saturating_sub(2))),
    })];
    let mut prev_words: Vec<String> = Vec::new();
    for turn in 1..=o.turns {
        if turn > 1 && o.think_ms > 0 {
            std::thread::sleep(Duration::from_millis(o.think_ms));
        }
        messages.push(json!({"role": "user", "content": words(&mut rng, o.turn_tokens)}));
        let body = json!({
            "model": o.model,
            "messages": messages,
            "max_tokens": o.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let body = serde_json::to_vec(&body).expect("json");
        let cur_words = message_words(&messages);
        let ideal = if turn == 1 {
            0
        } else {
            let l = shared_prefix(&prev_words, &cur_words);
            (l / o.block_tokens * o.block_tokens) as u64
        };
        let mut rec = TurnRec {
            session: idx,
            turn,
            status: 0,
            ok: false,
            attempts: 0,
            n429: 0,
            n5xx: 0,
            nerr: 0,
            ttft_ms: None,
            ttft_turn_ms: None,
            total_ms: 0.0,
            prompt_words: cur_words.len() as u64,
            prompt_tokens: 0,
            cached_tokens: 0,
            ideal_cached: ideal,
            engine_prompt_ms: None,
            peer: None,
            mode: None,
            failed_modes: Vec::new(),
        };
        let mut reply = String::new();
        let turn_t0 = Instant::now();
        loop {
            rec.attempts += 1;
            let attempt_at = turn_t0.elapsed();
            let r = conn.post(o, o.send_id.then_some(sid.as_str()), turn, &body);
            rec.status = r.status;
            rec.peer = r.peer.clone();
            rec.mode = r.mode.clone();
            let good = r.error.is_none() && r.status == 200 && r.prompt_tokens.is_some();
            if good {
                rec.ok = true;
                // TTFT and total of the successful attempt; the time lost to refused attempts
                // shows in turn_ms.
                rec.ttft_ms = r.ttft.map(|d| d.as_secs_f64() * 1e3);
                rec.ttft_turn_ms = r.ttft.map(|d| (attempt_at + d).as_secs_f64() * 1e3);
                rec.total_ms = r.total.as_secs_f64() * 1e3;
                rec.prompt_tokens = r.prompt_tokens.unwrap_or(0);
                rec.cached_tokens = r.cached_tokens.unwrap_or(0);
                rec.engine_prompt_ms = r.engine_prompt_ms;
                reply = r.content;
                break;
            }
            if r.error.is_some() || r.status == 0 {
                rec.nerr += 1;
            } else if r.status == 429 {
                rec.n429 += 1;
            } else if r.status >= 500 {
                rec.n5xx += 1;
            } else if r.status == 200 {
                rec.nerr += 1; // 200 without a usage frame
            }
            if let Some(m) = &r.mode {
                rec.failed_modes.push(m.clone());
            }
            if rec.attempts >= o.max_attempts
                || (r.status >= 400 && r.status < 500 && r.status != 429)
            {
                break;
            }
            // Backoff: 10 ms doubling to 160 ms, jittered.
            let base = 10u64 << rec.attempts.min(4);
            std::thread::sleep(Duration::from_millis(base + rng.next() % base));
        }
        prev_words = cur_words;
        // The reply as the client saw it goes into the history (empty when the turn failed).
        messages.push(json!({"role": "assistant", "content": reply}));
        recs.lock().expect("records lock").push(rec);
        done.fetch_add(1, Ordering::Relaxed);
    }
}

fn pct(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn stats(vals: &mut [f64]) -> Value {
    vals.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let r = |p| pct(vals, p).map(round3);
    json!({
        "n": vals.len(),
        "p50": r(50.0),
        "p90": r(90.0),
        "p99": r(99.0),
        "max": vals.last().copied().map(round3),
        "mean": if vals.is_empty() { None } else { Some(round3(vals.iter().sum::<f64>() / vals.len() as f64)) },
    })
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| (a as f64 / b as f64 * 1e4).round() / 1e4)
}

fn group(recs: &[&TurnRec]) -> Value {
    let ok: Vec<&&TurnRec> = recs.iter().filter(|r| r.ok).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let ideal: u64 = ok.iter().map(|r| r.ideal_cached).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let mut total: Vec<f64> = ok.iter().map(|r| r.total_ms).collect();
    let mut ttft_turn: Vec<f64> = ok.iter().filter_map(|r| r.ttft_turn_ms).collect();
    json!({
        "turns": recs.len(),
        "ok": ok.len(),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "hit_rate": ratio(cached, prompt),
        "ideal_hit_rate": ratio(ideal, prompt),
        "ttft_ms": stats(&mut ttft),
        "ttft_incl_retries_ms": stats(&mut ttft_turn),
        "total_ms": stats(&mut total),
    })
}

fn summarize(o: &Opts, recs: &mut [TurnRec], wall: Duration) -> Value {
    recs.sort_by_key(|r| (r.session, r.turn));
    let all: Vec<&TurnRec> = recs.iter().collect();
    let mut totals = group(&all);
    let first: Vec<&TurnRec> = recs.iter().filter(|r| r.turn == 1).collect();
    let later: Vec<&TurnRec> = recs.iter().filter(|r| r.turn > 1).collect();
    // Stickiness: a turn (after the first) answered by the peer of the session's previous turn.
    let (mut same, mut pairs) = (0u64, 0u64);
    for w in recs.windows(2) {
        if w[0].session == w[1].session && w[1].turn == w[0].turn + 1 {
            if let (Some(a), Some(b)) = (&w[0].peer, &w[1].peer) {
                pairs += 1;
                if a == b {
                    same += 1;
                }
            }
        }
    }
    let mut modes: BTreeMap<String, u64> = BTreeMap::new();
    let mut refused_modes: BTreeMap<String, u64> = BTreeMap::new();
    let mut peers: BTreeMap<String, u64> = BTreeMap::new();
    for r in recs.iter().filter(|r| r.ok) {
        *modes
            .entry(r.mode.clone().unwrap_or_else(|| "-".into()))
            .or_default() += 1;
        *peers
            .entry(r.peer.clone().unwrap_or_else(|| "-".into()))
            .or_default() += 1;
    }
    for r in recs.iter() {
        for m in &r.failed_modes {
            *refused_modes.entry(m.clone()).or_default() += 1;
        }
    }
    let token_mismatch = recs
        .iter()
        .filter(|r| r.ok && r.prompt_tokens != r.prompt_words)
        .count();
    let t = totals.as_object_mut().expect("object");
    t.insert(
        "ttft_first_turn_ms".into(),
        group(&first)["ttft_ms"].clone(),
    );
    t.insert(
        "ttft_later_turns_ms".into(),
        group(&later)["ttft_ms"].clone(),
    );
    t.insert(
        "ttft_incl_retries_later_turns_ms".into(),
        group(&later)["ttft_incl_retries_ms"].clone(),
    );
    t.insert(
        "hit_rate_later_turns".into(),
        group(&later)["hit_rate"].clone(),
    );
    t.insert(
        "ideal_hit_rate_later_turns".into(),
        group(&later)["ideal_hit_rate"].clone(),
    );
    t.insert("stickiness".into(), json!(ratio(same, pairs)));
    t.insert(
        "failed_turns".into(),
        json!(recs.iter().filter(|r| !r.ok).count()),
    );
    t.insert(
        "attempts".into(),
        json!(recs.iter().map(|r| u64::from(r.attempts)).sum::<u64>()),
    );
    t.insert(
        "status_429".into(),
        json!(recs.iter().map(|r| u64::from(r.n429)).sum::<u64>()),
    );
    t.insert(
        "status_5xx".into(),
        json!(recs.iter().map(|r| u64::from(r.n5xx)).sum::<u64>()),
    );
    t.insert(
        "conn_errors".into(),
        json!(recs.iter().map(|r| u64::from(r.nerr)).sum::<u64>()),
    );
    t.insert(
        "hash_fallback".into(),
        json!(modes.get("hash_fallback").copied().unwrap_or(0)),
    );
    t.insert("modes".into(), json!(modes));
    t.insert("refused_attempt_modes".into(), json!(refused_modes));
    t.insert("turns_per_peer".into(), json!(peers));
    t.insert("token_count_mismatch".into(), json!(token_mismatch));
    t.insert("wall_s".into(), json!(round3(wall.as_secs_f64())));
    t.insert(
        "turns_per_s".into(),
        json!(round3(recs.len() as f64 / wall.as_secs_f64().max(1e-9))),
    );
    let mut per_turn = Vec::new();
    for turn in 1..=o.turns {
        let g: Vec<&TurnRec> = recs.iter().filter(|r| r.turn == turn).collect();
        let s = group(&g);
        per_turn.push(json!({
            "turn": turn,
            "n": s["ok"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "hit_rate": s["hit_rate"],
            "ideal_hit_rate": s["ideal_hit_rate"],
            "hash_fallback": g.iter().filter(|r| r.ok && r.mode.as_deref() == Some("hash_fallback")).count(),
            "status_429": g.iter().map(|r| u64::from(r.n429)).sum::<u64>(),
        }));
    }
    json!({
        "label": o.label,
        "config": {
            "target": o.target,
            "sessions": o.sessions,
            "turns": o.turns,
            "concurrency": o.concurrency,
            "id": if o.send_id { "header" } else { "none" },
            "header_name": o.header_name,
            "turn_header": o.turn_header,
            "turn_tokens": o.turn_tokens,
            "system_tokens": o.system_tokens,
            "max_tokens": o.max_tokens,
            "think_ms": o.think_ms,
            "block_tokens": o.block_tokens,
            "seed": o.seed,
            "model": o.model,
            "max_attempts": o.max_attempts,
        },
        "totals": totals,
        "per_turn": per_turn,
    })
}

/// One JSON line per turn, for pooling the turns of several replays (bench/engine_report.py).
fn write_records(path: &str, recs: &[TurnRec]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in recs {
        let line = json!({
            "session": r.session,
            "turn": r.turn,
            "ok": r.ok,
            "status": r.status,
            "attempts": r.attempts,
            "ttft_ms": r.ttft_ms.map(round3),
            "ttft_turn_ms": r.ttft_turn_ms.map(round3),
            "total_ms": round3(r.total_ms),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "ideal_cached": r.ideal_cached,
            "engine_prompt_ms": r.engine_prompt_ms.map(round3),
            "peer": r.peer,
        });
        writeln!(f, "{line}")?;
    }
    f.flush()
}

fn replay(o: Opts) -> Result<Value, String> {
    let o = Arc::new(o);
    let recs = Arc::new(Mutex::new(Vec::with_capacity(o.sessions * o.turns)));
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..o.concurrency.min(o.sessions) {
        let (o, recs, next, done) = (o.clone(), recs.clone(), next.clone(), done.clone());
        handles.push(
            std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn(move || {
                    let mut conn = Conn::new(o.addr);
                    loop {
                        let idx = next.fetch_add(1, Ordering::Relaxed);
                        if idx >= o.sessions {
                            break;
                        }
                        run_session(&o, idx, &mut conn, &recs, &done);
                    }
                })
                .map_err(|e| format!("spawn: {e}"))?,
        );
    }
    let progress = {
        let (o, done, stop) = (o.clone(), done.clone(), stop.clone());
        std::thread::spawn(move || {
            let total = o.sessions * o.turns;
            let mut last = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                if !o.quiet && last.elapsed() >= Duration::from_secs(2) {
                    last = Instant::now();
                    eprintln!(
                        "  replay {}: {}/{} turns, {:.1}s",
                        o.label,
                        done.load(Ordering::Relaxed),
                        total,
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
        })
    };
    for h in handles {
        h.join()
            .map_err(|_| "a session thread panicked".to_string())?;
    }
    let wall = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = progress.join();
    let mut recs = std::mem::take(&mut *recs.lock().expect("records lock"));
    let summary = summarize(&o, &mut recs, wall);
    if let Some(path) = &o.records {
        write_records(path, &recs).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    Ok(summary)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("sse") {
        return sse::main(&args[1..]);
    }
    if args.first().map(String::as_str) == Some("wake-cost") {
        return wake_cost::main(&args[1..]);
    }
    let parsed = parse_args(&args);
    run_cli(
        "warmroute-bench",
        USAGE,
        parsed,
        |o: &Opts| (o.out.clone(), o.quiet),
        replay,
        |v| {
            let t = &v["totals"];
            format!(
                "  {}: hit {} (ideal {}), ttft p50/p99 first {}/{} later {}/{} ms, sticky {}, fallback {}, 429 {}, 5xx {}, failed {}, {:.1}s",
                v["label"].as_str().unwrap_or(""),
                t["hit_rate"],
                t["ideal_hit_rate"],
                t["ttft_first_turn_ms"]["p50"],
                t["ttft_first_turn_ms"]["p99"],
                t["ttft_later_turns_ms"]["p50"],
                t["ttft_later_turns_ms"]["p99"],
                t["stickiness"],
                t["hash_fallback"],
                t["status_429"],
                t["status_5xx"],
                t["failed_turns"],
                t["wall_s"].as_f64().unwrap_or(0.0),
            )
        },
    )
}

/// Every subcommand's shape: parse the arguments (`Ok(None)`: print the usage), run, write
/// the JSON result to `--out` or stdout, then print `summary` of it unless `--quiet`.
pub(crate) fn run_cli<O>(
    name: &str,
    usage: &str,
    parsed: Result<Option<O>, String>,
    out_quiet: impl Fn(&O) -> (Option<String>, bool),
    run: impl FnOnce(O) -> Result<Value, String>,
    summary: impl FnOnce(&Value) -> String,
) -> ExitCode {
    let o = match parsed {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{usage}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{name}: {e}\n(see --help)");
            return ExitCode::from(2);
        }
    };
    let (out, quiet) = out_quiet(&o);
    let v = match run(o) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(1);
        }
    };
    let text = serde_json::to_string_pretty(&v).expect("json");
    match out {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, text + "\n") {
                eprintln!("{name}: cannot write {path}: {e}");
                return ExitCode::from(1);
            }
        }
        None => println!("{text}"),
    }
    if !quiet {
        eprintln!("{}", summary(&v));
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_frames_split_anywhere() {
        let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"tok0\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" tok1\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        for split in 1..body.len() {
            let mut out = Outcome {
                status: 200,
                ..Outcome::default()
            };
            let mut s = Sse::default();
            let t0 = Instant::now();
            s.feed(&body[..split], t0, &mut out);
            s.feed(&body[split..], t0, &mut out);
            s.finish(t0, &mut out);
            assert_eq!(out.content, "tok0 tok1");
            assert!(out.ttft.is_some());
            assert_eq!(out.prompt_tokens, Some(40));
            assert_eq!(out.cached_tokens, Some(32));
        }
    }

    #[test]
    fn ideal_counts_whole_blocks_of_the_shared_prefix() {
        let a: Vec<String> = (0..40).map(|i| i.to_string()).collect();
        let mut b = a.clone();
        b.push("x".into());
        assert_eq!(shared_prefix(&a, &b) / 16 * 16, 32);
    }

    #[test]
    fn prompts_are_deterministic() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        assert_eq!(words(&mut a, 50), words(&mut b, 50));
        assert_eq!(words(&mut Rng(1), 10).split_whitespace().count(), 10);
    }

    #[test]
    fn args() {
        let a: Vec<String> =
            "replay --target http://127.0.0.1:9/bench/v1/chat/completions --sessions 3 --id none"
                .split_whitespace()
                .map(str::to_string)
                .collect();
        let o = parse_args(&a).unwrap().unwrap();
        assert_eq!(o.path, "/bench/v1/chat/completions");
        assert_eq!(o.sessions, 3);
        assert!(!o.send_id);
        assert!(parse_args(&["replay".to_string()]).is_err());
    }

    /// The head one request sends, captured by a listener that answers 503 and closes.
    fn sent_head(extra: &str) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let args: Vec<String> =
            format!("replay --target http://{addr}/bench/v1/chat/completions {extra}")
                .split_whitespace()
                .map(str::to_string)
                .collect();
        let o = parse_args(&args).unwrap().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "client closed before its head ended");
                got.extend_from_slice(&buf[..n]);
            }
            let _ =
                s.write_all(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            String::from_utf8(got).unwrap()
        });
        let out = Conn::new(o.addr).post(&o, Some("conv-7"), 3, b"{}");
        assert_eq!(out.status, 503);
        server.join().unwrap()
    }

    #[test]
    fn turn_header_carries_the_session_and_turn_when_asked() {
        let plain = sent_head("");
        assert!(plain.contains("X-Session-ID: conv-7\r\n"), "{plain}");
        assert!(!plain.contains("x-phanrouter-session"), "{plain}");
        let graded = sent_head("--turn-header x-phanrouter-session");
        assert!(
            graded.contains("x-phanrouter-session: {\"session_id\":\"conv-7\",\"turn\":3}\r\n"),
            "{graded}"
        );
    }
}
