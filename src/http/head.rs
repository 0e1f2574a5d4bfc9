//! Request and response heads: parsing and body-framing decisions.

use crate::limits::{
    REQUEST_HEADERS_MAX, REQUEST_HEAD_BYTES_MAX, RESPONSE_HEADERS_MAX, RESPONSE_HEAD_BYTES_MAX,
};

/// Outcome of trying to parse a head from the bytes received so far.
#[derive(Debug)]
pub enum HeadParse<T> {
    /// A whole head: the value and how many bytes it used.
    Complete(T, usize),
    /// More bytes are needed.
    Partial,
}

/// Why a head was refused. `status()` maps each to the answer a client gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadError {
    /// Head longer than the limit (431 for requests).
    TooLarge,
    /// More headers than the limit (431 for requests).
    TooManyHeaders,
    /// Not HTTP/1.x.
    Malformed(&'static str),
    /// Contradictory or invalid body framing (400).
    BadFraming(&'static str),
    /// A transfer coding other than chunked (501).
    UnsupportedCoding,
}

impl HeadError {
    pub fn status(self) -> u16 {
        match self {
            HeadError::TooLarge | HeadError::TooManyHeaders => 431,
            HeadError::Malformed(_) | HeadError::BadFraming(_) => 400,
            HeadError::UnsupportedCoding => 501,
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            HeadError::TooLarge => "request head exceeds 64 KiB",
            HeadError::TooManyHeaders => "more than 100 request headers",
            HeadError::Malformed(m) | HeadError::BadFraming(m) => m,
            HeadError::UnsupportedCoding => "only the chunked transfer coding is supported",
        }
    }
}

/// Header positions inside an owned copy of the head bytes: no per-header allocation.
#[derive(Debug, Clone, Default)]
pub struct Headers {
    raw: Vec<u8>,
    spans: Vec<[u32; 4]>,
    /// Which of the [`LOOKED_UP`] names occur: a lookup of an absent one returns at once
    /// instead of comparing every name (most requests carry none of them).
    present: u16,
}

/// Header names the per-request paths look up and that requests usually do not carry.
const LOOKED_UP: [&str; 10] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "expect",
    "x-forwarded-for",
    "authorization",
    "x-api-key",
    "x-litellm-session-id",
    "x-claude-code-session-id",
    "x-session-id",
];

/// The [`LOOKED_UP`] bit of a name (case-insensitive), 0 for other names. The listed
/// names all differ in length, so one comparison at most.
fn looked_up_bit(name: &[u8]) -> u16 {
    let i = match name.len() {
        14 => 0,
        17 => 1,
        10 => 2,
        6 => 3,
        15 => 4,
        13 => 5,
        9 => 6,
        20 => 7,
        24 => 8,
        12 => 9,
        _ => return 0,
    };
    if super::write::name_is(name, LOOKED_UP[i].as_bytes()) {
        1 << i
    } else {
        0
    }
}

impl Headers {
    fn from_parsed(raw: &[u8], list: &[httparse::Header<'_>]) -> Headers {
        let base = raw.as_ptr() as usize;
        let mut present = 0;
        let spans = list
            .iter()
            .map(|h| {
                present |= looked_up_bit(h.name.as_bytes());
                // httparse hands out sub-slices of `raw`, so the offsets are in range.
                let n = h.name.as_ptr() as usize - base;
                let v = h.value.as_ptr() as usize - base;
                [
                    n as u32,
                    h.name.len() as u32,
                    v as u32,
                    h.value.len() as u32,
                ]
            })
            .collect();
        Headers {
            raw: raw.to_vec(),
            spans,
            present,
        }
    }

    /// False only when `name` is one of [`LOOKED_UP`] and absent.
    fn may_have(&self, name: &str) -> bool {
        let bit = looked_up_bit(name.as_bytes());
        bit == 0 || self.present & bit != 0
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// All headers in wire order, names as sent.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> + '_ {
        self.spans.iter().map(move |s| {
            let name = &self.raw[s[0] as usize..(s[0] + s[1]) as usize];
            let value = &self.raw[s[2] as usize..(s[2] + s[3]) as usize];
            // httparse only accepts token characters in names, which are ASCII.
            (std::str::from_utf8(name).unwrap_or(""), value)
        })
    }

    /// Names and values as bytes, in wire order: for the per-request paths, which compare
    /// and copy bytes and need no UTF-8 check of the names.
    pub fn iter_raw(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        Headers::raw_pairs(&self.raw, &self.spans)
    }

    fn raw_pairs<'a>(
        raw: &'a [u8],
        spans: &'a [[u32; 4]],
    ) -> impl Iterator<Item = (&'a [u8], &'a [u8])> + 'a {
        spans.iter().map(move |s| {
            (
                &raw[s[0] as usize..(s[0] + s[1]) as usize],
                &raw[s[2] as usize..(s[2] + s[3]) as usize],
            )
        })
    }

    /// First value of a header, case-insensitive.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        if !self.may_have(name) {
            return None;
        }
        self.iter_raw()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// Every value of a header, case-insensitive.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let spans = if self.may_have(name) {
            &self.spans[..]
        } else {
            &[]
        };
        Headers::raw_pairs(&self.raw, spans)
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// Whether `name` is listed in a `Connection` header as a hop-by-hop header
    /// (RFC 9110 §7.6.1). `close` and `keep-alive` are options, never header names here.
    pub fn connection_lists(&self, name: &[u8]) -> bool {
        self.has_token("connection", name)
    }

    /// Whether the `Connection` header names anything besides `close`/`keep-alive`, i.e.
    /// whether `connection_lists` can ever be true (so callers can skip per-header checks).
    pub fn connection_names_headers(&self) -> bool {
        self.get_all("connection").any(|v| {
            v.split(|&b| b == b',').any(|t| {
                let t = trim(t);
                !t.is_empty()
                    && !t.eq_ignore_ascii_case(b"close")
                    && !t.eq_ignore_ascii_case(b"keep-alive")
            })
        })
    }

    /// Whether any comma-separated token of any `name` header equals `token` (case-insensitive).
    pub fn has_token(&self, name: &str, token: &[u8]) -> bool {
        self.get_all(name).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| trim(t).eq_ignore_ascii_case(token))
        })
    }

    fn raw_str(&self, start: u32, len: u32) -> &str {
        std::str::from_utf8(self.raw_bytes(start, len)).unwrap_or("")
    }

    fn raw_bytes(&self, start: u32, len: u32) -> &[u8] {
        &self.raw[start as usize..(start + len) as usize]
    }
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// How a request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// A parsed request head.
#[derive(Debug, Clone)]
pub struct RequestHead {
    pub headers: Headers,
    method: [u32; 2],
    target: [u32; 2],
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    pub body: BodyFraming,
    /// The client allows the connection to be reused after this request.
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub expect_continue: bool,
}

impl RequestHead {
    pub fn method(&self) -> &str {
        self.headers.raw_str(self.method[0], self.method[1])
    }
    /// The method as bytes, for the per-request paths (no UTF-8 check; a token).
    pub fn method_bytes(&self) -> &[u8] {
        self.headers.raw_bytes(self.method[0], self.method[1])
    }
    /// Path and query as sent (origin form), e.g. `/route/v1/chat?x=1`.
    pub fn target(&self) -> &str {
        self.headers.raw_str(self.target[0], self.target[1])
    }
    pub fn path(&self) -> &str {
        let t = self.target();
        crate::bytescan::split_once_ascii(t, b'?').map_or(t, |(p, _)| p)
    }
    pub fn query(&self) -> Option<&str> {
        crate::bytescan::split_once_ascii(self.target(), b'?').map(|(_, q)| q)
    }
}

fn offset_in(raw: &[u8], s: &str) -> [u32; 2] {
    [
        (s.as_ptr() as usize - raw.as_ptr() as usize) as u32,
        s.len() as u32,
    ]
}

/// Parse `Content-Length` values: all must be plain digits and agree.
fn content_length(headers: &Headers) -> Result<Option<u64>, HeadError> {
    let mut found: Option<u64> = None;
    for v in headers.get_all("content-length") {
        for part in v.split(|&b| b == b',') {
            let part = trim(part);
            if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
                return Err(HeadError::BadFraming("invalid Content-Length"));
            }
            // At most 19 digits: below u64::MAX, so no overflow.
            let n = part.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
            match found {
                Some(prev) if prev != n => {
                    return Err(HeadError::BadFraming("conflicting Content-Length headers"))
                }
                _ => found = Some(n),
            }
        }
    }
    Ok(found)
}

/// Whether `Transfer-Encoding` is present, and if so whether chunked is its final coding.
fn transfer_encoding(headers: &Headers) -> Option<bool> {
    let mut last: Option<&[u8]> = None;
    let mut present = false;
    for v in headers.get_all("transfer-encoding") {
        present = true;
        for t in v.split(|&b| b == b',') {
            let t = trim(t);
            if !t.is_empty() {
                last = Some(t);
            }
        }
    }
    present.then(|| last.is_some_and(|t| t.eq_ignore_ascii_case(b"chunked")))
}

/// Parse a request head from the start of `buf`.
pub fn parse_request(buf: &[u8]) -> Result<HeadParse<RequestHead>, HeadError> {
    let mut storage = [httparse::EMPTY_HEADER; REQUEST_HEADERS_MAX];
    let mut req = httparse::Request::new(&mut storage);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooManyHeaders),
        Err(httparse::Error::Version) => {
            return Err(HeadError::Malformed("unsupported HTTP version"))
        }
        Err(_) => return Err(HeadError::Malformed("malformed request head")),
    };
    let len = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => {
            return if buf.len() >= REQUEST_HEAD_BYTES_MAX {
                Err(HeadError::TooLarge)
            } else {
                Ok(HeadParse::Partial)
            };
        }
    };
    if len > REQUEST_HEAD_BYTES_MAX {
        return Err(HeadError::TooLarge);
    }
    let raw = &buf[..len];
    let (Some(method), Some(path), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(HeadError::Malformed("malformed request line"));
    };
    if !path.starts_with('/') {
        return Err(HeadError::Malformed(
            "request target must be an absolute path",
        ));
    }
    let method_span = offset_in(raw, method);
    let target_span = offset_in(raw, path);
    let headers = Headers::from_parsed(raw, req.headers);
    let cl = content_length(&headers)?;
    let te = transfer_encoding(&headers);
    let body = match (te, cl) {
        (Some(_), Some(_)) => {
            return Err(HeadError::BadFraming(
                "Content-Length and Transfer-Encoding together",
            ))
        }
        (Some(_), None) if minor == 0 => {
            return Err(HeadError::BadFraming(
                "Transfer-Encoding in an HTTP/1.0 request",
            ))
        }
        (Some(true), None) => BodyFraming::Chunked,
        (Some(false), None) => return Err(HeadError::UnsupportedCoding),
        (None, Some(0)) | (None, None) => BodyFraming::None,
        (None, Some(n)) => BodyFraming::Length(n),
    };
    let keep_alive = if minor == 0 {
        headers.has_token("connection", b"keep-alive")
    } else {
        !headers.has_token("connection", b"close")
    };
    let expect_continue = minor >= 1
        && headers
            .get("expect")
            .is_some_and(|v| trim(v).eq_ignore_ascii_case(b"100-continue"));
    Ok(HeadParse::Complete(
        RequestHead {
            headers,
            method: method_span,
            target: target_span,
            minor_version: minor,
            body,
            keep_alive,
            expect_continue,
        },
        len,
    ))
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFraming {
    /// No body (HEAD, 1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
    /// Read until the peer closes.
    UntilClose,
}

/// A parsed response head.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub headers: Headers,
    pub status: u16,
    pub minor_version: u8,
    reason: [u32; 2],
    pub framing: ResponseFraming,
    /// The connection may carry another request after this response.
    pub reusable: bool,
}

impl ResponseHead {
    pub fn reason(&self) -> &str {
        self.headers.raw_str(self.reason[0], self.reason[1])
    }
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status)
    }
}

/// Parse a response head; `head_request` says the request was HEAD (no body follows).
pub fn parse_response(
    buf: &[u8],
    head_request: bool,
) -> Result<HeadParse<ResponseHead>, HeadError> {
    let mut storage = [httparse::EMPTY_HEADER; RESPONSE_HEADERS_MAX];
    let mut res = httparse::Response::new(&mut storage);
    let status = match res.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooManyHeaders),
        Err(_) => return Err(HeadError::Malformed("malformed response head")),
    };
    let len = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => {
            return if buf.len() >= RESPONSE_HEAD_BYTES_MAX {
                Err(HeadError::TooLarge)
            } else {
                Ok(HeadParse::Partial)
            };
        }
    };
    let raw = &buf[..len];
    let (Some(code), Some(minor)) = (res.code, res.version) else {
        return Err(HeadError::Malformed("malformed status line"));
    };
    if !(100..=999).contains(&code) {
        return Err(HeadError::Malformed("invalid status code"));
    }
    let reason = offset_in(raw, res.reason.unwrap_or(""));
    let reason = if res.reason.is_some() { reason } else { [0, 0] };
    let headers = Headers::from_parsed(raw, res.headers);
    let te = transfer_encoding(&headers);
    let cl = content_length(&headers);
    let mut reusable = if minor == 0 {
        headers.has_token("connection", b"keep-alive")
    } else {
        !headers.has_token("connection", b"close")
    };
    let framing = if head_request || (100..200).contains(&code) || code == 204 || code == 304 {
        ResponseFraming::None
    } else {
        match te {
            Some(true) => {
                // Both headers from a peer: chunked wins (RFC 9112 §6.3), but the
                // connection cannot be trusted for another request.
                if !matches!(cl, Ok(None)) {
                    reusable = false;
                }
                ResponseFraming::Chunked
            }
            Some(false) => {
                reusable = false;
                ResponseFraming::UntilClose
            }
            None => match cl {
                Ok(Some(n)) => ResponseFraming::Length(n),
                Ok(None) => {
                    reusable = false;
                    ResponseFraming::UntilClose
                }
                Err(e) => return Err(e),
            },
        }
    };
    Ok(HeadParse::Complete(
        ResponseHead {
            headers,
            status: code,
            minor_version: minor,
            reason,
            framing,
            reusable,
        },
        len,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_of_listed_names_skip_absent_ones_and_find_present_ones() {
        let h = req("GET / HTTP/1.1\r\nX-SESSION-ID: a\r\nX-Forwarded-For: 1.2.3.4\r\nx-forwarded-for: 5.6.7.8\r\nX-Other: o\r\n\r\n")
            .unwrap()
            .headers;
        // Listed and present, in any case.
        assert_eq!(h.get("x-session-id"), Some(&b"a"[..]));
        let xff: Vec<&[u8]> = h.get_all("x-forwarded-for").collect();
        assert_eq!(xff, [&b"1.2.3.4"[..], b"5.6.7.8"]);
        // Listed and absent.
        assert_eq!(h.get("authorization"), None);
        assert_eq!(h.get_all("x-litellm-session-id").count(), 0);
        // Not listed: looked up by comparing names.
        assert_eq!(h.get("x-other"), Some(&b"o"[..]));
        assert_eq!(h.get("x-missing"), None);
        // Every listed name maps to its own bit, whatever its case; others to none.
        for (i, n) in LOOKED_UP.iter().enumerate() {
            assert_eq!(looked_up_bit(n.to_ascii_uppercase().as_bytes()), 1 << i);
            assert!(LOOKED_UP[..i].iter().all(|m| m.len() != n.len()));
        }
        assert_eq!(looked_up_bit(b"x-sessionid"), 0);
        assert_eq!(looked_up_bit(&[b'a'; 40]), 0);
    }

    fn req(s: &str) -> Result<RequestHead, HeadError> {
        match parse_request(s.as_bytes())? {
            HeadParse::Complete(h, n) => {
                assert_eq!(n, s.find("\r\n\r\n").unwrap() + 4);
                Ok(h)
            }
            HeadParse::Partial => panic!("partial"),
        }
    }

    #[test]
    fn parses_a_post() {
        let h = req("POST /r/v1/chat?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\nX-Session-Id: s\r\n\r\n")
            .unwrap();
        assert_eq!(h.method(), "POST");
        assert_eq!(h.method_bytes(), b"POST");
        assert_eq!(h.target(), "/r/v1/chat?x=1");
        assert_eq!(h.path(), "/r/v1/chat");
        assert_eq!(h.query(), Some("x=1"));
        assert_eq!(h.body, BodyFraming::Length(12));
        assert!(h.keep_alive);
        assert_eq!(h.headers.get("x-session-id"), Some(&b"s"[..]));
        assert_eq!(h.headers.len(), 3);
    }

    #[test]
    fn partial_until_complete_and_limits() {
        assert!(matches!(
            parse_request(b"GET / HTTP/1.1\r\nHost"),
            Ok(HeadParse::Partial)
        ));
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', REQUEST_HEAD_BYTES_MAX));
        assert_eq!(parse_request(&big).unwrap_err(), HeadError::TooLarge);
        assert_eq!(HeadError::TooLarge.status(), 431);
        let mut many = String::from("GET / HTTP/1.1\r\n");
        for i in 0..=REQUEST_HEADERS_MAX {
            many.push_str(&format!("H{i}: v\r\n"));
        }
        many.push_str("\r\n");
        assert_eq!(
            parse_request(many.as_bytes()).unwrap_err(),
            HeadError::TooManyHeaders
        );
        let mut exactly = String::from("GET / HTTP/1.1\r\n");
        for i in 0..REQUEST_HEADERS_MAX {
            exactly.push_str(&format!("H{i}: v\r\n"));
        }
        exactly.push_str("\r\n");
        assert!(req(&exactly).is_ok());
    }

    #[test]
    fn framing_rules() {
        assert_eq!(
            req("POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap_err(),
            HeadError::BadFraming("Content-Length and Transfer-Encoding together")
        );
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
        assert_eq!(
            req("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n")
                .unwrap()
                .body,
            BodyFraming::Length(5)
        );
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
        assert_eq!(
            req("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
                .unwrap()
                .body,
            BodyFraming::Chunked
        );
        assert_eq!(
            req("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n").unwrap_err(),
            HeadError::UnsupportedCoding
        );
        assert!(matches!(
            req("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
    }

    #[test]
    fn keep_alive_and_expect() {
        assert!(
            !req("GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(!req("GET / HTTP/1.0\r\n\r\n").unwrap().keep_alive);
        assert!(
            req("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(
            req("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n")
                .unwrap()
                .expect_continue
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "GARBAGE\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET http://x/ HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        ] {
            assert!(req(bad).is_err(), "{bad:?}");
        }
    }

    fn res(s: &str, head: bool) -> ResponseHead {
        match parse_response(s.as_bytes(), head).unwrap() {
            HeadParse::Complete(h, _) => h,
            HeadParse::Partial => panic!("partial"),
        }
    }

    #[test]
    fn response_framing() {
        let h = res("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", false);
        assert_eq!(
            (h.status, h.framing, h.reusable, h.reason()),
            (200, ResponseFraming::Length(5), true, "OK")
        );
        assert_eq!(
            res("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true).framing,
            ResponseFraming::None
        );
        assert_eq!(
            res("HTTP/1.1 204 No Content\r\n\r\n", false).framing,
            ResponseFraming::None
        );
        assert_eq!(
            res(
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false
            )
            .framing,
            ResponseFraming::None
        );
        let h = res("HTTP/1.1 100 Continue\r\n\r\n", false);
        assert!(h.is_interim());
        let h = res(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
        );
        assert_eq!((h.framing, h.reusable), (ResponseFraming::Chunked, true));
        let h = res(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            false,
        );
        assert_eq!((h.framing, h.reusable), (ResponseFraming::Chunked, false));
        let h = res("HTTP/1.1 200 OK\r\n\r\n", false);
        assert_eq!(
            (h.framing, h.reusable),
            (ResponseFraming::UntilClose, false)
        );
        let h = res("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false);
        assert!(!h.reusable);
        let h = res(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n",
            false,
        );
        assert!(!h.reusable);
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", false).is_err());
    }
}
