//! A single-thread, fire-once notification: lets every idle connection of a worker learn
//! at once that the worker is draining, without polling.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// The waiters live in slots reused through a free list: every request head waits on the
/// drain notification, so registering must cost no hashing and no allocation.
#[derive(Default)]
struct Inner {
    fired: Cell<bool>,
    slots: RefCell<Vec<Option<Waker>>>,
    free: RefCell<Vec<usize>>,
}

/// Cloneable handle; all clones share one state.
#[derive(Clone, Default)]
pub struct LocalNotify(Rc<Inner>);

impl LocalNotify {
    pub fn fire(&self) {
        self.0.fired.set(true);
        // Taken out first: a woken task may register or drop a waiter right away.
        let wakers: Vec<Waker> = self
            .0
            .slots
            .borrow_mut()
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        for w in wakers {
            w.wake();
        }
    }

    pub fn is_fired(&self) -> bool {
        self.0.fired.get()
    }

    /// Completes once `fire` has been called (immediately if it already was).
    pub fn wait(&self) -> Fired {
        Fired {
            inner: self.0.clone(),
            slot: None,
        }
    }

    /// Waiters registered now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.0.slots.borrow().iter().filter(|w| w.is_some()).count()
    }
}

/// Future returned by [`LocalNotify::wait`]; deregisters itself when dropped.
pub struct Fired {
    inner: Rc<Inner>,
    /// Its slot, once polled.
    slot: Option<usize>,
}

impl Future for Fired {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.inner.fired.get() {
            return Poll::Ready(());
        }
        let inner = self.inner.clone();
        let mut slots = inner.slots.borrow_mut();
        match self.slot {
            Some(i) => {
                if !slots[i].as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    slots[i] = Some(cx.waker().clone());
                }
            }
            None => {
                let i = match inner.free.borrow_mut().pop() {
                    Some(i) => i,
                    None => {
                        slots.push(None);
                        slots.len() - 1
                    }
                };
                slots[i] = Some(cx.waker().clone());
                self.slot = Some(i);
            }
        }
        Poll::Pending
    }
}

impl Drop for Fired {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            self.inner.slots.borrow_mut()[i] = None;
            self.inner.free.borrow_mut().push(i);
        }
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
            assert_eq!(n.waiting(), 1, "the dropped waiter is gone");
            n.fire();
            assert_eq!(h.await, 7);
            assert!(n.is_fired());
            n.wait().await;
        });
    }

    #[test]
    fn slots_of_dropped_waiters_are_reused_and_all_wake_on_fire() {
        let n = LocalNotify::default();
        let mut cx = Context::from_waker(Waker::noop());
        // A thousand waits in turn, each polled (registered) then dropped: one slot.
        for _ in 0..1000 {
            let mut w = n.wait();
            assert!(Pin::new(&mut w).poll(&mut cx).is_pending());
            assert!(Pin::new(&mut w).poll(&mut cx).is_pending(), "polled again");
        }
        assert_eq!(n.0.slots.borrow().len(), 1);
        assert_eq!(n.waiting(), 0);
        // Several at once take several slots; fire completes every one of them.
        let mut ws: Vec<Fired> = (0..5).map(|_| n.wait()).collect();
        for w in &mut ws {
            assert!(Pin::new(w).poll(&mut cx).is_pending());
        }
        assert_eq!(n.waiting(), 5);
        n.fire();
        assert_eq!(n.waiting(), 0);
        for w in &mut ws {
            assert!(Pin::new(w).poll(&mut cx).is_ready());
        }
    }
}
