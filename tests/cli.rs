//! The binary as an operator runs it: `check`, `serve` refusing bad config or a taken
//! port, `status`, SIGHUP reload, SIGTERM drain, and crash recovery of in-flight counts.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_warmroute");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(tag: &str) -> Dir {
    let p = shm_path(tag);
    std::fs::create_dir_all(p.join("routes")).unwrap();
    Dir(p)
}

struct Proc {
    child: Child,
    public: SocketAddr,
    admin: SocketAddr,
    shm: PathBuf,
}

impl Proc {
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }
    /// The routes digest every live worker row of this router publishes in `warmroute
    /// status`, when they all publish the same one. A worker writes its digest after it
    /// has taken a snapshot, so a new value on every row means every worker serves the new
    /// routes.
    fn one_routes_digest(&self) -> Option<String> {
        let g = live_digests(&self.shm, &self.child.id().to_string());
        let one = g.first()?;
        (one.len() == 16 && g.iter().all(|d| d == one)).then(|| one.clone())
    }
    /// [`Proc::one_routes_digest`], once the rows agree.
    fn routes_digest(&self) -> String {
        let mut one = None;
        eventually(
            Duration::from_secs(5),
            "one routes digest on every row",
            || {
                one = self.one_routes_digest();
                one.is_some()
            },
        );
        one.unwrap()
    }
    /// Wait until every worker serves routes other than those of the digest `before`
    /// (a reload is taken by each worker on its next tick, not all at once).
    fn wait_routes_changed(&self, before: &str) {
        eventually(
            Duration::from_secs(10),
            "every worker on the new routes",
            || self.one_routes_digest().is_some_and(|d| d != before),
        );
    }
    fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.shm);
    }
}

/// Write a server file into `dir` and return its path.
fn server_file(dir: &Path, public: u16, admin: u16, shm: &Path) -> PathBuf {
    server_file_with(dir, public, admin, shm, "")
}

fn server_file_with(dir: &Path, public: u16, admin: u16, shm: &Path, extra: &str) -> PathBuf {
    let p = dir.join("warmroute.toml");
    std::fs::write(&p, format!("listen = \"127.0.0.1:{public}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nroutes_dir = \"routes\"\nshm_path = \"{}\"\n{extra}", shm.display())).unwrap();
    p
}

fn spawn_serve(config: &Path, extra: &[&str]) -> Child {
    // The router's log goes next to its config, for reading when a test fails.
    let n = std::fs::read_dir(config.parent().unwrap())
        .map(|d| d.count())
        .unwrap_or(0);
    let log = std::fs::File::create(config.with_file_name(format!("router-{n}.log"))).unwrap();
    spawn_serve_to(config, extra, log.into())
}

fn spawn_serve_to(config: &Path, extra: &[&str], stderr: Stdio) -> Child {
    Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(["--workers", "2", "--no-pin", "--access-log", "off"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// Start a router with `--takeover` (and `extra`) on `old`'s server file, wait for `old` to
/// drain and exit cleanly, and return the new one.
fn take_over(old: &mut Proc, dir: &Path, extra: &[&str]) -> Proc {
    let new = spawn_takeover(old, dir, extra);
    let status = old
        .wait_exit(Duration::from_secs(15))
        .expect("the old router drains and exits");
    assert!(status.success());
    new
}

/// A router started with `--takeover` (and `extra`) on `old`'s server file in `dir`.
fn spawn_takeover(old: &Proc, dir: &Path, extra: &[&str]) -> Proc {
    let mut args = extra.to_vec();
    args.push("--takeover");
    Proc {
        child: spawn_serve(&dir.join("warmroute.toml"), &args),
        public: old.public,
        admin: old.admin,
        shm: old.shm.clone(),
    }
}

fn start_serve(dir: &Path) -> Proc {
    start_serve_with(dir, "", &[])
}

fn start_serve_with(dir: &Path, server_extra: &str, args: &[&str]) -> Proc {
    start_serve_spawning(dir, server_extra, |cfg| spawn_serve(cfg, args))
}

/// `serve` with `args`, its stderr in a file in `dir`; returns the process and a reader of
/// that file (the router's log, and the access log with `--access-log stderr`).
fn start_serve_logging(
    dir: &Path,
    server_extra: &str,
    args: &'static [&'static str],
) -> (Proc, impl Fn() -> String) {
    let log = dir.join("stderr.log");
    let p = start_serve_spawning(dir, server_extra, |cfg| {
        let f = std::fs::File::create(&log).unwrap();
        spawn_serve_to(cfg, args, f.into())
    });
    (p, move || std::fs::read_to_string(&log).unwrap_or_default())
}

/// Status of a chat request that carries no key.
fn chat_status_without_key(p: &Proc, route: &str) -> u16 {
    request(
        p.public,
        &post_json(
            &format!("/{route}/v1/chat/completions"),
            &chat_body("x", false),
            "",
        ),
    )
    .status
}

fn start_serve_spawning(dir: &Path, server_extra: &str, spawn: impl Fn(&Path) -> Child) -> Proc {
    // Ports come from binding :0 and letting go, so another test may take one before the
    // router binds it; the router then refuses to start. Try again on fresh ports.
    for _ in 0..3 {
        let (p, a) = (free_port(), free_port());
        let shm = dir.join("segment");
        let cfg = server_file_with(dir, p, a, &shm, server_extra);
        let child = spawn(&cfg);
        let public: SocketAddr = format!("127.0.0.1:{p}").parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
        // Built before waiting, so a failed start still kills the child.
        let mut proc = Proc {
            child,
            public,
            admin,
            shm,
        };
        if wait_ready_or_exit(&mut proc, dir) {
            return proc;
        }
    }
    panic!("router refused to start three times (see the logs above)");
}

/// Wait until the router is ready (true), or it exited (false, its logs shown). Panics,
/// showing the logs, if it neither became ready nor exited within 10 s.
fn wait_ready_or_exit(p: &mut Proc, dir: &Path) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if p.child.try_wait().ok().flatten().is_some() {
            dump_logs(dir);
            return false;
        }
        if try_request(p.admin, &get("/readyz")).is_ok_and(|r| r.status == 200) {
            // A ready answer could come from another test's router on a taken port: ours
            // must still be running.
            std::thread::sleep(Duration::from_millis(30));
            if p.child.try_wait().ok().flatten().is_none() {
                return true;
            }
            dump_logs(dir);
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    dump_logs(dir);
    panic!("router not ready");
}

/// Print the router logs of `dir` (for a failing test's output).
fn dump_logs(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("router-") {
            eprintln!(
                "== {}:\n{}",
                e.path().display(),
                std::fs::read_to_string(e.path()).unwrap_or_default()
            );
        }
    }
}

#[test]
fn check_reports_every_error_and_serve_refuses() {
    let d = temp_dir("check");
    std::fs::write(d.0.join("routes/bad.toml"), "peers = [ { host = \"127.0.0.1\", port = 70000, colour = \"red\" } ]\nmax_more_tries = \"two\"\nsession_afinity = true\n").unwrap();
    std::fs::write(d.0.join("routes/Bad-Name.toml"), "peers = []\n").unwrap();
    let cfg = server_file(&d.0, free_port(), free_port(), &d.0.join("seg"));
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for needle in [
        "bad.toml: peers[0].port",
        "bad.toml: peers[0].colour",
        "bad.toml: max_more_tries",
        "bad.toml: session_afinity",
        "Bad-Name.toml: name",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // serve refuses to start on it, printing the same errors.
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("session_afinity"));
    // The control: once fixed, check passes.
    std::fs::remove_file(d.0.join("routes/Bad-Name.toml")).unwrap();
    std::fs::write(
        d.0.join("routes/bad.toml"),
        "peers = [ { host = \"127.0.0.1\", port = 7000 } ]\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok: 1 route(s): bad"));
}

#[test]
fn check_reads_the_key_file_and_rule_typos() {
    let d = temp_dir("checkkeys");
    std::fs::write(
        d.0.join("routes/a.toml"),
        "peers = [ { host = \"127.0.0.1\", port = 7000 } ]\n[[reject_rules]]\nfield = \"model\"\nop = \"eq\"\nvalue = \"x\"\nstauts = 403\n",
    )
    .unwrap();
    let keys = d.0.join("keys");
    let cfg = server_file_with(
        &d.0,
        free_port(),
        free_port(),
        &d.0.join("seg"),
        &format!("api_keys_file = \"{}\"\n", keys.display()),
    );
    let check = || {
        let out = Command::new(BIN)
            .args(["check", "--config"])
            .arg(&cfg)
            .env_remove("WARMROUTE_API_KEYS_FILE")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // A key file that gives no key, and a typo in a rule: both are errors.
    std::fs::write(&keys, "# keys go here\n").unwrap();
    let (code, text) = check();
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("holds no key"), "{text}");
    assert!(
        text.contains("reject_rules[0]") && text.contains("did you mean \"status\"?"),
        "{text}"
    );
    // A missing key file is a warning (serve runs without keys, on purpose).
    std::fs::write(
        d.0.join("routes/a.toml"),
        "peers = [ { host = \"127.0.0.1\", port = 7000 } ]\n",
    )
    .unwrap();
    std::fs::remove_file(&keys).unwrap();
    let (code, text) = check();
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("warning: api_keys_file") && text.contains("missing"),
        "{text}"
    );
    // The control: a good key file, no word about it.
    std::fs::write(&keys, "k1:alice\n").unwrap();
    let (code, text) = check();
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("api_keys_file"), "{text}");
    assert!(text.contains("ok: 1 route(s): a"), "{text}");
}

/// `serve` on ports :0 in `dir` with `args` and segment `shm`, run to its exit (a start
/// that is refused): its exit code and stderr.
fn serve_to_exit(dir: &Path, args: &[&str], shm: &Path) -> (Option<i32>, String) {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .arg("--shm")
        .arg(shm)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_start_failure_is_one_whole_line_on_stderr() {
    let d = temp_dir("startio");
    // A directory as the segment: it cannot be created.
    let (code, err) = serve_to_exit(&d.0, &[], &d.0);
    assert_eq!(code, Some(1));
    assert!(err.ends_with("Is a directory (os error 21)\n"), "{err:?}");
    assert!(
        err.contains("warmroute: cannot start:\nshared segment "),
        "{err:?}"
    );
}

#[test]
fn a_second_router_on_the_same_port_is_refused_unless_takeover() {
    let d = temp_dir("port");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/r.toml"), route_for(&[m.addr()], "")).unwrap();
    let first = start_serve(&d.0);
    let cfg = d.0.join("warmroute.toml");
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(["--no-pin", "--shm"])
        .arg(d.0.join("other-seg"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already served") && err.contains("--takeover"),
        "{err}"
    );
    // The refused start leaves no segment file behind.
    assert!(
        !d.0.join("other-seg").exists(),
        "a refused start left its segment"
    );
    // --takeover with another segment is refused too: it would share the ports with a
    // router it cannot see or retire, for good.
    let log = d.0.join("takeover-other-seg.log");
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(["--no-pin", "--takeover", "--shm"])
        .arg(d.0.join("other-seg"))
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.is_some_and(|st| !st.success()),
        "the takeover on another segment started ({status:?}): {err}"
    );
    assert!(
        err.contains("does not use the shared segment") && err.contains("same shm_path"),
        "{err}"
    );
    assert!(
        !d.0.join("other-seg").exists(),
        "a refused takeover left its segment"
    );
    // The control: the running router's own segment is still there.
    assert!(first.shm.exists());
    // The first one is untouched.
    assert_eq!(
        request(
            first.public,
            &post_json("/r/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
}

/// `--listen` and `--admin-listen` are checked against each other as the server file's
/// addresses are: overlapping ones are refused before anything binds.
#[test]
fn overlapping_listen_addresses_from_the_command_line_are_refused() {
    let d = temp_dir("cli-listen");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/r.toml"), route_for(&[m.addr()], "")).unwrap();
    let port = free_port();
    let cfg = d.0.join("warmroute.toml");
    std::fs::write(
        &cfg,
        format!("routes_dir = \"{}\"\n", d.0.join("routes").display()),
    )
    .unwrap();
    let run = |listen: String, admin: String| {
        let mut child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&cfg)
            .args([
                "--no-pin",
                "--listen",
                &listen,
                "--admin-listen",
                &admin,
                "--shm",
            ])
            .arg(d.0.join("seg"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let exited = child.try_wait().unwrap();
        if exited.is_none() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        (exited, String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (st, err) = run(format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}"));
    assert!(st.is_some_and(|s| !s.success()), "started: {err}");
    assert!(err.contains("overlaps the public listen address"), "{err}");
    // The control: distinct ports start (and are stopped here).
    let (st, err) = run(
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:{}", free_port()),
    );
    assert!(st.is_none(), "did not start: {err}");
}

#[test]
fn status_reads_the_segment_of_a_running_router() {
    let d = temp_dir("status");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/chat.toml"), route_for(&[m.addr()], "")).unwrap();
    let p = start_serve(&d.0);
    // Hold one request in flight.
    let mut s = connect(p.public);
    s.write_all(&post_json(
        "/chat/v1/chat/completions",
        &chat_body("x", true),
        "x-mock-hang-ms: 3000\r\n",
    ))
    .unwrap();
    eventually(Duration::from_secs(5), "request in the engine", || {
        m.stats().active == 1
    });
    let status = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(BIN).arg("status").args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let row = |text: &str, addr: std::net::SocketAddr| -> Vec<String> {
        text.lines()
            .find(|l| l.contains(&format!("chat//{addr}")))
            .unwrap_or_else(|| panic!("peer row missing:\n{text}"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    // The segment alone: in-flight and bans, no names.
    let (code, text) = status(&["--shm".as_ref(), p.shm.as_os_str()]);
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(row(&text, m.addr())[1..3], ["?", "1"], "{text}");
    // A reader that stops early (`warmroute status | head -0`): the same exit code, no
    // panic. The pipe's read end is closed before the command starts, so its write fails.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(BIN)
        .arg("status")
        .args(["--shm".as_ref(), p.shm.as_os_str()])
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // With the configuration: the peer's name and limit.
    let cfg = d.0.join("warmroute.toml");
    let (code, text) = status(&["--config".as_ref(), cfg.as_os_str()]);
    assert_eq!(code, Some(0), "{text}");
    let r = row(&text, m.addr());
    assert_eq!(r[2], "1", "{text}");
    assert_ne!(r[1], "(removed)", "{text}");
    // A broken file on disk: the errors, and the way to the segment without them.
    std::fs::write(d.0.join("routes/bad.toml"), "peers = 5\n").unwrap();
    let out = Command::new(BIN)
        .args(["status", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.toml") && err.contains("status --shm PATH"),
        "{err}"
    );
    std::fs::remove_file(d.0.join("routes/bad.toml")).unwrap();
    drop(s);
    // A peer a reload removed keeps its row in the segment, marked as such.
    let m2 = mock("m1");
    std::fs::write(d.0.join("routes/chat.toml"), route_for(&[m2.addr()], "")).unwrap();
    p.signal("HUP");
    eventually(
        Duration::from_secs(5),
        "the old peer marked removed",
        || {
            let (_, text) = status(&["--config".as_ref(), cfg.as_os_str()]);
            text.contains(&format!("chat//{}", m2.addr())) && row(&text, m.addr())[1] == "(removed)"
        },
    );
    // No router running: said, and exit code 3.
    let mut p = p;
    p.signal("TERM");
    p.wait_exit(Duration::from_secs(10)).expect("router exits");
    let (code, text) = status(&["--shm".as_ref(), p.shm.as_os_str()]);
    assert_eq!(code, Some(3), "{text}");
    assert!(
        text.contains("no running router owns this segment"),
        "{text}"
    );
}

/// `warmroute demo` as the README's first command runs it: the lines it prints work (a
/// chat completion through the router, kept on its peer by session id; the `status`
/// command it names), `status` by port points at the demo's segment, and Ctrl-C stops the
/// demo and removes that segment.
#[test]
fn the_demo_serves_what_it_prints_and_takes_its_segment_with_it() {
    let d = temp_dir("demo-cwd");
    // The banner's lines, read on a thread so that a demo that prints nothing cannot
    // block the test.
    let (mut demo, banner) = (0..3)
        .find_map(|_| {
            let (p, a) = (free_port(), free_port());
            let child = Command::new(BIN)
                .args(["demo", "--listen", &format!("127.0.0.1:{p}")])
                .args(["--admin-listen", &format!("127.0.0.1:{a}")])
                .current_dir(&d.0)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut demo = Proc {
                public: format!("127.0.0.1:{p}").parse().unwrap(),
                admin: format!("127.0.0.1:{a}").parse().unwrap(),
                shm: PathBuf::from(format!("/dev/shm/warmroute-demo-{p}")),
                child,
            };
            let out = demo.child.stdout.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            let mut banner = Vec::new();
            // A demo that lost its port to another test exits: its stdout closes.
            while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
                let last = line.starts_with("Ctrl-C stops the demo");
                banner.push(line);
                if last {
                    return Some((demo, banner));
                }
            }
            None
        })
        .expect("the demo printed its lines (three tries)");
    assert!(demo.shm.exists(), "the demo's segment {:?}", demo.shm);
    // The chat line's request, with a session id: one peer for both turns.
    let chat = |sid: &str| {
        request(
            demo.public,
            &post_json(
                "/demo/v1/chat/completions",
                &chat_body("hi", false),
                &format!("X-Session-Id: {sid}\r\n"),
            ),
        )
    };
    let first = chat("conv-1");
    assert_eq!(
        first.status,
        200,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let peer = first.header("x-routed-peer").unwrap().to_string();
    assert!(peer.starts_with("mock-"), "{peer}");
    assert_eq!(first.header("x-routed-mode"), Some("hash"));
    assert_eq!(chat("conv-1").header("x-routed-peer"), Some(&*peer));
    // The status line it printed, run as printed: the demo's workers and three peers.
    let line = banner
        .iter()
        .find(|l| l.contains(" status --shm "))
        .unwrap_or_else(|| panic!("no status line in:\n{}", banner.join("\n")));
    let argv: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(argv[1..], ["status", "--shm", demo.shm.to_str().unwrap()]);
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    let pid = demo.child.id().to_string();
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().nth(1) == Some(&*pid)),
        "a worker row of the demo:\n{text}"
    );
    assert_eq!(text.matches("demo//127.0.0.1:").count(), 3, "{text}");
    // `status` by port finds no router segment there, and names the demo's.
    let out = Command::new(BIN)
        .args(["status", "--listen", &demo.public.to_string()])
        .current_dir(&d.0)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("warmroute status --shm {}", demo.shm.display())),
        "{err}"
    );
    // Ctrl-C: a clean stop, and the segment goes with the demo.
    demo.signal("INT");
    let status = demo.wait_exit(Duration::from_secs(10)).expect("demo exits");
    assert!(status.success(), "{status:?}");
    assert!(!demo.shm.exists(), "the demo removed {:?}", demo.shm);
}

#[test]
fn sighup_reloads_routes_and_keeps_the_old_config_on_errors() {
    let d = temp_dir("reload");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let p = start_serve(&d.0);
    // A long stream started before the reload finishes on the old config.
    let mut s = connect(p.public);
    s.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", true),
        "x-mock-tokens: 10\r\nx-mock-interval-ms: 100\r\n",
    ))
    .unwrap();
    assert_eq!(request(p.public, &get("/b/v1/models")).status, 404);
    let before = p.routes_digest();
    std::fs::write(d.0.join("routes/b.toml"), route_for(&[m.addr()], "")).unwrap();
    p.signal("HUP");
    p.wait_routes_changed(&before);
    for _ in 0..4 {
        assert_eq!(request(p.public, &get("/b/v1/models")).status, 200);
    }
    // A broken file: the reload is refused, both routes keep working.
    std::fs::write(d.0.join("routes/c.toml"), "peers = 7\n").unwrap();
    p.signal("HUP");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(request(p.public, &get("/b/v1/models")).status, 200);
    assert_eq!(request(p.public, &get("/c/v1/models")).status, 404);
    let resp = read_response(&mut BufReader::new(s), false).unwrap();
    assert_eq!(resp.status, 200);
    assert!(
        resp.text().contains("[DONE]"),
        "the stream survived the reloads"
    );
}

/// A request whose body is still arriving at the drain deadline gets the router's 503
/// `shutting_down` and its access line (`end: shutdown`); it used to be closed with no
/// answer and no line.
#[test]
fn a_body_still_uploading_at_the_drain_deadline_gets_a_503_and_its_line() {
    let d = temp_dir("drainupload");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let log = d.0.join("access.log");
    let mut p = start_serve_with(&d.0, "", &["--access-log", log.to_str().unwrap()]);
    let mut c = connect(p.public);
    c.write_all(
        b"POST /a/v1/chat/completions HTTP/1.1\r\nHost: t\r\nx-session-id: upload\r\n\
          Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    p.signal("INT");
    let answer = read_response(&mut BufReader::new(c), false).unwrap();
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert_eq!(answer.json()["error"]["type"], "shutting_down");
    let message = answer.json()["error"]["message"].to_string();
    assert!(
        message.contains("request body had not arrived"),
        "{message}"
    );
    // At the drain deadline (SIGINT: 5 s), not before.
    assert!(t0.elapsed() >= Duration::from_secs(4), "{:?}", t0.elapsed());
    let status = p.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status:?}");
    let line = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|l| l["session"] == "upload" || l["path"] == "/a/v1/chat/completions");
    let line = line.expect("an access line for the upload");
    assert_eq!(
        (line["status"].as_u64(), line["end"].as_str()),
        (Some(503), Some("shutdown")),
        "{line}"
    );
    // The control: the peer never saw the request.
    assert_eq!(m.stats().requests, 0);
}

#[test]
fn streams_cut_at_the_drain_deadline_get_their_access_lines() {
    let d = temp_dir("draincut");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let log = d.0.join("access.log");
    let mut p = start_serve_with(&d.0, "", &["--access-log", log.to_str().unwrap()]);
    // Two streams far longer than SIGINT's 5 s drain, and one short one that ends in it;
    // and one whose next event is due 30 s after the one before: the router waits for it
    // from before the drain, and that wait must end at the deadline too.
    let open_every = |tokens: u32, sid: &str, interval_ms: u32| {
        open_stream(
            p.public,
            "a",
            &format!(
                "x-session-id: {sid}\r\nx-mock-tokens: {tokens}\r\nx-mock-interval-ms: {interval_ms}\r\n"
            ),
        )
    };
    let open = |tokens: u32, sid: &str| open_every(tokens, sid, 100);
    let long = [open(600, "long-1"), open(600, "long-2")];
    let mut gap = open_every(3, "gap", 30_000);
    // And a request whose peer takes 30 s to answer at all (a long prefill).
    let mut prefill = connect(p.public);
    prefill
        .write_all(&post_json(
            "/a/v1/chat/completions",
            &chat_body("x", false),
            "x-session-id: prefill\r\nx-mock-ttft-ms: 30000\r\n",
        ))
        .unwrap();
    let mut event = String::new();
    while !event.starts_with("data:") {
        event.clear();
        gap.read_line(&mut event).unwrap();
    }
    // Waiting for the next event (and for the head) for longer than a wait takes to listen
    // for a drain.
    std::thread::sleep(Duration::from_millis(1_500));
    let short = open(10, "short");
    p.signal("INT");
    let status = p
        .wait_exit(Duration::from_secs(10))
        .expect("router exits at the drain deadline");
    assert!(status.success(), "{status:?}");
    drop((long, short, gap));
    // The request still waiting for its answer got the router's own: 503, shutting down.
    let answer = read_response(&mut BufReader::new(prefill), false).unwrap();
    assert_eq!(answer.status, 503);
    assert_eq!(
        answer.json()["error"]["type"],
        "shutting_down",
        "{}",
        answer.text()
    );
    let message = answer.json()["error"]["message"].to_string();
    assert!(
        message.contains("had not responded by its drain deadline"),
        "{message}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut ends: Vec<(String, String)> = lines
        .iter()
        .map(|l| {
            (
                l["session"].as_str().unwrap_or("?").to_string(),
                l["end"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    ends.sort();
    assert_eq!(
        ends,
        [
            ("gap".to_string(), "shutdown".to_string()),
            ("long-1".to_string(), "shutdown".to_string()),
            ("long-2".to_string(), "shutdown".to_string()),
            ("prefill".to_string(), "shutdown".to_string()),
            // The control: a stream that ended within the drain is complete.
            ("short".to_string(), "complete".to_string()),
        ],
        "{lines:#?}"
    );
    let prefill_line = lines.iter().find(|l| l["session"] == "prefill").unwrap();
    assert_eq!(prefill_line["status"], 503, "{prefill_line}");
}

/// A router on route `a` (one mock peer) with one stream of `tokens` events, 100 ms
/// apart, under way: the directory, the mock, the router and the client's connection.
fn serve_streaming(
    tag: &str,
    tokens: u32,
) -> (Dir, warmroute_mock::MockServer, Proc, std::net::TcpStream) {
    let d = temp_dir(tag);
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let p = start_serve(&d.0);
    let mut s = connect(p.public);
    s.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", true),
        &format!("x-mock-tokens: {tokens}\r\nx-mock-interval-ms: 100\r\n"),
    ))
    .unwrap();
    (d, m, p, s)
}

/// [`serve_streaming`], then SIGTERM once the stream's response has begun: returns when
/// the drain has closed the listeners, with the stream's reader past its status line.
fn streaming_then_sigterm(
    tag: &str,
    tokens: u32,
) -> (
    Dir,
    warmroute_mock::MockServer,
    Proc,
    BufReader<std::net::TcpStream>,
) {
    let (d, m, p, s) = serve_streaming(tag, tokens);
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"));
    p.signal("TERM");
    // New connections are refused once the listeners close.
    eventually(Duration::from_secs(3), "listener closed", || {
        std::net::TcpStream::connect(p.public).is_err()
    });
    (d, m, p, r)
}

#[test]
fn sigterm_drains_in_flight_streams_then_exits() {
    let (_d, _m, mut p, mut r) = streaming_then_sigterm("drain", 8);
    let mut rest = String::new();
    r.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("[DONE]"),
        "the stream finished during the drain"
    );
    let status = p
        .wait_exit(Duration::from_secs(10))
        .expect("router exits after draining");
    assert!(status.success());
}

/// SPEC §1: SIGINT drains with a 5 s limit, also when it comes during a SIGTERM's drain
/// (at `drain_timeout_s`, 300 s by default). Before, the SIGINT went unread and the router
/// drained on to the first deadline.
#[test]
fn sigint_during_a_drain_ends_it_within_five_seconds() {
    // A stream of 60 s: the drain would wait for it.
    let (_d, _m, mut p, _stream) = streaming_then_sigterm("drain-int", 600);
    // The control: the drain began and holds the stream (the router is still there).
    assert!(p.wait_exit(Duration::from_millis(1_000)).is_none());
    let t0 = Instant::now();
    p.signal("INT");
    let status = p
        .wait_exit(Duration::from_secs(9))
        .expect("the router exits within the SIGINT's 5 s");
    assert!(status.success(), "{status:?}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(4_500),
        "the drain still ran to its cut deadline: {took:?}"
    );
}

/// While a router drains, an idle kept connection closes when the drain's grace ends,
/// even when its client keeps sending empty lines (each one used to restart the grace, and
/// the connection stayed open up to its idle timeout).
#[test]
fn empty_lines_do_not_keep_a_connection_open_through_a_drain() {
    // A stream that keeps the drain going for about 4 s.
    let (_d, _m, mut p, s) = serve_streaming("drain-crlf", 40);
    // An idle kept connection, after one answer.
    let c = connect(p.public);
    let mut rd = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    c.write_all(&get("/a/v1/models")).unwrap();
    assert_eq!(read_response(&mut rd, false).unwrap().status, 200);
    p.signal("TERM");
    let t0 = Instant::now();
    let closed = std::thread::spawn(move || {
        let mut rest = Vec::new();
        let _ = rd.read_to_end(&mut rest);
        (t0.elapsed(), rest)
    });
    // Empty lines every 100 ms for 2.5 s (writes fail once the router has closed).
    while t0.elapsed() < Duration::from_millis(2500) && c.write_all(b"\r\n").is_ok() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (after, rest) = closed.join().unwrap();
    assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
    assert!(
        after < Duration::from_millis(2000),
        "the connection stayed open {after:?} into the drain"
    );
    // The control: the drain itself went on (the stream was still being served).
    let mut rest = String::new();
    BufReader::new(s.try_clone().unwrap())
        .read_to_string(&mut rest)
        .unwrap();
    assert!(
        rest.contains("[DONE]"),
        "the stream finished during the drain"
    );
    drop(s);
    assert!(p
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|st| st.success()));
}

/// A router on route `a` (one mock peer) with one streaming request held in the engine
/// for `hang_ms`: the directory, the mock, the router and the client's connection.
fn serve_holding_one(
    tag: &str,
    hang_ms: u64,
) -> (Dir, warmroute_mock::MockServer, Proc, std::net::TcpStream) {
    let d = temp_dir(tag);
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let p = start_serve(&d.0);
    let mut s = connect(p.public);
    s.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", true),
        &format!("x-mock-hang-ms: {hang_ms}\r\n"),
    ))
    .unwrap();
    eventually(Duration::from_secs(5), "request in the engine", || {
        m.stats().active == 1
    });
    (d, m, p, s)
}

#[test]
fn a_crashed_router_leaves_no_phantom_in_flight() {
    let (d, m, mut p, s) = serve_holding_one("crash", 10_000);
    let peer = m.addr().to_string();
    let r = request(p.public, &get("/a/_active_conns"));
    assert_eq!(r.json()[&peer], 1, "control: the request is counted");
    p.signal("KILL");
    p.wait_exit(Duration::from_secs(5)).expect("killed");
    drop(s);
    // A new router on the same segment starts with the dead rows reclaimed. (Fresh ports:
    // the dead router's could be handed to a test running alongside.)
    let (pp, ap) = (free_port(), free_port());
    let cfg = server_file(&d.0, pp, ap, &p.shm);
    let child = spawn_serve(&cfg, &[]);
    let mut q = Proc {
        child,
        public: format!("127.0.0.1:{pp}").parse().unwrap(),
        admin: format!("127.0.0.1:{ap}").parse().unwrap(),
        shm: p.shm.clone(),
    };
    assert!(wait_ready_or_exit(&mut q, &d.0), "the second router exited");
    let r = request(q.public, &get("/a/_active_conns"));
    assert_eq!(r.json()[&peer], 0);
}

/// SPEC §11: a router killed while it drains after a takeover leaves rows with in-flight
/// counts in the segment; the new router frees them within seconds. Before, they held
/// pool slots until yet another router started.
#[test]
fn a_router_killed_while_draining_leaves_no_phantom_in_flight() {
    let (d, m, mut old, s) = serve_holding_one("crash-drain", 20_000);
    let peer = m.addr().to_string();
    let mut new = spawn_takeover(&old, &d.0, &[]);
    assert!(wait_ready_or_exit(&mut new, &d.0), "the new router exited");
    // Its readiness may be the old router's answer on the shared admin port: wait for its
    // rows in the segment too.
    let new_pid = new.child.id().to_string();
    eventually(Duration::from_secs(10), "the new router's rows", || {
        status_text(&new.shm).lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 4 && f[1] == new_pid && f[3] == "yes"
        })
    });
    // The control: the old router's request counts in the segment the new one reads.
    // (While the old router lets go of the shared port a connection may land on it and be
    // reset: such a read is tried again.)
    let active = || {
        try_request(new.public, &get("/a/_active_conns"))
            .ok()
            .map(|r| r.json()[&peer].clone())
    };
    eventually(Duration::from_secs(5), "the old request counted", || {
        active() == Some(1.into())
    });
    old.signal("KILL");
    old.wait_exit(Duration::from_secs(5)).expect("killed");
    drop(s);
    eventually(Duration::from_secs(10), "the dead rows freed", || {
        active() == Some(0.into())
    });
}

/// The worker rows of `warmroute status`: `(pid, alive, routes digest)` per row, the
/// digest `"-"` when the row publishes none.
fn status_workers(shm: &Path) -> Vec<(String, bool, String)> {
    status_text(shm)
        .lines()
        .skip_while(|l| !l.starts_with("WORKER "))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 7).then(|| (f[1].to_string(), f[3] == "yes", f[6].to_string()))
        })
        .collect()
}

/// The routes digests of the live worker rows of process `pid` in `warmroute status`.
fn live_digests(shm: &Path, pid: &str) -> Vec<String> {
    status_workers(shm)
        .into_iter()
        .filter(|(p, alive, _)| p == pid && *alive)
        .map(|(_, _, digest)| digest)
        .collect()
}

/// A router draining after a takeover that changed the routes publishes no routes digest,
/// so the new router's check for joined routers with other routes does not count it (a
/// stream may keep it draining for minutes). `warmroute status` shows each row's digest.
#[test]
fn a_draining_router_publishes_no_routes_digest() {
    let (d, m, old, _s) = serve_holding_one("drain-digest", 20_000);
    let old_pid = old.child.id().to_string();
    let digests_of = |pid: &str| live_digests(&old.shm, pid);
    // The control: a serving router's rows carry its digest.
    let before = digests_of(&old_pid);
    assert!(!before.is_empty(), "the old router's rows");
    assert!(
        before.iter().all(|g| g.len() == 16 && g == &before[0]),
        "one digest for the whole router: {before:?}"
    );
    // Other routes, then a takeover: the old router drains, holding the stream.
    std::fs::write(d.0.join("routes/b.toml"), route_for(&[m.addr()], "")).unwrap();
    let mut new = spawn_takeover(&old, &d.0, &[]);
    assert!(wait_ready_or_exit(&mut new, &d.0), "the new router exited");
    let new_pid = new.child.id().to_string();
    eventually(Duration::from_secs(10), "the new router's digest", || {
        let g = digests_of(&new_pid);
        !g.is_empty() && g.iter().all(|g| g.len() == 16 && g != &before[0])
    });
    eventually(
        Duration::from_secs(10),
        "the draining router's rows without one",
        || {
            let g = digests_of(&old_pid);
            !g.is_empty() && g.iter().all(|g| g == "-")
        },
    );
    assert_eq!(m.stats().active, 1, "the old router still holds the stream");
}

fn chat_with_key(p: &Proc, route: &str, key: &str, extra: &str) -> Resp {
    request(
        p.public,
        &post_json(
            &format!("/{route}/v1/chat/completions"),
            &chat_body("x", false),
            &format!("Authorization: Bearer {key}\r\n{extra}"),
        ),
    )
}

#[test]
fn key_rotation_by_sighup_keeps_streams_and_logs_owners_not_keys() {
    let d = temp_dir("keys");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let keys = d.0.join("keys");
    std::fs::write(&keys, "old-secret-1:alice\n").unwrap();
    let log = d.0.join("access.log");
    let p = start_serve_with(
        &d.0,
        &format!("api_keys_file = \"{}\"\n", keys.display()),
        &["--access-log", log.to_str().unwrap()],
    );
    assert_eq!(chat_with_key(&p, "a", "wrong", "").status, 401);
    assert_eq!(
        request(
            p.public,
            &post_json("/a/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        401
    );
    assert_eq!(chat_with_key(&p, "a", "old-secret-1", "").status, 200);
    // A long stream authorised with the old key.
    let mut s = connect(p.public);
    s.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", true),
        "Authorization: Bearer old-secret-1\r\nx-mock-tokens: 10\r\nx-mock-interval-ms: 100\r\n",
    ))
    .unwrap();
    std::fs::write(&keys, "new-secret-2:bob,other-3:carol").unwrap();
    p.signal("HUP");
    // Each worker swaps to the new snapshot on its next tick: wait until all have.
    eventually(
        Duration::from_secs(5),
        "new key accepted, old refused",
        || {
            (0..4).all(|_| {
                chat_with_key(&p, "a", "new-secret-2", "").status == 200
                    && chat_with_key(&p, "a", "old-secret-1", "").status == 401
                    // x-api-key works too.
                    && request(
                        p.public,
                        &post_json(
                            "/a/v1/chat/completions",
                            &chat_body("x", false),
                            "x-api-key: other-3\r\n",
                        ),
                    )
                    .status
                        == 200
            })
        },
    );
    let resp = read_response(&mut BufReader::new(s), false).unwrap();
    assert!(
        resp.text().contains("[DONE]"),
        "the stream finished across the rotation"
    );
    let hs = request(p.public, &get("/a/_health_status")).json();
    assert_eq!(
        hs["_meta"],
        serde_json::json!({"api_keys_configured": true, "route_auth_enabled": true, "key_file_status": "ok", "kept_previous_keys": false})
    );
    // Owners are logged, keys never.
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually(Duration::from_secs(3), "access log flushed", || {
        text().contains("\"owner\":\"bob\"")
    });
    assert!(text().contains("\"owner\":\"alice\""));
    assert!(!text().contains("secret"), "no key in the access log");
}

#[test]
fn the_access_log_reaches_stderr_when_stderr_is_a_socket() {
    // systemd's journal and some container runtimes hand the process a socket as stderr,
    // which cannot be reopened through /proc/self/fd/2.
    let d = temp_dir("sockerr");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (ours, theirs) = UnixStream::pair().unwrap();
    let p = start_serve_spawning(&d.0, "", |cfg| {
        let stderr = OwnedFd::from(theirs.try_clone().unwrap());
        spawn_serve_to(cfg, &["--access-log", "stderr"], stderr.into())
    });
    let body = r#"{"model":"mock-model","max_tokens":4,"metadata":{"session_id":"conv-7"},"messages":[{"role":"user","content":"hi"}]}"#;
    let r = request(p.public, &post_json("/a/v1/chat/completions", body, ""));
    assert_eq!(r.status, 200);
    // The router's own log lines are text; the access line is the JSON one.
    ours.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut reader = BufReader::new(ours);
    let mut line = String::new();
    let t0 = Instant::now();
    let entry: serde_json::Value = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no access line on the socket; read so far: {line:?}"
        );
        match reader.read_line(&mut line) {
            Ok(0) => panic!("stderr closed without an access line"),
            Ok(_) if line.starts_with('{') => break serde_json::from_str(&line).unwrap(),
            Ok(_) => line.clear(),
            // A timeout keeps what was read of the line so far.
            Err(_) => {}
        }
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (entry["ts"].as_f64().unwrap() - now).abs() < 60.0,
        "{entry}"
    );
    assert_eq!(entry["route"], "a");
    assert_eq!(entry["method"], "POST");
    assert_eq!(entry["path"], "/a/v1/chat/completions");
    assert_eq!(entry["status"], 200);
    assert_eq!(entry["session"], "conv-7");
    assert_eq!(entry["peer"], "p0");
    assert_eq!(entry["retries"], 0);
    assert_eq!(entry["request_bytes"], body.len());
    assert_eq!(entry["response_bytes"], r.body.len());
    let usage = serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["usage"].clone();
    assert_eq!(entry["prompt_tokens"], usage["prompt_tokens"]);
    assert_eq!(entry["completion_tokens"], usage["completion_tokens"]);
    assert!(
        entry["source"].is_string() && entry["mode"].is_string(),
        "{entry}"
    );
    assert!(entry["ttft_ms"].as_f64().unwrap() <= entry["total_ms"].as_f64().unwrap());
    assert!(entry["owner"].is_null());
    assert!(entry["worker"].as_u64().unwrap() < 2);
}

#[test]
fn access_lines_survive_in_a_stderr_file_opened_without_append_and_carry_no_colours() {
    // `warmroute serve > log 2>&1`: the shell opens the file without O_APPEND. The access
    // lines and the router's own log must share the file's offset, or the next log line
    // (here the drain's) is written over the access lines.
    let d = temp_dir("fileerr");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (mut p, text) = start_serve_logging(&d.0, "", &["--access-log", "stderr"]);
    let access_lines = || {
        text()
            .lines()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["route"] == "a")
            .count()
    };
    for session in ["conv-1", "conv-2"] {
        let body = format!(
            r#"{{"model":"mock-model","max_tokens":4,"metadata":{{"session_id":"{session}"}},"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let r = request(p.public, &post_json("/a/v1/chat/completions", &body, ""));
        assert_eq!(r.status, 200);
    }
    eventually(
        Duration::from_secs(5),
        "both access lines in the file",
        || access_lines() == 2,
    );
    // Control: the router writes its own lines after the access lines.
    p.signal("TERM");
    p.wait_exit(Duration::from_secs(10))
        .expect("drained and exited");
    let all = text();
    assert!(all.contains("worker stopped"), "{all}");
    assert_eq!(access_lines(), 2, "access lines overwritten:\n{all}");
    // A file is not a terminal: no colour codes in the router's lines.
    assert!(!all.contains('\x1b'), "colour codes in a file:\n{all}");
    for line in all.lines() {
        assert!(
            line.starts_with('{') || line.contains("warmroute"),
            "a line pieced together from two writers: {line:?}"
        );
    }
}

#[test]
fn a_stderr_pipe_nobody_reads_does_not_stall_the_router() {
    // A log shipper that stops reading: the pipe fills (64 KiB, about 200 access lines) and
    // the workers keep serving, holding the lines until the reader is back.
    let d = temp_dir("stuckerr");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (mut reader, writer) = std::io::pipe().unwrap();
    let p = start_serve_spawning(&d.0, "", |cfg| {
        spawn_serve_to(
            cfg,
            &["--access-log", "stderr"],
            writer.try_clone().unwrap().into(),
        )
    });
    drop(writer);
    const REQUESTS: usize = 1500;
    let body = chat_body("x", false);
    let mut clients: Vec<_> = (0..4).map(|_| connect(p.public)).collect();
    for i in 0..REQUESTS {
        let s = &mut clients[i % 4];
        s.write_all(&post_json("/a/v1/chat/completions", &body, ""))
            .unwrap();
        let r = read_response(&mut BufReader::new(&mut *s), false).unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    // The control: the lines were held, not lost. Read them all back.
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        let mut chunk = vec![0; 1 << 16];
        while let Ok(n @ 1..) = reader.read(&mut chunk) {
            sink.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    let access_lines = |t: &[u8]| {
        t.split(|&c| c == b'\n')
            .filter(|l| l.starts_with(b"{"))
            .count()
    };
    eventually(Duration::from_secs(10), "every access line written", || {
        access_lines(&got.lock().unwrap()) >= REQUESTS
    });
    let text = got.lock().unwrap().clone();
    let text = String::from_utf8(text).unwrap();
    let access: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(access.len(), REQUESTS, "each request logged once");
    assert!(access
        .iter()
        .all(|e| e["status"] == 200 && e["route"] == "a"));
}

#[test]
fn a_worker_that_logs_into_a_full_stderr_pipe_drops_the_line_and_keeps_serving() {
    // The router's own log shares stderr with the access log. While a pipe nobody reads is
    // full, a worker logging a warning must not wait for the reader.
    let d = temp_dir("fullerr");
    let live = mock("m0");
    // Healthy at first (a probe finding it down would ban it before any request tried it).
    let doomed = mock("m1");
    std::fs::write(
        d.0.join("routes/a.toml"),
        route_for(&[doomed.addr(), live.addr()], ""),
    )
    .unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    let p = start_serve_spawning(&d.0, "", |cfg| {
        spawn_serve_to(
            cfg,
            &["--access-log", "stderr", "--workers", "1"],
            writer.try_clone().unwrap().into(),
        )
    });
    // Fill the pipe to its last byte, as a reader that stopped long ago leaves it (the
    // router's own writes may leave room at the end of a page that a short line fits in).
    let mut fill = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", writer.as_raw_fd()))
        .unwrap();
    drop(writer);
    let mut filled = 0;
    for chunk in [&[b'#'; 4096][..], b"#"] {
        while let Ok(n) = fill.write(chunk) {
            filled += n;
        }
    }
    assert!(filled > 0 && fill.write(b"#").is_err());
    drop(doomed);
    // Sessions that hash to the stopped peer make the worker log its connect failure and
    // the ban.
    let mut s = connect(p.public);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut retried = 0;
    for i in 0..20 {
        s.write_all(&post_json(
            "/a/v1/chat/completions",
            &chat_body("x", false),
            &format!("x-session-id: s{i}\r\n"),
        ))
        .unwrap();
        let r = read_response(&mut BufReader::new(&mut s), false)
            .unwrap_or_else(|e| panic!("session s{i}: the worker stalled: {e}"));
        assert_eq!(r.status, 200, "session s{i}");
        retried += usize::from(r.header("x-routed-retries") != Some("0"));
    }
    // The control: the stopped peer was tried (a warning was due) and the line dropped.
    assert!(retried >= 1, "no session reached the stopped peer");
    let m = request(p.admin, &get("/metrics")).text();
    let dropped: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("warmroute_log_dropped_total "))
        .expect("warmroute_log_dropped_total")
        .parse()
        .unwrap();
    assert!(dropped >= 1, "{m}");
    drop(reader);
}

#[test]
fn sigusr1_reopens_the_access_log_after_a_rotation() {
    let d = temp_dir("rotate");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let log = d.0.join("access.log");
    let rotated = d.0.join("access.log.1");
    let p = start_serve_with(&d.0, "", &["--access-log", log.to_str().unwrap()]);
    let chat = |session: &str| {
        let r = request(
            p.public,
            &post_json(
                "/a/v1/chat/completions",
                &chat_body("x", false),
                &format!("x-session-id: {session}\r\n"),
            ),
        );
        assert_eq!(r.status, 200);
    };
    let read = |f: &Path| std::fs::read_to_string(f).unwrap_or_default();
    chat("before");
    eventually(Duration::from_secs(3), "the first line", || {
        read(&log).contains("\"before\"")
    });
    // logrotate moves the file away: the router writes on into it until told.
    std::fs::rename(&log, &rotated).unwrap();
    chat("moved");
    eventually(Duration::from_secs(3), "the line in the moved file", || {
        read(&rotated).contains("\"moved\"")
    });
    assert!(!log.exists());
    p.signal("USR1");
    let mut n = 0;
    eventually(
        Duration::from_secs(5),
        "lines in a new file at the path",
        || {
            n += 1;
            chat(&format!("after-{n}"));
            read(&log).contains("\"after-")
        },
    );
    assert!(!read(&log).contains("\"moved\""));
    assert!(!read(&rotated).contains(&format!("\"after-{n}\"")));
}

#[test]
fn reloads_do_not_repeat_the_no_key_file_warning() {
    let d = temp_dir("reloadwarn");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (p, text) = start_serve_logging(&d.0, "", &[]);
    for generation in [2, 3] {
        p.signal("HUP");
        eventually(Duration::from_secs(5), "reloaded", || {
            text().contains(&format!("configuration reloaded generation={generation}"))
        });
    }
    // Said once, at start (the control: it is said), not again on each reload. The server
    // file names no key file, so the default one (SPEC §2.1) is read: it is not on this
    // machine, and the status says so.
    let all = text();
    assert_eq!(
        all.matches("no API keys: authentication is OFF").count(),
        1,
        "{all}"
    );
    assert!(all.contains("/etc/warmroute/api-keys/keys"), "{all}");
    let hs = request(p.public, &get("/a/_health_status")).json();
    assert_eq!(hs["_meta"]["key_file_status"], "missing", "{hs}");
}

#[test]
fn a_missing_key_file_fails_open_and_says_so() {
    let d = temp_dir("nokeys");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    std::fs::write(
        d.0.join("routes/locked.toml"),
        route_for(&[m.addr()], "api_keys = { \"route-key\" = \"dave\" }\n"),
    )
    .unwrap();
    let p = start_serve_with(
        &d.0,
        &format!("api_keys_file = \"{}\"\n", d.0.join("absent").display()),
        &[],
    );
    assert_eq!(
        request(
            p.public,
            &post_json("/a/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        200
    );
    let hs = request(p.public, &get("/a/_health_status")).json();
    assert_eq!(
        hs["_meta"],
        serde_json::json!({"api_keys_configured": false, "route_auth_enabled": false, "key_file_status": "missing", "kept_previous_keys": false})
    );
    // The control: a route with its own table still enforces it.
    assert_eq!(
        request(
            p.public,
            &post_json("/locked/v1/chat/completions", &chat_body("x", false), "")
        )
        .status,
        401
    );
    assert_eq!(chat_with_key(&p, "locked", "route-key", "").status, 200);
    assert_eq!(
        request(p.public, &get("/locked/_health_status")).json()["_meta"]["route_auth_enabled"],
        true
    );
}

#[test]
fn a_key_file_emptied_on_a_running_router_keeps_the_keys_in_force() {
    // An editor or a script that truncates the file before writing it leaves it empty for
    // a moment; a reload then must not open every route.
    let d = temp_dir("emptykeys");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let keys = d.0.join("keys");
    std::fs::write(&keys, "k1:alice\n").unwrap();
    let (p, text) = start_serve_logging(
        &d.0,
        &format!("api_keys_file = \"{}\"\n", keys.display()),
        &[],
    );
    let no_key = || chat_status_without_key(&p, "a");
    assert_eq!(no_key(), 401);
    std::fs::write(&keys, "").unwrap();
    p.signal("HUP");
    eventually(Duration::from_secs(5), "the reload logged", || {
        text().contains("keeping the keys loaded before")
    });
    for _ in 0..4 {
        assert_eq!(no_key(), 401, "an empty key file opened the route");
        assert_eq!(chat_with_key(&p, "a", "k1", "").status, 200);
    }
    // What the router says is what it does: the file is empty, the earlier keys are in
    // force, and no line claims that authentication is off.
    // (Each worker takes the new snapshot on its next tick: wait until all have.)
    let meta = || request(p.public, &get("/a/_health_status")).json()["_meta"].clone();
    let kept = serde_json::json!({"api_keys_configured": true, "route_auth_enabled": true, "key_file_status": "empty", "kept_previous_keys": true});
    eventually(
        Duration::from_secs(5),
        "the status names the emptied file",
        || (0..4).all(|_| meta() == kept),
    );
    assert!(!text().contains("authentication is OFF"), "{}", text());
    // Another reload finds the file as it was: the keys stay, and it is not said again.
    p.signal("HUP");
    eventually(Duration::from_secs(5), "reloaded again", || {
        text().contains("configuration reloaded generation=3")
    });
    assert_eq!(
        no_key(),
        401,
        "a second reload of the empty file opened the route"
    );
    assert_eq!(meta(), kept);
    assert_eq!(
        text().matches("keeping the keys loaded before").count(),
        1,
        "{}",
        text()
    );
    // The control: a key file removed on purpose turns the keys off (fail-open, as at
    // start) and says so, and a new file is taken as it is.
    std::fs::remove_file(&keys).unwrap();
    p.signal("HUP");
    eventually(Duration::from_secs(5), "keys off", || {
        (0..4).all(|_| no_key() == 200)
    });
    let off = serde_json::json!({"api_keys_configured": false, "route_auth_enabled": false, "key_file_status": "missing", "kept_previous_keys": false});
    eventually(
        Duration::from_secs(5),
        "the status says the keys are off",
        || (0..4).all(|_| meta() == off),
    );
    assert!(text().contains("authentication is OFF"), "{}", text());
    std::fs::write(&keys, "k2:bob\n").unwrap();
    p.signal("HUP");
    eventually(Duration::from_secs(5), "new keys", || {
        (0..4).all(|_| no_key() == 401 && chat_with_key(&p, "a", "k2", "").status == 200)
    });
}

/// A key file rotated while a route file on disk is broken: the configuration reload is
/// refused, but the keys apply (a revoked key stops working). They used to wait until the
/// route file was fixed, and nothing said so.
#[test]
fn a_key_rotation_applies_while_a_broken_route_file_is_refused() {
    let d = temp_dir("keys-broken-route");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let keys = d.0.join("keys");
    std::fs::write(&keys, "old-key:alice\n").unwrap();
    let (p, text) = start_serve_logging(
        &d.0,
        &format!("api_keys_file = \"{}\"\n", keys.display()),
        &[],
    );
    assert_eq!(chat_with_key(&p, "a", "old-key", "").status, 200);
    std::fs::write(d.0.join("routes/bad.toml"), "peers = 5\n").unwrap();
    std::fs::write(&keys, "new-key:bob\n").unwrap();
    p.signal("HUP");
    eventually(Duration::from_secs(5), "the new key in force", || {
        (0..4).all(|_| {
            chat_with_key(&p, "a", "new-key", "").status == 200
                && chat_with_key(&p, "a", "old-key", "").status == 401
        })
    });
    let log = text();
    assert!(log.contains("the rest of the reload was refused"), "{log}");
    // The control: the broken route file was refused, so no route "bad" is served.
    assert!(log.contains("reload refused"), "{log}");
    assert_eq!(
        request(p.public, &get("/bad/_route_state")).status,
        404,
        "the broken route was applied"
    );
}

#[test]
fn a_routes_directory_emptied_on_disk_is_not_applied_until_a_sighup() {
    // A deploy that empties the directory before copying the new files, seen by the
    // watcher halfway: every route would answer 404.
    let d = temp_dir("emptyroutes");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (p, text) = start_serve_logging(&d.0, "", &[]);
    let status = || chat_status_without_key(&p, "a");
    assert_eq!(status(), 200);
    std::fs::remove_file(d.0.join("routes/a.toml")).unwrap();
    eventually(Duration::from_secs(10), "the watcher's refusal", || {
        text().contains("a change on disk that removes every route is not applied")
    });
    for _ in 0..4 {
        assert_eq!(status(), 200, "the emptied directory was applied");
    }
    // The control: SIGHUP applies it.
    p.signal("HUP");
    eventually(Duration::from_secs(5), "no route after SIGHUP", || {
        (0..4).all(|_| status() == 404)
    });
}

#[test]
fn route_files_and_a_swapped_key_secret_are_picked_up_without_a_signal() {
    let d = temp_dir("watch");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    // A Kubernetes-style secret: keys -> ..data/keys, ..data -> v1.
    let sec = d.0.join("secret");
    std::fs::create_dir_all(sec.join("v1")).unwrap();
    std::fs::write(sec.join("v1/keys"), "k1:one").unwrap();
    std::os::unix::fs::symlink("v1", sec.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/keys", sec.join("keys")).unwrap();
    let p = start_serve_with(
        &d.0,
        &format!("api_keys_file = \"{}\"\n", sec.join("keys").display()),
        &[],
    );
    assert_eq!(chat_with_key(&p, "a", "k1", "").status, 200);
    std::fs::write(d.0.join("routes/b.toml"), route_for(&[m.addr()], "")).unwrap();
    eventually(
        Duration::from_secs(6),
        "new route served by every worker",
        || (0..4).all(|_| chat_with_key(&p, "b", "k1", "").status == 200),
    );
    // Swap the secret atomically, as the kubelet does.
    std::fs::create_dir_all(sec.join("v2")).unwrap();
    std::fs::write(sec.join("v2/keys"), "k2:two").unwrap();
    std::os::unix::fs::symlink("v2", sec.join("..data_tmp")).unwrap();
    std::fs::rename(sec.join("..data_tmp"), sec.join("..data")).unwrap();
    // Every worker picks the new snapshot up on its next tick: wait until all have.
    eventually(
        Duration::from_secs(6),
        "swapped key accepted, old one refused",
        || {
            (0..4).all(|_| {
                chat_with_key(&p, "a", "k2", "").status == 200
                    && chat_with_key(&p, "a", "k1", "").status == 401
            })
        },
    );
}

#[test]
fn takeover_replaces_a_running_router_without_failing_a_request() {
    let d = temp_dir("takeover");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let mut old = start_serve(&d.0);
    let public = old.public;
    // A long stream through the old router, and steady traffic on new connections.
    let mut s = connect(public);
    s.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", true),
        "x-mock-tokens: 10\r\nx-mock-interval-ms: 150\r\n",
    ))
    .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match try_request(
                    public,
                    &post_json("/a/v1/chat/completions", &chat_body("y", false), ""),
                ) {
                    Ok(r) if r.status == 200 => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, failed)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // The new router on the same config (ports and segment), with --takeover.
    let new = take_over(&mut old, &d.0, &[]);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = loader.join().unwrap();
    // Without net.ipv4.tcp_migrate_req the kernel resets a connection that reaches the old
    // listener in the instant between its last accept and its close; that (at most one
    // reset) is the only failure tolerated here.
    let resets = failed
        .iter()
        .filter(|f| f.contains("ConnectionReset"))
        .count();
    assert!(
        failed.len() == resets && resets <= 1,
        "{} failed of {}: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(ok > 20, "traffic flowed throughout: {ok}");
    let resp = read_response(&mut BufReader::new(s), false).unwrap();
    assert!(
        resp.text().contains("[DONE]"),
        "the old router's stream finished during its drain"
    );
    // The new one serves on its own now.
    assert_eq!(
        request(
            new.public,
            &post_json("/a/v1/chat/completions", &chat_body("z", false), "")
        )
        .status,
        200
    );
    assert_eq!(request(new.admin, &get("/readyz")).status, 200);
}

#[test]
fn a_takeover_loses_no_request_of_busy_keep_alive_clients() {
    // Clients that keep their connections and send the next request the moment the last
    // answer arrives (wrk, a connection pool under load): the draining router must answer
    // each request it reads and tell the client to reconnect, not close under it.
    let d = temp_dir("takeover-ka");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let mut old = start_serve(&d.0);
    let public = old.public;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut ok, mut told_to_close, mut lost) = (0u32, 0u32, Vec::new());
                let mut fresh_resets = 0u32;
                let mut conn: Option<std::net::TcpStream> = None;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let fresh = conn.is_none();
                    let s = conn.get_or_insert_with(|| connect(public));
                    let req = post_json("/a/v1/chat/completions", &chat_body("y", false), "");
                    let r = s
                        .write_all(&req)
                        .and_then(|()| read_response(&mut BufReader::new(&mut *s), false));
                    match r {
                        Ok(r) if r.status == 200 => {
                            ok += 1;
                            if r.header("connection") == Some("close") {
                                told_to_close += 1;
                                conn = None;
                            }
                        }
                        Err(e) if fresh && e.kind() == std::io::ErrorKind::ConnectionReset => {
                            fresh_resets += 1;
                            conn = None;
                        }
                        other => {
                            lost.push(format!("{other:?}"));
                            conn = None;
                        }
                    }
                }
                (ok, told_to_close, lost, fresh_resets)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let new = take_over(&mut old, &d.0, &[]);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut told, mut lost, mut fresh_resets) = (0, 0, Vec::new(), 0);
    for c in clients {
        let (o, t, l, r) = c.join().unwrap();
        ok += o;
        told += t;
        lost.extend(l);
        fresh_resets += r;
    }
    assert!(
        lost.is_empty(),
        "{} of {} requests lost: {:?}",
        lost.len(),
        ok as usize + lost.len(),
        &lost[..lost.len().min(3)]
    );
    // A keep-alive connection is never reset under its client. The one failure tolerated
    // is the kernel's, as in the test above: without net.ipv4.tcp_migrate_req a connection
    // that reaches the old listener in the instant between its last accept and its close
    // is reset before its first request is answered.
    let migrate = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req")
        .is_ok_and(|v| v.trim() == "1");
    assert!(
        fresh_resets <= u32::from(!migrate),
        "{fresh_resets} new connections reset (tcp_migrate_req: {migrate})"
    );
    // The control: the old router's last answers told the clients to go (one per client
    // connection it held), and traffic flowed on both sides of the handover.
    assert!(told >= 8, "answers with Connection: close: {told}");
    assert!(ok > 100, "{ok}");
    assert_eq!(request(new.admin, &get("/readyz")).status, 200);
}

#[test]
fn a_takeover_between_routers_of_more_than_32_workers_finds_rows_for_both() {
    // Both routers own worker rows while the old one drains: 40 + 40 outgrew the 64 rows
    // a segment had, and the new router's workers could not start.
    let d = temp_dir("takeover-wide");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let mut old = start_serve_with(&d.0, "", &["--workers", "40"]);
    let public = old.public;
    let chat = || {
        request(
            public,
            &post_json("/a/v1/chat/completions", &chat_body("x", false), ""),
        )
        .status
    };
    assert_eq!(chat(), 200);
    let mut new = take_over(&mut old, &d.0, &["--workers", "40"]);
    assert!(
        new.child.try_wait().unwrap().is_none(),
        "the new router exited"
    );
    assert_eq!(chat(), 200);
    let workers = request(new.admin, &get("/metrics"))
        .text()
        .lines()
        .filter(|l| l.starts_with("warmroute_worker_cpu_seconds_total{"))
        .count();
    assert_eq!(workers, 40);
}

#[test]
fn the_router_raises_its_soft_fd_limit_to_the_hard_one() {
    let (soft, hard) = warmroute_shm::nofile_limit().unwrap();
    // The router inherits a low soft limit (systemd's default is 1024), as a service would.
    let low = soft.min(hard).min(256);
    warmroute_shm::set_nofile_soft(low).unwrap();
    let d = temp_dir("nofile");
    let p = start_serve(&d.0);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", p.child.id())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(nums, vec![hard, hard], "{line}");
    // Control: the process that started it still has the low limit it handed down.
    assert_eq!(warmroute_shm::nofile_limit().unwrap().0, low);
    warmroute_shm::set_nofile_soft(soft).unwrap();
}

/// A TCP sink counting the bytes each accepted connection sends (a stand-in body-log
/// listener: the frames' content is tested in tests/bodylog_router.rs).
fn byte_sink() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let n = std::sync::Arc::new(AtomicUsize::new(0));
    let count = n.clone();
    serve_each(l, move |mut s| {
        let mut buf = [0u8; 4096];
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            count.fetch_add(k, Ordering::Relaxed);
        }
    });
    (addr, n)
}

/// SPEC §12 and §2.1: a SIGHUP that names another `[bodylog] listener` sends the next
/// records there, and `listener = ""` stops body logging. Before, the worker kept the
/// sender it started with: records went on to the old listener after body logging was
/// turned off.
#[test]
fn a_reload_moves_body_logging_to_the_new_listener_or_turns_it_off() {
    use std::sync::atomic::Ordering::Relaxed;
    let d = temp_dir("bodylog-reload");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (a, got_a) = byte_sink();
    let (b, got_b) = byte_sink();
    let (p, text) = start_serve_logging(&d.0, &format!("[bodylog]\nlistener = \"{a}\"\n"), &[]);
    let chat = || assert_eq!(chat_status_without_key(&p, "a"), 200);
    let reload = |listener: String, generation: u32| {
        server_file_with(
            &d.0,
            p.public.port(),
            p.admin.port(),
            &p.shm,
            &format!("[bodylog]\nlistener = \"{listener}\"\n"),
        );
        p.signal("HUP");
        eventually(Duration::from_secs(5), "reloaded", || {
            text().contains(&format!("configuration reloaded generation={generation}"))
        });
        // Each of the 2 workers takes the new snapshot at its next tick and says so.
        let changes = 2 * (generation as usize - 1);
        eventually(Duration::from_secs(5), "both workers switched", || {
            text().matches("body-log listener changed").count() == changes
        });
    };
    // The control: records reach the first listener.
    chat();
    eventually(Duration::from_secs(5), "a record at A", || {
        got_a.load(Relaxed) > 0
    });
    reload(b.to_string(), 2);
    let a_before = got_a.load(Relaxed);
    for _ in 0..4 {
        chat();
    }
    eventually(Duration::from_secs(5), "records at B", || {
        got_b.load(Relaxed) > 0
    });
    assert_eq!(got_a.load(Relaxed), a_before, "nothing more goes to A");
    let st = request(p.public, &get("/a/_bodylog_status")).json();
    assert_eq!(st["enabled"], true, "{st}");
    // Off: nothing goes anywhere, and the status says so.
    reload(String::new(), 3);
    let (a_off, b_off) = (got_a.load(Relaxed), got_b.load(Relaxed));
    for _ in 0..4 {
        chat();
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        (got_a.load(Relaxed), got_b.load(Relaxed)),
        (a_off, b_off),
        "{}",
        text()
    );
    let st = request(p.public, &get("/a/_bodylog_status")).json();
    assert_eq!(st["enabled"], false, "{st}");
}

/// Write a file whole (a temporary name, then a rename): the routes watcher never reads
/// it half written.
fn write_whole(path: &Path, text: &str) {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `count` peers on closed local ports, at addresses of their own for each `generation`
/// (127.0.<generation + 1>.x): a route whose backends all moved.
fn moved_peers_route(generation: u32, count: u32) -> String {
    let mut s = String::from("health_check_interval = 3600\npeers = [\n");
    for i in 0..count {
        s.push_str(&format!(
            "  {{ host = \"127.0.{}.{}\", port = {} }},\n",
            generation % 250 + 1,
            i % 250 + 1,
            40000 + i
        ));
    }
    s.push_str("]\n");
    s
}

/// `eventually` for a condition that runs a command: every 250 ms.
fn poll(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// SPEC §1: `status` prints the limits and EWMAs the gates use, which are the pool's, not
/// only each peer's: its in-flight count, healthy capacity, the limit the concurrency gate
/// applies (the adaptive one where adaptive concurrency is on) and its TTFT and
/// decode-rate EWMAs. Before, it had peer rows only.
#[test]
fn status_shows_each_pools_limit_and_ewmas() {
    let d = temp_dir("status-pools");
    let (m0, m1, m2) = (mock("m0"), mock("m1"), mock("m2"));
    let peer = |m: &warmroute_mock::MockServer, name: &str| {
        format!(
            "{{ host = \"127.0.0.1\", port = {}, name = \"{name}\", max_concurrency = 16 }}",
            m.addr().port()
        )
    };
    std::fs::write(
        d.0.join("routes/ac.toml"),
        format!(
            "adaptive_cc = true\nadaptive_cc_init_frac = 0.5\ntps_limit_tps = 15\n[peers_by_model]\n\"big\" = [ {}, {} ]\n",
            peer(&m0, "b0"),
            peer(&m1, "b1")
        ),
    )
    .unwrap();
    std::fs::write(
        d.0.join("routes/plain.toml"),
        format!("ttft_window = 1\npeers = [ {} ]\n", peer(&m2, "p0")),
    )
    .unwrap();
    let p = start_serve(&d.0);
    // One finished stream on `plain` (its EWMAs), one held on `big`.
    let done = request(
        p.public,
        &post_json("/plain/v1/chat/completions", &chat_body("x", true), ""),
    );
    assert_eq!(done.status, 200);
    let mut held = connect(p.public);
    let body = r#"{"model":"big","stream":true,"messages":[{"role":"user","content":"x"}]}"#;
    held.write_all(&post_json(
        "/ac/v1/chat/completions",
        body,
        "x-mock-hang-ms: 5000\r\n",
    ))
    .unwrap();
    eventually(Duration::from_secs(5), "request in the engine", || {
        m0.stats().active + m1.stats().active == 1
    });
    let text = status_with("--config", &d.0.join("warmroute.toml"));
    let pool = |name: &str| {
        status_row(&text, name).unwrap_or_else(|| panic!("no pool row {name}:\n{text}"))
    };
    // POOL INFLIGHT CAPACITY LIMIT ADAPTIVE TTFT_EWMA_MS TOKENS_S
    let big = pool("ac/big");
    assert_eq!(big[1..5], ["1", "32", "16", "yes"], "{text}");
    let plain = pool("plain");
    assert_eq!(plain[1..5], ["0", "16", "16", "no"], "{text}");
    assert_eq!(big[5], "-", "no sample yet: {text}");
    // The pool's TTFT EWMA once a window (1 s here) with samples has closed.
    let cfg = d.0.join("warmroute.toml");
    eventually(Duration::from_secs(10), "the pool's TTFT EWMA", || {
        let r = request(
            p.public,
            &post_json("/plain/v1/chat/completions", &chat_body("x", true), ""),
        );
        assert_eq!(r.status, 200);
        std::thread::sleep(Duration::from_millis(300));
        let text = status_with("--config", &cfg);
        status_row(&text, "plain").is_some_and(|r| r[5].parse::<f64>().is_ok())
    });
    // Without the configuration the segment does not name pools: it says how to see them.
    let text = status_text(&p.shm);
    assert!(text.contains("give --config"), "{text}");
    drop(held);
}

/// A server file without `shm_path` puts the segment at `/dev/shm/warmroute-<port>`, and
/// `serve --listen` moves it with the port. `status` takes the same `--listen` and reads the
/// segment `serve` would use; before, it ignored `--listen` and read the file's port's
/// segment (another router's, or none).
#[test]
fn status_follows_listen_to_the_default_segment() {
    let d = temp_dir("status-listen");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (file_port, public, admin) = (free_port(), free_port(), free_port());
    let cfg = d.0.join("warmroute.toml");
    std::fs::write(
        &cfg,
        format!("listen = \"127.0.0.1:{file_port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nroutes_dir = \"routes\"\n"),
    )
    .unwrap();
    let listen = format!("127.0.0.1:{public}");
    let mut p = Proc {
        child: spawn_serve(&cfg, &["--listen", &listen]),
        public: listen.parse().unwrap(),
        admin: format!("127.0.0.1:{admin}").parse().unwrap(),
        shm: PathBuf::from(format!("/dev/shm/warmroute-{public}")),
    };
    assert!(wait_ready_or_exit(&mut p, &d.0), "the router did not start");
    assert!(p.shm.exists(), "no segment at {}", p.shm.display());
    let status = |extra: &[&str]| {
        Command::new(BIN)
            .args(["status", "--config"])
            .arg(&cfg)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = status(&["--listen", &listen]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let key = format!("a//{}", m.addr());
    assert!(status_row(&text, &key).is_some(), "no row {key}:\n{text}");
    // The control: without --listen, the file's port's segment, which no router owns.
    let out = status(&[]);
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A router that has just exited can hold its port a moment longer (the kernel closes an
/// io_uring's listeners after the process is gone): a start right after looks again for a
/// second instead of refusing at once ("already served by another process").
#[test]
fn a_start_waits_a_moment_for_a_port_being_let_go() {
    let d = temp_dir("port-let-go");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let public = holder.local_addr().unwrap();
    let admin = free_port();
    let shm = d.0.join("segment");
    let cfg = server_file(&d.0, public.port(), admin, &shm);
    let letting_go = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(holder);
    });
    let mut p = Proc {
        child: spawn_serve(&cfg, &[]),
        public,
        admin: format!("127.0.0.1:{admin}").parse().unwrap(),
        shm,
    };
    letting_go.join().unwrap();
    assert!(
        wait_ready_or_exit(&mut p, &d.0),
        "the router refused a port let go 0.3 s after its start"
    );
    let r = request(
        p.public,
        &post_json("/a/v1/chat/completions", &chat_body("x", false), ""),
    );
    assert_eq!(r.status, 200);
}

/// `warmroute status --shm <segment>`.
fn status_text(shm: &Path) -> String {
    status_with("--shm", shm)
}

/// `warmroute status <flag> <path>` (`--shm` or `--config`): what it printed.
fn status_with(flag: &str, path: &Path) -> String {
    let out = Command::new(BIN)
        .args(["status".as_ref(), flag.as_ref(), path.as_os_str()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The status row of segment key `key`, split on blanks: key, name, in-flight, ...
fn status_row(text: &str, key: &str) -> Option<Vec<String>> {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .map(|l| l.split_whitespace().map(String::from).collect())
}

/// A streaming chat request to route `live` through `public` that the engine stretches over
/// a minute (the test drops it when done with it), once its response has started.
fn long_stream(public: SocketAddr) -> BufReader<std::net::TcpStream> {
    open_stream(
        public,
        "live",
        "x-mock-tokens: 600\r\nx-mock-interval-ms: 100\r\n",
    )
}

/// A streaming chat request to `route` through `public` with `headers` (each ending in
/// CRLF), once its response has started with a 200.
fn open_stream(public: SocketAddr, route: &str, headers: &str) -> BufReader<std::net::TcpStream> {
    let mut s = connect(public);
    s.write_all(&post_json(
        &format!("/{route}/v1/chat/completions"),
        &chat_body("x", true),
        headers,
    ))
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    r
}

/// Whether every one of a few requests to route `live` is answered by the mock `name`.
fn live_served_by(public: SocketAddr, name: &str) -> bool {
    (0..4).all(|_| {
        try_request(
            public,
            &post_json("/live/v1/chat/completions", &chat_body("y", false), ""),
        )
        .is_ok_and(|r| r.status == 200 && r.header("x-mock-peer") == Some(name))
    })
}

/// SPEC §11, §12: the segment slot of a peer that no configuration uses any more is freed
/// once nothing uses it, so a router whose backends keep moving (each reload replaces a
/// route's 1000 peers) keeps reloading long past the segment's 8192 peer slots, instead
/// of refusing every reload from the 9th on; a slot that a request in flight still uses
/// (on the configuration it started with) stays until the request ends.
#[test]
fn reloads_that_replace_peers_free_the_slots_of_the_old_ones() {
    let d = temp_dir("slots");
    let routes = d.0.join("routes");
    let mocks: Vec<_> = (0..12).map(|g| mock(&format!("m{g}"))).collect();
    write_whole(&routes.join("big.toml"), &moved_peers_route(0, 1000));
    write_whole(
        &routes.join("live.toml"),
        &route_for(&[mocks[0].addr()], ""),
    );
    let (p, log) = start_serve_logging(&d.0, "", &[]);
    // A stream on the first configuration's peer, in flight throughout.
    let stream = long_stream(p.public);
    let m0_key = format!("live//{}", mocks[0].addr());
    // 11 reloads, each with 1000 new peers (12,000 slots in all, for 8192) and a new
    // backend for `live`, which must serve once the reload is in force. A reload refused
    // for want of a slot is retried until the slots of the old peers are free.
    for (g, m) in mocks.iter().enumerate().skip(1) {
        write_whole(&routes.join("big.toml"), &moved_peers_route(g as u32, 1000));
        write_whole(&routes.join("live.toml"), &route_for(&[m.addr()], ""));
        let t0 = Instant::now();
        loop {
            p.signal("HUP");
            std::thread::sleep(Duration::from_millis(300));
            if live_served_by(p.public, &format!("m{g}")) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "generation {g} never came into force:\n{}",
                log().lines().rfind(|l| l.contains("reload")).unwrap_or("")
            );
            std::thread::sleep(Duration::from_millis(700));
        }
    }
    let text = status_text(&p.shm);
    let excerpt = |t: &str| t.chars().take(2000).collect::<String>();
    // The second generation's peers have left the segment (the reloads that followed
    // needed their slots)...
    assert!(
        !text.contains("big//127.0.2."),
        "the second generation's peers still hold slots:\n{}",
        excerpt(&text)
    );
    assert!(log().contains("freed the segment slots of peers no longer used"));
    // ... but the first configuration, which the stream still uses, keeps its slots: its
    // peer, and the rest of that configuration (a request may retry on other peers).
    let row = status_row(&text, &m0_key).unwrap_or_else(|| panic!("{m0_key} missing"));
    assert_eq!(row[2], "1", "its request is in flight: {row:?}");
    assert!(text.contains("big//127.0.1."), "{}", excerpt(&text));
    // Once the request ends, those slots go too.
    drop(stream);
    poll(Duration::from_secs(40), "the stream's peers freed", || {
        let text = status_text(&p.shm);
        status_row(&text, &m0_key).is_none() && !text.contains("big//127.0.1.")
    });
    assert!(live_served_by(p.public, "m11"));
}

/// `warmroute_segment_slots{table="peer",state=<state>}` from `admin`'s `/metrics`.
fn peer_slots_metric(admin: SocketAddr, state: &str) -> Option<u64> {
    slots_metric(admin, "peer", state)
}

/// `warmroute_segment_slots{table=<table>,state=<state>}` from `admin`'s `/metrics`.
fn slots_metric(admin: SocketAddr, table: &str, state: &str) -> Option<u64> {
    let want = format!("warmroute_segment_slots{{table=\"{table}\",state=\"{state}\"}} ");
    request(admin, &get("/metrics"))
        .text()
        .lines()
        .find_map(|l| l.strip_prefix(want.as_str())?.trim().parse().ok())
}

/// The route files of one generation for the route-slot test: `ROUTES_PER_GEN` routes named
/// `g<generation>-r<i>` on `peer`, each with `RULES_PER_ROUTE` reject rules (rule `rule<k>`
/// refuses `metadata.tenant = "t<k>"`). Each route takes 6 route slots (its own, status,
/// turn priority, and its pool's TTFT, decode-rate and control rows) and one per rule.
fn renamed_routes(routes: &Path, generation: u32, peer: SocketAddr) {
    let mut rules = String::from(
        "health_check_interval = 3600\nreject_rules_enabled = true\nreject_rules_status = 422\n",
    );
    for k in 0..RULES_PER_ROUTE {
        rules.push_str(&format!(
            "\n[[reject_rules]]\nname = \"rule{k}\"\nfield = \"metadata.tenant\"\nop = \"eq\"\nvalue = \"t{k}\"\n"
        ));
    }
    let text = route_for(&[peer], &rules);
    for i in 0..ROUTES_PER_GEN {
        write_whole(&routes.join(format!("g{generation}-r{i}.toml")), &text);
    }
}
const ROUTES_PER_GEN: u32 = 25;
const RULES_PER_ROUTE: u32 = 74;

/// SPEC §11, §12: the route slots of routes (and their pools and reject rules) that no
/// configuration uses any more are freed once nothing uses them, as peer slots are: a
/// router whose routes are renamed by each reload (2,025 route slots each, for 8,192)
/// keeps reloading instead of refusing every reload from the fourth on. The configuration
/// a request in flight started on keeps its slots until the request ends; a reused slot's
/// rule counter starts from nothing.
#[test]
fn reloads_that_rename_routes_free_the_slots_of_the_old_ones() {
    let d = temp_dir("route-slots");
    let routes = d.0.join("routes");
    let m = mock("m0");
    // Each with a key owner of its own, whose counters have a route slot too.
    write_whole(
        &routes.join("live.toml"),
        &route_for(&[m.addr()], "api_keys = { \"live-key\" = \"alice\" }\n"),
    );
    write_whole(
        &routes.join("keep.toml"),
        &route_for(&[m.addr()], "api_keys = { \"keep-key\" = \"dave\" }\n"),
    );
    renamed_routes(&routes, 0, m.addr());
    let (p, log) = start_serve_logging(&d.0, "", &[]);
    // A route's own rows: itself, its status, turn priority and route-wide record, and its
    // pool's three; then a row per rule. Live and keep have no rules, and a key owner each.
    let per_gen = u64::from(ROUTES_PER_GEN * (7 + RULES_PER_ROUTE));
    assert_eq!(
        slots_metric(p.admin, "route", "taken"),
        Some(per_gen + 16),
        "a generation, live and keep, alice and dave"
    );
    // A stream on `keep`, which the first reload drops, in flight throughout: it holds the
    // first configuration (its routes, rules and pools) until it ends.
    let mut stream = open_stream(
        p.public,
        "keep",
        "Authorization: Bearer keep-key\r\nx-mock-tokens: 600\r\nx-mock-interval-ms: 100\r\n",
    );
    std::fs::remove_file(routes.join("keep.toml")).unwrap();
    // Five reloads, each renaming every route of the generation: the fourth needs the slots
    // of the second (the first is held), the fifth those of the third. A reload refused
    // for want of a slot is retried until then.
    for g in 1..6u32 {
        for i in 0..ROUTES_PER_GEN {
            std::fs::remove_file(routes.join(format!("g{}-r{i}.toml", g - 1))).unwrap();
        }
        renamed_routes(&routes, g, m.addr());
        let path = format!("/g{g}-r0/v1/chat/completions");
        let body = r#"{"model":"mock-model","messages":[{"role":"user","content":"x"}],"metadata":{"tenant":"t3"}}"#;
        let t0 = Instant::now();
        loop {
            p.signal("HUP");
            std::thread::sleep(Duration::from_millis(300));
            if try_request(p.public, &post_json(&path, body, "")).is_ok_and(|r| r.status == 422) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "generation {g} never came into force ({:?} route slots taken):\n{}",
                slots_metric(p.admin, "route", "taken"),
                log()
                    .lines()
                    .filter(|l| l.contains("slot") || l.contains("reload"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            std::thread::sleep(Duration::from_millis(700));
        }
        // The rule's counter counts this generation's one hit, even in a reused slot. (The
        // other worker takes the new snapshot on its next tick: until then it knows no
        // such route.)
        let mut st = serde_json::Value::Null;
        eventually(Duration::from_secs(5), "the route on every worker", || {
            st = request(p.public, &get(&format!("/g{g}-r0/_reject_rules_status"))).json();
            st["rules"][3]["name"] == "rule3"
        });
        assert_eq!(st["rules"][3]["hits"], 1, "{st}");
        assert_eq!(st["rules"][2]["hits"], 0, "{st}");
    }
    assert!(
        log().contains("freed the segment slots of routes"),
        "{}",
        log()
    );
    // The reloads refused on the way said which table was full, how full, and what frees it.
    let refusal = log()
        .lines()
        .find(|l| l.contains("reload refused") && l.contains("no free route slot"))
        .map(String::from)
        .unwrap_or_else(|| panic!("no refusal logged:\n{}", log()));
    assert!(
        refusal.contains("(slots): shared segment has no free route slot for ")
            && refusal.contains(" of 8192 taken). The slots of peers and routes")
            && refusal.contains("retry the reload then"),
        "{refusal}"
    );
    // Generations 1 to 4 go; the first configuration (`keep` and its owner too) stays while
    // its request is in flight.
    poll(Duration::from_secs(40), "older generations freed", || {
        slots_metric(p.admin, "route", "taken") == Some(2 * per_gen + 16)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        slots_metric(p.admin, "route", "taken"),
        Some(2 * per_gen + 16),
        "the first configuration's slots stay under its request"
    );
    let mut line = String::new();
    stream.read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "the stream still flows");
    // Once the request ends, they go too.
    drop(stream);
    poll(
        Duration::from_secs(40),
        "the first configuration's slots freed",
        || slots_metric(p.admin, "route", "taken") == Some(per_gen + 8),
    );
    let r = request(
        p.public,
        &post_json(
            "/live/v1/chat/completions",
            &chat_body("y", false),
            "Authorization: Bearer live-key\r\n",
        ),
    );
    assert_eq!(r.status, 200);
}

/// SPEC §11, §12: in a takeover, the router being replaced drains on the configuration it
/// had; the slots of its peers stay while its requests are in flight, even though the new
/// router's configuration does not have them and frees what it dropped itself, and they
/// are freed once it is gone.
#[test]
fn a_draining_router_keeps_the_slots_of_its_peers_until_it_is_done() {
    let a = temp_dir("slots-old");
    let b = temp_dir("slots-new");
    let (m0, m1, m2) = (mock("m0"), mock("m1"), mock("m2"));
    write_whole(&a.0.join("routes/live.toml"), &route_for(&[m0.addr()], ""));
    let mut old = start_serve(&a.0);
    let stream = long_stream(old.public);
    let m0_key = format!("live//{}", m0.addr());
    let m2_key = format!("extra//{}", m2.addr());
    // The new router: same ports and segment, its own routes (live on m1, and extra on m2,
    // which a reload drops).
    write_whole(&b.0.join("routes/live.toml"), &route_for(&[m1.addr()], ""));
    write_whole(&b.0.join("routes/extra.toml"), &route_for(&[m2.addr()], ""));
    let public = old.public.port();
    let admin = old.admin.port();
    let cfg = server_file(&b.0, public, admin, &old.shm);
    let new = Proc {
        child: spawn_serve(&cfg, &["--takeover"]),
        public: old.public,
        admin: old.admin,
        shm: old.shm.clone(),
    };
    eventually(Duration::from_secs(10), "the new router serves", || {
        live_served_by(new.public, "m1")
    });
    assert!(
        old.child.try_wait().unwrap().is_none(),
        "the old one drains"
    );
    // /metrics shows the table: the old router's peer and the new router's two.
    assert_eq!(peer_slots_metric(new.admin, "taken"), Some(3));
    assert!(peer_slots_metric(new.admin, "capacity").is_some_and(|c| c >= 64));
    std::fs::remove_file(b.0.join("routes/extra.toml")).unwrap();
    new.signal("HUP");
    // The control: the slot the new router dropped is freed...
    poll(Duration::from_secs(40), "the dropped peer freed", || {
        status_row(&status_text(&new.shm), &m2_key).is_none()
    });
    // ... while the old router's peer, in no configuration of the new one, stays.
    assert!(
        old.child.try_wait().unwrap().is_none(),
        "the old one drains"
    );
    let text = status_text(&new.shm);
    let row = status_row(&text, &m0_key).unwrap_or_else(|| panic!("{m0_key} missing:\n{text}"));
    assert_eq!(row[2], "1", "its request is in flight: {row:?}");
    // Once the old router is done, its peer's slot goes too.
    drop(stream);
    let status = old
        .wait_exit(Duration::from_secs(15))
        .expect("the old router finishes draining");
    assert!(status.success());
    poll(
        Duration::from_secs(40),
        "the old router's peer freed",
        || status_row(&status_text(&new.shm), &m0_key).is_none(),
    );
    assert!(live_served_by(new.public, "m1"));
    assert_eq!(
        peer_slots_metric(new.admin, "taken"),
        Some(1),
        "only live//m1 is left"
    );
}

/// A router out of file descriptors bans no peer: a connect that fails on this host (EMFILE)
/// says nothing of the peer. The request that hit it is answered 502 (the control: the
/// descriptors did run out, for the proxied connect and for the health probes), yet no
/// peer is banned, the probes record a local error, and once descriptors are free again
/// the pool serves at once. It used to ban every peer it tried, and the probes kept the
/// bans going while descriptors stayed short.
#[test]
fn running_out_of_file_descriptors_bans_no_peer() {
    let (m0, m1) = (mock("m0"), mock("m1"));
    let dir = temp_dir("emfile");
    std::fs::write(
        dir.0.join("routes/r.toml"),
        route_for(
            &[m0.addr(), m1.addr()],
            "health_check_interval = 1\nhealth_ban_ttl = 60\n",
        ),
    )
    .unwrap();
    let p = start_serve_spawning(&dir.0, "", |cfg| {
        let line = format!(
            "ulimit -n 64 && exec {BIN} serve --config {} --workers 1 --no-pin --access-log off",
            cfg.display()
        );
        let log = std::fs::File::create(cfg.with_file_name("router.log")).unwrap();
        Command::new("sh")
            .args(["-c", &line])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    });
    // A kept connection, accepted while descriptors were free.
    let c = connect(p.public);
    let mut rd = BufReader::new(c.try_clone().unwrap());
    let mut c = c;
    let mut ask = |req: &[u8]| {
        c.write_all(req).unwrap();
        read_response(&mut rd, false).unwrap()
    };
    let chat = post_json("/r/v1/chat/completions", &chat_body("x", false), "");
    let health = get("/r/_health_status");
    assert_eq!(ask(&health).status, 200);
    // Idle clients take every descriptor the router has left.
    let idle: Vec<_> = (0..120).map(|_| connect(p.public)).collect();
    // Out of descriptors once its accept loop says so (a request sent before that could
    // still open a peer connection, which the pool would then keep).
    let log_path = dir.0.join("router.log");
    eventually(
        Duration::from_secs(10),
        "the router out of descriptors",
        || {
            std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .contains("accept failed")
        },
    );
    let r = ask(&chat);
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.text().contains("Too many open files"), "{}", r.text());
    // Two probe rounds under the shortage.
    std::thread::sleep(Duration::from_millis(2500));
    let hs = ask(&health).json();
    for m in [&m0, &m1] {
        let peer = &hs[m.addr().to_string()];
        assert_eq!(peer["banned"], false, "{hs}");
        assert_eq!(peer["bans"], 0, "{hs}");
        assert_eq!(peer["last_probe"]["result"], "local_error", "{hs}");
    }
    // The accept loop retried all along, and said so once, not at every retry.
    let log = std::fs::read_to_string(dir.0.join("router.log")).unwrap();
    let lines = log.matches("accept failed").count();
    assert_eq!(lines, 1, "{log}");
    drop(idle);
    eventually(Duration::from_secs(5), "served again", || {
        ask(&chat).status == 200
    });
    let r = ask(&chat);
    assert_eq!(
        (r.status, r.header("x-routed-retries")),
        (200, Some("0")),
        "{}",
        r.text()
    );
}

/// `warmroute status` shows a peer's TTFT EWMA only while it is younger than the route's
/// `ttft_ttl`, as `_health_status` and `/metrics` do; it showed a value long expired.
/// The control: the fresh value is shown.
#[test]
fn status_shows_no_expired_ewma() {
    let d = temp_dir("status-ttl");
    let m = mock_with("m0", |c| c.ttft_base_ms = 100);
    std::fs::write(
        d.0.join("routes/chat.toml"),
        route_for(&[m.addr()], "ttft_ttl = 2\n"),
    )
    .unwrap();
    let p = start_serve(&d.0);
    let r = request(
        p.public,
        &post_json("/chat/v1/chat/completions", &chat_body("x", true), ""),
    );
    assert_eq!(r.status, 200);
    let cfg = d.0.join("warmroute.toml");
    let ttft = || {
        let text = status_with("--config", &cfg);
        let row = status_row(&text, &format!("chat//{}", m.addr()))
            .unwrap_or_else(|| panic!("peer row missing:\n{text}"));
        row[row.len() - 2].clone()
    };
    // The sample is recorded a moment after the client has its last byte.
    eventually(
        Duration::from_secs(2),
        "a TTFT value after the request",
        || ttft() != "-",
    );
    let fresh: f64 = ttft().parse().unwrap();
    assert!((50.0..5000.0).contains(&fresh), "{fresh}");
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(ttft(), "-");
}

/// SPEC §10 and §5.6: a switch or override set for a whole route at runtime (no `model=`)
/// also covers a `peers_by_model` pool that a reload adds later; it used to leave the new
/// pool on its defaults, the route half switched. The control: one set for one model only
/// stays that model's.
#[test]
fn route_wide_runtime_settings_cover_a_pool_added_by_a_reload() {
    let d = temp_dir("widereload");
    let m = mock("m0");
    let port = m.addr().port();
    let pool = |model: &str| {
        format!(
            "\"{model}\" = [ {{ host = \"127.0.0.1\", port = {port}, max_concurrency = 1 }} ]\n"
        )
    };
    let file = d.0.join("routes/pm.toml");
    std::fs::write(&file, format!("[peers_by_model]\n{}", pool("m1"))).unwrap();
    let p = start_serve(&d.0);
    let before = p.routes_digest();
    for set in [
        "/pm/_rate_limit_toggle?on=0",
        "/pm/_ttft_toggle?on=0",
        "/pm/_ttft_limit?ms=5555&ttl=0",
        "/pm/_tps_limit?tps=7&ttl=0",
        "/pm/_tps_limit?tps=9&ttl=0&model=m1",
    ] {
        assert_eq!(request(p.public, &get(set)).status, 200, "{set}");
    }
    std::fs::write(
        &file,
        format!("[peers_by_model]\n{}{}", pool("m1"), pool("m2")),
    )
    .unwrap();
    p.signal("HUP");
    p.wait_routes_changed(&before);
    let rl = request(p.public, &get("/pm/_rate_limit_status")).json();
    for model in ["m1", "m2"] {
        assert_eq!(
            (
                &rl["pools"][model]["enabled"],
                &rl["pools"][model]["source"]
            ),
            (&serde_json::json!(false), &serde_json::json!("runtime")),
            "{model}: {rl}"
        );
    }
    let ttft = request(p.public, &get("/pm/_ttft_limit")).json();
    assert_eq!(ttft["pools"]["m2"]["override"], 5555.0, "{ttft}");
    let tps = request(p.public, &get("/pm/_tps_limit")).json();
    // The route-wide 7 reaches m2; m1 keeps the 9 set for it alone.
    assert_eq!(
        (
            &tps["pools"]["m1"]["override"],
            &tps["pools"]["m2"]["override"]
        ),
        (&serde_json::json!(9.0), &serde_json::json!(7.0)),
        "{tps}"
    );
    let st = request(p.public, &get("/pm/_ttft_status")).json();
    assert_eq!(st["pools"]["m2"]["runtime_off"], true, "{st}");
    // In force: the rate limit is off for m2 too, so a second request over its limit of
    // one goes through.
    let held = {
        let addr = p.public;
        std::thread::spawn(move || {
            request(
                addr,
                &post_json(
                    "/pm/v1/chat/completions",
                    &chat_body("x", false).replace("mock-model", "m2"),
                    "x-mock-hang-ms: 1500\r\n",
                ),
            )
        })
    };
    std::thread::sleep(Duration::from_millis(400));
    let r = request(
        p.public,
        &post_json(
            "/pm/v1/chat/completions",
            &chat_body("x", false).replace("mock-model", "m2"),
            "",
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(held.join().unwrap().status, 200);
}

/// SPEC §1 and §12: a log reader that goes away (`warmroute serve 2>&1 | head -1`, a log
/// shipper that dies) leaves the router serving and draining as usual. It used to abort:
/// the log formatter reported the failed write with `eprintln!`, which panics on a broken
/// stderr, and the panic's own report failed the same way. The control: the stream started
/// before SIGTERM finishes whole, and the router exits 0.
#[test]
fn a_log_reader_that_goes_away_neither_aborts_the_router_nor_cuts_its_drain() {
    let d = temp_dir("brokenerr");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    let mut p = start_serve_spawning(&d.0, "", |cfg| {
        spawn_serve_to(
            cfg,
            &["--access-log", "stderr"],
            writer.try_clone().unwrap().into(),
        )
    });
    drop(writer);
    drop(reader);
    // Requests and log lines into the broken pipe.
    for _ in 0..20 {
        assert_eq!(chat_status_without_key(&p, "a"), 200);
    }
    let mut s = open_stream(
        p.public,
        "a",
        "x-mock-tokens: 10\r\nx-mock-interval-ms: 100\r\n",
    );
    p.signal("TERM");
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("[DONE]"), "{rest}");
    let status = p.wait_exit(Duration::from_secs(10)).expect("exited");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// SPEC §2 and §1: start-up refuses, with the reason, an `--access-log` file it cannot open
/// (the workers used to turn the log off without a word) and a `shm_path` naming a file
/// that is not a segment (it used to be overwritten). The control: the same start with a
/// writable log and a fresh segment path serves.
#[test]
fn start_up_refuses_an_unopenable_access_log_and_a_file_that_is_not_a_segment() {
    let d = temp_dir("refusals");
    let run = |args: &[&str], shm: &Path| serve_to_exit(&d.0, args, shm);
    let fresh = d.0.join("segment");
    let (code, err) = run(&["--access-log", "/nonexistent-dir/access.log"], &fresh);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot start:\n--access-log /nonexistent-dir/access.log: No such file"),
        "{err}"
    );
    let data = d.0.join("notes.txt");
    std::fs::write(&data, "important data\n").unwrap();
    let (code, err) = run(&[], &data);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is not a warmroute segment"), "{err}");
    assert_eq!(std::fs::read_to_string(&data).unwrap(), "important data\n");
    // The control: a writable log and a path with no file start (and are stopped).
    let log = d.0.join("access.log");
    let cfg = server_file(&d.0, free_port(), free_port(), &fresh);
    let mut child = spawn_serve(&cfg, &["--access-log", log.to_str().unwrap()]);
    let t0 = Instant::now();
    while !fresh.exists() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the control start failed"
    );
    assert!(fresh.exists() && log.exists());
    child.kill().unwrap();
    child.wait().unwrap();
}

/// SPEC §12: a `drain_timeout_s` changed by a reload is the one the next drain keeps (it
/// used to be read once at start). The control: the stream that outlives the new limit is
/// cut at it, with the old limit of 300 s it would have run its 20 s.
#[test]
fn a_reloaded_drain_timeout_is_the_one_a_drain_keeps() {
    let d = temp_dir("draintimeout");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let mut p = start_serve_with(&d.0, "drain_timeout_s = 300\n", &[]);
    let cfg = d.0.join("warmroute.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("drain_timeout_s = 300", "drain_timeout_s = 1"),
    )
    .unwrap();
    p.signal("HUP");
    std::thread::sleep(Duration::from_millis(500));
    let mut s = open_stream(
        p.public,
        "a",
        "x-mock-tokens: 200\r\nx-mock-interval-ms: 100\r\n",
    );
    let t0 = Instant::now();
    p.signal("TERM");
    let status = p.wait_exit(Duration::from_secs(10)).expect("exited");
    let took = t0.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "drained for {took:?}");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(
        !String::from_utf8_lossy(&rest).contains("[DONE]"),
        "the stream was cut"
    );
}

/// The process's address space, in KiB (`VmSize`).
fn vm_size_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// SPEC §14 (every buffer bounded): a head that declares a large `Content-Length` and sends
/// nothing more holds a small buffer, not `max_body_size`. Before, each such head had the
/// router allocate the whole declared length, and a capped address space (`ulimit -v`,
/// strict overcommit) aborted the process after a few dozen of them.
#[test]
fn heads_declaring_large_bodies_do_not_reserve_them() {
    const DECLARED: usize = 16 * 1024 * 1024;
    const HEADS: usize = 32;
    let d = temp_dir("bodybuf");
    let b = raw_backend(
        vec![b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec()],
        usize::MAX,
    );
    std::fs::write(
        d.0.join("routes/a.toml"),
        route_for(&[b.addr], "max_body_size = \"20m\"\n"),
    )
    .unwrap();
    let p = start_serve(&d.0);
    let head = format!(
        "POST /a/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {DECLARED}\r\n\r\n{{"
    );
    let before = vm_size_kib(p.child.id());
    let mut conns: Vec<std::net::TcpStream> = (0..HEADS)
        .map(|_| {
            let mut s = connect(p.public);
            s.write_all(head.as_bytes()).unwrap();
            s
        })
        .collect();
    // Every head read and its body begun: each connection's first byte is in.
    std::thread::sleep(Duration::from_millis(500));
    let grown_mib = vm_size_kib(p.child.id()).saturating_sub(before) / 1024;
    assert!(
        grown_mib < 128,
        "{HEADS} heads of {DECLARED} bytes grew the router by {grown_mib} MiB"
    );
    // The control: the body that does arrive grows its buffer to the whole and reaches the
    // peer intact.
    let mut s = conns.pop().unwrap();
    let mut rest = vec![b' '; DECLARED - 2];
    rest.push(b'}');
    s.write_all(&rest).unwrap();
    let r = read_response(&mut BufReader::new(&mut s), false).unwrap();
    assert_eq!(r.status, 200);
    let got = b.requests.lock().unwrap();
    assert_eq!(got.len(), 1);
    let body = &got[0][got[0].len() - DECLARED..];
    assert_eq!((body[0], body[DECLARED - 1]), (b'{', b'}'));
    assert!(body[1..DECLARED - 1].iter().all(|&c| c == b' '));
}

/// How many CPUs this process may run on (its `Cpus_allowed_list`, counted).
fn worker0_mask_len() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    list.split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// The worker thread `warmroute-w0` of process `pid`: the CPUs it may run on
/// (`Cpus_allowed_list`).
fn worker0_cpus(pid: u32) -> String {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == "warmroute-w0" {
            let status = std::fs::read_to_string(t.path().join("status")).unwrap();
            return status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .unwrap()
                .trim()
                .to_string();
        }
    }
    panic!("no warmroute-w0 thread in {pid}");
}

/// `--join`: a second router serves the same port alongside the first, on one segment, so
/// one peer limit holds across both processes; a drain of one leaves the other serving; a
/// join pins its worker by its segment row, so two one-worker routers use two cores.
#[test]
fn a_joined_router_serves_alongside_the_first_with_one_pool_of_limits() {
    let d = temp_dir("join");
    let m = mock("m0");
    std::fs::write(
        d.0.join("routes/a.toml"),
        format!(
            "peers = [ {{ host = \"127.0.0.1\", port = {}, name = \"p0\", max_concurrency = 1 }} ]\n",
            m.addr().port()
        ),
    )
    .unwrap();
    // Pinned (no --no-pin), one worker each, an access log each: who served what.
    let log_a = d.0.join("access-a.log");
    let log_b = d.0.join("access-b.log");
    let spawn = |cfg: &Path, log: &Path, extra: &[&str]| {
        let n = std::fs::read_dir(d.0.clone())
            .map(|d| d.count())
            .unwrap_or(0);
        let err = std::fs::File::create(d.0.join(format!("router-{n}.log"))).unwrap();
        Command::new(BIN)
            .arg("serve")
            .arg("--config")
            .arg(cfg)
            .args(["--workers", "1", "--access-log"])
            .arg(log)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .unwrap()
    };
    let mut a = start_serve_spawning(&d.0, "", |cfg| spawn(cfg, &log_a, &[]));
    // The second process: the same server file (ports and segment), its own admin port so
    // that its readiness is its own.
    let admin_b: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cfg = d.0.join("warmroute.toml");
    let mut b = Proc {
        child: spawn(
            &cfg,
            &log_b,
            &["--join", "--admin-listen", &admin_b.to_string()],
        ),
        public: a.public,
        admin: admin_b,
        shm: a.shm.clone(),
    };
    assert!(wait_ready_or_exit(&mut b, &d.0), "the joined router starts");
    // Unlike a takeover, the first router keeps serving.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the join left the first router running"
    );
    assert_eq!(request(a.admin, &get("/readyz")).status, 200);
    // Both own a live worker row in the one segment (`WORKER PID TAG ALIVE ...`).
    let text = status_text(&a.shm);
    for pid in [a.child.id(), b.child.id()] {
        let owns_row = text.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 4 && f[1] == pid.to_string() && f[3] == "yes"
        });
        assert!(owns_row, "pid {pid} owns a live row:\n{text}");
    }
    // Pinned by segment row: the two one-worker routers run on different cores (on a host
    // with two cores or more in the mask; the index in the process would put both on the
    // first).
    if worker0_mask_len() >= 2 {
        let (ca, cb) = (worker0_cpus(a.child.id()), worker0_cpus(b.child.id()));
        assert_ne!(ca, cb, "the joined routers' workers share a core");
        assert!(
            !ca.contains(['-', ',']) && !cb.contains(['-', ',']),
            "{ca} / {cb} pinned"
        );
    }
    // One in-flight count: a request held in the engine fills the peer's limit of 1, and
    // every new connection, whichever process accepts it, is refused with a 429.
    let mut held = connect(a.public);
    held.write_all(&post_json(
        "/a/v1/chat/completions",
        &chat_body("x", false),
        "x-mock-hang-ms: 4000\r\n",
    ))
    .unwrap();
    eventually(Duration::from_secs(5), "request in the engine", || {
        m.stats().active == 1
    });
    let statuses: Vec<u16> = (0..24)
        .map(|i| {
            request(
                a.public,
                &post_json(
                    "/a/v1/chat/completions",
                    &chat_body(&format!("s{i}"), false),
                    "",
                ),
            )
            .status
        })
        .collect();
    assert!(statuses.iter().all(|&s| s == 429), "{statuses:?}");
    let lines = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    eventually(
        Duration::from_secs(3),
        "both processes refused some",
        || lines(&log_a).contains("\"status\":429") && lines(&log_b).contains("\"status\":429"),
    );
    // The control: with the held request done, the same requests pass.
    drop(held);
    eventually(Duration::from_secs(5), "the held request ends", || {
        m.stats().active == 0
    });
    eventually(Duration::from_secs(5), "the unit is given back", || {
        request(
            a.public,
            &post_json("/a/v1/chat/completions", &chat_body("c", false), ""),
        )
        .status
            == 200
    });
    // On a two-core host, a third router joined now finds both cores taken once and
    // shares the first's; when the second leaves, the third moves to the core it freed.
    if worker0_mask_len() == 2 {
        let admin_c: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log_c = d.0.join("access-c.log");
        let mut c = Proc {
            child: spawn(
                &cfg,
                &log_c,
                &["--join", "--admin-listen", &admin_c.to_string()],
            ),
            public: a.public,
            admin: admin_c,
            shm: a.shm.clone(),
        };
        assert!(wait_ready_or_exit(&mut c, &d.0), "the third router starts");
        let ca = worker0_cpus(a.child.id());
        assert_eq!(
            worker0_cpus(c.child.id()),
            ca,
            "the third shares the first's core"
        );
        b.signal("TERM");
        assert!(b
            .wait_exit(Duration::from_secs(15))
            .expect("the second exits")
            .success());
        eventually(
            Duration::from_secs(5),
            "the third moves to the freed core",
            || worker0_cpus(c.child.id()) != ca,
        );
        b = c;
    }
    // The first drains and exits; the other serves every new connection alone.
    a.signal("TERM");
    let status = a
        .wait_exit(Duration::from_secs(15))
        .expect("the first drains and exits");
    assert!(status.success());
    for i in 0..20 {
        let r = request(
            b.public,
            &post_json(
                "/a/v1/chat/completions",
                &chat_body(&format!("t{i}"), false),
                "",
            ),
        );
        assert_eq!(r.status, 200, "request {i} after the first router left");
    }
    assert!(b.child.try_wait().unwrap().is_none());
}

#[test]
fn takeover_and_join_together_are_refused() {
    let out = Command::new(BIN)
        .args(["serve", "--takeover", "--join"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--takeover and --join exclude each other"),
        "{err}"
    );
}

/// Two `--join` routers started in the same instant, with different worker counts (so
/// different segment sizes): both start and serve. Each claims its rows before it lets go
/// of the segment's lock, so neither takes the other's segment for unused and remakes it
/// under its mapping (a SIGBUS), nor the other's port for a stranger's.
#[test]
fn joined_routers_started_together_both_serve() {
    for round in 0..3 {
        let d = temp_dir("join-together");
        let m = mock("m0");
        std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
        let (p, a1, a2) = (free_port(), free_port(), free_port());
        let shm = d.0.join("segment");
        let cfg = server_file(&d.0, p, a1, &shm);
        let spawn = |workers: &str, admin: u16| {
            let admin = format!("127.0.0.1:{admin}");
            spawn_serve(
                &cfg,
                &["--join", "--workers", workers, "--admin-listen", &admin],
            )
        };
        let (c1, c2) = (spawn("1", a1), spawn("40", a2));
        let public: SocketAddr = format!("127.0.0.1:{p}").parse().unwrap();
        let mut procs = [(c1, a1), (c2, a2)].map(|(child, a)| Proc {
            child,
            public,
            admin: format!("127.0.0.1:{a}").parse().unwrap(),
            shm: shm.clone(),
        });
        for (i, pr) in procs.iter_mut().enumerate() {
            assert!(
                wait_ready_or_exit(pr, &d.0),
                "round {round}: router {i} started and stays up"
            );
        }
        for i in 0..10 {
            let r = request(
                public,
                &post_json(
                    "/a/v1/chat/completions",
                    &chat_body(&format!("r{i}"), false),
                    "",
                ),
            );
            assert_eq!(r.status, 200, "round {round}, request {i}");
        }
        for pr in &mut procs {
            assert!(
                pr.child.try_wait().unwrap().is_none(),
                "round {round}: both still up"
            );
        }
    }
}

/// A joined router that serves other routes than the lease holder is named in the holder's
/// log: the holder's health checks and adaptive limits cover its own routes only. A router
/// joined with the same routes is not (the warning counts one other route set, not two).
#[test]
fn a_joined_router_with_other_routes_is_warned_about() {
    let d = temp_dir("join-routes");
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let (a, log) = start_serve_logging(&d.0, "", &["--workers", "1"]);
    // A second server file: the same ports and segment, another routes directory.
    std::fs::create_dir_all(d.0.join("routes-c")).unwrap();
    std::fs::write(d.0.join("routes-c/a.toml"), route_for(&[m.addr()], "")).unwrap();
    std::fs::write(d.0.join("routes-c/b.toml"), route_for(&[m.addr()], "")).unwrap();
    let main_cfg = std::fs::read_to_string(d.0.join("warmroute.toml")).unwrap();
    let other_cfg = d.0.join("other.toml");
    std::fs::write(
        &other_cfg,
        main_cfg.replace("routes_dir = \"routes\"", "routes_dir = \"routes-c\""),
    )
    .unwrap();
    let join = |cfg: &Path| {
        let admin = format!("127.0.0.1:{}", free_port());
        let child = spawn_serve(cfg, &["--workers", "1", "--join", "--admin-listen", &admin]);
        let mut p = Proc {
            child,
            public: a.public,
            admin: admin.parse().unwrap(),
            shm: a.shm.clone(),
        };
        assert!(wait_ready_or_exit(&mut p, &d.0));
        p
    };
    let _same = join(&d.0.join("warmroute.toml"));
    let _other = join(&other_cfg);
    // Said once the difference has lasted 20 s.
    eventually(
        Duration::from_secs(40),
        "the warning in the holder's log",
        || log().contains("served other routes or peers than this one"),
    );
    let text = log();
    let line = text
        .lines()
        .find(|l| l.contains("served other routes or peers than this one"))
        .unwrap();
    assert!(line.contains("other_route_sets=1"), "{line}");
}

/// A join refuses an admin port that a process outside its segment serves (here a plain
/// listener), as it does the public port: the two would split the admin answers for good.
#[test]
fn a_join_refuses_an_admin_port_served_by_a_stranger() {
    let d = temp_dir("join-stranger");
    let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = stranger.local_addr().unwrap();
    let shm = d.0.join("segment");
    let public = format!("127.0.0.1:{}", free_port());
    let out = Command::new(BIN)
        .args(["serve", "--no-pin", "--join", "--listen", &public])
        .args(["--admin-listen", &taken.to_string()])
        .arg("--shm")
        .arg(&shm)
        .current_dir(&d.0)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "--join: {taken} is served by a process that does not use"
        )),
        "{err}"
    );
    assert!(!shm.exists(), "the refused join left its segment");
    // With a router on the segment, the stranger's port is still refused: the router
    // says which ports it serves, and this is not one of them.
    let m = mock("m0");
    std::fs::write(d.0.join("routes/a.toml"), route_for(&[m.addr()], "")).unwrap();
    let a = start_serve(&d.0);
    let cfg = d.0.join("warmroute.toml");
    let join_with_admin = |admin: &str| {
        Command::new(BIN)
            .args(["serve", "--no-pin", "--join", "--workers", "1", "--config"])
            .arg(&cfg)
            .args(["--admin-listen", admin])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut refused = join_with_admin(&taken.to_string());
    let t0 = Instant::now();
    while refused.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = refused.kill();
    let out = refused.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the join on a stranger's port started: {err}"
    );
    assert!(
        err.contains(&format!("--join: {taken} is served by a process")),
        "{err}"
    );
    // The control: the router's own admin port is shared.
    let mut b = Proc {
        child: join_with_admin(&a.admin.to_string()),
        public: a.public,
        admin: a.admin,
        shm: a.shm.clone(),
    };
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        b.child.try_wait().unwrap().is_none(),
        "the join on the router's admin port runs"
    );
    drop(stranger);
}
