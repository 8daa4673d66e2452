//! Tracing helpers for tests that watch the pool's events by message: a layer that hands every
//! event's message to a function, the message of one event, and a bounded run on a thread for
//! subscribers that could deadlock (a deadlock hangs rather than fails).

use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

// Not every test binary that includes this module watches events.
#[allow(unused_imports)]
pub use cumem_sys::testing::event_message as message;

/// A tracing layer that calls its function with every event's message.
pub struct OnEvent<F>(pub F);

impl<S: tracing::Subscriber, F: Fn(&str) + Send + Sync + 'static> tracing_subscriber::Layer<S>
    for OnEvent<F>
{
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        (self.0)(&message(event))
    }
}

/// Runs `work` on a thread and returns what it returned. Panics with `deadlocked` if it does not
/// end within 20 seconds, and if it panicked.
pub fn on_a_thread_within_20s<T: Send + 'static>(
    deadlocked: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || tx.send(work()).unwrap());
    let out = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => out,
        Err(RecvTimeoutError::Timeout) => panic!("{deadlocked}"),
        Err(RecvTimeoutError::Disconnected) => panic!("the worker panicked (see above)"),
    };
    worker.join().unwrap();
    out
}
