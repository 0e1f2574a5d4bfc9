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
}
