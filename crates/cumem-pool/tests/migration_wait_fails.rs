//! A migration whose wait fails (the simulator's fault injection fails `cuStreamWaitEvent`) does
//! not fail the allocation while the pool can still serve it otherwise: the block taken goes back
//! to its arena, the pool grows instead, and the failure is logged once.

use std::sync::Arc;

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing::{self, OnEvent, event_message};
use parking_lot::Mutex;
use serial_test::serial;

mod common;
use common::fails_once_on_this_thread;

const WAIT_FAILED: &str = "ordering a migration failed; trying elsewhere";

#[test]
#[serial]
fn a_failed_migration_wait_grows_instead() {
    testing::init_with("devices=1");
    // Injecting failures needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return;
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    // 1 MiB skips the thread cache: the block is cached in stream a's arena.
    let on_a = DeviceBuffer::<u8>::new_in(&pool, &a, 1 << 20).unwrap();
    let cached = on_a.device_ptr();
    drop(on_a);
    assert_eq!(pool.pool().segments().len(), 1);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = OnEvent({
        let seen = seen.clone();
        move |e: &tracing::Event<'_>| {
            if *e.metadata().level() <= tracing::Level::WARN {
                seen.lock().push(event_message(e));
            }
        }
    });
    // Stream b takes a's block, and waits for a: the wait fails.
    let grown = testing::with_subscriber(subscriber, || {
        let rule = ctl.inject_fault(fails_once_on_this_thread("cuStreamWaitEvent", 1));
        let grown = DeviceBuffer::<u8>::new_in(&pool, &b, 1 << 20);
        ctl.remove_fault(rule);
        grown
    });
    let grown = grown.expect("the pool grew instead");
    assert_ne!(grown.device_ptr(), cached, "a new segment's memory, not a's block");
    assert_eq!(pool.pool().segments().len(), 2);
    assert_eq!(*seen.lock(), [WAIT_FAILED], "logged once");
    // a's block went back to a's arena (nothing stranded): once b's new segment is used up, the
    // next migration (whose wait works) takes it.
    let s = pool.stats();
    assert_eq!((s.stranded_bytes, s.cached_bytes, s.current_bytes), (0, 3 << 20, 1 << 20));
    let rest = DeviceBuffer::<u8>::new_in(&pool, &b, 1 << 20).unwrap();
    let migrated = DeviceBuffer::<u8>::new_in(&pool, &b, 1 << 20).unwrap();
    assert_eq!(migrated.device_ptr(), cached);
    assert_eq!(pool.pool().segments().len(), 2);
    pool.pool().validate().unwrap();
    drop((grown, rest, migrated));
    b.synchronize().unwrap();
    pool.pool().trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    drop((pool, a, b, ctx));
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}
