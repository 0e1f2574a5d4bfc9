//! A single-thread, fire-once notification: lets every idle connection of a worker learn
//! at once that the worker is draining, without polling.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
struct Inner {
    fired: Cell<bool>,
    next_key: Cell<u64>,
    waiters: RefCell<HashMap<u64, Waker>>,
}

/// Cloneable handle; all clones share one state.
#[derive(Clone, Default)]
pub struct LocalNotify(Rc<Inner>);

impl LocalNotify {
    pub fn fire(&self) {
        self.0.fired.set(true);
        let waiters = std::mem::take(&mut *self.0.waiters.borrow_mut());
        for (_, w) in waiters {
            w.wake();
        }
    }

    pub fn is_fired(&self) -> bool {
        self.0.fired.get()
    }

    /// Completes once `fire` has been called (immediately if it already was).
    pub fn wait(&self) -> Fired {
        let key = self.0.next_key.get();
        self.0.next_key.set(key + 1);
        Fired {
            inner: self.0.clone(),
            key,
        }
    }
}

/// Future returned by [`LocalNotify::wait`]; deregisters itself when dropped.
pub struct Fired {
    inner: Rc<Inner>,
    key: u64,
}

impl Future for Fired {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.inner.fired.get() {
            return Poll::Ready(());
        }
        self.inner
            .waiters
            .borrow_mut()
            .insert(self.key, cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Fired {
    fn drop(&mut self) {
        self.inner.waiters.borrow_mut().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fire_wakes_waiters_and_drop_deregisters() {
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let n = LocalNotify::default();
            let n2 = n.clone();
            let h = monoio::spawn(async move {
                n2.wait().await;
                7
            });
            {
                let w = n.wait();
                let _ = monoio::time::timeout(std::time::Duration::from_millis(5), w).await;
            }
            monoio::time::sleep(std::time::Duration::from_millis(5)).await;
            assert_eq!(n.0.waiters.borrow().len(), 1, "the dropped waiter is gone");
            n.fire();
            assert_eq!(h.await, 7);
            assert!(n.is_fired());
            n.wait().await;
        });
    }
}
