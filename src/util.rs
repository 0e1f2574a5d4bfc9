//! Small helpers shared across modules: racing two futures, and cutting text for messages.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

pub enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Wait for whichever of two futures finishes first, preferring `a` when both are ready.
/// The loser is dropped.
pub async fn race<A: Future, B: Future>(a: A, b: B) -> Either<A::Output, B::Output> {
    let mut a = pin!(a);
    let mut b = pin!(b);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = a.as_mut().poll(cx) {
            return Poll::Ready(Either::Left(v));
        }
        if let Poll::Ready(v) = b.as_mut().poll(cx) {
            return Poll::Ready(Either::Right(v));
        }
        Poll::Pending
    })
    .await
}

/// Cut `s` to at most `keep` bytes (at a character boundary) and mark the cut with `...`.
pub fn truncate_with_ellipsis(s: &mut String, keep: usize) {
    let mut cut = keep.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str("...");
}

/// A short rendering of a TOML value for messages: strings quoted, anything longer than
/// 64 bytes cut to 64 with `...`.
pub fn show_toml(v: &toml::Value) -> String {
    let mut s = v.to_string();
    if s.len() > 64 {
        truncate_with_ellipsis(&mut s, 61);
    }
    s
}

/// Whether re-encoding `v` writes every number as the text it was read from would mean:
/// false when a number was an integer beyond 64 bits (`123456789012345678901234567890`),
/// which serde_json reads as a double, and so would write back rounded
/// (`1.2345678901234568e+29`). A rewrite that re-encodes a decoded text leaves such a text
/// as it is instead (fail-open).
pub fn json_numbers_exact(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Number(n) => n
            .as_f64()
            .filter(|_| n.is_f64())
            .is_none_or(|f| !(f.fract() == 0.0 && f.abs() >= 9.223_372_036_854_776e18)),
        Value::Array(items) => items.iter().all(json_numbers_exact),
        Value::Object(m) => m.values().all(json_numbers_exact),
        _ => true,
    }
}

/// `bytes` parsed as one JSON value, the way [`serde_json::from_slice`] into a
/// [`serde_json::Value`] would, but with every object read as the object it is.
///
/// The build enables serde_json's `raw_value` feature (numeric session ids), and with it
/// `Value`'s own parser reads an object whose first key is `$serde_json::private::RawValue`
/// as the JSON text inside that key's string value. A client could send
/// `"stream_options":{"$serde_json::private::RawValue":"{\"include_usage\":true}"}`: the
/// router would read `include_usage` as set and not inject it, while the engine reads an
/// object without it and sends no usage. Every parse of bytes from a client or a peer into a
/// `Value` goes through here instead.
pub fn json_value(bytes: &[u8]) -> serde_json::Result<serde_json::Value> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = PlainValue.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A [`serde_json::Value`] read without the `raw_value` key's special meaning.
struct PlainValue;

impl<'de> serde::de::DeserializeSeed<'de> for PlainValue {
    type Value = serde_json::Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for PlainValue {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Number(n.into()))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Number(n.into()))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(serde_json::Value::Null, Into::into))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(serde_json::Value::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
        Ok(serde_json::Value::String(s))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(v) = seq.next_element_seed(PlainValue)? {
            items.push(v);
        }
        Ok(serde_json::Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut m = serde_json::Map::new();
        // Keys as plain strings: `String`'s own reading knows no special key.
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(PlainValue)?;
            // A key sent twice counts by its last occurrence, as `Value` reads it.
            m.insert(k, v);
        }
        Ok(serde_json::Value::Object(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_a_character_boundary_and_marks_the_cut() {
        let mut s = "aé".repeat(3);
        truncate_with_ellipsis(&mut s, 4);
        assert_eq!(s, "aéa...");
        let long = toml::Value::String("x".repeat(100));
        assert_eq!(show_toml(&long), format!("\"{}...", "x".repeat(60)));
        assert_eq!(show_toml(&toml::Value::Integer(5)), "5");
    }

    #[test]
    fn the_raw_value_key_is_an_ordinary_key() {
        use serde_json::{json, Value};
        let token = "$serde_json::private::RawValue";
        // The control: serde_json's own `Value` reads the object as the text inside it.
        let body = format!(r#"{{"{token}":"{{\"include_usage\":true}}"}}"#);
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap(),
            json!({"include_usage": true})
        );
        assert_eq!(
            json_value(body.as_bytes()).unwrap(),
            json!({ token: "{\"include_usage\":true}" })
        );
        // Escaped, the same key (keys are compared decoded).
        let escaped = r#"{"\u0024serde_json::private::RawValue":"1"}"#;
        assert_eq!(
            json_value(escaped.as_bytes()).unwrap(),
            json!({ token: "1" })
        );
    }

    #[test]
    fn json_value_reads_what_serde_json_reads() {
        for t in [
            r#"{"a":[1,-2,3.5,1e-7,"x\u00e9",true,false,null,{"b":{}}],"a":0}"#,
            r#"[1e400000000]"#,
            r#"[]"#,
            r#" 18446744073709551615 "#,
            r#"-9223372036854775808"#,
            r#""s""#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.7}"#,
        ] {
            let ours = json_value(t.as_bytes());
            let theirs = serde_json::from_str::<serde_json::Value>(t);
            assert_eq!(ours.is_ok(), theirs.is_ok(), "{t}");
            if let (Ok(a), Ok(b)) = (ours, theirs) {
                assert_eq!(a, b, "{t}");
            }
        }
        for bad in ["", "{", "[1,]", r#"{"a":1} x"#, "\u{feff}{}", "nul"] {
            assert!(json_value(bad.as_bytes()).is_err(), "{bad}");
            assert!(
                serde_json::from_str::<serde_json::Value>(bad).is_err(),
                "{bad}"
            );
        }
        // Nesting is limited as serde_json limits it.
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(json_value(deep.as_bytes()).is_err());
    }

    #[test]
    fn numbers_beyond_64_bits_are_not_exact() {
        let exact = |t: &str| super::json_numbers_exact(&serde_json::from_str(t).unwrap());
        assert!(exact(
            r#"{"a":[1,-2,18446744073709551615,-9223372036854775808,0.5,1e5,1.0]}"#
        ));
        assert!(!exact(r#"{"a":{"seed":123456789012345678901234567890}}"#));
        assert!(!exact(r#"[18446744073709551616]"#));
        assert!(!exact(r#"[-9223372036854775809]"#));
    }
}
