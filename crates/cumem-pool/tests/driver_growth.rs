//! A caching pool over `cuMemAlloc` grows without waiting for other streams' work: the driver's
//! memory is usable on every stream at once, so the upstream does not synchronise the legacy
//! stream after a new segment (which would wait for every blocking stream). A stream-ordered
//! upstream still does. A held blocking stream makes the difference observable; a deadline turns
//! a wait into a failure instead of a hang.

mod gate;

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use cumem_core::{AllocLayout, Allocation, Context, Device, DeviceResource, DriverResource, Stream};
use cumem_pool::{
    CachingPool, DeviceUpstream, LimitingResource, Ordering, PoolConfig, StatisticsResource, StreamOrdering,
};
use cumem_sys::testing;
use serial_test::serial;

/// How long a growth may take before the test calls it waiting for the held stream.
const DEADLINE: Duration = Duration::from_secs(5);

fn ctx() -> Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

/// Grows a pool over `resource` (one 4 KiB allocation on a non-blocking stream, a new segment)
/// while a blocking stream is held; whether the growth returned before the deadline.
fn grows_while_a_blocking_stream_is_held(ctx: &Context, resource: Arc<dyn DeviceResource>) -> bool {
    let held = Stream::new(ctx).unwrap();
    let other = Stream::non_blocking(ctx).unwrap();
    let ordering = StreamOrdering::new(ctx);
    let key = ordering.register(&other);
    let pool = Arc::new(CachingPool::new(DeviceUpstream::new(resource), ordering, PoolConfig::default()));
    let gate = gate::hold(&held);
    let (done, returned) = channel();
    let p = pool.clone();
    let grower = std::thread::spawn(move || {
        let block = p.allocate(4096, 512, key).unwrap();
        let _ = done.send(());
        // SAFETY: no work ever used the block, nor will; `key` is registered with the ordering.
        unsafe { p.deallocate(block, key) }.unwrap();
    });
    let in_time = returned.recv_timeout(DEADLINE).is_ok();
    gate.release();
    grower.join().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 2 << 20, "the allocation grew one small segment");
    pool.ordering().synchronize().unwrap();
    pool.trim().unwrap();
    drop(pool);
    held.synchronize().unwrap();
    in_time
}

/// `cuMemAlloc` behind a resource that does not say its memory is usable everywhere at once (the
/// default answer, as a stream-ordered resource gives).
#[derive(Debug)]
struct Unsaid(DriverResource);

// SAFETY: forwards every request unchanged to the driver resource, which upholds the contract;
// it keeps the default answer of `usable_on_every_stream_at_once` (false), which promises nothing.
unsafe impl DeviceResource for Unsaid {
    fn context(&self) -> &Context {
        self.0.context()
    }
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<Allocation> {
        self.0.allocate(layout, stream)
    }
    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // SAFETY: forwarded unchanged from our caller, who upholds the contract.
        unsafe { self.0.deallocate(allocation, layout, stream) }
    }
}

#[test]
#[serial]
fn growth_over_the_driver_does_not_wait_for_a_held_blocking_stream() {
    let ctx = ctx();
    let driver = Arc::new(DriverResource::new(&ctx));
    assert!(
        grows_while_a_blocking_stream_is_held(&ctx, driver.clone()),
        "a segment from cuMemAlloc waited for a held blocking stream"
    );
    // Through adaptors that forward the answer.
    let stacked = Arc::new(StatisticsResource::new(Arc::new(LimitingResource::new(driver, 1 << 30))));
    assert!(stacked.usable_on_every_stream_at_once());
    assert!(
        grows_while_a_blocking_stream_is_held(&ctx, stacked),
        "a segment from cuMemAlloc through adaptors waited for a held blocking stream"
    );
    // A resource that does not say so still has the legacy stream synchronised, so its growth
    // waits for the held stream (until the gate is released after the deadline).
    assert!(
        !grows_while_a_blocking_stream_is_held(&ctx, Arc::new(Unsaid(DriverResource::new(&ctx)))),
        "a segment from a resource that may be stream-ordered was used without a synchronisation"
    );
    drop(ctx);
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    }
}
