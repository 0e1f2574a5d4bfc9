//! Small async helpers shared by the worker and the pipeline.

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
