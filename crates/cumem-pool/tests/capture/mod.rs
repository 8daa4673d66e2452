//! A tracing subscriber that keeps every span and event of the calling thread, with its fields and
//! the fields of the spans around it, so a test can assert what a user's subscriber would see.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// One span opened or event emitted.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Whether it was a span (else an event).
    pub span: bool,
    pub level: Level,
    /// The module that emitted it (a user's filter names it: `cumem_pool::caching_resource=trace`).
    pub target: String,
    /// The span's name, or the event's message.
    pub name: String,
    /// Its own fields (`message` excluded).
    pub fields: BTreeMap<String, String>,
    /// Which of its own fields were recorded as integers (what an `EnvFilter` numeric value
    /// directive compares with), not through `Debug`.
    pub numbers: BTreeSet<String>,
    /// The fields of the spans it was opened or emitted in, innermost last.
    pub scope: BTreeMap<String, String>,
}

impl Seen {
    /// A field of its own or of an enclosing span.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).or_else(|| self.scope.get(name)).map(String::as_str)
    }
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>, Option<String>, BTreeSet<String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        if field.name() == "message" {
            self.1 = Some(text);
        } else {
            self.0.insert(field.name().to_string(), text);
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record_debug(field, &value);
        self.2.insert(field.name().to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_debug(field, &value);
        self.2.insert(field.name().to_string());
    }
}

#[derive(Default, Clone)]
pub struct Capture {
    seen: Arc<Mutex<Vec<Seen>>>,
    spans: Arc<Mutex<HashMap<Id, BTreeMap<String, String>>>>,
}

impl Capture {
    /// Runs `f` with this thread's spans and events (every level) kept, and returns them.
    pub fn run<T>(f: impl FnOnce() -> T) -> (T, Vec<Seen>) {
        let capture = Capture::default();
        let subscriber = tracing_subscriber::registry().with(capture.clone());
        let out = cumem_sys::testing::with_subscriber(subscriber, f);
        let seen = capture.seen.lock().clone();
        (out, seen)
    }

    fn scope_of<S>(&self, parent: Option<Id>, ctx: &Context<'_, S>) -> BTreeMap<String, String>
    where
        S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let parent = parent.or_else(|| ctx.current_span().id().cloned());
        parent.and_then(|id| self.spans.lock().get(&id).cloned()).unwrap_or_default()
    }
}

impl<S> Layer<S> for Capture
where
    S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let parent = if attrs.is_root() { None } else { attrs.parent().cloned() };
        let scope = if attrs.is_root() { BTreeMap::new() } else { self.scope_of(parent, &ctx) };
        let mut all = scope.clone();
        all.extend(fields.0.clone());
        self.spans.lock().insert(id.clone(), all);
        self.seen.lock().push(Seen {
            span: true,
            level: *attrs.metadata().level(),
            target: attrs.metadata().target().to_string(),
            name: attrs.metadata().name().to_string(),
            fields: fields.0,
            numbers: fields.2,
            scope,
        });
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let scope =
            if event.is_root() { BTreeMap::new() } else { self.scope_of(event.parent().cloned(), &ctx) };
        self.seen.lock().push(Seen {
            span: false,
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            name: fields.1.unwrap_or_default(),
            fields: fields.0,
            numbers: fields.2,
            scope,
        });
    }
}
