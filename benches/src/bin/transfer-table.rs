//! `cargo xtask bench transfer`: cumem's transfers and allocation paths against the same raw
//! driver calls, side by side in one run, as a markdown table with the ratio of each pair.
//!
//! `--quick` sweeps two sizes only; `--small` measures the small queued calls only; `--channels`
//! the message-channel table only; `--runs N` takes the best of N timed runs instead of 15 (more
//! on a loaded machine).
//!
//! The small queued calls are timed twice: with the synchronisation after them (which measures the
//! device instead whenever it runs them more slowly than they are queued), and alone, queued
//! behind a gate (a host function that holds the stream closed until the timing has ended).
//!
//! Two more tables follow the main one: the profiling hooks (`cumem_copy::Profiler`) off vs on for
//! the same copies, with the cost of the off check alone, and large copies of pageable memory,
//! blocking vs staged through a `cumem_copy::StagingRing` vs pinned.
//!
//! Runs on the real driver when one is present, else on the simulator (said in the header; the
//! simulator's GB/s are those of host `memcpy`, so only the ratios mean anything there).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cumem_copy::StreamCopy;
use cumem_core::{Context, DeviceBuffer, DeviceResource, PinnedBuffer, Result, Stream};
use cumem_pool::{CachingResource, NativePoolResource, PoolConfig};
use cumem_sys::sys;

/// Fails loudly on a raw call's error: a benchmark that silently measures failures measures nothing.
fn ok(code: sys::CUresult, what: &'static str) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// The best of [`runs`] timings of `raw` and of `cumem`, taken in turns (after one warm-up call of
/// each) so that both see the same load. The minimum, not the median: on a shared machine (the
/// project's CI machine has 2 cores and other builds) every disturbance only adds time, so the
/// fastest run is the one closest to the call's own cost, and the ratio of minima is the stable one.
fn medians(
    mut raw: impl FnMut() -> Result<Duration>,
    mut cumem: impl FnMut() -> Result<Duration>,
) -> Result<(Duration, Duration)> {
    raw()?;
    cumem()?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..runs() {
        a.push(raw()?);
        b.push(cumem()?);
    }
    a.sort();
    b.sort();
    Ok((a[0], b[0]))
}

/// Times `f` once; `f` must leave no work queued that it did not wait for.
fn timed(f: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

/// One table row: what, the raw figure, cumem's figure, and cumem / raw (as time).
struct Row {
    what: String,
    unit: &'static str,
    raw: f64,
    cumem: f64,
    /// Higher is better (bandwidth): the ratio is raw / cumem, so that > 1 means cumem is slower.
    higher_better: bool,
}

impl Row {
    fn ratio(&self) -> f64 {
        if self.higher_better { self.raw / self.cumem } else { self.cumem / self.raw }
    }
}

/// Timed runs of each side: `--runs N`, 15 by default. On a loaded machine more runs give the
/// minimum more chances to fall on a batch that nothing disturbed.
fn runs() -> usize {
    static RUNS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *RUNS.get_or_init(|| {
        let args: Vec<String> = std::env::args().collect();
        args.windows(2)
            .find(|w| w[0] == "--runs")
            .and_then(|w| w[1].parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(15)
    })
}

/// `n` calls of `call`, then one synchronisation of `stream`, timed.
fn batch(stream: &Stream, n: u32, call: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
    timed(|| {
        for _ in 0..n {
            call()?;
        }
        stream.synchronize()
    })
}

/// How a batch of `n` calls is timed: [`batch`] or [`gated`].
type Timing = fn(&Stream, u32, &mut dyn FnMut() -> Result<()>) -> Result<Duration>;

/// µs per call of `raw` and of `cumem`, batches of `n` timed by `timing`.
fn us_per_call(
    stream: &Stream,
    n: u32,
    timing: Timing,
    mut raw: impl FnMut() -> Result<()>,
    mut cumem: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let (a, b) = medians(|| timing(stream, n, &mut raw), || timing(stream, n, &mut cumem))?;
    let us = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(n);
    Ok((us(a), us(b)))
}

/// µs per queued call of `raw` and of `cumem`: `n` calls queued, then one synchronisation.
fn per_call_us(
    stream: &Stream,
    n: u32,
    raw: impl FnMut() -> Result<()>,
    cumem: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    us_per_call(stream, n, batch, raw, cumem)
}

/// A raw call that queues or runs one operation; panics on failure (see [`ok`]).
macro_rules! raw {
    ($what:literal, $call:expr) => {
        || {
            // SAFETY: every raw call in this file names live allocations of the sizes given, on
            // memory nothing else touches while the stream runs, and each timing ends synchronised.
            ok(unsafe { $call }, $what);
            Ok(())
        }
    };
}

fn small_calls(ctx: &Context, stream: &Stream, rows: &mut Vec<Row>) -> Result<()> {
    const N: u32 = 2_000;
    let s = stream.raw();
    let host = PinnedBuffer::<u8>::from_slice(ctx, &[7u8; 4])?;
    let mut back = PinnedBuffer::<u8>::zeroed(ctx, 4)?;
    let mut dev = DeviceBuffer::<u8>::zeroed(stream, 4)?;
    let d = dev.as_slice().device_ptr();
    let (h, b) = (host.as_ptr(), back.as_mut_slice()?.as_mut_ptr());
    stream.synchronize()?;
    let mut push = |what: &str, (raw, cumem): (f64, f64)| {
        rows.push(Row { what: what.into(), unit: "µs/call", raw, cumem, higher_better: false });
    };
    push(
        "4 B copy_h2d queued, pinned (raw: cuMemcpyHtoDAsync_v2)",
        per_call_us(stream, N, raw!("HtoDAsync", sys::cuMemcpyHtoDAsync_v2(d, h.cast(), 4, s)), || {
            stream.copy_h2d(&host, &mut dev)
        })?,
    );
    // What cumem's call is made of: the copy and one cuCtxSetCurrent (every cumem call binds its
    // context, so that it works from any thread).
    let raw_ctx = ctx.raw();
    push(
        "4 B copy_h2d queued, pinned (raw: cuCtxSetCurrent + cuMemcpyHtoDAsync_v2)",
        per_call_us(
            stream,
            N,
            || {
                // SAFETY: as in `raw!`; `raw_ctx` is the retained primary context.
                ok(unsafe { sys::cuCtxSetCurrent(raw_ctx) }, "cuCtxSetCurrent");
                // SAFETY: as in `raw!`.
                ok(unsafe { sys::cuMemcpyHtoDAsync_v2(d, h.cast(), 4, s) }, "HtoDAsync");
                Ok(())
            },
            || stream.copy_h2d(&host, &mut dev),
        )?,
    );
    // A bind that asks first and sets only when another context is current (cudarc's way).
    push(
        "4 B copy_h2d queued, pinned (raw: cuCtxGetCurrent + cuMemcpyHtoDAsync_v2)",
        per_call_us(
            stream,
            N,
            || {
                let mut current = std::ptr::null_mut();
                // SAFETY: `current` is a valid out-pointer.
                ok(unsafe { sys::cuCtxGetCurrent(&mut current) }, "cuCtxGetCurrent");
                // SAFETY: as in `raw!`.
                ok(unsafe { sys::cuMemcpyHtoDAsync_v2(d, h.cast(), 4, s) }, "HtoDAsync");
                Ok(())
            },
            || stream.copy_h2d(&host, &mut dev),
        )?,
    );
    push(
        "4 B copy_d2h queued, pinned (raw: cuMemcpyDtoHAsync_v2)",
        per_call_us(stream, N, raw!("DtoHAsync", sys::cuMemcpyDtoHAsync_v2(b.cast(), d, 4, s)), || {
            stream.copy_d2h(&dev, &mut back)
        })?,
    );
    push(
        "4 B memset_d8 queued (raw: cuMemsetD8Async)",
        per_call_us(stream, N, raw!("MemsetD8Async", sys::cuMemsetD8Async(d, 1, 4, s)), || {
            stream.memset_d8(&mut dev, 1)
        })?,
    );
    // The same calls alone. The rows above time the calls and the synchronisation after them,
    // so when the device (or the simulator's engine thread) runs the copies more slowly than the
    // host queues them, they measure the device and the ratio tends to 1 whatever the calls cost.
    // Here the stream is held closed by a gate while the calls are timed.
    push(
        "4 B copy_h2d, the calls alone (stream gated; raw: cuMemcpyHtoDAsync_v2)",
        gated_call_us(
            stream,
            GATED,
            raw!("HtoDAsync", sys::cuMemcpyHtoDAsync_v2(d, h.cast(), 4, s)),
            || stream.copy_h2d(&host, &mut dev),
        )?,
    );
    push(
        "4 B copy_d2h, the calls alone (stream gated; raw: cuMemcpyDtoHAsync_v2)",
        gated_call_us(
            stream,
            GATED,
            raw!("DtoHAsync", sys::cuMemcpyDtoHAsync_v2(b.cast(), d, 4, s)),
            || stream.copy_d2h(&dev, &mut back),
        )?,
    );
    push(
        "4 B memset_d8, the calls alone (stream gated; raw: cuMemsetD8Async)",
        gated_call_us(stream, GATED, raw!("MemsetD8Async", sys::cuMemsetD8Async(d, 1, 4, s)), || {
            stream.memset_d8(&mut dev, 1)
        })?,
    );
    Ok(())
}

/// Calls per gated batch: few enough that a real driver's queue does not fill up (it would block
/// the calls until the gate opens).
const GATED: u32 = 500;

/// A gate: a host function queued on a stream that returns only once the host opens it, so that
/// nothing queued after it runs while the gate is closed.
struct Gate {
    open: parking_lot::Mutex<bool>,
    opened: parking_lot::Condvar,
}

/// The host function of a [`Gate`]: waits until it is opened.
unsafe extern "C" fn wait_for_gate(gate: *mut std::ffi::c_void) {
    // SAFETY: `gate` is the `Arc<Gate>` that `gated` passed, kept alive until the stream is idle.
    let gate = unsafe { &*gate.cast::<Gate>() };
    let mut open = gate.open.lock();
    while !*open {
        gate.opened.wait(&mut open);
    }
}

/// Times `n` calls of `call` queued behind a closed gate, then opens it and waits for the stream.
fn gated(stream: &Stream, n: u32, call: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
    let gate = Arc::new(Gate { open: parking_lot::Mutex::new(false), opened: parking_lot::Condvar::new() });
    let data = Arc::as_ptr(&gate).cast_mut().cast();
    // SAFETY: `wait_for_gate` only reads the gate, which `gate` keeps alive until the stream has
    // run it (the synchronisation below, also on the error paths, which open the gate first).
    ok(unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(wait_for_gate), data) }, "cuLaunchHostFunc");
    let t = Instant::now();
    let mut result = Ok(());
    for _ in 0..n {
        result = call();
        if result.is_err() {
            break;
        }
    }
    let elapsed = t.elapsed();
    *gate.open.lock() = true;
    gate.opened.notify_all();
    stream.synchronize()?;
    result.map(|()| elapsed)
}

/// µs per call of `raw` and of `cumem`, the calls alone: `n` of them queued behind a [`Gate`].
fn gated_call_us(
    stream: &Stream,
    n: u32,
    raw: impl FnMut() -> Result<()>,
    cumem: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    us_per_call(stream, n, gated, raw, cumem)
}

fn bandwidth(ctx: &Context, stream: &Stream, rows: &mut Vec<Row>, sizes: &[usize]) -> Result<()> {
    let s = stream.raw();
    for &bytes in sizes {
        let reps = ((64usize << 20) / bytes).clamp(2, 64) as u32;
        let label =
            if bytes >= 1 << 20 { format!("{} MiB", bytes >> 20) } else { format!("{} KiB", bytes >> 10) };
        let mut pinned = PinnedBuffer::<u8>::zeroed(ctx, bytes)?;
        let mut pageable = vec![3u8; bytes];
        let mut a = DeviceBuffer::<u8>::zeroed(stream, bytes)?;
        let mut b = DeviceBuffer::<u8>::zeroed(stream, bytes)?;
        let (pa, pb) = (a.as_slice().device_ptr(), b.as_slice().device_ptr());
        let hp = pinned.as_mut_slice()?.as_mut_ptr();
        let src = pageable.clone();
        let dst = pageable.as_mut_ptr();
        stream.synchronize()?;
        let mut push = |what: &str, (raw, cumem): (f64, f64)| {
            // µs per copy -> GB/s
            let gbps = |us: f64| bytes as f64 / us / 1e3;
            rows.push(Row {
                what: format!("{what} {label}"),
                unit: "GB/s",
                raw: gbps(raw),
                cumem: gbps(cumem),
                higher_better: true,
            });
        };
        push(
            "H2D pinned",
            per_call_us(
                stream,
                reps,
                raw!("HtoD", sys::cuMemcpyHtoDAsync_v2(pa, hp.cast(), bytes, s)),
                || stream.copy_h2d(&pinned, &mut a),
            )?,
        );
        push(
            "D2H pinned",
            per_call_us(
                stream,
                reps,
                raw!("DtoH", sys::cuMemcpyDtoHAsync_v2(hp.cast(), pa, bytes, s)),
                || stream.copy_d2h(&a, &mut pinned),
            )?,
        );
        push(
            "D2D",
            per_call_us(stream, reps, raw!("DtoD", sys::cuMemcpyDtoDAsync_v2(pb, pa, bytes, s)), || {
                stream.copy_d2d(&a, &mut b)
            })?,
        );
        push(
            "H2D pageable (blocking)",
            per_call_us(
                stream,
                reps,
                raw!("HtoD sync", sys::cuMemcpyHtoD_v2(pa, src.as_ptr().cast(), bytes)),
                || cumem_copy::copy_h2d(&src, &mut a),
            )?,
        );
        push(
            "D2H pageable (blocking)",
            per_call_us(
                stream,
                reps,
                raw!("DtoH sync", sys::cuMemcpyDtoH_v2(dst.cast(), pa, bytes)),
                || {
                    // SAFETY: `dst` is `pageable`'s buffer, which no other reference uses meanwhile.
                    let out = unsafe { std::slice::from_raw_parts_mut(dst, bytes) };
                    cumem_copy::copy_d2h(&a, out)
                },
            )?,
        );
    }
    Ok(())
}

/// Switch here once every device has a current resource: the row then measures
/// `DeviceBuffer::zeroed(&stream, 4096)` through it.
fn default_path_buffer(stream: &Stream, _caching: &Arc<dyn DeviceResource>) -> Result<DeviceBuffer<u8>> {
    DeviceBuffer::<u8>::zeroed(stream, 4096)
}

fn allocation(ctx: &Context, stream: &Stream, rows: &mut Vec<Row>) -> Result<()> {
    const N: u32 = 2_000;
    let layout = cumem_core::AllocLayout::new(4096, 1)?;
    let caching: Arc<dyn DeviceResource> = Arc::new(CachingResource::with_driver(ctx, PoolConfig::default()));
    let (raw, cumem) = per_call_us(
        stream,
        N,
        || {
            let p = caching.allocate(layout, stream)?;
            // SAFETY: `p` is a fresh 4096-byte allocation usable on `stream`, freed right after.
            ok(unsafe { sys::cuMemsetD8Async(p.ptr, 0, 4096, stream.raw()) }, "cuMemsetD8Async");
            // SAFETY: `p` came from `caching` with this layout; its only use is queued on `stream`.
            unsafe { caching.deallocate(p, layout, stream) };
            Ok(())
        },
        || default_path_buffer(stream, &caching).map(drop),
    )?;
    rows.push(Row {
        what: "zeroed(4096) + drop, default path (raw: caching alloc + cuMemsetD8Async + free)".into(),
        unit: "µs/pair",
        raw,
        cumem,
        higher_better: false,
    });

    let native = NativePoolResource::default_pool(ctx)?;
    let pool = native.pool().raw();
    let (raw, cumem) = per_call_us(
        stream,
        N,
        || {
            let mut p = 0;
            // SAFETY: `p` is a valid out-pointer; the allocation is freed on the same stream at once.
            ok(unsafe { sys::cuMemAllocFromPoolAsync(&mut p, 4096, pool, stream.raw()) }, "AllocFromPool");
            // SAFETY: `p` was just allocated from the pool on this stream and nothing uses it.
            ok(unsafe { sys::cuMemFreeAsync(p, stream.raw()) }, "cuMemFreeAsync");
            Ok(())
        },
        || {
            let p = native.allocate(layout, stream)?;
            // SAFETY: `p` came from `native` with this layout; nothing uses it.
            unsafe { native.deallocate(p, layout, stream) };
            Ok(())
        },
    )?;
    rows.push(Row {
        what: "NativePoolResource alloc+free 4096 B (raw: cuMemAllocFromPoolAsync + cuMemFreeAsync)".into(),
        unit: "µs/pair",
        raw,
        cumem,
        higher_better: false,
    });
    Ok(())
}

fn main() -> Result<()> {
    let kind = cumem_sys::driver::init()?;
    let ctx = cumem_core::Device::get(0)?.context()?;
    let stream = Stream::non_blocking(&ctx)?;
    let quick = std::env::args().any(|a| a == "--quick");
    let simulated = matches!(kind, cumem_sys::driver::DriverKind::Simulator);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("# cumem transfer benchmark\n");
    println!(
        "driver: {kind} ({}); device 0: {}; {} cores; load average at start: {}; best of {} runs of each, taken in turns{}\n",
        cumem_sys::driver::description().unwrap_or_default(),
        ctx.device().name()?,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        runs(),
        if simulated { "; GB/s are simulated (host memcpy): only the ratios count" } else { "" },
    );
    let mut rows = Vec::new();
    if std::env::args().any(|a| a == "--channels") {
        channel_table(&ctx, quick);
        return Ok(());
    }
    small_calls(&ctx, &stream, &mut rows)?;
    if std::env::args().any(|a| a == "--small") {
        print_table(&rows);
        return profiling(&ctx, &stream, true);
    }
    allocation(&ctx, &stream, &mut rows)?;
    let sizes: &[usize] =
        if quick { &[4 << 10, 1 << 20] } else { &[4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20] };
    bandwidth(&ctx, &stream, &mut rows, sizes)?;
    print_table(&rows);
    profiling(&ctx, &stream, quick)?;
    staging(&ctx, &stream, if quick { &[1 << 20, 16 << 20] } else { &[1 << 20, 16 << 20, 256 << 20] })?;
    channel_table(&ctx, quick);
    Ok(())
}

/// A copy the profiling table repeats.
type Call<'a> = dyn FnMut() -> Result<()> + 'a;

/// The profiling hooks, compiled in (always) and off vs on, for the 4-byte queued copy and the
/// 1 MiB copy; then the off path's own cost (one relaxed atomic load) against the 4-byte copy.
fn profiling(ctx: &Context, stream: &Stream, quick: bool) -> Result<()> {
    let small = PinnedBuffer::<u8>::from_slice(ctx, &[7u8; 4])?;
    let big = PinnedBuffer::<u8>::zeroed(ctx, 1 << 20)?;
    let mut d_small = DeviceBuffer::<u8>::zeroed(stream, 4)?;
    let mut d_big = DeviceBuffer::<u8>::zeroed(stream, 1 << 20)?;
    let profiler = cumem_copy::Profiler::new();
    let mut rows = Vec::new();
    let elsewhere = Stream::non_blocking(ctx)?;
    let cases: [(&str, u32, &mut Call<'_>); 2] = [
        ("4 B copy_h2d queued, pinned", 2_000, &mut || stream.copy_h2d(&small, &mut d_small)),
        ("1 MiB copy_h2d queued, pinned", if quick { 16 } else { 64 }, &mut || {
            stream.copy_h2d(&big, &mut d_big)
        }),
    ];
    for (what, n, call) in cases {
        // Both closures call the same copy, never at once.
        let call = std::cell::RefCell::new(call);
        let (off, on) = medians(
            || batch(stream, n, &mut **call.borrow_mut()),
            || {
                // The guard attaches the profiler for the batch; the report (which reads every
                // copy's events) is part of what profiling costs.
                let _on = profiler.observe(stream);
                let t = batch(stream, n, &mut **call.borrow_mut())?;
                let r = Instant::now();
                profiler.report()?;
                Ok(t + r.elapsed())
            },
        )?;
        let us = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(n);
        rows.push((what, us(off), us(on)));
        if n == 2_000 {
            // "On" here attaches the profiler to another stream: this copy is checked, not observed.
            let (off, on) = medians(
                || batch(stream, n, &mut **call.borrow_mut()),
                || {
                    let _on = profiler.observe(&elsewhere);
                    batch(stream, n, &mut **call.borrow_mut())
                },
            )?;
            rows.push(("4 B copy_h2d queued, another stream observed", us(off), us(on)));
        }
    }
    const CHECKS: u32 = 10_000_000;
    let t = Instant::now();
    for _ in 0..CHECKS {
        std::hint::black_box(cumem_copy::profile::active());
    }
    let check_ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(CHECKS);
    // Every copy also runs inside a `trace` span (no subscriber here, as in the rows above).
    let t = Instant::now();
    for i in 0..CHECKS {
        let _span = tracing::trace_span!(
            "copy",
            device = 0,
            stream = 1,
            bytes = std::hint::black_box(i),
            kind = "h2d"
        )
        .entered();
    }
    let trace_ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(CHECKS);
    // With a profiler attached to another stream, each copy checks whether its own is observed.
    let observing = profiler.observe(&elsewhere);
    let t = Instant::now();
    for _ in 0..CHECKS {
        std::hint::black_box(cumem_copy::profile::observes(std::hint::black_box(stream)));
    }
    let watched_ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(CHECKS);
    drop(observing);
    println!("\n## profiling hooks, off vs on (µs/call, best of {} batches)\n", runs());
    println!("| what | off | on | on / off |");
    println!("|---|---:|---:|---:|");
    for (what, off, on) in &rows {
        println!("| {what} | {off:.3} | {on:.3} | {:.3}× |", on / off);
    }
    println!(
        "\nOff, a copy pays one relaxed atomic load for profiling: {check_ns:.2} ns, {:.3} % of the 4 B \
         queued copy off ({:.3} µs); the bar is 1 %.",
        check_ns / (rows[0].1 * 1e3) * 100.0,
        rows[0].1
    );
    println!(
        "A disabled `trace` span entered and left (copy tracing, same fields) costs {trace_ns:.2} ns more: {:.3} %.",
        trace_ns / (rows[0].1 * 1e3) * 100.0
    );
    println!(
        "With a profiler attached to another stream, a copy's check (`profile::observes`: no lock, no \
         allocation) costs {watched_ns:.2} ns: {:.3} %.",
        watched_ns / (rows[0].1 * 1e3) * 100.0
    );
    Ok(())
}

/// Large copies of pageable memory: blocking (`copy_h2d`/`copy_d2h`, the driver stages them),
/// staged through a [`cumem_copy::StagingRing`] (default shape), and from/to pinned memory.
fn staging(ctx: &Context, stream: &Stream, sizes: &[usize]) -> Result<()> {
    let mut ring = cumem_copy::StagingRing::new(ctx)?;
    let mut split = cumem_copy::StagingRing::new(ctx)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4);
    split.set_fill_threads(threads);
    println!("\n## pageable vs staged vs pinned (GB/s, best of {})\n", runs());
    println!(
        "| copy | pageable (blocking) | staged (StagingRing) | staged, {threads} fill threads | pinned | best staged / pinned |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for &bytes in sizes {
        let label = format!("{} MiB", bytes >> 20);
        let mut host = vec![5u8; bytes];
        let mut pinned = PinnedBuffer::<u8>::zeroed(ctx, bytes)?;
        let mut dev = DeviceBuffer::<u8>::zeroed(stream, bytes)?;
        stream.synchronize()?;
        let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        let best = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            f()?;
            let mut v = (0..runs()).map(|_| timed(&mut *f)).collect::<Result<Vec<_>>>()?;
            v.sort();
            Ok(gbps(v[0]))
        };
        let h2d = [
            best(&mut || cumem_copy::copy_h2d(&host, &mut dev))?,
            best(&mut || {
                ring.copy_h2d(stream, &host, &mut dev)?;
                stream.synchronize()
            })?,
            best(&mut || {
                split.copy_h2d(stream, &host, &mut dev)?;
                stream.synchronize()
            })?,
            best(&mut || {
                stream.copy_h2d(&pinned, &mut dev)?;
                stream.synchronize()
            })?,
        ];
        let d2h = [
            best(&mut || cumem_copy::copy_d2h(&dev, &mut host))?,
            best(&mut || ring.copy_d2h(stream, &dev, &mut host))?,
            best(&mut || split.copy_d2h(stream, &dev, &mut host))?,
            best(&mut || {
                stream.copy_d2h(&dev, &mut pinned)?;
                pinned.wait_idle()
            })?,
        ];
        for (what, [pageable, staged, split, pin]) in [("H2D", h2d), ("D2H", d2h)] {
            println!(
                "| {what} {label} | {pageable:.2} | {staged:.2} | {split:.2} | {pin:.2} | {:.2} |",
                staged.max(split) / pin
            );
        }
    }
    Ok(())
}

/// The message-channel table (`cumem-channel`), after the transfer table; a failure fails the run.
fn channel_table(ctx: &Context, quick: bool) {
    match cumem_benches::channel::channel_rows(ctx, if quick { 20 } else { 200 }) {
        Ok(rows) => cumem_benches::channel::print_channel_table(&rows),
        Err(e) => {
            eprintln!("channel table: {e}");
            std::process::exit(1);
        }
    }
}

fn print_table(rows: &[Row]) {
    println!("| what | unit | raw driver | cumem | cumem / raw (time) |");
    println!("|---|---|---:|---:|---:|");
    for r in rows {
        println!("| {} | {} | {:.3} | {:.3} | {:.3}× |", r.what, r.unit, r.raw, r.cumem, r.ratio());
    }
}
