//! The `warmroute-mock` binary: flags, `listening on ADDR`, serving.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn binary_serves_and_reports_address() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_warmroute-mock"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--name",
            "bin-a",
            "--models",
            "m1,m2",
            "--ttft-base-ms",
            "0",
            "--decode-tps",
            "0",
            "--workers",
            "2",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    child.kill().unwrap();
    let _ = child.wait();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("x-mock-peer: bin-a"), "{out}");
    assert!(out.contains("\"m2\""), "{out}");
}

#[test]
fn binary_rejects_bad_flags_and_prints_help() {
    let out = Command::new(env!("CARGO_BIN_EXE_warmroute-mock"))
        .args(["--listen", "127.0.0.1:0", "--name", "a", "--bogus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument"));
    let out = Command::new(env!("CARGO_BIN_EXE_warmroute-mock"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--queue-when-busy"));
}
