//! Incremental decoder for `Transfer-Encoding: chunked` (RFC 9112 §7.1).
//!
//! Fed arbitrary slices of the wire, it hands out the data bytes and says where the
//! message ends. Extensions and well-formed trailers are accepted and discarded. Used both to read
//! request bodies into memory and to find the end of a chunked response that is relayed
//! to the client byte for byte.

use crate::limits::{CHUNK_LINE_BYTES_MAX, CHUNK_TRAILER_BYTES_MAX};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkError {
    /// A size line that is not hex, too long, or overflows u64.
    BadSize,
    /// Missing CRLF after a chunk's data or a line.
    BadDelimiter,
    /// Trailers beyond the limit.
    TrailersTooLarge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading hex digits of a size line.
    Size {
        digits: u8,
    },
    /// After the digits: optional whitespace, then `;` (extensions) or the CR. `ext`: a `;`
    /// was seen, and the rest of the line is extensions.
    SizeRest {
        ext: bool,
    },
    /// Expecting LF after the size line's CR.
    SizeLf,
    /// `n` data bytes remain in this chunk.
    Data(u64),
    DataCr,
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    /// Inside a trailer line; `colon`: its name has ended.
    Trailer {
        colon: bool,
    },
    TrailerLf {
        empty: bool,
    },
    Done,
}

/// Decoder state; `Default` starts before the first size line.
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
    size: u64,
    line_bytes: usize,
    trailer_bytes: usize,
    /// How many bytes of the last `feed`'s input end with a complete chunk (0: none did).
    boundary: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder {
            state: State::Size { digits: 0 },
            size: 0,
            line_bytes: 0,
            trailer_bytes: 0,
            boundary: 0,
        }
    }
}

fn hex(b: u8) -> Option<u64> {
    match b {
        b'0'..=b'9' => Some((b - b'0') as u64),
        b'a'..=b'f' => Some((b - b'a' + 10) as u64),
        b'A'..=b'F' => Some((b - b'A' + 10) as u64),
        _ => None,
    }
}

impl ChunkedDecoder {
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// How many bytes of the last [`feed`](Self::feed)'s input end with a complete chunk:
    /// after a framing error, the part of that input a relay can pass on as it is.
    pub fn boundary(&self) -> usize {
        self.boundary
    }

    /// Consume bytes from `input`, passing each run of body data to `data`. Returns how
    /// many bytes of `input` belong to this message (less than `input.len()` only when the
    /// message ended inside it).
    pub fn feed(
        &mut self,
        input: &[u8],
        data: &mut impl FnMut(&[u8]),
    ) -> Result<usize, ChunkError> {
        let mut i = 0;
        self.boundary = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                State::Size { digits } => {
                    if let Some(v) = hex(b) {
                        if digits >= 16 {
                            return Err(ChunkError::BadSize);
                        }
                        self.size = (self.size << 4) | v;
                        self.state = State::Size { digits: digits + 1 };
                        self.line_bytes += 1;
                    } else if digits == 0 {
                        return Err(ChunkError::BadSize);
                    } else if b == b'\r' {
                        self.state = State::SizeLf;
                    } else if b == b'\n' {
                        return Err(ChunkError::BadDelimiter);
                    } else if b == b';' || b == b' ' || b == b'\t' {
                        self.state = State::SizeRest { ext: b == b';' };
                        self.line_bytes += 1;
                    } else {
                        return Err(ChunkError::BadSize);
                    }
                    i += 1;
                }
                State::SizeRest { ext } => {
                    if b == b'\r' {
                        self.state = State::SizeLf;
                    } else if b == b'\n' {
                        return Err(ChunkError::BadDelimiter);
                    } else if !ext && b != b' ' && b != b'\t' && b != b';' {
                        // RFC 9112 §7.1: after the size only whitespace and extensions.
                        // `5 5` or `5 junk` read as 5 here and as something else by
                        // another parser of the same stream is how requests get smuggled.
                        return Err(ChunkError::BadSize);
                    } else if (b < 0x20 && b != b'\t') || b == 0x7f {
                        // Control bytes in an extension: tokens and quoted strings have none.
                        return Err(ChunkError::BadSize);
                    } else {
                        if b == b';' {
                            self.state = State::SizeRest { ext: true };
                        }
                        self.line_bytes += 1;
                        if self.line_bytes > CHUNK_LINE_BYTES_MAX {
                            return Err(ChunkError::BadSize);
                        }
                    }
                    i += 1;
                }
                State::SizeLf => {
                    if b != b'\n' {
                        return Err(ChunkError::BadDelimiter);
                    }
                    i += 1;
                    self.line_bytes = 0;
                    self.state = if self.size == 0 {
                        State::TrailerStart
                    } else {
                        State::Data(self.size)
                    };
                    self.size = 0;
                }
                State::Data(rem) => {
                    let avail = (input.len() - i) as u64;
                    let take = rem.min(avail) as usize;
                    data(&input[i..i + take]);
                    i += take;
                    let left = rem - take as u64;
                    self.state = if left == 0 {
                        State::DataCr
                    } else {
                        State::Data(left)
                    };
                }
                State::DataCr => {
                    if b != b'\r' {
                        return Err(ChunkError::BadDelimiter);
                    }
                    i += 1;
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkError::BadDelimiter);
                    }
                    i += 1;
                    self.boundary = i;
                    self.state = State::Size { digits: 0 };
                }
                // A trailer line is `name: value` CRLF (RFC 9112 §7.1.2). A bare LF, a line
                // without a name or a colon, or one that starts with whitespace (obs-fold)
                // is refused: a decoder that read past it while another hop took the LF as
                // a line end would disagree on where the message ends.
                State::TrailerStart => {
                    i += 1;
                    match b {
                        b'\r' => self.state = State::TrailerLf { empty: true },
                        b'\n' | b':' | b' ' | b'\t' => return Err(ChunkError::BadDelimiter),
                        _ => {
                            self.bump_trailer()?;
                            self.state = State::Trailer { colon: false };
                        }
                    }
                }
                State::Trailer { colon } => {
                    i += 1;
                    match b {
                        b'\r' if colon => self.state = State::TrailerLf { empty: false },
                        b'\r' | b'\n' => return Err(ChunkError::BadDelimiter),
                        _ => {
                            self.bump_trailer()?;
                            if b == b':' {
                                self.state = State::Trailer { colon: true };
                            }
                        }
                    }
                }
                State::TrailerLf { empty } => {
                    if b != b'\n' {
                        return Err(ChunkError::BadDelimiter);
                    }
                    i += 1;
                    if empty {
                        self.state = State::Done;
                        return Ok(i);
                    }
                    self.state = State::TrailerStart;
                }
                State::Done => return Ok(i),
            }
        }
        Ok(i)
    }

    fn bump_trailer(&mut self) -> Result<(), ChunkError> {
        self.trailer_bytes += 1;
        if self.trailer_bytes > CHUNK_TRAILER_BYTES_MAX {
            return Err(ChunkError::TrailersTooLarge);
        }
        Ok(())
    }
}

/// Encode `data` as one chunk into `out`.
pub fn encode_chunk(data: &[u8], out: &mut Vec<u8>) {
    // The size in lowercase hex, without the formatting machinery (one chunk per event).
    let mut hex = [0u8; 16];
    let mut n = data.len();
    let mut i = hex.len();
    loop {
        i -= 1;
        hex[i] = b"0123456789abcdef"[n & 0xf];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.reserve(hex.len() - i + data.len() + 4);
    out.extend_from_slice(&hex[i..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(wire: &[u8], step: usize) -> Result<(Vec<u8>, usize, bool), ChunkError> {
        let mut d = ChunkedDecoder::default();
        let mut out = Vec::new();
        let mut used = 0;
        for piece in wire.chunks(step.max(1)) {
            let n = d.feed(piece, &mut |b| out.extend_from_slice(b))?;
            used += n;
            if d.is_done() {
                break;
            }
        }
        Ok((out, used, d.is_done()))
    }

    #[test]
    fn decodes_across_every_split() {
        let wire = b"5;name=val\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT";
        for step in 1..wire.len() {
            let (out, used, done) = decode_all(wire, step).unwrap();
            assert_eq!(out, b"hello world", "step {step}");
            assert!(done);
            assert_eq!(used, wire.len() - 4, "step {step}");
        }
    }

    #[test]
    fn empty_body_and_uppercase_hex() {
        let (out, used, done) = decode_all(b"0\r\n\r\n", 100).unwrap();
        assert!(out.is_empty() && done && used == 5);
        let (out, _, done) = decode_all(b"A\r\n0123456789\r\n0\r\n\r\n", 3).unwrap();
        assert_eq!(out, b"0123456789");
        assert!(done);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(decode_all(b"zz\r\n", 10).unwrap_err(), ChunkError::BadSize);
        assert_eq!(decode_all(b"\r\n", 10).unwrap_err(), ChunkError::BadSize);
        assert_eq!(
            decode_all(b"3\r\nabcX", 10).unwrap_err(),
            ChunkError::BadDelimiter
        );
        assert_eq!(
            decode_all(b"3\nabc", 10).unwrap_err(),
            ChunkError::BadDelimiter
        );
        assert_eq!(
            decode_all(b"11111111111111111\r\n", 10).unwrap_err(),
            ChunkError::BadSize
        );
        let mut big = b"0\r\n".to_vec();
        big.extend(std::iter::repeat_n(b'a', CHUNK_TRAILER_BYTES_MAX + 1));
        assert_eq!(
            decode_all(&big, 1000).unwrap_err(),
            ChunkError::TrailersTooLarge
        );
    }

    /// After a chunk's size, only whitespace and `;` extensions: the size line's tail was
    /// skipped whatever it held, so `5 5` and `5 junk` read as a 5-byte chunk. The control:
    /// the lines RFC 9112 allows (and a trailing blank, as other servers accept) still read.
    #[test]
    fn a_size_line_holds_only_whitespace_and_extensions_after_the_size() {
        let wire = |line: &[u8]| [line, b"\r\nhello\r\n0\r\n\r\n"].concat();
        for line in [
            &b"5 5"[..],
            b"5 junk",
            b"5\t\x01\x7f;;",
            b"5;a=\x01",
            b"5 ;a\x7f",
        ] {
            for step in [1, 3, 100] {
                assert_eq!(
                    decode_all(&wire(line), step).unwrap_err(),
                    ChunkError::BadSize,
                    "{line:?}"
                );
            }
        }
        for line in [
            &b"5"[..],
            b"5 ",
            b"5\t ",
            b"5;a",
            b"5 ; a = 1",
            b"5;a=\"b c\";d",
            b"5;name=\xc3\xa9",
        ] {
            let wire = wire(line);
            for step in [1, 3, 100] {
                let (data, used, done) = decode_all(&wire, step).expect("a valid size line");
                assert_eq!(
                    (&data[..], used, done),
                    (&b"hello"[..], wire.len(), true),
                    "{line:?}"
                );
            }
        }
    }

    #[test]
    fn trailer_lines_must_be_name_colon_value_crlf() {
        // Each of these used to be read as a trailer line, so the decoder went on past the
        // message's end into whatever came next (a pipelined request, the next response).
        for wire in [
            &b"0\r\nX-T: 1\n\r\nGET /next HTTP/1.1\r\nHost: t\r\n\r\n"[..],
            b"0\r\n\nGET /next HTTP/1.1\r\nHost: t\r\n\r\n",
            b"0\r\nno colon here\r\n\r\n",
            b"0\r\n: no name\r\n\r\n",
            b"0\r\nX-T: 1\r\n folded\r\n\r\n",
            b"0\r\n\tX-T: 1\r\n\r\n",
        ] {
            for step in 1..=wire.len() {
                assert_eq!(
                    decode_all(wire, step).unwrap_err(),
                    ChunkError::BadDelimiter,
                    "{:?} in pieces of {step}",
                    String::from_utf8_lossy(wire)
                );
            }
        }
        // Control: well-formed trailers, an empty value and a colon in a value end the
        // message where they should.
        let wire = b"3\r\nabc\r\n0\r\nX-A: 1\r\nX-Empty:\r\nX-Url: http://h:1/p\r\n\r\nNEXT";
        for step in 1..wire.len() {
            let (out, used, done) = decode_all(wire, step).unwrap();
            assert_eq!((out.as_slice(), done), (&b"abc"[..], true), "step {step}");
            assert_eq!(used, wire.len() - 4, "step {step}");
        }
    }

    #[test]
    fn incomplete_is_not_done() {
        let (out, used, done) = decode_all(b"5\r\nhel", 2).unwrap();
        assert_eq!(out, b"hel");
        assert_eq!(used, 6);
        assert!(!done);
    }

    #[test]
    fn encode_roundtrip() {
        let mut wire = Vec::new();
        encode_chunk(b"abc", &mut wire);
        encode_chunk(&[7u8; 300], &mut wire);
        wire.extend_from_slice(b"0\r\n\r\n");
        let (out, _, done) = decode_all(&wire, 7).unwrap();
        assert!(done);
        assert_eq!(out.len(), 303);
        // The size line is the length in lowercase hex, as `format!` would write it.
        for n in [0usize, 1, 9, 10, 15, 16, 255, 256, 4095, 65536, 1 << 20] {
            let mut w = Vec::new();
            encode_chunk(&vec![b'x'; n], &mut w);
            let head = format!("{n:x}\r\n");
            assert!(w.starts_with(head.as_bytes()), "{n}");
            assert_eq!(w.len(), head.len() + n + 2, "{n}");
            assert!(w.ends_with(b"\r\n"));
        }
    }
}
