//! Writing heads: hop-by-hop filtering and reason phrases.

/// Headers that describe one connection and must not be forwarded (RFC 9110 §7.6.1),
/// plus the framing headers the proxy sets itself.
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    ];
    HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// Append `name: value\r\n`.
pub fn write_header(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Reason phrase for the statuses the router itself produces.
pub fn status_reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_is_case_insensitive() {
        assert!(is_hop_by_hop("Connection"));
        assert!(is_hop_by_hop("keep-alive"));
        assert!(!is_hop_by_hop("Content-Type"));
        assert!(!is_hop_by_hop("Transfer-Encoding"));
    }

    #[test]
    fn header_line() {
        let mut v = Vec::new();
        write_header(&mut v, "X-A", b"1");
        assert_eq!(v, b"X-A: 1\r\n");
        assert_eq!(status_reason(431), "Request Header Fields Too Large");
    }
}
