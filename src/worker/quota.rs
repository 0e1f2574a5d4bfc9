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
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
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

/// Whether `workers` workers can busy poll without spending a CPU quota they share: true
/// unless the process's cgroups limit it to fewer cores than that. The quota is read once
/// per process (and logged when it turns `busy_poll_us = "auto"` off).
pub fn room_to_poll(workers: usize) -> bool {
    static LIMIT: OnceLock<Option<f64>> = OnceLock::new();
    let limit = *LIMIT.get_or_init(|| {
        let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        cpu_limit(Path::new("/sys/fs/cgroup"), &cgroup)
    });
    match limit {
        Some(cores) if cores < workers as f64 => {
            static LOGGED: OnceLock<()> = OnceLock::new();
            LOGGED.get_or_init(|| {
                tracing::info!(
                    quota_cores = cores,
                    workers,
                    "busy polling (\"auto\") is off: the CPU quota is smaller than the worker count"
                );
            });
            false
        }
        _ => true,
    }
}

/// The tightest CPU quota, in cores, on the cgroups that `/proc/self/cgroup` (`cgroup`)
/// names under the cgroup mount `root`, and on their ancestors: `cpu.max` (v2), or
/// `cpu.cfs_quota_us` / `cpu.cfs_period_us` (v1). `None`: no quota. A container that sees
/// its own cgroup as its mount's root finds the limit there (the named path, from the host's
/// view, does not exist inside it).
fn cpu_limit(root: &Path, cgroup: &str) -> Option<f64> {
    let mut tightest: Option<f64> = None;
    for line in cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        let found = if controllers.is_empty() {
            cgroup_dirs(root, path)
                .filter_map(|d| v2_limit(&d))
                .reduce(f64::min)
        } else if controllers.split(',').any(|c| c == "cpu") {
            [root.join(controllers), root.join("cpu")]
                .iter()
                .flat_map(|mount| cgroup_dirs(mount, path))
                .filter_map(|d| v1_limit(&d))
                .reduce(f64::min)
        } else {
            None
        };
        if let Some(c) = found {
            tightest = Some(tightest.map_or(c, |t| t.min(c)));
        }
    }
    tightest
}

/// `mount/path` and each of its ancestors up to `mount`.
fn cgroup_dirs<'a>(mount: &'a Path, path: &'a str) -> impl Iterator<Item = PathBuf> + 'a {
    let leaf = mount.join(path);
    std::iter::successors(Some(leaf), move |d| {
        d.parent()
            .filter(|p| p.starts_with(mount))
            .map(Path::to_path_buf)
    })
}

/// `cpu.max` in `dir`: "max PERIOD" (none) or "QUOTA PERIOD".
fn v2_limit(dir: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(dir.join("cpu.max")).ok()?;
    let mut f = text.split_whitespace();
    let quota: f64 = f.next()?.parse().ok()?;
    let period: f64 = f.next()?.parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us` in `dir`.
fn v1_limit(dir: &Path) -> Option<f64> {
    let read = |f: &str| -> Option<f64> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let quota = read("cpu.cfs_quota_us")?;
    let period = read("cpu.cfs_period_us")?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `files` (path under `root`, contents) and returns the limit read for `cgroup`.
    fn limit_with(files: &[(&str, &str)], cgroup: &str) -> Option<f64> {
        let root = std::env::temp_dir().join(format!(
            "warmroute-quota-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let got = cpu_limit(&root, cgroup);
        let _ = std::fs::remove_dir_all(&root);
        got
    }

    #[test]
    fn reads_the_tightest_quota_of_a_cgroup_and_its_ancestors() {
        // v2: the leaf has none, its parent half a core.
        let v2 = [
            ("cpu.max", "max 100000\n"),
            ("app.slice/cpu.max", "50000 100000\n"),
            ("app.slice/wr.scope/cpu.max", "max 100000\n"),
        ];
        assert_eq!(limit_with(&v2, "0::/app.slice/wr.scope\n"), Some(0.5));
        // Control: the same tree without the parent's limit has no quota.
        let open = [
            ("cpu.max", "max 100000\n"),
            ("app.slice/wr.scope/cpu.max", "max 100000\n"),
        ];
        assert_eq!(limit_with(&open, "0::/app.slice/wr.scope\n"), None);
        // v1, the layout `bench/run` makes (5 ms per 10 ms), next to other controllers.
        let v1 = [
            ("cpu/wr/cpu.cfs_quota_us", "5000\n"),
            ("cpu/wr/cpu.cfs_period_us", "10000\n"),
            ("cpu/cpu.cfs_quota_us", "-1\n"),
            ("cpu/cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(limit_with(&v1, "12:memory:/wr\n4:cpu:/wr\n"), Some(0.5));
        // v1 in a container: the host path does not exist; the mount's root has the limit.
        let boxed = [
            ("cpu,cpuacct/cpu.cfs_quota_us", "200000\n"),
            ("cpu,cpuacct/cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(limit_with(&boxed, "3:cpu,cpuacct:/docker/abc\n"), Some(2.0));
        // v1 with cpu and cpuacct joined, mounted as `cpu` only (no `cpu,cpuacct` link).
        let joined = [
            ("cpu/wr/cpu.cfs_quota_us", "150000\n"),
            ("cpu/wr/cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(limit_with(&joined, "2:cpu,cpuacct:/wr\n"), Some(1.5));
        // Nothing readable: no quota.
        assert_eq!(limit_with(&[], "0::/\n"), None);
    }

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
