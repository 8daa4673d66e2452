//! The failure-callback adaptor: the callback sees each out-of-memory, decides to retry or give
//! up, and is asked at most the bound of times per request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cumem_core::{Device, DeviceBuffer, Error, Stream};
use cumem_pool::{CachingResource, FailureCallbackResource, LimitingResource, PoolConfig};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::parallel;

fn capped(limit: usize) -> (Stream, Arc<LimitingResource<CachingResource>>) {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    (Stream::non_blocking(&ctx).unwrap(), Arc::new(LimitingResource::new(pool, limit)))
}

#[test]
#[parallel]
fn a_callback_that_frees_memory_gets_the_retry_served() {
    let (s, capped) = capped(10_000);
    let held: Arc<Mutex<Vec<DeviceBuffer<u8>>>> = Arc::new(Mutex::new(
        (0..3).map(|_| DeviceBuffer::<u8>::zeroed_in(&capped, &s, 3000).unwrap()).collect(),
    ));
    let (calls, evict) = (Arc::new(AtomicU32::new(0)), held.clone());
    let seen = calls.clone();
    let retrying = Arc::new(FailureCallbackResource::new(capped.clone(), 5, move |f| {
        seen.fetch_add(1, Ordering::Relaxed);
        assert!(matches!(f.error, Error::OutOfMemory { .. }));
        assert_eq!(f.bytes, 6000);
        evict.lock().pop().is_some()
    }));
    // 9000 held, 6000 asked: two buffers must go, one per failure.
    let buf = DeviceBuffer::<u8>::zeroed_in(&retrying, &s, 6000).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![0; 6000]);
    assert_eq!((calls.load(Ordering::Relaxed), retrying.retries()), (2, 2));
    assert_eq!((held.lock().len(), capped.used()), (1, 9000));
}

#[test]
#[parallel]
fn retries_are_bounded() {
    let (s, capped) = capped(1000);
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let record = attempts.clone();
    let retrying = Arc::new(FailureCallbackResource::new(capped, 3, move |f| {
        record.lock().push(f.attempt);
        true // always asks for another try, and frees nothing
    }));
    let err = DeviceBuffer::<u8>::zeroed_in(&retrying, &s, 2000).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { report: Some(r), .. } if r.requested == 2000 && r.reserved == 1000)
    );
    assert_eq!(*attempts.lock(), [1, 2, 3]);
    assert_eq!(retrying.retries(), 3);
}

#[test]
#[parallel]
fn a_callback_that_gives_up_is_asked_once() {
    let (s, capped) = capped(1000);
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let retrying = Arc::new(FailureCallbackResource::new(capped, 10, move |_| {
        seen.fetch_add(1, Ordering::Relaxed);
        false
    }));
    assert!(matches!(DeviceBuffer::<u8>::zeroed_in(&retrying, &s, 2000), Err(Error::OutOfMemory { .. })));
    assert_eq!((calls.load(Ordering::Relaxed), retrying.retries()), (1, 0));
    // Requests that fit never call back.
    drop(DeviceBuffer::<u8>::zeroed_in(&retrying, &s, 1000).unwrap());
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}
