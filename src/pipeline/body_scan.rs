//! The fast path of [`parse_body`](super::session_id::parse_body): one pass over the bytes
//! of a common request body, no serde, no allocation, no recursion when skipping values.
//!
//! [`scan`] builds the same intermediate `TopObj` the serde path builds — strings borrowed
//! from the body, booleans, `Other` for null and arrays, ignored objects where a scalar was
//! expected — so `TopObj::reduce` is shared and the two paths cannot drift apart in what
//! they make of a value. The contract: whenever [`scan`] returns `Some`, serde reads the
//! same bytes to the same result (and the scan also tells whether a string starts with the
//! billing prefix, which serde does not look for). Anything unusual returns `None` and the
//! body goes to serde: not an object, an escape in a key or in a string that is read, a
//! read string that is not UTF-8 or a key serde checks that is not ASCII (see [`Cursor`]),
//! a number where a value is read (its decimal form is serde's business), skipped values
//! nested deeper than [`SKIP_DEPTH_MAX`], and every grammar error (serde then rejects the
//! body itself). Declining is always safe; it only costs the serde pass.
//!
//! Its cost is in the strings it skips: the prompt. The string skip classifies 64 bytes at a
//! time with SSE2 on x86_64 and finds the block's escapes without a branch per escape
//! ([`string_end`]). On the bench's 51.5 KB prompt body (40 turns of code and prose, an
//! escape every ~27 bytes) its 40 message contents took 22% less time than with 32-byte blocks
//! and a branch per escape (median of 6 alternating rounds of 2,000 bodies; about the same
//! instruction count, fewer mispredicted branches); `parse_body` runs about 107k instructions
//! on that body (callgrind) and 2.1k on the 156-byte bench body.

use std::borrow::Cow;

use serde::de::IgnoredAny;

use crate::bytescan::{first_flagged, word};
use crate::transform::CCH_MARKER;

use super::session_id::{Json, Key, MetadataObj, Scalar, SessionIdObj, StreamOptionsObj, TopObj};

/// Containers open at once inside a skipped value beyond which the body goes to serde.
const SKIP_DEPTH_MAX: u32 = 64;

/// The top-level object of `body`, or `None` when serde must decide.
pub(super) fn scan(body: &[u8]) -> Option<TopObj<'_>> {
    let mut c = Cursor {
        bytes: body,
        pos: 0,
        billing_prefix: false,
    };
    if c.token()? != b'{' {
        return None;
    }
    let mut top = TopObj::default();
    c.top_obj(&mut top)?;
    top.billing_prefix = Some(c.billing_prefix);
    // Nothing but whitespace may follow.
    c.token().is_none().then_some(top)
}

/// The object keys the parsed objects look at, by name (unescaped); every other name is
/// `Other`.
#[inline(always)]
fn key(name: &[u8]) -> Key {
    match name {
        b"model" => Key::Model,
        b"stream" => Key::Stream,
        b"stream_options" => Key::StreamOptions,
        b"include_usage" => Key::IncludeUsage,
        b"metadata" => Key::Metadata,
        b"litellm_metadata" => Key::LitellmMetadata,
        b"session_id" => Key::SessionId,
        b"user_id" => Key::UserId,
        b"user" => Key::User,
        _ => Key::Other,
    }
}

/// A read position in a body. The grammar is read token by token: each step takes the
/// first byte of the next token, already consumed.
///
/// UTF-8 is checked where serde_json checks it, not over the whole body: in the strings
/// that are read, and in the keys of every object serde visits (the objects that are read,
/// and the objects it skips with `IgnoredAny::visit_map` where a value is read). It does
/// not check the strings it skips (`ignore_str`), which in a chat request are nearly all of
/// the bytes; a whole-body check cost a quarter of the scan. Outside strings every byte of
/// the grammar is ASCII, so anything else there is a grammar error on both paths.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// A skipped string started with [`CCH_MARKER`] (every string value the router does
    /// not read is skipped, so this answers for all the values a transform could edit).
    billing_prefix: bool,
}

impl<'a> Cursor<'a> {
    /// The next byte that is not JSON whitespace (space, tab, LF, CR), consumed; `None` at
    /// the end.
    #[inline]
    fn token(&mut self) -> Option<u8> {
        loop {
            let b = *self.bytes.get(self.pos)?;
            self.pos += 1;
            if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(b);
            }
        }
    }

    /// The bytes from the read position on.
    fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.pos..).unwrap_or_default()
    }

    // -- Objects that are read ----------------------------------------------------------

    /// The members of an object whose `{` was just consumed, up to and including its `}`.
    /// `member` gets each key and the first byte of its value, and must consume the rest.
    fn members(&mut self, mut member: impl FnMut(&mut Self, Key, u8) -> Option<()>) -> Option<()> {
        let mut t = self.token()?;
        if t == b'}' {
            return Some(());
        }
        loop {
            if t != b'"' {
                return None;
            }
            let k = key(self.checked_key()?);
            if self.token()? != b':' {
                return None;
            }
            let first = self.token()?;
            member(self, k, first)?;
            match self.token()? {
                b',' => t = self.token()?,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// The top-level object into `o`, its `{` consumed.
    fn top_obj(&mut self, o: &mut TopObj<'a>) -> Option<()> {
        self.members(|c, k, first| {
            match k {
                Key::Model => o.model = Some(c.scalar(first)?),
                Key::Stream => o.stream = Some(c.scalar(first)?),
                Key::StreamOptions => {
                    o.stream_options = Some(c.value(first, Self::stream_options_obj)?);
                }
                Key::Metadata => o.metadata = Some(c.value(first, Self::metadata_obj)?),
                Key::LitellmMetadata => {
                    o.litellm_metadata = Some(c.value(first, Self::metadata_obj)?);
                }
                Key::User => o.user = Some(c.scalar(first)?),
                _ => c.skip_value(first)?,
            }
            Some(())
        })
    }

    /// `stream_options`, its `{` consumed.
    fn stream_options_obj(&mut self) -> Option<StreamOptionsObj> {
        let mut o = StreamOptionsObj::default();
        self.members(|c, k, first| {
            if k == Key::IncludeUsage {
                o.include_usage = match c.scalar(first)? {
                    Json::Bool(b) => Some(b),
                    _ => None,
                };
            } else {
                c.skip_value(first)?;
            }
            Some(())
        })?;
        Some(o)
    }

    /// `metadata` or `litellm_metadata`, its `{` consumed.
    fn metadata_obj(&mut self) -> Option<MetadataObj<'a>> {
        let mut o = MetadataObj::default();
        self.members(|c, k, first| {
            match k {
                Key::SessionId => o.session_id = Some(c.scalar(first)?),
                Key::UserId => o.user_id = Some(c.value(first, Self::session_id_obj)?),
                _ => c.skip_value(first)?,
            }
            Some(())
        })?;
        Some(o)
    }

    /// An object read only for its `session_id` (`metadata.user_id`), its `{` consumed.
    fn session_id_obj(&mut self) -> Option<SessionIdObj<'a>> {
        let mut o = SessionIdObj::default();
        self.members(|c, k, first| {
            if k == Key::SessionId {
                o.session_id = Some(c.scalar(first)?);
            } else {
                c.skip_value(first)?;
            }
            Some(())
        })?;
        Some(o)
    }

    // -- Values that are read -----------------------------------------------------------

    /// A value as serde's `Json<O>` reads it, from its first byte `first` (consumed);
    /// objects are parsed by `object` once their `{` is consumed. Numbers (and anything
    /// that is not a value) return `None`.
    fn value<O>(
        &mut self,
        first: u8,
        object: impl FnOnce(&mut Self) -> Option<O>,
    ) -> Option<Json<'a, O>> {
        let v = match first {
            b'"' => Json::Str(Cow::Borrowed(self.plain_str()?)),
            b't' => self.literal(b"rue", Json::Bool(true))?,
            b'f' => self.literal(b"alse", Json::Bool(false))?,
            b'n' => self.literal(b"ull", Json::Other)?,
            b'[' => {
                self.skip_container(b'[')?;
                Json::Other
            }
            b'{' => Json::Object(object(self)?),
            _ => return None,
        };
        Some(v)
    }

    /// A value whose objects are skipped (`Scalar`), from its first byte (consumed).
    /// serde visits such an object's members (their keys are read as strings and checked),
    /// so its own keys are checked here too.
    fn scalar(&mut self, first: u8) -> Option<Scalar<'a>> {
        self.value(first, |c| {
            c.skip_container_checking(b'{', true).map(|()| IgnoredAny)
        })
    }

    /// The rest of a literal whose first byte was just consumed, as `v`.
    fn literal<T>(&mut self, tail: &[u8], v: T) -> Option<T> {
        self.rest().starts_with(tail).then(|| {
            self.pos += tail.len();
            v
        })
    }

    /// The contents of a string whose `"` was just consumed, when it holds no escape and
    /// is UTF-8 (serde rejects the body otherwise), borrowed from the body; its closing `"`
    /// consumed.
    fn plain_str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.plain_bytes()?).ok()
    }

    /// A key of an object serde visits, whose `"` was just consumed: [`Self::plain_bytes`],
    /// declined unless ASCII (serde would check its UTF-8, and no key the router reads has
    /// anything else: such a body is left to serde).
    #[inline(always)]
    fn checked_key(&mut self) -> Option<&'a [u8]> {
        self.plain_bytes().filter(|k| k.is_ascii())
    }

    /// [`Self::plain_str`] as bytes, unchecked, for keys: they are only compared.
    #[inline(always)]
    fn plain_bytes(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        let end = string_special(self.bytes, start)?;
        if *self.bytes.get(end)? != b'"' {
            return None;
        }
        self.pos = end + 1;
        self.bytes.get(start..end)
    }

    // -- Values that are skipped --------------------------------------------------------

    /// Skips one value of any kind from its first byte (consumed), checking its grammar.
    fn skip_value(&mut self, first: u8) -> Option<()> {
        match first {
            b'{' | b'[' => self.skip_container(first),
            b => self.skip_scalar(b),
        }
    }

    /// Skips a string, number or literal whose first byte `first` was just consumed.
    fn skip_scalar(&mut self, first: u8) -> Option<()> {
        match first {
            b'"' => self.skip_str(),
            b't' => self.literal(b"rue", ()),
            b'f' => self.literal(b"alse", ()),
            b'n' => self.literal(b"ull", ()),
            b'-' | b'0'..=b'9' => self.skip_number(first),
            _ => None,
        }
    }

    /// Skips the rest of a container whose opening byte `open` was just consumed, up to
    /// and including its closing byte. Iterative: the open containers live in a [`Nest`].
    fn skip_container(&mut self, open: u8) -> Option<()> {
        self.skip_container_checking(open, false)
    }

    /// [`Self::skip_container`]; with `own_keys`, the keys of the container itself (an
    /// object) are checked as serde checks them, those of containers inside it are not.
    fn skip_container_checking(&mut self, open: u8, own_keys: bool) -> Option<()> {
        let mut nest = Nest::new(open);
        let mut first = true;
        loop {
            let mut t = self.token()?;
            if first && t == nest.close {
                if !nest.pop() {
                    return Some(());
                }
            } else {
                if nest.in_object() {
                    if t != b'"' {
                        return None;
                    }
                    if own_keys && nest.depth == 1 {
                        self.checked_key()?;
                    } else {
                        self.plain_bytes()?;
                    }
                    if self.token()? != b':' {
                        return None;
                    }
                    t = self.token()?;
                }
                if let b'{' | b'[' = t {
                    nest.push(t)?;
                    first = true;
                    continue;
                }
                self.skip_scalar(t)?;
            }
            // A value ended: a comma leads to the next one, closes end containers.
            loop {
                match self.token()? {
                    b',' => break,
                    b if b == nest.close => {
                        if !nest.pop() {
                            return Some(());
                        }
                    }
                    _ => return None,
                }
            }
            first = false;
        }
    }

    /// Skips the rest of a string whose `"` was just consumed; escapes are checked, and the
    /// start is compared with the billing prefix.
    fn skip_str(&mut self) -> Option<()> {
        let rest = self.rest();
        self.billing_prefix |= rest.first() == Some(&CCH_MARKER[0]) && rest.starts_with(CCH_MARKER);
        self.pos = string_end(self.bytes, self.pos)?;
        Some(())
    }

    /// Skips the rest of a number whose first byte `first` was just consumed:
    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`. Grammar only, no range.
    fn skip_number(&mut self, first: u8) -> Option<()> {
        let lead = if first == b'-' {
            let b = *self.bytes.get(self.pos)?;
            self.pos += 1;
            b
        } else {
            first
        };
        match lead {
            b'0' => {}
            b'1'..=b'9' => self.skip_digits(),
            _ => return None,
        }
        match self.bytes.get(self.pos) {
            Some(b'.' | b'e' | b'E') => self.skip_fraction_exponent(),
            _ => Some(()),
        }
    }

    /// Skips a number's optional `\.[0-9]+` and `[eE][+-]?[0-9]+` parts.
    fn skip_fraction_exponent(&mut self) -> Option<()> {
        if self.eat(b'.') {
            self.digits()?;
        }
        if self.eat(b'e') || self.eat(b'E') {
            let _ = self.eat(b'+') || self.eat(b'-');
            self.digits()?;
        }
        Some(())
    }

    /// Consumes `b` when it is next (no whitespace skipped).
    fn eat(&mut self, b: u8) -> bool {
        let hit = self.bytes.get(self.pos) == Some(&b);
        self.pos += usize::from(hit);
        hit
    }

    /// Skips one or more digits.
    fn digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.skip_digits();
        (self.pos > start).then_some(())
    }

    /// Skips any digits.
    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }
}

/// The containers open inside a skipped value: how many, a bit per level (set for an
/// object, clear for an array, so that a `]` cannot close a `{`), and the byte that closes
/// the innermost.
struct Nest {
    objects: u64,
    depth: u32,
    close: u8,
}

impl Nest {
    /// One open container.
    fn new(open: u8) -> Self {
        Nest {
            objects: u64::from(open == b'{'),
            depth: 1,
            close: closer(open),
        }
    }

    /// Opens a container inside the innermost; `None` past [`SKIP_DEPTH_MAX`].
    fn push(&mut self, open: u8) -> Option<()> {
        if self.depth == SKIP_DEPTH_MAX {
            return None;
        }
        self.objects |= u64::from(open == b'{') << self.depth;
        self.depth += 1;
        self.close = closer(open);
        Some(())
    }

    /// Closes the innermost container; false when none is left open.
    fn pop(&mut self) -> bool {
        self.depth -= 1;
        self.objects &= !(1 << self.depth);
        let parent_is_object = self.depth > 0 && self.objects >> (self.depth - 1) & 1 == 1;
        self.close = if parent_is_object { b'}' } else { b']' };
        self.depth > 0
    }

    /// Whether the innermost container is an object.
    fn in_object(&self) -> bool {
        self.close == b'}'
    }
}

/// Where a string whose first byte is at `pos` ends: the index after its closing `"`;
/// `None` for a control byte, a bad escape or no end. Escapes are checked as serde checks
/// the strings it skips.
///
/// Prose and code in prompts hold an escape every few dozen bytes (`\n`, `\"`), so the
/// special bytes (`"`, `\`, control) of a block are found at once and handled in place;
/// going back to a fresh search after each escape puts a reload and a new search on a chain
/// from escape to escape. On x86_64 a block is 64 bytes classified with SSE2 compares (part
/// of the x86_64 baseline, through `safe_arch`) and its escapes are found without a branch
/// per escape ([`string_end_sse2`]); elsewhere a block is an 8-byte word classified by
/// [`special_bytes`], an escape stepped over within the word.
#[inline(always)]
fn string_end(s: &[u8], pos: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        string_end_sse2(s, pos)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        string_end_swar(s, pos)
    }
}

/// [`string_end`] 64 bytes at a time (SSE2). The block's backslashes, and its quotes and
/// control bytes together, become two bit masks; which bytes are escaped follows from the
/// backslash mask without a branch per escape (odd-length backslash runs found by a
/// carry-propagating add, the method of simdjson's stage 1), with a run that crosses into the
/// next block carried over. The first quote or control byte that is not escaped ends the
/// string (a quote) or refuses it (a control byte); each escaped byte before it is checked
/// against the escapes serde accepts (for `\u`, four hex digits, read from `s` when they
/// cross the block's end).
#[cfg(target_arch = "x86_64")]
fn string_end_sse2(s: &[u8], mut pos: usize) -> Option<usize> {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    // Whether the block's first byte is escaped by a backslash run ending the block before.
    let mut carry = 0u64;
    while let Some(c) = s.get(pos..pos + 64) {
        let (quote_or_control, backslash) = special_masks64(c);
        // A backslash that is itself escaped neither starts nor continues a run.
        let backslash = backslash & !carry;
        let follows_escape = (backslash << 1) | carry;
        // Runs starting on odd bits, added to the runs themselves, carry out of exactly the
        // runs that start on even bits: those flip which bits after a run are escaped.
        let odd_starts = backslash & !EVEN & !follows_escape;
        let (even_runs, overflow) = odd_starts.overflowing_add(backslash);
        let escaped = (EVEN ^ (even_runs << 1)) & follows_escape;
        let stops = quote_or_control & !escaped;
        // The escaped bytes before the first stop (all of them when there is none).
        let mut e = escaped & (stops & stops.wrapping_neg()).wrapping_sub(1);
        while e != 0 {
            let k = e.trailing_zeros() as usize;
            e &= e - 1;
            match ESCAPES[usize::from(c[k])] {
                Escape::Single => {}
                Escape::Unicode => {
                    let hex = s.get(pos + k + 1..pos + k + 5)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                }
                Escape::Invalid => return None,
            }
        }
        if stops != 0 {
            let k = stops.trailing_zeros() as usize;
            return (c[k] == b'"').then_some(pos + k + 1);
        }
        carry = u64::from(overflow);
        pos += 64;
    }
    if carry != 0 {
        // The last block ended in an escaping backslash: the escape goes on here.
        pos += escape_len(s, pos)?;
    }
    string_end_tail(s, pos)
}

/// Bit masks of a 64-byte block's quotes and control bytes (below 0x20) together, and of
/// its backslashes; bit `i` for byte `i`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn special_masks64(c: &[u8]) -> (u64, u64) {
    use safe_arch::{
        bitor_m128i, cmp_eq_mask_i8_m128i, load_unaligned_m128i, min_u8_m128i, move_mask_i8_m128i,
        set_splat_i8_m128i,
    };
    let chunk = |i: usize| -> (u64, u64) {
        let Some(Ok(h)) = c.get(16 * i..16 * i + 16).map(<&[u8; 16]>::try_from) else {
            unreachable!("a 64-byte block")
        };
        let v = load_unaligned_m128i(h);
        let quote = cmp_eq_mask_i8_m128i(v, set_splat_i8_m128i(b'"' as i8));
        // Below 0x20 exactly where the unsigned minimum with 0x1F is the byte itself.
        let control = cmp_eq_mask_i8_m128i(min_u8_m128i(v, set_splat_i8_m128i(0x1F)), v);
        let backslash = cmp_eq_mask_i8_m128i(v, set_splat_i8_m128i(b'\\' as i8));
        let bits = |m| u64::from(move_mask_i8_m128i(m) as u16);
        (bits(bitor_m128i(quote, control)), bits(backslash))
    };
    let (a, b, c2, d) = (chunk(0), chunk(1), chunk(2), chunk(3));
    (
        a.0 | b.0 << 16 | c2.0 << 32 | d.0 << 48,
        a.1 | b.1 << 16 | c2.1 << 32 | d.1 << 48,
    )
}

/// [`string_end`] eight bytes at a time, the special bytes of a word flagged by
/// [`special_bytes`] (which may also flag bytes above a special one: each flag is looked at).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn string_end_swar(s: &[u8], mut pos: usize) -> Option<usize> {
    'words: while let Some(c) = s.get(pos..pos + 8) {
        let w = word(c);
        let mut m = special_bytes(w);
        while m != 0 {
            let k = (m.trailing_zeros() / 8) as usize;
            match (w >> (8 * k)) as u8 {
                b'"' => return Some(pos + k + 1),
                b'\\' => {
                    let next = k + 1 + escape_len(s, pos + k + 1)?;
                    if next >= 8 {
                        pos += next;
                        continue 'words;
                    }
                    m &= !0u64 << (8 * next);
                }
                b if b < 0x20 => return None,
                _ => m &= m - 1,
            }
        }
        pos += 8;
    }
    string_end_tail(s, pos)
}

/// [`string_end`] over a string's last bytes, too few for a block before the end of the
/// body.
fn string_end_tail(s: &[u8], mut pos: usize) -> Option<usize> {
    loop {
        pos = string_special(s, pos)?;
        let b = *s.get(pos)?;
        pos += 1;
        match b {
            b'"' => return Some(pos),
            b'\\' => pos += escape_len(s, pos)?,
            _ => return None,
        }
    }
}

/// The length of an escape after its `\`, whose next byte is at `at`: 1 for one of
/// `"\/bfnrt`, 5 for `u` and four hex digits (any code unit: serde does not check
/// surrogates it skips); `None` for anything else. By table: against a `match` on the
/// byte, 7-10% less time on an escape-dense 48.6 KB body and 3-4% on the bench's prompt
/// (4 alternating microbenchmark rounds each).
#[inline(always)]
fn escape_len(s: &[u8], at: usize) -> Option<usize> {
    match ESCAPES[usize::from(*s.get(at)?)] {
        Escape::Single => Some(1),
        Escape::Unicode => {
            let hex = s.get(at + 1..at + 5)?;
            hex.iter().all(u8::is_ascii_hexdigit).then_some(5)
        }
        Escape::Invalid => None,
    }
}

/// What may follow a `\` in a JSON string.
#[derive(Clone, Copy)]
enum Escape {
    /// One of `"\/bfnrt`: the escape ends there.
    Single,
    /// `u`: four hex digits follow.
    Unicode,
    Invalid,
}

/// [`Escape`] by the byte after the `\`.
static ESCAPES: [Escape; 256] = {
    let mut t = [Escape::Invalid; 256];
    let single = *b"\"\\/bfnrt";
    let mut i = 0;
    while i < single.len() {
        t[single[i] as usize] = Escape::Single;
        i += 1;
    }
    t[b'u' as usize] = Escape::Unicode;
    t
};

/// The byte that closes a container opened by `open` (`{` or `[`).
fn closer(open: u8) -> u8 {
    if open == b'{' {
        b'}'
    } else {
        b']'
    }
}

/// The index of the first `"`, `\` or control byte (below 0x20) in `s` from `from` on:
/// where a string's plain run ends. Most strings (keys, ids) end within sixteen bytes:
/// those two words are checked inline, longer runs go to [`string_special_long`].
#[inline(always)]
fn string_special(s: &[u8], from: usize) -> Option<usize> {
    if let Some(c) = s.get(from..from + 16) {
        for (i, half) in [(from, &c[..8]), (from + 8, &c[8..])] {
            let hit = special_bytes(word(half));
            if hit != 0 {
                return Some(i + (hit.trailing_zeros() / 8) as usize);
            }
        }
        return string_special_long(s, from + 16);
    }
    string_special_long(s, from)
}

/// [`string_special`] eight bytes at a time, out of line so that its constants stay in
/// registers across the loop.
#[inline(never)]
fn string_special_long(s: &[u8], from: usize) -> Option<usize> {
    let rest = s.get(from..)?;
    first_flagged(rest, special_bytes, |b| b == b'"' || b == b'\\' || b < 0x20).map(|p| from + p)
}

/// Bit 7 set in each byte of `w` that is `"`, `\` or a control byte (below 0x20) — and
/// possibly in bytes above such a byte, never below: the lowest set bit marks the first.
///
/// `w ^ 0x02` maps `"` to 0x20 and the control bytes onto themselves, and nothing else below
/// 0x21; `w ^ 0x5C` maps `\` to 0. A byte below 0x21 (or 1) borrows into its bit 7 when
/// subtracted from, and the XORs leave bit 7 alone, so `!w` keeps only bytes that started
/// below 0x80. A borrow only ever runs upwards, from a true hit.
#[inline(always)]
fn special_bytes(w: u64) -> u64 {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let quote_or_control = (w ^ (LO * 0x02)).wrapping_sub(LO * 0x21);
    let backslash = (w ^ (LO * u64::from(b'\\'))).wrapping_sub(LO);
    (quote_or_control | backslash) & !w & HI
}

#[cfg(test)]
mod tests {
    use super::super::session_id::{parse_body_serde, BodyFields};
    use super::*;
    use crate::testutil::XorShift;

    /// The body the proxy benchmark sends.
    const BENCH_BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"bench session 7: reply with eight tokens"}],"max_tokens":8,"metadata":{"session_id":"bench-session-007"}}"#;

    /// The fast path's fields, when it takes the body, set beside serde's: the billing
    /// prefix (which serde does not look for) is left out, and tested on its own.
    fn fast(body: &[u8]) -> Option<BodyFields> {
        scan(body).map(|top| {
            assert!(
                top.billing_prefix.is_some(),
                "the scan tells the billing prefix"
            );
            let mut f = top.reduce();
            f.billing_prefix = None;
            f
        })
    }

    /// The scan tells whether a string value starts with the billing prefix, wherever the
    /// string is skipped; not for keys, read values or the prefix further into a string.
    #[test]
    fn billing_prefix_is_found_at_the_start_of_skipped_strings() {
        let m = "x-anthropic-billing-header: cc_version=2; cc_entrypoint=cli; cch=ab;";
        let prefix = |body: String| scan(body.as_bytes()).and_then(|t| t.billing_prefix);
        for body in [
            format!(r#"{{"messages":[{{"role":"user","content":"{m} hi"}}]}}"#),
            format!(r#"{{"system":[{{"type":"text","text":"{m}"}}],"model":"m"}}"#),
            format!(r#"{{"model":"m","note":"{m}"}}"#),
            format!(r#"{{"metadata":{{"other":"{m}","session_id":"s"}}}}"#),
            format!(r#"{{"model":"m","x":["a","{m}\n"]}}"#),
        ] {
            assert_eq!(prefix(body.clone()), Some(true), "{body}");
        }
        for body in [
            format!(r#"{{"messages":[{{"role":"user","content":"see {m}"}}]}}"#),
            format!(r#"{{"model":"{m}"}}"#),
            format!(r#"{{"metadata":{{"session_id":"{m}"}}}}"#),
            format!(r#"{{"{m}":1}}"#),
            r#"{"messages":[{"role":"user","content":"x-anthropic-billing-header"}]}"#.to_string(),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#.to_string(),
        ] {
            assert_eq!(prefix(body.clone()), Some(false), "{body}");
        }
    }

    #[test]
    fn common_bodies_take_the_fast_path_and_agree_with_serde() {
        let bodies = [
            BENCH_BODY,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}"#,
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
            r#"{"model":"m","user":"alice","temperature":0.7,"top_p":1,"seed":-3,"n":1e3}"#,
            r#"{"litellm_metadata":{"session_id":"ls","tags":["a","b"]},"model":"m"}"#,
            r#"{"metadata":{"user_id":{"session_id":"us","device":"d"}}}"#,
            r#"{"metadata":{"user_id":"plain-user"}}"#,
            r#"{"metadata":{"user_id":"{}"},"user":" "}"#,
            r#"{"messages":[{"role":"user","content":"a\nb \"q\" \\ \/ \u00e9 \ud83d\ude00 \ud800"}]}"#,
            r#"{"model":"modèle 😀","messages":[{"content":"héllo wörld ✓"}]}"#,
            r#"{"tools":[{"type":"function","function":{"parameters":{"type":"object","properties":{"x":{"enum":[1,2,[3,{}]]}}}}}],"model":"t"}"#,
            r#"{"metadata":{"session_id":{"a":[1]}},"user":[1],"stream":null,"model":false}"#,
            r#"{"model":"a","model":"b","metadata":{"session_id":"x"},"metadata":"gone"}"#,
            " \r\n\t{ \"model\" : \"m\" , \"stream\" :\ttrue\n}\r\n ",
            "{}",
        ];
        for b in bodies {
            let got = fast(b.as_bytes()).unwrap_or_else(|| panic!("fast path declined {b}"));
            assert_eq!(Some(&got), parse_body_serde(b.as_bytes()).as_ref(), "{b}");
        }
        let f = fast(BENCH_BODY.as_bytes()).unwrap();
        assert_eq!(f.model.as_deref(), Some("m"));
        assert_eq!(f.metadata_session_id.as_deref(), Some("bench-session-007"));
        let f = fast(bodies[2].as_bytes()).unwrap();
        assert_eq!((f.stream, f.include_usage), (true, Some(true)));
        let f = fast(bodies[12].as_bytes()).unwrap();
        assert_eq!(
            (f.model.as_deref(), f.metadata_session_id.clone()),
            (Some("b"), None)
        );
    }

    #[test]
    fn unusual_bodies_fall_back() {
        let deep = |n: usize| format!(r#"{{"x":{}{},"user":"u"}}"#, "[".repeat(n), "]".repeat(n));
        assert!(scan(deep(SKIP_DEPTH_MAX as usize).as_bytes()).is_some());
        let too_deep = deep(SKIP_DEPTH_MAX as usize + 1);
        let triggers: Vec<(&str, &[u8])> = vec![
            ("not UTF-8 in a read string", b"{\"model\":\"\xff\"}"),
            ("not UTF-8 in a top-level key", b"{\"x\xc3\":1}"),
            ("empty", b""),
            ("whitespace", b" \n "),
            ("array", b"[{\"user\":\"u\"}]"),
            ("string", b"\"s\""),
            ("number", b"42"),
            ("null", b"null"),
            ("byte order mark", b"\xef\xbb\xbf{}"),
            (
                "escaped top key",
                br#"{"met\u0061data":{"session_id":"k"}}"#,
            ),
            (
                "escaped nested key",
                br#"{"metadata":{"session_\u0069d":"k"}}"#,
            ),
            (
                "escaped skipped key",
                br#"{"messages":[{"ro\u006ce":"user"}]}"#,
            ),
            ("escaped model", br#"{"model":"a\/b"}"#),
            (
                "escaped session id",
                br#"{"metadata":{"session_id":"caf\u00e9"}}"#,
            ),
            (
                "escaped user_id",
                br#"{"metadata":{"user_id":"{\"session_id\":\"g\"}"}}"#,
            ),
            ("escaped user", br#"{"user":"\""}"#),
            ("number model", br#"{"model":7}"#),
            ("number stream", br#"{"stream":1}"#),
            ("number user", br#"{"user":12}"#),
            ("number metadata", br#"{"metadata":1}"#),
            ("number stream_options", br#"{"stream_options":0}"#),
            ("number session_id", br#"{"metadata":{"session_id":42}}"#),
            (
                "number user_id",
                br#"{"metadata":{"user_id":18446744073709551615}}"#,
            ),
            (
                "number user_id.session_id",
                br#"{"metadata":{"user_id":{"session_id":1.5}}}"#,
            ),
            (
                "number litellm session_id",
                br#"{"litellm_metadata":{"session_id":-7}}"#,
            ),
            (
                "number include_usage",
                br#"{"stream_options":{"include_usage":1}}"#,
            ),
            ("too deep", too_deep.as_bytes()),
            ("trailing comma, object", br#"{"a":1,}"#),
            ("trailing comma, array", br#"{"a":[1,]}"#),
            ("leading comma", br#"{,"a":1}"#),
            ("missing comma", br#"{"a":1 "b":2}"#),
            ("missing colon", br#"{"a" 1}"#),
            ("key not a string", br#"{a:1}"#),
            ("bad literal", br#"{"a":tru}"#),
            ("bad literal case", br#"{"stream":True}"#),
            ("leading zero", br#"{"a":01}"#),
            ("bare minus", br#"{"a":-}"#),
            ("no fraction digits", br#"{"a":1.}"#),
            ("no integer digits", br#"{"a":.5}"#),
            ("no exponent digits", br#"{"a":1e+}"#),
            ("plus sign", br#"{"a":+1}"#),
            ("raw tab in a skipped string", b"{\"a\":\"x\ty\"}"),
            ("raw LF in a read string", b"{\"model\":\"x\ny\"}"),
            ("bad escape", br#"{"a":"\x"}"#),
            ("short unicode escape", br#"{"a":"\u12G4"}"#),
            ("bracket mismatch", br#"{"a":[}"#),
            ("brace mismatch", br#"{"a":{]}"#),
            ("trailing garbage", br#"{"user":"u"} x"#),
            ("two objects", b"{}{}"),
            ("truncated string", br#"{"a":"b"#),
            ("truncated value", br#"{"a":"#),
            ("truncated object", b"{"),
            ("truncated escape", br#"{"a":"\u00"#),
        ];
        for (why, b) in triggers {
            assert!(scan(b).is_none(), "{why}: {:?}", String::from_utf8_lossy(b));
        }
    }

    /// serde_json checks UTF-8 in the strings it reads and in the keys of the objects it
    /// visits, not in the strings it skips: the fast path does the same, and skips prompt
    /// text without checking it.
    #[test]
    fn utf8_is_checked_where_serde_checks_it() {
        let taken: [&[u8]; 6] = [
            b"{\"x\":\"\xff\"}",
            b"{\"x\":\"\xc3\"}",
            b"{\"messages\":[{\"content\":\"a\xff\xfe\\n\"}],\"model\":\"m\"}",
            b"{\"x\":{\"\xff\":1},\"user\":\"u\"}",
            b"{\"metadata\":{\"x\":[\"\xc3\"],\"session_id\":\"s\"}}",
            b"{\"model\":[\"\xff\"]}",
        ];
        for b in taken {
            let got =
                fast(b).unwrap_or_else(|| panic!("declined {:?}", String::from_utf8_lossy(b)));
            assert_eq!(
                Some(&got),
                parse_body_serde(b).as_ref(),
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
        // Control: where serde checks, a bad byte makes it refuse the body, and the fast
        // path leaves the body to it.
        let refused: [&[u8]; 6] = [
            b"{\"model\":\"\xff\"}",
            b"{\"user\":\"a\xc3\"}",
            b"{\"\xff\":1}",
            b"{\"metadata\":{\"\xc3\":1}}",
            b"{\"model\":{\"\xff\":1}}",
            b"{\"metadata\":{\"session_id\":\"a\xffb\"}}",
        ];
        for b in refused {
            assert!(scan(b).is_none(), "{:?}", String::from_utf8_lossy(b));
            assert_eq!(
                parse_body_serde(b),
                None,
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
        // A key the fast path declines for being non-ASCII is still read, by serde.
        let b = "{\"modèle\":\"x\",\"user\":\"u\"}".as_bytes();
        assert!(scan(b).is_none());
        assert_eq!(
            parse_body_serde(b).and_then(|f| f.user.clone()).as_deref(),
            Some("u")
        );
    }

    /// Skipped strings of every length, escape density and alignment, ending anywhere
    /// relative to the body's end: the word-at-a-time skip and its tail agree with serde on
    /// which are valid, and the fast path takes exactly the bodies serde reads.
    #[test]
    fn skipped_strings_agree_with_serde() {
        let mut rng = XorShift::new(0x5717_0001);
        let fine: &[&[u8]] = &[
            b"a",
            b"n",
            b"u",
            b"0",
            b"f",
            b" ",
            b"\\n",
            b"\\\"",
            b"\\\\",
            b"\\/",
            b"\\t",
            b"\\u00e9",
            b"\\uD83D",
            b"\xc3\xa9",
            b"\xff",
            b"\x7f",
        ];
        // A lone `\` escapes whatever comes next; a `"` ends the string early.
        let bad: &[&[u8]] = &[b"\\", b"\"", b"\\x", b"\\u12", b"\x01", b"\x1f"];
        let (mut valid, mut invalid) = (0, 0);
        for _ in 0..40_000 {
            let mut body = b"{\"model\":\"m\",\"messages\":[{\"content\":\"".to_vec();
            body.extend(std::iter::repeat_n(b'x', rng.below(6)));
            let len = rng.below(120);
            while body.len() < 40 + len {
                // Mostly plain bytes, so that the special ones are spread out.
                let p = match rng.below(120) {
                    0 => bad[rng.below(bad.len())],
                    1..=40 => fine[rng.below(fine.len())],
                    _ => b"q",
                };
                body.extend_from_slice(p);
            }
            body.extend_from_slice(b"\"}]");
            // The string ends at every distance from the end of the body.
            match rng.below(3) {
                0 => body.extend_from_slice(b"}"),
                1 => body.extend_from_slice(b",\"user\":\"u\"}"),
                _ => body.extend_from_slice(b",\"x\":\"0123456789abcdef\"}"),
            }
            let want = parse_body_serde(&body);
            let got = fast(&body);
            assert_eq!(got, want, "{:?}", String::from_utf8_lossy(&body));
            if want.is_some() {
                valid += 1;
            } else {
                invalid += 1;
            }
        }
        // Not vacuous: both kinds come up often.
        assert!(
            valid > 5_000 && invalid > 5_000,
            "{valid} valid, {invalid} invalid"
        );
    }

    /// The string skip's two block sizes (32 bytes by SSE2 on x86_64, 8-byte words
    /// elsewhere) and a byte-at-a-time reference agree on where every string ends and which
    /// are refused: special bytes at every offset of a block, escapes across block edges,
    /// strings that run off the end.
    #[test]
    fn string_end_block_sizes_agree_with_a_byte_loop() {
        fn reference(s: &[u8], mut pos: usize) -> Option<usize> {
            loop {
                let b = *s.get(pos)?;
                pos += 1;
                match b {
                    b'"' => return Some(pos),
                    b'\\' => pos += escape_len(s, pos)?,
                    b if b < 0x20 => return None,
                    _ => {}
                }
            }
        }
        let parts: &[&[u8]] = &[
            b"\\n", b"\\\\", b"\\\"", b"\\u00e9", b"\\u12", b"\\x", b"\\", b"\"", b"\x01", b"\x1f",
            b"\x20", b"\xff", b"\\/", b"\\u", b"\\\\\\",
        ];
        let mut rng = XorShift::new(0x5717_0002);
        let (mut ended, mut refused) = (0, 0);
        for _ in 0..100_000 {
            let len = rng.below(100);
            let mut s = Vec::with_capacity(len + 8);
            while s.len() < len {
                if rng.below(5) == 0 {
                    s.extend_from_slice(parts[rng.below(parts.len())]);
                } else {
                    s.push(b'z');
                }
            }
            if rng.below(2) == 0 {
                s.extend_from_slice(b"\"tail");
            }
            for from in 0..3.min(s.len()) {
                let want = reference(&s, from);
                let words: fn(&[u8], usize) -> Option<usize> = string_end_swar;
                for (name, skip) in [("words", words), ("blocks", string_end)] {
                    let shown = s.escape_ascii().to_string();
                    assert_eq!(skip(&s, from), want, "{name}: {shown:?} from {from}");
                }
                if want.is_some() {
                    ended += 1;
                } else {
                    refused += 1;
                }
            }
        }
        assert!(
            ended > 50_000 && refused > 50_000,
            "{ended} ended, {refused} refused"
        );
        // Long strings of valid escapes (backslash runs of every length among them) that end,
        // or are refused, only after several blocks: the carry from block to block.
        let valid: &[&[u8]] = &[b"\\n", b"\\\\", b"\\\"", b"\\u00e9", b"\\/", b"\\\\\\\\"];
        let ends: &[&[u8]] = &[b"\"", b"\x01", b"\\x", b"\\u12\"", b"\\u", b"\\", b""];
        let (mut ended, mut refused, mut long) = (0, 0, 0);
        for _ in 0..30_000 {
            let len = rng.below(300);
            let mut s = Vec::with_capacity(len + 16);
            while s.len() < len {
                if rng.below(3) == 0 {
                    s.extend_from_slice(valid[rng.below(valid.len())]);
                } else {
                    s.push(b'z');
                }
            }
            s.extend_from_slice(ends[rng.below(ends.len())]);
            s.extend_from_slice(b"zz\"");
            for from in 0..2 {
                let want = reference(&s, from);
                let shown = s.escape_ascii().to_string();
                assert_eq!(string_end(&s, from), want, "blocks: {shown:?} from {from}");
                assert_eq!(
                    string_end_swar(&s, from),
                    want,
                    "words: {shown:?} from {from}"
                );
                match want {
                    Some(end) if end > 128 => long += 1,
                    _ => {}
                }
                if want.is_some() {
                    ended += 1;
                } else {
                    refused += 1;
                }
            }
        }
        assert!(
            ended > 10_000 && refused > 10_000 && long > 5_000,
            "{ended} ended ({long} after 128 bytes), {refused} refused"
        );
    }

    #[test]
    fn string_special_finds_the_first_special_byte() {
        let mut rng = XorShift::new(7);
        let near = b"\"\\\x00\x1f\x20\x21\x23\x5b\x5d\x7f\x80\xa2\xdc\xff";
        for _ in 0..5000 {
            let len = rng.below(40);
            let s: Vec<u8> = (0..len)
                .map(|_| match rng.below(8) {
                    0 => near[rng.below(near.len())],
                    1 => rng.next() as u8,
                    _ => b'a' + rng.below(26) as u8,
                })
                .collect();
            let want = s.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
            assert_eq!(string_special(&s, 0), want, "{s:?}");
            if let Some(from) = want.and_then(|w| w.checked_sub(3)) {
                assert_eq!(string_special(&s, from), want, "{s:?} from {from}");
            }
        }
    }

    /// Builds random JSON-ish bodies from fragments that hit every key and value shape.
    struct Gen {
        rng: XorShift,
        out: Vec<u8>,
    }

    /// Indexes of the known keys in `KEYS`.
    const MODEL: usize = 0;
    const STREAM: usize = 1;
    const STREAM_OPTIONS: usize = 2;
    const INCLUDE_USAGE: usize = 3;
    const SESSION_ID: usize = 6;
    const USER_ID: usize = 7;
    const USER: usize = 8;

    /// Keys as they appear on the wire: the known names, common others, escaped and near
    /// misses.
    const KEYS: &[&str] = &[
        r#""model""#,
        r#""stream""#,
        r#""stream_options""#,
        r#""include_usage""#,
        r#""metadata""#,
        r#""litellm_metadata""#,
        r#""session_id""#,
        r#""user_id""#,
        r#""user""#,
        r#""messages""#,
        r#""content""#,
        r#""""#,
        r#""Model""#,
        r#""session_id ""#,
        r#""met\u0061data""#,
        r#""session_\u0069d""#,
    ];

    /// Strings: plain, blank, escaped, non-ASCII, JSON inside, and a few invalid ones.
    const STRINGS: &[&str] = &[
        r#""s""#,
        r#""bench-session-007""#,
        r#""é ü 😀""#,
        r#""{}""#,
        r#""{broken""#,
        r#""007""#,
        r#""[1]""#,
        r#""""#,
        r#"" ""#,
        r#""\t""#,
        r#""caf\u00e9""#,
        r#""a\"b\\c\/d\b\f\n\r\t""#,
        r#""\ud83d\ude00""#,
        r#""\ud800""#,
        r#""{\"session_id\":\"in\"}""#,
        r#""{\"session_id\":3}""#,
        r#""bad\x""#,
        r#""\u12""#,
        "\"raw\u{1}ctl\"",
    ];
    /// How many `STRINGS` come first that are plain (no escape) and non-blank.
    const PLAIN_STRINGS: usize = 7;
    /// How many `STRINGS` come first that are valid JSON.
    const VALID_STRINGS: usize = 16;

    /// Numbers of every shape, and a few that are not numbers.
    const NUMBERS: &[&str] = &[
        "0",
        "-0",
        "12",
        "-7",
        "1.5",
        "-0.25e-3",
        "1e5",
        "1E+2",
        "18446744073709551615",
        "-9223372036854775809",
        "1e999",
        "123456789012345678901234567890",
        "01",
        "1.",
        "-",
        ".5",
        "1e",
        "+1",
    ];

    /// Literals, and near misses.
    const LITERALS: &[&str] = &["true", "false", "null", "tru", "nul", "True"];

    /// Bytes inserted by mutations.
    const SPECIALS: &[&[u8]] = &[
        b"{", b"}", b"[", b"]", b"\"", b"\\", b"\\u", b":", b",", b"\xff", b"\xc3", b" ", b"1",
        b"-", b"null", b"\x01",
    ];

    impl Gen {
        fn pick(&mut self, from: &[&str]) {
            let s = from[self.rng.below(from.len())];
            self.out.extend_from_slice(s.as_bytes());
        }

        /// Optional whitespace, usually none.
        fn ws(&mut self) {
            if self.rng.below(5) == 0 {
                for _ in 0..1 + self.rng.below(3) {
                    let w = [b' ', b'\t', b'\n', b'\r'][self.rng.below(4)];
                    self.out.push(w);
                }
            }
        }

        /// A value; containers only while `depth` lasts. Strings and objects come up most.
        fn value(&mut self, depth: usize) {
            match self.rng.below(if depth == 0 { 5 } else { 9 }) {
                0..=2 => self.pick_mostly(STRINGS, VALID_STRINGS),
                3 => self.pick_mostly(NUMBERS, 12),
                4 => self.pick_mostly(LITERALS, 3),
                5 => self.array(depth - 1),
                _ => self.object(depth - 1),
            }
        }

        /// One of `from`, usually among its first `valid` entries.
        fn pick_mostly(&mut self, from: &[&str], valid: usize) {
            let i = self.below_mostly(from.len(), valid);
            self.out.extend_from_slice(from[i].as_bytes());
        }

        /// Uniform in `0..n`, usually in `0..valid`.
        fn below_mostly(&mut self, n: usize, valid: usize) -> usize {
            let n = if self.rng.below(16) == 0 { n } else { valid };
            self.rng.below(n)
        }

        /// The value of `KEYS[k]`: for a known key, mostly the shape it is read as, so that
        /// fields end up set.
        fn member_value(&mut self, k: usize, depth: usize) {
            if k >= 9 || self.rng.below(4) == 0 {
                return self.value(depth);
            }
            let plain_or_object = depth == 0 || (k == USER_ID && self.rng.below(2) == 0);
            match k {
                STREAM | INCLUDE_USAGE => self.pick(&["true", "false"]),
                _ if plain_or_object || [MODEL, SESSION_ID, USER].contains(&k) => {
                    self.pick(&STRINGS[..PLAIN_STRINGS])
                }
                STREAM_OPTIONS => self.object_with(depth - 1, &[INCLUDE_USAGE]),
                USER_ID => self.object_with(depth - 1, &[SESSION_ID]),
                _ => self.object_with(depth - 1, &[SESSION_ID, USER_ID]),
            }
        }

        /// `sep` where it belongs; now and then a grammar slip instead: the separator
        /// missing or doubled, or a trailing comma.
        fn punct(&mut self, sep: Option<u8>) {
            let sep = sep.into_iter();
            match self.rng.below(250) {
                0 => {}
                1 => self.out.extend(sep.clone().chain(sep)),
                2 => self.out.push(b','),
                _ => self.out.extend(sep),
            }
        }

        fn array(&mut self, depth: usize) {
            self.out.push(b'[');
            for i in 0..self.rng.below(4) {
                self.punct((i > 0).then_some(b','));
                self.ws();
                self.value(depth);
                self.ws();
            }
            self.punct(None);
            self.out.push(b']');
        }

        /// An object; known keys come up often, so read objects nest in read objects.
        fn object(&mut self, depth: usize) {
            self.object_with(depth, &[]);
        }

        /// An object whose keys are often from `prefer` (indexes into `KEYS`).
        fn object_with(&mut self, depth: usize, prefer: &[usize]) {
            self.out.push(b'{');
            for i in 0..self.rng.below(6) {
                self.punct((i > 0).then_some(b','));
                self.ws();
                let k = match prefer.len() {
                    n if n > 0 && self.rng.below(2) == 0 => prefer[self.rng.below(n)],
                    _ => self.below_mostly(KEYS.len(), 14),
                };
                self.out.extend_from_slice(KEYS[k].as_bytes());
                self.ws();
                self.punct(Some(b':'));
                self.ws();
                self.member_value(k, depth);
                self.ws();
            }
            self.punct(None);
            self.out.push(b'}');
        }

        /// A body: almost always an object, sometimes mutated afterwards.
        fn body(&mut self) -> Vec<u8> {
            self.out.clear();
            self.ws();
            if self.rng.below(50) == 0 {
                self.value(2);
            } else {
                self.object(3);
            }
            self.ws();
            if self.rng.below(4) == 0 {
                self.mutate();
            }
            self.out.clone()
        }

        /// One to three byte edits: delete, insert, flip or truncate.
        fn mutate(&mut self) {
            for _ in 0..1 + self.rng.below(3) {
                let pos = self.rng.below(self.out.len() + 1);
                match self.rng.below(4) {
                    0 if pos < self.out.len() => {
                        self.out.remove(pos);
                    }
                    1 => {
                        let s = SPECIALS[self.rng.below(SPECIALS.len())];
                        self.out.splice(pos..pos, s.iter().copied());
                    }
                    2 if pos < self.out.len() => self.out[pos] = self.rng.next() as u8,
                    _ => self.out.truncate(pos),
                }
            }
        }
    }

    /// Which fields of `f` are set, in declaration order.
    fn fields_set(f: &BodyFields) -> [bool; 8] {
        [
            f.model.is_some(),
            f.stream,
            f.include_usage.is_some(),
            f.metadata_session_id.is_some(),
            f.litellm_metadata_session_id.is_some(),
            f.user_id_session_id.is_some(),
            f.user_id.is_some(),
            f.user.is_some(),
        ]
    }

    /// The contract: whenever the fast path takes a body, serde reads it to the same fields.
    #[test]
    fn fast_path_agrees_with_serde_on_random_bodies() {
        const CASES: usize = 30_000;
        let mut g = Gen {
            rng: XorShift::new(0x5eed_b0d1_e5ca_0001),
            out: Vec::new(),
        };
        let (mut objects, mut fast_taken) = (0, 0);
        let mut field_set = [0usize; 8];
        for _ in 0..CASES {
            let b = g.body();
            let want = parse_body_serde(&b);
            objects += usize::from(want.is_some());
            let Some(got) = fast(&b) else { continue };
            assert_eq!(
                Some(&got),
                want.as_ref(),
                "{:?}",
                String::from_utf8_lossy(&b)
            );
            fast_taken += 1;
            for (n, set) in field_set.iter_mut().zip(fields_set(&got)) {
                *n += usize::from(set);
            }
        }
        eprintln!(
            "{CASES} bodies, {objects} objects to serde, fast path took {fast_taken}; \
             fields set by it: {field_set:?}"
        );
        // Not vacuous: the fast path takes most bodies serde reads, and sets every field.
        assert!(fast_taken * 2 > objects, "fast path took only {fast_taken}");
        assert!(field_set.iter().all(|&n| n >= 100), "{field_set:?}");
    }
}
