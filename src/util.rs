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
