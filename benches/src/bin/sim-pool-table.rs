//! `cargo xtask bench sim-pool`: what the simulator's own entry points cost, called through its C
//! ABI (the crate's exports, linked in; no cumem code in between), as markdown tables.
//!
//! 1. `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` of 256 B on one stream, with 0, 1,000 and
//!    10,000 other blocks live in the pool (mixed sizes, with a free hole beside each live block,
//!    so the pool's free map holds as many entries as there are live blocks).
//! 2. The per-call cost of the calls the library's fast path is compared against: event create,
//!    record, stream wait, destroy, and a 4-byte `cuMemcpyHtoDAsync_v2` from pinned memory.
//!
//! Each row is the median of 5 timed runs after a warm-up run. The simulated latency is the
//! default (200 µs): queued operations run on the engine thread meanwhile, as in the tests.

use std::ffi::c_void;
use std::time::Instant;

use cumem_sim::exports::{context, copy, event, init, memory, pool, stream};
use cumem_sys::sys::CUresult;

/// Panics unless a driver call succeeded (a benchmark has no error path worth keeping).
#[track_caller]
fn ok(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "driver call failed");
}

/// Median over 5 timed runs of `iters` calls of `f`, after a warm-up run; ns per call.
fn ns_per_op(iters: u64, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 10 + 1 {
        f();
    }
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[2]
}

/// A deterministic size between 512 B and 32 KiB.
fn size(i: u64) -> usize {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54; // 0..1024
    512 + (x as usize) * 32
}

fn main() {
    ok(init::cuInit(0));
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointers and live handles throughout; every allocation is freed before
    // the end.
    unsafe {
        ok(context::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(context::cuCtxSetCurrent(ctx));
        let mut s = std::ptr::null_mut();
        ok(stream::cuStreamCreate(&mut s, 1));
        let mut p = std::ptr::null_mut();
        ok(pool::cuDeviceGetDefaultMemPool(&mut p, 0));
        // Keep every reservation: the rows measure placement, not chunk mapping.
        let mut keep = u64::MAX;
        ok(pool::cuMemPoolSetAttribute(p, 4, (&raw mut keep).cast::<c_void>()));

        println!("# cumem-sim: per-call cost of its entry points");
        println!();
        println!("## cuMemAllocFromPoolAsync + cuMemFreeAsync (256 B, one stream)");
        println!();
        println!("| live blocks in the pool | ns per alloc+free |");
        println!("|---:|---:|");
        let mut live: Vec<u64> = Vec::new();
        for target in [0usize, 1_000, 10_000] {
            // Two neighbours per live block; the second is freed, leaving a hole of its size.
            let mut holes = Vec::new();
            let mut i = live.len() as u64;
            while live.len() < target {
                for list in [&mut live, &mut holes] {
                    let mut d = 0;
                    ok(pool::cuMemAllocFromPoolAsync(&mut d, size(i), p, s));
                    list.push(d);
                    i += 1;
                }
            }
            for d in holes {
                ok(pool::cuMemFreeAsync(d, s));
            }
            ok(stream::cuStreamSynchronize(s));
            let iters = match target {
                0 => 100_000,
                1_000 => 20_000,
                _ => 5_000,
            };
            let ns = ns_per_op(iters, || {
                let mut d = 0;
                ok(pool::cuMemAllocFromPoolAsync(&mut d, 256, p, s));
                ok(pool::cuMemFreeAsync(d, s));
            });
            println!("| {target} | {ns:.0} |");
            ok(stream::cuStreamSynchronize(s));
        }
        for d in live.drain(..) {
            ok(pool::cuMemFreeAsync(d, s));
        }
        ok(stream::cuStreamSynchronize(s));

        println!();
        println!("## Stream and event calls (one non-blocking stream)");
        println!();
        println!("| call | ns per call |");
        println!("|---|---:|");
        let row = |name: &str, ns: f64| println!("| {name} | {ns:.0} |");
        row(
            "cuEventCreate + cuEventDestroy_v2 (DISABLE_TIMING)",
            ns_per_op(100_000, || {
                let mut e = std::ptr::null_mut();
                ok(event::cuEventCreate(&mut e, 2));
                ok(event::cuEventDestroy_v2(e));
            }),
        );
        let mut e = std::ptr::null_mut();
        ok(event::cuEventCreate(&mut e, 2));
        row("cuEventRecord", ns_per_op(100_000, || ok(event::cuEventRecord(e, s))));
        ok(stream::cuStreamSynchronize(s));
        let mut t = std::ptr::null_mut();
        ok(stream::cuStreamCreate(&mut t, 1));
        ok(event::cuEventRecord(e, s));
        row("cuStreamWaitEvent", ns_per_op(100_000, || ok(stream::cuStreamWaitEvent(t, e, 0))));
        ok(stream::cuStreamSynchronize(t));
        let mut host = std::ptr::null_mut();
        ok(memory::cuMemAllocHost_v2(&mut host, 4));
        let mut dev = 0;
        ok(memory::cuMemAlloc_v2(&mut dev, 4));
        row(
            "cuMemcpyHtoDAsync_v2, 4 B from pinned memory",
            ns_per_op(100_000, || ok(copy::cuMemcpyHtoDAsync_v2(dev, host.cast_const(), 4, s))),
        );
        ok(stream::cuStreamSynchronize(s));
        ok(memory::cuMemFree_v2(dev));
        ok(memory::cuMemFreeHost(host));
        ok(event::cuEventDestroy_v2(e));
        ok(stream::cuStreamDestroy_v2(t));
        ok(stream::cuStreamDestroy_v2(s));
    }
}
