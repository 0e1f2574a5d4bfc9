//! Minimal HTTP/1.1 server-side framing: request heads, request bodies, response heads.

/// Largest accepted request head: above the router's 64 KiB client limit (SPEC §14), since
/// a router in front adds its forwarding headers (`X-Forwarded-*`, `X-Real-IP`, a peer
/// `Host`, `Content-Length`) to the largest head it accepts.
pub const HEAD_LIMIT: usize = 80 * 1024;
/// Largest number of request headers: the router's 100 (SPEC §14) plus the headers it adds
/// when forwarding, with room to spare.
pub const MAX_HEADERS: usize = 128;
/// Largest accepted request body (decoded).
pub const BODY_LIMIT: usize = 64 * 1024 * 1024;
const CHUNK_LINE_LIMIT: usize = 4096;
const TRAILER_LIMIT: usize = 64 * 1024;

/// A request failure that ends the connection with an error status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpError {
    pub status: u16,
    pub message: &'static str,
}

impl HttpError {
    pub const fn new(status: u16, message: &'static str) -> Self {
        Self { status, message }
    }
    fn bad(message: &'static str) -> Self {
        Self::new(400, message)
    }
}

/// A parsed request head with owned data.
#[derive(Debug, Clone)]
pub struct Head {
    pub method: String,
    /// The request target as sent (path and query).
    pub target: String,
    /// The target without its query string.
    pub path: String,
    /// HTTP/1.`minor_version`.
    pub minor_version: u8,
    /// Headers in received order, names as received.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Head {
    /// First value of a header (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// First value of a header as trimmed UTF-8 (None when absent or not UTF-8).
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name)
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(str::trim)
    }

    fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.header_values(name).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
        })
    }

    /// Whether the connection may be reused after this request.
    pub fn keep_alive(&self) -> bool {
        if self.has_token("connection", "close") {
            return false;
        }
        self.minor_version >= 1 || self.has_token("connection", "keep-alive")
    }

    /// Whether the client asked for `100 Continue` before sending the body.
    pub fn expects_continue(&self) -> bool {
        self.minor_version >= 1 && self.has_token("expect", "100-continue")
    }

    /// Headers as a JSON array of `[name, value]` pairs in received order. Values that are not
    /// UTF-8 are converted lossily. Only ASCII is emitted, so the text is usable as a header
    /// value.
    pub fn headers_json(&self) -> String {
        let pairs: Vec<(&str, String)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), String::from_utf8_lossy(v).into_owned()))
            .collect();
        ascii_json(&serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".into()))
    }
}

/// Escape every non-ASCII character of a JSON text as `\uXXXX` (only valid because non-ASCII
/// characters can only occur inside JSON strings).
pub fn ascii_json(s: &str) -> String {
    if s.is_ascii() {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// Parse a request head from the start of `buf`. `Ok(None)` = incomplete, read more.
/// On success returns the head and its length in bytes.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => {
            if len > HEAD_LIMIT {
                return Err(HttpError::new(431, "request head too large"));
            }
            let method = req.method.unwrap_or("").to_string();
            let target = req.path.unwrap_or("").to_string();
            let path = target.split(['?', '#']).next().unwrap_or("").to_string();
            let head = Head {
                method,
                path,
                target,
                minor_version: req.version.unwrap_or(1),
                headers: req
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), h.value.to_vec()))
                    .collect(),
            };
            Ok(Some((head, len)))
        }
        Ok(httparse::Status::Partial) => {
            if buf.len() > HEAD_LIMIT {
                Err(HttpError::new(431, "request head too large"))
            } else {
                Ok(None)
            }
        }
        Err(httparse::Error::TooManyHeaders) => Err(HttpError::new(431, "too many headers")),
        Err(_) => Err(HttpError::bad("malformed request head")),
    }
}

/// How the request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Empty,
    Length(usize),
    Chunked,
}

/// Determine the body framing, rejecting ambiguous or unsupported framings.
pub fn body_kind(head: &Head) -> Result<BodyKind, HttpError> {
    let mut length: Option<usize> = None;
    for v in head.header_values("content-length") {
        for part in v.split(|&b| b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) || part.len() > 19 {
                return Err(HttpError::bad("invalid content-length"));
            }
            let n: u64 = std::str::from_utf8(part)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(HttpError::bad("invalid content-length"))?;
            let n = usize::try_from(n).map_err(|_| HttpError::new(413, "body too large"))?;
            if length.is_some_and(|l| l != n) {
                return Err(HttpError::bad("conflicting content-length"));
            }
            length = Some(n);
        }
    }
    let mut codings: Vec<String> = Vec::new();
    for v in head.header_values("transfer-encoding") {
        for part in v.split(|&b| b == b',') {
            let part = part.trim_ascii();
            if !part.is_empty() {
                codings.push(String::from_utf8_lossy(part).to_ascii_lowercase());
            }
        }
    }
    let has_te = head.header("transfer-encoding").is_some();
    if has_te && length.is_some() {
        return Err(HttpError::bad("both content-length and transfer-encoding"));
    }
    if has_te {
        if head.minor_version == 0 {
            return Err(HttpError::bad("transfer-encoding in HTTP/1.0"));
        }
        return match codings.as_slice() {
            [c] if c == "chunked" => Ok(BodyKind::Chunked),
            _ => Err(HttpError::new(501, "unsupported transfer-encoding")),
        };
    }
    match length {
        Some(n) if n > BODY_LIMIT => Err(HttpError::new(413, "body too large")),
        Some(0) | None => Ok(BodyKind::Empty),
        Some(n) => Ok(BodyKind::Length(n)),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Size,
    Data(u64),
    DataEnd,
    Trailers(usize),
    Done,
}

/// Incremental decoder of a chunked request body.
#[derive(Debug)]
pub struct ChunkedDecoder {
    state: ChunkState,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedDecoder {
    pub fn new() -> Self {
        Self {
            state: ChunkState::Size,
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Decode as much of `buf` as possible, appending data to `out`. Returns the number of
    /// bytes of `buf` consumed (the caller drops them). Check `is_done` afterwards.
    pub fn feed(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, HttpError> {
        let mut pos = 0;
        loop {
            let rest = &buf[pos..];
            match self.state {
                ChunkState::Done => return Ok(pos),
                ChunkState::Size => match httparse::parse_chunk_size(rest) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        pos += used;
                        self.state = if size == 0 {
                            ChunkState::Trailers(0)
                        } else {
                            if out.len() as u64 + size > BODY_LIMIT as u64 {
                                return Err(HttpError::new(413, "body too large"));
                            }
                            ChunkState::Data(size)
                        };
                    }
                    Ok(httparse::Status::Partial) => {
                        if rest.len() > CHUNK_LINE_LIMIT {
                            return Err(HttpError::bad("chunk size line too long"));
                        }
                        return Ok(pos);
                    }
                    Err(_) => return Err(HttpError::bad("invalid chunk size")),
                },
                ChunkState::Data(remaining) => {
                    if rest.is_empty() {
                        return Ok(pos);
                    }
                    let take = (remaining.min(rest.len() as u64)) as usize;
                    out.extend_from_slice(&rest[..take]);
                    pos += take;
                    let left = remaining - take as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                }
                ChunkState::DataEnd => {
                    if rest.len() < 2 {
                        if rest.first().is_some_and(|&b| b != b'\r') {
                            return Err(HttpError::bad("missing CRLF after chunk"));
                        }
                        return Ok(pos);
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err(HttpError::bad("missing CRLF after chunk"));
                    }
                    pos += 2;
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers(seen) => match rest.iter().position(|&b| b == b'\n') {
                    Some(i) => {
                        let line = &rest[..i];
                        let line = line.strip_suffix(b"\r").unwrap_or(line);
                        pos += i + 1;
                        if line.is_empty() {
                            self.state = ChunkState::Done;
                        } else {
                            let seen = seen + i + 1;
                            if seen > TRAILER_LIMIT {
                                return Err(HttpError::new(431, "trailers too large"));
                            }
                            self.state = ChunkState::Trailers(seen);
                        }
                    }
                    None => {
                        if seen + rest.len() > TRAILER_LIMIT {
                            return Err(HttpError::new(431, "trailers too large"));
                        }
                        return Ok(pos);
                    }
                },
            }
        }
    }
}

/// Standard reason phrase of a status code.
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Body framing of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RespLen {
    /// `Content-Length: n`.
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// No length header (204/304, or delimited by close).
    None,
}

/// Serialize a response head. `extra` headers are written verbatim (values must be valid).
pub fn response_head(
    status: u16,
    peer: &str,
    content_type: Option<&str>,
    len: RespLen,
    close: bool,
    extra: &[(&str, &str)],
) -> Vec<u8> {
    let mut h = String::with_capacity(256);
    h.push_str(&format!("HTTP/1.1 {status} {}\r\n", reason(status)));
    h.push_str("x-mock-peer: ");
    // The name comes from configuration; keep the head well-formed whatever it holds.
    h.extend(peer.chars().map(|c| {
        if c.is_ascii_graphic() || c == ' ' {
            c
        } else {
            '_'
        }
    }));
    h.push_str("\r\n");
    if let Some(ct) = content_type {
        h.push_str("content-type: ");
        h.push_str(ct);
        h.push_str("\r\n");
    }
    match len {
        RespLen::Length(n) => h.push_str(&format!("content-length: {n}\r\n")),
        RespLen::Chunked => h.push_str("transfer-encoding: chunked\r\n"),
        RespLen::None => {}
    }
    for (n, v) in extra {
        h.push_str(n);
        h.push_str(": ");
        h.push_str(v);
        h.push_str("\r\n");
    }
    if close {
        h.push_str("connection: close\r\n");
    }
    h.push_str("\r\n");
    h.into_bytes()
}

/// One HTTP chunk holding `data` (never empty: an empty chunk would end the body).
pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 12);
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// OpenAI-shaped JSON error body.
pub fn error_body(status: u16, kind: &str, message: &str) -> Vec<u8> {
    serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &str) -> Head {
        parse_head(raw.as_bytes()).unwrap().unwrap().0
    }

    #[test]
    fn parses_head_and_framing() {
        let h = head("POST /v1/x?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello");
        assert_eq!(h.path, "/v1/x");
        assert_eq!(h.target, "/v1/x?q=1");
        assert!(h.keep_alive());
        assert_eq!(body_kind(&h), Ok(BodyKind::Length(5)));
        let h = head("GET / HTTP/1.0\r\n\r\n");
        assert!(!h.keep_alive());
        let h = head("GET / HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n");
        assert!(!h.keep_alive());
        assert!(parse_head(b"GET / HTTP/1.1\r\nHost: a\r\n")
            .unwrap()
            .is_none());
        assert_eq!(
            parse_head(b"\x01\x02 garbage\r\n\r\n").unwrap_err().status,
            400
        );
    }

    #[test]
    fn rejects_ambiguous_framing() {
        let h = head("POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(body_kind(&h).unwrap_err().status, 400);
        let h = head("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n");
        assert_eq!(body_kind(&h).unwrap_err().status, 400);
        let h = head("POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n");
        assert_eq!(body_kind(&h), Ok(BodyKind::Length(5)));
        let h = head("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n");
        assert_eq!(body_kind(&h).unwrap_err().status, 400);
        let h = head("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
        assert_eq!(body_kind(&h).unwrap_err().status, 501);
        let h = head("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(body_kind(&h), Ok(BodyKind::Chunked));
    }

    #[test]
    fn head_limits() {
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.extend(vec![b'a'; HEAD_LIMIT]);
        assert_eq!(parse_head(&big).unwrap_err().status, 431);
        let mut many = String::from("GET / HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            many.push_str(&format!("h{i}: v\r\n"));
        }
        many.push_str("\r\n");
        assert_eq!(parse_head(many.as_bytes()).unwrap_err().status, 431);
    }

    #[test]
    fn chunked_decoding_byte_by_byte() {
        let raw = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\nNEXT";
        // All at once.
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        let used = d.feed(raw, &mut out).unwrap();
        assert!(d.is_done());
        assert_eq!(out, b"hello world");
        assert_eq!(&raw[used..], b"NEXT");
        // One byte at a time, as a caller with a growing buffer would.
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        let mut buf = Vec::new();
        for &b in raw.iter() {
            buf.push(b);
            let used = d.feed(&buf, &mut out).unwrap();
            buf.drain(..used);
            if d.is_done() {
                break;
            }
        }
        assert_eq!(out, b"hello world");
        assert!(buf.is_empty());
        let mut d = ChunkedDecoder::new();
        assert!(d.feed(b"zz\r\n", &mut Vec::new()).is_err());
        let mut d = ChunkedDecoder::new();
        assert!(d.feed(b"2\r\nabXY", &mut Vec::new()).is_err());
    }

    #[test]
    fn ascii_headers_json() {
        let h = head("GET / HTTP/1.1\r\nX-A: caf\u{e9}\r\nx-b: 1\r\n\r\n");
        let j = h.headers_json();
        assert!(j.is_ascii());
        let v: Vec<(String, String)> = serde_json::from_str(&j).unwrap();
        assert_eq!(v[0], ("X-A".into(), "caf\u{e9}".into()));
        assert_eq!(v[1], ("x-b".into(), "1".into()));
    }
}
