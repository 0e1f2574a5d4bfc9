//! Opt-in busy polling (`busy_poll_us` in the server file; 0, the default, is off).
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
//! so an idle router costs nothing and a busy one spends at most the window per request
//! gap. It spends CPU to buy latency: for a worker under a CPU quota, or for requests that
//! last seconds (an LLM's prefill), it buys nothing.
//!
//! How: one task per worker awaits the write-readiness of one end of a socket pair, which is
//! always writable. On io_uring that is a poll that completes as soon as the worker enters
//! the ring, so the runtime's wait returns at once, after the kernel has handed over every
//! completion already there (with `DEFER_TASKRUN`, completions are only handed over when
//! the ring is entered to wait: a task that only re-woke itself would starve every socket).
//! On the epoll fallback the same poll completes without the runtime ever waiting, and
//! monoio's timers only advance when it waits, so the option is ignored there (with a
//! warning at start).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{quota, WorkerCtx};
use crate::util::{race, Either};

/// How many turns of the ring a busy-polling worker makes between two publications of its
/// busy-poll time (the end of a window always publishes).
const PUBLISH_EVERY: u32 = 1024;

/// A worker's request activity, as the busy-poll task sees it. Cheap to kick when off.
#[derive(Default)]
pub struct Activity {
    /// The window, `Duration::ZERO` when busy polling is off or the driver cannot do it.
    window: Cell<Duration>,
    /// Requests started or finished so far (wrapping).
    count: Cell<u64>,
    /// The busy-poll task, while it waits for the next request.
    waiter: Cell<Option<Waker>>,
}

impl Activity {
    /// A request started or finished: opens (or extends) the window.
    #[inline]
    pub fn kick(&self) {
        if self.window.get().is_zero() {
            return;
        }
        self.count.set(self.count.get().wrapping_add(1));
        if let Some(w) = self.waiter.take() {
            w.wake();
        }
    }

    /// Sets the window (from the server file, at start and on every reload).
    pub fn set_window(&self, window: Duration) {
        self.window.set(window);
    }

    pub fn window(&self) -> Duration {
        self.window.get()
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
    let mut seen = activity.count.get();
    loop {
        match race(activity.after(seen), ctx.drain.wait()).await {
            Either::Left(()) => {}
            Either::Right(()) => return,
        }
        let started = Instant::now();
        let mut deadline = started + activity.window();
        seen = activity.count.get();
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
            let count = activity.count.get();
            if count != seen {
                seen = count;
                deadline = now + activity.window();
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
        a.set_window(Duration::from_micros(50));
        a.kick();
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            1,
            "on: a kick wakes the waiter"
        );
        assert!(after.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_dropped_wait_leaves_no_waker_behind() {
        let a = Activity::default();
        a.set_window(Duration::from_micros(50));
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
