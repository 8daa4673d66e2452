//! The tracking adaptor: a leak report, on demand and on drop, that names a leaked allocation with
//! its size, stream and call site.

mod capture;

use std::sync::Arc;

use capture::Capture;
use cumem_core::{AllocLayout, Device, DeviceBuffer, DeviceResource, Stream};
use cumem_pool::{CachingResource, LimitingResource, PoolConfig, TrackingResource};
use cumem_sys::testing;
use serial_test::parallel;
use tracing::Level;

fn pool() -> (Stream, Arc<CachingResource>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    (Stream::non_blocking(&ctx).unwrap(), Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default())))
}

/// Whether a backtrace taken here names the functions and files of this binary. It does not when
/// the binary was stripped (the GPU packer strips the test binaries it ships): a site is still
/// captured then, but its frames have no names to check. On the simulator (CI, debug builds with
/// symbols) it must: otherwise the name checks would stop running unnoticed.
#[inline(never)]
fn symbols_resolve() -> bool {
    let trace = std::backtrace::Backtrace::force_capture().to_string();
    let resolved = trace.contains("symbols_resolve") && trace.contains("tracking.rs");
    assert!(
        resolved || testing::sim_control().is_none(),
        "backtraces do not name this test's functions and file: the site checks cannot run"
    );
    resolved
}

#[test]
#[parallel]
fn a_leaked_allocation_is_reported_with_its_size_and_site() {
    let (s, pool) = pool();
    let tracker = Arc::new(TrackingResource::with_sites(pool));
    let freed = DeviceBuffer::<u8>::zeroed_in(&tracker, &s, 64).unwrap();
    let leaked = DeviceBuffer::<u8>::zeroed_in(&tracker, &s, 12_345).unwrap();
    drop(freed);
    let report = tracker.report();
    assert_eq!(report.allocations.len(), 1);
    let live = &report.allocations[0];
    assert_eq!((live.ptr, live.bytes, live.stream), (leaked.device_ptr(), 12_345, s.raw() as usize as u64));
    let site = live.site_text().expect("sites are captured");
    let first_frame = site.lines().next().unwrap();
    let text = report.to_string();
    assert!(text.starts_with("1 live allocations, 12345 bytes\n"), "{text}");
    assert!(text.contains(&format!("{:#x}: 12345 bytes", leaked.device_ptr())), "{text}");
    if symbols_resolve() {
        assert!(
            first_frame.contains("a_leaked_allocation_is_reported_with_its_size_and_site"),
            "the site starts at this test function: {site}"
        );
        assert!(text.contains("a_leaked_allocation_is_reported_with_its_size_and_site"), "{text}");
        assert!(text.contains("tests/tracking.rs"), "the site names this file: {text}");
    }
    drop(leaked);
    assert_eq!((tracker.live_count(), tracker.live_bytes()), (0, 0));
    assert!(tracker.report().allocations.is_empty());
}

#[test]
#[parallel]
fn dropping_the_adaptor_with_live_allocations_warns_with_the_report() {
    let (s, pool) = pool();
    let layout = AllocLayout::new(4000, 256).unwrap();
    let ((), seen) = Capture::run(|| {
        let tracker = TrackingResource::with_sites(pool.clone());
        let allocation = tracker.allocate(layout, &s).unwrap();
        drop(tracker);
        // Freed behind the dropped tracker's back, so the simulator's leak check stays clean.
        // SAFETY: allocated from `pool` (through the tracker, which forwards it unchanged) with
        // `layout` on `s`, never used, and freed once.
        unsafe { pool.deallocate(allocation, layout, &s) };
    });
    let warnings: Vec<_> = seen.iter().filter(|e| !e.span && e.level == Level::WARN).collect();
    assert_eq!(warnings.len(), 1, "{seen:#?}");
    let w = warnings[0];
    assert_eq!((w.field("count"), w.field("bytes")), (Some("1"), Some("4000")));
    assert!(w.name.contains("4000 bytes"), "{}", w.name);
    if symbols_resolve() {
        assert!(
            w.name.contains("dropping_the_adaptor_with_live_allocations_warns_with_the_report"),
            "{}",
            w.name
        );
    }
}

#[test]
#[parallel]
fn without_sites_it_still_tracks_size_and_stream_and_stacks_under_a_cap() {
    let (s, pool) = pool();
    let tracker = Arc::new(TrackingResource::new(pool));
    let capped = Arc::new(LimitingResource::new(tracker.clone(), 10_000));
    let a = DeviceBuffer::<u32>::zeroed_in(&capped, &s, 1000).unwrap();
    assert!(DeviceBuffer::<u8>::zeroed_in(&capped, &s, 7000).is_err(), "over the cap");
    let report = tracker.report();
    assert_eq!(report.allocations.len(), 1, "a refused request never reaches the tracker");
    assert_eq!((report.allocations[0].bytes, report.allocations[0].ptr), (4000, a.device_ptr()));
    assert!(report.allocations[0].site.is_none());
    drop(a);
    assert_eq!(tracker.live_count(), 0);
}

/// A free of memory the tracker never handed out (allocated from the pool directly) is forwarded
/// and warned about, and leaves the tracker's own records alone; threads allocating and freeing
/// through one tracker at once leave it empty.
#[test]
#[parallel]
fn an_unknown_free_warns_and_forwards_and_threads_share_one_tracker() {
    let (s, pool) = pool();
    let tracker = Arc::new(TrackingResource::new(pool.clone()));
    let kept = DeviceBuffer::<u8>::zeroed_in(&tracker, &s, 300).unwrap();
    let layout = AllocLayout::new(700, 256).unwrap();
    let stranger = pool.allocate(layout, &s).unwrap();
    let ptr = stranger.ptr;
    let ((), seen) = Capture::run(|| {
        // SAFETY: allocated from `pool` (which the tracker forwards to) with `layout` on `s`,
        // never used, and freed once.
        unsafe { tracker.deallocate(stranger, layout, &s) };
    });
    let warnings: Vec<_> = seen.iter().filter(|e| !e.span && e.level == Level::WARN).collect();
    assert_eq!(warnings.len(), 1, "{seen:#?}");
    assert_eq!(warnings[0].field("ptr"), Some(ptr.to_string().as_str()));
    assert_eq!((tracker.live_count(), tracker.live_bytes()), (1, 300), "its own record is untouched");
    assert_eq!(pool.stats().requested_bytes, 300, "the free reached the pool");

    std::thread::scope(|scope| {
        for t in 0..4 {
            let (tracker, s) = (&tracker, &s);
            scope.spawn(move || {
                for i in 0..200 {
                    drop(DeviceBuffer::<u8>::zeroed_in(tracker, s, 1 + (i * 13 + t) % 5000).unwrap());
                }
            });
        }
    });
    assert_eq!(tracker.report().allocations.iter().map(|a| a.ptr).collect::<Vec<_>>(), [kept.device_ptr()]);
    drop(kept);
    assert_eq!(tracker.live_count(), 0);
}
