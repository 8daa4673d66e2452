//! Tracing that helps: the caching pool's slow paths (segment growth, cross-stream migration, the
//! out-of-memory ladder, trim) open debug spans with the fields a user filters on (device, stream,
//! bytes), each allocation and free is a trace event with the same fields, and a happy-path
//! workload through every adaptor emits nothing at info or above.
//! Only the test's own thread is captured, so tests running beside it add nothing.

mod capture;

use std::sync::Arc;

use capture::{Capture, Seen};
use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Stream};
use cumem_pool::{
    CachingResource, FailureCallbackResource, LimitingResource, LoggingResource, MemPool, MemPoolOptions,
    MemoryPressureMonitor, NativePoolResource, PoolConfig, StatisticsResource, TrackingResource,
};
use cumem_sys::testing;
use serial_test::parallel;
use tracing::Level;

const MIB: usize = 1 << 20;
const CACHING: &str = "cumem_pool::caching_resource";

fn spans<'a>(seen: &'a [Seen], name: &str) -> Vec<&'a Seen> {
    seen.iter().filter(|s| s.span && s.name == name).collect()
}

fn events<'a>(seen: &'a [Seen], message: &str) -> Vec<&'a Seen> {
    seen.iter().filter(|s| !s.span && s.name == message).collect()
}

/// The events of one resource's module (the caching pool's upstream traces its own).
fn events_of<'a>(seen: &'a [Seen], target: &str, message: &str) -> Vec<&'a Seen> {
    events(seen, message).into_iter().filter(|s| s.target == target).collect()
}

#[test]
#[parallel]
fn segment_growth_migration_and_trim_open_spans_with_device_stream_and_bytes() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let (s1, s2) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let ((), seen) = Capture::run(|| {
        drop(DeviceBuffer::<u8>::zeroed_in(&pool, &s1, 3 * MIB).unwrap()); // grows
        drop(DeviceBuffer::<u8>::zeroed_in(&pool, &s2, 3 * MIB).unwrap()); // takes s1's block
        pool.trim().unwrap();
    });
    let slow = spans(&seen, "allocate_slow");
    assert_eq!(slow.len(), 2, "{seen:#?}");
    for span in &slow {
        assert_eq!((span.field("device"), span.field("bytes")), (Some("0"), Some("3145728")));
    }
    assert_ne!(slow[0].field("stream"), slow[1].field("stream"), "each names its own stream");
    let allocations = events_of(&seen, CACHING, "allocate");
    assert_eq!(allocations.len(), 2, "one trace event per allocation");
    for (event, span) in allocations.iter().zip(&slow) {
        assert_eq!(event.level, Level::TRACE);
        assert_eq!((event.field("device"), event.field("bytes")), (Some("0"), Some("3145728")));
        assert_eq!(event.field("stream"), span.field("stream"));
    }
    assert_eq!(events_of(&seen, CACHING, "free").len(), 2);
    // The one segment the pool grew came from the driver, which says so too.
    assert_eq!(events_of(&seen, "cumem_core::resource", "allocate").len(), 1, "{seen:#?}");
    let grow = spans(&seen, "grow");
    assert_eq!(grow.len(), 1, "{seen:#?}");
    assert_eq!(grow[0].level, Level::DEBUG);
    assert_eq!(grow[0].field("device"), Some("0"));
    assert!(grow[0].field("bytes").unwrap().parse::<usize>().unwrap() >= 3 * MIB);
    assert_eq!(
        grow[0].scope.get("stream").map(String::as_str),
        slow[0].field("stream"),
        "inside the allocation"
    );
    let added = events(&seen, "segment added");
    assert_eq!(added.len(), 1);
    let migrated = events(&seen, "cross-stream migration");
    assert_eq!(migrated.len(), 1, "{seen:#?}");
    assert_eq!(migrated[0].field("from"), slow[0].field("stream"));
    assert_eq!(migrated[0].scope.get("stream").map(String::as_str), slow[1].field("stream"));
    let trim = spans(&seen, "trim");
    assert_eq!((trim.len(), trim[0].field("device")), (1, Some("0")));
    let released = events(&seen, "segments released");
    assert_eq!(released.len(), 1);
    assert_eq!(
        released[0].field("released_bytes"),
        added[0].field("segment_bytes"),
        "the one segment went back"
    );
    assert_eq!(released[0].scope.get("keep").map(String::as_str), Some("0"), "inside the trim span");
}

/// The driver's resources trace each allocation and free as the caching pool does: a user
/// filtering on device, stream and bytes sees every allocator.
#[test]
#[parallel]
fn the_driver_and_native_pool_resources_trace_each_allocation_and_free() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let driver = Arc::new(DriverResource::new(&ctx));
    let native = Arc::new(NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap()));
    let (padded, seen) = Capture::run(|| {
        drop(DeviceBuffer::<u8>::zeroed_in(&driver, &stream, 5000).unwrap());
        let kept = DeviceBuffer::<u8>::zeroed_in(&native, &stream, 7000).unwrap();
        // Over-aligned, while the first block is still held (so the trial lands past it, not at
        // the pool's aligned start): the native pool pads, and traces the address it hands out.
        let padded = DeviceBuffer::<u8>::zeroed_aligned_in(&native, &stream, 64, 4096).unwrap();
        let at = padded.device_ptr();
        drop(padded);
        drop(kept);
        at
    });
    let stream_id = stream.id().to_string();
    for (what, want) in [("allocate", ["5000", "7000", "64"]), ("free", ["5000", "64", "7000"])] {
        let got = events(&seen, what);
        assert_eq!(got.len(), 3, "{what}: {seen:#?}");
        assert_eq!(got[0].target, "cumem_core::resource");
        assert!(got[1..].iter().all(|e| e.target == "cumem_pool::native_resource"), "{got:#?}");
        for (event, bytes) in got.iter().zip(want) {
            assert_eq!(event.level, Level::TRACE);
            assert_eq!(
                (event.field("device"), event.field("stream"), event.field("bytes")),
                (Some("0"), Some(stream_id.as_str()), Some(bytes)),
                "{what}"
            );
            assert!(event.field("ptr").is_some_and(|p| p != "0"), "{what}: {event:?}");
        }
        let padded_event = got.iter().find(|e| e.field("bytes") == Some("64")).unwrap();
        assert_eq!(
            padded_event.field("ptr"),
            Some(padded.to_string().as_str()),
            "{what}: the address handed out"
        );
    }
}

/// The caching pool names streams as the driver's resources do: the same number, recorded as a
/// number (the `allocate_slow` span records the pool's key through `Debug`: the same text).
#[test]
#[parallel]
fn the_caching_pool_names_a_stream_as_the_other_resources_do() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let ((), seen) = Capture::run(|| drop(DeviceBuffer::<u8>::zeroed_in(&pool, &stream, 4096).unwrap()));
    let id = stream.id().to_string();
    for what in ["allocate", "free"] {
        let got = events_of(&seen, CACHING, what);
        assert_eq!(got.len(), 1, "{what}: {seen:#?}");
        assert_eq!(got[0].field("stream"), Some(id.as_str()), "{what}");
        assert!(got[0].numbers.contains("stream"), "{what}: the stream recorded as a number");
    }
    assert_eq!(spans(&seen, "allocate_slow")[0].field("stream"), Some(id.as_str()));
    let driver = Arc::new(DriverResource::new(&ctx));
    let ((), seen) = Capture::run(|| drop(DeviceBuffer::<u8>::zeroed_in(&driver, &stream, 4096).unwrap()));
    let got = events(&seen, "allocate");
    assert_eq!(got.len(), 1, "{seen:#?}");
    assert_eq!(got[0].field("stream"), Some(id.as_str()));
    assert!(got[0].numbers.contains("stream"), "the driver resource records a number too");
}

#[test]
#[parallel]
fn the_out_of_memory_ladder_opens_a_span() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let upstream = Arc::new(LimitingResource::new(Arc::new(DriverResource::new(&ctx)), 4 * MIB));
    let pool = Arc::new(CachingResource::new(upstream, PoolConfig::default()));
    let (result, seen) = Capture::run(|| DeviceBuffer::<u8>::zeroed_in(&pool, &s, 6 * MIB).map(drop));
    assert!(matches!(result, Err(Error::OutOfMemory { .. })));
    let ladder = spans(&seen, "oom_ladder");
    assert_eq!(ladder.len(), 1, "{seen:#?}");
    assert_eq!((ladder[0].field("device"), ladder[0].field("bytes")), (Some("0"), Some("6291456")));
    assert!(ladder[0].scope.contains_key("stream"), "inside the allocation's span");
    // Running out is not the happy path: the pool says so at warn, and no higher.
    assert!(seen.iter().all(|e| e.level >= Level::WARN), "{seen:#?}");
}

#[test]
#[parallel]
fn a_happy_path_workload_emits_nothing_at_info_or_above() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let (s1, s2) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let ((), seen) = Capture::run(|| {
        let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
        let stats = Arc::new(StatisticsResource::new(pool.clone()));
        let tracker = Arc::new(TrackingResource::with_sites(stats.clone()));
        let capped = Arc::new(LimitingResource::new(tracker.clone(), 64 * MIB));
        let retrying = Arc::new(FailureCallbackResource::new(capped, 2, |_| false));
        let log = Arc::new(LoggingResource::new(retrying, std::io::sink()).unwrap());
        let monitor = MemoryPressureMonitor::new(&ctx).min_free_bytes(1).watch_pool(pool.clone(), u64::MAX);
        for round in 0..3usize {
            let a = DeviceBuffer::<u32>::from_slice_in(&log, &s1, &[round as u32; 1000]).unwrap();
            let mut b = DeviceBuffer::<u32>::zeroed_in(&log, &s2, 1000).unwrap();
            s2.copy_d2d(&a, &mut b).unwrap();
            assert_eq!(b.to_vec().unwrap(), vec![round as u32; 1000]);
            let big = DeviceBuffer::<u8>::zeroed_in(&log, &s1, 5 * MIB).unwrap();
            drop((a, b, big));
            assert!(monitor.check().unwrap().is_empty());
        }
        log.flush().unwrap();
        assert_eq!(tracker.live_count(), 0);
        drop(log);
        pool.trim().unwrap();
    });
    let loud: Vec<_> = seen.iter().filter(|e| e.level <= Level::INFO).collect();
    assert!(loud.is_empty(), "{loud:#?}");
    assert!(!spans(&seen, "grow").is_empty(), "the capture saw the workload's debug spans");
}
