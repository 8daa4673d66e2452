//! The device's current pool (issue 7, item 4): a handle from `MemPool::current` keeps the pool it
//! names alive, a pool made current lives while it is current, and a pool made current by code
//! outside cumem is never handed out.
//!
//! The current pool is per device and process-wide, so each test owns one device and the tests
//! run in parallel; each restores the default pool before it ends.

use std::sync::Arc;

use cumem_copy::copy_h2d;
use cumem_core::{Context, Device, DeviceBuffer, Error, Stream};
use cumem_pool::{MemPool, MemPoolOptions, NativePoolResource};
use cumem_sys::testing;

const SIM: &str = "devices=4";

/// Device `device`'s context; `None` where there is no such device (fewer GPUs than simulated
/// devices: the tests would share a device's current pool).
fn ctx(device: usize) -> Option<Context> {
    testing::init_with(SIM);
    testing::needs_devices(device + 1).then(|| Device::get(device).unwrap().context().unwrap())
}

/// Whether the simulator still lists `pool` as a live user pool (`true` on a real driver, which
/// cannot be asked).
fn pool_alive(pool: u64) -> bool {
    testing::sim_control().is_none_or(|ctl| ctl.live_report().contains_pool(pool))
}

/// Whether the simulator no longer lists `pool` (`true` on a real driver, which cannot be asked).
fn pool_destroyed(pool: u64) -> bool {
    testing::sim_control().is_none_or(|ctl| !ctl.live_report().contains_pool(pool))
}

fn assert_no_violations() {
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
    }
}

#[test]
#[serial_test::parallel]
fn a_handle_from_current_keeps_the_pool_alive_after_its_owner_is_dropped() {
    let Some(ctx) = ctx(0) else { return };
    let owner = MemPool::create(&ctx, MemPoolOptions::default()).unwrap();
    let handle = owner.raw() as u64;
    owner.make_current().unwrap();
    let current = MemPool::current(&ctx).unwrap();
    assert_eq!(current.raw() as u64, handle);
    drop(owner);

    // The handle names a live pool: the driver answers for it, and it serves buffers.
    assert_eq!(current.usage().unwrap().used_current, 0);
    assert!(pool_alive(handle));
    let stream = Stream::non_blocking(&ctx).unwrap();
    let resource = Arc::new(NativePoolResource::new(current));
    let data: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
    let mut buf = DeviceBuffer::<u32>::new_in(&resource, &stream, data.len()).unwrap();
    copy_h2d(&data, &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    assert_eq!(MemPool::current(&ctx).unwrap().raw() as u64, handle, "still the device's current pool");

    // Making the default pool current lets go of the pool; the resource still holds it.
    MemPool::default_pool(&ctx).unwrap().make_current().unwrap();
    assert!(pool_alive(handle));
    drop(buf);
    drop(resource);
    stream.synchronize().unwrap();
    assert!(pool_destroyed(handle), "the last handle destroyed the pool");
    assert_no_violations();
}

#[test]
#[serial_test::parallel]
fn a_pool_made_current_lives_until_another_pool_is_made_current() {
    let Some(ctx) = ctx(1) else { return };
    let first = MemPool::create(&ctx, MemPoolOptions::default()).unwrap();
    let first_handle = first.raw() as u64;
    first.make_current().unwrap();
    drop(first);
    assert!(pool_alive(first_handle), "a current pool is not destroyed with its last user handle");
    assert_eq!(MemPool::current(&ctx).unwrap().raw() as u64, first_handle);

    let second = MemPool::create(&ctx, MemPoolOptions::default()).unwrap();
    let second_handle = second.raw() as u64;
    second.make_current().unwrap();
    assert!(pool_destroyed(first_handle), "replaced as current and unused: destroyed");
    assert_eq!(MemPool::current(&ctx).unwrap().raw() as u64, second_handle);

    MemPool::default_pool(&ctx).unwrap().make_current().unwrap();
    assert!(pool_alive(second_handle), "its owner still holds it");
    drop(second);
    assert!(pool_destroyed(second_handle));
    assert_no_violations();
}

#[test]
#[serial_test::parallel]
fn a_pool_made_current_outside_cumem_is_not_handed_out() {
    let Some(ctx) = ctx(2) else { return };
    let pool = MemPool::create(&ctx, MemPoolOptions::default()).unwrap();
    let dev = ctx.device().raw();
    // Foreign code makes the pool current behind cumem's back.
    // SAFETY: `pool` is a live pool of `dev`.
    let code = unsafe { cumem_sys::sys::cuDeviceSetMemPool(dev, pool.raw()) };
    assert_eq!(code, cumem_sys::sys::CUresult::CUDA_SUCCESS);
    // cumem cannot keep a pool it did not make current alive, so it does not name it.
    let err = MemPool::current(&ctx).unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");

    MemPool::default_pool(&ctx).unwrap().make_current().unwrap();
    assert_eq!(MemPool::current(&ctx).unwrap().raw(), MemPool::default_pool(&ctx).unwrap().raw());
    drop(pool);
    assert_no_violations();
}

#[test]
#[serial_test::parallel]
fn the_default_pool_is_current_until_another_is_made_current() {
    let Some(ctx) = ctx(3) else { return };
    let default = MemPool::default_pool(&ctx).unwrap();
    assert_eq!(MemPool::current(&ctx).unwrap().raw(), default.raw());
    default.make_current().unwrap();
    let current = MemPool::current(&ctx).unwrap();
    assert_eq!(current.raw(), default.raw());
    drop(default);
    // The default pool is never destroyed: the handle stays good.
    assert_eq!(current.usage().unwrap().used_current, 0);
    let clone = current.clone();
    drop(current);
    assert!(clone.release_threshold().is_ok());
    assert_no_violations();
}
