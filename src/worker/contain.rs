//! A connection's task with a panic stopped at the task.
//!
//! monoio does not catch a panic in a spawned task: it unwinds the worker's thread, and the
//! worker is gone while the process lives on. Its listener closes; the connections it held
//! and those in its accept queue are dropped, and with one worker the router answers
//! nothing at all. A panic is a bug, but one request's bug should cost that request's
//! connection, not the worker. Each connection's task is therefore polled under
//! `catch_unwind`: a panic ends that task (its state unwinds; the guards it holds give back
//! their in-flight counts and buffers as they drop), the caller is told, and the worker goes
//! on serving its other connections.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::task::Poll;

/// Run the future `make` builds to its end; if a poll of it panics, stop polling it, drop
/// it and hand the panic's message to `on_panic`. The future is built here, in place: taken
/// by value it would be held twice, the moved-in argument beside the pinned copy, and a
/// connection's task is held for the connection's whole life.
pub async fn contained<M, F, P>(make: M, on_panic: P)
where
    M: FnOnce() -> F,
    F: Future<Output = ()>,
    P: FnOnce(&str),
{
    let mut fut = std::pin::pin!(make());
    let panicked = std::future::poll_fn(|cx| {
        // Unwind safety: after a panic the future is never polled again, only dropped,
        // and nothing else observes the state it was left in.
        match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) => Poll::Ready(None),
            Err(payload) => Poll::Ready(Some(payload)),
        }
    })
    .await;
    if let Some(payload) = panicked {
        on_panic(message(payload.as_ref()));
    }
}

/// Route every panic to the log as one event: its thread, location and message, and a
/// backtrace when `RUST_BACKTRACE` asks for one. The default hook writes plain lines to
/// stderr instead, which a `--log-json` log cannot parse, and the location a bug report
/// needs is only there. Call it after the log is set up: before, the event goes nowhere.
pub fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let current = std::thread::current();
        let thread = current.name().unwrap_or("unnamed");
        let location = info.location().map(ToString::to_string).unwrap_or_default();
        let panic = info.payload_as_str().unwrap_or("(no message)");
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            tracing::error!(thread, location, panic, %backtrace, "panicked");
        } else {
            tracing::error!(thread, location, panic, "panicked");
        }
    }));
}

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
fn message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;
    use std::time::Duration;

    struct Guard(Rc<Cell<u32>>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    #[test]
    fn a_panicking_task_ends_alone_and_the_runtime_serves_on() {
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let dropped = Rc::new(Cell::new(0));
            let told = Rc::new(RefCell::new(Vec::<String>::new()));
            let finished = Rc::new(Cell::new(false));
            // A task that panics after a wait, holding a guard; a second one that runs on.
            let g = Guard(dropped.clone());
            let t = told.clone();
            let bad = monoio::spawn(contained(
                move || async move {
                    let _g = g;
                    monoio::time::sleep(Duration::from_millis(5)).await;
                    // Deliberately: the bug being contained.
                    panic!("a bug in a connection task");
                },
                move |m| t.borrow_mut().push(m.to_string()),
            ));
            let f = finished.clone();
            let good = monoio::spawn(contained(
                move || async move {
                    monoio::time::sleep(Duration::from_millis(20)).await;
                    f.set(true);
                },
                |_| panic!("this task does not panic"),
            ));
            bad.await;
            // The panicking task's state was dropped (its guard ran) and its message passed on.
            assert_eq!(dropped.get(), 1);
            assert_eq!(*told.borrow(), ["a bug in a connection task"]);
            good.await;
            assert!(finished.get(), "the other task ran to its end");
        });
    }

    #[test]
    fn a_task_that_ends_normally_is_not_reported() {
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .build()
            .unwrap();
        let ran = Rc::new(Cell::new(false));
        let r = ran.clone();
        rt.block_on(contained(
            move || async move { r.set(true) },
            |m| panic!("reported a panic that did not happen: {m}"),
        ));
        assert!(ran.get());
    }

    /// A log that writes into a shared buffer.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn panics_go_to_the_log_with_their_location() {
        let log = Captured::default();
        let subscriber = || {
            let w = log.clone();
            tracing_subscriber::fmt()
                .with_writer(move || w.clone())
                .with_ansi(false)
                .finish()
        };
        let panic_line = line!() + 3;
        let panic_here = |what: &'static str| {
            tracing::subscriber::with_default(subscriber(), || {
                std::panic::catch_unwind(|| panic!("{what}")).unwrap_err()
            })
        };
        // Control: the default hook does not write to the log.
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        panic_here("unseen, deliberately");
        assert_eq!(log.text(), "", "a hook that does not log");
        log_panics();
        panic_here("seen, deliberately");
        std::panic::set_hook(before);
        let text = log.text();
        assert!(text.contains(r#"panic="seen, deliberately""#), "{text}");
        let location = format!(r#"location="{}:{panic_line}:"#, file!());
        assert!(text.contains(&location), "{text}");
        assert!(text.contains(" ERROR "), "{text}");
        assert_eq!(
            text.matches("location=").count(),
            1,
            "one event per panic: {text}"
        );
    }

    #[test]
    fn the_wrapped_task_is_not_held_twice() {
        // A connection's task is held for the connection's whole life (an open stream's
        // memory): the wrapper must build the future in place, not keep a moved-in copy
        // of it next to the pinned one.
        let make = || async {
            let buf = [0u8; 4096];
            monoio::time::sleep(Duration::from_millis(1)).await;
            std::hint::black_box(&buf);
        };
        let inner = std::mem::size_of_val(&make());
        let wrapped = std::mem::size_of_val(&contained(make, |_| {}));
        assert!(inner >= 4096, "{inner}");
        assert!(wrapped < inner + 256, "inner {inner}, wrapped {wrapped}");
    }

    #[test]
    fn messages_of_both_panic_kinds_are_read() {
        let s: Box<dyn Any + Send> = Box::new("static");
        let o: Box<dyn Any + Send> = Box::new(format!("formatted {}", 1));
        let n: Box<dyn Any + Send> = Box::new(7u8);
        assert_eq!(message(s.as_ref()), "static");
        assert_eq!(message(o.as_ref()), "formatted 1");
        assert_eq!(message(n.as_ref()), "(no message)");
    }
}
