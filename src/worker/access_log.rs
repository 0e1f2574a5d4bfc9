//! The per-worker access log: one JSON object per line, encoded straight into the worker's
//! buffer (no intermediate map, no per-field allocation), flushed by the worker tick or when
//! the buffer fills.

use std::fs::File;
use std::io::{self, Write};
use std::time::{Duration, Instant};

use super::stderr::open_stderr;
use super::AccessLogTarget;
use crate::http::push_decimal;

/// Per-worker buffered access log, written in whole lines so lines of different workers
/// never mix.
pub struct AccessLog {
    out: Option<File>,
    /// The last flush left lines behind (a full pipe): until the next tick's flush, a full
    /// buffer does not try again on every request.
    stalled: bool,
    /// The largest write that keeps lines whole next to other workers' writes: any size for
    /// a regular file (appends are atomic), `PIPE_BUF` for a pipe, a socket or a terminal.
    write_max: usize,
    buf: Vec<u8>,
    dropped: u64,
}

/// Flush when the buffer holds this much.
const ACCESS_LOG_FLUSH_BYTES: usize = 32 * 1024;
/// Never hold more than this; lines beyond it are dropped and counted (a stuck stderr must
/// not grow memory).
const ACCESS_LOG_BUF_MAX: usize = 1024 * 1024;
/// Writes of at most this many bytes to a pipe are atomic (POSIX `PIPE_BUF` on Linux).
const PIPE_BUF: usize = 4096;

impl AccessLog {
    pub(super) fn open(target: &AccessLogTarget) -> AccessLog {
        let out = match target {
            AccessLogTarget::Off => None,
            AccessLogTarget::Stderr => open_stderr(),
            AccessLogTarget::File(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok(),
        };
        AccessLog::to(out)
    }

    fn to(out: Option<File>) -> AccessLog {
        AccessLog {
            write_max: write_max(out.as_ref()),
            out,
            stalled: false,
            buf: Vec::new(),
            dropped: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.out.is_some()
    }

    /// Append one line: `fill` writes the fields, in order, through a [`Line`].
    pub fn line(&mut self, fill: impl FnOnce(&mut Line<'_>)) {
        if self.out.is_none() {
            return;
        }
        if self.buf.len() > ACCESS_LOG_BUF_MAX {
            self.dropped += 1;
            return;
        }
        self.buf.push(b'{');
        let mut line = Line {
            buf: &mut self.buf,
            first: true,
        };
        fill(&mut line);
        self.buf.extend_from_slice(b"}\n");
        if self.buf.len() >= ACCESS_LOG_FLUSH_BYTES && !self.stalled {
            self.flush();
        }
    }

    /// Write what the buffer holds, in whole lines. A full pipe (stderr is non-blocking) or
    /// a failed output keeps the rest for the next flush; the worker never waits for the
    /// reader. The worker's tick calls it.
    pub fn flush(&mut self) {
        let Some(f) = self.out.as_mut() else {
            return;
        };
        let mut done = 0;
        while done < self.buf.len() {
            let end = done + whole_lines(&self.buf[done..], self.write_max);
            match f.write(&self.buf[done..end]) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The reader of the pipe went away for good: the lines held are dropped
                // and counted, and no later line is made (it was written again on every
                // tick, thousands of times a minute).
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                    let held = self.buf[done..].iter().filter(|&&b| b == b'\n').count();
                    self.dropped += held as u64;
                    self.buf.clear();
                    self.out = None;
                    self.stalled = false;
                    return;
                }
                Err(_) => break,
            }
        }
        self.buf.drain(..done);
        self.stalled = !self.buf.is_empty();
    }

    /// After a log rotation moved the file away: write what is held to the old file and
    /// go on in a new file at the path. Only a file target reopens (a rotated stderr is
    /// the business of whoever redirected it); when the path cannot be opened, the old file
    /// stays.
    pub fn reopen(&mut self, target: &AccessLogTarget) {
        let AccessLogTarget::File(path) = target else {
            return;
        };
        self.flush();
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            Ok(f) => {
                self.write_max = write_max(Some(&f));
                self.out = Some(f);
            }
            Err(e) => tracing::warn!(
                path = %path.display(),
                error = %e,
                "cannot reopen the access log; writing on to the old file"
            ),
        }
    }

    /// At exit: flush, and while a full pipe holds lines back, try again for up to `limit`.
    pub fn finish(&mut self, limit: Duration) {
        let t0 = Instant::now();
        self.flush();
        while !self.buf.is_empty() && self.out.is_some() && t0.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
            self.flush();
        }
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// The largest write that keeps lines whole next to other workers' writes: any size for a
/// regular file (appends are atomic), `PIPE_BUF` for anything else.
fn write_max(out: Option<&File>) -> usize {
    let regular = out
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| m.file_type().is_file());
    if regular {
        usize::MAX
    } else {
        PIPE_BUF
    }
}

/// How much of `buf` (whole lines) one write takes: everything when it fits `max`, else the
/// lines that fit, else the first line alone (a line longer than `max` may then mix with
/// another worker's, which only a path of kilobytes makes).
fn whole_lines(buf: &[u8], max: usize) -> usize {
    if buf.len() <= max {
        return buf.len();
    }
    match buf[..max].iter().rposition(|&c| c == b'\n') {
        Some(i) => i + 1,
        None => buf
            .iter()
            .position(|&c| c == b'\n')
            .map_or(buf.len(), |i| i + 1),
    }
}

/// One access-log line being written: a JSON object's members, in the order they are added.
pub struct Line<'a> {
    buf: &'a mut Vec<u8>,
    first: bool,
}

impl Line<'_> {
    #[inline]
    fn key(&mut self, k: &str) {
        if !self.first {
            self.buf.push(b',');
        }
        self.first = false;
        self.buf.push(b'"');
        self.buf.extend_from_slice(k.as_bytes());
        self.buf.extend_from_slice(b"\":");
    }

    #[inline]
    pub fn str(&mut self, k: &str, v: &str) {
        self.key(k);
        json_string(self.buf, v);
    }

    #[inline]
    pub fn opt_str(&mut self, k: &str, v: Option<&str>) {
        match v {
            Some(v) => self.str(k, v),
            None => self.null(k),
        }
    }

    #[inline]
    pub fn u64(&mut self, k: &str, v: u64) {
        self.key(k);
        push_decimal(self.buf, v);
    }

    #[inline]
    pub fn opt_u64(&mut self, k: &str, v: Option<u64>) {
        match v {
            Some(v) => self.u64(k, v),
            None => self.null(k),
        }
    }

    /// A fixed-point number with three decimals: `thousandths` / 1000 (milliseconds from
    /// microseconds, seconds from milliseconds).
    #[inline]
    pub fn thousandths(&mut self, k: &str, thousandths: u64) {
        self.key(k);
        push_decimal(self.buf, thousandths / 1000);
        let frac = thousandths % 1000;
        self.buf.extend_from_slice(&[
            b'.',
            b'0' + (frac / 100) as u8,
            b'0' + (frac / 10 % 10) as u8,
            b'0' + (frac % 10) as u8,
        ]);
    }

    #[inline]
    pub fn opt_thousandths(&mut self, k: &str, v: Option<u64>) {
        match v {
            Some(v) => self.thousandths(k, v),
            None => self.null(k),
        }
    }

    #[inline]
    fn null(&mut self, k: &str) {
        self.key(k);
        self.buf.extend_from_slice(b"null");
    }
}

/// `s` as a JSON string: quotes, backslashes and control bytes escaped; everything else
/// (valid UTF-8 included) copied as it is.
fn json_string(buf: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let b = s.as_bytes();
    buf.reserve(b.len() + 2);
    buf.push(b'"');
    let mut from = 0;
    for (i, &c) in b.iter().enumerate() {
        let esc: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(c >> 4) as usize],
                HEX[(c & 0xf) as usize],
            ],
            _ => continue,
        };
        buf.extend_from_slice(&b[from..i]);
        buf.extend_from_slice(esc);
        from = i + 1;
    }
    buf.extend_from_slice(&b[from..]);
    buf.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::stderr::dup_stderr;
    use serde_json::{json, Value};
    use std::os::unix::fs::OpenOptionsExt;

    fn log_to_buffer() -> AccessLog {
        // A real output that is never flushed to: the tests read the buffer.
        AccessLog::to(Some(dup_stderr().unwrap()))
    }

    #[test]
    fn a_line_is_one_json_object_with_the_fields_in_order() {
        let mut log = log_to_buffer();
        log.line(|l| {
            l.thousandths("ts", 1_764_756_000_007);
            l.str("route", "chat");
            l.u64("status", 200);
            l.opt_str("peer", None);
            l.opt_u64("cached_tokens", Some(0));
            l.opt_u64("prompt_tokens", None);
            l.opt_thousandths("ttft_ms", Some(12_345));
            l.opt_thousandths("none_ms", None);
            l.thousandths("total_ms", 999);
            l.u64("max", u64::MAX);
        });
        let text = std::str::from_utf8(&log.buf).unwrap();
        assert!(text.ends_with("}\n") && text.matches('\n').count() == 1);
        assert!(
            text.starts_with(r#"{"ts":1764756000.007,"route":"chat","status":200,"peer":null"#),
            "{text}"
        );
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(
            v,
            json!({
                "ts": 1764756000.007, "route": "chat", "status": 200, "peer": null,
                "cached_tokens": 0, "prompt_tokens": null, "ttft_ms": 12.345,
                "none_ms": null, "total_ms": 0.999, "max": u64::MAX,
            })
        );
    }

    #[test]
    fn strings_round_trip_through_a_json_parser_whatever_they_hold() {
        let nasty = [
            "",
            "plain",
            "a\"quote",
            "back\\slash\\",
            "new\nline\r\ttab",
            "\u{0}\u{1}\u{1f}\u{7f}",
            "/path?q=\"x\"&y=\\u0041",
            "ünïcödé ✓ 🚀",
            "\"",
        ];
        let mut log = log_to_buffer();
        for s in nasty {
            log.line(|l| l.str("s", s));
        }
        let text = std::str::from_utf8(&log.buf).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), nasty.len(), "no string broke its line");
        for (line, s) in lines.iter().zip(nasty) {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(v["s"], s);
        }
    }

    /// The write end of a pipe opened anew, non-blocking, like the reopened stderr.
    fn non_blocking(writer: &std::io::PipeWriter) -> File {
        use std::os::fd::AsRawFd;
        std::fs::OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(format!("/proc/self/fd/{}", writer.as_raw_fd()))
            .unwrap()
    }

    #[test]
    fn at_exit_the_held_lines_go_out_once_the_reader_is_back() {
        use std::io::Read;
        let (mut reader, writer) = std::io::pipe().unwrap();
        let mut log = AccessLog::to(Some(non_blocking(&writer)));
        for n in 0..2000 {
            log.line(|l| l.str("pad", &format!("{n:0>100}")));
        }
        log.flush();
        let held = log.buf.len();
        assert!(held > 0, "the pipe is full and the buffer holds the rest");
        drop(writer);
        let reading = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let mut all = Vec::new();
            reader.read_to_end(&mut all).unwrap();
            all
        });
        log.finish(Duration::from_secs(5));
        assert!(
            log.buf.is_empty(),
            "{} of {held} bytes still held",
            log.buf.len()
        );
        drop(log);
        let all = reading.join().unwrap();
        assert_eq!(all.iter().filter(|&&c| c == b'\n').count(), 2000);
    }

    #[test]
    fn writes_end_on_a_line_end_and_fit_the_limit_when_a_line_does() {
        let b = b"aaa\nbbb\nccc\n";
        assert_eq!(whole_lines(b, 100), b.len());
        assert_eq!(whole_lines(b, 9), 8);
        assert_eq!(whole_lines(b, 4), 4);
        // A line longer than the limit goes whole, alone.
        assert_eq!(whole_lines(b"aaaaaaaa\nb\n", 4), 9);
        assert_eq!(whole_lines(b"aaaaaaaa", 4), 8);
    }

    #[test]
    fn a_pipe_nobody_reads_keeps_lines_in_the_buffer_and_never_blocks_the_flush() {
        use std::io::Read;
        let (mut reader, writer) = std::io::pipe().unwrap();
        let mut log = AccessLog::to(Some(non_blocking(&writer)));
        assert_eq!(log.write_max, PIPE_BUF);
        // Far more than the pipe holds (64 KiB by default); flushed on a thread, so a flush
        // that waited for the reader fails the test instead of hanging it.
        const LINES: u64 = 3000;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for n in 0..LINES {
                log.line(|l| {
                    l.u64("n", n);
                    l.str("pad", &"x".repeat(100));
                });
            }
            log.flush();
            tx.send(log).unwrap();
        });
        let mut log = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the flush returned although nobody reads the pipe");
        assert!(!log.buf.is_empty(), "what the pipe did not take is kept");
        assert_eq!(log.dropped(), 0);
        // Stalled, a full buffer does not retry on every line: with the pipe drained, a new
        // line writes nothing until the tick's flush.
        let mut got = Vec::new();
        let mut chunk = vec![0; 1 << 16];
        let mut nb_reader = {
            use std::os::fd::AsRawFd;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(format!("/proc/self/fd/{}", reader.as_raw_fd()))
                .unwrap()
        };
        while let Ok(n @ 1..) = nb_reader.read(&mut chunk) {
            got.extend_from_slice(&chunk[..n]);
        }
        log.line(|l| {
            l.u64("n", LINES);
            l.str("pad", "");
        });
        let mut probe = [0u8; 1];
        assert!(
            nb_reader.read(&mut probe).is_err(),
            "a line written while stalled went out before the tick's flush"
        );
        // The reader catches up: every line arrives once, whole and in order.
        while !log.buf.is_empty() {
            log.flush();
            while let Ok(n @ 1..) = nb_reader.read(&mut chunk) {
                got.extend_from_slice(&chunk[..n]);
            }
        }
        drop(log);
        drop(writer);
        reader.read_to_end(&mut got).unwrap();
        let text = String::from_utf8(got).unwrap();
        let ns: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["n"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(ns, (0..=LINES).collect::<Vec<_>>());
    }

    /// A pipe whose reader went away: the held lines are dropped and counted at once, and
    /// the log stops making lines, instead of writing them again on every tick. The
    /// control: with the reader there, the same lines are written.
    #[test]
    fn a_pipe_whose_reader_left_drops_the_lines_once_and_stops() {
        use std::io::Read;
        let (mut reader, writer) = std::io::pipe().unwrap();
        let mut log = AccessLog::to(Some(non_blocking(&writer)));
        log.line(|l| l.u64("n", 1));
        log.flush();
        let mut got = [0u8; 8];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"{\"n\":1}\n");
        drop(reader);
        log.line(|l| l.u64("n", 2));
        log.line(|l| l.u64("n", 3));
        log.flush();
        assert_eq!(log.dropped(), 2);
        assert!(log.buf.is_empty() && !log.enabled());
        log.line(|l| l.u64("n", 4));
        assert!(log.buf.is_empty());
    }

    #[test]
    fn a_full_buffer_drops_and_counts_lines_instead_of_growing() {
        let mut log = log_to_buffer();
        log.buf = vec![b'x'; ACCESS_LOG_BUF_MAX + 1];
        log.line(|l| l.u64("n", 1));
        log.line(|l| l.u64("n", 2));
        assert_eq!(log.dropped(), 2);
        assert_eq!(log.buf.len(), ACCESS_LOG_BUF_MAX + 1);
        // The control: below the limit a line is kept.
        log.buf.clear();
        log.line(|l| l.u64("n", 3));
        assert_eq!(log.buf, b"{\"n\":3}\n");
    }
}
