//! Writing heads: hop-by-hop filtering and reason phrases.

/// Headers that describe one connection and must not be forwarded (RFC 9110 §7.6.1),
/// plus the framing headers the proxy sets itself.
/// Names are compared as bytes: this runs for every header of every request and response.
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    let is = |h: &[u8]| name_is(name, h);
    // Dispatch on the length first: most names match no candidate's length.
    match name.len() {
        2 => is(b"te"),
        7 => is(b"trailer") || is(b"upgrade"),
        10 => is(b"connection") || is(b"keep-alive"),
        16 => is(b"proxy-connection"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    }
}

/// Whether a header name (token characters, as httparse admits them) equals `lower`, a
/// lowercase name of letters, digits and `-`, ignoring case. Setting bit 0x20 lowercases a
/// letter and leaves digits and `-` alone; the only other byte it maps onto one of those
/// is CR (onto `-`), which is not a token character. Cheaper than `eq_ignore_ascii_case`,
/// and it compares eight bytes at a time.
pub fn name_is(name: &[u8], lower: &[u8]) -> bool {
    if name.len() != lower.len() {
        return false;
    }
    let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8-byte chunk"));
    let (mut a, mut b) = (name.chunks_exact(8), lower.chunks_exact(8));
    for (x, y) in (&mut a).zip(&mut b) {
        if word(x) | 0x2020_2020_2020_2020 != word(y) {
            return false;
        }
    }
    a.remainder()
        .iter()
        .zip(b.remainder())
        .all(|(&x, &y)| x | 0x20 == y)
}

/// Append `name: value\r\n`.
pub fn write_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.reserve(name.len() + value.len() + 4);
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Append `n` in decimal, without going through `fmt` (heads are written per request).
pub fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// `Content-Length` or `Transfer-Encoding`: the headers that delimit a body.
pub fn is_framing(name: &[u8]) -> bool {
    name_is(name, b"content-length") || name_is(name, b"transfer-encoding")
}

/// `HTTP/1.1 <status> <reason>\r\n` for a relayed head: the peer's reason, or the
/// registry's when the peer sent none.
pub fn push_status_line(out: &mut Vec<u8>, status: u16, reason: &str) {
    out.extend_from_slice(b"HTTP/1.1 ");
    push_decimal(out, u64::from(status));
    out.push(b' ');
    out.extend_from_slice(
        if reason.is_empty() {
            status_reason(status)
        } else {
            reason
        }
        .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
}

/// Reason phrase of `status`: the IANA registry's for every registered code (a reject rule
/// may answer with any 4xx or 5xx, and a peer may send a bare status line), empty for an
/// unregistered one (RFC 9112 §4: the reason phrase is optional; the line is then
/// `HTTP/1.1 599 `).
pub fn status_reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        103 => "Early Hints",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        300 => "Multiple Choices",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Payload Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        423 => "Locked",
        424 => "Failed Dependency",
        425 => "Too Early",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        451 => "Unavailable For Legal Reasons",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        506 => "Variant Also Negotiates",
        507 => "Insufficient Storage",
        508 => "Loop Detected",
        511 => "Network Authentication Required",
        _ => "",
    }
}

/// `Date: <IMF-fixdate>\r\n` for now (RFC 9110 §6.6.1: a server with a clock sends it
/// on its own answers). Formatted once a second per thread.
pub fn push_date_header(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    thread_local! {
        static CACHE: RefCell<(u64, [u8; 37])> = const { RefCell::new((u64::MAX, [0; 37])) };
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let line = CACHE
        .try_with(|c| {
            let mut c = c.borrow_mut();
            if c.0 != secs {
                *c = (secs, date_line(secs));
            }
            c.1
        })
        .unwrap_or_else(|_| date_line(secs));
    out.extend_from_slice(&line);
}

/// `Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n` for `secs` since the epoch.
fn date_line(secs: u64) -> [u8; 37] {
    const DAYS: [&[u8; 3]; 7] = [b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed"];
    const MONTHS: [&[u8; 3]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    let days = secs / 86_400;
    let (year, month, day, hour, minute, second, _) =
        crate::bodylog::assemble::utc_fields(secs.saturating_mul(1000));
    let (year, month, day) = (year as u64, month as usize, u64::from(day));
    let (hour, minute, second) = (u64::from(hour), u64::from(minute), u64::from(second));
    let mut l = [0u8; 37];
    l[..6].copy_from_slice(b"Date: ");
    l[6..9].copy_from_slice(DAYS[(days % 7) as usize]);
    l[9..11].copy_from_slice(b", ");
    let two = |n: u64| [b'0' + (n / 10 % 10) as u8, b'0' + (n % 10) as u8];
    l[11..13].copy_from_slice(&two(day));
    l[13] = b' ';
    l[14..17].copy_from_slice(MONTHS[month - 1]);
    l[17] = b' ';
    l[18..20].copy_from_slice(&two(year / 100));
    l[20..22].copy_from_slice(&two(year % 100));
    l[22] = b' ';
    l[23..25].copy_from_slice(&two(hour));
    l[25] = b':';
    l[26..28].copy_from_slice(&two(minute));
    l[28] = b':';
    l[29..31].copy_from_slice(&two(second));
    l[31..37].copy_from_slice(b" GMT\r\n");
    l
}

#[cfg(test)]
mod tests {
    #[test]
    fn date_lines_are_imf_fixdate() {
        let s = |secs| String::from_utf8(super::date_line(secs).to_vec()).unwrap();
        assert_eq!(s(784_111_777), "Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n");
        assert_eq!(s(0), "Date: Thu, 01 Jan 1970 00:00:00 GMT\r\n");
        assert_eq!(s(951_782_400), "Date: Tue, 29 Feb 2000 00:00:00 GMT\r\n");
        assert_eq!(s(1_796_471_704), "Date: Sat, 05 Dec 2026 11:55:04 GMT\r\n");
        let mut out = Vec::new();
        super::push_date_header(&mut out);
        assert!(out.starts_with(b"Date: ") && out.ends_with(b" GMT\r\n") && out.len() == 37);
    }

    use super::*;

    #[test]
    fn hop_by_hop_is_case_insensitive() {
        for h in [
            "Connection",
            "keep-alive",
            "Proxy-Connection",
            "TE",
            "Trailer",
            "Upgrade",
            "Proxy-Authenticate",
            "proxy-authorization",
        ] {
            assert!(is_hop_by_hop(h.as_bytes()), "{h}");
        }
        for h in [
            "Content-Type",
            "Transfer-Encoding",
            "tf",
            "Upgrades",
            "x",
            "",
        ] {
            assert!(!is_hop_by_hop(h.as_bytes()), "{h}");
        }
    }

    #[test]
    fn header_line() {
        let mut v = Vec::new();
        write_header(&mut v, b"X-A", b"1");
        assert_eq!(v, b"X-A: 1\r\n");
        assert_eq!(status_reason(431), "Request Header Fields Too Large");
        // A reject rule's own status has its phrase; an unregistered code has none.
        assert_eq!(status_reason(422), "Unprocessable Content");
        assert_eq!(status_reason(451), "Unavailable For Legal Reasons");
        assert_eq!(status_reason(599), "");
    }

    #[test]
    fn names_compare_ignoring_case() {
        assert!(name_is(b"Content-Length", b"content-length"));
        assert!(name_is(b"X-SESSION-ID", b"x-session-id"));
        assert!(name_is(b"x-1", b"x-1"));
        assert!(!name_is(b"Content-Lengt", b"content-length"));
        assert!(!name_is(b"Content_Length", b"content-length"));
        assert!(!name_is(b"Content-Lengtx", b"content-length"));
        // Every token character against every lowercase candidate byte: the same answer
        // as eq_ignore_ascii_case.
        let token = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
        for c in (0u8..=255).filter(|&c| token(c)) {
            for l in b"abcdefghijklmnopqrstuvwxyz0123456789-".iter() {
                assert_eq!(name_is(&[c], &[*l]), c.eq_ignore_ascii_case(l), "{c} {l}");
            }
        }
        // The same at every place of a name long enough for whole words and a remainder.
        let lower = b"x-claude-code-session-id";
        for at in 0..lower.len() {
            for c in (0u8..=255).filter(|&c| token(c)) {
                let mut name = lower.to_ascii_uppercase();
                name[at] = c;
                let want = name.eq_ignore_ascii_case(lower);
                assert_eq!(name_is(&name, lower), want, "{at} {c}");
                assert_eq!(name_is(&name[..at + 1], &lower[..at + 1]), want, "{at} {c}");
            }
        }
    }

    #[test]
    fn decimals_match_fmt() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            12345,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            let mut v = b"x".to_vec();
            push_decimal(&mut v, n);
            assert_eq!(v, format!("x{n}").into_bytes());
        }
    }
}
