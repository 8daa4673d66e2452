//! Tracing helpers for tests that react to cumem's events: a subscriber that hands every event to
//! a function, and the message of one event.
//!
//! ```
//! use cumem_sys::testing::{OnEvent, event_message};
//! let seen = std::sync::Mutex::new(Vec::new());
//! let subscriber = OnEvent(move |e: &tracing::Event<'_>| seen.lock().unwrap().push(event_message(e)));
//! tracing::subscriber::with_default(subscriber, || tracing::warn!("hello"));
//! ```

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
