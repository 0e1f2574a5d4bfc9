//! The process's stderr in the forms the workers write it: the access log's own open file,
//! and the writer of the router's log (`tracing`). Neither lets a reader that stopped
//! reading (a stuck log shipper, a paused terminal) stall a worker: a worker that logs a
//! warning while the pipe is full drops that line and counts it instead of waiting.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The process's stderr, opened for writers that must not wait on it.
///
/// - A regular file is duplicated: the access lines and the router's own log then share
///   one file offset. A reopened file would have an offset of its own, and unless the
///   shell opened it with `O_APPEND` (`>>`), the router's next log line would be written
///   over the access lines appended after it (`warmroute serve > log 2>&1`). A write to a
///   regular file does not wait on a reader, so blocking is harmless.
/// - A pipe or a terminal is reopened through `/proc/self/fd/2`, non-blocking, without
///   changing the process's own stderr (a pipe reopened this way is a new open file of the
///   same pipe), so a reader that stops reading fills the pipe instead of stalling the
///   worker.
/// - A socket (systemd's journal, some container runtimes) cannot be reopened that way, so
///   it is duplicated. It stays blocking: making it non-blocking would change stderr for
///   the rest of the process too.
pub(crate) fn open_stderr() -> Option<File> {
    if let Ok(f) = dup_stderr() {
        if f.metadata().is_ok_and(|m| m.is_file()) {
            return Some(f);
        }
    }
    std::fs::OpenOptions::new()
        .append(true)
        // O_NOCTTY: a session leader without a controlling terminal must not get stderr's
        // terminal as one (its ^C would then drain the router).
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open("/proc/self/fd/2")
        .or_else(|_| dup_stderr())
        .ok()
}

pub(crate) fn dup_stderr() -> io::Result<File> {
    Ok(File::from(io::stderr().as_fd().try_clone_to_owned()?))
}

/// Lines of the router's log dropped because stderr was full.
static LOG_LINES_DROPPED: AtomicU64 = AtomicU64::new(0);

/// How many lines of the router's log were dropped on a full stderr (process-wide).
pub fn log_lines_dropped() -> u64 {
    LOG_LINES_DROPPED.load(Relaxed)
}

/// The router log's writer (`tracing_subscriber::fmt().with_writer(...)`): stderr opened by
/// [`open_stderr`], so on a full pipe a line is dropped and counted, never waited for.
pub struct LogStderr {
    out: Option<File>,
}

impl LogStderr {
    pub fn open() -> LogStderr {
        LogStderr { out: open_stderr() }
    }

    #[cfg(test)]
    fn to(out: File) -> LogStderr {
        LogStderr { out: Some(out) }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogStderr {
    type Writer = LogLine<'a>;

    fn make_writer(&'a self) -> LogLine<'a> {
        LogLine(self.out.as_ref())
    }
}

/// One log line on its way out: the formatter hands it over whole, in one `write_all`.
pub struct LogLine<'a>(Option<&'a File>);

impl Write for LogLine<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    /// A line of up to `PIPE_BUF` (4 KiB) goes into a pipe whole or not at all. A longer one
    /// (a backtrace under `RUST_BACKTRACE=1`) can be cut where the pipe filled, and the next
    /// line then continues it: the partial write filled the pipe, so not even a newline
    /// would fit to end it.
    ///
    /// A line that cannot be written for any other reason (the reader of the pipe went
    /// away: `EPIPE`) is dropped and counted too. An error would reach the formatter, which
    /// reports it with `eprintln!`, and that panics on a broken stderr: the router aborted
    /// when whoever read its log went away.
    fn write_all(&mut self, mut buf: &[u8]) -> io::Result<()> {
        let Some(mut f) = self.0 else {
            if io::stderr().write_all(buf).is_err() {
                LOG_LINES_DROPPED.fetch_add(1, Relaxed);
            }
            return Ok(());
        };
        while !buf.is_empty() {
            match f.write(buf) {
                Ok(n) if n > 0 => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => {
                    LOG_LINES_DROPPED.fetch_add(1, Relaxed);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use tracing_subscriber::fmt::MakeWriter;

    #[test]
    fn a_full_pipe_drops_and_counts_the_line_instead_of_waiting() {
        let (mut reader, writer) = std::io::pipe().unwrap();
        // Non-blocking, as `open_stderr` reopens a pipe.
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&writer));
        let out = std::fs::OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .unwrap();
        let log = LogStderr::to(out);
        let line = [b'x'; 999];
        let before = log_lines_dropped();
        // The control: lines go through while the pipe has room.
        log.make_writer().write_all(b"first\n").unwrap();
        let mut got = [0u8; 6];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"first\n");
        assert_eq!(log_lines_dropped(), before);
        // Nobody reads: the pipe fills, and every further line returns at once, counted.
        let t0 = std::time::Instant::now();
        for _ in 0..200 {
            log.make_writer().write_all(&line).unwrap();
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        let dropped = log_lines_dropped() - before;
        // 64 KiB of pipe holds 65 of them; the rest were dropped (other tests in this
        // process do not log through this writer).
        assert!((100..=200).contains(&dropped), "{dropped}");
        drop(log);
        drop(writer);
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert_eq!(rest.len() as u64, (200 - dropped) * 999, "only whole lines");
    }
}
