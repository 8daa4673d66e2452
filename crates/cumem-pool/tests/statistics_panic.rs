//! `StatisticsResource::with_scope` under a panic (issue 7, item 7): the scope is closed while
//! unwinding, so the counters below it still count every live buffer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, DriverResource, Stream};
use cumem_pool::StatisticsResource;
use cumem_sys::testing;

fn setup() -> (Stream, Arc<StatisticsResource>, Arc<StatisticsResource>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stats = Arc::new(StatisticsResource::new(Arc::new(DriverResource::new(&ctx))));
    let r = stats.clone();
    (Stream::new(&ctx).unwrap(), stats, r)
}

fn current(stats: &StatisticsResource) -> (i64, i64) {
    let c = stats.counters();
    (c.current_bytes, c.current_count)
}

#[test]
#[serial_test::parallel]
fn a_panicking_empty_scope_leaves_the_live_buffers_counted() {
    let (s, stats, r) = setup();
    let live = DeviceBuffer::<u8>::zeroed_in(&r, &s, 1000).unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| stats.with_scope(|| panic!("inside the scope"))));
    assert!(caught.is_err());
    assert_eq!(current(&stats), (1000, 1), "the buffer allocated before the scope is still live");
    assert!(stats.pop_scope().is_none(), "the panicking scope was closed");
    drop(live);
    assert_eq!(current(&stats), (0, 0));
}

#[test]
#[serial_test::parallel]
fn buffers_allocated_in_a_panicking_scope_are_folded_into_the_scope_below() {
    let (s, stats, r) = setup();
    let before = DeviceBuffer::<u8>::zeroed_in(&r, &s, 1000).unwrap();
    let mut kept = None;
    let caught = catch_unwind(AssertUnwindSafe(|| {
        stats.with_scope(|| {
            kept = Some(DeviceBuffer::<u8>::zeroed_in(&r, &s, 24).unwrap());
            // A nested scope left open by the panic is closed too.
            stats.push_scope();
            let _tmp = DeviceBuffer::<u8>::zeroed_in(&r, &s, 4000).unwrap();
            panic!("inside the scope");
        })
    }));
    assert!(caught.is_err());
    let c = stats.counters();
    assert_eq!((c.current_bytes, c.current_count), (1024, 2));
    assert_eq!((c.peak_bytes, c.total_count, c.total_bytes), (5024, 3, 5024));
    assert!(stats.pop_scope().is_none(), "every scope the panic left open was closed");
    drop(kept);
    drop(before);
    assert_eq!(current(&stats), (0, 0));
}

#[test]
#[serial_test::parallel]
fn a_scope_without_a_panic_still_returns_its_counts() {
    let (s, stats, r) = setup();
    let (buf, scope) = stats.with_scope(|| DeviceBuffer::<u8>::zeroed_in(&r, &s, 512).unwrap());
    assert_eq!((scope.current_bytes, scope.current_count, scope.peak_bytes), (512, 1, 512));
    assert_eq!(current(&stats), (512, 1));
    drop(buf);
    assert_eq!(current(&stats), (0, 0));
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
    }
}
