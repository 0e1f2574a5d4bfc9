use super::*;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// A unique path in the temp dir, removed on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(name: &str) -> TempPath {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "warmroute-shm-test-{}-{name}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        TempPath(p)
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn small() -> Capacities {
    Capacities {
        workers: 4,
        peers: 16,
        routes: 8,
    }
}

#[test]
fn a_zombie_or_exiting_process_is_not_alive() {
    // A child killed and not yet reaped is a zombie: kill(pid, 0) still succeeds.
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let pid = child.id();
    assert!(pid_alive(pid), "control: a running child is alive");
    child.kill().expect("kill sleep");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "never a zombie"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!pid_alive(pid), "a zombie is dead");
    child.wait().expect("reap sleep");
    assert!(!pid_alive(pid));
}

#[test]
fn proc_stat_lines_are_read_past_the_command_name() {
    // Running, flags without PF_EXITING; a command name with spaces and parentheses.
    assert!(!stat_says_dying(b"42 (a) b) R 1 42 42 0 -1 4194560 100 0"));
    assert!(stat_says_dying(b"42 (a) b) Z 1 42 42 0 -1 4194560 100 0"));
    assert!(stat_says_dying(b"42 (x) X 1 42 42 0 -1 4194560 100 0"));
    // Sleeping but exiting (PF_EXITING = 0x4 in flags 4194564).
    assert!(stat_says_dying(
        b"42 (warmroute-w0) S 1 42 42 0 -1 4194564 100 0"
    ));
    assert!(!stat_says_dying(b"garbage"));
}

/// The pid of a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let pid = child.id();
    child.wait().expect("wait true");
    assert!(!pid_alive(pid));
    pid
}

fn me() -> u32 {
    std::process::id()
}

#[test]
fn default_caps_and_layout() {
    let c = Capacities::default();
    assert_eq!((c.workers, c.peers, c.routes), (64, 4096, 1024));
    let l = Layout::new(c).unwrap();
    for off in [
        l.workers_offset,
        l.inflight_offset,
        l.peers_offset,
        l.routes_offset,
    ] {
        assert_eq!(off % 64, 0);
    }
    assert!(
        l.total_size < 8 << 20,
        "default segment is {} bytes",
        l.total_size
    );
    assert!(Layout::new(Capacities { workers: 0, ..c }).is_err());
    assert!(Layout::new(Capacities {
        peers: MAX_PEERS + 1,
        ..c
    })
    .is_err());
}

#[test]
fn create_then_attach_keeps_state() {
    let t = TempPath::new("attach");
    {
        let s = Segment::open_or_create(&t.0, small()).unwrap();
        assert_eq!(s.caps(), small());
        assert_eq!(s.path(), t.0.as_path());
        let mode = std::fs::metadata(&t.0).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let p = s.peer_slot("10.0.0.1:8000").unwrap();
        let r = s.route_slot("chat").unwrap();
        s.peer_cell(p, 3).store(42, Ordering::Relaxed);
        s.route_cell(r, 63).store(7, Ordering::Relaxed);
        s.global_cell(0).store(9, Ordering::Relaxed);
        s.ban(p, 12345);
        let w = s.claim_worker(me(), 0).unwrap();
        s.inflight_add(w, p, 2);
        // the row is not released: this process is alive, so the next open must keep it
    }
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.find_peer_slot("10.0.0.1:8000").unwrap();
    let r = s.route_slot("chat").unwrap();
    assert_eq!(s.peer_cell(p, 3).load(Ordering::Relaxed), 42);
    assert_eq!(s.route_cell(r, 63).load(Ordering::Relaxed), 7);
    assert_eq!(s.global_cell(0).load(Ordering::Relaxed), 9);
    assert_eq!(s.banned_until_ms(p), 12345);
    assert_eq!(s.inflight(p), 2);
    assert_eq!(s.workers().len(), 1);

    let e = Segment::open_existing(&t.0).unwrap();
    assert_eq!(e.caps(), small());
    assert_eq!(e.inflight(p), 2);
    assert_eq!(e.peer_keys(), vec![(p, "10.0.0.1:8000".to_string())]);
    assert_eq!(e.route_keys(), vec![(r, "chat".to_string())]);
}

#[test]
fn mismatched_caps_reinitialise_without_live_owner() {
    let t = TempPath::new("reinit");
    {
        let s = Segment::open_or_create(&t.0, small()).unwrap();
        s.global_cell(1).store(5, Ordering::Relaxed);
        s.peer_slot("a").unwrap();
        // a row owned by a dead process does not block reinitialisation
        s.claim_worker(dead_pid(), 0).unwrap();
        let w = s.claim_worker(me(), 1).unwrap();
        s.release_worker(w);
    }
    let caps = Capacities {
        workers: 2,
        peers: 8,
        routes: 4,
    };
    let s = Segment::open_or_create(&t.0, caps).unwrap();
    assert_eq!(s.caps(), caps);
    assert_eq!(s.global_cell(1).load(Ordering::Relaxed), 0);
    assert!(s.peer_keys().is_empty());
    assert!(s.workers().is_empty());
    let len = std::fs::metadata(&t.0).unwrap().len();
    assert_eq!(len, Layout::new(caps).unwrap().total_size);
    assert_eq!(Segment::open_existing(&t.0).unwrap().caps(), caps);
}

#[test]
fn mismatched_caps_refused_with_live_owner() {
    let t = TempPath::new("live");
    {
        let s = Segment::open_or_create(&t.0, small()).unwrap();
        s.claim_worker(me(), 0).unwrap();
        s.global_cell(2).store(11, Ordering::Relaxed);
    }
    let bigger = Capacities {
        peers: 32,
        ..small()
    };
    let err = Segment::open_or_create(&t.0, bigger).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("live process"), "{msg}");
    assert!(msg.contains(&me().to_string()), "{msg}");
    // untouched
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    assert_eq!(s.global_cell(2).load(Ordering::Relaxed), 11);
}

#[test]
fn short_or_garbage_files() {
    let t = TempPath::new("garbage");
    assert!(Segment::open_existing(&t.0).is_err(), "missing file");
    std::fs::write(&t.0, b"hello").unwrap();
    assert!(Segment::open_existing(&t.0).is_err(), "short file");
    std::fs::write(&t.0, vec![0xAB; 4096]).unwrap();
    let e = Segment::open_existing(&t.0).unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
    // a file that is not a segment (someone's data at a mistyped path) is not overwritten
    let e = Segment::open_or_create(&t.0, small()).unwrap_err();
    assert!(e.to_string().contains("is not a warmroute segment"), "{e}");
    assert_eq!(std::fs::read(&t.0).unwrap(), vec![0xAB; 4096]);
    std::fs::write(&t.0, b"hello").unwrap();
    assert!(
        Segment::open_or_create(&t.0, small()).is_err(),
        "short text"
    );
    assert_eq!(std::fs::read(&t.0).unwrap(), b"hello");
    // the control: an empty file (as `open` with O_CREAT leaves it) is made a segment
    std::fs::write(&t.0, b"").unwrap();
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    assert!(s.peer_keys().is_empty());
    drop(s);
    // a file shorter than its header says is reinitialised too
    let full = Layout::new(small()).unwrap().total_size;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&t.0)
        .unwrap()
        .set_len(full - 64)
        .unwrap();
    assert!(Segment::open_existing(&t.0).is_err());
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    assert_eq!(std::fs::metadata(&t.0).unwrap().len(), full);
    drop(s);
    // a zero-filled file of the right size has no header, so it is (re)initialised
    std::fs::write(&t.0, vec![0u8; full as usize]).unwrap();
    assert!(Segment::open_existing(&t.0).is_err());
    assert_eq!(
        Segment::open_or_create(&t.0, small()).unwrap().caps(),
        small()
    );
}

#[test]
fn two_mappings_see_each_others_writes() {
    let t = TempPath::new("xmap");
    let a = Segment::open_or_create(&t.0, small()).unwrap();
    let b = Segment::open_or_create(&t.0, small()).unwrap();
    let c = Segment::open_existing(&t.0).unwrap();
    let pa = a.peer_slot("p").unwrap();
    assert_eq!(b.find_peer_slot("p"), Some(pa));
    assert_eq!(c.peer_slot("p"), Some(pa));
    let wa = a.claim_worker(me(), 0).unwrap();
    let wb = b.claim_worker(me(), 1).unwrap();
    assert_ne!(wa, wb);
    a.inflight_add(wa, pa, 3);
    b.inflight_add(wb, pa, 4);
    assert_eq!(c.inflight(pa), 7);
    b.peer_cell(pa, 0).store(99, Ordering::Relaxed);
    assert_eq!(a.peer_cell(pa, 0).load(Ordering::Relaxed), 99);
    assert!(a.try_lease(1, 1000, 100));
    assert_eq!(c.lease(), (1, 1100));
    assert!(!b.try_lease(2, 1050, 100));
    c.ban(pa, 5000);
    assert!(a.is_banned(pa, 4999));
    a.release_worker(wa);
    assert_eq!(b.inflight(pa), 4);
}

#[test]
fn concurrent_inserts_one_slot_per_key() {
    let t = TempPath::new("race");
    let caps = Capacities {
        workers: 2,
        peers: 600,
        routes: 600,
    };
    let seg = Arc::new(Segment::open_or_create(&t.0, caps).unwrap());
    let keys: Vec<String> = (0..500)
        .map(|i| format!("10.1.{}.{}:8000", i / 256, i % 256))
        .collect();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let seg = Arc::clone(&seg);
            let mut keys = keys.clone();
            keys.rotate_left(t * 61);
            if t % 2 == 1 {
                keys.reverse();
            }
            std::thread::spawn(move || {
                let mut peers = HashMap::new();
                let mut routes = HashMap::new();
                for k in &keys {
                    peers.insert(k.clone(), seg.peer_slot(k).unwrap());
                    routes.insert(k.clone(), seg.route_slot(k).unwrap());
                }
                (peers, routes)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    for r in &results[1..] {
        assert_eq!(r.0, results[0].0);
        assert_eq!(r.1, results[0].1);
    }
    let distinct: HashSet<_> = results[0].0.values().collect();
    assert_eq!(distinct.len(), 500);
    let distinct: HashSet<_> = results[0].1.values().collect();
    assert_eq!(distinct.len(), 500);
    let listed = seg.peer_keys();
    assert_eq!(listed.len(), 500);
    for (slot, key) in listed {
        assert_eq!(results[0].0[&key], slot);
    }
    assert_eq!(seg.route_keys().len(), 500);
}

#[test]
fn slot_keys_limits_and_full_table() {
    let t = TempPath::new("full");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let max = "k".repeat(MAX_KEY_BYTES);
    let over = "k".repeat(MAX_KEY_BYTES + 1);
    let p = s.peer_slot(&max).unwrap();
    assert_eq!(s.peer_keys(), vec![(p, max.clone())]);
    assert_eq!(s.peer_slot(&over), None);
    assert_eq!(s.route_slot(&over), None);
    assert_eq!(s.find_peer_slot(&over), None);
    assert_eq!(s.find_peer_slot("absent"), None);
    // keys differing only past the first word, and non-ASCII keys
    let a = s.peer_slot("same-prefix-a").unwrap();
    let b = s.peer_slot("same-prefix-b").unwrap();
    assert_ne!(a, b);
    let u = s.peer_slot("pëer-ünïcode").unwrap();
    assert!(s.peer_keys().contains(&(u, "pëer-ünïcode".to_string())));
    assert_eq!(s.peer_slot(""), s.find_peer_slot(""));
    // fill the rest of the 16 peer slots
    let mut slots = HashSet::new();
    for i in 0.. {
        match s.peer_slot(&format!("fill-{i}")) {
            Some(p) => assert!(slots.insert(p)),
            None => break,
        }
    }
    assert_eq!(s.peer_keys().len(), 16);
    assert_eq!(s.peer_slot("one-too-many"), None);
    assert_eq!(s.find_peer_slot("one-too-many"), None);
    assert_eq!(
        s.peer_slot(&max),
        Some(p),
        "existing keys still found when full"
    );
    assert_eq!(s.find_route_slot("r"), None);
    let r = s.route_slot("r").unwrap();
    assert_eq!(s.find_route_slot("r"), Some(r));
}

#[test]
fn abandoned_slot_write_is_skipped() {
    let t = TempPath::new("abandon");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let key = "victim";
    let start = (key_hash(key.as_bytes()) % 16) as usize;
    let rec = &s.peer_rows()[start].key;
    // a process died between claiming the slot and publishing it
    rec.state.store(WRITING, Ordering::Release);
    rec.writer_pid.store(dead_pid(), Ordering::Release);
    let p = s.peer_slot(key).unwrap();
    assert_ne!(p.0 as usize, start);
    assert_eq!(rec.state.load(Ordering::Acquire), ABANDONED);
    assert_eq!(s.find_peer_slot(key), Some(p));
    assert_eq!(s.peer_keys(), vec![(p, key.to_string())]);
    // The abandoned slot counts as taken until a free round turns it into a freed one,
    // which the next insert probing from there reuses; the live key is untouched.
    assert_eq!(s.slots_taken().0, 2);
    let now = s.peer_last_ref_ms(p);
    assert_eq!(s.free_idle_peer_slots(now, 5_000, 1_000), 1);
    assert_eq!(rec.state.load(Ordering::Acquire), FREED);
    assert_eq!(s.slots_taken().0, 1);
    assert_eq!(s.find_peer_slot(key), Some(p));
    let other = key_starting_at("other", start as u32);
    assert_eq!(s.peer_slot(&other).map(|q| q.0 as usize), Some(start));
}

/// A second release of a row, after another router claimed it, leaves the new owner's row
/// alone: a failed start gives back rows its workers already gave back as they stopped.
#[test]
fn a_release_frees_only_a_row_this_process_owns() {
    let t = TempPath::new("release-own");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let mine = s.claim_worker(me(), 0).unwrap();
    s.release_worker(mine);
    assert!(
        s.workers().is_empty(),
        "control: this process's row is freed"
    );
    // Another live process (the test runner's parent) claims the freed row.
    let other = std::os::unix::process::parent_id();
    assert!(pid_alive(other));
    let theirs = s.claim_worker(other, 7).unwrap();
    assert_eq!(theirs, mine, "the freed row is the first free one");
    s.release_worker(mine);
    let rows = s.workers();
    assert_eq!(rows.len(), 1, "the other process's row is still owned");
    assert_eq!((rows[0].0, rows[0].1, rows[0].2), (theirs, other, 7));
}

#[test]
fn inflight_sums_across_workers() {
    let t = TempPath::new("inflight");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("p").unwrap();
    let q = s.peer_slot("q").unwrap();
    let ws: Vec<_> = (0..4).map(|i| s.claim_worker(me(), i).unwrap()).collect();
    assert!(s.claim_worker(me(), 9).is_err(), "all rows live");
    assert!(s.claim_worker(0, 0).is_err());
    for (i, w) in ws.iter().enumerate() {
        s.inflight_add(*w, p, i as i64 + 1);
    }
    assert_eq!(s.inflight(p), 10);
    assert_eq!(s.inflight(q), 0);
    s.inflight_add(ws[0], p, -1);
    assert_eq!(s.inflight_of(ws[0], p), 0);
    assert_eq!(s.inflight(p), 9);
    s.inflight_set(ws[1], p, -100);
    assert_eq!(s.inflight_of(ws[1], p), -100);
    assert_eq!(s.inflight(p), 0, "negative sums clamp to 0");
    assert_eq!(
        s.inflight_sum(p),
        -100 + 3 + 4,
        "the raw sum does not (rows 0..3: 0, -100, 3, 4)"
    );
    s.inflight_set(ws[1], p, 2);
    s.release_worker(ws[3]);
    assert_eq!(s.inflight(p), 5);
    assert_eq!(s.workers().len(), 3);
    s.release_worker(ws[3]); // double release is harmless
    let again = s.claim_worker(me(), 3).unwrap();
    assert_eq!(again, ws[3]);
    assert_eq!(s.inflight_of(again, p), 0, "a claimed row starts at zero");
    s.heartbeat(again, 777);
    let rows = s.workers();
    assert!(rows.contains(&(again, me(), 3, 777)));
}

#[test]
fn inflight_concurrent_writers() {
    let t = TempPath::new("inflight-mt");
    let s = Arc::new(Segment::open_or_create(&t.0, small()).unwrap());
    let p = s.peer_slot("p").unwrap();
    let hs: Vec<_> = (0..4)
        .map(|i| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let w = s.claim_worker(me(), i).unwrap();
                for _ in 0..10_000 {
                    s.inflight_add(w, p, 1);
                    let _ = s.inflight(p);
                    s.inflight_add(w, p, -1);
                }
                s.inflight_add(w, p, 1);
                w
            })
        })
        .collect();
    let ws: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(s.inflight(p), 4);
    for w in ws {
        s.release_worker(w);
    }
    assert_eq!(s.inflight(p), 0);
}

#[test]
fn dead_rows_are_reclaimed() {
    let t = TempPath::new("reclaim");
    let caps = Capacities {
        workers: 2,
        ..small()
    };
    let s = Segment::open_or_create(&t.0, caps).unwrap();
    let p = s.peer_slot("p").unwrap();
    let dead = dead_pid();
    let wd = s.claim_worker(dead, 5).unwrap();
    s.inflight_add(wd, p, 5);
    let wl = s.claim_worker(me(), 6).unwrap();
    s.inflight_add(wl, p, 1);
    assert_eq!(s.inflight(p), 6, "counted until reclaimed");
    assert_eq!(s.reclaim_dead(), 1);
    assert_eq!(s.reclaim_dead(), 0);
    assert_eq!(s.inflight(p), 1);
    assert_eq!(s.inflight_of(wd, p), 0);
    assert_eq!(s.workers(), vec![(wl, me(), 6, s.workers()[0].3)]);

    // claim_worker reclaims a dead row itself when no row is free
    let wd = s.claim_worker(dead, 5).unwrap();
    s.inflight_add(wd, p, 5);
    let w = s.claim_worker(me(), 7).unwrap();
    assert_eq!(w, wd);
    assert_eq!(s.inflight_of(w, p), 0);
    assert_eq!(s.inflight(p), 1);
    assert!(s.claim_worker(me(), 8).is_err());

    // a row left mid-reset by a dead process is reclaimable too
    s.release_worker(w);
    s.worker_rows()[w.0 as usize]
        .pid
        .store(RESETTING | dead, Ordering::Release);
    assert_eq!(s.inflight(p), 1, "a resetting row is not counted");
    assert_eq!(s.reclaim_dead(), 1);
    assert_eq!(s.claim_worker(me(), 9).unwrap(), w);
}

#[test]
fn dead_rows_are_reclaimed_once_quiet() {
    let t = TempPath::new("reclaim-quiet");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("p").unwrap();
    let dead = s.claim_worker(dead_pid(), 1).unwrap();
    s.inflight_add(dead, p, 6);
    let live = s.claim_worker(me(), 2).unwrap();
    s.inflight_add(live, p, 1);
    let now = now_ms();
    s.heartbeat(dead, now);
    s.heartbeat(live, now - 60_000);
    // A dead row that beat 1 s ago is left alone; a live row that is quiet is too.
    assert_eq!(s.reclaim_dead_quiet(now + 1_000, 5_000), 0);
    assert_eq!(s.inflight(p), 7);
    // The control: once quiet for 5 s, the dead row goes, the live one stays.
    assert_eq!(s.reclaim_dead_quiet(now + 5_000, 5_000), 1);
    assert_eq!(s.inflight(p), 1);
    assert_eq!(s.inflight_of(live, p), 1);
}

#[test]
fn lease_acquire_renew_expire_takeover() {
    let t = TempPath::new("lease");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    assert_eq!(s.lease(), (0, 0));
    assert!(!s.try_lease(0, 1000, 100), "holder 0 means none");
    assert!(s.try_lease(1, 1000, 100));
    assert_eq!(s.lease(), (1, 1100));
    assert!(!s.try_lease(2, 1050, 100), "held and not expired");
    assert!(s.try_lease(1, 1090, 100), "renew");
    assert_eq!(s.lease(), (1, 1190));
    assert!(!s.try_lease(2, 1189, 100));
    assert!(s.try_lease(2, 1190, 100), "expired: takeover");
    assert_eq!(s.lease(), (2, 1290));
    assert!(!s.try_lease(1, 1200, 100), "old holder lost it");
    s.release_lease(1); // not the holder: no effect
    assert_eq!(s.lease(), (2, 1290));
    s.release_lease(2);
    assert_eq!(s.lease(), (0, 0));
    assert!(s.try_lease(1, 1200, 100), "free after release");

    // a claim marker left by a process that died mid-claim goes stale
    s.header()
        .lease_expires
        .store(LEASE_CLAIMING | 2000, Ordering::Release);
    assert!(!s.try_lease(3, 2000 + LEASE_CLAIM_STALE_MS, 100));
    assert!(s.try_lease(3, 2001 + LEASE_CLAIM_STALE_MS, 100));
    assert_eq!(s.lease(), (3, 2101 + LEASE_CLAIM_STALE_MS));
}

#[test]
fn a_lease_set_before_the_clock_stepped_back_does_not_outlive_its_holder() {
    let t = TempPath::new("lease-step");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let hour = 3_600_000;
    assert!(s.try_lease(1, 10 * hour, 2_000));
    // Control: on the same clock, the lease is held until it expires, even within the
    // step margin.
    assert!(!s.try_lease(2, 10 * hour - LEASE_CLOCK_STEP_MS, 2_000));
    assert!(!s.try_lease(2, 10 * hour + 1_999, 2_000));
    // The wall clock steps back an hour and holder 1 dies (it renews no more): its
    // expiry is an hour ahead, and another worker takes the lease at once.
    assert!(s.try_lease(2, 9 * hour, 2_000));
    assert_eq!(s.lease(), (2, 9 * hour + 2_000));
    assert!(
        !s.try_lease(1, 9 * hour + 500, 2_000),
        "the old holder lost it"
    );
    // So is a claim marker left by a claimer that died before the step.
    s.header()
        .lease_expires
        .store(LEASE_CLAIMING | (10 * hour), Ordering::Release);
    assert!(!s.try_lease(3, 10 * hour, 2_000), "a fresh marker holds");
    assert!(s.try_lease(3, 9 * hour, 2_000));
}

#[test]
fn lease_has_one_winner_under_contention() {
    let t = TempPath::new("lease-mt");
    let s = Arc::new(Segment::open_or_create(&t.0, small()).unwrap());
    for round in 0..200u64 {
        let now = 10_000 + round * 1_000; // every round the previous lease has expired
        let barrier = Arc::new(std::sync::Barrier::new(8));
        let hs: Vec<_> = (1..=8u64)
            .map(|h| {
                let s = Arc::clone(&s);
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    s.try_lease(h, now, 500)
                })
            })
            .collect();
        let winners: Vec<u64> = hs
            .into_iter()
            .zip(1..)
            .filter_map(|(h, id)| h.join().unwrap().then_some(id))
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        assert_eq!(s.lease(), (winners[0], now + 500));
    }
}

#[test]
fn bans() {
    let t = TempPath::new("bans");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("p").unwrap();
    assert_eq!(s.banned_until_ms(p), 0);
    assert!(!s.is_banned(p, 0));
    s.ban(p, 2000);
    assert!(s.is_banned(p, 1999));
    assert!(!s.is_banned(p, 2000));
    s.unban(p);
    assert_eq!(s.banned_until_ms(p), 0);
    assert!(!s.is_banned(p, 1000));
}

#[test]
fn a_ban_has_one_banner_under_contention() {
    // Every worker that fails to connect to a down peer bans it; the ban is one
    // transition, counted once.
    let t = TempPath::new("ban-mt");
    let s = Arc::new(Segment::open_or_create(&t.0, small()).unwrap());
    let p = s.peer_slot("p").unwrap();
    for round in 0..200u64 {
        let now = 10_000 + round * 1_000; // the previous round's ban has expired
        let barrier = Arc::new(std::sync::Barrier::new(8));
        let hs: Vec<_> = (0..8u64)
            .map(|w| {
                let s = Arc::clone(&s);
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    s.ban_from(p, now, now + 500 + w)
                })
            })
            .collect();
        let banners = hs
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|&b| b)
            .count();
        assert_eq!(banners, 1, "round {round}");
        assert!(s.is_banned(p, now + 499));
    }
    // The control: a peer still banned is not banned anew; an expired ban is.
    assert!(!s.ban_from(p, 1, 5_000));
    assert!(s.ban_from(p, 6_000, 7_000));
}

#[test]
#[should_panic]
fn cell_index_out_of_range_panics() {
    let t = TempPath::new("oob");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("p").unwrap();
    let _ = s.peer_cell(p, PEER_CELLS);
}

#[test]
#[should_panic]
fn peer_slot_out_of_range_panics() {
    let t = TempPath::new("oob2");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let w = s.claim_worker(me(), 0).unwrap();
    s.inflight_add(w, PeerSlot(16), 1);
}

#[test]
fn now_and_pids() {
    let a = now_ms();
    assert!(a > 1_577_836_800_000, "after 2020");
    assert!(a < 4_102_444_800_000, "before 2100");
    assert!(now_ms() >= a);
    assert!(pid_alive(me()));
    assert!(pid_alive(1), "init exists (EPERM counts as alive)");
    assert!(!pid_alive(0));
    assert!(!pid_alive(u32::MAX));
    assert!(!pid_alive(dead_pid()));
}

#[test]
fn segment_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Segment>();
}

/// Run by `segment_shared_across_processes` in a child process: attach, claim a row, count one
/// in-flight request, and exit without releasing (as a crash would).
#[test]
fn cross_process_child_helper() {
    let Ok(path) = std::env::var("WARMROUTE_SHM_CHILD_PATH") else {
        return; // only meaningful in the child
    };
    let s = Segment::open_or_create(Path::new(&path), small()).unwrap();
    let p = s.peer_slot("shared-peer").unwrap();
    let w = s.claim_worker(me(), 42).unwrap();
    s.inflight_add(w, p, 3);
    s.global_cell(5).fetch_add(1, Ordering::Relaxed);
}

#[test]
fn segment_shared_across_processes() {
    let t = TempPath::new("xproc");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("shared-peer").unwrap();
    let w = s.claim_worker(me(), 0).unwrap();
    s.inflight_add(w, p, 1);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tests::cross_process_child_helper",
            "--test-threads=1",
        ])
        .env("WARMROUTE_SHM_CHILD_PATH", &t.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // the child saw our slot and wrote into the same mapping
    assert_eq!(s.global_cell(5).load(Ordering::Relaxed), 1);
    let child_rows: Vec<_> = s.workers().into_iter().filter(|r| r.2 == 42).collect();
    assert_eq!(child_rows.len(), 1);
    let child_pid = child_rows[0].1;
    assert_ne!(child_pid, me());
    assert!(!pid_alive(child_pid));
    assert_eq!(
        s.inflight(p),
        4,
        "the dead child's row counts until reclaimed"
    );
    assert_eq!(s.reclaim_dead(), 1);
    assert_eq!(s.inflight(p), 1);
    assert_eq!(s.peer_keys(), vec![(p, "shared-peer".to_string())]);
}

#[test]
fn concurrent_open_initialises_once() {
    let t = TempPath::new("open-race");
    let path = Arc::new(t.0.clone());
    let hs: Vec<_> = (0..8)
        .map(|i| {
            let path = Arc::clone(&path);
            std::thread::spawn(move || {
                let caps = Capacities {
                    workers: 8,
                    ..small()
                };
                let s = Segment::open_or_create(&path, caps).unwrap();
                let w = s.claim_worker(me(), i).unwrap();
                s.peer_cell(s.peer_slot("x").unwrap(), 0)
                    .fetch_add(1, Ordering::Relaxed);
                (s, w)
            })
        })
        .collect();
    let opened: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    // had any open reinitialised the file after another claimed a row, a row or a count is lost
    let s = &opened[0].0;
    let rows: HashSet<_> = opened.iter().map(|(_, w)| *w).collect();
    assert_eq!(rows.len(), 8);
    assert_eq!(s.workers().len(), 8);
    let x = s.find_peer_slot("x").unwrap();
    assert_eq!(s.peer_cell(x, 0).load(Ordering::Relaxed), 8);
}

#[test]
fn signal_drain_refuses_bad_pids_and_signals_a_child() {
    assert!(signal_drain(0).is_err());
    assert!(signal_drain(std::process::id()).is_err());
    assert!(signal_drain(u32::MAX).is_err());
    // A child that exits on SIGQUIT's default action: signalled, it dies by that signal.
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    signal_drain(child.id()).unwrap();
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGQUIT));
}

#[test]
fn session_placements_are_shared_and_refreshed() {
    let tp = TempPath::new("sessions");
    let a = Segment::open_or_create(&tp.0, small()).unwrap();
    let b = Segment::open_or_create(&tp.0, small()).unwrap();
    assert_eq!(a.session_peer(42, 100), None);
    a.set_session_peer(42, 7, 100);
    // Another mapping (another worker or process) sees it; key 0 is a key like any other.
    assert_eq!(b.session_peer(42, 100), Some(7));
    b.set_session_peer(0, 3, 100);
    assert_eq!(a.session_peer(0, 100), Some(3));
    // Moving a session overwrites its own slot.
    b.set_session_peer(42, 9, 101);
    assert_eq!(a.session_peer(42, 101), Some(9));
    // A read refreshes the last-use time.
    let row = session_window(a.try_session_rows().unwrap(), 42)
        .find(|r| r.key.load(Ordering::Relaxed) == 42)
        .unwrap();
    assert_eq!(session_age(row.val.load(Ordering::Relaxed), 101), 0);
    assert_eq!(a.session_peer(42, 150), Some(9));
    assert_eq!(session_age(row.val.load(Ordering::Relaxed), 150), 0);
}

#[test]
fn a_full_window_forgets_its_least_recently_used_session() {
    let tp = TempPath::new("sessions-lru");
    let seg = Segment::open_or_create(&tp.0, small()).unwrap();
    // Nine keys with one window: the ninth must evict someone.
    let key = |i: u64| 5 + i * SESSION_SLOTS;
    for i in 0..SESSION_PROBE {
        seg.set_session_peer(key(i), i as u32, 100 + i);
    }
    for i in 0..SESSION_PROBE {
        assert_eq!(seg.session_peer(key(i), 100 + i), Some(i as u32));
    }
    // Key 0 is used again later, so key 1 is now the least recently used.
    assert_eq!(seg.session_peer(key(0), 200), Some(0));
    seg.set_session_peer(key(SESSION_PROBE), 99, 201);
    assert_eq!(seg.session_peer(key(SESSION_PROBE), 201), Some(99));
    assert_eq!(
        seg.session_peer(key(1), 201),
        None,
        "the LRU one is forgotten"
    );
    for i in [0, 2, 3, 7] {
        assert_eq!(
            seg.session_peer(key(i), 202),
            Some(i as u32),
            "key {i} kept"
        );
    }
    // A window that wraps past the end of the table works the same.
    let last = SESSION_SLOTS - 1;
    seg.set_session_peer(last, 1, 300);
    seg.set_session_peer(last + SESSION_SLOTS, 2, 300);
    assert_eq!(seg.session_peer(last, 300), Some(1));
    assert_eq!(seg.session_peer(last + SESSION_SLOTS, 300), Some(2));
}

#[test]
fn a_reader_racing_a_replacement_sees_no_placement() {
    let tp = TempPath::new("sessions-race");
    let seg = Segment::open_or_create(&tp.0, small()).unwrap();
    let old = 77u64;
    let new = 77u64 | (0xab << 56); // same window, other check bits
    seg.set_session_peer(old, 4, 10);
    // A writer has swapped the key in but not yet its value.
    let row = session_window(seg.try_session_rows().unwrap(), old)
        .find(|r| r.key.load(Ordering::Relaxed) == old)
        .unwrap();
    row.key.store(new, Ordering::Release);
    assert_eq!(
        seg.session_peer(new, 10),
        None,
        "old value must not be read as the new key's"
    );
    seg.set_session_peer(new, 5, 11);
    assert_eq!(seg.session_peer(new, 11), Some(5));
}

#[test]
fn concurrent_placements_all_land() {
    let tp = TempPath::new("sessions-threads");
    let seg = Arc::new(Segment::open_or_create(&tp.0, small()).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let seg = Arc::clone(&seg);
            std::thread::spawn(move || {
                for i in 0..2000u64 {
                    let key = (i * 4 + t).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    seg.set_session_peer(key, (key >> 40) as u32, 1);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut found = 0;
    for k in 0..8000u64 {
        let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        if seg.session_peer(key, 2) == Some((key >> 40) as u32) {
            found += 1;
        }
    }
    // 8000 keys in 65536 slots with 8-slot windows: every one fits.
    assert_eq!(found, 8000);
}

#[test]
fn the_soft_fd_limit_is_raised_to_the_hard_one() {
    // nextest runs every test in its own process, so changing the limit touches no other test.
    let (soft, hard) = nofile_limit().unwrap();
    assert!(soft <= hard);
    let lowered = hard.min(soft).min(512);
    set_nofile_soft(lowered).unwrap();
    assert_eq!(
        nofile_limit().unwrap(),
        (lowered, hard),
        "control: the limit was lowered"
    );
    assert_eq!(raise_nofile_limit().unwrap(), (lowered, hard));
    assert_eq!(nofile_limit().unwrap(), (hard, hard));
    // Already at the hard limit: nothing to do.
    assert_eq!(raise_nofile_limit().unwrap(), (hard, hard));
    // Above the hard limit is refused, and says so.
    if hard < u64::MAX / 2 {
        assert!(set_nofile_soft(hard + 1).is_err());
    }
}

/// This thread's run time as the scheduler last charged it (`/proc/thread-self/schedstat`,
/// first field), which a plain read does not bring up to date.
fn charged_run_time_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[test]
fn reading_the_thread_cpu_clock_charges_the_run_time() {
    if charged_run_time_ns().is_none() {
        eprintln!("no /proc/thread-self/schedstat on this kernel: nothing to compare with");
        return;
    }
    let first = thread_cpu_time_ns().expect("the thread CPU clock reads");
    // Busy without blocking, as a loaded worker is, until the scheduler has charged 30 ms
    // of run time (an independent count, which lags the clock): not for 30 ms of wall time,
    // of which a thread sharing a loaded machine may get much less (19.99 ms in one CI
    // run). At most 2 s, for a kernel that counts nothing.
    let charged_first = charged_run_time_ns().unwrap();
    let spin = Instant::now();
    let mut x = 0u64;
    while charged_run_time_ns().unwrap() - charged_first < 30_000_000
        && spin.elapsed() < Duration::from_secs(2)
    {
        for _ in 0..1000 {
            x = hint::black_box(x.wrapping_add(1));
        }
    }
    let before = charged_run_time_ns().unwrap();
    if before == 0 {
        // 2 s of spinning crossed many ticks: zero means the kernel keeps no counts.
        eprintln!("scheduler statistics are off on this kernel: nothing to compare with");
        return;
    }
    let now = thread_cpu_time_ns().expect("the thread CPU clock reads");
    let after = charged_run_time_ns().unwrap();
    // Control: what was charged before the read lags the clock (it was last brought up to
    // date at a tick or a switch, and the thread has run since).
    assert!(before < now, "{before} !< {now}");
    // The read charged the time up to its own answer.
    assert!(after >= now, "charged {after} < clock {now}");
    // And the clock is this thread's CPU time: the spin is in it, a sleep is not.
    assert!(now - first >= 20_000_000, "{first} -> {now}");
    std::thread::sleep(Duration::from_millis(50));
    let slept = thread_cpu_time_ns().unwrap();
    assert!(slept - now < 20_000_000, "{now} -> {slept} across a sleep");
}

/// A key whose probe starts at slot `start` of a 16-slot table (the peers of `small()`).
fn key_starting_at(prefix: &str, start: u32) -> String {
    key_starting_at_of(prefix, start, 16)
}

/// A key whose probe starts at slot `start` of an `n`-slot table.
fn key_starting_at_of(prefix: &str, start: u32, n: u64) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|k| key_hash(k.as_bytes()) % n == u64::from(start))
        .unwrap()
}

#[test]
fn idle_peer_slots_are_freed_and_reset_on_reuse() {
    let t = TempPath::new("free");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let w = s.claim_worker(me(), 0).unwrap();
    let old = s.peer_slot("route//10.0.0.1:8000").unwrap();
    let stamped = s.peer_last_ref_ms(old);
    assert!(stamped > 0, "an insert stamps the slot");
    s.ban(old, u64::MAX);
    for i in 0..PEER_CELLS {
        s.peer_cell(old, i).store(i as u64 + 7, Ordering::Relaxed);
    }
    let later = stamped + 60_000;
    s.heartbeat(w, later);
    // Controls: recently stamped, or with a request in flight, the slot stays.
    assert_eq!(s.free_idle_peer_slots(stamped + 1_000, 5_000, 1_000), 0);
    s.inflight_add(w, old, 1);
    assert_eq!(s.free_idle_peer_slots(later, 5_000, 1_000), 0);
    s.inflight_add(w, old, -1);
    s.touch_peer(old, later - 1_000);
    assert_eq!(s.free_idle_peer_slots(later, 5_000, 1_000), 0);
    // Idle for long enough and nothing in flight: freed.
    s.heartbeat(w, later + 4_000);
    s.route_slot("route").unwrap();
    assert_eq!(s.slots_taken(), (1, 1));
    assert_eq!(s.free_idle_peer_slots(later + 4_000, 5_000, 1_000), 1);
    assert_eq!(
        s.slots_taken(),
        (0, 1),
        "a freed peer slot no longer counts as taken"
    );
    assert_eq!(s.find_peer_slot("route//10.0.0.1:8000"), None);
    assert!(s.peer_keys().is_empty());
    // A new key that probes from the freed slot takes it, and inherits nothing.
    let key = key_starting_at("route//10.0.0.2", old.0);
    let new = s.peer_slot(&key).unwrap();
    assert_eq!(new, old);
    assert_eq!(s.banned_until_ms(new), 0);
    assert!((0..PEER_CELLS).all(|i| s.peer_cell(new, i).load(Ordering::Relaxed) == 0));
    assert!(s.peer_last_ref_ms(new) >= stamped);
    assert_eq!(s.peer_keys(), vec![(new, key)]);
    assert_eq!(s.slots_taken(), (1, 1));
}

#[test]
fn lookups_and_inserts_probe_past_freed_slots() {
    let t = TempPath::new("tomb");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    // Three keys probing from the same slot: a, b and c sit one after the other.
    let keys: Vec<String> = (0..3)
        .map(|i| key_starting_at(&format!("k{i}"), 5))
        .collect();
    let slots: Vec<PeerSlot> = keys.iter().map(|k| s.peer_slot(k).unwrap()).collect();
    assert_eq!(slots.iter().map(|p| p.0).collect::<Vec<_>>(), vec![5, 6, 7]);
    // Free a and b; c is still in use.
    let now = s.peer_last_ref_ms(slots[2]) + 60_000;
    s.touch_peer(slots[2], now);
    assert_eq!(s.free_idle_peer_slots(now, 5_000, 1_000), 2);
    // c is still found, by lookup and by insert, in its own slot: not copied into a freed one.
    assert_eq!(s.find_peer_slot(&keys[2]), Some(slots[2]));
    assert_eq!(s.peer_slot(&keys[2]), Some(slots[2]));
    assert_eq!(s.peer_keys().len(), 1);
    // A new key reuses the first freed slot of its probe, then the next.
    let d = s.peer_slot(&key_starting_at("d", 5)).unwrap();
    let e = s.peer_slot(&key_starting_at("e", 5)).unwrap();
    assert_eq!((d.0, e.0), (5, 6));
    let f = s.peer_slot(&key_starting_at("f", 5)).unwrap();
    assert_eq!(f.0, 8, "no freed slot left: the first empty one");
}

#[test]
fn a_full_peer_table_reuses_freed_slots() {
    let t = TempPath::new("fullfree");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let first: Vec<PeerSlot> = (0..16)
        .map(|i| s.peer_slot(&format!("gen1-{i}")).unwrap())
        .collect();
    assert_eq!(s.peer_slot("gen2-0"), None, "full");
    let now = s.peer_last_ref_ms(first[0]) + 60_000;
    assert_eq!(s.free_idle_peer_slots(now, 5_000, 1_000), 16);
    let second: HashSet<PeerSlot> = (0..16)
        .map(|i| s.peer_slot(&format!("gen2-{i}")).unwrap())
        .collect();
    assert_eq!(second.len(), 16);
    assert_eq!(s.peer_slot("gen3-0"), None, "full again");
    assert_eq!(s.find_peer_slot("gen1-3"), None);
}

#[test]
fn nothing_is_freed_while_a_worker_is_silent() {
    let t = TempPath::new("silent");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let p = s.peer_slot("p").unwrap();
    let now = s.peer_last_ref_ms(p) + 60_000;
    let (a, b) = (
        s.claim_worker(me(), 0).unwrap(),
        s.claim_worker(me(), 1).unwrap(),
    );
    s.heartbeat(a, now);
    // b stopped beating (a stalled process stamps nothing either).
    s.heartbeat(b, now - 3_000);
    assert_eq!(s.free_idle_peer_slots(now, 5_000, 1_000), 0);
    assert_eq!(s.find_peer_slot("p"), Some(p));
    // The control: once b beats again, the idle slot goes.
    s.heartbeat(b, now - 500);
    assert_eq!(s.free_idle_peer_slots(now, 5_000, 1_000), 1);
}

#[test]
fn the_peer_slot_lock_is_taken_from_a_dead_or_stuck_holder() {
    let t = TempPath::new("slotlock");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let lock = &s.header().peer_slot_lock;
    let now = now_ms();
    let word = |pid: u32, at_ms: u64| (u64::from(pid) << 32) | (at_ms & 0xffff_ffff);
    let p = s.peer_slot("p").unwrap();
    assert_eq!(
        lock.load(Ordering::Acquire),
        0,
        "an insert gives the lock back"
    );
    let later = s.peer_last_ref_ms(p) + 60_000;
    // Held by a live process just now: a free round skips.
    lock.store(word(me(), now), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_none());
    // Held by a live process for 999 ms, or taken "later" than now (the clock went back):
    // still held.
    lock.store(word(me(), now - 999), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_none());
    lock.store(word(me(), now + 30_000), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_none());
    // A dead holder loses it even then, and after 1 s in any case (ms, not whole seconds:
    // 1.001 s is not "2 s" and 0.999 s is not "1 s").
    lock.store(word(dead_pid(), now + 30_000), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_some());
    lock.store(word(dead_pid(), now - 500), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_none());
    lock.store(word(me(), now), Ordering::Release);
    assert_eq!(s.free_idle_peer_slots(later, 5_000, 1_000), 0);
    // Held by a process that died a while ago: taken over, and given back after use.
    lock.store(word(dead_pid(), now - 5_000), Ordering::Release);
    let q = s.peer_slot("q").unwrap();
    assert_eq!(lock.load(Ordering::Acquire), 0);
    s.touch_peer(q, later);
    lock.store(word(dead_pid(), now - 5_000), Ordering::Release);
    assert_eq!(s.free_idle_peer_slots(later, 5_000, 1_000), 1, "p, not q");
    assert_eq!(lock.load(Ordering::Acquire), 0);
    // Held by a live process for implausibly long: taken over too.
    lock.store(word(me(), now - 60_000), Ordering::Release);
    assert!(s.try_lock_slots(lock).is_some());
    assert_eq!(lock.load(Ordering::Acquire), 0);
}

#[test]
fn idle_route_slots_are_freed_and_reset_on_reuse() {
    let t = TempPath::new("routefree");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let w = s.claim_worker(me(), 0).unwrap();
    let old = s.route_slot("gone#status").unwrap();
    let kept = s.route_slot("kept#status").unwrap();
    let stamped = s.route_last_ref_ms(old);
    assert!(stamped > 0, "an insert stamps the slot");
    for i in 0..ROUTE_CELLS {
        s.route_cell(old, i).store(i as u64 + 7, Ordering::Relaxed);
    }
    let later = stamped + 60_000;
    s.heartbeat(w, later);
    s.touch_route(kept, later);
    // Controls: stamped recently, the slot stays; so it does while a worker is quiet, or
    // while another process holds the route table's lock.
    assert_eq!(s.free_idle_route_slots(stamped + 1_000, 5_000, 1_000), 0);
    assert_eq!(s.free_idle_route_slots(later + 2_000, 5_000, 1_000), 0);
    let lock = &s.header().route_slot_lock;
    lock.store(
        (u64::from(me()) << 32) | (now_ms() & 0xffff_ffff),
        Ordering::Release,
    );
    assert_eq!(s.free_idle_route_slots(later, 5_000, 1_000), 0);
    lock.store(0, Ordering::Release);
    assert_eq!(s.slots_taken(), (0, 2));
    // Idle for long enough: freed; the slot stamped since stays.
    assert_eq!(s.free_idle_route_slots(later, 5_000, 1_000), 1);
    assert_eq!(s.slots_taken(), (0, 1));
    assert_eq!(s.find_route_slot("gone#status"), None);
    assert_eq!(s.find_route_slot("kept#status"), Some(kept));
    assert_eq!(s.route_keys(), vec![(kept, "kept#status".to_string())]);
    // A new key that probes from the freed slot takes it, and inherits no counts.
    let key = key_starting_at_of("new#status", old.0, u64::from(small().routes));
    let new = s.route_slot(&key).unwrap();
    assert_eq!(new, old);
    assert!((0..ROUTE_CELLS).all(|i| s.route_cell(new, i).load(Ordering::Relaxed) == 0));
    assert!(s.route_last_ref_ms(new) >= stamped);
    assert_eq!(s.slots_taken(), (0, 2));
    // The same key asked for again gets the same slot, stamped again.
    assert_eq!(s.route_slot(&key), Some(new));
    assert_eq!(
        lock.load(Ordering::Acquire),
        0,
        "an insert gives the lock back"
    );
}

#[test]
fn a_full_route_table_reuses_freed_slots() {
    let t = TempPath::new("routefull");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let n = small().routes;
    let first: Vec<RouteSlot> = (0..n)
        .map(|i| s.route_slot(&format!("gen1-{i}")).unwrap())
        .collect();
    assert_eq!(s.route_slot("gen2-0"), None, "full");
    let now = s.route_last_ref_ms(first[0]) + 60_000;
    assert_eq!(s.free_idle_route_slots(now, 5_000, 1_000), n);
    let second: HashSet<RouteSlot> = (0..n)
        .map(|i| s.route_slot(&format!("gen2-{i}")).unwrap())
        .collect();
    assert_eq!(second.len(), n as usize);
    assert_eq!(s.route_slot("gen3-0"), None, "full again");
    assert_eq!(s.find_route_slot("gen1-3"), None);
}

#[test]
fn socket_pending_sees_bytes_and_closes_without_taking_them() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut b, _) = l.accept().unwrap();
    // A quiet connection, and the call does not block on it.
    assert_eq!(socket_pending(b.as_raw_fd()), Pending::Nothing);
    a.write_all(b"HTTP/1.1 408").unwrap();
    let seen = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(5));
        socket_pending(b.as_raw_fd()) == Pending::Bytes
    });
    assert!(seen, "the bytes sent were never seen");
    // Nothing was taken: every byte is still there to read.
    let mut got = [0u8; 12];
    b.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"HTTP/1.1 408");
    assert_eq!(socket_pending(b.as_raw_fd()), Pending::Nothing);
    drop(a);
    let closed = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(5));
        socket_pending(b.as_raw_fd()) == Pending::Closed
    });
    assert!(closed, "the peer's close was never seen");
    // Not a socket: a clear answer, no crash.
    assert_eq!(socket_pending(-1), Pending::Closed);
}

#[test]
fn rows_claimed_in_open_or_create_then_keep_a_second_opener_from_reinitialising() {
    let t = TempPath::new("then");
    // The first opener claims its row before the lock is let go; a second opener with
    // other capacities then finds a live owner and is refused instead of remaking the file.
    let (first, w) =
        Segment::open_or_create_then(&t.0, small(), |s| s.claim_worker(me(), 0)).unwrap();
    first.global_cell(3).store(7, Ordering::Relaxed);
    let bigger = Capacities {
        workers: 8,
        ..small()
    };
    let err = Segment::open_or_create_then(&t.0, bigger, |_| Ok(())).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
    assert_eq!(first.global_cell(3).load(Ordering::Relaxed), 7);
    // The control: with the row given back, the same open remakes the segment.
    first.release_worker(w);
    let (second, ()) = Segment::open_or_create_then(&t.0, bigger, |_| Ok(())).unwrap();
    assert_eq!(second.caps().workers, 8);
    assert_eq!(second.global_cell(3).load(Ordering::Relaxed), 0);
    // An error from `then` is the open's error.
    let err = Segment::open_or_create_then(&t.0, bigger, |_| -> io::Result<()> {
        Err(io::Error::other("no"))
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "no");
}

#[test]
fn beating_rows_report_core_and_routes_digest_and_leave_out_quiet_rows() {
    let t = TempPath::new("beating");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let a = s.claim_worker(me(), 0).unwrap();
    let b = s.claim_worker(me(), 1).unwrap();
    s.set_worker_core(a, Some(3));
    s.set_worker_routes_digest(a, 42);
    let now = now_ms();
    s.heartbeat(a, now);
    s.heartbeat(b, now - 10_000);
    // `b` has not beaten for 10 s: left out; `a` with its core and digest.
    assert_eq!(s.beating_rows(now, 2_000), vec![(a, Some(3), 42)]);
    s.heartbeat(b, now);
    let rows = s.beating_rows(now, 2_000);
    assert!(rows.contains(&(b, None, 0)), "{rows:?}");
    // Core 0 is told apart from "not said".
    s.set_worker_core(b, Some(0));
    assert!(s.beating_rows(now, 2_000).contains(&(b, Some(0), 0)));
    // A row given back and claimed again starts with neither.
    s.release_worker(a);
    let c = s.claim_worker(me(), 2).unwrap();
    assert_eq!(c, a);
    assert!(s.beating_rows(now_ms(), 2_000).contains(&(c, None, 0)));
}

#[test]
fn worker_infos_read_every_owned_row_whole_quiet_or_not() {
    let t = TempPath::new("infos");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let a = s.claim_worker(me(), 0).unwrap();
    let b = s.claim_worker(me(), 1).unwrap();
    s.set_worker_core(a, Some(3));
    s.set_worker_routes_digest(a, 42);
    s.heartbeat(a, 1_000);
    s.heartbeat(b, 2_000);
    let info = |id, tag, heartbeat_ms, core, routes_digest| WorkerInfo {
        id,
        pid: me(),
        tag,
        heartbeat_ms,
        core,
        routes_digest,
    };
    // Both rows with every field, however long ago they beat (`beating_rows` leaves
    // these out, `workers` gives the first four fields).
    assert_eq!(
        s.worker_infos(),
        vec![info(a, 0, 1_000, Some(3), 42), info(b, 1, 2_000, None, 0)]
    );
    assert!(s.beating_rows(now_ms(), 2_000).is_empty());
    assert_eq!(s.workers(), vec![(a, me(), 0, 1_000), (b, me(), 1, 2_000)]);
    // A row given back is not read.
    s.release_worker(a);
    assert_eq!(s.worker_infos(), vec![info(b, 1, 2_000, None, 0)]);
}

#[test]
fn remove_unused_keeps_a_segment_with_a_live_owner_and_removes_one_without() {
    let t = TempPath::new("remove");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let w = s.claim_worker(me(), 0).unwrap();
    assert!(!Segment::remove_unused(&t.0).unwrap());
    assert!(t.0.exists());
    s.release_worker(w);
    assert!(Segment::remove_unused(&t.0).unwrap());
    assert!(!t.0.exists());
    // Nothing there: nothing to do.
    assert!(!Segment::remove_unused(&t.0).unwrap());
}

#[test]
fn open_existing_then_runs_under_the_lock_and_ports_are_said_and_forgotten() {
    let t = TempPath::new("existing-then");
    let s = Segment::open_or_create(&t.0, small()).unwrap();
    let (other, w) = Segment::open_existing_then(&t.0, |seg| seg.claim_worker(me(), 0)).unwrap();
    assert_eq!(s.worker_ports(), vec![(me(), None)]);
    other.set_worker_ports(w, 8080, 8090);
    assert_eq!(s.worker_ports(), vec![(me(), Some((8080, 8090)))]);
    // Port 0 is a port said, not "not said".
    other.set_worker_ports(w, 0, 0);
    assert_eq!(s.worker_ports(), vec![(me(), Some((0, 0)))]);
    // Given back: the next owner starts with nothing said.
    s.set_worker_core(w, Some(1));
    s.set_worker_routes_digest(w, 9);
    s.release_worker(w);
    let w2 = s.claim_worker(me(), 0).unwrap();
    assert_eq!(w2, w);
    assert_eq!(s.worker_ports(), vec![(me(), None)]);
    assert!(s.beating_rows(now_ms(), 2_000).contains(&(w2, None, 0)));
}
