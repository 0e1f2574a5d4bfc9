//! Session id: which id a request carries and where it came from (SPEC §3.3, §3.7, §14).
//!
//! Reads the request headers and, through [`parse_body`], the few JSON body fields the
//! router needs (`model`, `stream`, `stream_options.include_usage`, the session-id
//! candidates) in one streaming pass. Decides the id by the SPEC's fixed source order and
//! labels its source. Never builds a JSON tree, never materialises skipped values, never
//! allocates in proportion to the body more than once, never trims an id, never panics on
//! client bytes. Pure: no IO, no shared state.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::marker::PhantomData;

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use super::body_scan;
use crate::http::{Headers, Known};
use crate::limits::SESSION_ID_HASH_BYTES_MAX;

/// Bytes of the original id shown in `X-Routed-Session` before it is cut with `...`.
const HEADER_VALUE_ID_BYTES_MAX: usize = 128;

/// Header sources, in precedence order (as the parsed head indexes them), with their labels.
const HEADER_SOURCES: [(Known, &str); 3] = [
    (Known::X_LITELLM_SESSION_ID, "header:x-litellm-session-id"),
    (
        Known::X_CLAUDE_CODE_SESSION_ID,
        "header:x-claude-code-session-id",
    ),
    (Known::X_SESSION_ID, "header:x-session-id"),
];

/// Body sources (dotted paths), in precedence order, with their labels.
const BODY_SOURCES: [(&str, &str); 5] = [
    ("metadata.session_id", "body:metadata.session_id"),
    (
        "litellm_metadata.session_id",
        "body:litellm_metadata.session_id",
    ),
    (
        "metadata.user_id.session_id",
        "body:metadata.user_id.session_id",
    ),
    ("metadata.user_id", "body:metadata.user_id"),
    ("user", "body:user"),
];

/// Where a session id came from: the `X-Routed-Source` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A request header: `x-litellm-session-id`, `x-claude-code-session-id` or `x-session-id`.
    Header(&'static str),
    /// A body field by dotted path: `metadata.session_id`, `litellm_metadata.session_id`,
    /// `metadata.user_id.session_id`, `metadata.user_id` or `user`.
    Body(&'static str),
    /// No source carried a usable id.
    None,
    /// An id was present but the route has `session_affinity = false`.
    AffinityOff,
}

impl Source {
    /// `header:<name>`, `body:<dotted path>`, `none` or `affinity_off`.
    pub fn label(&self) -> Cow<'static, str> {
        let known = |table: &[(&'static str, &'static str)], name: &str| {
            table.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
        };
        match *self {
            Source::None => Cow::Borrowed("none"),
            Source::AffinityOff => Cow::Borrowed("affinity_off"),
            Source::Header(n) => HEADER_SOURCES
                .iter()
                .find(|(k, _)| k.name() == n)
                .map(|(_, l)| *l)
                .map_or_else(|| Cow::Owned(format!("header:{n}")), Cow::Borrowed),
            Source::Body(p) => known(&BODY_SOURCES, p)
                .map_or_else(|| Cow::Owned(format!("body:{p}")), Cow::Borrowed),
        }
    }
}

/// The fields of a JSON request body the router needs. Session-id candidates hold only
/// usable (non-blank) values; numbers are already in their decimal form.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct BodyFields {
    /// `model`, only when it is a JSON string.
    pub model: Option<String>,
    /// `stream`, true only when it is JSON `true`.
    pub stream: bool,
    /// `stream_options.include_usage`, when it is a boolean.
    pub include_usage: Option<bool>,
    /// The object has a `stream_options` member, whatever its value.
    pub has_stream_options: bool,
    /// `metadata.session_id`.
    pub metadata_session_id: Option<String>,
    /// `litellm_metadata.session_id`.
    pub litellm_metadata_session_id: Option<String>,
    /// `metadata.user_id.session_id`: `user_id` an object, or a string holding a JSON object.
    pub user_id_session_id: Option<String>,
    /// `metadata.user_id` used plainly: a string that held no usable `session_id`, or a number.
    pub user_id: Option<String>,
    /// `user`.
    pub user: Option<String>,
    /// Whether a string value of the body starts with Claude Code's billing prefix
    /// ([`crate::transform::CCH_MARKER`], raw bytes): known when the byte scan read the body
    /// (it looks at the start of every string it skips), `None` when serde did.
    pub billing_prefix: Option<bool>,
}

thread_local! {
    /// Strings of dropped [`BodyFields`], for the next body this thread parses: the model
    /// and the session id of every request would otherwise cost an allocation each.
    static SPARE_STRINGS: std::cell::RefCell<Vec<String>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare strings kept per thread, and the largest capacity kept.
const SPARE_STRINGS_MAX: usize = 64;
const SPARE_STRING_BYTES_MAX: usize = 256;

/// `s` in a string of this thread's spares when one is large enough, else a new one.
fn pooled(s: &str) -> String {
    let spare = SPARE_STRINGS
        .try_with(|l| {
            let mut l = l.try_borrow_mut().ok()?;
            l.last()
                .is_some_and(|b| b.capacity() >= s.len())
                .then(|| l.pop())
                .flatten()
        })
        .ok()
        .flatten();
    match spare {
        Some(mut b) => {
            b.push_str(s);
            b
        }
        None => {
            // Room for the usual model name or session id (a UUID is 36 bytes), so a spare
            // fits the next request's whichever it is.
            let mut b = String::with_capacity(s.len().max(48));
            b.push_str(s);
            b
        }
    }
}

impl Drop for BodyFields {
    fn drop(&mut self) {
        let strings = [
            self.model.take(),
            self.metadata_session_id.take(),
            self.litellm_metadata_session_id.take(),
            self.user_id_session_id.take(),
            self.user_id.take(),
            self.user.take(),
        ];
        // During thread exit the list may be gone: then the strings are simply freed.
        let _ = SPARE_STRINGS.try_with(|l| {
            let Ok(mut l) = l.try_borrow_mut() else {
                return;
            };
            for mut b in strings.into_iter().flatten() {
                if l.len() < SPARE_STRINGS_MAX
                    && (1..=SPARE_STRING_BYTES_MAX).contains(&b.capacity())
                {
                    b.clear();
                    l.push(b);
                }
            }
        });
    }
}

/// Parse the fields the router needs in one pass. `None` when the body is not a JSON
/// object (not JSON at all, an array, a scalar, empty, truncated, trailing garbage).
/// A key sent twice counts by its last occurrence, as a tree parser would read it.
/// Common bodies take the byte scanner in [`body_scan`]; anything it declines goes to serde.
pub fn parse_body(body: &[u8]) -> Option<BodyFields> {
    if let Some(top) = body_scan::scan(body) {
        return Some(top.reduce());
    }
    parse_body_serde(body)
}

/// [`parse_body`] through serde alone: the fallback, and the oracle the fast path is
/// tested against.
pub(super) fn parse_body_serde(body: &[u8]) -> Option<BodyFields> {
    let _exact = ExactNumbers::set(std::str::from_utf8(body).is_ok());
    match serde_json::from_slice::<Json<'_, TopObj<'_>>>(body).ok()? {
        Json::Object(top) => Some(top.reduce()),
        _ => None,
    }
}

/// A session id and where it came from; the id borrows from the headers or body fields
/// it was found in unless it had to be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionId<'a> {
    pub id: Cow<'a, str>,
    pub source: Source,
}

/// The route options extraction depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidOptions {
    /// `session_affinity`: false turns any found id into none, labelled `affinity_off`.
    pub session_affinity: bool,
    /// `body_user_affinity`: false skips the body's `user`.
    pub body_user_affinity: bool,
}

/// The session id by the SPEC §3.3 order: headers `x-litellm-session-id`,
/// `x-claude-code-session-id`, `x-session-id`; body `metadata.session_id`,
/// `litellm_metadata.session_id`, `metadata.user_id.session_id`, `metadata.user_id`, `user`.
/// The first non-blank value wins. `body` is `None` when the body is not JSON or was not
/// parsed. With `session_affinity` off the id is dropped and the source is `AffinityOff` —
/// only when some id would have been found; otherwise `None`.
pub fn extract<'a>(
    headers: &'a Headers,
    body: Option<&'a BodyFields>,
    opts: &SidOptions,
) -> (Option<SessionId<'a>>, Source) {
    match find(headers, body, opts.body_user_affinity) {
        None => (None, Source::None),
        Some(_) if !opts.session_affinity => (None, Source::AffinityOff),
        Some((id, source)) => (Some(SessionId { id, source }), source),
    }
}

/// True when a header alone decides the id, so the body need not be parsed for it.
pub fn header_decides(headers: &Headers) -> bool {
    header_id(headers).is_some()
}

/// The `X-Routed-Session` value: bytes outside `0x21..=0x7E` and `%` percent-encoded, the
/// id cut to its first 128 bytes (on a char boundary) plus `...` when longer, `-` for none.
/// The result is printable ASCII only: never CR, LF or another control byte.
/// Borrowed when the id needs neither encoding nor cutting (the usual id).
pub fn header_value(id: Option<&str>) -> Cow<'_, str> {
    let Some(id) = id else {
        return Cow::Borrowed("-");
    };
    let plain = |b: &u8| (0x21..=0x7e).contains(b) && *b != b'%';
    if id.len() <= HEADER_VALUE_ID_BYTES_MAX && id.bytes().all(|b| plain(&b)) {
        return Cow::Borrowed(id);
    }
    let mut end = id.len().min(HEADER_VALUE_ID_BYTES_MAX);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    let cut = &id.as_bytes()[..end];
    let mut out = String::with_capacity(cut.len() + 3);
    for &b in cut {
        if plain(&b) {
            out.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "%{b:02X}");
        }
    }
    if end < id.len() {
        out.push_str("...");
    }
    Cow::Owned(out)
}

/// The bytes of an id used for hashing: at most its first 4 KiB (SPEC §14).
pub fn hash_bytes(id: &str) -> &[u8] {
    &id.as_bytes()[..id.len().min(SESSION_ID_HASH_BYTES_MAX)]
}

/// Empty or whitespace only. Whitespace is ASCII's (space, tab, LF, VT, FF, CR), as the
/// reference's Lua patterns read it: U+00A0 or U+2028 is an id's character, not a blank.
pub(crate) fn is_blank(s: &str) -> bool {
    s.bytes()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
}

/// A header's id as text: as sent when it is UTF-8, else read as Latin-1 (each byte one
/// char), so that distinct ids stay distinct. A lossy read would turn every invalid byte
/// into U+FFFD, and `s\xE9` and `s\xFF` would hash to one peer and log as one session.
fn id_text(v: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(v) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(v.iter().map(|&b| char::from(b)).collect()),
    }
}

/// The first non-blank value of the first header source that has one.
fn header_id(headers: &Headers) -> Option<(Cow<'_, str>, Source)> {
    // Most requests carry none of them: one test of the head's index.
    const KNOWN: [Known; HEADER_SOURCES.len()] = {
        let mut ks = [Known::X_SESSION_ID; HEADER_SOURCES.len()];
        let mut i = 0;
        while i < ks.len() {
            ks[i] = HEADER_SOURCES[i].0;
            i += 1;
        }
        ks
    };
    if !headers.any_known(&KNOWN) {
        return None;
    }
    HEADER_SOURCES.iter().find_map(|&(k, _)| {
        headers
            .all_known(k)
            .map(id_text)
            .find(|v| !is_blank(v))
            .map(|v| (v, Source::Header(k.name())))
    })
}

/// The winning id, borrowed where possible, before the affinity switch applies.
fn find<'a>(
    headers: &'a Headers,
    body: Option<&'a BodyFields>,
    body_user_affinity: bool,
) -> Option<(Cow<'a, str>, Source)> {
    if let Some(hit) = header_id(headers) {
        return Some(hit);
    }
    let b = body?;
    let user = if body_user_affinity { &b.user } else { &None };
    let candidates = [
        &b.metadata_session_id,
        &b.litellm_metadata_session_id,
        &b.user_id_session_id,
        &b.user_id,
        user,
    ];
    candidates
        .into_iter()
        .zip(BODY_SOURCES)
        .find_map(|(c, (path, _))| {
            // Candidates are non-blank by construction; the check guards hand-built fields.
            c.as_deref()
                .filter(|v| !is_blank(v))
                .map(|v| (Cow::Borrowed(v), Source::Body(path)))
        })
}

// ---------------------------------------------------------------------------------------
// One-pass body parsing. Every known field is read as a `Json<O>`, which accepts any JSON
// value (so a mistyped field never rejects the body) and parses objects only as `O`
// describes; every other key's value is skipped as `IgnoredAny`, which serde_json scans
// without building anything.

/// The object keys the router cares about, at any level; everything else is `Other`.
/// The fast path matches the same names in `body_scan::key`.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(field_identifier, rename_all = "snake_case")]
pub(super) enum Key {
    Model,
    Stream,
    StreamOptions,
    IncludeUsage,
    Metadata,
    LitellmMetadata,
    SessionId,
    UserId,
    User,
    #[serde(other)]
    Other,
}

/// A JSON value reduced to what matters: strings (borrowed unless escaped), numbers in
/// decimal form, booleans, objects parsed as `O`; null and arrays are `Other`.
pub(super) enum Json<'a, O> {
    Str(Cow<'a, str>),
    Num(String),
    Bool(bool),
    Object(O),
    Other,
}

/// A JSON value whose objects are skipped.
pub(super) type Scalar<'a> = Json<'a, IgnoredAny>;

impl<O> Json<'_, O> {
    /// The value as a session id: a non-blank string or a number.
    fn usable_id(self) -> Option<String> {
        match self {
            Json::Str(s) if !is_blank(&s) => Some(pooled(&s)),
            Json::Num(n) => Some(n),
            _ => None,
        }
    }
}

thread_local! {
    /// Whether [`id_value`] reads numbers from their text (see [`ExactNumbers`]).
    static EXACT_NUMBERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, has [`id_value`] read numbers exactly (`on`) or as serde's number visitors
/// do; restores the previous mode when dropped. Exact reading takes the value's raw text,
/// which serde_json requires to be UTF-8, whereas it skips the strings of an ignored value
/// without looking: so it is on only for a body (or string) that is UTF-8 throughout. A
/// body with invalid UTF-8 in some skipped string (not JSON by RFC 8259, but read so far,
/// and by the byte scan too) keeps the old reading, numbers past u64 rounded, rather than
/// failing whole.
struct ExactNumbers(bool);

impl ExactNumbers {
    fn set(on: bool) -> ExactNumbers {
        ExactNumbers(EXACT_NUMBERS.with(|c| c.replace(on)))
    }
}

impl Drop for ExactNumbers {
    fn drop(&mut self) {
        EXACT_NUMBERS.with(|c| c.set(self.0));
    }
}

/// The next value of `map`, where a session id may be, as [`Json`] reads it, except that a
/// number is its exact value in [`decimal_form`] (under [`ExactNumbers`]): serde's number
/// visitors would hand an integer past the u64 range over as an f64, rounded, so distinct
/// ids would merge. The value's text is taken as it is in the body (serde checks its
/// grammar) and read again unless it is a number.
fn id_value<'de, A: MapAccess<'de>, O: FromMap<'de>>(
    map: &mut A,
) -> Result<Json<'de, O>, A::Error> {
    if !EXACT_NUMBERS.with(|c| c.get()) {
        return map.next_value();
    }
    let raw: &'de RawValue = map.next_value()?;
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'-' | b'0'..=b'9') => Ok(Json::Num(decimal_form(text))),
        _ => serde_json::from_str(text).map_err(de::Error::custom),
    }
}

/// A JSON number (valid grammar: `-?int(.frac)?([eE][+-]?exp)?`) in one decimal form per
/// value, computed from its digits (exact at any size, no float): an integer as its digits
/// (`100`, `1e2`, `100.0` and `1.00e+2` are all `100`; a plain integer is its own text), a
/// fraction with a point and no exponent (`0.0015`, from `1.5e-3`); zero, `-0` included, is
/// `0`. A value whose plain form would pass [`SESSION_ID_HASH_BYTES_MAX`] (so a short
/// `1e999999` cannot grow into a megabyte) is written `d.ddde<exp>` instead, still one form
/// per value. An exponent too large for an i64 leaves the text as sent.
pub(super) fn decimal_form(text: &str) -> String {
    let (neg, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exp) = match unsigned.find(['e', 'E']) {
        Some(i) => (&unsigned[..i], &unsigned[i + 1..]),
        None => (unsigned, "0"),
    };
    let Ok(exp) = exp.parse::<i64>() else {
        return text.to_string();
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // The value is digits × 10^exp, with digits = int ++ frac.
    let digits = || int.bytes().chain(frac.bytes());
    let lead = digits().take_while(|&b| b == b'0').count();
    let total = int.len() + frac.len();
    if lead == total {
        return "0".into();
    }
    let trail = digits().rev().take_while(|&b| b == b'0').count();
    let sig: Vec<u8> = digits().skip(lead).take(total - lead - trail).collect();
    let n = sig.len() as i64;
    let Some(exp) = exp
        .checked_sub(frac.len() as i64)
        .and_then(|e| e.checked_add(trail as i64))
    else {
        return text.to_string();
    };
    // Length of the plain form: digits and zeros, plus "0." before a fraction below 1.
    // (`exp` may be i64::MIN, whose negation overflows: such a value takes the d.ddde form.)
    let plain_len = match exp.checked_neg() {
        _ if exp >= 0 => n.checked_add(exp),
        Some(z) if z < n => Some(n + 1),
        Some(z) => z.checked_add(2),
        None => None,
    };
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    let sig = std::str::from_utf8(&sig).unwrap_or("0");
    match plain_len {
        Some(len) if len <= SESSION_ID_HASH_BYTES_MAX as i64 => {
            if exp >= 0 {
                out.push_str(sig);
                out.extend((0..exp).map(|_| '0'));
            } else if -exp < n {
                let point = (n + exp) as usize;
                out.push_str(&sig[..point]);
                out.push('.');
                out.push_str(&sig[point..]);
            } else {
                out.push_str("0.");
                out.extend((0..-exp - n).map(|_| '0'));
                out.push_str(sig);
            }
        }
        _ => {
            // d.ddd × 10^(exp + n - 1)
            out.push_str(&sig[..1]);
            if n > 1 {
                out.push('.');
                out.push_str(&sig[1..]);
            }
            let _ = write!(out, "e{}", exp.saturating_add(n - 1));
        }
    }
    out
}

/// An object read key by key from a map.
trait FromMap<'de>: Sized {
    fn from_map<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error>;
}

impl<'de> FromMap<'de> for IgnoredAny {
    fn from_map<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        IgnoredAny.visit_map(map)
    }
}

impl<'de: 'a, 'a, O: FromMap<'de>> Deserialize<'de> for Json<'a, O> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor(PhantomData))
    }
}

struct JsonVisitor<'a, O>(PhantomData<(Cow<'a, str>, O)>);

impl<'de: 'a, 'a, O: FromMap<'de>> Visitor<'de> for JsonVisitor<'a, O> {
    type Value = Json<'a, O>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Json::Num(v.to_string()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Json::Num(v.to_string()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Json::Other, |n| Json::Num(n.to_string())))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Owned(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Json::Other)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Json::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        IgnoredAny.visit_seq(seq).map(|_| Json::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        O::from_map(map).map(Json::Object)
    }
}

/// The top-level object.
#[derive(Default)]
pub(super) struct TopObj<'a> {
    pub(super) model: Option<Scalar<'a>>,
    pub(super) stream: Option<Scalar<'a>>,
    pub(super) stream_options: Option<Json<'a, StreamOptionsObj>>,
    pub(super) metadata: Option<Json<'a, MetadataObj<'a>>>,
    pub(super) litellm_metadata: Option<Json<'a, MetadataObj<'a>>>,
    pub(super) user: Option<Scalar<'a>>,
    /// [`BodyFields::billing_prefix`].
    pub(super) billing_prefix: Option<bool>,
}

/// `stream_options`.
#[derive(Default)]
pub(super) struct StreamOptionsObj {
    pub(super) include_usage: Option<bool>,
}

/// `metadata` and `litellm_metadata`.
#[derive(Default)]
pub(super) struct MetadataObj<'a> {
    pub(super) session_id: Option<Scalar<'a>>,
    pub(super) user_id: Option<Json<'a, SessionIdObj<'a>>>,
}

/// An object whose only field of interest is `session_id` (`metadata.user_id`).
#[derive(Default)]
pub(super) struct SessionIdObj<'a> {
    pub(super) session_id: Option<Scalar<'a>>,
}

impl<'de: 'a, 'a> FromMap<'de> for TopObj<'a> {
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut o = TopObj::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Model => o.model = Some(map.next_value()?),
                Key::Stream => o.stream = Some(map.next_value()?),
                Key::StreamOptions => o.stream_options = Some(map.next_value()?),
                Key::Metadata => o.metadata = Some(map.next_value()?),
                Key::LitellmMetadata => o.litellm_metadata = Some(map.next_value()?),
                Key::User => o.user = Some(id_value(&mut map)?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(o)
    }
}

impl<'de> FromMap<'de> for StreamOptionsObj {
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut o = StreamOptionsObj::default();
        while let Some(key) = map.next_key::<Key>()? {
            if key == Key::IncludeUsage {
                o.include_usage = match map.next_value::<Scalar<'_>>()? {
                    Json::Bool(b) => Some(b),
                    _ => None,
                };
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(o)
    }
}

impl<'de: 'a, 'a> FromMap<'de> for MetadataObj<'a> {
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut o = MetadataObj::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::SessionId => o.session_id = Some(id_value(&mut map)?),
                Key::UserId => o.user_id = Some(id_value(&mut map)?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(o)
    }
}

impl<'de: 'a, 'a> FromMap<'de> for SessionIdObj<'a> {
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut o = SessionIdObj::default();
        while let Some(key) = map.next_key::<Key>()? {
            if key == Key::SessionId {
                o.session_id = Some(id_value(&mut map)?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(o)
    }
}

impl SessionIdObj<'_> {
    fn usable_id(self) -> Option<String> {
        self.session_id.and_then(Json::usable_id)
    }
}

/// `metadata.user_id` → (its `session_id`, itself as a plain id).
fn reduce_user_id(v: Json<'_, SessionIdObj<'_>>) -> (Option<String>, Option<String>) {
    match v {
        Json::Object(o) => (o.usable_id(), None),
        Json::Str(s) => {
            let _exact = ExactNumbers::set(true); // a str is UTF-8
            let inner = match serde_json::from_str::<Json<'_, SessionIdObj<'_>>>(&s) {
                Ok(Json::Object(o)) => o.usable_id(),
                _ => None,
            };
            match inner {
                Some(sid) => (Some(sid), None),
                None => (None, Json::<IgnoredAny>::Str(s).usable_id()),
            }
        }
        Json::Num(n) => (None, Some(n)),
        _ => (None, None),
    }
}

/// The parsed object, when the value was one.
fn object<O>(v: Option<Json<'_, O>>) -> Option<O> {
    match v {
        Some(Json::Object(o)) => Some(o),
        _ => None,
    }
}

impl TopObj<'_> {
    /// The fields the router needs, from the parsed top-level object.
    pub(super) fn reduce(self) -> BodyFields {
        let metadata = object(self.metadata);
        let litellm = object(self.litellm_metadata);
        let (metadata_session_id, user_id_field) = match metadata {
            Some(m) => (m.session_id.and_then(Json::usable_id), m.user_id),
            None => (None, None),
        };
        let (user_id_session_id, user_id) = user_id_field.map_or((None, None), reduce_user_id);
        BodyFields {
            model: match self.model {
                Some(Json::Str(s)) => Some(pooled(&s)),
                _ => None,
            },
            stream: matches!(self.stream, Some(Json::Bool(true))),
            has_stream_options: self.stream_options.is_some(),
            include_usage: object(self.stream_options).and_then(|so| so.include_usage),
            metadata_session_id,
            litellm_metadata_session_id: litellm.and_then(|m| m.session_id?.usable_id()),
            user_id_session_id,
            user_id,
            user: self.user.and_then(Json::usable_id),
            billing_prefix: self.billing_prefix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    const ON: SidOptions = SidOptions {
        session_affinity: true,
        body_user_affinity: true,
    };

    fn headers_raw(lines: &[u8]) -> Headers {
        let mut raw = b"POST /r/v1/chat/completions HTTP/1.1\r\nhost: x\r\n".to_vec();
        raw.extend_from_slice(lines);
        raw.extend_from_slice(b"\r\n");
        match crate::http::parse_request(&raw).unwrap() {
            crate::http::HeadParse::Complete(h, _) => h.headers,
            _ => unreachable!(),
        }
    }

    #[test]
    fn dropped_fields_lend_their_strings_to_the_next_body() {
        // Each test runs on its own thread: the spare list starts empty.
        let a = parse_body(br#"{"model":"m-long-name","metadata":{"session_id":"s-1"}}"#).unwrap();
        let ptrs = [
            a.model.as_ref().unwrap().as_ptr(),
            a.metadata_session_id.as_ref().unwrap().as_ptr(),
        ];
        drop(a);
        let b = parse_body(br#"{"model":"m2","metadata":{"session_id":"s-22"}}"#).unwrap();
        // The same buffers, holding only the new values.
        assert_eq!(b.model.as_deref(), Some("m2"));
        assert_eq!(b.metadata_session_id.as_deref(), Some("s-22"));
        let mut reused = [
            b.model.as_ref().unwrap().as_ptr(),
            b.metadata_session_id.as_ref().unwrap().as_ptr(),
        ];
        reused.sort();
        let mut ptrs = ptrs;
        ptrs.sort();
        assert_eq!(reused, ptrs);
        drop(b);
        // A string larger than the bound is freed, not kept; the list is bounded.
        let big = format!(
            r#"{{"model":"{}"}}"#,
            "x".repeat(SPARE_STRING_BYTES_MAX + 1)
        );
        drop(parse_body(big.as_bytes()).unwrap());
        let kept = SPARE_STRINGS.with(|l| l.borrow().iter().map(String::capacity).max());
        assert!(kept.is_some_and(|c| c <= SPARE_STRING_BYTES_MAX));
        for _ in 0..2 * SPARE_STRINGS_MAX {
            drop(body(r#"{"model":"m","user":"u"}"#).clone());
        }
        assert!(SPARE_STRINGS.with(|l| l.borrow().len()) <= SPARE_STRINGS_MAX);
    }

    fn hdrs(list: &[(&str, &str)]) -> Headers {
        let mut lines = Vec::new();
        for (n, v) in list {
            lines.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
        }
        headers_raw(&lines)
    }

    fn body(json: &str) -> BodyFields {
        parse_body(json.as_bytes()).expect("a JSON object")
    }

    /// The id and label for headers and a JSON body, affinity on.
    fn sid(h: &[(&str, &str)], json: &str) -> (Option<String>, String) {
        sid_with(h, json, &ON)
    }

    fn sid_with(h: &[(&str, &str)], json: &str, opts: &SidOptions) -> (Option<String>, String) {
        let b = parse_body(json.as_bytes());
        let headers = hdrs(h);
        let (id, src) = extract(&headers, b.as_ref(), opts);
        if let Some(id) = &id {
            assert_eq!(id.source, src);
        }
        (id.map(|s| s.id.into_owned()), src.label().into_owned())
    }

    fn hit(id: &str, label: &str) -> (Option<String>, String) {
        (Some(id.to_string()), label.to_string())
    }

    fn none() -> (Option<String>, String) {
        (None, "none".to_string())
    }

    #[test]
    fn each_source_wins_alone() {
        assert_eq!(
            sid(&[("X-LiteLLM-Session-Id", "a")], "{}"),
            hit("a", "header:x-litellm-session-id")
        );
        assert_eq!(
            sid(&[("x-claude-code-session-id", "b")], "{}"),
            hit("b", "header:x-claude-code-session-id")
        );
        assert_eq!(
            sid(&[("x-session-id", "c")], "{}"),
            hit("c", "header:x-session-id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"session_id":"d"}}"#),
            hit("d", "body:metadata.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"litellm_metadata":{"session_id":"e"}}"#),
            hit("e", "body:litellm_metadata.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":{"session_id":"f"}}}"#),
            hit("f", "body:metadata.user_id.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"{\"session_id\":\"g\"}"}}"#),
            hit("g", "body:metadata.user_id.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"h"}}"#),
            hit("h", "body:metadata.user_id")
        );
        assert_eq!(sid(&[], r#"{"user":"i"}"#), hit("i", "body:user"));
        assert_eq!(sid(&[], r#"{"model":"m"}"#), none());
        assert_eq!(sid(&[], "not json"), none());
    }

    #[test]
    fn precedence_follows_the_spec_order() {
        let all_body = r#"{"user":"u","metadata":{"user_id":"{\"session_id\":\"us\"}",
            "session_id":"ms"},"litellm_metadata":{"session_id":"ls"}}"#;
        let h3 = [
            ("x-session-id", "h3"),
            ("x-claude-code-session-id", "h2"),
            ("x-litellm-session-id", "h1"),
        ];
        assert_eq!(sid(&h3, all_body), hit("h1", "header:x-litellm-session-id"));
        assert_eq!(
            sid(&h3[..2], all_body),
            hit("h2", "header:x-claude-code-session-id")
        );
        assert_eq!(sid(&h3[..1], all_body), hit("h3", "header:x-session-id"));
        assert_eq!(sid(&[], all_body), hit("ms", "body:metadata.session_id"));
        // litellm_metadata.session_id beats metadata.user_id.session_id.
        assert_eq!(
            sid(
                &[],
                r#"{"user":"u","metadata":{"user_id":{"session_id":"us"}},
                    "litellm_metadata":{"session_id":"ls"}}"#
            ),
            hit("ls", "body:litellm_metadata.session_id")
        );
        // user_id.session_id beats user.
        assert_eq!(
            sid(
                &[],
                r#"{"user":"u","metadata":{"user_id":{"session_id":"us"}}}"#
            ),
            hit("us", "body:metadata.user_id.session_id")
        );
        // plain user_id beats user.
        assert_eq!(
            sid(&[], r#"{"user":"u","metadata":{"user_id":"plain"}}"#),
            hit("plain", "body:metadata.user_id")
        );
    }

    #[test]
    fn blank_values_are_skipped_at_every_level() {
        let blank_headers = [
            ("x-litellm-session-id", ""),
            ("x-claude-code-session-id", " \t "),
            ("x-session-id", "   "),
        ];
        let body_all_blank = r#"{"metadata":{"session_id":"  ","user_id":{"session_id":"\t"}},
            "litellm_metadata":{"session_id":""},"user":"\n"}"#;
        assert_eq!(sid(&blank_headers, body_all_blank), none());
        assert!(!header_decides(&hdrs(&blank_headers)));
        // Each blank level falls through to the next usable one.
        assert_eq!(
            sid(
                &blank_headers,
                r#"{"metadata":{"session_id":" ","user_id":"{\"session_id\":\" \"}"},
                    "litellm_metadata":{"session_id":"\u000b\f"},"user":"u"}"#
            ),
            // The JSON user_id has a blank session_id, so it is used plainly.
            hit("{\"session_id\":\" \"}", "body:metadata.user_id")
        );
        assert_eq!(
            sid(
                &[],
                r#"{"metadata":{"session_id":"","user_id":" "},"user":"u"}"#
            ),
            hit("u", "body:user")
        );
        // Whitespace is ASCII's, as the reference's Lua patterns read it: a no-break space
        // or a line separator is an id's character (the bytes an id is hashed by).
        for id in ["\u{a0}", "\u{2028}", "\u{85}"] {
            let body = serde_json::json!({"metadata": {"session_id": id}, "user": "u"});
            assert_eq!(
                sid(&[], &body.to_string()),
                hit(id, "body:metadata.session_id")
            );
        }
        // Not trimmed otherwise.
        assert_eq!(
            sid(&[], r#"{"metadata":{"session_id":"  s p  "}}"#),
            hit("  s p  ", "body:metadata.session_id")
        );
        assert_eq!(
            sid(&[("x-session-id", "a b")], "{}"),
            hit("a b", "header:x-session-id")
        );
    }

    #[test]
    fn repeated_header_uses_first_non_blank() {
        let h = headers_raw(b"x-session-id: \r\nx-session-id: first\r\nx-session-id: second\r\n");
        let (id, src) = extract(&h, None, &ON);
        assert_eq!(id.unwrap().id, "first");
        assert_eq!(src, Source::Header("x-session-id"));
        assert!(header_decides(&h));
    }

    #[test]
    fn non_utf8_header_ids_stay_apart() {
        // Read as Latin-1: two ids that differ in a byte that is not UTF-8 stay two ids
        // (a lossy read made both "ab\u{fffd}cd").
        let id = |raw: &[u8]| {
            extract(&headers_raw(raw), None, &ON)
                .0
                .unwrap()
                .id
                .to_string()
        };
        let (a, b) = (
            id(b"x-session-id: ab\xffcd\r\n"),
            id(b"x-session-id: ab\xe9cd\r\n"),
        );
        assert_eq!((a.as_ref(), b.as_ref()), ("ab\u{ff}cd", "ab\u{e9}cd"));
        assert_ne!(hash_bytes(&a), hash_bytes(&b));
        assert_eq!(header_value(Some(&b)), "ab%C3%A9cd");
        // UTF-8 is taken as it is.
        assert_eq!(id("x-session-id: ab\u{e9}cd\r\n".as_bytes()), "ab\u{e9}cd");
    }

    #[test]
    fn numbers_are_used_in_decimal_form() {
        assert_eq!(
            sid(&[], r#"{"metadata":{"session_id":42}}"#),
            hit("42", "body:metadata.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"litellm_metadata":{"session_id":-7}}"#),
            hit("-7", "body:litellm_metadata.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":{"session_id":1.5}}}"#),
            hit("1.5", "body:metadata.user_id.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"{\"session_id\":0}"}}"#),
            hit("0", "body:metadata.user_id.session_id")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":18446744073709551615}}"#),
            hit("18446744073709551615", "body:metadata.user_id")
        );
        assert_eq!(sid(&[], r#"{"user":12}"#), hit("12", "body:user"));
        // A JSON-number string in user_id is not an object: used plainly, verbatim.
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"007"}}"#),
            hit("007", "body:metadata.user_id")
        );
    }

    /// SPEC §3.3 "numbers are used in their decimal form": exactly, at any size, and one
    /// form per value (found by the black-box review: integers past u64 were rounded to an
    /// f64, so distinct ids merged, and `1e2` and `100` were two sessions).
    #[test]
    fn numeric_ids_keep_their_exact_value_in_one_form() {
        let sources = [
            (
                r#"{"metadata":{"session_id":N}}"#,
                "body:metadata.session_id",
            ),
            (
                r#"{"litellm_metadata":{"session_id":N}}"#,
                "body:litellm_metadata.session_id",
            ),
            (
                r#"{"metadata":{"user_id":{"session_id":N}}}"#,
                "body:metadata.user_id.session_id",
            ),
            (
                r#"{"metadata":{"user_id":"{\"session_id\":N}"}}"#,
                "body:metadata.user_id.session_id",
            ),
            (r#"{"metadata":{"user_id":N}}"#, "body:metadata.user_id"),
            (r#"{"user":N}"#, "body:user"),
        ];
        let cases = [
            ("18446744073709551616", "18446744073709551616"),
            ("18446744073709551617", "18446744073709551617"),
            ("99999999999999999999999", "99999999999999999999999"),
            ("100000000000000000000001", "100000000000000000000001"),
            ("-100000000000000000000001", "-100000000000000000000001"),
            ("1e2", "100"),
            ("100.0", "100"),
            ("100", "100"),
            ("-0", "0"),
            ("1.5", "1.5"),
            ("1e23", "100000000000000000000000"),
        ];
        for (template, label) in sources {
            for (sent, used) in cases {
                let body = template.replace('N', sent);
                assert_eq!(sid(&[], &body), hit(used, label), "{body}");
            }
        }
    }

    /// Reading numbers from their text must not make serde refuse a body it read before:
    /// one with invalid UTF-8 in a string skipped inside an id field.
    #[test]
    fn a_body_with_invalid_utf8_in_a_skipped_string_still_parses() {
        let body = b"{\"model\":\"m\",\"metadata\":{\"user_id\":[\"\xff\"],\"session_id\":5e0},\"user\":{\"a\":\"\xfe\"}}";
        let f = parse_body(body).expect("read as before");
        assert_eq!(f.model.as_deref(), Some("m"));
        assert_eq!(
            f.metadata_session_id.as_deref(),
            Some("5.0"),
            "serde's reading"
        );
        // The control: the same body in UTF-8 reads the number exactly.
        let utf8 = String::from_utf8_lossy(body).into_owned();
        let f = parse_body(utf8.as_bytes()).unwrap();
        assert_eq!(f.metadata_session_id.as_deref(), Some("5"));
    }

    #[test]
    fn decimal_form_is_exact_and_one_per_value() {
        for (sent, used) in [
            ("0", "0"),
            ("-0.0e5", "0"),
            ("0.000", "0"),
            ("7", "7"),
            ("-7", "-7"),
            ("1E2", "100"),
            ("1.00e+2", "100"),
            ("0.5e1", "5"),
            ("1000e-3", "1"),
            ("123.4500", "123.45"),
            ("1.5e-3", "0.0015"),
            ("-1.5E-3", "-0.0015"),
            ("12.5e-1", "1.25"),
            ("9007199254740993", "9007199254740993"),
            ("12345678901234567890.5", "12345678901234567890.5"),
            ("1e99999999999999999999", "1e99999999999999999999"),
        ] {
            assert_eq!(decimal_form(sent), used, "{sent}");
        }
        // A short number never grows past the hashed length: beyond it, d.ddde<exp>.
        let plain = decimal_form("1e4095");
        assert_eq!(plain.len(), SESSION_ID_HASH_BYTES_MAX);
        assert!(plain.starts_with('1') && plain[1..].bytes().all(|b| b == b'0'));
        assert_eq!(decimal_form("1e4096"), "1e4096");
        assert_eq!(decimal_form("10e4095"), "1e4096");
        assert_eq!(decimal_form("12.5e5000"), "1.25e5001");
        assert_eq!(decimal_form("-1e999999"), "-1e999999");
        let tiny = decimal_form("1e-4094");
        assert_eq!(tiny.len(), SESSION_ID_HASH_BYTES_MAX);
        assert!(tiny.starts_with("0.000") && tiny.ends_with("01"));
        assert_eq!(decimal_form("1e-4095"), "1e-4095");
        assert_eq!(decimal_form("0.1e-4094"), "1e-4095");
        // Exponents at the ends of i64, where a negation or a sum overflows: no panic
        // (client bytes), one form per value or the text as sent.
        assert_eq!(
            decimal_form("1e-9223372036854775808"),
            "1e-9223372036854775808"
        );
        assert_eq!(
            decimal_form("-25e-9223372036854775807"),
            "-2.5e-9223372036854775806"
        );
        for text in [
            "1e9223372036854775807",
            "99e9223372036854775807",
            "1.5e-9223372036854775808",
            "0.001e-9223372036854775806",
            "100e-9223372036854775808",
            "-1e-9223372036854775809",
            "1.000e9223372036854775807",
        ] {
            let out = decimal_form(text);
            assert!(!out.is_empty() && out.len() <= 64, "{text} -> {out}");
        }
        // Through the body, as a client sends it.
        for body in [
            r#"{"user":1e-9223372036854775808}"#,
            r#"{"metadata":{"session_id":-1e-9223372036854775808}}"#,
            r#"{"metadata":{"user_id":1.5e-9223372036854775808}}"#,
        ] {
            assert!(sid(&[], body).0.is_some(), "{body}");
        }
    }

    #[test]
    fn non_ids_are_ignored() {
        for v in ["true", "false", "null", "[]", "[\"a\"]", "{}", "{\"a\":1}"] {
            let j = format!(
                r#"{{"metadata":{{"session_id":{v}}},"litellm_metadata":{{"session_id":{v}}},"user":{v}}}"#
            );
            assert_eq!(sid(&[], &j), none(), "{j}");
        }
        // metadata that is not an object contributes nothing.
        assert_eq!(
            sid(&[], r#"{"metadata":"s","litellm_metadata":[1],"user":"u"}"#),
            hit("u", "body:user")
        );
    }

    #[test]
    fn user_id_object_without_session_id_is_not_used_plainly() {
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":{"name":"x"}},"user":"u"}"#),
            hit("u", "body:user")
        );
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":{"session_id":" "}}}"#),
            none()
        );
    }

    #[test]
    fn user_id_string_forms() {
        // JSON object without session_id → plain.
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"{\"user\":\"x\"}"}}"#),
            hit("{\"user\":\"x\"}", "body:metadata.user_id")
        );
        // Not JSON → plain.
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"{broken"}}"#),
            hit("{broken", "body:metadata.user_id")
        );
        // JSON object with session_id an object → plain.
        assert_eq!(
            sid(&[], r#"{"metadata":{"user_id":"{\"session_id\":{}}"}}"#),
            hit("{\"session_id\":{}}", "body:metadata.user_id")
        );
        // Claude Code style.
        let b = body(
            r#"{"metadata":{"user_id":"{\"device_id\":\"d\",\"session_id\":\"5f0e-\u00e9\"}"}}"#,
        );
        assert_eq!(b.user_id_session_id.as_deref(), Some("5f0e-é"));
        assert_eq!(b.user_id, None);
    }

    #[test]
    fn escaped_strings_are_decoded() {
        assert_eq!(
            sid(
                &[],
                r#"{"metadata":{"session_id":"caf\u00e9 \"q\" \\ \ud83d\ude00"}}"#
            ),
            hit("café \"q\" \\ 😀", "body:metadata.session_id")
        );
        // Escaped keys match too.
        assert_eq!(
            sid(&[], r#"{"met\u0061data":{"session_\u0069d":"k"}}"#),
            hit("k", "body:metadata.session_id")
        );
        let b = body(r#"{"model":"a\/b\n"}"#);
        assert_eq!(b.model.as_deref(), Some("a/b\n"));
    }

    #[test]
    fn non_json_body_yields_no_body_id_but_headers_work() {
        assert_eq!(parse_body(b"metadata.session_id=x"), None);
        assert_eq!(
            sid(&[("x-session-id", "h")], "garbage"),
            hit("h", "header:x-session-id")
        );
        let empty = hdrs(&[]);
        let (id, src) = extract(&empty, None, &ON);
        assert_eq!((id, src), (None, Source::None));
    }

    #[test]
    fn parse_body_rejects_non_objects() {
        for b in [
            &b""[..],
            b"   ",
            b"[]",
            b"[{\"user\":\"u\"}]",
            b"\"str\"",
            b"42",
            b"null",
            b"true",
            b"{",
            b"{\"user\":\"u\"",
            b"{\"user\":\"u\",}",
            b"{\"user\":\"u\"} x",
            b"{\"user\":\"u\"}{}",
            b"{\"messages\":[1,2,}",
            b"{\"user\":\"\xff\"}",
            b"\xef\xbb\xbf{}",
        ] {
            assert_eq!(parse_body(b), None, "{:?}", String::from_utf8_lossy(b));
        }
        assert!(parse_body(b" {}\n").is_some());
    }

    #[test]
    fn body_user_affinity_off_skips_user() {
        let opts = SidOptions {
            session_affinity: true,
            body_user_affinity: false,
        };
        assert_eq!(sid_with(&[], r#"{"user":"u"}"#, &opts), none());
        assert_eq!(
            sid_with(&[], r#"{"user":"u","metadata":{"user_id":"p"}}"#, &opts),
            hit("p", "body:metadata.user_id")
        );
    }

    #[test]
    fn affinity_off_drops_the_id_only_when_one_exists() {
        let opts = SidOptions {
            session_affinity: false,
            body_user_affinity: true,
        };
        assert_eq!(
            sid_with(&[("x-session-id", "h")], "{}", &opts),
            (None, "affinity_off".to_string())
        );
        assert_eq!(
            sid_with(&[], r#"{"user":"u"}"#, &opts),
            (None, "affinity_off".to_string())
        );
        assert_eq!(sid_with(&[], r#"{"user":" "}"#, &opts), none());
        let both_off = SidOptions {
            session_affinity: false,
            body_user_affinity: false,
        };
        assert_eq!(sid_with(&[], r#"{"user":"u"}"#, &both_off), none());
    }

    #[test]
    fn model_stream_and_include_usage() {
        let b = body(
            r#"{"model":"llama","stream":true,"stream_options":{"include_usage":false},
                "messages":[{"role":"user","content":"hi"}]}"#,
        );
        assert_eq!(b.model.as_deref(), Some("llama"));
        assert!(b.stream);
        assert_eq!(b.include_usage, Some(false));
        let b = body(r#"{"model":7,"stream":"true","stream_options":{"include_usage":1}}"#);
        assert_eq!(
            (b.model.clone(), b.stream, b.include_usage),
            (None, false, None)
        );
        let b = body(r#"{"stream":1,"stream_options":true}"#);
        assert_eq!((b.stream, b.include_usage), (false, None));
        assert!(b.has_stream_options);
        assert!(body(r#"{"stream_options":null}"#).has_stream_options);
        assert!(!body(r#"{"x":{"stream_options":{}}}"#).has_stream_options);
        let b = body(r#"{"stream_options":{"include_usage":true}}"#);
        assert_eq!(b.include_usage, Some(true));
        let mut empty = BodyFields::default();
        empty.billing_prefix = Some(false);
        assert_eq!(body("{}"), empty);
        // A key sent twice counts by its last occurrence.
        let b = body(r#"{"model":"a","stream":true,"model":"b","stream":false}"#);
        assert_eq!((b.model.as_deref(), b.stream), (Some("b"), false));
    }

    #[test]
    fn unknown_fields_of_any_shape_are_skipped() {
        let b = body(
            r#"{"x":[[[{"metadata":{"session_id":"no"}}]]],"y":{"user":"no"},"z":null,
                "tools":[{"a":1e5,"b":-0.5,"c":"\u0000"}],"user":"yes"}"#,
        );
        assert_eq!(b.user.as_deref(), Some("yes"));
        assert_eq!(b.metadata_session_id, None);
        // Deep nesting inside a skipped value is fine (skipping is not recursive).
        let deep = format!(
            r#"{{"x":{}{},"user":"u"}}"#,
            "[".repeat(5000),
            "]".repeat(5000)
        );
        assert_eq!(body(&deep).user.as_deref(), Some("u"));
    }

    #[test]
    fn the_indexed_header_sources_are_the_named_ones() {
        let names: Vec<&str> = HEADER_SOURCES.iter().map(|(k, _)| k.name()).collect();
        assert_eq!(
            names,
            [
                "x-litellm-session-id",
                "x-claude-code-session-id",
                "x-session-id"
            ]
        );
        for (k, label) in HEADER_SOURCES {
            assert_eq!(label, format!("header:{}", k.name()));
        }
    }

    #[test]
    fn header_decides_only_on_a_usable_header() {
        assert!(header_decides(&hdrs(&[("x-claude-code-session-id", "x")])));
        assert!(!header_decides(&hdrs(&[("x-other-session-id", "x")])));
        assert!(!header_decides(&hdrs(&[])));
    }

    #[test]
    fn labels() {
        assert_eq!(Source::None.label(), "none");
        assert_eq!(Source::AffinityOff.label(), "affinity_off");
        assert_eq!(
            Source::Header("x-session-id").label(),
            "header:x-session-id"
        );
        assert!(matches!(
            Source::Body("metadata.user_id").label(),
            Cow::Borrowed("body:metadata.user_id")
        ));
        assert_eq!(Source::Body("other").label(), "body:other");
    }

    #[test]
    fn header_value_sanitises() {
        assert_eq!(header_value(None), "-");
        assert_eq!(header_value(Some("abc-123_X")), "abc-123_X");
        assert!(matches!(header_value(Some("abc-123_X")), Cow::Borrowed(_)));
        assert!(matches!(header_value(Some("a b")), Cow::Owned(_)));
        assert_eq!(header_value(Some("a b")), "a%20b");
        assert_eq!(header_value(Some("a\r\nX-Evil: 1")), "a%0D%0AX-Evil:%201");
        assert_eq!(header_value(Some("\0\t\x7f")), "%00%09%7F");
        assert_eq!(header_value(Some("100%")), "100%25");
        assert_eq!(header_value(Some("é")), "%C3%A9");
        let exact = "a".repeat(128);
        assert_eq!(header_value(Some(&exact)), exact);
        let long = "b".repeat(129);
        assert_eq!(header_value(Some(&long)), format!("{}...", "b".repeat(128)));
        // 127 ASCII bytes then a 2-byte char straddling the cut: cut before it.
        let straddle = format!("{}é", "c".repeat(127));
        assert_eq!(
            header_value(Some(&straddle)),
            format!("{}...", "c".repeat(127))
        );
        // Encoded output may exceed 128 bytes; the cut is on the original id.
        let wide = "é".repeat(100);
        assert_eq!(
            header_value(Some(&wide)),
            format!("{}...", "%C3%A9".repeat(64))
        );
    }

    #[test]
    fn hash_bytes_caps_at_4_kib() {
        assert_eq!(hash_bytes("abc"), b"abc");
        let long = "x".repeat(10_000);
        assert_eq!(hash_bytes(&long).len(), 4096);
        let exact = "y".repeat(4096);
        assert_eq!(hash_bytes(&exact), exact.as_bytes());
    }

    /// A body of about `bytes` whose `messages` array dwarfs everything, ids at the end.
    fn big_body(bytes: usize) -> Vec<u8> {
        let msg = r#"{"role":"user","content":"lorem ipsum \"dolor\" sit amet \u00e9 [ { } ] , : 12345"},"#;
        let mut b = br#"{"model":"big","messages":["#.to_vec();
        while b.len() < bytes {
            b.extend_from_slice(msg.as_bytes());
        }
        b.pop();
        b.extend_from_slice(br#"],"metadata":{"session_id":"tail"},"stream":true}"#);
        b
    }

    fn best_of_3(b: &[u8]) -> Duration {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                let f = parse_body(b).unwrap();
                assert_eq!(f.metadata_session_id.as_deref(), Some("tail"));
                t.elapsed()
            })
            .min()
            .unwrap()
    }

    #[test]
    fn big_body_parses_in_linear_time() {
        let big = big_body(5 << 20);
        let f = parse_body(&big).unwrap();
        assert_eq!(f.model.as_deref(), Some("big"));
        assert!(f.stream);
        let small = big_body(640 << 10);
        let t_small = best_of_3(&small);
        let t_big = best_of_3(&big);
        // Linear: ~8x. Quadratic would be ~64x. Debug builds still do >10 MB/s.
        assert!(t_big < Duration::from_secs(5), "5 MiB took {t_big:?}");
        assert!(
            t_big < t_small * 32 + Duration::from_millis(50),
            "small {t_small:?}, big {t_big:?}"
        );
    }

    use crate::testutil::XorShift;

    #[test]
    fn random_mutations_never_panic() {
        let seeds: [&[u8]; 5] = [
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"metadata":{"session_id":"s","user_id":"{\"session_id\":\"u\\u00e9\"}"},"litellm_metadata":{"session_id":42},"user":"x","messages":[{"role":"user","content":"hi \"there\""}]}"#,
            br#"{"metadata":{"user_id":{"session_id":1.5e3,"x":[null,true,false]}},"user":" "}"#,
            br#"{"metadata":{"user_id":"{\"session_id\":{\"a\":[1,2]}}"},"tools":[[[]]],"n":-0.0}"#,
            br#"[{"user":"u"}, 1, "s", null]"#,
            br#"{"m\u0065tadata":{"session_id":"\ud83d\ude00\n\r\u0000"}}"#,
        ];
        let specials: &[&[u8]] = &[
            b"{", b"}", b"[", b"]", b"\"", b"\\", b"\\u", b"\\ud800", b":", b",", b"\xff", b"\xc3",
            b"\r\n", b" ", b"1e999", b"-", b"null",
        ];
        let h = hdrs(&[]);
        let mut rng = XorShift::new(0x9e37_79b9_7f4a_7c15);
        for i in 0..4000 {
            let b = crate::testutil::mutate(&mut rng, seeds[i % seeds.len()], specials);
            let fields = parse_body(&b);
            // Whatever a tree parser reads as an object, the one-pass parser reads too.
            if let Ok(serde_json::Value::Object(v)) = serde_json::from_slice(&b) {
                let f = fields.as_ref().expect("a JSON object parses");
                assert_eq!(f.model.as_deref(), v.get("model").and_then(|m| m.as_str()));
                assert_eq!(
                    f.stream,
                    v.get("stream") == Some(&serde_json::Value::Bool(true))
                );
            }
            for opts in [
                ON,
                SidOptions {
                    session_affinity: true,
                    body_user_affinity: false,
                },
            ] {
                let (id, src) = extract(&h, fields.as_ref(), &opts);
                if let Some(id) = &id {
                    assert!(!is_blank(&id.id));
                    assert_eq!(id.source, src);
                }
                let v = header_value(id.as_ref().map(|s| &*s.id));
                assert!(v.bytes().all(|c| (0x21..=0x7e).contains(&c)), "{v:?}");
                let _ = src.label();
            }
        }
    }
}
