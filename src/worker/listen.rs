//! Listening sockets: one SO_REUSEPORT socket per worker and port, created on the main
//! thread so that port 0 resolves once and every worker shares the same port.
//!
//! Before binding, a plain bind (no SO_REUSEPORT) probes the port: if any other socket
//! holds it — a stale or live warmroute included — for more than a second, startup
//! refuses, unless `--takeover` asks to share the port with the process being replaced, or
//! `--join` to serve alongside it.

use std::io;
use std::net::{SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};

/// Accept backlog per socket.
const BACKLOG: i32 = 4096;

fn reuseport_socket(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    sock.set_nodelay(true)?;
    sock.bind(&addr.into())?;
    sock.listen(BACKLOG)?;
    sock.set_nonblocking(true)?;
    Ok(sock.into())
}

/// Bind `count` listeners sharing one address. Returns them and the bound address.
pub fn bind_shared(
    addr: SocketAddr,
    count: usize,
    takeover: bool,
) -> io::Result<(Vec<TcpListener>, SocketAddr)> {
    if !takeover && addr.port() != 0 {
        // A plain bind fails with EADDRINUSE when anything already listens here, including
        // another warmroute whose SO_REUSEPORT sockets would otherwise silently share it.
        match TcpListener::bind(addr) {
            Ok(probe) => drop(probe),
            // A router that has just exited can hold its listeners a moment longer (the
            // kernel closes an io_uring's sockets after the process is gone): a restart
            // right after a stop looks again for a while before it refuses.
            Err(e)
                if e.kind() == io::ErrorKind::AddrInUse && freed_within(addr, PORT_FREE_WAIT) => {}
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, in_use(addr)))
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("cannot bind {addr}: {e}"))),
        }
    }
    let first = reuseport_socket(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot bind {addr}: {e}")))?;
    let bound = first.local_addr()?;
    let mut all = vec![first];
    for _ in 1..count {
        all.push(reuseport_socket(bound)?);
    }
    Ok((all, bound))
}

/// How long a start waits for a port held by someone else to be let go before refusing.
pub const PORT_FREE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether a plain bind of `addr` succeeds within `wait` (looking every 50 ms).
pub fn freed_within(addr: SocketAddr, wait: std::time::Duration) -> bool {
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(50));
        if TcpListener::bind(addr).is_ok() {
            return true;
        }
    }
    false
}

/// Whether a listener (of any process) already serves `addr`: a plain bind fails and a
/// socket listens on the port. For `--takeover`, which shares the port whoever holds it.
pub fn served(addr: SocketAddr) -> bool {
    addr.port() != 0
        && TcpListener::bind(addr).is_err_and(|e| e.kind() == io::ErrorKind::AddrInUse)
        && listening_on(addr.port()).unwrap_or(true)
}

/// Why `addr` cannot be bound, as far as can be told: something listens there (another
/// router: `--takeover` is the way), or only a connection holds the port, typically an
/// outgoing one from the kernel's ephemeral range waiting out its TIME-WAIT, which no
/// `--takeover` changes.
fn in_use(addr: SocketAddr) -> String {
    let listening = listening_on(addr.port()).unwrap_or_else(|| {
        // No /proc/net: a connection tells, for the loopback address at least.
        let mut probe = addr;
        if probe.ip().is_unspecified() {
            probe.set_ip(match addr {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        std::net::TcpStream::connect_timeout(&probe, std::time::Duration::from_millis(500)).is_ok()
    });
    if listening {
        return format!(
            "{addr} is already served by another process (a running warmroute?); stop it, or \
             start with --takeover to replace it without downtime (or --join to serve alongside it)"
        );
    }
    let mut msg = format!(
        "{addr} is held by a connection, not by a listener (nothing answers there), \
         likely one waiting out its TIME-WAIT"
    );
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    if let Some((lo, hi)) = range.as_deref().and_then(parse_port_range) {
        if (lo..=hi).contains(&addr.port()) {
            msg.push_str(&format!(
                "; port {} is in the kernel's ephemeral range {lo}-{hi} \
                 (net.ipv4.ip_local_port_range), where outgoing connections take their ports: \
                 choose a port outside it",
                addr.port()
            ));
        }
    }
    msg.push_str("; or retry in a minute");
    msg
}

/// Whether a socket of this network namespace listens on `port`, on any address (which is
/// what makes a bind of the port fail), from `/proc/net/tcp` and `tcp6`; `None` when
/// neither can be read.
fn listening_on(port: u16) -> Option<bool> {
    let tables: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect();
    if tables.is_empty() {
        return None;
    }
    Some(tables.iter().any(|t| lists_listener(t, port)))
}

/// Whether a `/proc/net/tcp`-format table has a LISTEN (`0A`) row on `port`.
fn lists_listener(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|l| {
        let mut f = l.split_whitespace();
        let local = f.nth(1);
        let state = f.nth(1);
        let p = local
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
        state == Some("0A") && p == Some(port)
    })
}

/// `net.ipv4.ip_local_port_range` as read from /proc: two numbers.
fn parse_port_range(s: &str) -> Option<(u16, u16)> {
    let mut it = s.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) => Some((lo, hi)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_resolves_once_and_second_start_is_refused() {
        let (ls, bound) = bind_shared("127.0.0.1:0".parse().unwrap(), 3, false).unwrap();
        assert_eq!(ls.len(), 3);
        assert!(ls.iter().all(|l| l.local_addr().unwrap() == bound));
        let err = bind_shared(bound, 1, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("--takeover"));
        // The control: with --takeover the same port is shared.
        let (more, again) = bind_shared(bound, 1, true).unwrap();
        assert_eq!(again, bound);
        drop(more);
    }

    #[test]
    fn a_port_held_by_a_time_wait_connection_is_named_as_such() {
        // A connection closed first from this side waits out its TIME-WAIT on its local
        // port, which a listener then cannot take (the client socket had no SO_REUSEADDR).
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let port = client.local_addr().unwrap().port();
        let (accepted, _) = server.accept().unwrap();
        drop(client);
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(accepted);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let held: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let err = bind_shared(held, 1, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        let msg = err.to_string();
        assert!(
            msg.contains("held by a connection, not by a listener"),
            "{msg}"
        );
        assert!(!msg.contains("--takeover"), "{msg}");
        // Ports the kernel hands to outgoing connections come from its ephemeral range.
        assert!(msg.contains("ephemeral range"), "{msg}");
    }

    #[test]
    fn a_listener_on_one_address_is_named_for_a_bind_of_all_addresses() {
        // Another service on 127.0.0.2 only: a router asking for 0.0.0.0 cannot have the
        // port, and nothing answers on 127.0.0.1 (what a connection would have tried).
        let other = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = other.local_addr().unwrap().port();
        let all: SocketAddr = format!("0.0.0.0:{port}").parse().unwrap();
        let err = bind_shared(all, 1, false).unwrap_err();
        assert!(err.to_string().contains("already served"), "{err}");
    }

    #[test]
    fn proc_net_tcp_rows_are_read_for_listeners() {
        let table = "  sl  local_address rem_address   st tx_queue\n\
           0: 0200007F:B267 00000000:0000 0A 00000000:00000000\n\
           1: 0100007F:1F90 0100007F:9C40 06 00000000:00000000\n";
        assert!(lists_listener(table, 0xB267));
        // TIME-WAIT (06) on 8080 is not a listener; nor is a port absent from the table.
        assert!(!lists_listener(table, 8080));
        assert!(!lists_listener(table, 1));
    }

    #[test]
    fn the_ephemeral_range_is_read_as_two_ports() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("garbage"), None);
    }
}
