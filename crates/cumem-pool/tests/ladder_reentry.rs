//! The out-of-memory ladder asks its upstream for a segment with no pool lock held, so an upstream
//! that runs user code on failure (a `FailureCallbackResource`) may free memory into the same pool
//! and trim it, as that adaptor's documentation says a callback may. Run under a watchdog: a lock
//! held across the call would hang the test, not fail it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Stream};
use cumem_pool::{CachingResource, FailureCallbackResource, LimitingResource, PoolConfig};
use cumem_sys::testing::{self, within_watchdog};
use parking_lot::Mutex;
use serial_test::parallel;

const MIB: usize = 1 << 20;

/// A pool of at most 40 MiB whose upstream calls `on_failure(pool, attempt)` when it runs out;
/// the limiter, to read what is held.
#[allow(clippy::type_complexity)]
fn pool_calling_back(
    on_failure: impl Fn(&CachingResource, u32) -> bool + Send + Sync + 'static,
) -> (Stream, Arc<CachingResource>, Arc<LimitingResource<DriverResource>>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let capped = Arc::new(LimitingResource::new(Arc::new(DriverResource::new(&ctx)), 40 * MIB));
    let me: Arc<OnceLock<Weak<CachingResource>>> = Arc::new(OnceLock::new());
    let calls = AtomicU32::new(0);
    let pool_of_callback = me.clone();
    let up = Arc::new(FailureCallbackResource::new(capped.clone(), 1, move |_| {
        let call = calls.fetch_add(1, Ordering::Relaxed) + 1;
        let pool = pool_of_callback.get().and_then(Weak::upgrade).expect("the pool lives");
        on_failure(&pool, call)
    }));
    let pool = Arc::new(CachingResource::new(up, PoolConfig::default()));
    me.set(Arc::downgrade(&pool)).unwrap();
    (Stream::non_blocking(&ctx).unwrap(), pool, capped)
}

#[test]
#[parallel]
fn a_callback_that_trims_the_pool_gets_an_out_of_memory_error() {
    within_watchdog("a failure callback trimming the pool it serves", || {
        let (s, pool, capped) = pool_calling_back(|pool, _| {
            pool.trim().unwrap();
            true
        });
        let a = DeviceBuffer::<u8>::zeroed_in(&pool, &s, 30 * MIB).unwrap();
        // The ladder runs too (nothing the trims free makes room): an error, not a hang.
        let err = DeviceBuffer::<u8>::zeroed_in(&pool, &s, 30 * MIB).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
        assert_eq!(pool.stats().oom_ladders, 1);
        drop(a);
        pool.trim().unwrap();
        assert_eq!(capped.used(), 0);
    });
}

#[test]
#[parallel]
fn a_callback_in_the_ladder_may_drop_buffers_of_the_pool_and_trim_it() {
    within_watchdog("a failure callback freeing into the pool it serves", || {
        let parked: Arc<Mutex<Vec<DeviceBuffer<u8>>>> = Arc::new(Mutex::new(vec![]));
        let evict = parked.clone();
        let (s, pool, capped) = pool_calling_back(move |pool, call| {
            // The first failure (before the ladder) gives up; the ladder's frees the parked
            // buffer (a free into the pool's arena) and trims (every lock of the pool).
            if call == 1 {
                return false;
            }
            evict.lock().clear();
            pool.trim().unwrap();
            true
        });
        parked.lock().push(DeviceBuffer::<u8>::from_slice_in(&pool, &s, &[7u8; 30 * MIB]).unwrap());
        let b = DeviceBuffer::<u8>::zeroed_in(&pool, &s, 30 * MIB).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![0u8; 30 * MIB]);
        assert!(parked.lock().is_empty());
        let stats = pool.stats();
        assert_eq!((stats.oom_ladders, stats.oom_errors, capped.used()), (1, 0, 30 * MIB));
        drop(b);
        pool.trim().unwrap();
        assert_eq!(capped.used(), 0);
        if let Some(ctl) = testing::sim_control() {
            assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
        }
    });
}
