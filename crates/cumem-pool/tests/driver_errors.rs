//! One error type end to end: a driver failure inside the caching pool reaches the caller as the
//! driver's own error, carried inside the pool's error (no side channel that can go stale).

use std::sync::Arc;

use cumem_core::sys::CUresult;
use cumem_core::{Device, DeviceBuffer, DriverResource, Error, Stream};
use cumem_pool::{CachingPool, CachingResource, DeviceUpstream, HostOrdering, PoolConfig, PoolError};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;

fn fault(function: &str, code: CUresult) -> FaultRule {
    FaultRule { function: function.into(), nth: 1, code, times: 1, this_thread_only: true }
}

/// The first `cumem_core::Error` in `e`'s source chain.
fn driver_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<Error>() {
            return Some(found);
        }
        next = e.source();
    }
    None
}

#[test]
#[serial_test::parallel]
fn an_upstream_failure_carries_the_drivers_error() {
    testing::init();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    let upstream = DeviceUpstream::new(Arc::new(DriverResource::new(&ctx)));
    let pool = CachingPool::new(upstream, HostOrdering::new(), PoolConfig::default());
    let rule = ctl.inject_fault(fault("cuMemAlloc_v2", CUresult::CUDA_ERROR_INVALID_VALUE));
    let err = pool.allocate(4096, 256, 0).unwrap_err();
    ctl.remove_fault(rule);
    assert!(matches!(err, PoolError::Upstream(_)), "{err}");
    let inner = driver_error(&err).unwrap_or_else(|| panic!("no driver error inside {err:?}"));
    assert!(matches!(inner, Error::InvalidValue { .. }), "{inner}");
    assert_eq!(inner.code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
    let block = pool.allocate(4096, 256, 0).unwrap();
    // SAFETY: no work ever used the block (only its address was read), nor will.
    unsafe { pool.deallocate(block, 0) }.unwrap();
    pool.trim().unwrap();
}

#[test]
#[serial_test::parallel]
fn a_failed_stream_synchronisation_after_a_failed_wait_reaches_the_caller_as_the_drivers_error() {
    testing::init();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let resource = pool.clone();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    drop(DeviceBuffer::<u8>::new_in(&resource, &a, 1 << 20).unwrap());
    // An earlier failure the pool recovered from must not stand in for the next one.
    let oom = ctl.inject_fault(fault("cuMemAlloc_v2", CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    drop(DeviceBuffer::<u8>::new_in(&resource, &a, 8 << 20).unwrap());
    ctl.remove_fault(oom);
    // b needs a's cached memory: the pool orders b after a, and that fails. A failed wait is
    // answered only when nothing else serves the request: the upstream is out of memory too, and
    // the ladder's synchronisation (which would make a's memory safe for b) fails as well, with
    // its own error, which the caller gets (the wait's went to the log).
    let rules = [
        fault("cuStreamWaitEvent", CUresult::CUDA_ERROR_INVALID_HANDLE),
        FaultRule { times: 0, ..fault("cuMemAlloc_v2", CUresult::CUDA_ERROR_OUT_OF_MEMORY) },
        fault("cuEventSynchronize", CUresult::CUDA_ERROR_INVALID_VALUE),
    ]
    .map(|rule| ctl.inject_fault(rule));
    let err = DeviceBuffer::<u8>::new_in(&resource, &b, 1 << 20).unwrap_err();
    for rule in rules {
        ctl.remove_fault(rule);
    }
    assert!(matches!(err, Error::InvalidValue { .. }), "{err}");
    let ok = DeviceBuffer::<u8>::new_in(&resource, &b, 1 << 20).unwrap();
    drop(ok);
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

#[test]
#[serial_test::parallel]
fn an_alignment_beyond_the_pools_reads_as_not_supported() {
    use cumem_core::{AllocLayout, DeviceResource, Feature};
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = CachingResource::with_driver(&ctx, PoolConfig::default());
    let too_large = cumem_pool::MAX_ALIGN * 2;
    let layout = AllocLayout::new(4096, too_large).unwrap();
    let err = pool.allocate(layout, &stream).unwrap_err();
    assert!(
        matches!(err, Error::NotSupported { feature: Feature::Alignment(a), .. } if a == too_large),
        "{err:?}"
    );
    // The largest alignment the pool serves is served.
    let layout = AllocLayout::new(4096, cumem_pool::MAX_ALIGN).unwrap();
    let a = pool.allocate(layout, &stream).unwrap();
    assert_eq!(a.ptr % cumem_pool::MAX_ALIGN as u64, 0);
    // SAFETY: allocated just above with this layout on this stream, never used, freed once.
    unsafe { pool.deallocate(a, layout, &stream) };
}
