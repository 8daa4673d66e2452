//! The caching pool with expandable segments on the device (issue 10, item 3): blocks laid across
//! chunk boundaries keep their data bitwise, growth maps chunks and takes no upstream block, trim
//! unmaps whole chunks and the driver's free memory
//! rises by exactly what it reports, memory moves between streams only behind an event, a device
//! without virtual memory management falls back to segments, a failed unmap keeps its chunk mapped
//! and cached, a chunk a failed map could not undo is unmapped before growth maps there again, and
//! nothing is left in the live report.
//! Every test reads the device's free memory or holds a stream, so all are `#[serial]`.

use std::sync::Arc;
use std::time::Duration;

use cumem_copy::{StreamCopy, copy_h2d};
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;
use serial_test::serial;

mod common;
use common::{assert_sim_clean as assert_clean, fails_once_on_this_thread};

const MIB: usize = 1 << 20;

/// Device 1 has no virtual memory management; streams run late enough that a missing wait shows.
fn init() {
    testing::init_with("devices=2,latency_us=500,dev1.virtual_memory_management_supported=0");
}

/// Device 0's context, if it has virtual memory management (on a real GPU it may not).
fn vmm_ctx() -> Option<Context> {
    init();
    let device = Device::get(0).unwrap();
    let found = device.capabilities().unwrap().virtual_memory.then(|| device.context().unwrap());
    if found.is_none() {
        testing::skip("device 0 has no virtual memory management");
    }
    found
}

fn expandable_pool(ctx: &Context) -> Arc<CachingResource> {
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(ctx, config));
    assert!(pool.pool().expandable().is_some());
    pool
}

/// The device's chunk: the recommended granularity (what the pool maps).
fn chunk(ctx: &Context) -> u64 {
    cumem_vmm::Granularity::of(ctx.device()).unwrap().recommended as u64
}

#[test]
#[serial]
fn data_round_trips_bitwise_across_chunk_boundaries() {
    let Some(ctx) = vmm_ctx() else { return };
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let c = chunk(&ctx) as usize;
    // Large blocks back to back in one segment: most of them straddle a chunk boundary.
    let sizes = [c + c / 4, 3 * c / 2, c / 2 + 4096, 2 * c + 512, c + 64 * 1024];
    let mut bufs = vec![];
    for (i, &bytes) in sizes.iter().enumerate() {
        let n = bytes / 4;
        let data: Vec<u32> =
            (0..n as u32).map(|k| k.wrapping_mul(2_654_435_761) ^ (i as u32) << 28).collect();
        let mut buf = DeviceBuffer::<u32>::new_in(&pool, &stream, n).unwrap();
        stream.synchronize().unwrap();
        copy_h2d(&data, &mut buf).unwrap();
        bufs.push((buf, data));
    }
    let starts: Vec<u64> = bufs.iter().map(|(b, _)| b.device_ptr()).collect();
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "one segment, growing at its end: {starts:x?}");
    let straddling = bufs.iter().filter(|(b, _)| {
        let (s, e) = (b.device_ptr() - starts[0], b.device_ptr() - starts[0] + b.bytes() as u64);
        s / chunk(&ctx) != (e - 1) / chunk(&ctx)
    });
    assert!(straddling.count() >= 3);
    // A device-to-device copy across the whole segment, then every block read back.
    let (first, _) = &bufs[1];
    let mut copy = DeviceBuffer::<u32>::zeroed_in(&pool, &stream, first.len()).unwrap();
    stream.copy_d2d(first, &mut copy).unwrap();
    for (buf, data) in &bufs {
        assert_eq!(&buf.to_vec().unwrap(), data);
    }
    assert_eq!(copy.to_vec().unwrap(), bufs[1].1);
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes % chunk(&ctx), 0);
    assert_eq!(stats.reserved_bytes, pool.pool().segments().iter().map(|s| s.1).sum::<u64>());
    drop((bufs, copy));
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn trim_unmaps_whole_chunks_and_the_driver_sees_exactly_them() {
    let Some(ctx) = vmm_ctx() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let free_at_start = ctx.mem_info().unwrap().free;
    let ctl = testing::sim_control();
    let calls = |f: &str| ctl.as_ref().map(|ctl| ctl.calls_on_this_thread(f));
    const UPSTREAM: [&str; 3] = ["cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocFromPoolAsync"];
    let upstream_before = UPSTREAM.map(calls);
    let (creates, maps) = (calls("cuMemCreate"), calls("cuMemMap"));
    // 1.25 chunks, then 2.5 chunks: 4 chunks mapped.
    let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, (5 * c / 4) as usize).unwrap();
    let b = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, (5 * c / 2) as usize).unwrap();
    assert_eq!(b.device_ptr(), a.device_ptr() + 5 * c / 4);
    // Grown by mapping chunks, not by taking blocks from upstream.
    assert_eq!(UPSTREAM.map(calls), upstream_before, "{UPSTREAM:?}");
    assert_eq!((calls("cuMemCreate"), calls("cuMemMap")), (creates.map(|n| n + 4), maps.map(|n| n + 4)));
    assert_eq!(pool.stats().reserved_bytes, 4 * c);
    assert_eq!(free_at_start - ctx.mem_info().unwrap().free, 4 * c as usize, "charged when mapped");
    drop(b);
    // Free from 1.25 chunks up: the 2 chunks from 2 up are whole.
    let before = ctx.mem_info().unwrap().free;
    let report = pool.trim().unwrap();
    assert_eq!(report.released_bytes, 2 * c);
    assert_eq!(ctx.mem_info().unwrap().free - before, report.released_bytes as usize);
    assert_eq!(pool.stats().reserved_bytes, 2 * c);
    drop(a);
    let before = ctx.mem_info().unwrap().free;
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (2 * c, 1));
    assert_eq!(ctx.mem_info().unwrap().free - before, 2 * c as usize);
    assert_eq!(ctx.mem_info().unwrap().free, free_at_start);
    drop((pool, stream));
    assert_clean();
}

/// A request larger than the device is out of memory at once: no chunk is created and undone
/// for it (one per chunk of the device's memory), and the pool serves the next request.
#[test]
#[serial]
fn a_request_larger_than_the_device_is_refused_without_mapping_anything() {
    let Some(ctx) = vmm_ctx() else { return };
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let ctl = testing::sim_control();
    let calls = |f: &str| ctl.as_ref().map(|ctl| ctl.calls_on_this_thread(f));
    let (creates, maps) = (calls("cuMemCreate"), calls("cuMemMap"));
    let total = ctx.device().total_memory().unwrap();
    let refused = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, total + 1);
    assert!(matches!(refused, Err(cumem_core::Error::OutOfMemory { .. })), "{refused:?}");
    assert_eq!((calls("cuMemCreate"), calls("cuMemMap")), (creates, maps), "chunks were made for it");
    assert_eq!(pool.stats().reserved_bytes, 0);
    let served = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, MIB).unwrap();
    drop((served, pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_map_past_a_reservation_or_the_address_space_is_an_error_not_a_panic() {
    let Some(ctx) = vmm_ctx() else { return };
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let buf = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, MIB).unwrap();
    let up = pool.pool().expandable().unwrap();
    let c = up.chunk_bytes();
    let (base, len) = pool.pool().segments()[0];
    let ctl = testing::sim_control();
    let maps = || ctl.as_ref().map(|ctl| ctl.calls_on_this_thread("cuMemMap"));
    let before = maps();
    // `map` is safe: ranges that wrap around the address space or run past the reservation the
    // address lies in are refused before the driver is asked.
    assert!(up.map(0u64.wrapping_sub(2 * c as u64), 4 * c).is_err());
    assert!(up.map(base + up.reservation_bytes() as u64 - c as u64, 2 * c).is_err());
    assert_eq!(maps(), before, "the driver was asked to map");
    up.log_deferred();
    // The pool is unharmed.
    assert_eq!(pool.pool().segments(), vec![(base, len)]);
    pool.pool().validate().unwrap();
    let more = DeviceBuffer::<u8>::from_slice_in(&pool, &stream, &[7u8; 4096]).unwrap();
    assert_eq!(more.to_vec().unwrap(), vec![7u8; 4096]);
    drop((buf, more, pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn another_stream_gets_freed_memory_only_after_the_work_on_it() {
    let Some(ctx) = vmm_ctx() else { return };
    let pool = expandable_pool(&ctx);
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let n = 3 * MIB / 4; // 3 MiB of u32: a large block
    let mut x = DeviceBuffer::<u32>::zeroed_in(&pool, &a, n).unwrap();
    a.fill(&mut x, 0xAAAA_AAAA).unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx, n).unwrap();
    a.context().bind().unwrap();
    assert!(serial_test::is_locked_serially(None));
    // SAFETY: `a` is alive and its context current.
    let gate = unsafe { testing::hold(a.raw()) };
    a.copy_d2h(&x, &mut seen).unwrap(); // pending on A, behind the gate
    let x_ptr = x.device_ptr();
    drop(x); // freed on A while A still reads it
    let mut y = DeviceBuffer::<u32>::zeroed_in(&pool, &b, n).unwrap();
    assert_eq!(y.device_ptr(), x_ptr, "B did not get A's block: the test would prove nothing");
    b.fill(&mut y, 0xBBBB_BBBB).unwrap();
    std::thread::sleep(Duration::from_millis(50)); // time for B to run, if nothing held it back
    gate.release();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert!(
        seen.to_vec().unwrap().iter().all(|&v| v == 0xAAAA_AAAA),
        "B overwrote the block before A read it"
    );
    drop((y, seen));
    pool.trim().unwrap();
    drop((pool, a, b));
    assert_clean();
}

#[test]
#[serial]
fn a_device_without_virtual_memory_falls_back_to_segments() {
    init();
    // The simulator's device 1; on a real machine, any device without VMM (usually none).
    let Some(device) = Device::all().unwrap().into_iter().find(|d| !d.capabilities().unwrap().virtual_memory)
    else {
        return testing::skip("needs a device without virtual memory management (the simulator's device 1)");
    };
    let ctx = device.context().unwrap();
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(&ctx, config));
    assert!(pool.pool().expandable().is_none());
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<u8>::new_in(&pool, &stream, 5000).unwrap();
    stream.synchronize().unwrap();
    copy_h2d(&[7u8; 5000], &mut buf).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![7u8; 5000]);
    assert_eq!(pool.pool().segments().len(), 1);
    assert_eq!(pool.stats().reserved_bytes, 2 * MIB as u64, "a small segment");
    drop(buf);
    pool.trim().unwrap();
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_failed_unmap_keeps_the_chunk_mapped_and_the_segment_grows_above_it() {
    let Some(ctx) = vmm_ctx() else { return };
    // Injecting the failure needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, (3 * c) as usize).unwrap();
    let base = a.device_ptr();
    drop(a);
    // The second unmap (the middle chunk; trim goes from the top) fails once.
    let rule = ctl.inject_fault(fails_once_on_this_thread("cuMemUnmap", 2));
    let before = ctx.mem_info().unwrap().free;
    let report = pool.trim().unwrap();
    ctl.remove_fault(rule);
    assert_eq!((report.released_bytes, report.released_segments), (c, 0));
    assert_eq!(ctx.mem_info().unwrap().free - before, c as usize, "only the top chunk was freed");
    assert_eq!(pool.stats().reserved_bytes, 2 * c);
    assert_eq!(pool.pool().segments(), vec![(base, 2 * c)]);
    // Four chunks: the two kept ones at the base and two new ones mapped above them.
    let n = (4 * c) as usize / 4;
    let data: Vec<u32> = (0..n as u32).map(|k| k.wrapping_mul(2_654_435_761)).collect();
    let mut b = DeviceBuffer::<u32>::new_in(&pool, &stream, n).unwrap();
    assert_eq!(b.device_ptr(), base);
    stream.synchronize().unwrap();
    copy_h2d(&data, &mut b).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    assert_eq!(pool.stats().reserved_bytes, 4 * c);
    drop(b);
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (4 * c, 1));
    assert_eq!(pool.stats().reserved_bytes, 0);
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_chunk_whose_rollback_unmap_failed_is_unmapped_before_growth_maps_there_again() {
    let Some(ctx) = vmm_ctx() else { return };
    // Injecting the failures needs the simulator.
    let Some(ctl) = testing::sim_control() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, c as usize).unwrap();
    let base = a.device_ptr();
    // Growing by two chunks: the second map fails, and undoing the first one's fails too.
    let rules = [("cuMemMap", 2), ("cuMemUnmap", 1)]
        .map(|(function, nth)| ctl.inject_fault(fails_once_on_this_thread(function, nth)));
    let n = (2 * c) as usize / 4;
    let err = DeviceBuffer::<u32>::new_in(&pool, &stream, n).unwrap_err();
    for rule in rules {
        ctl.remove_fault(rule);
    }
    assert!(matches!(err, cumem_core::Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, .. }), "{err:?}");
    assert_eq!(pool.pool().segments(), vec![(base, c)]);
    // The same growth again: the chunk left mapped is unmapped first, then both are mapped.
    let data: Vec<u32> = (0..n as u32).map(|k| k.wrapping_mul(2_654_435_761)).collect();
    let mut b = DeviceBuffer::<u32>::new_in(&pool, &stream, n).unwrap();
    assert_eq!(b.device_ptr(), base + c);
    stream.synchronize().unwrap();
    copy_h2d(&data, &mut b).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    assert_eq!(pool.stats().reserved_bytes, 3 * c);
    drop((a, b));
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (3 * c, 1));
    drop((pool, stream));
    assert_clean();
}
