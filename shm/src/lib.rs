//! The shared segment: one file (normally under `/dev/shm`) mapped `MAP_SHARED` by every worker
//! thread of a router process, by a process taking over from it, and by `warmroute status`.
//!
//! Contract:
//! - The mapping holds `#[repr(C)]` atomics only: no pointers, no plain fields that are written.
//!   A zero-filled file is the valid empty state; the creator writes the header after sizing the
//!   file and publishes it by storing [`MAGIC`] last (Release). Attachers check magic (Acquire),
//!   [`LAYOUT_VERSION`] and capacities.
//! - Layout (every table starts on a 64-byte line): header (stable identity prefix, lease,
//!   [`GLOBAL_CELLS`] global cells) · worker rows · in-flight matrix `[workers][peers]` (each
//!   worker's row contiguous) · peer slots · route slots · session placements. See [`Layout`].
//! - Who writes what: a worker row and its in-flight row are written only by the thread that
//!   claimed it (and by whoever reclaims it after its process died); slot keys are written once
//!   by the inserter and never change; bans by the health prober and proxying workers; the lease
//!   by contenders for it; generic cells by whoever the router assigns them to; session
//!   placements by any worker (a slot's key by CAS, then its value).
//! - Peer and route slots keep their key for as long as somebody uses them, across reloads
//!   and processes: every user stamps the slots it may still touch ([`Segment::touch_peer`],
//!   [`Segment::touch_route`]), and a slot nobody stamped for a while (and, for a peer, with
//!   no request in flight) is freed ([`Segment::free_idle_peer_slots`],
//!   [`Segment::free_idle_route_slots`]) and reset when a new key takes it. Inserts and frees
//!   take the table's slot lock (off the data path); lookups never do. Capacities are fixed
//!   when the segment is created.
//! - Reinitialising (capacity or version change) truncates the file; it is refused while a live
//!   process owns a worker row. A process that still maps a shrunk segment would get SIGBUS, so
//!   only short-lived readers (`warmroute status`) may be attached across such a change.
//!
//! This is the only crate of the project with `unsafe`; every block says why it holds.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::hint;
use std::io;
use std::mem::{align_of, size_of};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use memmap2::{MmapOptions, MmapRaw};

/// `b"WRMRTSHM"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"WRMRTSHM");
/// Bumped whenever any table's layout changes. The header's identity prefix (magic, version,
/// capacities, total size, worker-row offset and size, owner pid as the first u32 of a worker
/// row) never moves, so any version can tell whether a live process owns an older segment.
///
/// v3: peer slots can be freed (a `FREED` key state, a per-row `last_ref_ms` stamp, the peer
/// slot-table lock in the lease line). A v2 process would neither stamp its slots nor
/// take the lock, so the two must not share a segment.
///
/// v4: route slots can be freed too (a `last_ref_ms` stamp in the route row, the route
/// slot-table lock in the lease line). A v3 process would not stamp its routes, whose slots
/// a v4 lease holder would then free under it.
pub const LAYOUT_VERSION: u32 = 4;
/// Generic per-peer u64 cells (counters, EWMAs as f64 bits, ...), meaning defined by the router.
pub const PEER_CELLS: usize = 32;
/// Generic per-route u64 cells.
pub const ROUTE_CELLS: usize = 64;
/// Generic process-wide cells (toggles, counters).
pub const GLOBAL_CELLS: usize = 64;
/// Session placement slots (16 bytes each): how many sessions the segment remembers a peer
/// for. A full table forgets the least recently used session of the probed window.
pub const SESSION_SLOTS: u64 = 1 << 16;
/// Consecutive slots a session key may occupy (its probe window).
const SESSION_PROBE: u64 = 8;
/// Bits of a placement's last-use time (seconds, wrapping every ~194 days).
const SESSION_TIME_BITS: u32 = 24;
/// Longest slot key in bytes; longer keys get no slot.
pub const MAX_KEY_BYTES: usize = 119;

/// Upper bounds on capacities, so a corrupt header or a typo cannot ask for terabytes.
pub const MAX_WORKERS: u32 = 4096;
pub const MAX_PEERS: u32 = 1 << 20;
pub const MAX_ROUTES: u32 = 1 << 20;
/// Upper bound on the whole segment (4 GiB).
pub const MAX_SEGMENT_BYTES: u64 = 1 << 32;

/// Fixed table sizes of a segment, decided when it is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub workers: u32,
    pub peers: u32,
    pub routes: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Capacities {
            workers: 64,
            peers: 4096,
            routes: 1024,
        }
    }
}

/// A claimed worker row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkerId(pub u32);

/// A worker row with an owner, as [`Segment::worker_infos`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerInfo {
    pub id: WorkerId,
    pub pid: u32,
    /// The tag the owner claimed the row with (its worker index).
    pub tag: u32,
    pub heartbeat_ms: u64,
    /// The core the worker is pinned to; `None` when not pinned or not said.
    pub core: Option<usize>,
    /// The digest of the routes the worker serves; 0 when draining or not said.
    pub routes_digest: u64,
}

/// A peer slot (stable for a key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerSlot(pub u32);
/// A route slot (stable for a key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RouteSlot(pub u32);

// ---------------------------------------------------------------------------------------------
// Layout of the mapping
// ---------------------------------------------------------------------------------------------

/// Segment header. Lines 0 (identity) and 1 (lease) are separate so lease traffic does not
/// invalidate the identity line every reader checks; then the global cells.
#[repr(C, align(64))]
struct Header {
    // --- line 0: identity; written by the creator before `magic`, then read-only -------------
    /// Writer: creator, stored last with Release.
    magic: AtomicU64,
    /// Writer: creator.
    layout_version: AtomicU32,
    /// Writer: creator (capacities).
    workers: AtomicU32,
    peers: AtomicU32,
    routes: AtomicU32,
    /// Writer: creator. Bytes the file must have.
    total_size: AtomicU64,
    /// Writer: creator. Byte offset of the worker-row table (stable across versions).
    workers_offset: AtomicU64,
    /// Writer: creator. Size of one worker row; its first u32 is the owner pid.
    worker_row_size: AtomicU32,
    /// Writer: claimers (`fetch_max`). Rows at or past it have never been claimed.
    rows_high_water: AtomicU32,
    _pad0: [AtomicU64; 2],
    // --- line 1: lease ----------------------------------------------------------------------
    /// Writer: the contender whose claim CAS on `lease_expires` succeeded. 0 = none.
    lease_holder: AtomicU64,
    /// Writer: lease contenders, always by CAS. Bit 63 set = a claim is in progress (low bits are
    /// the claim time), otherwise the expiry in ms since the epoch.
    lease_expires: AtomicU64,
    /// Writer: whoever inserts or frees peer slots, by CAS (0 = free, else
    /// `pid << 32 | acquired_ms as u32`); see [`Segment::lock_slots`].
    peer_slot_lock: AtomicU64,
    /// The same for route slots.
    route_slot_lock: AtomicU64,
    _pad1: [AtomicU64; 4],
    // --- lines 2..10: generic global cells; writers as the router assigns them ------------------
    globals: [AtomicU64; GLOBAL_CELLS],
}
const _: () = assert!(size_of::<Header>() == 640);
const _: () = assert!(align_of::<Header>() == 64);

/// One worker thread's row (one cache line).
#[repr(C, align(64))]
struct WorkerRow {
    /// Writer: the claimer (CAS), the owner on release, a reclaimer when the owner died.
    /// 0 = free; `RESETTING | pid` = being reset by `pid` (not counted); else the owner pid.
    /// Must stay the first field (see `LAYOUT_VERSION`).
    pid: AtomicU32,
    /// Writer: the claimer, while resetting. Free-form (worker index).
    tag: AtomicU32,
    /// Writer: owner.
    heartbeat_ms: AtomicU64,
    /// Writer: the claimer, while resetting.
    claimed_ms: AtomicU64,
    /// Writer: owner (or its process's main thread). The core its worker is pinned to,
    /// plus one; 0 = not pinned or not said (a router from before this field, which read
    /// it as padding and never wrote it).
    core: AtomicU64,
    /// Writer: owner (or its process's main thread). A digest of the routes and peers its
    /// process serves (0 = not said), so that routers sharing the segment can tell when
    /// they serve different route sets.
    routes_digest: AtomicU64,
    /// Writer: its process's main thread. The public and admin ports its process listens
    /// on, `1 << 32 | public << 16 | admin`; 0 = not said. A takeover or join tells by them
    /// whether a served port is one of the segment's routers' or a stranger's.
    ports: AtomicU64,
    _pad: [AtomicU64; 2],
}
const _: () = assert!(size_of::<WorkerRow>() == 64);

impl WorkerRow {
    /// Forget what the owner said of itself (core, routes, ports): a row given back or
    /// reclaimed carries nothing of its last owner to the next (which may be a router from
    /// before these fields, that would never overwrite them).
    fn clear_said(&self) {
        self.core.store(0, Ordering::Relaxed);
        self.routes_digest.store(0, Ordering::Relaxed);
        self.ports.store(0, Ordering::Relaxed);
    }
}

/// Key part of a peer or route slot. Written once by the inserter, immutable once ready.
#[repr(C)]
struct KeyRec {
    /// Writer: inserter (CAS `EMPTY`→`WRITING`, then `WRITING`→`READY`), or a waiter that finds
    /// the inserting process dead (`WRITING`→`ABANDONED`); the freer (`READY` or
    /// `ABANDONED`→`FREED`, under the table's slot lock) and an inserter reusing a freed slot
    /// (`FREED`→`WRITING`, under the lock). Never goes back to `EMPTY`.
    state: AtomicU32,
    /// Writer: inserter, while `WRITING`.
    key_len: AtomicU32,
    /// Writer: inserter, while `WRITING`. `key_hash` of the key.
    hash: AtomicU64,
    /// Writer: inserter, right after its CAS to `WRITING`.
    writer_pid: AtomicU32,
    _reserved: AtomicU32,
    /// Writer: inserter, while `WRITING`. Key bytes, little-endian packed, zero padded.
    key: [AtomicU64; KEY_WORDS],
}
const KEY_WORDS: usize = 15;
const _: () = assert!(size_of::<KeyRec>() == 144);
const _: () = assert!(MAX_KEY_BYTES < KEY_WORDS * 8);

/// A peer slot: key, ban, generic cells.
#[repr(C, align(64))]
struct PeerRow {
    key: KeyRec,
    /// Writer: health prober and proxying workers. 0 = not banned.
    banned_until_ms: AtomicU64,
    /// Writer: every process that may use the slot ([`Segment::touch_peer`], and the
    /// inserter), storing its wall-clock ms. A slot stamped long ago is up for freeing.
    last_ref_ms: AtomicU64,
    _pad: [AtomicU64; 4],
    /// Writers as the router assigns them (each cell one role).
    cells: [AtomicU64; PEER_CELLS],
}
const _: () = assert!(size_of::<PeerRow>() == 448);

/// A route slot: key, use stamp, generic cells.
#[repr(C, align(64))]
struct RouteRow {
    key: KeyRec,
    /// Writer: every process that may use the slot ([`Segment::touch_route`], and the
    /// inserter), storing its wall-clock ms. A slot stamped long ago is up for freeing.
    last_ref_ms: AtomicU64,
    _pad: [AtomicU64; 5],
    /// Writers as the router assigns them (each cell one role).
    cells: [AtomicU64; ROUTE_CELLS],
}
const _: () = assert!(size_of::<RouteRow>() == 704);

/// One session placement. `key` is the session's 64-bit key (never 0 once used; slots are
/// overwritten, never emptied); `val` packs the peer (high 32 bits), 8 check bits of the key
/// (bits 24..32) and the last-use time in seconds (low 24 bits). The check bits let a reader
/// that races a replacement (new key, old value) see the mismatch and read it as absent.
#[repr(C, align(16))]
struct SessionRow {
    /// Writer: any worker, by CAS (an empty or least recently used slot of the window).
    key: AtomicU64,
    /// Writer: the worker that last wrote the key, or any reader refreshing the time.
    val: AtomicU64,
}
const _: () = assert!(size_of::<SessionRow>() == 16);

const EMPTY: u32 = 0;
const WRITING: u32 = 1;
const READY: u32 = 2;
const ABANDONED: u32 = 3;
/// A slot freed for reuse: lookups probe past it (a key further on may have passed it
/// when it was taken), inserts reuse the first one they saw once the key is known absent.
const FREED: u32 = 4;

const RESETTING: u32 = 1 << 31;
const LEASE_CLAIMING: u64 = 1 << 63;
/// A lease claim marker older than this is from a process that died mid-claim.
const LEASE_CLAIM_STALE_MS: u64 = 5_000;
/// A lease expiry further than this beyond `now + ttl` was set before the wall clock
/// stepped back (no holder renews that far ahead), and counts as expired. Otherwise a
/// holder that died just after such a step would keep the lease, and the probes, for as
/// long as the step.
const LEASE_CLOCK_STEP_MS: u64 = 1_000;
/// A slot stuck in `WRITING` longer than this is treated as abandoned.
const SLOT_WRITE_STALE: Duration = Duration::from_secs(2);
/// A slot-table lock is taken over from a holder that is dead and has held it this
/// long (ms), or from any holder after `SLOT_LOCK_STALE_MS` (a holder in another pid
/// namespace looks dead; no insert or free round takes anywhere near this long). The lock
/// word keeps the low 32 bits of the wall clock in ms: ages up to 24 days read right, and a
/// clock stepped back (a negative age) makes no live holder stale.
const SLOT_LOCK_DEAD_MS: i64 = 1_000;
const SLOT_LOCK_STALE_MS: i64 = 10_000;

/// Marker for types that may be viewed in the mapping.
///
/// # Safety
/// Implementors are `#[repr(C)]`, made only of atomics (so shared references to them may be used
/// while other threads and processes write them), and valid when all bytes are zero.
unsafe trait ShmSafe {}
// SAFETY: repr(C), atomics only, all-zero is a valid value.
unsafe impl ShmSafe for Header {}
// SAFETY: repr(C), atomics only, all-zero is a valid value.
unsafe impl ShmSafe for WorkerRow {}
// SAFETY: repr(C), atomics only, all-zero is a valid value.
unsafe impl ShmSafe for PeerRow {}
// SAFETY: repr(C), atomics only, all-zero is a valid value.
unsafe impl ShmSafe for RouteRow {}
// SAFETY: repr(C), atomics only, all-zero is a valid value (an empty slot).
unsafe impl ShmSafe for SessionRow {}
// SAFETY: an atomic; all-zero is a valid value.
unsafe impl ShmSafe for AtomicI64 {}
// SAFETY: an atomic; all-zero is a valid value.
unsafe impl ShmSafe for AtomicU32 {}

/// Byte offsets of the tables for given capacities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub workers_offset: u64,
    pub inflight_offset: u64,
    /// i64 entries per worker row of the in-flight matrix (peers rounded up to a cache line).
    pub inflight_stride: u64,
    pub peers_offset: u64,
    pub routes_offset: u64,
    pub sessions_offset: u64,
    pub total_size: u64,
}

impl Layout {
    /// Compute the layout, rejecting capacities out of bounds.
    pub fn new(caps: Capacities) -> io::Result<Layout> {
        let ok = (1..=MAX_WORKERS).contains(&caps.workers)
            && (1..=MAX_PEERS).contains(&caps.peers)
            && (1..=MAX_ROUTES).contains(&caps.routes);
        if !ok {
            return Err(invalid_input(format!(
                "segment capacities {caps:?} out of bounds (workers 1..={MAX_WORKERS}, \
                 peers 1..={MAX_PEERS}, routes 1..={MAX_ROUTES})"
            )));
        }
        let (w, p, r) = (
            u64::from(caps.workers),
            u64::from(caps.peers),
            u64::from(caps.routes),
        );
        let workers_offset = size_of::<Header>() as u64;
        let inflight_offset = workers_offset + w * size_of::<WorkerRow>() as u64;
        let inflight_stride = p.div_ceil(8) * 8;
        let peers_offset = inflight_offset + w * inflight_stride * 8;
        let routes_offset = peers_offset + p * size_of::<PeerRow>() as u64;
        let sessions_offset = routes_offset + r * size_of::<RouteRow>() as u64;
        let total_size = sessions_offset + SESSION_SLOTS * size_of::<SessionRow>() as u64;
        if total_size > MAX_SEGMENT_BYTES {
            return Err(invalid_input(format!(
                "segment capacities {caps:?} need {total_size} bytes, more than {MAX_SEGMENT_BYTES}"
            )));
        }
        Ok(Layout {
            workers_offset,
            inflight_offset,
            inflight_stride,
            peers_offset,
            routes_offset,
            sessions_offset,
            total_size,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The segment
// ---------------------------------------------------------------------------------------------

/// A mapped segment. `Send + Sync`: share it with `Arc` across threads.
pub struct Segment {
    map: MmapRaw,
    path: PathBuf,
    caps: Capacities,
    layout: Layout,
}

impl fmt::Debug for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Segment")
            .field("path", &self.path)
            .field("caps", &self.caps)
            .field("total_size", &self.layout.total_size)
            .finish()
    }
}

/// View `n` values of `T` at byte offset `off` of the mapping, or `None` when out of bounds or
/// misaligned. This is the one place that turns mapping bytes into references.
fn view<T: ShmSafe>(map: &MmapRaw, off: u64, n: u64) -> Option<&[T]> {
    let bytes = n.checked_mul(size_of::<T>() as u64)?;
    let end = off.checked_add(bytes)?;
    if end > map.len() as u64 {
        return None;
    }
    let off = usize::try_from(off).ok()?;
    let n = usize::try_from(n).ok()?;
    // The mapping is page aligned, so alignment of the address equals alignment of the offset;
    // check the address anyway.
    let ptr = map.as_ptr().wrapping_add(off);
    if (ptr as usize) & (align_of::<T>() - 1) != 0 {
        return None;
    }
    // SAFETY: `off..end` lies inside the live mapping (checked above), the address is aligned for
    // `T` (checked above), and `T: ShmSafe` is made only of atomics that are valid for any bytes
    // we may find there (all-zero included), so shared references may coexist with concurrent
    // atomic writes from other threads and processes. The slice borrows `map`, so it cannot
    // outlive the mapping. (If another process truncates the file, access faults with SIGBUS,
    // which is not a memory-safety violation.)
    Some(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), n) })
}

fn invalid_input(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn invalid_data(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// An advisory lock on the whole file, held only while opening (never on the data path), so
/// creators and attachers never see a half-written header. Unlocked explicitly on drop: closing
/// the descriptor is not enough, because the mapping keeps the open file description alive.
struct FileLock<'a>(&'a File);

impl<'a> FileLock<'a> {
    fn new(file: &'a File, exclusive: bool) -> io::Result<FileLock<'a>> {
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        loop {
            // SAFETY: `file` is an open file, so its descriptor is valid for this call; flock
            // takes no pointers.
            let r = unsafe { libc::flock(file.as_raw_fd(), op) };
            if r == 0 {
                return Ok(FileLock(file));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: the borrowed file is still open, so its descriptor is valid; no pointers.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn map_file(file: &File, len: u64) -> io::Result<MmapRaw> {
    let len = usize::try_from(len).map_err(|_| invalid_data(format!("segment of {len} bytes")))?;
    let map = MmapOptions::new().len(len).map_raw(file)?;
    if (map.as_ptr() as usize) & 63 != 0 {
        return Err(io::Error::other("segment mapping is not 64-byte aligned"));
    }
    Ok(map)
}

/// What a header says about itself.
struct HeaderInfo {
    magic: u64,
    version: u32,
    caps: Capacities,
    total_size: u64,
    workers_offset: u64,
    worker_row_size: u32,
}

fn read_header(map: &MmapRaw) -> Option<HeaderInfo> {
    let h = &view::<Header>(map, 0, 1)?[0];
    let magic = h.magic.load(Ordering::Acquire);
    Some(HeaderInfo {
        magic,
        version: h.layout_version.load(Ordering::Relaxed),
        caps: Capacities {
            workers: h.workers.load(Ordering::Relaxed),
            peers: h.peers.load(Ordering::Relaxed),
            routes: h.routes.load(Ordering::Relaxed),
        },
        total_size: h.total_size.load(Ordering::Relaxed),
        workers_offset: h.workers_offset.load(Ordering::Relaxed),
        worker_row_size: h.worker_row_size.load(Ordering::Relaxed),
    })
}

/// Pids of live processes owning worker rows, read through the version-stable header prefix.
fn live_owners(map: &MmapRaw, info: &HeaderInfo) -> Vec<u32> {
    let mut pids = Vec::new();
    if info.magic != MAGIC {
        return pids;
    }
    let stride = u64::from(info.worker_row_size);
    if stride < 4 || stride % 4 != 0 {
        return pids;
    }
    for i in 0..u64::from(info.caps.workers.min(MAX_WORKERS)) {
        let Some(off) = i
            .checked_mul(stride)
            .and_then(|o| o.checked_add(info.workers_offset))
        else {
            break;
        };
        let Some(cell) = view::<AtomicU32>(map, off, 1) else {
            break; // beyond the end of a short file
        };
        let pid = cell[0].load(Ordering::Acquire) & !RESETTING;
        if pid != 0 && pid_alive(pid) && !pids.contains(&pid) {
            pids.push(pid);
        }
    }
    pids
}

impl Segment {
    /// Create the file (mode 0600) sized for `caps`, or attach to an existing one whose header
    /// matches (magic, version, caps), keeping all its state. If the existing header does not
    /// match (or the file is shorter than the header says) and no live process owns any worker
    /// row, reinitialise it; if a live process owns rows, return an error explaining the mismatch.
    pub fn open_or_create(path: &Path, caps: Capacities) -> io::Result<Segment> {
        Segment::open_or_create_then(path, caps, |_| Ok(())).map(|(seg, ())| seg)
    }

    /// [`Segment::open_or_create`], then `then` on the segment while the file lock is still
    /// held: another process's open waits for it. A router claims its worker rows here, so
    /// that a router starting in the same instant sees them (and does not take the segment
    /// for unused and reinitialise it under the first one's mapping).
    pub fn open_or_create_then<T>(
        path: &Path,
        caps: Capacities,
        then: impl FnOnce(&Segment) -> io::Result<T>,
    ) -> io::Result<(Segment, T)> {
        let layout = Layout::new(caps)?;
        // The file whose lock is held must still be the one at `path`: a failed start
        // removes the file it created (`remove_unused`, under this lock), and a segment
        // opened from an unlinked file would be one that no other router can find.
        for _ in 0..10 {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)?;
            let _lock = FileLock::new(&file, true)?;
            let same = match std::fs::metadata(path) {
                Ok(m) => m.ino() == file.metadata()?.ino(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                Err(e) => return Err(e),
            };
            if same {
                return Segment::open_or_create_locked(path, caps, layout, &file, then);
            }
        }
        Err(io::Error::other(
            "the segment file kept being removed while this process opened it",
        ))
    }

    /// The rest of [`Segment::open_or_create_then`], with `file` open and locked.
    fn open_or_create_locked<T>(
        path: &Path,
        caps: Capacities,
        layout: Layout,
        file: &File,
        then: impl FnOnce(&Segment) -> io::Result<T>,
    ) -> io::Result<(Segment, T)> {
        let len = file.metadata()?.len();
        // A file that was never a segment (a mistyped `shm_path` naming someone's data) is
        // not overwritten. One that starts with zeros may be a segment whose creation was
        // cut before its magic was stored: that one is made anew.
        if len > 0 {
            let mut first = [0u8; 8];
            let n = std::os::unix::fs::FileExt::read_at(file, &mut first, 0)?;
            if first[..n] != MAGIC.to_le_bytes()[..n] && first[..n].iter().any(|&b| b != 0) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    // The caller names the path.
                    format!(
                        "the file exists ({len} bytes) and is not a warmroute segment; not overwriting it: remove it or set another shm_path"
                    ),
                ));
            }
        }
        if len >= size_of::<Header>() as u64 {
            let map = map_file(file, len)?;
            let info = read_header(&map).ok_or_else(|| io::Error::other("header not mapped"))?;
            let matches = info.magic == MAGIC
                && info.version == LAYOUT_VERSION
                && info.caps == caps
                && info.total_size == layout.total_size
                && info.workers_offset == layout.workers_offset
                && info.worker_row_size == size_of::<WorkerRow>() as u32
                && len >= layout.total_size;
            if matches {
                let seg = Segment::from_map(map, path, caps, layout)?;
                let t = then(&seg)?;
                return Ok((seg, t));
            }
            let live = live_owners(&map, &info);
            if !live.is_empty() {
                let found = if info.magic == MAGIC {
                    format!(
                        "layout v{} with {:?} in {} bytes (file has {len})",
                        info.version, info.caps, info.total_size
                    )
                } else {
                    "no valid header".to_string()
                };
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "shared segment {} has {found}, but this process needs layout v{} with \
                         {caps:?}; live process(es) {live:?} own worker rows in it, so it cannot \
                         be reinitialised: stop them or use another segment path",
                        path.display(),
                        LAYOUT_VERSION
                    ),
                ));
            }
            drop(map);
        }
        // Reinitialise: truncating to zero zeroes every byte, so the tables start empty.
        file.set_len(0)?;
        file.set_len(layout.total_size)?;
        let map = map_file(file, layout.total_size)?;
        {
            let h = &view::<Header>(&map, 0, 1)
                .ok_or_else(|| io::Error::other("header not mapped"))?[0];
            h.layout_version.store(LAYOUT_VERSION, Ordering::Relaxed);
            h.workers.store(caps.workers, Ordering::Relaxed);
            h.peers.store(caps.peers, Ordering::Relaxed);
            h.routes.store(caps.routes, Ordering::Relaxed);
            h.total_size.store(layout.total_size, Ordering::Relaxed);
            h.workers_offset
                .store(layout.workers_offset, Ordering::Relaxed);
            h.worker_row_size
                .store(size_of::<WorkerRow>() as u32, Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
        }
        let seg = Segment::from_map(map, path, caps, layout)?;
        let t = then(&seg)?;
        Ok((seg, t))
    }

    /// Attach to an existing segment reading caps from its header (for `warmroute status`);
    /// error if missing or invalid.
    pub fn open_existing(path: &Path) -> io::Result<Segment> {
        Segment::open_existing_with(path, false, |_| Ok(())).map(|(seg, ())| seg)
    }

    /// [`Segment::open_existing`], then `then` on it under the file's exclusive lock (as
    /// [`Segment::open_or_create_then`] does): a router sharing a segment of another size
    /// claims its rows here, so that no start reinitialises the file meanwhile.
    pub fn open_existing_then<T>(
        path: &Path,
        then: impl FnOnce(&Segment) -> io::Result<T>,
    ) -> io::Result<(Segment, T)> {
        Segment::open_existing_with(path, true, then)
    }

    fn open_existing_with<T>(
        path: &Path,
        exclusive: bool,
        then: impl FnOnce(&Segment) -> io::Result<T>,
    ) -> io::Result<(Segment, T)> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let _lock = FileLock::new(&file, exclusive)?;
        let len = file.metadata()?.len();
        let bad = |why: String| invalid_data(format!("{}: {why}", path.display()));
        if len < size_of::<Header>() as u64 {
            return Err(bad(format!(
                "{len} bytes is too short for a segment header"
            )));
        }
        let map = map_file(&file, len)?;
        let info = read_header(&map).ok_or_else(|| bad("header not mapped".into()))?;
        if info.magic != MAGIC {
            return Err(bad("not a warmroute segment (bad magic)".into()));
        }
        if info.version != LAYOUT_VERSION {
            return Err(bad(format!(
                "layout version {} but this binary reads {LAYOUT_VERSION}",
                info.version
            )));
        }
        let layout = Layout::new(info.caps).map_err(|e| bad(e.to_string()))?;
        if info.total_size != layout.total_size
            || info.workers_offset != layout.workers_offset
            || info.worker_row_size != size_of::<WorkerRow>() as u32
            || len < layout.total_size
        {
            return Err(bad(format!(
                "header ({:?}, {} bytes) is inconsistent with the file ({len} bytes)",
                info.caps, info.total_size
            )));
        }
        let seg = Segment::from_map(map, path, info.caps, layout)?;
        let t = then(&seg)?;
        Ok((seg, t))
    }

    /// Remove the segment file at `path` if no live process owns a worker row in it, under
    /// its exclusive lock (so a router opening it meanwhile either finds the file gone and
    /// makes a new one, or has claimed its rows first and keeps the file). For a start that
    /// failed after creating the file. Ok(true) when it was removed.
    pub fn remove_unused(path: &Path) -> io::Result<bool> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let _lock = FileLock::new(&file, true)?;
        let len = file.metadata()?.len();
        if len >= size_of::<Header>() as u64 {
            let map = map_file(&file, len)?;
            let info = read_header(&map).ok_or_else(|| io::Error::other("header not mapped"))?;
            if info.magic == MAGIC && !live_owners(&map, &info).is_empty() {
                return Ok(false);
            }
        }
        match std::fs::metadata(path) {
            Ok(m) if m.ino() == file.metadata()?.ino() => {
                std::fs::remove_file(path)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn from_map(map: MmapRaw, path: &Path, caps: Capacities, layout: Layout) -> io::Result<Self> {
        let seg = Segment {
            map,
            path: path.to_path_buf(),
            caps,
            layout,
        };
        // Check once that every table is in bounds and aligned, so the accessors may rely on it.
        let ok = seg.try_header().is_some()
            && seg.try_worker_rows().is_some()
            && seg.try_inflight().is_some()
            && seg.try_peer_rows().is_some()
            && seg.try_route_rows().is_some()
            && seg.try_session_rows().is_some();
        if !ok {
            return Err(invalid_data(format!(
                "{}: tables do not fit the mapping",
                path.display()
            )));
        }
        Ok(seg)
    }

    fn try_header(&self) -> Option<&Header> {
        view::<Header>(&self.map, 0, 1).map(|s| &s[0])
    }
    fn try_worker_rows(&self) -> Option<&[WorkerRow]> {
        view(
            &self.map,
            self.layout.workers_offset,
            u64::from(self.caps.workers),
        )
    }
    fn try_inflight(&self) -> Option<&[AtomicI64]> {
        view(
            &self.map,
            self.layout.inflight_offset,
            u64::from(self.caps.workers) * self.layout.inflight_stride,
        )
    }
    fn try_peer_rows(&self) -> Option<&[PeerRow]> {
        view(
            &self.map,
            self.layout.peers_offset,
            u64::from(self.caps.peers),
        )
    }
    fn try_route_rows(&self) -> Option<&[RouteRow]> {
        view(
            &self.map,
            self.layout.routes_offset,
            u64::from(self.caps.routes),
        )
    }

    fn try_session_rows(&self) -> Option<&[SessionRow]> {
        view(&self.map, self.layout.sessions_offset, SESSION_SLOTS)
    }

    // The `expect`s below hold by construction: `from_map` checked these exact views.
    fn header(&self) -> &Header {
        self.try_header().expect("header checked at open")
    }
    fn worker_rows(&self) -> &[WorkerRow] {
        self.try_worker_rows().expect("worker rows checked at open")
    }
    fn inflight_row(&self, w: WorkerId) -> &[AtomicI64] {
        let stride = self.layout.inflight_stride as usize;
        let all = self
            .try_inflight()
            .expect("in-flight matrix checked at open");
        let start = w.0 as usize * stride;
        &all[start..start + stride]
    }
    fn peer_rows(&self) -> &[PeerRow] {
        self.try_peer_rows().expect("peer rows checked at open")
    }
    fn route_rows(&self) -> &[RouteRow] {
        self.try_route_rows().expect("route rows checked at open")
    }
    fn peer(&self, p: PeerSlot) -> &PeerRow {
        &self.peer_rows()[p.0 as usize]
    }

    pub fn caps(&self) -> Capacities {
        self.caps
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }

    // --- worker rows --------------------------------------------------------------------------

    /// Claim a free row (owner pid 0) or reclaim a row whose owner pid is no longer alive
    /// (zeroing its in-flight counts first). Records pid and `tag` (e.g. worker index). Error when
    /// all rows are taken by live owners.
    pub fn claim_worker(&self, pid: u32, tag: u32) -> io::Result<WorkerId> {
        if pid == 0 || pid & RESETTING != 0 {
            return Err(invalid_input(format!("pid {pid} cannot own a worker row")));
        }
        // Free rows first (no syscall), then rows of dead processes.
        let free = self.worker_rows().iter().enumerate().map(|r| (r, true));
        let dead = self.worker_rows().iter().enumerate().map(|r| (r, false));
        for ((i, row), free_pass) in free.chain(dead) {
            let v = row.pid.load(Ordering::Acquire);
            let takeable = if free_pass {
                v == 0
            } else {
                v != 0 && !pid_alive(v & !RESETTING)
            };
            if !takeable {
                continue;
            }
            let me = RESETTING | std::process::id();
            if row
                .pid
                .compare_exchange(v, me, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue; // somebody else took or reclaimed it first
            }
            let w = WorkerId(i as u32);
            self.zero_inflight(w);
            row.tag.store(tag, Ordering::Relaxed);
            row.clear_said();
            row.heartbeat_ms.store(now_ms(), Ordering::Relaxed);
            row.claimed_ms.store(now_ms(), Ordering::Relaxed);
            self.header()
                .rows_high_water
                .fetch_max(i as u32 + 1, Ordering::AcqRel);
            row.pid.store(pid, Ordering::Release);
            return Ok(w);
        }
        Err(io::Error::other(format!(
            "all {} worker rows of segment {} are owned by live processes",
            self.caps.workers,
            self.path.display()
        )))
    }

    /// Zero the row's in-flight counts and free it, if this process owns it. A row freed
    /// once may be claimed by another router at once, so a second release of it (a worker
    /// gives its row back as it stops, and a failed start gives back every row it claimed)
    /// must leave the new owner's row alone.
    pub fn release_worker(&self, w: WorkerId) {
        let row = &self.worker_rows()[w.0 as usize];
        let v = row.pid.load(Ordering::Acquire);
        if v != std::process::id() {
            return;
        }
        if row
            .pid
            .compare_exchange(v, v | RESETTING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.zero_inflight(w);
            row.clear_said();
            row.pid.store(0, Ordering::Release);
        }
    }

    /// Free every row whose owner pid is dead (`kill(pid, 0)` says ESRCH); returns how many.
    pub fn reclaim_dead(&self) -> u32 {
        self.reclaim_dead_where(|_| true)
    }

    /// [`Segment::reclaim_dead`] for the rows that are also quiet: no heartbeat for
    /// `quiet_ms` before `now_ms`. A running router calls this periodically, so a process
    /// killed while it drained (after a takeover) leaves no in-flight counts behind; the
    /// heartbeat condition keeps it from freeing the rows of a live router whose pid this
    /// process cannot see (another pid namespace sharing the segment), which beats every
    /// few tens of milliseconds.
    pub fn reclaim_dead_quiet(&self, now_ms: u64, quiet_ms: u64) -> u32 {
        self.reclaim_dead_where(|row| {
            now_ms.saturating_sub(row.heartbeat_ms.load(Ordering::Relaxed)) >= quiet_ms
        })
    }

    fn reclaim_dead_where(&self, also: impl Fn(&WorkerRow) -> bool) -> u32 {
        let mut n = 0;
        for (i, row) in self.worker_rows().iter().enumerate() {
            let v = row.pid.load(Ordering::Acquire);
            if v == 0 || !also(row) || pid_alive(v & !RESETTING) {
                continue;
            }
            let me = RESETTING | std::process::id();
            if row
                .pid
                .compare_exchange(v, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                self.zero_inflight(WorkerId(i as u32));
                row.clear_said();
                row.pid.store(0, Ordering::Release);
                n += 1;
            }
        }
        n
    }

    fn zero_inflight(&self, w: WorkerId) {
        for c in self.inflight_row(w) {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// Rows that may be owned: `0..rows_high_water`.
    fn live_rows(&self) -> impl Iterator<Item = (usize, &WorkerRow)> {
        let hw = self.header().rows_high_water.load(Ordering::Acquire) as usize;
        self.worker_rows()
            .iter()
            .enumerate()
            .take(hw)
            .filter(|(_, r)| owner(r.pid.load(Ordering::Acquire)).is_some())
    }

    pub fn heartbeat(&self, w: WorkerId, now_ms: u64) {
        self.worker_rows()[w.0 as usize]
            .heartbeat_ms
            .store(now_ms, Ordering::Relaxed);
    }

    /// Record the core worker `w` is pinned to (`None`: not pinned).
    pub fn set_worker_core(&self, w: WorkerId, core: Option<usize>) {
        let v = core.map_or(0, |c| c as u64 + 1);
        self.worker_rows()[w.0 as usize]
            .core
            .store(v, Ordering::Relaxed);
    }

    /// Record the digest of the routes worker `w`'s process serves.
    pub fn set_worker_routes_digest(&self, w: WorkerId, digest: u64) {
        self.worker_rows()[w.0 as usize]
            .routes_digest
            .store(digest, Ordering::Relaxed);
    }

    /// Record the public and admin ports worker `w`'s process listens on.
    pub fn set_worker_ports(&self, w: WorkerId, public: u16, admin: u16) {
        let v = 1 << 32 | u64::from(public) << 16 | u64::from(admin);
        self.worker_rows()[w.0 as usize]
            .ports
            .store(v, Ordering::Relaxed);
    }

    /// `(pid, (public, admin) ports)` of every row with an owner; the ports `None` when the
    /// owner has not said them (a router from before the field, or one still starting).
    pub fn worker_ports(&self) -> Vec<(u32, Option<(u16, u16)>)> {
        self.live_rows()
            .filter_map(|(_, r)| {
                let pid = owner(r.pid.load(Ordering::Acquire))?;
                let v = r.ports.load(Ordering::Relaxed);
                let ports = (v >> 32 == 1).then_some(((v >> 16) as u16, v as u16));
                Some((pid, ports))
            })
            .collect()
    }

    /// Every row with an owner, read once: its pid, tag, last heartbeat, pinned core and
    /// routes digest.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        self.infos().collect()
    }

    /// [`Segment::worker_infos`], row by row, for the views below to take what they need
    /// without a list of their own in between.
    fn infos(&self) -> impl Iterator<Item = WorkerInfo> + '_ {
        self.live_rows().filter_map(|(i, r)| {
            let pid = owner(r.pid.load(Ordering::Acquire))?;
            Some(WorkerInfo {
                id: WorkerId(i as u32),
                pid,
                tag: r.tag.load(Ordering::Relaxed),
                heartbeat_ms: r.heartbeat_ms.load(Ordering::Relaxed),
                core: r
                    .core
                    .load(Ordering::Relaxed)
                    .checked_sub(1)
                    .map(|c| c as usize),
                routes_digest: r.routes_digest.load(Ordering::Relaxed),
            })
        })
    }

    /// The rows with an owner that has beaten within `quiet_ms` before `now_ms` (a live
    /// router beats every few tens of milliseconds; a row just claimed counts from its
    /// claim): `(id, pinned core, routes digest)`, the core `None` when not said.
    pub fn beating_rows(&self, now_ms: u64, quiet_ms: u64) -> Vec<(WorkerId, Option<usize>, u64)> {
        self.infos()
            .filter(|w| now_ms.saturating_sub(w.heartbeat_ms) < quiet_ms)
            .map(|w| (w.id, w.core, w.routes_digest))
            .collect()
    }

    /// `(id, pid, tag, last heartbeat ms)` of rows with an owner.
    pub fn workers(&self) -> Vec<(WorkerId, u32, u32, u64)> {
        self.infos()
            .map(|w| (w.id, w.pid, w.tag, w.heartbeat_ms))
            .collect()
    }

    // --- slots --------------------------------------------------------------------------------

    /// Find or insert the peer slot of `key`, and stamp it as used now (see
    /// [`Segment::touch_peer`]). Keys longer than [`MAX_KEY_BYTES`] get `None`; `None` when
    /// the table is full. The same key gets the same slot for as long as the slot is in use;
    /// a slot freed by [`Segment::free_idle_peer_slots`] may be given to another key, with
    /// its ban, cells and stamp reset. Takes the slot-table lock (never on the data path).
    pub fn peer_slot(&self, key: &str) -> Option<PeerSlot> {
        let rows = self.peer_rows();
        self.insert_stamped(
            &self.header().peer_slot_lock,
            rows.len(),
            |i| (&rows[i].key, &rows[i].last_ref_ms),
            key,
            |i| {
                rows[i].banned_until_ms.store(0, Ordering::Relaxed);
                rows[i]
                    .cells
                    .iter()
                    .for_each(|c| c.store(0, Ordering::Relaxed));
            },
        )
        .map(|i| PeerSlot(i as u32))
    }
    /// Find or insert the route slot of `key`, and stamp it as used now (see
    /// [`Segment::touch_route`]). As [`Segment::peer_slot`]: the same key gets the same slot
    /// for as long as the slot is in use, and a slot freed by
    /// [`Segment::free_idle_route_slots`] goes to a new key with its cells reset. Takes the
    /// route slot-table lock (never on the data path).
    pub fn route_slot(&self, key: &str) -> Option<RouteSlot> {
        let rows = self.route_rows();
        self.insert_stamped(
            &self.header().route_slot_lock,
            rows.len(),
            |i| (&rows[i].key, &rows[i].last_ref_ms),
            key,
            |i| {
                rows[i]
                    .cells
                    .iter()
                    .for_each(|c| c.store(0, Ordering::Relaxed))
            },
        )
        .map(|i| RouteSlot(i as u32))
    }

    /// Find or insert `key` in a table of `n` slots (slot `i`'s key record and use stamp
    /// from `row(i)`) under the table's slot lock `lock`, and stamp the slot as used now. A
    /// reused slot gets `reset(i)` (its values) and a fresh stamp before it is published.
    fn insert_stamped<'a>(
        &'a self,
        lock: &'a AtomicU64,
        n: usize,
        row: impl Fn(usize) -> (&'a KeyRec, &'a AtomicU64),
        key: &str,
        reset: impl Fn(usize),
    ) -> Option<usize> {
        let _lock = self.lock_slots(lock);
        let now = now_ms();
        let i = slot_lookup(
            n,
            |i| row(i).0,
            key,
            true,
            |i| {
                reset(i);
                row(i).1.store(now, Ordering::Relaxed);
            },
        )?;
        // Under the lock, so no free round can take the slot between finding and stamping.
        row(i).1.fetch_max(now, Ordering::Relaxed);
        Some(i)
    }
    /// Look up a peer slot without inserting (nor stamping).
    pub fn find_peer_slot(&self, key: &str) -> Option<PeerSlot> {
        let rows = self.peer_rows();
        slot_lookup(rows.len(), |i| &rows[i].key, key, false, |_| {}).map(|i| PeerSlot(i as u32))
    }
    /// Look up a route slot without inserting.
    pub fn find_route_slot(&self, key: &str) -> Option<RouteSlot> {
        let rows = self.route_rows();
        slot_lookup(rows.len(), |i| &rows[i].key, key, false, |_| {}).map(|i| RouteSlot(i as u32))
    }

    /// Stamp peer slot `p` as still used at `now_ms` (wall clock). Every process calls this,
    /// more often than the `idle_ms` its lease holder frees with, for every slot it may still
    /// touch: those of its current configuration and of any older one a request or task
    /// still holds. A stamp never moves back (a clock stepped back leaves it ahead).
    pub fn touch_peer(&self, p: PeerSlot, now_ms: u64) {
        stamp(&self.peer(p).last_ref_ms, now_ms);
    }
    /// When peer slot `p` was last stamped as used (ms since the epoch).
    pub fn peer_last_ref_ms(&self, p: PeerSlot) -> u64 {
        self.peer(p).last_ref_ms.load(Ordering::Relaxed)
    }
    /// Stamp route slot `r` as still used at `now_ms`, as [`Segment::touch_peer`] does.
    pub fn touch_route(&self, r: RouteSlot, now_ms: u64) {
        stamp(&self.route_rows()[r.0 as usize].last_ref_ms, now_ms);
    }
    /// When route slot `r` was last stamped as used (ms since the epoch).
    pub fn route_last_ref_ms(&self, r: RouteSlot) -> u64 {
        self.route_rows()[r.0 as usize]
            .last_ref_ms
            .load(Ordering::Relaxed)
    }

    /// The owned worker rows (claimed, being claimed or reset), or `None` when one of the
    /// owned ones has gone `beat_ms` before `now_ms` without a heartbeat: a stalled or
    /// stopped process stamps nothing either, so nothing may be freed.
    fn owned_rows_if_beating(&self, now_ms: u64, beat_ms: u64) -> Option<Vec<WorkerId>> {
        let mut owned = Vec::new();
        let hw = self.header().rows_high_water.load(Ordering::Acquire) as usize;
        for (i, row) in self.worker_rows().iter().enumerate().take(hw) {
            let v = row.pid.load(Ordering::Acquire);
            if v == 0 {
                continue;
            }
            let quiet = now_ms.saturating_sub(row.heartbeat_ms.load(Ordering::Relaxed));
            if owner(v).is_some() && quiet > beat_ms {
                return None;
            }
            // Rows being claimed or reset count too: their counts are on their way to 0.
            owned.push(WorkerId(i as u32));
        }
        Some(owned)
    }

    /// Free every peer slot that nobody has stamped for `idle_ms` before `now_ms` and that
    /// has no request in flight in any owned worker row, and every slot an inserter died
    /// before publishing (`ABANDONED`); returns how many. Freed slots are no longer found by
    /// their key and are reused (reset) by later inserts.
    ///
    /// Nothing is freed while any owned worker row has gone `beat_ms` without a heartbeat:
    /// a stalled or stopped process stamps nothing either, and its slots must not look idle
    /// (a dead one's rows are reclaimed first, see [`Segment::reclaim_dead_quiet`]). So that
    /// a live process's slots are never freed, it must stamp them (and then heartbeat) at
    /// intervals that, added to `beat_ms`, stay well under `idle_ms`. Skips the round when
    /// another process holds the slot-table lock.
    pub fn free_idle_peer_slots(&self, now_ms: u64, idle_ms: u64, beat_ms: u64) -> u32 {
        let Some(_lock) = self.try_lock_slots(&self.header().peer_slot_lock) else {
            return 0;
        };
        let Some(owned) = self.owned_rows_if_beating(now_ms, beat_ms) else {
            return 0;
        };
        let mut n = 0;
        for (i, row) in self.peer_rows().iter().enumerate() {
            let p = PeerSlot(i as u32);
            n += u32::from(free_if_idle(
                &row.key,
                &row.last_ref_ms,
                now_ms,
                idle_ms,
                || owned.iter().all(|&w| self.inflight_of(w, p) == 0),
            ));
        }
        n
    }

    /// Free every route slot that nobody has stamped for `idle_ms` before `now_ms`, and every
    /// slot an inserter died before publishing; returns how many. The rules of
    /// [`Segment::free_idle_peer_slots`] hold (nothing is freed while a worker row is quiet,
    /// the round is skipped while another process holds the lock); a route row has no
    /// in-flight count, so only the stamp tells.
    pub fn free_idle_route_slots(&self, now_ms: u64, idle_ms: u64, beat_ms: u64) -> u32 {
        let Some(_lock) = self.try_lock_slots(&self.header().route_slot_lock) else {
            return 0;
        };
        if self.owned_rows_if_beating(now_ms, beat_ms).is_none() {
            return 0;
        }
        let mut n = 0;
        for row in self.route_rows() {
            n += u32::from(free_if_idle(
                &row.key,
                &row.last_ref_ms,
                now_ms,
                idle_ms,
                || true,
            ));
        }
        n
    }

    /// Take a slot-table lock (`lock`, one of the header's), waiting for it (inserts and
    /// frees are short). A holder that died, or that has held it implausibly long, loses it.
    fn lock_slots<'a>(&'a self, lock: &'a AtomicU64) -> SlotLock<'a> {
        let mut spins: u32 = 0;
        loop {
            if let Some(l) = self.try_lock_slots(lock) {
                return l;
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                hint::spin_loop();
            } else if spins < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn try_lock_slots<'a>(&'a self, lock: &'a AtomicU64) -> Option<SlotLock<'a>> {
        let now = now_ms();
        let word = (u64::from(std::process::id()) << 32) | (now & 0xffff_ffff);
        let cur = lock.load(Ordering::Acquire);
        if cur != 0 {
            let age = i64::from((now as u32).wrapping_sub(cur as u32) as i32);
            let dead = || !pid_alive((cur >> 32) as u32);
            let stale = if age < 0 {
                // Taken "in the future": the clock went back since. Only a dead holder
                // loses it (a live one gives it back within microseconds).
                dead()
            } else {
                age >= SLOT_LOCK_STALE_MS || (age >= SLOT_LOCK_DEAD_MS && dead())
            };
            if !stale {
                return None;
            }
        }
        lock.compare_exchange(cur, word, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SlotLock { lock, word })
    }
    /// How many peer and route slots are taken (in any state but empty or freed): against
    /// [`Segment::caps`], how close the tables are to full.
    pub fn slots_taken(&self) -> (u32, u32) {
        let taken = |k: &KeyRec| !matches!(k.state.load(Ordering::Acquire), EMPTY | FREED);
        let peers = self.peer_rows().iter().filter(|r| taken(&r.key)).count();
        let routes = self.route_rows().iter().filter(|r| taken(&r.key)).count();
        (peers as u32, routes as u32)
    }
    /// Every ready peer slot with its key, in slot order.
    pub fn peer_keys(&self) -> Vec<(PeerSlot, String)> {
        self.peer_rows()
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((PeerSlot(i as u32), read_key(&r.key)?)))
            .collect()
    }
    /// Every ready route slot with its key, in slot order.
    pub fn route_keys(&self) -> Vec<(RouteSlot, String)> {
        self.route_rows()
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((RouteSlot(i as u32), read_key(&r.key)?)))
            .collect()
    }

    // --- in-flight ----------------------------------------------------------------------------

    /// Add `delta` to the in-flight count of peer `p` in row `w` (written only by the row's owner).
    pub fn inflight_add(&self, w: WorkerId, p: PeerSlot, delta: i64) {
        self.inflight_cell(w, p).fetch_add(delta, Ordering::Relaxed);
    }
    /// Sum over all owned rows (free rows skipped); negative sums read as 0.
    pub fn inflight(&self, p: PeerSlot) -> i64 {
        self.inflight_sum(p).max(0)
    }
    /// Sum over all owned rows as it is, below 0 too (a row set by hand can hold a
    /// negative count that offsets the others).
    pub fn inflight_sum(&self, p: PeerSlot) -> i64 {
        let _ = self.peer(p); // bounds check like every other accessor
        self.live_rows()
            .map(|(i, _)| {
                self.inflight_cell(WorkerId(i as u32), p)
                    .load(Ordering::Relaxed)
            })
            .sum()
    }
    /// Row `w`'s own count for peer `p`.
    pub fn inflight_of(&self, w: WorkerId, p: PeerSlot) -> i64 {
        self.inflight_cell(w, p).load(Ordering::Relaxed)
    }
    /// Overwrite the row's own count (used by a debug endpoint).
    pub fn inflight_set(&self, w: WorkerId, p: PeerSlot, v: i64) {
        self.inflight_cell(w, p).store(v, Ordering::Relaxed);
    }
    fn inflight_cell(&self, w: WorkerId, p: PeerSlot) -> &AtomicI64 {
        assert!(p.0 < self.caps.peers, "peer slot {} out of range", p.0);
        &self.inflight_row(w)[p.0 as usize]
    }

    // --- bans ---------------------------------------------------------------------------------

    pub fn ban(&self, p: PeerSlot, until_ms: u64) {
        self.peer(p)
            .banned_until_ms
            .store(until_ms, Ordering::Relaxed);
    }
    /// Ban until `until_ms`, and say whether this call is the one that banned the peer
    /// (it was not banned at `now_ms`). One swap, so when several workers ban the same
    /// peer at once (all of them failing to connect to it), exactly one is told so and the
    /// ban is counted and logged once.
    pub fn ban_from(&self, p: PeerSlot, now_ms: u64, until_ms: u64) -> bool {
        let before = self
            .peer(p)
            .banned_until_ms
            .swap(until_ms, Ordering::Relaxed);
        before <= now_ms
    }
    pub fn unban(&self, p: PeerSlot) {
        self.peer(p).banned_until_ms.store(0, Ordering::Relaxed);
    }
    /// 0 = not banned.
    pub fn banned_until_ms(&self, p: PeerSlot) -> u64 {
        self.peer(p).banned_until_ms.load(Ordering::Relaxed)
    }
    pub fn is_banned(&self, p: PeerSlot, now_ms: u64) -> bool {
        self.banned_until_ms(p) > now_ms
    }

    // --- generic cells ------------------------------------------------------------------------

    /// Panics when `i >= PEER_CELLS` or the slot is out of range.
    pub fn peer_cell(&self, p: PeerSlot, i: usize) -> &AtomicU64 {
        &self.peer(p).cells[i]
    }
    /// Panics when `i >= ROUTE_CELLS` or the slot is out of range.
    pub fn route_cell(&self, r: RouteSlot, i: usize) -> &AtomicU64 {
        &self.route_rows()[r.0 as usize].cells[i]
    }
    /// Panics when `i >= GLOBAL_CELLS`.
    pub fn global_cell(&self, i: usize) -> &AtomicU64 {
        &self.header().globals[i]
    }

    // --- session placements -------------------------------------------------------------------

    /// The peer recorded for session `key` (any u64; 0 is stored as 1), refreshing its last-use
    /// time to `now_s`. `None` when the table does not hold it (never placed, forgotten, or
    /// being replaced this instant).
    pub fn session_peer(&self, key: u64, now_s: u64) -> Option<u32> {
        let key = session_key(key);
        let rows = self
            .try_session_rows()
            .expect("session rows checked at open");
        for row in session_window(rows, key) {
            match row.key.load(Ordering::Acquire) {
                k if k == key => {
                    let v = row.val.load(Ordering::Acquire);
                    if session_check(v) != session_check_of(key) {
                        return None;
                    }
                    let fresh = session_val(key, (v >> 32) as u32, now_s);
                    if fresh != v {
                        // Losing this race to another refresh or a replacement is fine.
                        let _ =
                            row.val
                                .compare_exchange(v, fresh, Ordering::AcqRel, Ordering::Relaxed);
                    }
                    return Some((v >> 32) as u32);
                }
                // Slots are filled front to back and never emptied: the key is not further on.
                0 => return None,
                _ => {}
            }
        }
        None
    }

    /// Record that session `key` lives on `peer`: its own slot if it has one, else the first
    /// empty slot of its window, else the window's least recently used one. Two workers placing
    /// the same new session at once both succeed; the later value stands.
    pub fn set_session_peer(&self, key: u64, peer: u32, now_s: u64) {
        let key = session_key(key);
        let rows = self
            .try_session_rows()
            .expect("session rows checked at open");
        let val = session_val(key, peer, now_s);
        for _ in 0..4 {
            let mut victim: Option<(&SessionRow, u64, u64)> = None; // row, its key, its age
            for row in session_window(rows, key) {
                let k = row.key.load(Ordering::Acquire);
                if k == key {
                    row.val.store(val, Ordering::Release);
                    return;
                }
                if k == 0 {
                    victim = Some((row, 0, u64::MAX));
                    break;
                }
                let age = session_age(row.val.load(Ordering::Relaxed), now_s);
                if victim.is_none_or(|(_, _, a)| age > a) {
                    victim = Some((row, k, age));
                }
            }
            let Some((row, old, _)) = victim else {
                return;
            };
            if row
                .key
                .compare_exchange(old, key, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                row.val.store(val, Ordering::Release);
                return;
            }
            // Another worker took that slot first: look again.
        }
    }

    // --- lease --------------------------------------------------------------------------------

    /// Acquire the lease if it is free or expired, or renew it if `holder` (non-zero) already
    /// holds it, until `now_ms + ttl_ms`. Returns whether `holder` holds it after the call.
    ///
    /// Every change goes through a CAS on the expiry word; a takeover first swaps in a claim
    /// marker, then writes the holder, then the new expiry, so two contenders never both win.
    pub fn try_lease(&self, holder: u64, now_ms: u64, ttl_ms: u64) -> bool {
        if holder == 0 {
            return false;
        }
        let h = self.header();
        let until = now_ms.saturating_add(ttl_ms) & !LEASE_CLAIMING;
        for _ in 0..64 {
            let e = h.lease_expires.load(Ordering::Acquire);
            let cur = h.lease_holder.load(Ordering::Acquire);
            let claiming = e & LEASE_CLAIMING != 0;
            let free = if claiming {
                // Somebody is mid-claim; only a marker left by a dead claimer is up for grabs
                // (or one "from the future": the clock stepped back since it was set).
                let at = e & !LEASE_CLAIMING;
                now_ms > at.saturating_add(LEASE_CLAIM_STALE_MS)
                    || at > now_ms.saturating_add(LEASE_CLAIM_STALE_MS)
            } else {
                cur == 0
                    || e <= now_ms
                    || e > now_ms
                        .saturating_add(ttl_ms)
                        .saturating_add(LEASE_CLOCK_STEP_MS)
            };
            if !claiming && cur == holder {
                // Renew. The holder only changes after a CAS on `lease_expires`, so if this CAS
                // succeeds nobody took the lease since we read `cur`.
                if h.lease_expires
                    .compare_exchange(e, until, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return true;
                }
                continue;
            }
            if !free {
                return false;
            }
            let marker = LEASE_CLAIMING | (now_ms & !LEASE_CLAIMING);
            if h.lease_expires
                .compare_exchange(e, marker, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                h.lease_holder.store(holder, Ordering::Release);
                h.lease_expires.store(until, Ordering::Release);
                return true;
            }
        }
        false
    }

    /// `(holder, expires_ms)`; holder 0 = none.
    pub fn lease(&self) -> (u64, u64) {
        let h = self.header();
        let e = h.lease_expires.load(Ordering::Acquire);
        (h.lease_holder.load(Ordering::Acquire), e & !LEASE_CLAIMING)
    }

    /// Give the lease up if `holder` holds it.
    pub fn release_lease(&self, holder: u64) {
        let h = self.header();
        let e = h.lease_expires.load(Ordering::Acquire);
        if e & LEASE_CLAIMING != 0 || h.lease_holder.load(Ordering::Acquire) != holder {
            return;
        }
        let marker = LEASE_CLAIMING | (now_ms() & !LEASE_CLAIMING);
        if h.lease_expires
            .compare_exchange(e, marker, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            h.lease_holder.store(0, Ordering::Release);
            h.lease_expires.store(0, Ordering::Release);
        }
    }
}

/// A held slot-table lock; released on drop (unless a stale-lock taker took it).
struct SlotLock<'a> {
    lock: &'a AtomicU64,
    word: u64,
}

impl Drop for SlotLock<'_> {
    fn drop(&mut self) {
        let _ = self
            .lock
            .compare_exchange(self.word, 0, Ordering::Release, Ordering::Relaxed);
    }
}

fn owner(v: u32) -> Option<u32> {
    (v != 0 && v & RESETTING == 0).then_some(v)
}

/// Stamp a slot as used at `now_ms`, unless it already holds a later time (a clock stepped
/// back leaves it ahead). A load and a store, not a read-modify-write: two stampers racing
/// may leave the older of two nearly equal times, which is harmless.
fn stamp(last_ref_ms: &AtomicU64, now_ms: u64) {
    if last_ref_ms.load(Ordering::Relaxed) < now_ms {
        last_ref_ms.store(now_ms, Ordering::Relaxed);
    }
}

/// One step of a free round (the table's slot lock held): an `ABANDONED` slot (an insert
/// whose process died before publishing it, which nobody ever got and which would otherwise
/// stay taken for the life of the segment) is freed; a `READY` one when its stamp is
/// `idle_ms` old and `unused()` agrees. Whether it freed the slot.
fn free_if_idle(
    key: &KeyRec,
    last_ref_ms: &AtomicU64,
    now_ms: u64,
    idle_ms: u64,
    unused: impl FnOnce() -> bool,
) -> bool {
    let from = match key.state.load(Ordering::Acquire) {
        ABANDONED => ABANDONED,
        READY => {
            let idle = now_ms.saturating_sub(last_ref_ms.load(Ordering::Relaxed));
            if idle < idle_ms || !unused() {
                return false;
            }
            READY
        }
        _ => return false,
    };
    key.state
        .compare_exchange(from, FREED, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

// ---------------------------------------------------------------------------------------------
// Slot tables: open addressing, linear probing, lock-free insert
// ---------------------------------------------------------------------------------------------

/// FNV-1a 64: stable across builds and processes (std's hasher is not promised to be).
fn key_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn pack_key(bytes: &[u8]) -> [u64; KEY_WORDS] {
    let mut words = [0u64; KEY_WORDS];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    words
}

/// The key of a ready slot.
fn read_key(rec: &KeyRec) -> Option<String> {
    if rec.state.load(Ordering::Acquire) != READY {
        return None;
    }
    let len = (rec.key_len.load(Ordering::Relaxed) as usize).min(KEY_WORDS * 8);
    let mut bytes = Vec::with_capacity(KEY_WORDS * 8);
    for w in &rec.key {
        bytes.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
    }
    bytes.truncate(len);
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// Wait for a slot in `WRITING` to settle. Spins briefly, then yields; marks the slot
/// `ABANDONED` when its writer process is dead or it stays unsettled too long.
fn wait_settled(rec: &KeyRec) {
    for _ in 0..128 {
        if rec.state.load(Ordering::Acquire) != WRITING {
            return;
        }
        hint::spin_loop();
    }
    let start = Instant::now();
    let mut n: u32 = 0;
    while rec.state.load(Ordering::Acquire) == WRITING {
        n = n.wrapping_add(1);
        if n & 63 == 0 {
            let wp = rec.writer_pid.load(Ordering::Relaxed);
            let dead = wp != 0 && !pid_alive(wp);
            if dead || start.elapsed() > SLOT_WRITE_STALE {
                let _ = rec.state.compare_exchange(
                    WRITING,
                    ABANDONED,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                return;
            }
        }
        std::thread::yield_now();
    }
}

/// What became of an attempt to take a slot for a key.
enum Claim {
    Taken,
    /// Another inserter changed the slot first.
    Lost,
    /// A waiter gave up on us and marked the slot abandoned.
    Abandoned,
}

/// Take slot `r` (in state `from`) for the key: `from`→`WRITING`, write the key, call
/// `reset` (which clears a reused slot's values before anybody can find it), `WRITING`→`READY`.
fn claim_slot(r: &KeyRec, from: u32, bytes: &[u8], hash: u64, reset: impl FnOnce()) -> Claim {
    if r.state
        .compare_exchange(from, WRITING, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return Claim::Lost;
    }
    r.writer_pid.store(std::process::id(), Ordering::Relaxed);
    r.key_len.store(bytes.len() as u32, Ordering::Relaxed);
    r.hash.store(hash, Ordering::Relaxed);
    for (cell, w) in r.key.iter().zip(pack_key(bytes)) {
        cell.store(w, Ordering::Relaxed);
    }
    reset();
    match r
        .state
        .compare_exchange(WRITING, READY, Ordering::Release, Ordering::Relaxed)
    {
        Ok(_) => Claim::Taken,
        Err(_) => Claim::Abandoned,
    }
}

/// Find (and with `insert`, insert) `key` in a table of `n` slots; returns the slot index.
///
/// Lookups probe past `FREED` and `ABANDONED` slots and stop at the first `EMPTY` one
/// (inserts fill the first empty slot, so the key is not further on). An insert reuses the
/// first `FREED` slot of the probe only once it has seen the key is absent (an `EMPTY` slot
/// or the whole table), calling `reset(index)` before publishing it. Inserts run under the
/// table's slot lock only, so no two inserts of one key can each take a different freed slot.
fn slot_lookup<'a>(
    n: usize,
    rec: impl Fn(usize) -> &'a KeyRec,
    key: &str,
    insert: bool,
    reset: impl Fn(usize),
) -> Option<usize> {
    let bytes = key.as_bytes();
    if bytes.len() > MAX_KEY_BYTES || n == 0 {
        return None;
    }
    let words = pack_key(bytes);
    let hash = key_hash(bytes);
    let start = (hash % n as u64) as usize;
    // A freed slot taken by somebody else under our feet (only possible without the lock):
    // start over, a bounded number of times.
    'scan: for _ in 0..8 {
        let mut probe = 0;
        let mut freed: Option<usize> = None;
        while probe < n {
            let i = (start + probe) % n;
            let r = rec(i);
            match r.state.load(Ordering::Acquire) {
                EMPTY => {
                    if !insert {
                        return None; // inserts take the first empty slot: the key is absent
                    }
                    if let Some(f) = freed {
                        match claim_slot(rec(f), FREED, bytes, hash, || reset(f)) {
                            Claim::Taken => return Some(f),
                            Claim::Lost | Claim::Abandoned => continue 'scan,
                        }
                    }
                    match claim_slot(r, EMPTY, bytes, hash, || {}) {
                        Claim::Taken => return Some(i),
                        Claim::Lost => {} // lost the race: look at this slot again
                        Claim::Abandoned => probe += 1,
                    }
                }
                WRITING => wait_settled(r), // then look at this slot again
                READY => {
                    let same = r.hash.load(Ordering::Relaxed) == hash
                        && r.key_len.load(Ordering::Relaxed) as usize == bytes.len()
                        && r.key
                            .iter()
                            .zip(words)
                            .all(|(c, w)| c.load(Ordering::Relaxed) == w);
                    if same {
                        return Some(i);
                    }
                    probe += 1;
                }
                FREED => {
                    freed.get_or_insert(i);
                    probe += 1;
                }
                _ => probe += 1, // abandoned
            }
        }
        // Every slot is taken or freed, and the key is in none of them.
        let f = freed.filter(|_| insert)?;
        match claim_slot(rec(f), FREED, bytes, hash, || reset(f)) {
            Claim::Taken => return Some(f),
            Claim::Lost | Claim::Abandoned => continue 'scan,
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Free functions
// ---------------------------------------------------------------------------------------------

/// The calling thread's CPU time in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`), `None` if the
/// clock cannot be read.
///
/// This clock has no vDSO path: every call enters the kernel, which brings the thread's
/// run time up to date (`update_curr`) before it answers. That is also where a CPU quota
/// (a cgroup's `cpu.max`, `docker --cpus`, a Kubernetes CPU limit) is charged: a thread
/// that never blocks is otherwise charged only at the next timer tick, overruns its quota
/// by up to a tick, and pays the overrun back as a longer stall in the next period.
pub fn thread_cpu_time_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable `timespec` for the duration of the call, which
    // only writes through the pointer; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return None;
    }
    Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// What waits in a socket's receive queue, looked at without taking it: see
/// [`socket_pending`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    /// Nothing to read yet: the socket is quiet.
    Nothing,
    /// Bytes wait to be read.
    Bytes,
    /// The peer closed the connection or reset it (or `fd` is not a usable socket).
    Closed,
}

/// Looks at socket `fd`'s receive queue without blocking and without taking anything from
/// it (`recv` with `MSG_PEEK | MSG_DONTWAIT`): for a pooled upstream connection before a
/// request goes on it, since bytes a peer sent on an idle connection (an unsolicited 408
/// at its idle timeout) would otherwise be read as the next request's response.
pub fn socket_pending(fd: std::os::fd::RawFd) -> Pending {
    let mut b = [0u8; 1];
    // SAFETY: `b` is a valid, writable buffer of the length passed, for the duration of
    // the call; with MSG_PEEK | MSG_DONTWAIT the kernel only copies into it and returns at
    // once. An `fd` that is not an open socket makes the call fail (EBADF, ENOTSOCK),
    // which is reported, not undefined behaviour.
    let n = unsafe {
        libc::recv(
            fd,
            b.as_mut_ptr().cast(),
            b.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        1.. => Pending::Bytes,
        0 => Pending::Closed,
        _ => match io::Error::last_os_error().kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Pending::Nothing,
            _ => Pending::Closed,
        },
    }
}

/// Wall-clock milliseconds since the Unix epoch (shared meaning across processes).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn session_key(key: u64) -> u64 {
    key.max(1)
}

fn session_check_of(key: u64) -> u64 {
    (key >> 56) & 0xff
}

fn session_check(val: u64) -> u64 {
    (val >> SESSION_TIME_BITS) & 0xff
}

fn session_val(key: u64, peer: u32, now_s: u64) -> u64 {
    let time = now_s & ((1 << SESSION_TIME_BITS) - 1);
    (u64::from(peer) << 32) | (session_check_of(key) << SESSION_TIME_BITS) | time
}

/// Seconds since the value's last use, modulo the time field's range.
fn session_age(val: u64, now_s: u64) -> u64 {
    let mask = (1 << SESSION_TIME_BITS) - 1;
    now_s.wrapping_sub(val & mask) & mask
}

/// The probe window of `key`: `SESSION_PROBE` slots from `key % SESSION_SLOTS`, wrapping.
fn session_window(rows: &[SessionRow], key: u64) -> impl Iterator<Item = &SessionRow> {
    let start = key % SESSION_SLOTS;
    (0..SESSION_PROBE).map(move |i| &rows[((start + i) % SESSION_SLOTS) as usize])
}

/// The process's open-file limit: (soft, hard).
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the call to fill; nothing else is passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((r.rlim_cur, r.rlim_max))
}

/// Set the soft open-file limit (it may not exceed the hard one).
pub fn set_nofile_soft(soft: u64) -> io::Result<()> {
    let (_, hard) = nofile_limit()?;
    let r = libc::rlimit {
        rlim_cur: soft as libc::rlim_t,
        rlim_max: hard as libc::rlim_t,
    };
    // SAFETY: `r` is a valid rlimit read by the call; nothing else is passed.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Raise the soft open-file limit to the hard one (every proxied stream holds two
/// descriptors, and systemd's default soft limit is 1024 under a hard one of 524288).
/// Returns the limits before and after: (old soft, new soft).
pub fn raise_nofile_limit() -> io::Result<(u64, u64)> {
    let (soft, hard) = nofile_limit()?;
    if soft < hard {
        set_nofile_soft(hard)?;
    }
    Ok((soft, nofile_limit()?.0))
}

/// Whether a process with this pid exists (`kill(pid, 0)`; EPERM counts as alive) and is
/// not dying: a process that is exiting (a `kill -9` takes a moment to tear it down) or
/// exited and not yet reaped (a zombie) is dead, as `/proc/PID/stat` says. Its rows are
/// reclaimed at once then, not after the heartbeat timeout: a router restarted right after
/// a crash would otherwise count the dead one's in-flight requests for a while. Pid 0 and
/// pids that do not fit `pid_t` are never alive.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled; nothing is
    // delivered and no memory is passed.
    let r = unsafe { libc::kill(p, 0) };
    let exists = r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !dying(pid)
}

/// `PF_EXITING` in `/proc/PID/stat`'s flags: the process is being torn down.
const PF_EXITING: u64 = 0x4;

/// Whether `/proc/PID/stat` shows the process as a zombie, dead, or exiting. A `/proc` that
/// cannot be read (not mounted) says nothing: false.
fn dying(pid: u32) -> bool {
    let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat_says_dying(&stat)
}

/// [`dying`] on the text of a `/proc/PID/stat`: `pid (comm) state ppid pgrp session tty_nr
/// tpgid flags ...`, where `comm` may hold spaces and parentheses (so the fields start after
/// the last `)`).
fn stat_says_dying(stat: &[u8]) -> bool {
    let Some(close) = stat.iter().rposition(|&b| b == b')') else {
        return false;
    };
    let rest = String::from_utf8_lossy(&stat[close + 1..]);
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next().unwrap_or("");
    let flags = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// Ask another process to drain: send it SIGQUIT (used by `--takeover` to retire the router
/// it replaces). Pid 0, negative and this process's own pid are refused.
pub fn signal_drain(pid: u32) -> io::Result<()> {
    let p = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    if p <= 0 || pid == std::process::id() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal this pid",
        ));
    }
    // SAFETY: kill takes plain integers; SIGQUIT goes to exactly one positive pid (never a
    // process group, never this process), and no memory is passed.
    let r = unsafe { libc::kill(p, libc::SIGQUIT) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests;
