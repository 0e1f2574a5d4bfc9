//! Busy polling (`busy_poll_us` in the server file: `"auto"`, the default, a fixed window in
//! microseconds, or 0 for off).
//!
//! An idle worker waits in the kernel, and its core halts. The next packet for it then pays
//! for waking the thread on another core, and on a virtual machine for waking the halted
//! virtual CPU as well: `bench/run latency` measured ~130 µs of the ~150 µs that one
//! unloaded request through a proxy adds on this project's 2-core VM, for nginx and haproxy
//! as much as for warmroute. haproxy's `busy-polling` answers the same cost.
//!
//! With a window set, each request a worker starts or finishes opens a window of that many
//! microseconds in which the worker does not wait: it keeps entering its ring without
//! blocking, so the backend's answer and the client's next request find a running thread.
//! Once a window passes with no request started or finished, the worker waits as usual,
//! so an idle router costs nothing. A fixed window spends CPU whether or not it pays: on a
//! core shared with other busy processes it takes their time (the bench's shared placement
//! lost a third of its req/s with `busy_poll_us = 200`), under a CPU quota it spends the
//! quota, and for requests that last seconds (an LLM's prefill) it buys nothing.
//!
//! `"auto"` polls only while it pays, the way KVM's halt polling sizes its window:
//! - The window starts at zero. When the next request start or finish comes within
//!   [`BusyPoll::AUTO_MAX_US`] of the last, but after the window ended, the window doubles
//!   (from [`AUTO_FIRST`]) up to that maximum. When it comes later, the window goes back to
//!   zero. A ping-pong of short requests polls; a stream of LLM requests seconds apart
//!   does not.
//! - Each turn of the poll yields the core ([`std::thread::yield_now`]). If the yield took
//!   more than [`CONTENDED`], another task wanted the core (or the worker was throttled or
//!   descheduled): polling stops, and stays off for [`COOL_DOWN`].
//! - Under a CPU quota smaller than the worker count, `"auto"` does not poll at all
//!   ([`super::quota::room_to_poll`]).
//!
//! How: one task per worker awaits the write-readiness of one end of a socket pair, which is
//! always writable. On io_uring that is a poll that completes as soon as the worker enters
//! the ring, so the runtime's wait returns at once, after the kernel has handed over every
//! completion already there (with `DEFER_TASKRUN`, completions are only handed over when
//! the ring is entered to wait: a task that only re-woke itself would starve every socket).
//! On the epoll fallback the same poll completes without the runtime ever waiting, and
//! monoio's timers only advance when it waits, so busy polling is off there (a fixed window
//! is ignored with a warning at start).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{quota, WorkerCtx};
use crate::config::BusyPoll;
use crate::util::{race, Either};

/// How many turns of the ring a busy-polling worker makes between two publications of its
/// busy-poll time (the end of a window always publishes).
const PUBLISH_EVERY: u32 = 1024;

/// The longest window `"auto"` grows to.
const AUTO_MAX: Duration = Duration::from_micros(BusyPoll::AUTO_MAX_US);
/// The window `"auto"` starts growing from.
const AUTO_FIRST: Duration = Duration::from_micros(10);
/// A turn's yield that takes longer than this gave the core to someone else.
const CONTENDED: Duration = Duration::from_micros(50);
/// How long `"auto"` stays off after its core was contended.
const COOL_DOWN: Duration = Duration::from_millis(100);

/// What a worker's busy-poll task does, from the server file and the worker's driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Never polls (the option off, the epoll fallback, or `"auto"` under a CPU quota).
    #[default]
    Off,
    /// Polls for this long after each request start or finish.
    Window(Duration),
    /// Polls while it pays (see the module comment).
    Auto,
}

/// A worker's request activity, as the busy-poll task sees it. Cheap to kick when off.
#[derive(Default)]
pub struct Activity {
    mode: Cell<Mode>,
    /// Requests started or finished so far (wrapping).
    count: Cell<u64>,
    /// The busy-poll task, while it waits for the next request.
    waiter: Cell<Option<Waker>>,
}

impl Activity {
    /// A request started or finished: opens (or extends) the window.
    #[inline]
    pub fn kick(&self) {
        if self.mode.get() == Mode::Off {
            return;
        }
        self.count.set(self.count.get().wrapping_add(1));
        if let Some(w) = self.waiter.take() {
            w.wake();
        }
    }

    /// Sets the mode (from the server file, at start and on every reload).
    pub fn set_mode(&self, mode: Mode) {
        self.mode.set(mode);
    }

    pub fn mode(&self) -> Mode {
        self.mode.get()
    }

    /// Completes when a request starts or finishes after the count was `seen`.
    fn after(&self, seen: u64) -> After<'_> {
        After { a: self, seen }
    }
}

struct After<'a> {
    a: &'a Activity,
    seen: u64,
}

impl Future for After<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.a.count.get() != self.seen {
            return Poll::Ready(());
        }
        self.a.waiter.set(Some(cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for After<'_> {
    fn drop(&mut self) {
        self.a.waiter.set(None);
    }
}

/// `"auto"`'s window, sized from the gaps between request starts and finishes.
#[derive(Debug, Default)]
struct Adapt {
    window: Duration,
    /// The last request start or finish the task saw.
    last: Option<Instant>,
    /// No polling before this, after the core was contended.
    cool_until: Option<Instant>,
}

impl Adapt {
    /// A request started or finished at `now` while the worker waited: the window to poll
    /// for now (zero: wait again).
    fn woken(&mut self, now: Instant) -> Duration {
        let gap = self.last.map(|t| now.saturating_duration_since(t));
        self.last = Some(now);
        if self.cool_until.is_some_and(|t| now < t) {
            return Duration::ZERO;
        }
        self.cool_until = None;
        self.window = match gap {
            // The window ended before this came, and a longer one would have caught it.
            Some(g) if g <= AUTO_MAX => (self.window * 2).clamp(AUTO_FIRST, AUTO_MAX),
            // Too long a gap (or the first request): polling would not have paid.
            _ => Duration::ZERO,
        };
        self.window
    }

    /// A request started or finished at `now` while the worker polled.
    fn seen(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// Another task wanted the core at `now`: stop, and stay off for [`COOL_DOWN`].
    fn contended(&mut self, now: Instant) {
        self.window = Duration::ZERO;
        self.cool_until = Some(now + COOL_DOWN);
    }
}

/// The worker's busy-poll task: spawned on io_uring workers only (see the module comment);
/// ends when the worker drains.
pub async fn run(ctx: Rc<WorkerCtx>) {
    let probe = match always_writable() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(worker = ctx.index, error = %e, "busy polling unavailable: no socket pair");
            return;
        }
    };
    let activity = &ctx.busy_poll;
    let cells = &ctx.shared.per_worker[ctx.index];
    let mut adapt = Adapt::default();
    let mut seen = activity.count.get();
    loop {
        match race(activity.after(seen), ctx.drain.wait()).await {
            Either::Left(()) => {}
            Either::Right(()) => return,
        }
        seen = activity.count.get();
        let started = Instant::now();
        let mode = activity.mode();
        let window = match mode {
            Mode::Off => continue,
            Mode::Window(w) => w,
            Mode::Auto => adapt.woken(started),
        };
        if window.is_zero() {
            continue;
        }
        let mut deadline = started + window;
        let mut turns = 0u32;
        let mut now = started;
        let mut published = started;
        while now < deadline && !ctx.drain.is_fired() {
            // Completes as soon as the runtime next enters the ring, which it then does
            // without waiting; the completions that entry hands over wake their tasks in the
            // same turn of the runtime.
            if let Err(e) = probe.end.writable(false).await {
                tracing::warn!(worker = ctx.index, error = %e, "busy polling stopped: the poll failed");
                publish(cells, now - published);
                return;
            }
            now = Instant::now();
            // A spinning worker never blocks, so its CPU quota is charged only at the next
            // timer tick unless it reads its own clock.
            quota::settle(now);
            if mode == Mode::Auto {
                std::thread::yield_now();
                let after = Instant::now();
                if after - now > CONTENDED {
                    // The time the core was someone else's is not counted as polling.
                    adapt.contended(after);
                    break;
                }
                now = after;
            }
            let count = activity.count.get();
            if count != seen {
                seen = count;
                deadline = now + window;
                adapt.seen(now);
            }
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(PUBLISH_EVERY) {
                publish(cells, now - published);
                published = now;
            }
        }
        publish(cells, now - published);
    }
}

fn publish(cells: &super::WorkerCells, spent: Duration) {
    cells
        .busy_poll_ns
        .fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
}

/// One end of a connected socket pair, with its peer kept open (nothing is ever written,
/// so the end stays writable).
struct Probe {
    end: monoio::net::UnixStream,
    _peer: std::os::unix::net::UnixStream,
}

fn always_writable() -> std::io::Result<Probe> {
    let (end, peer) = std::os::unix::net::UnixStream::pair()?;
    end.set_nonblocking(true)?;
    Ok(Probe {
        end: monoio::net::UnixStream::from_std(end)?,
        _peer: peer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Wake;

    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_kick_wakes_the_waiting_task_only_when_a_window_is_set() {
        let count = Arc::new(Count(Default::default()));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let a = Activity::default();
        let mut after = std::pin::pin!(a.after(0));
        assert!(after.as_mut().poll(&mut cx).is_pending());
        a.kick();
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            0,
            "off: a kick wakes nobody"
        );
        assert!(after.as_mut().poll(&mut cx).is_pending());
        a.set_mode(Mode::Window(Duration::from_micros(50)));
        a.kick();
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            1,
            "on: a kick wakes the waiter"
        );
        assert!(after.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn auto_grows_its_window_on_short_gaps_and_drops_it_on_long_ones_or_contention() {
        let us = Duration::from_micros;
        let t0 = Instant::now();
        let mut a = Adapt::default();
        // The first request after start: nothing to go by.
        assert_eq!(a.woken(t0), Duration::ZERO);
        // Gaps of 150 µs, each one past the window that was open: it doubles up to the cap.
        let mut t = t0;
        let mut got = Vec::new();
        for _ in 0..6 {
            t += us(150);
            got.push(a.woken(t).as_micros());
        }
        assert_eq!(got, [10, 20, 40, 80, 160, 200]);
        // Activity seen while polling counts as the last one: a gap measured from it.
        a.seen(t + us(100));
        assert_eq!(a.woken(t + us(250)), AUTO_MAX, "150 µs after the last seen");
        // A gap longer than the cap: polling would not have paid, the window closes.
        t += us(250) + us(5_000);
        assert_eq!(a.woken(t), Duration::ZERO);
        t += us(50);
        assert_eq!(a.woken(t), AUTO_FIRST, "and grows again from the start");
        // Contention: nothing for the cool-down, however short the gaps, then it regrows.
        a.contended(t);
        for _ in 0..10 {
            t += us(50);
            assert_eq!(a.woken(t), Duration::ZERO);
        }
        t = t + COOL_DOWN + us(1);
        assert_eq!(
            a.woken(t),
            Duration::ZERO,
            "the gap since the last wake was long"
        );
        t += us(50);
        assert_eq!(a.woken(t), AUTO_FIRST);
    }

    #[test]
    fn a_dropped_wait_leaves_no_waker_behind() {
        let a = Activity::default();
        a.set_mode(Mode::Auto);
        let count = Arc::new(Count(Default::default()));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        {
            let mut after = std::pin::pin!(a.after(a.count.get()));
            assert!(after.as_mut().poll(&mut cx).is_pending());
        }
        a.kick();
        assert_eq!(count.0.load(Ordering::Relaxed), 0);
    }
}
