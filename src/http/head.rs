//! Request and response heads: parsing and body-framing decisions.

use std::mem::MaybeUninit;

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
    /// A request line naming a version other than HTTP/1.x (505).
    UnsupportedVersion,
    /// A well-formed request line naming a later HTTP/1 minor version (`HTTP/1.2`), whose
    /// minor digit is at `at`. The head is to be read as HTTP/1.1, the highest 1.x the
    /// router implements (RFC 9110 §2.5, as nginx does): the reader rewrites that digit to
    /// `1` in its buffer and parses again. Answered 505 where it is not.
    LaterMinor { at: usize },
    /// A request line longer than the head limit (414).
    UriTooLong,
    /// `TRACE` (it would echo the client's credentials) or `CONNECT` (no tunnels) (405).
    MethodNotAllowed,
}

impl HeadError {
    pub fn status(self) -> u16 {
        match self {
            HeadError::TooLarge | HeadError::TooManyHeaders => 431,
            HeadError::Malformed(_) | HeadError::BadFraming(_) => 400,
            HeadError::UnsupportedCoding => 501,
            HeadError::UnsupportedVersion | HeadError::LaterMinor { .. } => 505,
            HeadError::UriTooLong => 414,
            HeadError::MethodNotAllowed => 405,
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            HeadError::TooLarge => "request head exceeds 64 KiB",
            HeadError::TooManyHeaders => "more than 100 request headers",
            HeadError::Malformed(m) | HeadError::BadFraming(m) => m,
            HeadError::UnsupportedCoding => "only the chunked transfer coding is supported",
            HeadError::UnsupportedVersion | HeadError::LaterMinor { .. } => {
                "only HTTP/1.x is served"
            }
            HeadError::UriTooLong => "request line exceeds 64 KiB",
            HeadError::MethodNotAllowed => "TRACE and CONNECT are not served",
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
    /// Which of them occur more than once.
    repeated: u16,
    /// Where each present one first occurs (an index into `spans`), so a lookup of a
    /// present name starts there instead of comparing the names before it.
    first: [u8; LOOKED_UP.len()],
    /// What the `Connection` headers say, read once: [`CONN_CLOSE`], [`CONN_KEEP_ALIVE`],
    /// [`CONN_NAMES`].
    connection: u8,
}

/// A `Connection` token `close`.
const CONN_CLOSE: u8 = 1;
/// A `Connection` token `keep-alive`.
const CONN_KEEP_ALIVE: u8 = 2;
/// A `Connection` token naming a header (anything but `close` and `keep-alive`).
const CONN_NAMES: u8 = 4;

/// Header names the per-request paths look up: the framing and forwarding headers, the
/// session-id headers, and the response's `Content-Type`. [`Known`] names each by place.
const LOOKED_UP: [&str; 13] = [
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
    "content-type",
    "x-phanrouter-session",
    "host",
];

/// One of the header names the per-request paths look up, by its place in the table
/// [`Headers`] indexes while parsing: a lookup by `Known` compares no names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known(u8);

impl Known {
    pub const CONTENT_LENGTH: Known = Known(0);
    pub const TRANSFER_ENCODING: Known = Known(1);
    pub const CONNECTION: Known = Known(2);
    pub const EXPECT: Known = Known(3);
    pub const X_FORWARDED_FOR: Known = Known(4);
    pub const AUTHORIZATION: Known = Known(5);
    pub const X_API_KEY: Known = Known(6);
    pub const X_LITELLM_SESSION_ID: Known = Known(7);
    pub const X_CLAUDE_CODE_SESSION_ID: Known = Known(8);
    pub const X_SESSION_ID: Known = Known(9);
    pub const CONTENT_TYPE: Known = Known(10);
    pub const X_PHANROUTER_SESSION: Known = Known(11);
    pub const HOST: Known = Known(12);

    /// The name, lowercase.
    pub fn name(self) -> &'static str {
        LOOKED_UP[usize::from(self.0)]
    }

    fn bit(self) -> u16 {
        1 << self.0
    }
}

/// The [`LOOKED_UP`] index of a name (case-insensitive), `None` for other names.
/// Dispatched on the length: at most two comparisons.
fn looked_up(name: &[u8]) -> Option<Known> {
    let is = |i: u8| super::write::name_is(name, LOOKED_UP[usize::from(i)].as_bytes());
    let (a, b) = match name.len() {
        14 => (0, None),
        17 => (1, None),
        10 => (2, None),
        6 => (3, None),
        15 => (4, None),
        13 => (5, None),
        9 => (6, None),
        20 => (7, Some(11)),
        24 => (8, None),
        12 => (9, Some(10)),
        4 => (12, None),
        _ => return None,
    };
    if is(a) {
        Some(Known(a))
    } else {
        b.filter(|&b| is(b)).map(Known)
    }
}

// `first` holds span indexes as bytes.
const _: () = assert!(REQUEST_HEADERS_MAX <= 256 && RESPONSE_HEADERS_MAX <= 256);

/// The buffers of heads this thread dropped, for the next heads it parses: a worker parses
/// two heads per request, and reusing their buffers spares four allocations. Per thread
/// (workers share nothing) and bounded in count and size.
type HeadStorage = (Vec<u8>, Vec<[u32; 4]>);

thread_local! {
    static SPARE_STORAGE: std::cell::RefCell<Vec<HeadStorage>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare head buffers kept per thread.
const SPARE_STORAGE_MAX: usize = 64;
/// A head buffer larger than this is freed rather than kept.
const SPARE_RAW_BYTES_MAX: usize = 8 * 1024;
/// Span lists with room for more headers than this are freed rather than kept (and not
/// handed out).
const SPARE_SPANS_MAX: usize = 32;

/// A spare head buffer for a head of `len` bytes, when the latest one kept is not more
/// than 4x too large for it (a small head must not keep a large head's buffer for as long
/// as it lives: a stream holds two heads); otherwise new buffers.
fn take_storage(len: usize) -> HeadStorage {
    let fits =
        |s: &HeadStorage| s.0.capacity() <= 4 * len.max(256) && s.1.capacity() <= SPARE_SPANS_MAX;
    SPARE_STORAGE
        .try_with(|s| {
            let mut s = s.try_borrow_mut().ok()?;
            s.last().is_some_and(fits).then(|| s.pop()).flatten()
        })
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Drop for Headers {
    fn drop(&mut self) {
        if self.raw.capacity() == 0
            || self.raw.capacity() > SPARE_RAW_BYTES_MAX
            || self.spans.capacity() > SPARE_SPANS_MAX
        {
            return;
        }
        let storage = (
            std::mem::take(&mut self.raw),
            std::mem::take(&mut self.spans),
        );
        // During thread exit the list may be gone: then the buffers are simply freed.
        let _ = SPARE_STORAGE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                if s.len() < SPARE_STORAGE_MAX {
                    s.push(storage);
                }
            }
        });
    }
}

impl Headers {
    fn from_parsed(raw: &[u8], list: &[httparse::Header<'_>]) -> Headers {
        let base = raw.as_ptr() as usize;
        let mut present = 0u16;
        let mut repeated = 0u16;
        let mut first = [0u8; LOOKED_UP.len()];
        let (mut buf, mut spans) = take_storage(raw.len());
        buf.clear();
        buf.extend_from_slice(raw);
        spans.clear();
        spans.extend(list.iter().enumerate().map(|(at, h)| {
            if let Some(k) = looked_up(h.name.as_bytes()) {
                let bit = k.bit();
                if present & bit == 0 {
                    present |= bit;
                    first[usize::from(k.0)] = at as u8;
                } else {
                    repeated |= bit;
                }
            }
            // httparse hands out sub-slices of `raw`, so the offsets are in range.
            let n = h.name.as_ptr() as usize - base;
            let v = h.value.as_ptr() as usize - base;
            [
                n as u32,
                h.name.len() as u32,
                v as u32,
                h.value.len() as u32,
            ]
        }));
        let mut h = Headers {
            raw: buf,
            spans,
            present,
            repeated,
            first,
            connection: 0,
        };
        let mut connection = 0;
        for v in h.all_known(Known::CONNECTION) {
            for t in v.split(|&b| b == b',').map(trim).filter(|t| !t.is_empty()) {
                connection |= if t.eq_ignore_ascii_case(b"close") {
                    CONN_CLOSE
                } else if t.eq_ignore_ascii_case(b"keep-alive") {
                    CONN_KEEP_ALIVE
                } else {
                    CONN_NAMES
                };
            }
        }
        h.connection = connection;
        h
    }

    /// A `Connection` header has the token `close`.
    pub fn connection_close(&self) -> bool {
        self.connection & CONN_CLOSE != 0
    }

    /// A `Connection` header has the token `keep-alive`.
    pub fn connection_keep_alive(&self) -> bool {
        self.connection & CONN_KEEP_ALIVE != 0
    }

    /// The headers holding `k`: none when it is absent, the first occurrence on when it
    /// is present (just that one when it occurs once), and whether there is more than one.
    fn known_spans(&self, k: Known) -> (&[[u32; 4]], bool) {
        if self.present & k.bit() == 0 {
            return (&[], false);
        }
        let from = usize::from(self.first[usize::from(k.0)]);
        if self.repeated & k.bit() == 0 {
            (&self.spans[from..from + 1], false)
        } else {
            (&self.spans[from..], true)
        }
    }

    /// Whether any of `ks` is present: one test of the index, nothing compared.
    pub fn any_known(&self, ks: &[Known]) -> bool {
        let mask = ks.iter().fold(0u16, |m, k| m | k.bit());
        self.present & mask != 0
    }

    /// First value of a known header: no name is compared.
    pub fn get_known(&self, k: Known) -> Option<&[u8]> {
        if self.present & k.bit() == 0 {
            return None;
        }
        let s = self.spans[usize::from(self.first[usize::from(k.0)])];
        Some(self.raw_bytes(s[2], s[3]))
    }

    /// Every value of a known header, in order.
    pub fn all_known(&self, k: Known) -> impl Iterator<Item = &[u8]> + '_ {
        let (spans, repeated) = self.known_spans(k);
        Headers::raw_pairs(&self.raw, spans)
            .filter(move |(n, _)| !repeated || super::write::name_is(n, k.name().as_bytes()))
            .map(|(_, v)| v)
    }

    /// Whether any comma-separated token of any `k` header equals `token` (case-insensitive).
    pub fn known_has_token(&self, k: Known, token: &[u8]) -> bool {
        self.all_known(k).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| trim(t).eq_ignore_ascii_case(token))
        })
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

    /// Append the headers `keep` accepts to `out` as header lines. A run of consecutive
    /// accepted lines is copied as received, in one piece, when each ends in CRLF (httparse
    /// admits no folding, and the bytes between a name and its value are `:` and blanks);
    /// any other line is written out as `name: value` + CRLF.
    pub fn write_lines(&self, out: &mut Vec<u8>, mut keep: impl FnMut(&[u8], &[u8]) -> bool) {
        let raw = &self.raw[..];
        // The bytes of the run not yet copied.
        let mut run = 0..0;
        for s in &self.spans {
            let [n0, nl, v0, vl] = s.map(|x| x as usize);
            let (name, value) = (&raw[n0..n0 + nl], &raw[v0..v0 + vl]);
            if !keep(name, value) {
                out.extend_from_slice(&raw[std::mem::replace(&mut run, 0..0)]);
                continue;
            }
            let end = v0 + vl;
            if end >= n0 + nl && raw.get(end..end + 2) == Some(&b"\r\n"[..]) {
                if run.is_empty() || run.end != n0 {
                    out.extend_from_slice(&raw[std::mem::replace(&mut run, n0..n0)]);
                }
                run.end = end + 2;
            } else {
                out.extend_from_slice(&raw[std::mem::replace(&mut run, 0..0)]);
                super::write::write_header(out, name, value);
            }
        }
        out.extend_from_slice(&raw[run]);
    }

    /// First value of a header, case-insensitive.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        match looked_up(name.as_bytes()) {
            Some(k) => self.get_known(k),
            None => self
                .iter_raw()
                .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
                .map(|(_, v)| v),
        }
    }

    /// Every value of a header, case-insensitive.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        let (spans, compare) = match looked_up(name.as_bytes()) {
            Some(k) => self.known_spans(k),
            None => (&self.spans[..], true),
        };
        Headers::raw_pairs(&self.raw, spans)
            .filter(move |(n, _)| !compare || n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// Whether `name` is listed in a `Connection` header as a hop-by-hop header
    /// (RFC 9110 §7.6.1). `close` and `keep-alive` are options, never header names here.
    pub fn connection_lists(&self, name: &[u8]) -> bool {
        self.known_has_token(Known::CONNECTION, name)
    }

    /// Whether the `Connection` header names anything besides `close`/`keep-alive`, i.e.
    /// whether `connection_lists` can ever be true (so callers can skip per-header checks).
    pub fn connection_names_headers(&self) -> bool {
        self.connection & CONN_NAMES != 0
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

/// Where `s` lies in `raw`, as start and length; `[0, 0]` (empty) when it is not a part of
/// `raw`. httparse hands out a static `""` as the reason of a status line that has none
/// (`HTTP/1.1 200` + CRLF) or one that is not UTF-8 (obs-text), not a slice of the buffer.
fn offset_in(raw: &[u8], s: &str) -> [u32; 2] {
    let start = (s.as_ptr() as usize).wrapping_sub(raw.as_ptr() as usize);
    if start <= raw.len() && s.len() <= raw.len() - start {
        [start as u32, s.len() as u32]
    } else {
        [0, 0]
    }
}

/// Parse `Content-Length` values: all must be plain digits and agree.
/// `restated` is set when the length is said more than once (equal values on two lines, or
/// a list such as `5, 5`), so a forwarder can say it once.
fn content_length(headers: &Headers, restated: &mut bool) -> Result<Option<u64>, HeadError> {
    let mut found: Option<u64> = None;
    // At most 19 digits: below u64::MAX, so no overflow.
    let mut agree = |part: &[u8]| {
        let n = part.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
        match found.replace(n) {
            Some(prev) if prev != n => {
                Err(HeadError::BadFraming("conflicting Content-Length headers"))
            }
            Some(_) => {
                *restated = true;
                Ok(())
            }
            None => Ok(()),
        }
    };
    let plain = |part: &[u8]| (1..=19).contains(&part.len()) && part.iter().all(u8::is_ascii_digit);
    for v in headers.all_known(Known::CONTENT_LENGTH) {
        // The usual value is plain digits: nothing to split or trim.
        if plain(v) {
            agree(v)?;
            continue;
        }
        for part in v.split(|&b| b == b',') {
            let part = trim(part);
            if !plain(part) {
                return Err(HeadError::BadFraming("invalid Content-Length"));
            }
            agree(part)?;
        }
    }
    Ok(found)
}

/// Whether `Transfer-Encoding` is present, and if so whether chunked is its final coding.
fn transfer_encoding(headers: &Headers) -> Option<bool> {
    let mut last: Option<&[u8]> = None;
    let mut present = false;
    for v in headers.all_known(Known::TRANSFER_ENCODING) {
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

/// Whether `Transfer-Encoding` names `chunked` and nothing else. A request's body is
/// de-chunked and forwarded with a length, so any other coding (`gzip, chunked`, or
/// `chunked, chunked`) would reach the peer undone: such a request gets 501.
fn chunked_only(headers: &Headers) -> bool {
    let mut codings = 0;
    for v in headers.all_known(Known::TRANSFER_ENCODING) {
        for t in v.split(|&b| b == b',') {
            let t = trim(t);
            if t.is_empty() {
                continue;
            }
            codings += 1;
            if !t.eq_ignore_ascii_case(b"chunked") {
                return false;
            }
        }
    }
    codings == 1
}

/// Whether a Host value is an authority as RFC 9110 §7.2 and RFC 3986 §3.2 allow it: a
/// reg-name, IPv4 address or bracketed IP literal, with an optional port, in the bytes
/// those grammars use; no path, space or control byte, no leading dot and no empty label
/// (`..`), which nginx refuses too. An empty value is valid (RFC 9112 §3.2). The value is a
/// few bytes long; one table lookup per byte.
fn host_value_ok(v: &[u8]) -> bool {
    const fn table() -> [bool; 256] {
        let mut t = [false; 256];
        let mut c = 0;
        while c < 256 {
            let b = c as u8;
            t[c] = b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'-' | b'.'
                        | b'_'
                        | b'~'
                        | b'%'
                        | b'!'
                        | b'$'
                        | b'&'
                        | b'\''
                        | b'('
                        | b')'
                        | b'*'
                        | b'+'
                        | b','
                        | b';'
                        | b'='
                        | b':'
                        | b'['
                        | b']'
                );
            c += 1;
        }
        t
    }
    static HOST_BYTE: [bool; 256] = table();
    if v.first() == Some(&b'.') {
        return false;
    }
    let mut prev = 0u8;
    for &b in v {
        if !HOST_BYTE[usize::from(b)] || (b == b'.' && prev == b'.') {
            return false;
        }
        prev = b;
    }
    true
}

/// The path (and query) of an absolute-form target `http://authority/path?query`, or
/// `None` when `target` is not one or has no path.
fn absolute_form_path(target: &str) -> Option<&str> {
    let b = target.as_bytes();
    let rest = if b.len() > 7 && b[..7].eq_ignore_ascii_case(b"http://") {
        &target[7..]
    } else if b.len() > 8 && b[..8].eq_ignore_ascii_case(b"https://") {
        &target[8..]
    } else {
        return None;
    };
    let slash = rest.find('/')?;
    // The authority holds no query or fragment: `http://host?x/y` has no path.
    if rest[..slash].contains(['?', '#']) || slash == 0 {
        return None;
    }
    Some(&rest[slash..])
}

/// What httparse's version error means for a request whose head starts `buf`:
/// - a well-formed request line naming a later HTTP/1 minor version (`GET / HTTP/1.2`):
///   [`HeadError::LaterMinor`], for the reader to rewrite the digit and parse again;
/// - one naming another major version (`GET / HTTP/2.0`): 505;
/// - anything else httparse also reports so (`GET /a b HTTP/1.1`, a lower-case
///   `http/1.1`): 400.
#[cold]
fn version_error(buf: &[u8]) -> HeadError {
    // httparse skips empty lines before a request line (RFC 9112 §2.2).
    let skipped = buf
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    let buf = &buf[skipped..];
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.split(|&b| b == b' ');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(&[b'H', b'T', b'T', b'P', b'/', major, b'.', minor]), None)
            if !m.is_empty()
                && !t.is_empty()
                && major.is_ascii_digit()
                && minor.is_ascii_digit() =>
        {
            if major == b'1' && minor > b'1' {
                HeadError::LaterMinor {
                    at: skipped + line.len() - 1,
                }
            } else {
                HeadError::UnsupportedVersion
            }
        }
        _ => HeadError::Malformed("malformed request line"),
    }
}

/// A head over the limit: 414 when its request line alone does not end within it (RFC
/// 9112 §3), 431 otherwise.
#[cold]
fn too_large(buf: &[u8]) -> HeadError {
    let within = &buf[..buf.len().min(REQUEST_HEAD_BYTES_MAX)];
    if within.contains(&b'\n') {
        HeadError::TooLarge
    } else {
        HeadError::UriTooLong
    }
}

/// Parse a request head from the start of `buf`.
pub fn parse_request(buf: &[u8]) -> Result<HeadParse<RequestHead>, HeadError> {
    // Left uninitialised: httparse writes the headers it finds, and filling all 100 slots
    // first would cost more than parsing a usual head.
    let mut storage =
        [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; REQUEST_HEADERS_MAX];
    let mut req = httparse::Request::new(&mut []);
    let status = match req.parse_with_uninit_headers(buf, &mut storage) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooManyHeaders),
        Err(httparse::Error::Version) => return Err(version_error(buf)),
        Err(_) => return Err(HeadError::Malformed("malformed request head")),
    };
    let len = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => {
            return if buf.len() >= REQUEST_HEAD_BYTES_MAX {
                Err(too_large(buf))
            } else {
                Ok(HeadParse::Partial)
            };
        }
    };
    if len > REQUEST_HEAD_BYTES_MAX {
        return Err(too_large(buf));
    }
    let raw = &buf[..len];
    let (Some(method), Some(path), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(HeadError::Malformed("malformed request line"));
    };
    // As nginx answers them, before their targets (`CONNECT host:443`) are judged.
    if matches!(method, "TRACE" | "CONNECT") {
        return Err(HeadError::MethodNotAllowed);
    }
    // The absolute form (`GET http://host/route/v1/models`, as a client configured with
    // the router as its HTTP proxy sends it) is served by its path (RFC 9112 §3.2.2); the
    // host it names is the router itself.
    let path = if path.starts_with('/') {
        path
    } else if let Some(p) = absolute_form_path(path) {
        p
    } else {
        return Err(HeadError::Malformed(
            "request target must be an absolute path or an http:// URI with a path",
        ));
    };
    let method_span = offset_in(raw, method);
    let target_span = offset_in(raw, path);
    let headers = Headers::from_parsed(raw, req.headers);
    // RFC 9112 §3.2: an HTTP/1.1 request has exactly one Host, and no request has two.
    // The router names its own host to the peer; a request that a proxy in front could
    // read as addressed elsewhere is refused, as nginx does.
    // Two bit tests of the head's index: nothing is compared or iterated.
    if headers.repeated & Known::HOST.bit() != 0 {
        return Err(HeadError::Malformed("more than one Host header"));
    }
    if minor >= 1 && headers.present & Known::HOST.bit() == 0 {
        return Err(HeadError::Malformed("missing Host header"));
    }
    if let Some(host) = headers.get_known(Known::HOST) {
        if !host_value_ok(host) {
            return Err(HeadError::Malformed("invalid Host header"));
        }
    }
    let cl = content_length(&headers, &mut false)?;
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
        (Some(true), None) if chunked_only(&headers) => BodyFraming::Chunked,
        (Some(_), None) => return Err(HeadError::UnsupportedCoding),
        (None, Some(0)) | (None, None) => BodyFraming::None,
        (None, Some(n)) => BodyFraming::Length(n),
    };
    let keep_alive = if minor == 0 {
        headers.connection_keep_alive()
    } else {
        !headers.connection_close()
    };
    let expect_continue = minor >= 1
        && headers
            .get_known(Known::EXPECT)
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
    /// The length, when `Content-Length` said it more than once (two equal lines, or
    /// `5, 5`), whatever the framing (a HEAD or 304 answer says it too).
    pub restated_length: Option<u64>,
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
    let mut storage =
        [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; RESPONSE_HEADERS_MAX];
    let mut res = httparse::Response::new(&mut []);
    let status = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut res,
        buf,
        &mut storage,
    ) {
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
    let reason = res.reason.map_or([0, 0], |r| offset_in(raw, r));
    let headers = Headers::from_parsed(raw, res.headers);
    let te = transfer_encoding(&headers);
    let mut length_restated = false;
    let cl = content_length(&headers, &mut length_restated);
    let mut reusable = if minor == 0 {
        headers.connection_keep_alive()
    } else {
        !headers.connection_close()
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
            restated_length: cl.ok().flatten().filter(|_| length_restated),
        },
        len,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_of_listed_names_skip_absent_ones_and_find_present_ones() {
        let h = req("GET / HTTP/1.1\r\nX-Other: o\r\nX-SESSION-ID: a\r\nX-Forwarded-For: 1.2.3.4\r\nContent-Type: t\r\nx-forwarded-for: 5.6.7.8\r\nX-Other: p\r\nConnection: a, b\r\ncontent-TYPE: u\r\n\r\n")
            .unwrap()
            .headers;
        // Listed and present once or more, in any case: the first, and every one in order.
        assert_eq!(h.get("x-session-id"), Some(&b"a"[..]));
        assert_eq!(h.get("content-type"), Some(&b"t"[..]));
        let xff: Vec<&[u8]> = h.get_all("x-forwarded-for").collect();
        assert_eq!(xff, [&b"1.2.3.4"[..], b"5.6.7.8"]);
        let ct: Vec<&[u8]> = h.get_all("content-type").collect();
        assert_eq!(ct, [&b"t"[..], b"u"]);
        assert_eq!(h.get_all("x-session-id").count(), 1);
        assert!(
            h.known_has_token(Known::CONNECTION, b"b")
                && !h.known_has_token(Known::CONNECTION, b"c")
        );
        // Listed and absent.
        assert_eq!(h.get("authorization"), None);
        assert_eq!(h.get_all("x-litellm-session-id").count(), 0);
        assert_eq!(h.get(crate::control::session_prio::HEADER), None);
        // Not listed: looked up by comparing names.
        assert_eq!(h.get("x-other"), Some(&b"o"[..]));
        assert_eq!(h.get_all("x-other").count(), 2);
        assert_eq!(h.get("x-missing"), None);
        // Lookups by index agree with lookups by name.
        assert_eq!(h.get_known(Known::CONTENT_TYPE), Some(&b"t"[..]));
        let ct: Vec<&[u8]> = h.all_known(Known::CONTENT_TYPE).collect();
        assert_eq!(ct, [&b"t"[..], b"u"]);
        assert_eq!(h.get_known(Known::AUTHORIZATION), None);
        assert!(h.known_has_token(Known::CONNECTION, b"A"));
        // Every listed name maps to its own index, whatever its case; others to none.
        for (i, n) in LOOKED_UP.iter().enumerate() {
            let k = looked_up(n.to_ascii_uppercase().as_bytes());
            assert_eq!(k, Some(Known(i as u8)), "{n}");
            assert_eq!(k.unwrap().name(), *n);
        }
        // Each constant names the header it says.
        for (k, n) in [
            (Known::CONTENT_LENGTH, "content-length"),
            (Known::TRANSFER_ENCODING, "transfer-encoding"),
            (Known::CONNECTION, "connection"),
            (Known::EXPECT, "expect"),
            (Known::X_FORWARDED_FOR, "x-forwarded-for"),
            (Known::AUTHORIZATION, "authorization"),
            (Known::X_API_KEY, "x-api-key"),
            (Known::X_LITELLM_SESSION_ID, "x-litellm-session-id"),
            (Known::X_CLAUDE_CODE_SESSION_ID, "x-claude-code-session-id"),
            (Known::X_SESSION_ID, "x-session-id"),
            (Known::CONTENT_TYPE, "content-type"),
            (Known::X_PHANROUTER_SESSION, "x-phanrouter-session"),
        ] {
            assert_eq!(k.name(), n);
        }
        assert_eq!(looked_up(b"x-sessionid"), None);
        assert_eq!(looked_up(b"x-session-ie"), None);
        assert_eq!(looked_up(&[b'a'; 40]), None);
        assert_eq!(
            Known::X_PHANROUTER_SESSION.name(),
            crate::control::session_prio::HEADER
        );
    }

    #[test]
    fn kept_lines_are_copied_as_received_and_others_normalised() {
        let h = req("GET / HTTP/1.1\r\nHost: a\r\nX-A:1\r\nConnection: close\r\nX-B:\t two\r\nX-C: 3\nX-D: 4\r\nX-E: 5\r\n\r\n")
            .unwrap()
            .headers;
        let mut out = b"> ".to_vec();
        h.write_lines(&mut out, |n, _| !n.eq_ignore_ascii_case(b"connection"));
        // Runs of CRLF lines as received (`X-A:1`, `X-B:\t two`); the bare-LF line
        // rewritten with CRLF; the dropped line gone.
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "> Host: a\r\nX-A:1\r\nX-B:\t two\r\nX-C: 3\r\nX-D: 4\r\nX-E: 5\r\n"
        );
        let mut none = Vec::new();
        h.write_lines(&mut none, |_, _| false);
        assert!(none.is_empty());
    }

    #[test]
    fn kept_lines_reparse_to_the_kept_headers() {
        let mut rng = crate::testutil::XorShift::new(7);
        let blanks = ["", " ", "  ", "\t", " \t "];
        for _ in 0..500 {
            let n = rng.below(12);
            // HTTP/1.0: no Host needed, so the head holds only the lines under test.
            let mut head = String::from("POST /x HTTP/1.0\r\n");
            for i in 0..n {
                let pre = blanks[rng.below(blanks.len())];
                let post = blanks[rng.below(blanks.len())];
                let value = ["v", "a b", "", "x,y"][rng.below(4)];
                let eol = if rng.below(4) == 0 { "\n" } else { "\r\n" };
                head.push_str(&format!("H-{i}:{pre}{value}{post}{eol}"));
            }
            head.push_str("\r\n");
            let HeadParse::Complete(h, _) = parse_request(head.as_bytes()).unwrap() else {
                panic!("partial: {head:?}");
            };
            let h = h.headers;
            let keep: Vec<bool> = (0..n).map(|_| rng.below(3) != 0).collect();
            let mut i = 0;
            let mut out = b"GET / HTTP/1.0\r\n".to_vec();
            h.write_lines(&mut out, |_, _| {
                i += 1;
                keep[i - 1]
            });
            assert!(
                !out.windows(2).any(|w| w[1] == b'\n' && w[0] != b'\r'),
                "{head:?}"
            );
            out.extend_from_slice(b"\r\n");
            let again = req(std::str::from_utf8(&out).unwrap()).unwrap().headers;
            let want: Vec<_> = h
                .iter_raw()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(p, _)| p)
                .collect();
            let got: Vec<_> = again.iter_raw().collect();
            assert_eq!(got, want, "{head:?}");
        }
    }

    #[test]
    fn a_dropped_head_lends_its_buffers_to_the_next_one() {
        let a = req("GET /a HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n\r\n").unwrap();
        let (raw, spans) = (a.headers.raw.as_ptr(), a.headers.spans.as_ptr());
        drop(a);
        let b = req("GET /b HTTP/1.1\r\nHost: b\r\n\r\n").unwrap();
        assert_eq!(
            (b.headers.raw.as_ptr(), b.headers.spans.as_ptr()),
            (raw, spans)
        );
        // Nothing of the first head shows through.
        assert_eq!(b.target(), "/b");
        assert_eq!(b.headers.len(), 1);
        assert_eq!(b.headers.get("x-a"), None);
        assert_eq!(b.headers.get("host"), Some(&b"b"[..]));
        // A head whose buffer is too large to keep is freed, not kept.
        let big = format!(
            "GET / HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "v".repeat(SPARE_RAW_BYTES_MAX)
        );
        drop(req(&big).unwrap());
        let kept = SPARE_STORAGE.with(|s| s.borrow().iter().map(|(r, _)| r.capacity()).max());
        assert!(kept.unwrap_or(0) <= SPARE_RAW_BYTES_MAX);
        // A small head does not take a spare much larger than itself.
        let large = format!("GET / HTTP/1.1\r\nX-L: {}\r\n\r\n", "v".repeat(4000));
        drop(req(&large).unwrap());
        let small = req("GET / HTTP/1.1\r\nHost: s\r\n\r\n").unwrap();
        assert!(
            small.headers.raw.capacity() < 1024,
            "{}",
            small.headers.raw.capacity()
        );
        drop(small);
        // The list stays bounded.
        let many: Vec<_> = (0..SPARE_STORAGE_MAX + 10)
            .map(|_| req("GET / HTTP/1.1\r\n\r\n").unwrap())
            .collect();
        drop(many);
        assert_eq!(SPARE_STORAGE.with(|s| s.borrow().len()), SPARE_STORAGE_MAX);
    }

    #[test]
    fn a_listed_name_among_the_last_allowed_headers_is_found() {
        // `first` holds indexes as bytes: the limits keep them in range, the last too.
        let mut s = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..RESPONSE_HEADERS_MAX - 2 {
            s.push_str(&format!("X-{i}: v\r\n"));
        }
        s.push_str("Content-Type: late\r\nContent-Length: 0\r\n\r\n");
        let HeadParse::Complete(h, _) = parse_response(s.as_bytes(), false).unwrap() else {
            panic!("partial");
        };
        assert_eq!(h.headers.get("content-type"), Some(&b"late"[..]));
        assert_eq!(h.framing, ResponseFraming::Length(0));
    }

    /// Parse `s`, with a `Host` added after the request line of an HTTP/1.1 head that has
    /// none (the cases here are about other headers).
    fn req(s: &str) -> Result<RequestHead, HeadError> {
        let owned;
        let s = match s.split_once("\r\n") {
            Some((line, rest))
                if line.ends_with("HTTP/1.1") && !s.to_ascii_lowercase().contains("\r\nhost:") =>
            {
                owned = format!("{line}\r\nHost: t\r\n{rest}");
                owned.as_str()
            }
            _ => s,
        };
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
        let mut exactly = String::from("GET / HTTP/1.1\r\nHost: t\r\n");
        for i in 1..REQUEST_HEADERS_MAX {
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
        // A list of equal values, a plain value and a list together, the digit limit.
        assert_eq!(
            req("POST / HTTP/1.1\r\nContent-Length: 7 ,7\r\ncontent-length: 7\r\n\r\n")
                .unwrap()
                .body,
            BodyFraming::Length(7)
        );
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 7, 8\r\n\r\n")
                .unwrap_err(),
            HeadError::BadFraming(_)
        ));
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: ,\r\n\r\n").unwrap_err(),
            HeadError::BadFraming(_)
        ));
        let max = "9".repeat(19);
        assert_eq!(
            req(&format!("POST / HTTP/1.1\r\nContent-Length: {max}\r\n\r\n"))
                .unwrap()
                .body,
            BodyFraming::Length(max.parse().unwrap())
        );
        assert!(matches!(
            req(&format!(
                "POST / HTTP/1.1\r\nContent-Length: 1{max}\r\n\r\n"
            ))
            .unwrap_err(),
            HeadError::BadFraming(_)
        ));
        // Only `chunked` alone: the body is de-chunked and sent on with a length, so
        // any other coding in the list would reach the peer undone.
        for te in ["gzip, chunked", "chunked, chunked", "identity, chunked"] {
            assert_eq!(
                req(&format!(
                    "POST / HTTP/1.1\r\nTransfer-Encoding: {te}\r\n\r\n"
                ))
                .unwrap_err(),
                HeadError::UnsupportedCoding,
                "{te}"
            );
        }
        assert_eq!(
            req("POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n")
                .unwrap()
                .body,
            BodyFraming::Chunked
        );
        assert_eq!(
            req("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap_err(),
            HeadError::UnsupportedCoding
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
        // Tokens from every Connection header, in any case, among other tokens.
        let h = req("GET / HTTP/1.1\r\nConnection: x-a , CLOSE\r\nX: y\r\nconnection: ,\r\n\r\n")
            .unwrap();
        assert!(!h.keep_alive && h.headers.connection_names_headers());
        assert!(h.headers.connection_lists(b"X-A") && !h.headers.connection_lists(b"x"));
        let h = req("GET / HTTP/1.0\r\nConnection: te\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(h.keep_alive && h.headers.connection_names_headers());
        let h = req("GET / HTTP/1.1\r\nConnection: keep-alive, close\r\n\r\n").unwrap();
        assert!(!h.keep_alive && !h.headers.connection_names_headers());
        let h = req("GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(h.keep_alive && !h.headers.connection_names_headers());
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "GARBAGE\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET http://x HTTP/1.1\r\n\r\n",
            "GET http://x?a/b HTTP/1.1\r\n\r\n",
            "GET http:///a HTTP/1.1\r\n\r\n",
            "GET ftp://x/a HTTP/1.1\r\n\r\n",
            "OPTIONS * HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        ] {
            assert!(req(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_later_http1_minor_version_is_read_as_1_1_and_others_are_505() {
        // As the connection's reader does it: the digit rewritten in its buffer, then
        // parsed again.
        let parse = |b: &[u8]| {
            let mut b = b.to_vec();
            match parse_request(&b) {
                Err(HeadError::LaterMinor { at }) => {
                    assert_eq!(&b[at - 7..at], b"HTTP/1.");
                    b[at] = b'1';
                    parse_request(&b)
                }
                r => r,
            }
        };
        let whole = "GET /a HTTP/1.2\r\nHost: t\r\nX-A: 1\r\n\r\nnext";
        let Ok(HeadParse::Complete(h, n)) = parse(whole.as_bytes()) else {
            panic!("HTTP/1.2 is parsed")
        };
        assert_eq!((h.minor_version, h.path(), n), (1, "/a", whole.len() - 4));
        assert_eq!(h.headers.get("x-a"), Some(&b"1"[..]));
        // Read as 1.1: keep-alive by default, and a Host is required.
        assert!(h.keep_alive);
        assert!(matches!(
            parse(b"GET /a HTTP/1.9\r\n\r\n"),
            Err(HeadError::Malformed("missing Host header"))
        ));
        // Pieces of it are partial, as an HTTP/1.1 head's are.
        for cut in 1..whole.len() - 4 {
            assert!(
                matches!(parse(&whole.as_bytes()[..cut]), Ok(HeadParse::Partial)),
                "{:?}",
                &whole[..cut]
            );
        }
        // Empty lines before the request line are skipped, as httparse skips them.
        let Ok(HeadParse::Complete(h, _)) = parse(b"\r\n\nGET /b HTTP/1.3\r\nHost: t\r\n\r\n")
        else {
            panic!("after empty lines")
        };
        assert_eq!((h.minor_version, h.path()), (1, "/b"));
        // Other major versions, and two-digit minors, are not read as HTTP/1.1.
        for (raw, want) in [
            ("GET / HTTP/2.0\r\nHost: t\r\n\r\n", 505),
            ("GET / HTTP/0.9\r\nHost: t\r\n\r\n", 505),
            ("GET / HTTP/1.12\r\nHost: t\r\n\r\n", 400),
        ] {
            let got = parse(raw.as_bytes()).map(|_| ()).unwrap_err();
            assert_eq!(got.status(), want, "{raw:?}");
        }
    }

    #[test]
    fn host_is_required_once_in_http_1_1() {
        let parse = |s: &str| match parse_request(s.as_bytes()) {
            Ok(HeadParse::Complete(..)) => Ok(()),
            Ok(HeadParse::Partial) => panic!("partial"),
            Err(e) => Err(e),
        };
        for bad in [
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",
            "GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
        ] {
            assert!(
                matches!(parse(bad), Err(HeadError::Malformed(m)) if m.contains("Host")),
                "{bad:?}"
            );
        }
        // The controls: one Host, and HTTP/1.0 without one.
        assert!(parse("GET / HTTP/1.1\r\nHOST: a:8080\r\n\r\n").is_ok());
        assert!(parse("GET / HTTP/1.0\r\n\r\n").is_ok());
    }

    #[test]
    fn a_host_value_that_is_no_authority_is_refused() {
        let parse = |host: &str| {
            let head = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            match parse_request(head.as_bytes()) {
                Ok(HeadParse::Complete(..)) => Ok(()),
                Ok(HeadParse::Partial) => panic!("partial"),
                Err(e) => Err(e),
            }
        };
        for bad in [
            "a b", "a/b", "a\\b", ".a", "a..b", "a@b", "a\tb", "h\"x", "é",
        ] {
            assert!(
                matches!(parse(bad), Err(HeadError::Malformed("invalid Host header"))),
                "{bad:?}"
            );
        }
        for good in [
            "",
            "llm.internal",
            "llm.internal.",
            "127.0.0.1:8080",
            "[::1]:8080",
            "a-b_c~d.example",
            "xn--bcher-kva.example",
            "%41b",
        ] {
            assert!(parse(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn an_absolute_form_target_is_served_by_its_path() {
        for (line, target) in [
            (
                "GET http://llm.internal/r/v1/models HTTP/1.1",
                "/r/v1/models",
            ),
            ("GET HTTPS://h:8080/r/v1/x?a=b HTTP/1.1", "/r/v1/x?a=b"),
            ("POST http://h/ HTTP/1.1", "/"),
        ] {
            let h = req(&format!("{line}\r\nHost: h\r\n\r\n")).unwrap();
            assert_eq!(h.target(), target, "{line}");
        }
    }

    fn res(s: &str, head: bool) -> ResponseHead {
        match parse_response(s.as_bytes(), head).unwrap() {
            HeadParse::Complete(h, _) => h,
            HeadParse::Partial => panic!("partial"),
        }
    }

    #[test]
    fn a_status_line_without_a_usable_reason_has_an_empty_one() {
        // No reason phrase at all, an empty one, and one that is not UTF-8 (httparse gives
        // a static "" for the first and the last, not a slice of the head).
        for (line, reason) in [
            (&b"HTTP/1.1 200\r\n"[..], ""),
            (b"HTTP/1.1 200 \r\n", ""),
            (b"HTTP/1.1 404 Not \xff Found\r\n", ""),
            (b"HTTP/1.1 201 Made\r\n", "Made"),
        ] {
            let mut head = line.to_vec();
            head.extend_from_slice(b"Content-Length: 0\r\n\r\n");
            let HeadParse::Complete(h, n) = parse_response(&head, false).unwrap() else {
                panic!("partial");
            };
            assert_eq!(n, head.len());
            assert_eq!(h.reason(), reason, "{line:?}");
            assert_eq!(h.framing, ResponseFraming::Length(0));
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
