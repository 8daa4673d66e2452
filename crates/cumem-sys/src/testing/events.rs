//! Tracing helpers for tests that react to cumem's events: a subscriber that hands every event to
//! a function, the message of one event, and [`with_subscriber`], which a test uses in place of
//! `tracing::subscriber::with_default` so that tests running beside it cannot hide its events.
//!
//! ```
//! use cumem_sys::testing::{OnEvent, event_message, with_subscriber};
//! let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
//! let log = seen.clone();
//! let subscriber = OnEvent(move |e: &tracing::Event<'_>| log.lock().unwrap().push(event_message(e)));
//! with_subscriber(subscriber, || tracing::warn!("hello"));
//! assert_eq!(*seen.lock().unwrap(), ["hello"]);
//! ```

use std::sync::OnceLock;

/// A tracing subscriber that hands every event to its function and keeps no spans: for tests that
/// only react to events (count them, read state from inside one, panic on one).
pub struct OnEvent<F>(pub F);

impl<F: Fn(&tracing::Event<'_>) + Send + Sync + 'static> tracing::Subscriber for OnEvent<F> {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        (self.0)(event)
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Runs `f` with `subscriber` as this thread's default, like `tracing::subscriber::with_default`,
/// but so that every event `f` emits reaches it even when other threads emit the same events for
/// the first time meanwhile (as the other tests of a binary do).
///
/// tracing caches, per call site, whether any subscriber wants it, when the site is first reached.
/// While at most one subscriber is alive (counted when one is registered) it asks only the
/// reaching thread's default, so a test's scoped subscriber, the only one alive, lets another
/// thread that has none cache "never" for a site the test then waits to see (a CI run failed so,
/// once). With two more
/// subscribers registered for the life of the process, tracing asks every live subscriber
/// instead, the test's among them.
pub fn with_subscriber<S, T>(subscriber: S, f: impl FnOnce() -> T) -> T
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    static ALWAYS_REGISTERED: OnceLock<[tracing::Dispatch; 2]> = OnceLock::new();
    ALWAYS_REGISTERED.get_or_init(|| {
        let none = || tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
        [none(), none()]
    });
    // The one place a scoped subscriber is installed (clippy.toml sends every test here).
    #[allow(clippy::disallowed_methods)]
    tracing::subscriber::with_default(subscriber, f)
}

/// The message of an event (empty if it has none).
pub fn event_message(event: &tracing::Event<'_>) -> String {
    struct Message(String);
    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
    let mut m = Message(String::new());
    event.record(&mut m);
    m.0
}
