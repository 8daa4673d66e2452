//! The caching pool (and the driver's pools, last) with two devices: a stream is named by its context as well as its handle (the
//! legacy streams of two devices are two streams), and releasing memory waits for every stream that
//! used it, on whichever device. Streams are held back by a gate so that "work still running" is
//! deterministic; a pool that confuses the streams or waits for its own device only corrupts data
//! or frees memory under pending work.

mod gate;

use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys;
use cumem_core::{Context, Device, DeviceBuffer, DriverResource, PinnedBuffer, Stream};
use cumem_pool::{CachingResource, MemPool, MemPoolOptions, NativePoolResource, PoolConfig};
use cumem_sys::testing;

const N: usize = 4096;
const A: u32 = 0xAAAA_AAAA;
const B: u32 = 0xBBBB_BBBB;

/// Devices 0 and 1; `None` on a machine with one GPU (the tests need two devices).
fn contexts() -> Option<(Context, Context)> {
    testing::init_with("devices=2,latency_us=200,dev0.memory=67108864");
    testing::needs_devices(2)
        .then(|| (Device::get(0).unwrap().context().unwrap(), Device::get(1).unwrap().context().unwrap()))
}

fn check_sim() {
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    }
}

#[test]
#[serial_test::serial]
fn the_legacy_streams_of_two_devices_are_two_streams() {
    let Some((ctx0, ctx1)) = contexts() else { return };
    let pool = Arc::new(CachingResource::with_driver(&ctx0, PoolConfig::default()));
    let resource = pool.clone();
    let (legacy0, legacy1) = (Stream::legacy(&ctx0), Stream::legacy(&ctx1));
    let (c, b) = (Stream::non_blocking(&ctx0).unwrap(), Stream::non_blocking(&ctx0).unwrap());

    // A device-0 buffer last used on device 1's legacy stream: its memory is cached for that stream.
    let w = DeviceBuffer::<u32>::zeroed_in(&resource, &c, 256).unwrap();
    drop(w.order().use_on(&legacy1).unwrap());
    drop(w);

    // Device 0's legacy stream reads a block, held back by a gate; the block is freed meanwhile.
    let mut x = DeviceBuffer::<u32>::zeroed_in(&resource, &legacy0, N).unwrap();
    legacy0.fill(&mut x, A).unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx0, N).unwrap();
    let gate = gate::hold(&legacy0);
    legacy0.copy_d2h(&x, &mut seen).unwrap();
    let x_range = x.device_ptr()..x.device_ptr() + x.bytes() as u64;
    drop(x);

    // Stream b takes the memory: it must wait for device 0's legacy stream, not device 1's.
    let mut y = DeviceBuffer::<u32>::zeroed_in(&resource, &b, N).unwrap();
    let y_range = y.device_ptr()..y.device_ptr() + y.bytes() as u64;
    assert!(
        y_range.start < x_range.end && x_range.start < y_range.end,
        "b did not get the freed block's memory: the test would prove nothing"
    );
    b.fill(&mut y, B).unwrap();
    std::thread::sleep(Duration::from_millis(50)); // time for b to run, if nothing holds it back
    gate.release();
    legacy0.synchronize().unwrap();
    b.synchronize().unwrap();
    let seen = seen.to_vec().unwrap();
    let foreign = seen.iter().filter(|&&v| v != A).count();
    assert_eq!(foreign, 0, "{foreign} of {N} values read belonged to the next owner");
    drop(y);
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    check_sim();
}

/// A device-0 pool block read on a device-1 stream (held back by a gate) and freed; then `release`
/// gives the pool's memory back to the driver. The gate opens a little later on another thread.
fn release_waits_for_the_other_device(release: impl FnOnce(&Arc<CachingResource>)) {
    let Some((ctx0, ctx1)) = contexts() else { return };
    let pool = Arc::new(CachingResource::with_driver(
        &ctx0,
        PoolConfig { release_threshold: 0, ..PoolConfig::default() },
    ));
    let resource = pool.clone();
    let a0 = Stream::non_blocking(&ctx0).unwrap();
    let s1 = Stream::non_blocking(&ctx1).unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed_in(&resource, &a0, N).unwrap();
    a0.fill(&mut x, A).unwrap();
    // Device 1's copy of the data, made by s1 reading the pool's block (unified addressing).
    let copy = DeviceBuffer::<u32>::zeroed_in(&Arc::new(DriverResource::new(&ctx1)), &s1, N).unwrap();
    let gate = gate::hold(&s1);
    let opener = gate.release_after(Duration::from_millis(150));
    {
        let _ticket = x.order().use_on(&s1).unwrap();
        ctx1.bind().unwrap();
        // SAFETY: both ranges are `N` u32 of live device memory; the read of `x` is recorded on s1
        // by the ticket (so `x` is freed after it in stream order) and `copy`'s only user is s1.
        let code =
            unsafe { sys::cuMemcpyDtoDAsync_v2(copy.device_ptr(), x.device_ptr(), x.bytes(), s1.raw()) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
    drop(x); // freed on s1, its last user, while s1's read is pending behind the gate

    release(&pool);
    opener.join().unwrap();
    let passed = s1.synchronize();
    let violations = testing::sim_control().map(|c| c.violations()).unwrap_or_default();
    assert!(violations.is_empty(), "memory freed under device 1's pending read: {violations:?}");
    passed.unwrap();
    let seen = copy.to_vec().unwrap();
    assert!(seen.iter().all(|&v| v == A), "device 1 read {:#x} instead of the data", seen[0]);
    assert_eq!(pool.stats().reserved_bytes, 0);
}

#[test]
#[serial_test::serial]
fn trim_waits_for_a_stream_of_another_device() {
    release_waits_for_the_other_device(|pool| {
        assert_eq!(pool.trim().unwrap().released_segments, 1);
    });
}

#[test]
#[serial_test::serial]
fn the_release_threshold_waits_for_a_stream_of_another_device() {
    release_waits_for_the_other_device(|pool| {
        assert_eq!(pool.synchronize().unwrap().released_segments, 1);
    });
}

#[test]
#[serial_test::serial]
fn the_out_of_memory_ladder_waits_for_a_stream_of_another_device() {
    release_waits_for_the_other_device(|pool| {
        // More than device 0 has besides the cached segment: the ladder must release that segment.
        let ctx = pool.pool().upstream().resource().context().clone();
        let free = ctx.mem_info().unwrap().free;
        let resource = pool.clone();
        let stream = Stream::non_blocking(&ctx).unwrap();
        let big = DeviceBuffer::<u8>::new_in(&resource, &stream, free + (1 << 20)).unwrap();
        drop(big);
        pool.trim().unwrap();
    });
}

/// A driver-pool block written and read on a non-blocking device-0 stream (held back by a gate),
/// then last used on `last`, a stream of device 1, and dropped; device 0's legacy stream then takes
/// memory from the pool and writes it. The free must follow the gated work: a free queued on
/// device 0's legacy stream (which does not wait for a non-blocking stream) hands the block to the
/// legacy stream at once, whose write lands before the gated read.
///
/// With `fail_wait`, the free's wait for `last` fails (simulator only): it must then wait for
/// `last` on the host before freeing. The gate opens on another thread, as that wait waits for it.
fn a_native_pool_free_follows_a_stream_of_another_device(
    last: impl FnOnce(&Context) -> Stream,
    fail_wait: bool,
) {
    let Some((ctx0, ctx1)) = contexts() else { return };
    let ctl = testing::sim_control();
    if fail_wait && ctl.is_none() {
        return testing::skip("injects driver faults: simulator only");
    }
    let last = last(&ctx1);
    let pool = Arc::new(NativePoolResource::new(
        MemPool::create(&ctx0, MemPoolOptions { max_size: None, release_threshold: u64::MAX }).unwrap(),
    ));
    let (s0, legacy0) = (Stream::non_blocking(&ctx0).unwrap(), Stream::legacy(&ctx0));
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx0, N).unwrap();
    let gate = gate::hold(&s0);
    let mut x = DeviceBuffer::<u32>::zeroed_in(&pool, &s0, N).unwrap();
    s0.fill(&mut x, A).unwrap();
    s0.copy_d2h(&x, &mut seen).unwrap();
    drop(x.order().use_on(&last).unwrap()); // `last` waits for s0 and follows every use
    // The gate opens on another thread: a free that waits for `last`, or a pool that orders y
    // after the gated work, must not deadlock this one.
    let opener = gate.release_after(Duration::from_millis(200));
    let fault = ctl.filter(|_| fail_wait).map(|ctl| {
        let rule = cumem_sys::sim_control::FaultRule {
            this_thread_only: true,
            ..cumem_sys::sim_control::FaultRule::nth_call(
                "cuStreamWaitEvent",
                1,
                sys::CUresult::CUDA_ERROR_UNKNOWN,
            )
        };
        (ctl.inject_fault(rule), ctl.calls_on_this_thread("cuStreamWaitEvent"), ctl)
    });
    drop(x);
    if let Some((rule, before, ctl)) = fault {
        let tried = ctl.calls_on_this_thread("cuStreamWaitEvent") - before;
        assert_eq!(tried, 1, "the free did not try to wait (once)");
        ctl.remove_fault(rule);
    }
    let mut y = DeviceBuffer::<u32>::zeroed_in(&pool, &legacy0, N).unwrap();
    legacy0.fill(&mut y, B).unwrap();
    legacy0.synchronize().unwrap();
    opener.join().unwrap();
    s0.synchronize().unwrap();
    last.synchronize().unwrap();
    let violations = testing::sim_control().map(|c| c.violations()).unwrap_or_default();
    assert!(violations.is_empty(), "the block was freed under the gated work: {violations:?}");
    let seen = seen.to_vec().unwrap();
    let foreign = seen.iter().filter(|&&v| v != A).count();
    assert_eq!(foreign, 0, "{foreign} of {N} values read belonged to the next owner");
    assert!(y.to_vec().unwrap().iter().all(|&v| v == B));
    drop(y);
    drop(pool);
    check_sim();
}

#[test]
#[serial_test::serial]
fn a_native_pool_block_last_used_on_another_devices_legacy_stream_is_freed_after_its_work() {
    a_native_pool_free_follows_a_stream_of_another_device(Stream::legacy, false);
}

#[test]
#[serial_test::serial]
fn a_native_pool_block_last_used_on_another_devices_stream_is_freed_after_its_work() {
    a_native_pool_free_follows_a_stream_of_another_device(|ctx1| Stream::non_blocking(ctx1).unwrap(), false);
}

#[test]
#[serial_test::serial]
fn a_native_pool_free_whose_wait_for_another_devices_stream_fails_waits_on_the_host() {
    a_native_pool_free_follows_a_stream_of_another_device(Stream::legacy, true);
}
