//! Command line: parse arguments, set up logging, run the chosen subcommand. Signals are
//! handled here, on the main thread, which is never on the data path.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `print!` that does not panic when stdout is closed early (`warmroute status | head`):
/// what the reader no longer wants is dropped.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($t)*);
    }};
}

/// `println!`, the same way.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1};
use warmroute::server::{ConfigSource, Overrides, Router};
use warmroute::worker::AccessLogTarget;

const USAGE: &str = "\
warmroute — session-affinity router for LLM inference backends

USAGE:
    warmroute [serve] [OPTIONS]      run the router (default)
    warmroute check [--config PATH]  validate the server file, route files and key file
    warmroute demo [--listen ADDR] [--admin-listen ADDR]
                                     three in-process mock engines + the router, no files needed
    warmroute status [--config PATH] [--listen ADDR] [--shm PATH]
                                     print peers, in-flight and bans from a running router's segment
                                     (the segment the same options would give `serve`)
    warmroute bodylog-listen --listen ADDR --dir DIR

OPTIONS (serve):
    --config PATH          server file (default: none, all defaults; routes from ./routes)
    --workers N            worker threads (default: cores in the affinity mask)
    --listen ADDR          public address (overrides the server file)
    --admin-listen ADDR    admin address (overrides the server file)
    --shm PATH             shared segment path (overrides the server file)
    --takeover             share the ports with a running warmroute that this one replaces
    --join                 serve alongside the warmroute(s) running on the same ports and
                           segment: one pool of counts, limits and bans, each process with
                           its own open-file limit (started alone, it starts as usual)
    --no-pin               do not pin workers to cores
    --access-log TARGET    stderr (default), off, or a file path
    --log-format FORMAT    text (default) or json
";

struct Args {
    cmd: String,
    config: Option<PathBuf>,
    overrides: Overrides,
    log_json: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1).peekable();
    let cmd = match it.peek() {
        Some(s) if !s.starts_with('-') => it.next().unwrap_or_default(),
        _ => "serve".to_string(),
    };
    let mut a = Args {
        cmd,
        config: None,
        overrides: Overrides::default(),
        log_json: false,
    };
    while let Some(flag) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let addr = |s: String, name: &str| {
            s.parse::<SocketAddr>()
                .map_err(|e| format!("{name}: {e}: {s:?}"))
        };
        match flag.as_str() {
            "--config" | "-c" => a.config = Some(PathBuf::from(val("--config")?)),
            "--workers" => {
                a.overrides.workers = Some(
                    val("--workers")?
                        .parse()
                        .map_err(|_| "--workers needs a number".to_string())?,
                )
            }
            "--listen" => a.overrides.listen = Some(addr(val("--listen")?, "--listen")?),
            "--admin-listen" => {
                a.overrides.admin_listen = Some(addr(val("--admin-listen")?, "--admin-listen")?)
            }
            "--shm" => a.overrides.shm_path = Some(PathBuf::from(val("--shm")?)),
            "--takeover" => a.overrides.takeover = true,
            "--join" => a.overrides.join = true,
            "--no-pin" => a.overrides.no_pin = true,
            "--access-log" => {
                a.overrides.access_log = Some(match val("--access-log")?.as_str() {
                    "off" => AccessLogTarget::Off,
                    "stderr" => AccessLogTarget::Stderr,
                    p => AccessLogTarget::File(PathBuf::from(p)),
                })
            }
            "--log-format" => match val("--log-format")?.as_str() {
                "json" => a.log_json = true,
                "text" => a.log_json = false,
                other => {
                    return Err(format!(
                        "--log-format: expected text or json, got {other:?}"
                    ))
                }
            },
            "-h" | "--help" => {
                out!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.overrides.takeover && a.overrides.join {
        return Err(
            "--takeover and --join exclude each other: a takeover retires the \
                    routers on the ports, a join serves alongside them"
                .to_string(),
        );
    }
    Ok(a)
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WARMROUTE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal, not into a file, a pipe or the journal.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Never waits on a full stderr pipe: a worker that logs while nobody reads drops
        // the line and counts it (`warmroute_log_dropped_total`).
        .with_writer(warmroute::worker::stderr::LogStderr::open())
        // A line it cannot write is dropped by the writer; the formatter's own report of a
        // failed write would go through `eprintln!`, which panics on a broken stderr.
        .log_internal_errors(false);
    if json {
        b.json().init();
    } else {
        b.init();
    }
    warmroute::worker::contain::log_panics();
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("bodylog-listen") {
        init_logging(false);
        return bodylog_listen(&raw[1..]);
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("warmroute: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    init_logging(args.log_json);
    match args.cmd.as_str() {
        "serve" => serve(ConfigSource::Files(args.config), args.overrides),
        "check" => check(args.config),
        "demo" => demo(args.overrides),
        "status" => status(args.config, &args.overrides),
        other => {
            eprintln!("warmroute: unknown command {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// `warmroute bodylog-listen --listen ADDR --dir DIR [--metrics-listen ADDR]`: receive
/// body-log frames from routers, write hourly JSONL, serve /metrics; stop on SIGINT/SIGTERM.
fn bodylog_listen(args: &[String]) -> ExitCode {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM, SIGQUIT] {
        if let Err(e) = signal_hook::flag::register(sig, stop.clone()) {
            eprintln!("warmroute bodylog-listen: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    }
    let cfg = match warmroute::bodylog::listener::ListenerConfig::parse_args(args, stop) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("warmroute bodylog-listen: {e}\n\nusage: warmroute bodylog-listen --listen ADDR --dir DIR [--metrics-listen ADDR]");
            return ExitCode::from(2);
        }
    };
    match warmroute::bodylog::listener::run_listener_with(cfg) {
        Ok(h) => {
            outln!("listening on {} (metrics on {})", h.addr, h.metrics_addr);
            h.wait();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warmroute bodylog-listen: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What `check` says about the key file: a warning when it is missing (taken as
/// deliberate: `serve` runs without keys), an error when it is there and gives no key
/// (`serve` would run fail-open on a file that was meant to hold keys).
fn check_key_file(c: &warmroute::config::Config) -> (Vec<String>, Vec<String>) {
    use warmroute::auth::{load_key_file, KeyFileStatus};
    let Some(path) = c.server.api_keys_file.as_deref() else {
        return (Vec::new(), Vec::new());
    };
    let kf = load_key_file(Some(path));
    let at = format!("api_keys_file {}", path.display());
    let open = "routes without their own api_keys would accept every request (fail-open)";
    match kf.status {
        KeyFileStatus::Ok | KeyFileStatus::Unset => (Vec::new(), Vec::new()),
        KeyFileStatus::Missing => (vec![format!("{at}: missing; {open}")], Vec::new()),
        KeyFileStatus::Empty => (Vec::new(), vec![format!("{at}: holds no key; {open}")]),
        KeyFileStatus::Unreadable => (
            Vec::new(),
            vec![format!("{at}: present but unreadable; {open}")],
        ),
    }
}

fn check(config: Option<PathBuf>) -> ExitCode {
    match warmroute::config::load(config.as_deref()) {
        Ok(c) => {
            let (key_warnings, key_errors) = check_key_file(&c);
            for w in c
                .warnings
                .iter()
                .map(ToString::to_string)
                .chain(key_warnings)
            {
                outln!("warning: {w}");
            }
            let errors: Vec<String> = c
                .soft_errors
                .iter()
                .map(ToString::to_string)
                .chain(key_errors)
                .collect();
            for e in &errors {
                outln!("error: {e}");
            }
            if errors.is_empty() {
                outln!(
                    "ok: {} route(s): {}",
                    c.routes.len(),
                    c.routes
                        .iter()
                        .map(|r| r.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                ExitCode::SUCCESS
            } else {
                outln!("{} error(s)", errors.len());
                ExitCode::FAILURE
            }
        }
        Err(errs) => {
            for e in &errs {
                outln!("error: {e}");
            }
            outln!("{} error(s)", errs.len());
            ExitCode::FAILURE
        }
    }
}

/// Exit code of `warmroute status` when no live router owns the segment (as `systemctl
/// status` says "not running").
const STATUS_NOT_RUNNING: u8 = 3;

fn status(config: Option<PathBuf>, overrides: &Overrides) -> ExitCode {
    let shm = overrides.shm_path.clone();
    // The configuration names the peers and their limits; with `--shm` alone and no
    // readable configuration the table has the segment's figures only.
    let loaded = match (&shm, &config) {
        // A segment named alone: the files in this directory may be another router's.
        (Some(_), None) => None,
        _ => match warmroute::config::load(config.as_deref()) {
            // The segment `serve` would use with the same options: `--listen` moves a
            // default segment path with the port.
            Ok(c) => Some(warmroute::server::apply_overrides(c, overrides)),
            Err(_) if shm.is_some() => None,
            Err(errs) => {
                for e in errs {
                    eprintln!("error: {e}");
                }
                eprintln!(
                    "warmroute status: the configuration above does not load; \
                     `warmroute status --shm PATH` shows the segment without it"
                );
                return ExitCode::FAILURE;
            }
        },
    };
    let path = match (shm, &loaded) {
        (Some(p), _) => p,
        (None, Some(c)) => c.server.shm_path.clone(),
        (None, None) => return ExitCode::FAILURE,
    };
    match warmroute::status::render(&path, loaded.as_ref()) {
        Ok(s) => {
            out!("{}", s.text);
            if s.running {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(STATUS_NOT_RUNNING)
            }
        }
        Err(e) => {
            eprintln!("warmroute status: {}: {e}", path.display());
            // A demo on the same port has a segment of its own.
            let port = loaded.as_ref().map(|c| c.server.listen.port());
            let demo = port.map(warmroute::demo::shm_path).filter(|d| d.exists());
            if let (true, Some(d)) = (e.kind() == std::io::ErrorKind::NotFound, demo) {
                eprintln!(
                    "warmroute status: a `warmroute demo` serves on this port: \
                     `warmroute status --shm {}` reads its segment",
                    d.display()
                );
            }
            ExitCode::FAILURE
        }
    }
}

/// The signals `run_until_signalled` acts on, caught from here on.
fn install_signals() -> Option<signal_hook::iterator::Signals> {
    signal_hook::iterator::Signals::new([SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1])
        .map_err(|e| eprintln!("warmroute: cannot install signal handlers: {e}"))
        .ok()
}

/// An `--access-log` file that cannot be opened stops the start with the reason; each
/// worker opening it later would turn the log off without a word.
fn access_log_opens(overrides: &Overrides) -> bool {
    let Some(AccessLogTarget::File(path)) = &overrides.access_log else {
        return true;
    };
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(_) => true,
        Err(e) => {
            eprintln!(
                "warmroute: cannot start:\n--access-log {}: {e}",
                path.display()
            );
            false
        }
    }
}

fn serve(source: ConfigSource, overrides: Overrides) -> ExitCode {
    if !access_log_opens(&overrides) {
        return ExitCode::FAILURE;
    }
    let Some(signals) = install_signals() else {
        return ExitCode::FAILURE;
    };
    let router = match Router::start(source, overrides) {
        Ok(r) => r,
        Err(e) => {
            eprint!("warmroute: cannot start:\n{e}");
            return ExitCode::FAILURE;
        }
    };
    run_until_signalled(router, signals)
}

/// How often the route files, server file and key file are checked for changes.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// How often peers given by name are looked up again (a pod's address changes when it
/// restarts); a changed address reloads the configuration.
const DNS_INTERVAL: Duration = Duration::from_secs(10);

fn run_until_signalled(
    mut router: Router,
    mut signals: signal_hook::iterator::Signals,
) -> ExitCode {
    // Read when the drain starts: a reload may have changed it.
    let drain_default = |r: &Router| Duration::from_secs(r.config.server.drain_timeout_s);
    // Signals arrive on a thread of their own that blocks until one comes, so this thread
    // sleeps until a signal or the next look at the files: no polling tick between them.
    let (tx, rx) = crossbeam_channel::bounded(16);
    let handle = signals.handle();
    let forwarder = std::thread::Builder::new()
        .name("warmroute-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.send(sig).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = forwarder {
        tracing::error!(error = %e, "cannot start the signal thread; stopping");
        let t = drain_default(&router);
        router.shutdown(t);
        return ExitCode::FAILURE;
    }
    let mut stamp = router.watch_stamp();
    let mut next_check = std::time::Instant::now() + WATCH_INTERVAL;
    let mut next_dns = std::time::Instant::now() + DNS_INTERVAL;
    let code = loop {
        let wait = next_check.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(wait) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                // Between signals, poll the files and reload on a change as SIGHUP would.
                next_check = std::time::Instant::now() + WATCH_INTERVAL;
                let now = router.watch_stamp();
                if now != stamp {
                    stamp = now;
                    tracing::info!("configuration files changed on disk; reloading");
                    log_refused(router.reload_on_change());
                } else if std::time::Instant::now() >= next_dns {
                    next_dns = std::time::Instant::now() + DNS_INTERVAL;
                    if let Some(moved) = router.peer_moved() {
                        tracing::info!(peer = moved, "a peer's name resolves elsewhere; reloading");
                        reload(&mut router);
                    }
                }
            }
            Ok(SIGHUP) => {
                router.reopen_logs();
                reload(&mut router);
                stamp = router.watch_stamp();
            }
            Ok(SIGUSR1) => {
                tracing::info!("SIGUSR1: reopening the access log");
                router.reopen_logs();
            }
            Ok(SIGINT) => {
                tracing::info!("SIGINT: draining (5 s limit)");
                drain_listening(router, SIGINT_DRAIN, &rx);
                break ExitCode::SUCCESS;
            }
            Ok(_) => {
                let t = drain_default(&router);
                tracing::info!(timeout_s = t.as_secs(), "draining");
                drain_listening(router, t, &rx);
                break ExitCode::SUCCESS;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                tracing::error!("the signal thread stopped; draining");
                let t = drain_default(&router);
                router.shutdown(t);
                break ExitCode::FAILURE;
            }
        }
    };
    handle.close();
    code
}

/// The drain limit of SIGINT (SPEC §1).
const SIGINT_DRAIN: Duration = Duration::from_secs(5);

/// Drain within `timeout` and wait for the workers, still listening to signals: a SIGINT
/// brings the end to at most [`SIGINT_DRAIN`] from then (an operator's Ctrl-C after a
/// SIGTERM, or on an old router draining after a takeover, with `drain_timeout_s` at its
/// 300 s); SIGHUP and SIGUSR1 still reopen the access log.
fn drain_listening(router: Router, timeout: Duration, rx: &crossbeam_channel::Receiver<i32>) {
    router.workers.drain(timeout);
    while !router.workers.is_finished() {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(SIGINT) => {
                tracing::info!("SIGINT while draining: the drain ends within 5 s");
                router.workers.cut_drain(SIGINT_DRAIN);
            }
            Ok(SIGHUP | SIGUSR1) => router.reopen_logs(),
            Ok(_) => tracing::info!("already draining"),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
    router.workers.join();
}

fn reload(router: &mut Router) {
    log_refused(router.reload());
}

fn log_refused(result: Result<(), Vec<warmroute::config::ConfigError>>) {
    if let Err(errs) = result {
        for e in &errs {
            tracing::error!("reload refused: {e}");
        }
        tracing::error!(
            errors = errs.len(),
            "reload refused; the running configuration stays"
        );
    }
}

fn demo(overrides: Overrides) -> ExitCode {
    let Some(signals) = install_signals() else {
        return ExitCode::FAILURE;
    };
    let listen = overrides
        .listen
        .unwrap_or_else(|| "127.0.0.1:8080".parse().expect("literal"));
    let admin = overrides
        .admin_listen
        .unwrap_or_else(|| "127.0.0.1:8090".parse().expect("literal"));
    let d = match warmroute::demo::start(listen, admin, overrides) {
        Ok(d) => d,
        Err(e) => {
            eprint!("warmroute demo: cannot start:\n{e}");
            return ExitCode::FAILURE;
        }
    };
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| p.to_str().map(str::to_string))
        .unwrap_or_else(|| "warmroute".to_string());
    let shm = d.router.shm_path().to_path_buf();
    outln!(
        "{}",
        warmroute::demo::curl_lines(d.router.public_addr(), d.router.admin_addr(), &exe, &shm)
    );
    let code = run_until_signalled(d.router, signals);
    for m in d.mocks {
        m.shutdown();
    }
    // The demo's own segment goes with it (one named with `--shm` stays, as `serve`'s
    // does); a demo still running on it keeps it.
    if shm == warmroute::demo::shm_path(listen.port()) {
        if let Err(e) = warmroute_shm::Segment::remove_unused(&shm) {
            eprintln!("warmroute demo: cannot remove {}: {e}", shm.display());
        }
    }
    code
}
