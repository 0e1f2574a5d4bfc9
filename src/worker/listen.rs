//! Listening sockets: one SO_REUSEPORT socket per worker and port, created on the main
//! thread so that port 0 resolves once and every worker shares the same port.
//!
//! Before binding, a plain bind (no SO_REUSEPORT) probes the port: if any other socket
//! holds it — a stale or live warmroute included — startup refuses, unless `--takeover`
//! asks to share the port with the process being replaced.

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
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "{addr} is already served by another process (a running warmroute?); \
                         stop it, or start with --takeover to replace it without downtime"
                    ),
                ))
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
}
