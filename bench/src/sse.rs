//! `warmroute-bench sse`: many concurrent, mostly idle SSE streams against one endpoint.
//!
//! Opens `--streams` HTTP/1.1 connections (one request each, `Connection: close`), spread
//! evenly over `--ramp-ms`, each POSTing a streaming chat completion. Every `data:` event is
//! timestamped when the read that carried it completes; the gaps between consecutive token
//! events are compared with the nominal `1 / --decode-tps` (the pacing of `warmroute-mock`,
//! which schedules token `i` at first-token time + `i` / decode-tps, so it does not drift).
//! Reports completed / failed streams (with reasons), events, the extra delay per
//! inter-event gap, lateness against the schedule, time to first event, token events that
//! arrived in the same read as an earlier one (batching), and a per-`--bucket-ms` timeline of
//! events and open streams. When all streams are open at once (or `--open-timeout-ms` after
//! the ramp, whichever comes first) it writes `--open-file`, so that a script can sample the
//! proxy's memory then.
//!
//! One monoio thread (io_uring when available) runs every stream as a task.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use serde_json::{json, Value};

use crate::{each_flag, num, parse_target};

const USAGE: &str = "\
usage: warmroute-bench sse --target URL [options]

Open N concurrent streaming chat completions against URL (http://HOST:PORT/PATH), ramped
up evenly, and report completed streams, inter-event gap fidelity, time to first event and
batching (token events that arrive in the same read).

options:
  --target URL           endpoint to POST to                                    [required]
  --streams N            concurrent streams (default 1000)
  --ramp-ms R            spread the N connects evenly over R ms (default 5000)
  --max-tokens M         max_tokens of each request (default 56)
  --decode-tps F         the backend's pacing in tokens/s: nominal gap = 1/F (default 2)
  --model NAME           model field (default mock-model)
  --header-name NAME     session id header (default X-Session-ID), value sse-<k % sessions>
  --sessions K           distinct session ids (default N)
  --open-file PATH       write {\"unix_ms\",\"open\",\"streams\",\"all_open\"} here when all N are
                         open (response head received) or --open-timeout-ms after the ramp
  --open-timeout-ms T    (default 10000)
  --stream-timeout-s S   give up on streams still running S s after the ramp
                         (default 30 + 2 x M / F)
  --steady-after-s S     the steady window starts S s after the open file is written
                         (default 1) ...
  --steady-s W           ... and lasts W s (default 15): gap and batching figures are also
                         reported for the token events that arrive within it
  --bucket-ms B          timeline resolution (default 100)
  --label TEXT           copied into the output JSON
  --out FILE             write the JSON result here (default: stdout)
  --dump-events FILE     also write one line per stream: k, then its token arrival times
                         (ms since the start, 0.1 ms resolution)
  --quiet                no progress lines on stderr
";

#[derive(Debug, Clone)]
struct Opts {
    target: String,
    host: String,
    addr: SocketAddr,
    path: String,
    streams: usize,
    ramp_ms: u64,
    max_tokens: u32,
    decode_tps: f64,
    model: String,
    header_name: String,
    sessions: usize,
    open_file: Option<String>,
    open_timeout_ms: u64,
    stream_timeout_s: f64,
    steady_after_s: f64,
    steady_s: f64,
    bucket_ms: u64,
    label: String,
    out: Option<String>,
    dump_events: Option<String>,
    quiet: bool,
}

fn parse_args(args: &[String]) -> Result<Option<Opts>, String> {
    let mut o = Opts {
        target: String::new(),
        host: String::new(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        path: String::new(),
        streams: 1000,
        ramp_ms: 5000,
        max_tokens: 56,
        decode_tps: 2.0,
        model: "mock-model".into(),
        header_name: "X-Session-ID".into(),
        sessions: 0,
        open_file: None,
        open_timeout_ms: 10_000,
        stream_timeout_s: 0.0,
        steady_after_s: 1.0,
        steady_s: 15.0,
        bucket_ms: 100,
        label: String::new(),
        out: None,
        dump_events: None,
        quiet: false,
    };
    let Some(quiet) = each_flag(args.iter(), |flag, v| {
        match flag {
            "--target" => o.target = v,
            "--streams" => o.streams = num(flag, &v)?,
            "--ramp-ms" => o.ramp_ms = num(flag, &v)?,
            "--max-tokens" => o.max_tokens = num(flag, &v)?,
            "--decode-tps" => o.decode_tps = num(flag, &v)?,
            "--model" => o.model = v,
            "--header-name" => o.header_name = v,
            "--sessions" => o.sessions = num(flag, &v)?,
            "--open-file" => o.open_file = Some(v),
            "--open-timeout-ms" => o.open_timeout_ms = num(flag, &v)?,
            "--stream-timeout-s" => o.stream_timeout_s = num(flag, &v)?,
            "--steady-after-s" => o.steady_after_s = num(flag, &v)?,
            "--steady-s" => o.steady_s = num(flag, &v)?,
            "--bucket-ms" => o.bucket_ms = num(flag, &v)?,
            "--label" => o.label = v,
            "--out" => o.out = Some(v),
            "--dump-events" => o.dump_events = Some(v),
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
    if o.streams == 0 || o.max_tokens == 0 || o.bucket_ms == 0 {
        return Err("--streams, --max-tokens and --bucket-ms must be > 0".into());
    }
    if !(o.steady_after_s.is_finite()
        && o.steady_after_s >= 0.0
        && o.steady_s.is_finite()
        && o.steady_s >= 0.0)
    {
        return Err("--steady-after-s and --steady-s must be >= 0".into());
    }
    if !(o.decode_tps.is_finite() && o.decode_tps > 0.0) {
        return Err("--decode-tps must be > 0 (the backend must pace its events)".into());
    }
    if o.sessions == 0 {
        o.sessions = o.streams;
    }
    if !(o.stream_timeout_s.is_finite() && o.stream_timeout_s > 0.0) {
        o.stream_timeout_s = 30.0 + 2.0 * f64::from(o.max_tokens) / o.decode_tps;
    }
    let (host, addr, path) = parse_target(&o.target)?;
    o.host = host;
    o.addr = addr;
    o.path = path;
    Ok(Some(o))
}

// ---------------------------------------------------------------------------------------------
// Response parsing: head, chunked framing, SSE events
// ---------------------------------------------------------------------------------------------

/// Status and body framing of a response head; `None` while incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(usize, u16, Framing)>, String> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        if buf.len() > 64 * 1024 {
            return Err("response head too large".into());
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| "non-UTF-8 response head")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "malformed status line".to_string())?;
    let mut framing = Framing::UntilClose;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("transfer-encoding")
            && value.to_ascii_lowercase().contains("chunked")
        {
            framing = Framing::Chunked(Chunked::default());
        } else if name.eq_ignore_ascii_case("content-length")
            && !matches!(framing, Framing::Chunked(_))
        {
            let n = value.parse().map_err(|_| "bad content-length")?;
            framing = Framing::Length(n);
        }
    }
    Ok(Some((end + 4, status, framing)))
}

enum Framing {
    Chunked(Chunked),
    Length(u64),
    UntilClose,
}

#[derive(Default)]
enum ChunkState {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    Trailer,
    Done,
}

/// Incremental chunked-body decoder.
#[derive(Default)]
struct Chunked {
    state: ChunkState,
    line: Vec<u8>,
}

impl Chunked {
    fn done(&self) -> bool {
        matches!(self.state, ChunkState::Done)
    }

    /// Decode `data`, appending body bytes to `out`.
    fn feed(&mut self, mut data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        while !data.is_empty() {
            match self.state {
                ChunkState::Done => return Ok(()),
                ChunkState::Data(n) => {
                    let take = (n as usize).min(data.len());
                    out.extend_from_slice(&data[..take]);
                    data = &data[take..];
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                }
                ChunkState::Size | ChunkState::DataEnd | ChunkState::Trailer => {
                    let (line_part, found) = match data.iter().position(|&b| b == b'\n') {
                        Some(i) => (&data[..=i], true),
                        None => (data, false),
                    };
                    self.line.extend_from_slice(line_part);
                    data = &data[line_part.len()..];
                    if self.line.len() > 4096 {
                        return Err("chunk line too long".into());
                    }
                    if !found {
                        continue;
                    }
                    let line = std::mem::take(&mut self.line);
                    let text = std::str::from_utf8(&line)
                        .map_err(|_| "bad chunk line")?
                        .trim_end_matches(['\r', '\n']);
                    self.state = match self.state {
                        ChunkState::DataEnd if text.is_empty() => ChunkState::Size,
                        ChunkState::DataEnd => return Err("missing CRLF after chunk".into()),
                        ChunkState::Trailer if text.is_empty() => ChunkState::Done,
                        ChunkState::Trailer => ChunkState::Trailer,
                        _ => {
                            let hex = text.split(';').next().unwrap_or("").trim();
                            let n = u64::from_str_radix(hex, 16)
                                .map_err(|_| format!("bad chunk size {hex:?}"))?;
                            if n == 0 {
                                ChunkState::Trailer
                            } else {
                                ChunkState::Data(n)
                            }
                        }
                    };
                }
            }
        }
        Ok(())
    }
}

/// What the SSE parser found in the bytes of one read.
#[derive(Default, Debug, PartialEq)]
struct Found {
    /// `data:` events of any kind.
    events: u32,
    /// Token events (a `"content":` delta).
    tokens: u32,
    /// `data: [DONE]` seen.
    done: bool,
}

/// Split complete SSE events (ended by a blank line) off the front of `buf`.
fn take_events(buf: &mut Vec<u8>) -> Found {
    let mut f = Found::default();
    let mut start = 0;
    while let Some(rel) = buf[start..].windows(2).position(|w| w == b"\n\n") {
        let ev = &buf[start..start + rel];
        start += rel + 2;
        for line in ev.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(payload) = line.strip_prefix(b"data:") else {
                continue;
            };
            let payload = payload.trim_ascii();
            f.events += 1;
            if payload == b"[DONE]" {
                f.done = true;
            } else if payload.windows(11).any(|w| w == b"\"content\":\"") {
                f.tokens += 1;
            }
            break;
        }
    }
    buf.drain(..start);
    f
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Shared {
    open: usize,
    max_open: usize,
    finished: usize,
    completed: usize,
    failures: BTreeMap<String, u64>,
    events: u64,
    token_events: u64,
    reads_with_tokens: u64,
    coalesced_tokens: u64,
    /// Per-bucket counts of `data:` events, and open streams at each bucket's end.
    timeline_events: Vec<u64>,
    timeline_open: Vec<usize>,
    /// Extra delay of each inter-token gap over the nominal gap (µs; may be negative).
    gap_extra_us: Vec<f64>,
    /// The same for gaps that end within the steady window.
    steady_gap_extra_us: Vec<f64>,
    /// Token events within the steady window, and those of them that came in the same read
    /// as an earlier token event of their stream.
    steady_tokens: u64,
    steady_coalesced: u64,
    /// Arrival of token i against first token + i × nominal gap (µs).
    lateness_us: Vec<f64>,
    /// From the start of connect to the first token event (µs).
    ttfe_us: Vec<f64>,
    connect_us: Vec<f64>,
    /// Per stream (with --dump-events): its index and token arrival times.
    dump: Vec<(usize, Vec<Instant>)>,
    all_open_at: Option<Instant>,
    /// When the open file was written (all open, or the open timeout).
    signalled_at: Option<Instant>,
}

struct Run {
    o: Opts,
    t0: Instant,
    t0_unix_ms: u128,
    nominal: Duration,
    st: RefCell<Shared>,
}

impl Run {
    fn bucket(&self, at: Instant) -> usize {
        (at.saturating_duration_since(self.t0).as_millis() / u128::from(self.o.bucket_ms)) as usize
    }

    fn unix_ms(&self, at: Instant) -> u128 {
        self.t0_unix_ms + at.saturating_duration_since(self.t0).as_millis()
    }

    /// Write the open file once: all streams open (or the open timeout passed).
    fn signal_open(&self, st: &mut Shared, now: Instant) {
        if st.signalled_at.is_some() {
            return;
        }
        st.signalled_at = Some(now);
        let v = json!({
            "unix_ms": self.unix_ms(now) as u64,
            "open": st.open,
            "streams": self.o.streams,
            "all_open": st.open == self.o.streams,
            "after_s": round3(now.duration_since(self.t0).as_secs_f64()),
        });
        if !self.o.quiet {
            eprintln!(
                "[sse] {:6.1}s {} of {} streams open{}",
                now.duration_since(self.t0).as_secs_f64(),
                st.open,
                self.o.streams,
                if st.open == self.o.streams {
                    ""
                } else {
                    " (open timeout; not all open)"
                }
            );
        }
        if let Some(path) = &self.o.open_file {
            if let Err(e) = std::fs::write(path, v.to_string() + "\n") {
                eprintln!("warmroute-bench sse: cannot write {path}: {e}");
            }
        }
    }
}

fn request_bytes(o: &Opts, k: usize) -> Vec<u8> {
    let body = json!({
        "model": o.model,
        "messages": [{"role": "user", "content": format!("stream {k}: tell a long story")}],
        "stream": true,
        "max_tokens": o.max_tokens,
    })
    .to_string();
    format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{}: sse-{}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
        o.path,
        o.host,
        o.header_name,
        k % o.sessions,
        body.len(),
        body
    )
    .into_bytes()
}

/// How a stream ended; `Err` carries the failure reason.
async fn stream(run: Rc<Run>, k: usize) -> Result<(), String> {
    let o = &run.o;
    let started = Instant::now();
    let conn = monoio::time::timeout(Duration::from_secs(10), TcpStream::connect(o.addr))
        .await
        .map_err(|_| "connect timeout".to_string())?
        .map_err(|e| format!("connect: {}", e.kind()))?;
    let _ = conn.set_nodelay(true);
    let mut conn = conn;
    run.st
        .borrow_mut()
        .connect_us
        .push(started.elapsed().as_secs_f64() * 1e6);
    let (r, _) = conn.write_all(request_bytes(o, k)).await;
    r.map_err(|e| format!("write: {}", e.kind()))?;

    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut head_buf: Vec<u8> = Vec::new();
    let mut framing: Option<Framing> = None;
    let mut body: Vec<u8> = Vec::new();
    let mut token_times: Vec<Instant> = Vec::with_capacity(o.max_tokens as usize);
    // Reads that carried more than one token event: (when, token events beyond the first).
    let mut coalesced: Vec<(Instant, u32)> = Vec::new();
    let mut events = 0u32;
    let mut done = false;
    let mut open = false;
    let result: Result<(), String> = loop {
        buf.clear();
        // No timer per read (it would cost a timer per event): `drive` gives up on streams
        // still running --stream-timeout-s after the last connect.
        let (res, slice) = conn.read(buf.slice_mut(0..4096)).await;
        let now = Instant::now();
        buf = slice.into_inner();
        let n = match res {
            Ok(n) => n,
            Err(e) => break Err(format!("read: {}", e.kind())),
        };
        if n == 0 {
            break match (&framing, done) {
                (Some(Framing::UntilClose), true) => Ok(()),
                (None, _) => Err("eof before response head".to_string()),
                _ => Err(format!("eof mid-stream (after {events} events)")),
            };
        }
        // Body bytes of this read: the read itself, or what followed the head.
        let mut rest = Vec::new();
        let mut after_head = false;
        if framing.is_none() {
            head_buf.extend_from_slice(&buf[..n]);
            match parse_head(&head_buf) {
                Err(e) => break Err(e),
                Ok(None) => continue,
                Ok(Some((used, status, f))) => {
                    if status != 200 {
                        break Err(format!("status {status}"));
                    }
                    framing = Some(f);
                    open = true;
                    let mut st = run.st.borrow_mut();
                    st.open += 1;
                    st.max_open = st.max_open.max(st.open);
                    if st.open == o.streams && st.all_open_at.is_none() {
                        st.all_open_at = Some(now);
                        run.signal_open(&mut st, now);
                    }
                    drop(st);
                    rest = head_buf.split_off(used);
                    head_buf = Vec::new();
                    after_head = true;
                }
            }
        }
        let data: &[u8] = if after_head { &rest } else { &buf[..n] };
        let mut body_end = false;
        match framing.as_mut() {
            Some(Framing::Chunked(c)) => {
                if let Err(e) = c.feed(data, &mut body) {
                    break Err(e);
                }
                body_end = c.done();
            }
            Some(Framing::Length(left_bytes)) => {
                let take = (data.len() as u64).min(*left_bytes) as usize;
                body.extend_from_slice(&data[..take]);
                *left_bytes -= take as u64;
                body_end = *left_bytes == 0;
            }
            Some(Framing::UntilClose) => body.extend_from_slice(data),
            None => {}
        }
        let f = take_events(&mut body);
        if f.events > 0 {
            events += f.events;
            done |= f.done;
            for _ in 0..f.tokens {
                token_times.push(now);
            }
            if f.tokens > 1 {
                coalesced.push((now, f.tokens - 1));
            }
            let mut st = run.st.borrow_mut();
            let b = run.bucket(now);
            if st.timeline_events.len() <= b {
                st.timeline_events.resize(b + 1, 0);
            }
            st.timeline_events[b] += u64::from(f.events);
            st.events += u64::from(f.events);
            st.token_events += u64::from(f.tokens);
            if f.tokens > 0 {
                st.reads_with_tokens += 1;
                st.coalesced_tokens += u64::from(f.tokens - 1);
            }
        }
        if body_end {
            break if done {
                Ok(())
            } else {
                Err("body ended without [DONE]".to_string())
            };
        }
    };
    {
        let mut st = run.st.borrow_mut();
        if open {
            st.open -= 1;
        }
        let steady = st.signalled_at.map(|t| {
            let from = t + Duration::from_secs_f64(o.steady_after_s);
            (from, from + Duration::from_secs_f64(o.steady_s))
        });
        let in_steady = |t: Instant| steady.is_some_and(|(a, b)| t >= a && t < b);
        st.steady_tokens += token_times.iter().filter(|t| in_steady(**t)).count() as u64;
        st.steady_coalesced += coalesced
            .iter()
            .filter(|(t, _)| in_steady(*t))
            .map(|(_, n)| u64::from(*n))
            .sum::<u64>();
        if let Some(&first) = token_times.first() {
            st.ttfe_us
                .push(first.duration_since(started).as_secs_f64() * 1e6);
            let nominal = run.nominal.as_secs_f64() * 1e6;
            for (i, w) in token_times.windows(2).enumerate() {
                let gap = w[1].duration_since(w[0]).as_secs_f64() * 1e6;
                st.gap_extra_us.push(gap - nominal);
                if in_steady(w[1]) {
                    st.steady_gap_extra_us.push(gap - nominal);
                }
                let due = nominal * (i + 1) as f64;
                let at = w[1].duration_since(first).as_secs_f64() * 1e6;
                st.lateness_us.push(at - due);
            }
        }
        if o.dump_events.is_some() {
            st.dump.push((k, token_times));
        }
    }
    result
}

fn pct(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    // Nearest rank; the epsilon keeps 99.9 % of 1000 at rank 999 despite float rounding.
    let i = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    Some(sorted[i.clamp(1, sorted.len()) - 1])
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Distribution of values in µs, reported in ms.
fn dist_ms(vals: &mut [f64]) -> Value {
    vals.sort_by(f64::total_cmp);
    let ms = |v: Option<f64>| v.map(|x| round3(x / 1000.0));
    let mean = if vals.is_empty() {
        None
    } else {
        Some(vals.iter().sum::<f64>() / vals.len() as f64)
    };
    json!({
        "count": vals.len(),
        "min": ms(vals.first().copied()),
        "mean": ms(mean),
        "p50": ms(pct(vals, 50.0)),
        "p90": ms(pct(vals, 90.0)),
        "p99": ms(pct(vals, 99.0)),
        "p999": ms(pct(vals, 99.9)),
        "max": ms(vals.last().copied()),
    })
}

/// utime + stime of this process in seconds (from /proc/self/stat, clock ticks of 1/100 s).
fn self_cpu_s() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

fn self_max_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

async fn drive(run: Rc<Run>) {
    let o = &run.o;
    let n = o.streams;
    // Timeline and progress.
    let ticker = {
        let run = run.clone();
        monoio::spawn(async move {
            let o = &run.o;
            let tick = Duration::from_millis(o.bucket_ms);
            let ramp_end = run.t0 + Duration::from_millis(o.ramp_ms);
            let open_timeout = ramp_end + Duration::from_millis(o.open_timeout_ms);
            let give_up = ramp_end + Duration::from_secs_f64(o.stream_timeout_s);
            let mut next = run.t0 + tick;
            let mut next_progress = run.t0 + Duration::from_secs(2);
            let mut last_events = 0u64;
            let mut last_at = run.t0;
            loop {
                monoio::time::sleep(next.saturating_duration_since(Instant::now())).await;
                let now = Instant::now();
                let mut st = run.st.borrow_mut();
                let open = st.open;
                let b = run.bucket(now);
                if st.timeline_open.len() <= b {
                    st.timeline_open.resize(b + 1, open);
                }
                st.timeline_open[b] = open;
                if now >= open_timeout {
                    run.signal_open(&mut st, now);
                }
                if now >= next_progress {
                    if !o.quiet {
                        let rate = (st.events - last_events) as f64
                            / now.duration_since(last_at).as_secs_f64();
                        eprintln!(
                            "[sse] {:6.1}s open {}/{} completed {} failed {} events {} ({:.0}/s)",
                            now.duration_since(run.t0).as_secs_f64(),
                            open,
                            n,
                            st.completed,
                            st.finished - st.completed,
                            st.events,
                            rate
                        );
                    }
                    last_events = st.events;
                    last_at = now;
                    next_progress += Duration::from_secs(5);
                }
                if st.finished == n {
                    break;
                }
                if now >= give_up {
                    // Streams still running count as failed; their tasks are dropped with
                    // the runtime.
                    let left = (n - st.finished) as u64;
                    if left > 0 {
                        *st.failures.entry("timeout".to_string()).or_insert(0) += left;
                        st.finished = n;
                    }
                    break;
                }
                drop(st);
                next += tick;
            }
        })
    };
    for k in 0..n {
        let at = run.t0 + Duration::from_millis(o.ramp_ms).mul_f64(k as f64 / n as f64);
        let wait = at.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            monoio::time::sleep(wait).await;
        }
        let run = run.clone();
        monoio::spawn(async move {
            let r = stream(run.clone(), k).await;
            let mut st = run.st.borrow_mut();
            st.finished += 1;
            match r {
                Ok(()) => st.completed += 1,
                Err(reason) => {
                    // Group reasons that carry an event count.
                    let key = match reason.find(" (after") {
                        Some(i) => reason[..i].to_string(),
                        None => match reason.find(" after ") {
                            Some(i) => reason[..i].to_string(),
                            None => reason,
                        },
                    };
                    *st.failures.entry(key).or_insert(0) += 1;
                }
            }
        });
    }
    ticker.await;
}

fn summarize(run: &Run, wall: Duration, driver_cpu_s: Option<f64>) -> Value {
    let o = &run.o;
    let mut st = run.st.borrow_mut();
    let nominal_ms = run.nominal.as_secs_f64() * 1000.0;
    let coalesced_share = if st.token_events > 0 {
        Some(round3(st.coalesced_tokens as f64 / st.token_events as f64))
    } else {
        None
    };
    let all_open_after_s = st
        .all_open_at
        .map(|t| round3(t.duration_since(run.t0).as_secs_f64()));
    let all_open_unix_ms = st.all_open_at.map(|t| run.unix_ms(t) as u64);
    let failed = st.finished - st.completed;
    json!({
        "label": o.label,
        "config": {
            "target": o.target,
            "streams": o.streams,
            "ramp_ms": o.ramp_ms,
            "max_tokens": o.max_tokens,
            "decode_tps": o.decode_tps,
            "nominal_gap_ms": round3(nominal_ms),
            "sessions": o.sessions,
            "stream_timeout_s": o.stream_timeout_s,
        },
        "started_unix_ms": run.t0_unix_ms as u64,
        "wall_s": round3(wall.as_secs_f64()),
        "streams": {
            "target": o.streams,
            "completed": st.completed,
            "failed": failed,
            "failures": st.failures,
            "max_open": st.max_open,
            "all_open": st.all_open_at.is_some(),
            "all_open_after_s": all_open_after_s,
            "all_open_unix_ms": all_open_unix_ms,
        },
        "events": {
            "total": st.events,
            "token_events": st.token_events,
            "expected_token_events": o.streams as u64 * u64::from(o.max_tokens),
            "reads_with_tokens": st.reads_with_tokens,
            "coalesced_token_events": st.coalesced_tokens,
            "coalesced_share": coalesced_share,
        },
        "gap_extra_ms": dist_ms(&mut st.gap_extra_us),
        "steady": {
            "from_unix_ms": st.signalled_at.map(|t| run.unix_ms(t + Duration::from_secs_f64(o.steady_after_s)) as u64),
            "seconds": o.steady_s,
            "token_events": st.steady_tokens,
            "coalesced_token_events": st.steady_coalesced,
            "gap_extra_ms": dist_ms(&mut st.steady_gap_extra_us),
        },
        "lateness_ms": dist_ms(&mut st.lateness_us),
        "ttfe_ms": dist_ms(&mut st.ttfe_us),
        "connect_ms": dist_ms(&mut st.connect_us),
        "timeline": {
            "start_unix_ms": run.t0_unix_ms as u64,
            "bucket_ms": o.bucket_ms,
            "events": st.timeline_events,
            "open": st.timeline_open,
        },
        "driver": {
            "cpu_s": driver_cpu_s.map(round3),
            "max_rss_kb": self_max_rss_kb(),
        },
    })
}

fn run_sse(o: Opts) -> Result<Value, String> {
    let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .with_entries(4096)
        .enable_timer()
        .build()
        .map_err(|e| format!("cannot build the runtime: {e}"))?;
    if let Some(path) = &o.open_file {
        let _ = std::fs::remove_file(path);
    }
    let cpu0 = self_cpu_s();
    let t0_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let run = Rc::new(Run {
        nominal: Duration::from_secs_f64(1.0 / o.decode_tps),
        o,
        t0: Instant::now(),
        t0_unix_ms,
        st: RefCell::new(Shared::default()),
    });
    rt.block_on(drive(run.clone()));
    let wall = run.t0.elapsed();
    if let Some(path) = &run.o.dump_events {
        let st = run.st.borrow();
        let mut text = String::new();
        for (k, times) in &st.dump {
            text.push_str(&k.to_string());
            for t in times {
                let ms = t.duration_since(run.t0).as_secs_f64() * 1000.0;
                text.push_str(&format!(" {ms:.1}"));
            }
            text.push('\n');
        }
        std::fs::write(path, text).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    let cpu = match (cpu0, self_cpu_s()) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    Ok(summarize(&run, wall, cpu))
}

/// Entry point of `warmroute-bench sse ARGS...` (ARGS without the subcommand).
pub fn main(args: &[String]) -> ExitCode {
    crate::run_cli(
        "warmroute-bench sse",
        USAGE,
        parse_args(args),
        |o: &Opts| (o.out.clone(), o.quiet),
        run_sse,
        |v| {
            let s = &v["streams"];
            let g = &v["gap_extra_ms"];
            format!(
                "  {}: {}/{} completed, {} failed {}, events {}, coalesced {}, gap extra p50/p99/p999/max {}/{}/{}/{} ms (steady window: p99 {} ms, coalesced {}), ttfe p50/p99 {}/{} ms, {:.1}s",
                v["label"].as_str().unwrap_or(""),
                s["completed"],
                s["target"],
                s["failed"],
                s["failures"],
                v["events"]["total"],
                v["events"]["coalesced_token_events"],
                g["p50"],
                g["p99"],
                g["p999"],
                g["max"],
                v["steady"]["gap_extra_ms"]["p99"],
                v["steady"]["coalesced_token_events"],
                v["ttfe_ms"]["p50"],
                v["ttfe_ms"]["p99"],
                v["wall_s"].as_f64().unwrap_or(0.0),
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse_body(tokens: u32) -> Vec<u8> {
        let mut b = Vec::new();
        for i in 0..tokens {
            b.extend_from_slice(
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\" tok{i}\"}}}}]}}\n\n")
                    .as_bytes(),
            );
        }
        b.extend_from_slice(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
        b.extend_from_slice(b"data: [DONE]\n\n");
        b
    }

    fn chunked(body: &[u8], piece: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in body.chunks(piece) {
            out.extend_from_slice(format!("{:x};ext=1\r\n", c.len()).as_bytes());
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        out
    }

    #[test]
    fn chunked_sse_split_anywhere() {
        let body = sse_body(3);
        let wire = chunked(&body, 37);
        for split in 1..wire.len() {
            let mut c = Chunked::default();
            let mut out = Vec::new();
            let mut total = Found::default();
            for part in [&wire[..split], &wire[split..]] {
                c.feed(part, &mut out).unwrap();
                let f = take_events(&mut out);
                total.events += f.events;
                total.tokens += f.tokens;
                total.done |= f.done;
            }
            assert!(c.done(), "split {split}");
            assert!(out.is_empty());
            assert_eq!(
                total,
                Found {
                    events: 5,
                    tokens: 3,
                    done: true
                }
            );
        }
    }

    #[test]
    fn heads() {
        let (used, st, f) = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nabc")
            .unwrap()
            .unwrap();
        assert_eq!((used, st), (47, 200));
        assert!(matches!(f, Framing::Chunked(_)));
        let (_, st, f) = parse_head(b"HTTP/1.1 429 Busy\r\ncontent-length: 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(st, 429);
        assert!(matches!(f, Framing::Length(5)));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\n").unwrap().is_none());
        assert!(parse_head(b"garbage\r\n\r\n").is_err());
    }

    #[test]
    fn args() {
        let a: Vec<String> = "--target http://127.0.0.1:9/bench/v1/chat/completions --streams 3"
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let o = parse_args(&a).unwrap().unwrap();
        assert_eq!(o.path, "/bench/v1/chat/completions");
        assert_eq!((o.streams, o.sessions), (3, 3));
        assert!(o.stream_timeout_s > 80.0);
        assert!(parse_args(&[]).is_err());
        let bad: Vec<String> = vec![
            "--target".into(),
            "http://127.0.0.1:9/".into(),
            "--decode-tps".into(),
            "0".into(),
        ];
        assert!(parse_args(&bad).is_err());
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(pct(&v, 50.0), Some(500.0));
        assert_eq!(pct(&v, 99.9), Some(999.0));
        assert_eq!(pct(&v, 100.0), Some(1000.0));
    }
}
