//! Byte searches eight bytes at a time, for the scans that run over every response: the
//! SSE filter's line ends, the usage probe's strings and its backward search for `"usage"`.
//! A byte-by-byte loop was the largest cost of each.

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;
const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;

/// The first eight bytes of `c` as a little-endian word (byte 0 lowest).
#[inline(always)]
pub fn word(c: &[u8]) -> u64 {
    u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
}

/// 0x80 in exactly the bytes of `w` that are zero (no false flags, unlike the cheaper
/// borrow test), so the highest flag is also the last zero byte.
fn zero_bytes(w: u64) -> u64 {
    !(((w & LOW7).wrapping_add(LOW7)) | w | LOW7)
}

/// Index of the first byte of `hay` that `is` accepts, eight bytes at a time: `flags` sets
/// bit 7 of every accepted byte of a word (it may also flag bytes above an accepted one,
/// never below, so the lowest flag is the first); `is` decides the last few bytes.
#[inline(always)]
pub fn first_flagged(
    hay: &[u8],
    flags: impl Fn(u64) -> u64,
    is: impl Fn(u8) -> bool,
) -> Option<usize> {
    let mut chunks = hay.chunks_exact(8);
    let mut base = 0;
    for c in &mut chunks {
        let hit = flags(word(c));
        if hit != 0 {
            return Some(base + (hit.trailing_zeros() / 8) as usize);
        }
        base += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&c| is(c))
        .map(|p| base + p)
}

/// Index of the first `a` or `b` in `hay`.
pub fn find_either(hay: &[u8], a: u8, b: u8) -> Option<usize> {
    let (wa, wb) = (LO * u64::from(a), LO * u64::from(b));
    let flags = |w: u64| {
        let (x, y) = (w ^ wa, w ^ wb);
        // The borrow test: flags every zero byte of `x` or `y`, and possibly bytes above.
        ((x.wrapping_sub(LO) & !x) | (y.wrapping_sub(LO) & !y)) & HI
    };
    first_flagged(hay, flags, |c| c == a || c == b)
}

/// Index of the last `c` in `hay`.
pub fn rfind(hay: &[u8], c: u8) -> Option<usize> {
    let wc = LO * u64::from(c);
    let mut chunks = hay.rchunks_exact(8);
    let mut end = hay.len();
    for ch in &mut chunks {
        end -= 8;
        let hit = zero_bytes(word(ch) ^ wc);
        if hit != 0 {
            return Some(end + 7 - (hit.leading_zeros() / 8) as usize);
        }
    }
    chunks.remainder().iter().rposition(|&x| x == c)
}

/// `s` split around its first `c`, an ASCII byte (so both sides are on character
/// boundaries). For the short request targets the per-request paths split, a plain byte
/// loop: `str::split_once(char)` goes through the general searcher, several times dearer.
pub fn split_once_ascii(s: &str, c: u8) -> Option<(&str, &str)> {
    debug_assert!(c.is_ascii());
    let i = s.bytes().position(|b| b == c)?;
    Some((&s[..i], &s[i + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::XorShift;

    #[test]
    fn searches_agree_with_byte_loops() {
        let mut rng = XorShift::new(5);
        // A small alphabet so matches are common, at every offset and length.
        const ALPHABET: &[u8] = b"\"\\\n\r\x00\x01\x80\xffab";
        for len in 0..80 {
            for _ in 0..200 {
                let hay: Vec<u8> = (0..len)
                    .map(|_| ALPHABET[rng.below(ALPHABET.len())])
                    .collect();
                for (a, b) in [(b'"', b'\\'), (b'\n', b'\r'), (0, 0x80), (0xff, 0x01)] {
                    let want = hay.iter().position(|&c| c == a || c == b);
                    assert_eq!(find_either(&hay, a, b), want, "{hay:?} {a} {b}");
                    assert_eq!(rfind(&hay, a), hay.iter().rposition(|&c| c == a), "{hay:?}");
                }
            }
        }
    }

    #[test]
    fn split_once_ascii_agrees_with_str_split_once() {
        for s in [
            "",
            "?",
            "/a?b",
            "/a",
            "a?b?c",
            "/é/x?q=ü",
            "??",
            "/v1/chat/completions?x=1",
        ] {
            for c in [b'?', b'/'] {
                assert_eq!(split_once_ascii(s, c), s.split_once(c as char), "{s:?} {c}");
            }
        }
    }
}
