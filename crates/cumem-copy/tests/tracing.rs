//! Tracing of copies: every copy runs inside a `trace` span `copy` (and every staged copy inside a
//! `debug` span `staged_copy`, around its chunks' spans) with the fields a user filters on: device,
//! stream, bytes, kind. A capturing subscriber shows it, and shows that nothing at `info` or above
//! is emitted on the happy path. The span is made before the copy locks its buffers, so a
//! subscriber may use them from another thread.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cumem_copy::{Copy2D, Pitched, Profiler, StagingConfig, StagingRing, StreamCopy, copy_h2d};
use cumem_core::{Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_sys::testing;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One captured span or event: its level, its name (or message) and its fields as text.
#[derive(Debug, Clone)]
struct Captured {
    level: Level,
    fields: Vec<(String, String)>,
}

impl Captured {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Capture {
    records: Mutex<Vec<Captured>>,
    next: AtomicU64,
}

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_string(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }
}

#[derive(Clone, Default)]
struct Handle(Arc<Capture>);

impl Subscriber for Handle {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = vec![("span".to_string(), span.metadata().name().to_string())];
        span.record(&mut Fields(&mut fields));
        self.0.records.lock().unwrap().push(Captured { level: *span.metadata().level(), fields });
        Id::from_u64(self.0.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        self.0.records.lock().unwrap().push(Captured { level: *event.metadata().level(), fields });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn copies_are_traced_with_device_stream_bytes_and_kind_and_nothing_above_debug() {
    testing::init_with("devices=2,latency_us=2000");
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let capture = Handle::default();
    cumem_sys::testing::with_subscriber(capture.clone(), || {
        let host = PinnedBuffer::from_slice(&ctx, &[3u8; 64]).unwrap();
        let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap();
        let profiler = Profiler::new();
        let _on = profiler.observe(&stream);
        stream.copy_h2d(&host, &mut dev).unwrap();
        stream.memset_d8(&mut dev, 1).unwrap();
        copy_h2d(&[5u8; 64], &mut dev).unwrap();
        let mut ring = StagingRing::with_config(&ctx, StagingConfig { chunk_bytes: 40, chunks: 2 }).unwrap();
        let mut back = [0u8; 64];
        ring.copy_d2h(&stream, &dev, &mut back).unwrap();
        assert_eq!(back, [5; 64]);
        profiler.report().unwrap();
    });
    let records = capture.0.records.lock().unwrap().clone();
    let loud: Vec<_> = records.iter().filter(|r| r.level <= Level::INFO).collect();
    assert!(loud.is_empty(), "info or louder on the happy path: {loud:?}");
    let copies: Vec<_> = records.iter().filter(|r| r.field("span") == Some("copy")).collect();
    let kinds: Vec<_> = copies.iter().map(|r| r.field("kind").unwrap()).collect();
    // The pinned upload, the memset, the blocking upload, then the staged download's two chunks.
    assert_eq!(kinds, ["h2d", "memset", "h2d", "d2h", "d2h"], "{copies:?}");
    let bytes: Vec<_> = copies.iter().map(|r| r.field("bytes").unwrap()).collect();
    assert_eq!(bytes, ["64", "64", "64", "40", "24"]);
    assert!(copies.iter().all(|r| r.level == Level::TRACE && r.field("device") == Some("0")));
    let id = stream.id().to_string();
    let on_stream = copies.iter().filter(|r| r.field("stream") == Some(&id)).count();
    assert_eq!(on_stream, 4, "all but the blocking copy (legacy stream, id 0)");
    let staged = records.iter().find(|r| r.field("span") == Some("staged_copy")).expect("a staged span");
    assert_eq!(staged.level, Level::DEBUG);
    assert_eq!(
        (staged.field("kind"), staged.field("bytes"), staged.field("stream")),
        (Some("d2h"), Some("64"), Some(id.as_str()))
    );
}

/// A subscriber that hands the name of every new span to its function.
struct OnSpan<F>(F);

impl<F: Fn(&'static str) + Send + Sync + 'static> Subscriber for OnSpan<F> {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        (self.0)(span.metadata().name());
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The `copy` span is made before the copy takes its buffers' locks (here a pinned source's
/// tracker): a subscriber that, on the span, copies from the same buffer on another thread and
/// waits for it gets its copy instead of deadlocking the copying thread. The 1D and the 2D path;
/// under a watchdog, since the bug hangs.
#[test]
fn a_copys_span_is_made_before_the_copy_locks_its_buffers() {
    testing::init_with("devices=2,latency_us=2000");
    testing::within_watchdog("a subscriber that copies the same buffer when a copy's span is made", || {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let (stream, other) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
        let host = Arc::new(PinnedBuffer::from_slice(&ctx, &(0..256u32).collect::<Vec<_>>()).unwrap());
        // What the other thread's copy of the same buffer saw, once per `copy` span.
        let seen = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        let subscriber = {
            let (host, seen) = (host.clone(), seen.clone());
            OnSpan(move |name| {
                if name != "copy" {
                    return;
                }
                let copied = common::copied_on_another_thread(&other, &host);
                seen.lock().unwrap().push(copied);
            })
        };
        let mut flat = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
        let mut img = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
        cumem_sys::testing::with_subscriber(subscriber, || {
            stream.copy_h2d(&*host, &mut flat).unwrap();
            let (src, mut dst) = (Pitched::new(&*host, 16), Pitched::new(img.as_mut_slice(), 16));
            stream.copy_2d(&src, &mut dst, Copy2D::new(16, 16)).unwrap();
        });
        let expected: Vec<u32> = (0..256).collect();
        assert_eq!(*seen.lock().unwrap(), vec![expected.clone(); 2], "one copy per span");
        assert_eq!(flat.to_vec().unwrap(), expected);
        assert_eq!(img.to_vec().unwrap(), expected);
    });
}
