//! The body-log wire frame (notes-edges §3.4), big-endian, frames back to back on a stream:
//!
//! ```text
//! u32 total_len   bytes that follow (= 2 + meta_len + 4 + req_len + 4 + resp_len)
//! u16 meta_len    then meta_len bytes of meta JSON (UTF-8)
//! u32 req_len     then req_len bytes of request body
//! u32 resp_len    then resp_len bytes of response body
//! ```
//!
//! Pure: no IO. Unlike the reference, the encoder refuses a meta longer than the u16 field
//! instead of letting it wrap, and the decoder checks every length against the limits in
//! [`crate::bodylog`] and against `total_len` before it allocates anything, so garbage never
//! panics and never makes the reader buffer more than [`FRAME_MAX_BYTES`].

use super::{FRAME_MAX_BYTES, META_MAX_BYTES, REQ_BODY_MAX_BYTES, RESP_BODY_MAX_BYTES};

/// One logged request.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub meta: serde_json::Value,
    pub request: Vec<u8>,
    pub response: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// Meta JSON longer than 65,535 bytes (the u16 length); carries its length.
    MetaTooLarge(usize),
    /// Request body over [`REQ_BODY_MAX_BYTES`].
    RequestTooLarge(usize),
    /// Response body over [`RESP_BODY_MAX_BYTES`].
    ResponseTooLarge(usize),
    /// Meta could not be serialised (cannot happen for a `serde_json::Value`, kept total).
    Meta(String),
}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodeError::MetaTooLarge(n) => write!(f, "meta is {n} bytes, max {META_MAX_BYTES}"),
            EncodeError::RequestTooLarge(n) => {
                write!(f, "request body is {n} bytes, max {REQ_BODY_MAX_BYTES}")
            }
            EncodeError::ResponseTooLarge(n) => {
                write!(f, "response body is {n} bytes, max {RESP_BODY_MAX_BYTES}")
            }
            EncodeError::Meta(e) => write!(f, "meta: {e}"),
        }
    }
}

impl std::error::Error for EncodeError {}

/// A framing error: the stream cannot be resynchronised, so the reader closes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// `total_len` is 0, below the fixed 10 header bytes, or over [`FRAME_MAX_BYTES`].
    BadTotalLen(u32),
    /// A field length exceeds its limit or runs past `total_len`.
    BadFieldLen(&'static str, u32),
    /// `resp` does not end exactly at `total_len`.
    TrailingBytes(usize),
    /// Meta is not a JSON value.
    BadMeta(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::BadTotalLen(n) => write!(f, "bad total_len {n}"),
            DecodeError::BadFieldLen(field, n) => write!(f, "bad {field} length {n}"),
            DecodeError::TrailingBytes(n) => write!(f, "{n} bytes after resp inside the frame"),
            DecodeError::BadMeta(e) => write!(f, "meta is not JSON: {e}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Bytes of fixed fields inside `total_len`: meta_len (2) + req_len (4) + resp_len (4).
const FIXED_INNER: usize = 2 + 4 + 4;

/// Append one frame for `rec` to `out`. On error `out` is left as it was.
pub fn encode(rec: &Record, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let meta = serde_json::to_vec(&rec.meta).map_err(|e| EncodeError::Meta(e.to_string()))?;
    encode_parts(&meta, &rec.request, &rec.response, out)
}

/// [`encode`] with the meta already serialised.
pub fn encode_parts(
    meta: &[u8],
    request: &[u8],
    response: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if meta.len() > META_MAX_BYTES {
        return Err(EncodeError::MetaTooLarge(meta.len()));
    }
    if request.len() > REQ_BODY_MAX_BYTES {
        return Err(EncodeError::RequestTooLarge(request.len()));
    }
    if response.len() > RESP_BODY_MAX_BYTES {
        return Err(EncodeError::ResponseTooLarge(response.len()));
    }
    let total = FIXED_INNER + meta.len() + request.len() + response.len();
    // Bounded by FRAME_MAX_BYTES (< 4 GiB) through the checks above.
    out.reserve(4 + total);
    out.extend_from_slice(&(total as u32).to_be_bytes());
    out.extend_from_slice(&(meta.len() as u16).to_be_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(&(request.len() as u32).to_be_bytes());
    out.extend_from_slice(request);
    out.extend_from_slice(&(response.len() as u32).to_be_bytes());
    out.extend_from_slice(response);
    Ok(())
}

/// Validate the 4-byte prefix: how many bytes follow it. Lets a reader size its buffer
/// before reading the body of the frame.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, DecodeError> {
    let total = u32::from_be_bytes(prefix);
    let t = total as usize;
    if !(FIXED_INNER..=FRAME_MAX_BYTES).contains(&t) {
        return Err(DecodeError::BadTotalLen(total));
    }
    Ok(t)
}

/// Decode the frame at the start of `buf`. `Ok(None)`: the frame is not complete yet (read
/// more); `Ok(Some((rec, used)))`: `used` bytes were consumed; `Err`: the stream is corrupt.
pub fn decode(buf: &[u8]) -> Result<Option<(Record, usize)>, DecodeError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let total = frame_len([prefix[0], prefix[1], prefix[2], prefix[3]])?;
    let Some(body) = buf.get(4..4 + total) else {
        return Ok(None);
    };
    let mut cur = Cursor { buf: body, pos: 0 };
    let meta_len = cur.u16() as usize;
    let meta = cur.take("meta", meta_len as u32, META_MAX_BYTES)?;
    let req_len = cur.u32("req_len")?;
    let request = cur.take("req", req_len, REQ_BODY_MAX_BYTES)?;
    let resp_len = cur.u32("resp_len")?;
    let response = cur.take("resp", resp_len, RESP_BODY_MAX_BYTES)?;
    if cur.pos != body.len() {
        return Err(DecodeError::TrailingBytes(body.len() - cur.pos));
    }
    let meta = crate::util::json_value(meta).map_err(|e| DecodeError::BadMeta(e.to_string()))?;
    Ok(Some((
        Record {
            meta,
            request: request.to_vec(),
            response: response.to_vec(),
        },
        4 + total,
    )))
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// The first field: `total_len ≥ FIXED_INNER` guarantees two bytes.
    fn u16(&mut self) -> u16 {
        let v = u16::from_be_bytes([self.buf[0], self.buf[1]]);
        self.pos = 2;
        v
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        let b = self
            .buf
            .get(self.pos..self.pos + 4)
            .ok_or(DecodeError::BadFieldLen(field, 0))?;
        self.pos += 4;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn take(&mut self, field: &'static str, len: u32, max: usize) -> Result<&'a [u8], DecodeError> {
        let n = len as usize;
        if n > max {
            return Err(DecodeError::BadFieldLen(field, len));
        }
        let s = self
            .buf
            .get(self.pos..self.pos + n)
            .ok_or(DecodeError::BadFieldLen(field, len))?;
        self.pos += n;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(i: usize) -> Record {
        Record {
            meta: json!({"route": "r", "i": i, "status": 200}),
            request: format!("{{\"n\":{i}}}").into_bytes(),
            response: vec![b'x'; i],
        }
    }

    #[test]
    fn round_trip_and_back_to_back() {
        let mut buf = Vec::new();
        for i in 0..5 {
            encode(&rec(i), &mut buf).unwrap();
        }
        let empty = Record {
            meta: json!({}),
            request: vec![],
            response: vec![],
        };
        encode(&empty, &mut buf).unwrap();
        let mut off = 0;
        for i in 0..5 {
            let (r, used) = decode(&buf[off..]).unwrap().unwrap();
            assert_eq!(r, rec(i));
            off += used;
        }
        let (r, used) = decode(&buf[off..]).unwrap().unwrap();
        assert_eq!(r, empty);
        assert_eq!(off + used, buf.len());
        assert_eq!(decode(&buf[buf.len()..]).unwrap(), None);
    }

    #[test]
    fn layout_is_big_endian_as_documented() {
        let mut buf = Vec::new();
        let r = Record {
            meta: json!(1),
            request: b"ab".to_vec(),
            response: b"xyz".to_vec(),
        };
        encode(&r, &mut buf).unwrap();
        let expected: Vec<u8> = [
            &[0, 0, 0, 16][..],
            &[0, 1],
            b"1",
            &[0, 0, 0, 2],
            b"ab",
            &[0, 0, 0, 3],
            b"xyz",
        ]
        .concat();
        assert_eq!(buf, expected);
    }

    #[test]
    fn truncated_frame_needs_more() {
        let mut buf = Vec::new();
        encode(&rec(40), &mut buf).unwrap();
        for cut in 0..buf.len() {
            assert_eq!(decode(&buf[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert!(decode(&buf).unwrap().is_some());
    }

    #[test]
    fn oversize_meta_is_refused_not_wrapped() {
        let big = "h".repeat(70_000);
        let r = Record {
            meta: json!({ "req_headers": { "x": big } }),
            request: vec![],
            response: vec![],
        };
        let mut out = vec![9];
        assert!(matches!(
            encode(&r, &mut out),
            Err(EncodeError::MetaTooLarge(n)) if n > 65_535
        ));
        assert_eq!(out, vec![9], "nothing appended on error");
        // A control: the same shape under the limit encodes.
        let ok = Record {
            meta: json!({ "req_headers": { "x": "h".repeat(60_000) } }),
            request: vec![],
            response: vec![],
        };
        assert!(encode(&ok, &mut out).is_ok());
    }

    #[test]
    fn oversize_bodies_are_refused() {
        let mut out = Vec::new();
        let r = Record {
            meta: json!({}),
            request: vec![0; REQ_BODY_MAX_BYTES + 1],
            response: vec![],
        };
        assert!(matches!(
            encode(&r, &mut out),
            Err(EncodeError::RequestTooLarge(_))
        ));
        let r = Record {
            meta: json!({}),
            request: vec![],
            response: vec![0; RESP_BODY_MAX_BYTES + 1],
        };
        assert!(matches!(
            encode(&r, &mut out),
            Err(EncodeError::ResponseTooLarge(_))
        ));
    }

    #[test]
    fn bad_lengths_are_errors() {
        // total_len 0, too small, too large.
        for total in [0u32, 9, (FRAME_MAX_BYTES + 1) as u32, u32::MAX] {
            let mut b = total.to_be_bytes().to_vec();
            b.extend_from_slice(&[0; 16]);
            assert_eq!(decode(&b), Err(DecodeError::BadTotalLen(total)));
        }
        // meta_len pointing past the frame.
        let mut good = Vec::new();
        encode(&rec(3), &mut good).unwrap();
        let mut b = good.clone();
        b[4] = 0xff;
        b[5] = 0xff;
        assert!(matches!(
            decode(&b),
            Err(DecodeError::BadFieldLen("meta", _))
        ));
        // req_len past the frame.
        let meta_len = u16::from_be_bytes([good[4], good[5]]) as usize;
        let mut b = good.clone();
        b[6 + meta_len..10 + meta_len].copy_from_slice(&1000u32.to_be_bytes());
        assert!(matches!(
            decode(&b),
            Err(DecodeError::BadFieldLen("req", _))
        ));
        // req_len over its limit even though total_len is large enough to be plausible.
        let mut b = good.clone();
        b[6 + meta_len..10 + meta_len]
            .copy_from_slice(&((REQ_BODY_MAX_BYTES + 1) as u32).to_be_bytes());
        assert!(matches!(
            decode(&b),
            Err(DecodeError::BadFieldLen("req", _))
        ));
        // Frame longer than its fields: trailing bytes.
        let mut b = good.clone();
        let total = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) + 2;
        b[..4].copy_from_slice(&total.to_be_bytes());
        b.extend_from_slice(b"zz");
        assert_eq!(decode(&b), Err(DecodeError::TrailingBytes(2)));
        // Meta that is not JSON.
        let mut b = Vec::new();
        encode_parts(b"{not json", b"", b"", &mut b).unwrap();
        assert!(matches!(decode(&b), Err(DecodeError::BadMeta(_))));
    }

    /// xorshift64*: a replayable stream for the mutation test.
    fn next(s: &mut u64) -> u64 {
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    #[test]
    fn mutated_frames_never_panic() {
        let seed = 0x5eed_b0d1_u64;
        let mut s = seed;
        let mut base = Vec::new();
        for i in 0..4 {
            encode(&rec(i * 7), &mut base).unwrap();
        }
        let (mut ok, mut err, mut more) = (0, 0, 0);
        for _ in 0..20_000 {
            let mut b = base.clone();
            let flips = 1 + next(&mut s) % 4;
            for _ in 0..flips {
                let at = (next(&mut s) as usize) % b.len();
                // Bias toward the length fields, where the interesting bugs live.
                let v = next(&mut s);
                b[at] = match v % 3 {
                    0 => 0xff,
                    1 => 0,
                    _ => v as u8,
                };
            }
            let cut = (next(&mut s) as usize) % (b.len() + 1);
            let mut off = 0;
            loop {
                match decode(&b[off..cut]) {
                    Ok(Some((_, used))) => {
                        assert!(used > 0 && off + used <= cut, "seed {seed:#x}");
                        off += used;
                        ok += 1;
                    }
                    Ok(None) => {
                        more += 1;
                        break;
                    }
                    Err(_) => {
                        err += 1;
                        break;
                    }
                }
            }
        }
        assert!(ok > 0 && err > 0 && more > 0, "{ok} {err} {more}");
    }
}
