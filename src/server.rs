//! The router as a value: load config, open the segment, start the workers, reload,
//! drain. `main` drives it from the command line and signals; tests and the demo start it
//! in-process.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use warmroute_shm::{Capacities, Segment};

use crate::auth::{file_stamp, load_key_file, FileStamp, KeyFile, KeyFileStatus};
use crate::config::{self, Config, ConfigError};
use crate::snapshot::Snapshot;
use crate::worker::{default_worker_count, AccessLogTarget, StartOptions, WorkerRows, Workers};

/// Where the configuration comes from.
#[derive(Clone, Debug)]
pub enum ConfigSource {
    /// A server file (or none: all defaults, routes from `./routes`).
    Files(Option<PathBuf>),
    /// Text held in memory (the demo, tests): server TOML and (route name, route TOML).
    Embedded {
        server: Option<String>,
        routes: Vec<(String, String)>,
    },
}

impl ConfigSource {
    pub fn load(&self) -> Result<Config, Vec<ConfigError>> {
        match self {
            ConfigSource::Files(p) => config::load(p.as_deref()),
            ConfigSource::Embedded { server, routes } => {
                let r: Vec<(&str, &str)> = routes
                    .iter()
                    .map(|(a, b)| (a.as_str(), b.as_str()))
                    .collect();
                config::load_from_strs(server.as_deref(), &r)
            }
        }
    }
}

/// Command-line overrides of the server file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub workers: Option<usize>,
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub shm_path: Option<PathBuf>,
    pub takeover: bool,
    /// `--join`: serve alongside the routers already on the ports and segment.
    pub join: bool,
    pub no_pin: bool,
    pub access_log: Option<AccessLogTarget>,
}

pub struct Router {
    pub workers: Workers,
    pub seg: Arc<Segment>,
    source: ConfigSource,
    overrides: Overrides,
    generation: u64,
    pub config: Arc<Config>,
    /// The keys in force (kept across a reload that finds the key file empty or
    /// unreadable).
    keys: Arc<KeyFile>,
}

/// The command line's `--workers`, `--listen`, `--admin-listen` and `--shm` over the files'
/// values; a default segment path follows the port `--listen` gives.
pub fn apply_overrides(mut c: Config, o: &Overrides) -> Config {
    if let Some(w) = o.workers {
        c.server.workers = w;
    }
    if let Some(a) = o.listen {
        c.server.listen = a;
        if c.server.shm_path_is_default {
            c.server.shm_path = crate::config::default_shm_path(&a);
        }
    }
    if let Some(a) = o.admin_listen {
        c.server.admin_listen = a;
    }
    if let Some(p) = &o.shm_path {
        c.server.shm_path = p.clone();
    }
    c
}

/// Startup failure: configuration errors (all of them) or an IO problem.
#[derive(Debug)]
pub enum StartError {
    Config(Vec<ConfigError>),
    Io(io::Error),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(errs) => {
                for e in errs {
                    writeln!(f, "{e}")?;
                }
                Ok(())
            }
            // Each line ends with a newline, as the configuration errors' do.
            StartError::Io(e) => writeln!(f, "{e}"),
        }
    }
}

/// The segment's fixed capacity. Route slots hold more than routes: each pool of a route
/// has three (TTFT and decode-rate windows, control) and each reject rule one hit counter,
/// so they are sized well past the 1024-route limit; peers likewise past 1024 per route
/// across a few large routes. Both leave room for reloads: the slots no configuration uses
/// any more are freed (`control::SLOT_IDLE_MS`).
/// Worker rows hold this router's workers and, during a takeover, those of the router it
/// replaces: twice the worker count or the CPU count, whichever is larger, in steps of 64
/// (so a small change of the count keeps the layout), 64 at least. The CPU count, because a
/// segment keeps the size its first router gave it for as long as takeovers share it: a
/// router of 16 workers followed by one of 40 on a 48-CPU host would otherwise leave 64
/// rows, too few for the next takeover of the 40.
fn segment_capacities(workers: usize, cpus: usize) -> Capacities {
    let rows = (2 * workers.max(cpus)).max(1).div_ceil(64) * 64;
    Capacities {
        workers: u32::try_from(rows)
            .unwrap_or(u32::MAX)
            .min(warmroute_shm::MAX_WORKERS),
        peers: 8192,
        routes: 8192,
    }
}

/// Open the segment sized for `workers` and claim a worker row for each, with the core it
/// is to be pinned to (`cores`: the affinity mask's core ids; empty = no pinning). When a
/// live router (one a takeover replaces, or one a join serves alongside) owns the segment
/// with another worker capacity, share it as it is if its free rows suffice.
///
/// The rows are claimed before the file lock is let go, so that a router starting in the
/// same instant sees them: it neither takes the segment for unused (and reinitialises it
/// under this one's mapping) nor takes the served port for a stranger's.
fn open_segment(
    path: &std::path::Path,
    workers: usize,
    cpus: usize,
    cores: &[usize],
    ports: (u16, u16),
) -> io::Result<(Segment, WorkerRows)> {
    let caps = segment_capacities(workers, cpus);
    let claim = |seg: &Segment| claim_rows(seg, workers, cores, ports);
    match Segment::open_or_create_then(path, caps, claim) {
        // Another layout, owned by a live router: share it as it is, if its tables have the
        // same sizes, claiming under its lock as above.
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let same_tables =
                |seg: &Segment| seg.caps().peers == caps.peers && seg.caps().routes == caps.routes;
            let claim = |seg: &Segment| {
                if same_tables(seg) {
                    claim_rows(seg, workers, cores, ports).map(Some)
                } else {
                    Ok(None)
                }
            };
            match Segment::open_existing_then(path, claim) {
                Ok((seg, Some(rows))) => Ok((seg, rows)),
                Err(short) if short.kind() == io::ErrorKind::ResourceBusy => Err(short),
                _ => Err(e),
            }
        }
        other => other,
    }
}

/// Claim `workers` rows of `seg` for this process, each with a core: the ones the routers
/// already running there use least (`worker::pin::assign`).
fn claim_rows(
    seg: &Segment,
    workers: usize,
    cores: &[usize],
    (public, admin): (u16, u16),
) -> io::Result<WorkerRows> {
    reclaim_dead_rows(seg);
    let owned = seg.workers().len();
    let rows = seg.caps().workers as usize;
    if owned + workers > rows {
        return Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!(
                "{workers} workers need {workers} free worker rows, but {owned} of its {rows} are \
                 owned by live processes (routers joined on it or still draining, or one of more \
                 workers than this segment was sized for: a router that starts on the segment \
                 alone, without --takeover or --join, sizes it anew)"
            ),
        ));
    }
    let taken: Vec<usize> = seg
        .beating_rows(warmroute_shm::now_ms(), crate::worker::BEATING_MS)
        .into_iter()
        .filter_map(|(_, core, _)| core)
        .collect();
    let assigned = crate::worker::assign_cores(cores, &taken, workers);
    let pid = std::process::id();
    let mut claimed = Vec::with_capacity(workers);
    for idx in 0..workers {
        match seg.claim_worker(pid, idx as u32) {
            Ok(w) => {
                let core = assigned.get(idx).copied();
                seg.set_worker_core(w, core);
                seg.set_worker_ports(w, public, admin);
                claimed.push((w, core));
            }
            Err(e) => {
                for (w, _) in claimed {
                    seg.release_worker(w);
                }
                return Err(e);
            }
        }
    }
    Ok(claimed)
}

/// Remove the segment file a failed start created, unless another live process has rows
/// in it (a router that started alongside and opened it too). Under the file's lock, so a
/// router opening it meanwhile keeps a file that others can find.
fn discard_segment(path: &std::path::Path) {
    let _ = Segment::remove_unused(path);
}

/// The live processes other than this one that own worker rows in `seg`, sorted, each once.
fn other_live_pids(seg: &Segment) -> Vec<u32> {
    let me = std::process::id();
    let mut pids: Vec<u32> = seg
        .workers()
        .into_iter()
        .map(|(_, pid, _, _)| pid)
        .filter(|&p| p != me && warmroute_shm::pid_alive(p))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn reclaim_dead_rows(seg: &Segment) {
    let reclaimed = seg.reclaim_dead();
    if reclaimed > 0 {
        tracing::info!(rows = reclaimed, "reclaimed worker rows of a dead process");
    }
}

/// `--takeover` and `--join` share the ports (public and admin) with whoever serves them:
/// the routers whose rows are in the segment (which a takeover then retires and a join
/// serves alongside). A port served while the segment has no other live router is served
/// by something else (a router with another `shm_path`, or another program): the two would
/// split the connections for good, each with its own counts and limits.
fn refuse_sharing_with_a_stranger(
    seg: &Segment,
    shm_path: &std::path::Path,
    addr: std::net::SocketAddr,
    join: bool,
) -> io::Result<()> {
    if !crate::worker::port_served(addr) {
        return Ok(());
    }
    // Served: by a router of this segment if one says it listens on the port. One that
    // says nothing (a router from before the rows said their ports) is given the benefit
    // of the doubt.
    let me = std::process::id();
    let ours = seg.worker_ports().into_iter().any(|(pid, ports)| {
        pid != me
            && warmroute_shm::pid_alive(pid)
            && ports.is_none_or(|(p, a)| p == addr.port() || a == addr.port())
    });
    // Nor a port that is let go within a moment: the listeners of a router that has just
    // died (the kernel closes an io_uring's sockets after the process is gone).
    if ours || crate::worker::port_freed_within(addr, crate::worker::PORT_FREE_WAIT) {
        return Ok(());
    }
    let (flag, what) = if join {
        ("--join", "a join")
    } else {
        ("--takeover", "a takeover")
    };
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "{flag}: {addr} is served by a process that does not use the shared segment \
             {} (a router with another shm_path, or another program); {what} shares the \
             ports of the routers on its segment: give this one the same shm_path, or a \
             port that is free",
            shm_path.display()
        ),
    ))
}

/// `--takeover`: once this process's workers accept on the shared ports, ask every other
/// live process with rows in the segment (the router being replaced) to drain. Its
/// listeners close, in-flight requests and streams finish, and new connections land here.
fn retire_previous(workers: &Workers, seg: &Segment) {
    let t0 = std::time::Instant::now();
    while !workers.shared.ready() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = other_live_pids(seg);
    if pids.is_empty() {
        tracing::info!("takeover: no previous router found in the shared segment");
    }
    for pid in pids {
        match warmroute_shm::signal_drain(pid) {
            Ok(()) => tracing::info!(pid, "takeover: asked the previous router to drain"),
            Err(e) => {
                tracing::error!(pid, error = %e, "takeover: could not signal the previous router")
            }
        }
    }
}

/// Read the key file and say what it gave, unless that is what `before` (the keys in force,
/// on a reload) already said: a reload that finds the file as it was says nothing.
///
/// A file that was read with keys and now reads empty or unreadable is taken for a write in
/// progress (an editor truncating it first) or a broken mount, not for a decision to drop
/// authentication: the keys in force stay (`kept_previous`), for as long as the file stays
/// so. Fail-open is for a router that never had keys; a file removed on purpose (missing)
/// still turns the keys off.
fn load_keys(config: &Config, before: Option<&KeyFile>) -> KeyFile {
    let mut kf = load_key_file(config.server.api_keys_file.as_deref());
    if let Some(b) = before {
        if matches!(kf.status, KeyFileStatus::Empty | KeyFileStatus::Unreadable)
            && kf.path == b.path
            && !b.table.is_empty()
        {
            kf.table = b.table.clone();
            kf.kept_previous = true;
        }
        if kf.path == b.path
            && kf.status == b.status
            && kf.kept_previous == b.kept_previous
            && kf.status != KeyFileStatus::Ok
        {
            return kf;
        }
    }
    let path = kf
        .path
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(none configured)".into());
    match kf.status {
        KeyFileStatus::Ok => tracing::info!(path, keys = kf.table.len(), "API keys loaded"),
        status if kf.kept_previous => tracing::error!(
            path,
            status = status.as_str(),
            kept = kf.table.len(),
            "API key file is now {}: keeping the keys loaded before; authentication stays ON with them",
            status.as_str()
        ),
        KeyFileStatus::Unreadable => tracing::error!(
            path,
            "API key file is present but unreadable: authentication is OFF (fail-open)"
        ),
        KeyFileStatus::Unset => tracing::warn!(
            path,
            "key files are off (api_keys_file = \"\"): routes without their own api_keys accept every request"
        ),
        status => tracing::error!(
            path,
            status = status.as_str(),
            "no API keys: authentication is OFF (fail-open) for routes without their own api_keys"
        ),
    }
    kf
}

/// What asked for a reload.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ReloadCause {
    /// SIGHUP (or a peer's name moving): the operator's word, applied when valid.
    Signal,
    /// A change on disk the watcher saw.
    Watcher,
}

impl Router {
    pub fn start(source: ConfigSource, overrides: Overrides) -> Result<Router, StartError> {
        let config = source.load().map_err(StartError::Config)?;
        for w in &config.soft_errors {
            tracing::error!("{w}");
        }
        for w in &config.warnings {
            tracing::warn!("{w}");
        }
        let config = apply_overrides(config, &overrides);
        let server = &config.server;
        if let Some(message) = crate::config::listen_conflict(&server.listen, &server.admin_listen)
        {
            return Err(StartError::Config(vec![ConfigError {
                file: PathBuf::from("(command line)"),
                field: "--admin-listen".into(),
                message,
            }]));
        }
        let config = Arc::new(config);
        let server = &config.server;
        match warmroute_shm::raise_nofile_limit() {
            Ok((before, after)) if after > before => {
                tracing::info!(
                    before,
                    after,
                    "raised the open-file limit to the hard limit"
                );
            }
            Ok((_, after)) => tracing::debug!(limit = after, "open-file limit"),
            Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
        }
        let workers = match (overrides.workers, server.workers) {
            (Some(n), _) if n > 0 => n,
            (_, n) if n > 0 => n,
            _ => default_worker_count(),
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if workers > cpus {
            tracing::warn!(
                workers,
                cpus,
                "more workers than CPUs: workers share cores (one per core is the design)"
            );
        }
        // A segment file this start creates goes again if the start fails after (a port
        // already served, say): a refused start leaves nothing behind in /dev/shm.
        let created = !server.shm_path.exists();
        let cores: Vec<usize> = if overrides.no_pin {
            Vec::new()
        } else {
            crate::worker::mask_cores()
        };
        let ports = (server.listen.port(), server.admin_listen.port());
        let (seg, rows) =
            open_segment(&server.shm_path, workers, cpus, &cores, ports).map_err(|e| {
                if created {
                    discard_segment(&server.shm_path);
                }
                StartError::Io(io::Error::new(
                    e.kind(),
                    format!("shared segment {}: {e}", server.shm_path.display()),
                ))
            })?;
        let seg = Arc::new(seg);
        // A failed start gives its rows back (and removes a segment file it created).
        let discard = |e: io::Error| {
            for &(w, _) in &rows {
                seg.release_worker(w);
            }
            if created {
                discard_segment(&server.shm_path);
            }
            StartError::Io(e)
        };
        if overrides.takeover || overrides.join {
            for addr in [server.listen, server.admin_listen] {
                refuse_sharing_with_a_stranger(&seg, &server.shm_path, addr, overrides.join)
                    .map_err(discard)?;
            }
        }
        let keys = Arc::new(load_keys(&config, None));
        let snapshot = Arc::new(
            Snapshot::build(config.clone(), keys.clone(), &seg, 1)
                .map_err(|e| discard(io::Error::other(e)))?,
        );
        let opts = StartOptions {
            rows: rows.clone(),
            cores,
            public: server.listen,
            admin: server.admin_listen,
            share_ports: overrides.takeover || overrides.join,
            access_log: overrides
                .access_log
                .clone()
                .unwrap_or(AccessLogTarget::Stderr),
        };
        let workers = Workers::start(opts, snapshot, seg.clone()).map_err(discard)?;
        // The ports as bound (port 0 resolves there).
        for &(w, _) in &rows {
            let s = &workers.shared;
            seg.set_worker_ports(w, s.public_addr.port(), s.admin_addr.port());
        }
        if overrides.takeover {
            retire_previous(&workers, &seg);
        }
        tracing::info!(
            public = %workers.shared.public_addr,
            admin = %workers.shared.admin_addr,
            workers = workers.shared.workers_total,
            routes = config.routes.len(),
            "warmroute listening"
        );
        Ok(Router {
            workers,
            seg,
            source,
            overrides,
            generation: 1,
            config,
            keys,
        })
    }

    pub fn public_addr(&self) -> SocketAddr {
        self.workers.shared.public_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.workers.shared.admin_addr
    }

    /// The shared segment this router serves on (kept across reloads).
    pub fn shm_path(&self) -> &std::path::Path {
        &self.config.server.shm_path
    }

    /// Re-read and validate everything; on any error keep the running config. Listener
    /// and segment settings need a restart (or a takeover) and are kept as they are.
    pub fn reload(&mut self) -> Result<(), Vec<ConfigError>> {
        self.reload_from(ReloadCause::Signal)
    }

    /// `reload`, for a change the watcher saw on disk: one that leaves no route at all
    /// while routes are served (a deploy that empties the directory before copying, an
    /// `rsync --delete` half done) is not applied; SIGHUP applies it.
    pub fn reload_on_change(&mut self) -> Result<(), Vec<ConfigError>> {
        self.reload_from(ReloadCause::Watcher)
    }

    fn reload_from(&mut self, cause: ReloadCause) -> Result<(), Vec<ConfigError>> {
        let fresh = match self.source.load() {
            Ok(f) => f,
            Err(e) => {
                self.apply_key_file_alone();
                return Err(e);
            }
        };
        if cause == ReloadCause::Watcher
            && fresh.routes.is_empty()
            && !self.config.routes.is_empty()
        {
            self.apply_key_file_alone();
            return Err(vec![ConfigError {
                file: fresh.server.routes_dir.clone(),
                field: "(routes)".into(),
                message: format!(
                    "no route file left (the running configuration has {}); a change on disk that removes every route is not applied: send SIGHUP to apply it",
                    self.config.routes.len()
                ),
            }]);
        }
        // A value that is not what its option takes (the default applies) is an error (SPEC
        // §2.2), logged as one; a value read with a warning (a boolean as a string) is not.
        for w in &fresh.soft_errors {
            tracing::error!("{w}");
        }
        for w in &fresh.warnings {
            tracing::warn!("{w}");
        }
        let mut fresh = apply_overrides(fresh, &self.overrides);
        let old = &self.config.server;
        if fresh.server.listen != old.listen
            || fresh.server.admin_listen != old.admin_listen
            || fresh.server.shm_path != old.shm_path
        {
            tracing::warn!("listen addresses and shm_path change only on restart or takeover; keeping the running ones");
            fresh.server.listen = old.listen;
            fresh.server.admin_listen = old.admin_listen;
            fresh.server.shm_path = old.shm_path.clone();
        }
        if fresh.server.workers != old.workers {
            tracing::warn!("workers changes only on restart or takeover; keeping the running ones");
        }
        let fresh = Arc::new(fresh);
        let keys = Arc::new(load_keys(&fresh, Some(&self.keys)));
        let snap = Snapshot::build(fresh.clone(), keys.clone(), &self.seg, self.generation + 1)
            .map_err(|e| {
                vec![ConfigError {
                    file: self.config.server.shm_path.clone(),
                    field: "(slots)".into(),
                    message: e,
                }]
            })?;
        self.generation += 1;
        self.config = fresh;
        self.keys = keys;
        self.workers.publish(Arc::new(snap));
        tracing::info!(
            generation = self.generation,
            routes = self.config.routes.len(),
            "configuration reloaded"
        );
        Ok(())
    }

    /// A reload refused for the files on disk still applies a changed key file to the
    /// running configuration: a key taken out of the file (rotated out, revoked) stops
    /// working, and a new one works, whatever else is broken on disk.
    fn apply_key_file_alone(&mut self) {
        let Some(path) = self.config.server.api_keys_file.as_deref() else {
            return;
        };
        if crate::auth::file_stamp(path) == self.keys.stamp {
            return;
        }
        let keys = Arc::new(load_keys(&self.config, Some(&self.keys)));
        match Snapshot::build(
            self.config.clone(),
            keys.clone(),
            &self.seg,
            self.generation + 1,
        ) {
            Ok(snap) => {
                self.generation += 1;
                self.keys = keys;
                self.workers.publish(Arc::new(snap));
                tracing::warn!(
                    generation = self.generation,
                    "the key file changed: its keys are in force; the rest of the reload was refused"
                );
            }
            Err(e) => tracing::error!("the key file changed, but could not be applied: {e}"),
        }
    }

    /// What the watcher compares to notice changes on disk: the server file, every route
    /// file and the key file (following symlinks, so a Kubernetes secret swap counts).
    pub fn watch_stamp(&self) -> Vec<(PathBuf, FileStamp)> {
        let mut paths: Vec<PathBuf> = Vec::new();
        if let ConfigSource::Files(Some(p)) = &self.source {
            paths.push(p.clone());
        }
        if matches!(self.source, ConfigSource::Files(_)) {
            let dir = &self.config.server.routes_dir;
            paths.push(dir.clone());
            if let Ok(rd) = std::fs::read_dir(dir) {
                let mut files: Vec<PathBuf> = rd
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                    .collect();
                files.sort();
                paths.extend(files);
            }
        }
        if let Some(k) = &self.config.server.api_keys_file {
            paths.push(k.clone());
        }
        paths
            .into_iter()
            .map(|p| {
                let st = file_stamp(&p);
                (p, st)
            })
            .collect()
    }

    pub fn drain(&self, timeout: Duration) {
        self.workers.drain(timeout);
    }

    /// A peer given by name whose name no longer gives the address in use (a restarted
    /// pod, a moved service), as `route: host:port now a.b.c.d:port (was ...)`; `None` when
    /// every name still gives the address in use among its answers. A name that does not
    /// resolve now keeps its address. Each name is looked up once.
    pub fn peer_moved(&self) -> Option<String> {
        self.peer_moved_with(crate::config::resolve_peer_all)
    }

    fn peer_moved_with(
        &self,
        resolve: impl Fn(&str, u16) -> Result<Vec<SocketAddr>, String>,
    ) -> Option<String> {
        let mut looked_up = std::collections::HashMap::new();
        for r in &self.config.routes {
            for peer in r.pools.iter().flat_map(|p| &p.peers) {
                if crate::config::is_ip_literal(&peer.host) {
                    continue;
                }
                let now = looked_up
                    .entry((peer.host.as_str(), peer.port))
                    .or_insert_with(|| resolve(&peer.host, peer.port).unwrap_or_default());
                if let Some(first) = now.first() {
                    if !now.contains(&peer.addr) {
                        return Some(format!(
                            "{}: {}:{} now {first} (was {})",
                            r.name, peer.host, peer.port, peer.addr
                        ));
                    }
                }
            }
        }
        None
    }

    /// Every worker reopens its access-log file (after a rotation).
    pub fn reopen_logs(&self) {
        self.workers.reopen_logs();
    }

    /// Drain and wait for every worker to stop.
    pub fn shutdown(self, timeout: Duration) {
        self.workers.drain(timeout);
        self.workers.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_moves_the_default_segment_but_not_a_written_one() {
        let route = [("r", "peers = [ { host = \"127.0.0.1\", port = 9 } ]\n")];
        let moved = Overrides {
            listen: Some("127.0.0.1:9180".parse().unwrap()),
            ..Overrides::default()
        };
        // No shm_path written: two routers told apart only by --listen get a segment each.
        let c =
            crate::config::load_from_strs(Some("listen = \"127.0.0.1:9080\"\n"), &route).unwrap();
        assert_eq!(c.server.shm_path, PathBuf::from("/dev/shm/warmroute-9080"));
        let c = apply_overrides(c, &moved);
        assert_eq!(c.server.shm_path, PathBuf::from("/dev/shm/warmroute-9180"));
        // A written shm_path stays, even when it reads like the default.
        let c = crate::config::load_from_strs(
            Some("listen = \"127.0.0.1:9080\"\nshm_path = \"/dev/shm/warmroute-9080\"\n"),
            &route,
        )
        .unwrap();
        let c = apply_overrides(c, &moved);
        assert_eq!(c.server.shm_path, PathBuf::from("/dev/shm/warmroute-9080"));
        assert_eq!(c.server.listen, "127.0.0.1:9180".parse().unwrap());
    }

    #[test]
    fn a_peer_name_that_resolves_elsewhere_is_noticed() {
        let shm = std::env::temp_dir().join(format!("warmroute-dns-{}", std::process::id()));
        let route =
            "peers = [ { host = \"localhost\", port = 9 }, { host = \"127.0.0.1\", port = 10 } ]\n";
        let source = ConfigSource::Embedded {
            server: Some(format!(
                "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshm_path = \"{}\"\n",
                shm.display()
            )),
            routes: vec![("r".into(), route.into())],
        };
        let overrides = Overrides {
            workers: Some(1),
            no_pin: true,
            access_log: Some(crate::worker::AccessLogTarget::Off),
            ..Overrides::default()
        };
        let router = Router::start(source, overrides).unwrap();
        let looked_up = std::cell::RefCell::new(Vec::new());
        let dns = |to: &'static [&'static str]| {
            let looked_up = &looked_up;
            move |h: &str, p: u16| {
                looked_up.borrow_mut().push(h.to_string());
                Ok(to
                    .iter()
                    .map(|ip| SocketAddr::new(ip.parse().unwrap(), p))
                    .collect())
            }
        };
        // The control: the name still gives the address in use, alone or among others
        // (rotating answers do not reload).
        assert_eq!(router.peer_moved_with(dns(&["127.0.0.1"])), None);
        assert_eq!(
            router.peer_moved_with(dns(&["127.0.0.3", "127.0.0.1"])),
            None
        );
        let moved = router.peer_moved_with(dns(&["127.0.0.2"]));
        assert_eq!(
            moved.as_deref(),
            Some("r: localhost:9 now 127.0.0.2:9 (was 127.0.0.1:9)")
        );
        // The IP literal is never looked up; a failed lookup keeps the address.
        assert!(looked_up.borrow().iter().all(|h| h == "localhost"));
        assert_eq!(router.peer_moved_with(|_, _| Err("no answer".into())), None);
        router.shutdown(Duration::from_secs(1));
        let _ = std::fs::remove_file(&shm);
    }

    #[test]
    fn worker_rows_leave_room_for_a_takeover_in_steps_of_64() {
        let rows = |w| segment_capacities(w, 2).workers;
        assert_eq!([rows(1), rows(2), rows(32)], [64, 64, 64]);
        assert_eq!([rows(33), rows(64), rows(65)], [128, 128, 192]);
        assert_eq!(rows(4096), warmroute_shm::MAX_WORKERS);
        // On a 48-CPU host a router of 16 workers leaves room for a takeover chain of
        // routers up to 48 workers each.
        assert_eq!(segment_capacities(16, 48).workers, 128);
        // What the routes and peers get does not depend on the worker count.
        assert_eq!(
            segment_capacities(1, 2).peers,
            segment_capacities(500, 2).peers
        );
    }
}
