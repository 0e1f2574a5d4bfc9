//! Keeping a CPU quota's books current on a busy worker.
//!
//! Under a CPU quota (a cgroup's `cpu.max`, `docker --cpus`, a Kubernetes CPU limit) the
//! kernel charges a thread's run time when the thread blocks, and otherwise only at the next
//! timer tick (every 4 ms at `HZ=250`). A busy worker rarely blocks: its io_uring wait
//! usually finds completions already there. So it overruns the quota by up to a tick, and
//! the overrun is taken from the next period as a longer stall, which every request in
//! flight waits out. Reading the thread's own CPU clock makes the kernel bring the charge up
//! to date (`warmroute_shm::thread_cpu_time_ns`), so the quota stops the worker within
//! [`SETTLE_EVERY`] of running out and the stalls stay as long as the quota says.
//!
//! Measured with `bench/run ab` (a 50% quota, wrk `-c32`, 8 rounds): p99 7.1 → 5.5 ms, req/s
//! unchanged (B/A 0.998); the stalls went from 2–8 ms to a steady 5 ms (`bench/RESULTS.md`).
//! Without a quota the read is a cheap system call, at most once per [`SETTLE_EVERY`] of
//! busy time (nothing when idle: it is only made from request and stream paths).
//!
//! The time read is published as the worker's `warmroute_worker_cpu_seconds_total`.

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Shared;

/// The most time that passes between two charges while a worker is busy.
pub const SETTLE_EVERY: Duration = Duration::from_micros(250);

thread_local! {
    /// When this thread last had its CPU time charged.
    static SETTLED_AT: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Where this thread publishes the CPU time it reads: its worker's
    /// [`WorkerCells::cpu_ns`](super::WorkerCells::cpu_ns).
    static PUBLISH: RefCell<Option<(Arc<Shared>, usize)>> = const { RefCell::new(None) };
}

/// Publish this thread's CPU time, at each settle, as worker `idx`'s.
pub fn publish_to(shared: Arc<Shared>, idx: usize) {
    let _ = PUBLISH.try_with(|p| *p.borrow_mut() = Some((shared, idx)));
}

/// Has the kernel charge this thread's CPU time now if it was last done [`SETTLE_EVERY`] or
/// more before `now` (a time the caller has already read: no clock read otherwise).
pub fn settle(now: Instant) {
    settle_with(now, || {
        let Some(ns) = warmroute_shm::thread_cpu_time_ns() else {
            return;
        };
        let _ = PUBLISH.try_with(|p| {
            if let Ok(p) = p.try_borrow() {
                if let Some(w) = p.as_ref().and_then(|(shared, i)| shared.per_worker.get(*i)) {
                    w.cpu_ns.store(ns, Relaxed);
                }
            }
        });
    });
}

/// [`settle`] with the charge done by `charge`.
fn settle_with(now: Instant, charge: impl FnOnce()) {
    let due = SETTLED_AT
        .try_with(|at| match at.get() {
            Some(t) if now.saturating_duration_since(t) < SETTLE_EVERY => false,
            _ => {
                at.set(Some(now));
                true
            }
        })
        .unwrap_or(false);
    if due {
        charge();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_at_most_once_per_interval() {
        let n = Cell::new(0);
        let count = || n.set(n.get() + 1);
        let t0 = Instant::now();
        settle_with(t0, count);
        assert_eq!(n.get(), 1, "control: the first call charges");
        // Within the interval (and a time before the last charge): nothing.
        settle_with(t0 + SETTLE_EVERY / 2, count);
        settle_with(t0, count);
        assert_eq!(n.get(), 1);
        // An interval on: charged again, and the interval counts from there.
        settle_with(t0 + SETTLE_EVERY, count);
        assert_eq!(n.get(), 2);
        settle_with(t0 + SETTLE_EVERY * 3 / 2, count);
        assert_eq!(n.get(), 2);
        settle_with(t0 + SETTLE_EVERY * 2, count);
        assert_eq!(n.get(), 3);
    }
}
