//! Expandable segments on the device, after a workload frees its middle: trim unmaps the whole free
//! chunks of a hole between live blocks (the driver's free memory and mappings say exactly which),
//! the blocks around it keep their addresses and their data bitwise, a later allocation maps the
//! hole again, a chunk freed under queued work is unmapped only after that work completed, a full
//! segment makes the pool reserve a second one, and a refused reservation is an address-space
//! error, not out-of-memory. Every test reads the device's free memory or holds a stream, so all
//! are `#[serial]`.

use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, Error, PinnedBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use serial_test::serial;

mod common;
mod gate;

use common::assert_sim_clean as assert_clean;

/// Streams run late enough that a missing wait shows.
fn vmm_ctx() -> Option<Context> {
    testing::init_with("latency_us=500");
    let device = Device::get(0).unwrap();
    device.capabilities().unwrap().virtual_memory.then(|| device.context().unwrap())
}

fn expandable_pool(ctx: &Context, reservation: Option<usize>) -> Arc<CachingResource> {
    let config = PoolConfig {
        expandable_segments: true,
        expandable_reservation_bytes: reservation,
        ..PoolConfig::default()
    };
    let pool = Arc::new(CachingResource::with_driver(ctx, config));
    assert!(pool.pool().expandable().is_some());
    pool
}

/// The device's chunk: the recommended granularity (what the pool maps).
fn chunk(ctx: &Context) -> u64 {
    cumem_vmm::Granularity::of(ctx.device()).unwrap().recommended as u64
}

/// `n` distinct values, different for each `seed`.
fn pattern(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|k| k.wrapping_mul(2_654_435_761) ^ seed.rotate_left(28)).collect()
}

/// A buffer of `bytes` bytes from `pool`, holding `pattern(.., seed)`, last used on `stream` (so
/// that its free caches it in `stream`'s arena).
fn filled(
    pool: &Arc<CachingResource>,
    stream: &Stream,
    bytes: u64,
    seed: u32,
) -> (DeviceBuffer<u32>, Vec<u32>) {
    let data = pattern(bytes as usize / 4, seed);
    let buf = DeviceBuffer::<u32>::from_slice_in(pool, stream, &data).unwrap();
    (buf, data)
}

/// The simulator's mappings inside `[lo, hi)` as `(offset from lo, bytes)`; `None` on a GPU.
fn sim_mappings(lo: u64, hi: u64) -> Option<Vec<(u64, u64)>> {
    let report = testing::sim_control()?.live_report();
    let mut out: Vec<(u64, u64)> =
        report.mappings.iter().filter(|m| m.ptr >= lo && m.ptr < hi).map(|m| (m.ptr - lo, m.bytes)).collect();
    out.sort_unstable();
    Some(out)
}

#[test]
#[serial]
fn trim_unmaps_a_hole_and_the_blocks_around_it_keep_their_data() {
    let Some(ctx) = vmm_ctx() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx, None);
    let stream = Stream::non_blocking(&ctx).unwrap();
    // [0, 1.5) [1.5, 4.5) [4.5, 6) chunks: six mapped.
    let (a, a_data) = filled(&pool, &stream, 3 * c / 2, 1);
    let (b, _) = filled(&pool, &stream, 3 * c, 2);
    let (d, d_data) = filled(&pool, &stream, 3 * c / 2, 3);
    let base = a.device_ptr();
    assert_eq!((b.device_ptr(), d.device_ptr()), (base + 3 * c / 2, base + 9 * c / 2));
    assert_eq!(pool.stats().reserved_bytes, 6 * c);
    let every_chunk: Vec<(u64, u64)> = (0..6).map(|i| (i * c, c)).collect();
    if let Some(m) = sim_mappings(base, base + 6 * c) {
        assert_eq!(m, every_chunk);
    }
    drop(b);
    // The hole [1.5, 4.5) holds two whole chunks, [2, 4): they go, the rest stays mapped.
    let free_before = ctx.mem_info().unwrap().free;
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (2 * c, 0));
    assert_eq!(ctx.mem_info().unwrap().free - free_before, 2 * c as usize);
    assert_eq!(pool.stats().reserved_bytes, 4 * c);
    assert_eq!(pool.pool().segments(), vec![(base, 2 * c), (base + 4 * c, 2 * c)]);
    if let Some(m) = sim_mappings(base, base + 6 * c) {
        assert_eq!(m, vec![(0, c), (c, c), (4 * c, c), (5 * c, c)]);
    }
    pool.pool().validate().unwrap();
    assert_eq!(a.to_vec().unwrap(), a_data);
    assert_eq!(d.to_vec().unwrap(), d_data);
    // 2.5 chunks: the half chunk below the hole and the hole's two chunks, mapped again.
    let (e, e_data) = filled(&pool, &stream, 5 * c / 2, 4);
    assert_eq!(e.device_ptr(), base + 3 * c / 2);
    assert_eq!(pool.stats().reserved_bytes, 6 * c);
    if let Some(m) = sim_mappings(base, base + 6 * c) {
        assert_eq!(m, every_chunk);
    }
    // Everything is live or a partial chunk: nothing to give back, nothing disturbed.
    assert_eq!(pool.trim().unwrap().released_bytes, 0);
    for (buf, data) in [(&a, &a_data), (&d, &d_data), (&e, &e_data)] {
        assert_eq!(&buf.to_vec().unwrap(), data);
    }
    drop((a, d, e));
    assert_eq!(pool.trim().unwrap().released_bytes, 6 * c);
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_hole_with_queued_work_is_unmapped_only_after_the_work_completed() {
    let Some(ctx) = vmm_ctx() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx, None);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let (a, a_data) = filled(&pool, &stream, c, 1);
    let (b, b_data) = filled(&pool, &stream, 2 * c, 2);
    let (d, d_data) = filled(&pool, &stream, c, 3);
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx, b_data.len()).unwrap();
    let gate = gate::hold(&stream);
    stream.copy_d2h(&b, &mut seen).unwrap(); // queued behind the gate
    drop(b); // freed on the stream while the copy still reads it: two whole chunks
    // Trim must wait for the copy before it unmaps: the gate opens from another thread meanwhile.
    let opener = gate.release_after(Duration::from_millis(50));
    let report = pool.trim().unwrap();
    opener.join().unwrap();
    assert_eq!(report.released_bytes, 2 * c);
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "unmapped under the queued copy: {:?}", ctl.violations());
    }
    stream.synchronize().unwrap();
    assert_eq!(seen.to_vec().unwrap(), b_data, "the copy read the hole after it was unmapped");
    assert_eq!(a.to_vec().unwrap(), a_data);
    assert_eq!(d.to_vec().unwrap(), d_data);
    drop((a, d, seen));
    pool.trim().unwrap();
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_full_segment_is_followed_by_a_second_reservation() {
    let Some(ctx) = vmm_ctx() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx, Some(4 * c as usize));
    let stream = Stream::non_blocking(&ctx).unwrap();
    let (a, a_data) = filled(&pool, &stream, 3 * c, 1);
    let (b, b_data) = filled(&pool, &stream, 3 * c, 2); // one chunk left in the first: a second
    assert_eq!(pool.stats().segments, 2);
    assert_eq!(pool.stats().reserved_bytes, 6 * c);
    let (sa, sb) = (a.device_ptr(), b.device_ptr());
    assert!(sb >= sa + 4 * c || sb + 4 * c <= sa, "two reservations: {sa:#x} {sb:#x}");
    if let Some(ctl) = testing::sim_control() {
        let r = ctl.live_report().reservations;
        let ours: Vec<u64> = r.iter().filter(|r| r.ptr == sa || r.ptr == sb).map(|r| r.bytes).collect();
        assert_eq!(ours, vec![4 * c, 4 * c], "{r:?}");
    }
    // A block larger than the configured reservation gets one of its own size.
    let (big, big_data) = filled(&pool, &stream, 5 * c, 3);
    assert_eq!(pool.stats().segments, 3);
    for (buf, data) in [(&a, &a_data), (&b, &b_data), (&big, &big_data)] {
        assert_eq!(&buf.to_vec().unwrap(), data);
    }
    assert_eq!((a.device_ptr(), b.device_ptr()), (sa, sb));
    drop((a, b, big));
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (11 * c, 3));
    drop((pool, stream));
    assert_clean();
}

#[test]
#[serial]
fn a_refused_reservation_is_an_address_space_error() {
    let Some(ctx) = vmm_ctx() else { return };
    // Injecting the refusal needs the simulator (on a GPU, exhausting the address space takes
    // hundreds of terabytes of reservations).
    let Some(ctl) = testing::sim_control() else { return };
    let c = chunk(&ctx);
    let pool = expandable_pool(&ctx, Some(4 * c as usize));
    let stream = Stream::non_blocking(&ctx).unwrap();
    let (a, a_data) = filled(&pool, &stream, 3 * c, 1);
    // The driver reports exhausted virtual addresses as OUT_OF_MEMORY (driver-api.md §9).
    let rule = ctl.inject_fault(FaultRule {
        function: "cuMemAddressReserve".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 0,
        this_thread_only: true,
    });
    let free_before = ctx.mem_info().unwrap().free;
    let err = DeviceBuffer::<u32>::new_in(&pool, &stream, (3 * c / 4) as usize).unwrap_err();
    ctl.remove_fault(rule);
    match &err {
        Error::LimitExceeded { what, limit } => {
            assert_eq!(*limit, 4 * c as usize);
            assert!(what.contains("expandable_reservation_bytes"), "{err}");
            assert!(
                err.to_string().contains(&format!("at most {} bytes: a reservation of that many", 4 * c)),
                "{err}"
            );
        }
        other => panic!("expected an address-space limit, got {other:?}"),
    }
    assert_eq!(ctx.mem_info().unwrap().free, free_before, "nothing was mapped for the refused request");
    assert_eq!(pool.stats().segments, 1);
    assert_eq!(a.to_vec().unwrap(), a_data);
    // Reservations work again: the pool falls back to a second segment.
    let (b, b_data) = filled(&pool, &stream, 3 * c, 2);
    assert_eq!(pool.stats().segments, 2);
    assert_eq!(b.to_vec().unwrap(), b_data);
    drop((a, b));
    pool.trim().unwrap();
    drop((pool, stream));
    assert_clean();
}
