//! Pitched arrays allocate from the current resource like every other device buffer (issue 8,
//! item 1): with `cumem-pool` linked that is the caching pool, so a freed image's memory is reused
//! by the next one of its size without a driver call, and any resource can be passed with `_in`.
//!
//! The tests read the default pool's statistics, so they run one at a time.

use std::sync::Arc;

use cumem_copy::{Copy2D, Pitched, PitchedBuffer, copy_2d};
use cumem_core::{Device, DriverResource, Error, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;
use serial_test::serial;

fn stream() -> Stream {
    testing::init();
    Stream::non_blocking(&Device::get(0).unwrap().context().unwrap()).unwrap()
}

#[test]
#[serial]
fn a_pitched_array_comes_from_the_caching_pool_and_goes_back_to_it() {
    let stream = stream();
    let device = stream.context().device();
    let Some(pool) = cumem_pool::current_caching(&device).unwrap() else {
        // Reported (and a failure on the simulator, where nothing is skipped), never silent.
        return testing::skip("CUMEM_ALLOCATOR chose another default resource than the caching pool");
    };
    let before = pool.stats();
    let rows: Vec<u32> = (0..100 * 7).collect();
    let mut img = PitchedBuffer::<u32>::zeroed(&stream, 100, 7).unwrap();
    assert!(img.pitch_bytes().is_multiple_of(512) && img.pitch() >= 100);
    assert!(std::ptr::addr_eq(Arc::as_ptr(img.resource()), Arc::as_ptr(&pool)));
    assert_eq!(pool.stats().current_bytes - before.current_bytes, (img.pitch_bytes() * 7) as u64);
    let segments = pool.stats().upstream_allocations;
    copy_2d(&Pitched::new(&rows[..], 100), &mut img.as_pitched_mut(), Copy2D::new(100, 7)).unwrap();
    assert_eq!(img.to_vec().unwrap(), rows);
    drop(img);
    assert_eq!(pool.stats().current_bytes, before.current_bytes);

    let again = PitchedBuffer::<u32>::zeroed(&stream, 100, 7).unwrap();
    assert_eq!(again.to_vec().unwrap(), vec![0; 700]);
    // The copy and the read left the first array last used on the legacy stream, so its block is
    // cached there; the pool serves the new array on `stream` from what it holds, with no new segment.
    assert_eq!(pool.stats().upstream_allocations, segments);
}

#[test]
#[serial]
fn pitched_arrays_take_any_resource_and_refuse_another_devices() {
    let stream = stream();
    let pool = Arc::new(CachingResource::with_driver(stream.context(), PoolConfig::default()));
    let a = PitchedBuffer::<f32>::zeroed_in(&pool, &stream, 33, 3).unwrap();
    let b = PitchedBuffer::<f32>::new_3d_in(&pool, &stream, 10, 2, 4).unwrap();
    assert_eq!(pool.stats().current_count, 2);
    assert_eq!((a.to_vec().unwrap(), b.len()), (vec![0.0; 99], b.pitch() * 8));
    drop((a, b));
    assert_eq!(pool.stats().current_count, 0);
    pool.trim().unwrap();

    if !testing::needs_devices(2) {
        return;
    }
    let other = Arc::new(DriverResource::new(&Device::get(1).unwrap().context().unwrap()));
    assert!(matches!(
        PitchedBuffer::<u8>::zeroed_in(&other, &stream, 8, 8),
        Err(Error::WrongDevice { expected: 1, actual: 0 })
    ));
}
