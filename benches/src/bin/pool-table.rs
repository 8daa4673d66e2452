//! `cargo xtask bench pool`: every allocator measured side by side in one run, as a markdown table
//! of ns per alloc+free pair, with the ratios between them.
//!
//! Runs on the real driver when one is present, else on the simulator (said in the header).

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use cumem_benches::{
    Allocator, FEW_LIVE, OnStream, churn_loop, host_fast_path, host_free, host_many_live, host_pool,
    host_varying_sizes, in_parallel, interleaved_loop, random_size_loop, raw_pool_fast_path,
    resource_fast_path, resource_many_live, resource_varying_sizes, training_loop,
};
use cumem_core::{Context, Device, DriverResource, Stream};
use cumem_pool::{
    CachingPool, CachingResource, HostOrdering, HostUpstream, MemPool, MemPoolOptions, NativePoolResource,
    PoolConfig, PoolStats,
};

/// Median over `runs` timed runs of `iters` pairs, after a warm-up run; ns per pair.
fn ns_per_op(runs: usize, iters: u64, mut f: impl FnMut(u64)) -> f64 {
    f(iters / 10 + 1);
    let mut v: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f(iters);
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[runs / 2]
}

/// Two workloads measured in alternating runs (so a load change hits both alike); medians of
/// `runs` runs each, ns per pair.
fn side_by_side(runs: usize, iters: u64, a: impl FnMut(u64), b: impl FnMut(u64)) -> (f64, f64) {
    let (a, b, _) = side_by_side_settled(runs, iters, a, b, || {});
    (a, b)
}

/// [`side_by_side`], calling `settle` (untimed) after every run: so queued work one run left
/// behind (a stream worker still draining frees) is not paid by the other. Also returns the
/// median of the ratios b/a of adjacent runs, which a load that drifts during the runs skews less.
fn side_by_side_settled(
    runs: usize,
    iters: u64,
    mut a: impl FnMut(u64),
    mut b: impl FnMut(u64),
    settle: impl Fn(),
) -> (f64, f64, f64) {
    a(iters / 10 + 1);
    b(iters / 10 + 1);
    settle();
    let time = |f: &mut dyn FnMut(u64)| {
        let t = Instant::now();
        f(iters);
        let ns = t.elapsed().as_nanos() as f64 / iters as f64;
        settle();
        ns
    };
    let (mut va, mut vb) = (vec![], vec![]);
    for _ in 0..runs {
        va.push(time(&mut a));
        vb.push(time(&mut b));
    }
    let mut ratios: Vec<f64> = va.iter().zip(&vb).map(|(a, b)| b / a).collect();
    ratios.sort_by(f64::total_cmp);
    va.sort_by(f64::total_cmp);
    vb.sort_by(f64::total_cmp);
    (va[runs / 2], vb[runs / 2], ratios[runs / 2])
}

/// Aggregate ns per pair with `threads` threads each doing `iters` pairs at once (median of runs).
fn parallel_ns_per_op(runs: usize, threads: usize, iters: u64, work: impl Fn(usize, u64) + Sync) -> f64 {
    work(0, iters / 10 + 1);
    let mut v: Vec<f64> = (0..runs)
        .map(|_| in_parallel(threads, |t| work(t, iters)).as_nanos() as f64 / (threads as u64 * iters) as f64)
        .collect();
    v.sort_by(f64::total_cmp);
    v[runs / 2]
}

/// The footprint workloads ([`run_footprint`] runs them by index): name, and whether the bar of
/// issue 10 names it.
const FOOTPRINT: [(&str, bool); 4] = [
    ("training-like loop (200 steps)", true),
    ("random-size loop (300 steps)", true),
    ("interleaved random sizes (100 steps)", false),
    ("steady churn (20,000 operations)", false),
];

/// Runs footprint workload `w` through `a`; returns the largest sum of requested bytes held.
fn run_footprint<A: Allocator>(w: usize, a: &A) -> u64 {
    match w {
        0 => training_loop(a, 200, 7),
        1 => random_size_loop(a, 300, 7),
        2 => interleaved_loop(a, 100, 7),
        _ => churn_loop(a, 20_000, 7),
    }
}

/// One footprint row: peak live (rounded) and reserved bytes, peak requested bytes, ns per pair.
struct Footprint {
    live: u64,
    reserved: u64,
    requested: u64,
    ns: f64,
}

impl Footprint {
    fn of(stats: &PoolStats, requested: u64, t: Instant) -> Footprint {
        let ns = t.elapsed().as_nanos() as f64 / stats.allocations_total.max(1) as f64;
        Footprint { live: stats.peak_bytes, reserved: stats.peak_reserved_bytes, requested, ns }
    }
}

/// Frees between two trims in the footprint rows that trim.
const TRIM_EVERY: u64 = 64;

/// An allocator whose pool is trimmed after every [`TRIM_EVERY`]-th free (a program that hands
/// memory back now and then, as with PyTorch's `empty_cache`); `trim` returns reserved and live
/// bytes afterwards, and the mean of reserved ÷ live right after each trim is kept.
struct Trimming<'a, A> {
    inner: &'a A,
    trim: &'a dyn Fn() -> (u64, u64),
    frees: Cell<u64>,
    after: Cell<(f64, u64)>,
}

impl<A: Allocator> Allocator for Trimming<'_, A> {
    type Handle = A::Handle;
    fn alloc(&self, bytes: usize) -> A::Handle {
        self.inner.alloc(bytes)
    }
    fn free(&self, handle: A::Handle) {
        self.inner.free(handle);
        self.frees.set(self.frees.get() + 1);
        if self.frees.get().is_multiple_of(TRIM_EVERY) {
            let (reserved, live) = (self.trim)();
            if live > 0 {
                let (sum, n) = self.after.get();
                self.after.set((sum + reserved as f64 / live as f64, n + 1));
            }
        }
    }
}

impl<'a, A> Trimming<'a, A> {
    fn new(inner: &'a A, trim: &'a dyn Fn() -> (u64, u64)) -> Self {
        Trimming { inner, trim, frees: Cell::new(0), after: Cell::new((0.0, 0)) }
    }

    /// Mean reserved ÷ live right after a trim, formatted.
    fn after(&self) -> String {
        let (sum, n) = self.after.get();
        if n == 0 { "–".into() } else { format!("{:.3}", sum / n as f64) }
    }
}

/// Peak reserved ÷ peak live of each footprint workload, with and without expandable segments, on
/// the host model and through `CachingResource` on `ctx`'s device.
fn footprint_table(ctx: &Context) -> cumem_core::Result<()> {
    let stream = Stream::non_blocking(ctx)?;
    let vmm = ctx.device().capabilities()?.virtual_memory;
    println!(
        "Footprint (issue 10, item 3): peak reserved ÷ peak live, one run each; live = rounded bytes of live"
    );
    println!(
        "blocks (the pool's `peak_bytes`), requested = what the workload asked for; ns per alloc+free pair."
    );
    println!(
        "Rows \"trim every {TRIM_EVERY}\" trim the pool after every {TRIM_EVERY}th free (ns include the trims); their last"
    );
    println!("column is the mean reserved ÷ live right after each trim.");
    println!();
    println!(
        "| workload | pool | peak live MiB | peak reserved MiB | reserved ÷ live | reserved ÷ requested | ns/pair | after trims |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    for (w, (name, bar)) in FOOTPRINT.iter().enumerate() {
        let name = if *bar { name.to_string() } else { format!("{name} (beyond the bar)") };
        for (expandable_segments, trims) in [(false, false), (true, false), (false, true), (true, true)] {
            let config = PoolConfig { expandable_segments, ..PoolConfig::default() };
            let mode = match (expandable_segments, trims) {
                (false, false) => "segments".to_string(),
                (true, false) => "expandable segments".to_string(),
                (false, true) => format!("segments, trim every {TRIM_EVERY}"),
                (true, true) => format!("expandable segments, trim every {TRIM_EVERY}"),
            };
            let host = CachingPool::new(HostUpstream::new(1 << 40), HostOrdering::new(), config.clone());
            let host_trim = || {
                host.trim().expect("host trim");
                let s = host.stats();
                (s.reserved_bytes, s.current_bytes)
            };
            let t = Instant::now();
            let (requested, after) = if trims {
                let a = Trimming::new(&host, &host_trim);
                (run_footprint(w, &a), a.after())
            } else {
                (run_footprint(w, &host), "–".into())
            };
            let mut rows = vec![("host model", Footprint::of(&host.stats(), requested, t), after)];
            if vmm || !expandable_segments {
                let dev = CachingResource::with_driver(ctx, config);
                let dev_trim = || {
                    dev.trim().expect("device trim");
                    let s = dev.stats();
                    (s.reserved_bytes, s.current_bytes)
                };
                let t = Instant::now();
                let on = OnStream(&dev, &stream);
                let (requested, after) = if trims {
                    let a = Trimming::new(&on, &dev_trim);
                    (run_footprint(w, &a), a.after())
                } else {
                    (run_footprint(w, &on), "–".into())
                };
                rows.push(("as DeviceResource", Footprint::of(&dev.stats(), requested, t), after));
                dev.trim()?;
            }
            for (what, f, after) in rows {
                println!(
                    "| {name} | {what}, {mode} | {:.1} | {:.1} | {:.3} | {:.3} | {:.0} | {after} |",
                    mib(f.live),
                    mib(f.reserved),
                    f.reserved as f64 / f.live as f64,
                    f.reserved as f64 / f.requested as f64,
                    f.ns
                );
            }
        }
    }
    println!();
    Ok(())
}

fn main() -> cumem_core::Result<()> {
    let kind = cumem_sys::driver::init()?;
    let ctx = Device::get(0)?.context()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# cumem pool benchmark");
    println!();
    println!(
        "driver: {} ({}); device 0: {}; {cores} cores; ns per alloc+free pair, median of 5 runs (9 alternating runs where two rows are compared side by side, 31 for the driver pool)",
        kind,
        cumem_sys::driver::description().unwrap_or_default(),
        ctx.device().name()?
    );
    println!();
    let mut rows: Vec<(&str, String, f64)> = Vec::new();

    // (a) fast path, 1 thread, warmed.
    let host = host_pool();
    let stream = Stream::non_blocking(&ctx)?;
    let caching = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let (a_host, a_dev) = side_by_side(
        9,
        1_000_000,
        |n| host_fast_path(&host, n, 256),
        |n| resource_fast_path(caching.as_ref(), &stream, n, 256),
    );
    rows.push(("a", "caching pool, host model: same 256 B block, 1 thread".into(), a_host));
    rows.push(("a", "caching pool as DeviceResource on the driver: same 256 B block".into(), a_dev));
    // A reference cost: an allocation and a free that went to their stream's arena would each lock
    // and unlock its mutex once. (a) takes no lock: with the per-thread caches (the default), the
    // same stream's pair is served from the calling thread's cache.
    let arena_lock = parking_lot::Mutex::new(0u64);
    let h = ns_per_op(5, 1_000_000, |n| {
        for _ in 0..n {
            *std::hint::black_box(&arena_lock).lock() += 1;
            *std::hint::black_box(&arena_lock).lock() += 1;
        }
    });
    rows.push((
        "h",
        "two uncontended parking_lot::Mutex lock+unlock (an arena pair's locks; (a) takes none)".into(),
        h,
    ));

    // (b) 10,000 live blocks of random sizes.
    let host = host_pool();
    let (b_host, b_dev) = side_by_side(
        9,
        300_000,
        |n| host_many_live(&host, 10_000, n, 7),
        |n| resource_many_live(caching.as_ref(), &stream, 10_000, n, 7),
    );
    rows.push(("b", "caching pool, host model: 10,000 live random-size blocks".into(), b_host));
    rows.push(("b", "caching pool as DeviceResource: 10,000 live random-size blocks".into(), b_dev));

    // (c) threads, each on its own stream, one shared pool.
    let host = host_pool();
    let host_1 = parallel_ns_per_op(5, 1, 1_000_000, |t, n| {
        for _ in 0..n {
            let b = host.allocate(256, 256, t as u32).expect("host pool");
            host_free(&host, b, t as u32);
        }
    });
    let mut c_rows = vec![];
    for threads in [2usize, 8] {
        let ns = parallel_ns_per_op(5, threads, 1_000_000, |t, n| {
            for _ in 0..n {
                let b = host.allocate(256, 256, t as u32).expect("host pool");
                host_free(&host, b, t as u32);
            }
        });
        c_rows.push((threads, ns, host_1 / ns));
    }
    let streams: Vec<Stream> = (0..8).map(|_| Stream::non_blocking(&ctx)).collect::<Result<_, _>>()?;
    let dev_1 =
        parallel_ns_per_op(5, 1, 500_000, |t, n| resource_fast_path(caching.as_ref(), &streams[t], n, 256));
    let mut c_dev_rows = vec![];
    for threads in [2usize, 8] {
        let ns = parallel_ns_per_op(5, threads, 500_000, |t, n| {
            resource_fast_path(caching.as_ref(), &streams[t], n, 256)
        });
        c_dev_rows.push((threads, ns, dev_1 / ns));
    }
    rows.push(("c", "caching pool, host model: 1 thread (throughput baseline)".into(), host_1));
    for (threads, ns, speedup) in &c_rows {
        rows.push((
            "c",
            format!(
                "caching pool, host model: {threads} threads, own streams ({speedup:.2}x throughput of 1)"
            ),
            *ns,
        ));
    }
    rows.push(("c", "caching pool as DeviceResource: 1 thread (throughput baseline)".into(), dev_1));
    for (threads, ns, speedup) in &c_dev_rows {
        rows.push(("c", format!("caching pool as DeviceResource: {threads} threads, own streams ({speedup:.2}x throughput of 1)"), *ns));
    }

    // (d) the driver's pool, (e) cuMemAlloc/cuMemFree.
    let native = NativePoolResource::new(MemPool::create(
        &ctx,
        MemPoolOptions { max_size: None, release_threshold: u64::MAX },
    )?);
    ctx.bind()?;
    // Many short alternating runs: the simulator's stream worker shares 2 cores with this thread,
    // so scheduling noise is large and must hit both rows alike.
    let (d_raw, d, d_ratio) = side_by_side_settled(
        31,
        5_000,
        |n| raw_pool_fast_path(native.pool(), &stream, n, 256),
        |n| resource_fast_path(&native, &stream, n, 256),
        || stream.synchronize().expect("stream synchronize"),
    );
    rows.push(("d", "raw cuMemAllocFromPoolAsync + cuMemFreeAsync: same 256 B".into(), d_raw));
    rows.push(("d", "driver pool as DeviceResource (NativePoolResource): same 256 B".into(), d));
    // What binding costs when the context is already current: a check, or a set.
    let (get_ns, set_ns) = side_by_side(
        9,
        200_000,
        |n| {
            for _ in 0..n {
                let mut c = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                unsafe { cumem_core::sys::cuCtxGetCurrent(&mut c) };
                std::hint::black_box(c);
            }
        },
        |n| {
            for _ in 0..n {
                // SAFETY: a live context handle.
                unsafe { cumem_core::sys::cuCtxSetCurrent(std::hint::black_box(ctx.raw())) };
            }
        },
    );
    rows.push(("g", "cuCtxGetCurrent (per call)".into(), get_ns));
    rows.push(("g", "cuCtxSetCurrent to the current context (per call)".into(), set_ns));
    let driver = DriverResource::new(&ctx);
    let e = ns_per_op(5, 20_000, |n| resource_fast_path(&driver, &stream, n, 256));
    rows.push(("e", "cuMemAlloc/cuMemFree: same 256 B".into(), e));

    // (f) one stream, a different size every time, few live blocks.
    let host = host_pool();
    rows.push((
        "f",
        format!("caching pool, host model: varying sizes 256 B..64 KiB, {FEW_LIVE} live blocks"),
        ns_per_op(5, 2_000_000, |n| host_varying_sizes(&host, n, 11)),
    ));
    // A fresh pool: the one above still caches (b)'s 10,000 blocks in bins of every size class,
    // which would measure bin hits rather than a pool with few blocks.
    let caching_f = CachingResource::with_driver(&ctx, PoolConfig::default());
    let f_dev = ns_per_op(5, 1_000_000, |n| resource_varying_sizes(&caching_f, &stream, n, 11));
    rows.push((
        "f",
        format!("caching pool as DeviceResource: varying sizes 256 B..64 KiB, {FEW_LIVE} live blocks"),
        f_dev,
    ));
    stream.synchronize()?;

    println!("| | workload | ns/op |");
    println!("|---|---|---:|");
    for (tag, what, ns) in &rows {
        println!("| ({tag}) | {what} | {ns:.1} |");
    }
    println!();
    println!("Ratios (same run):");
    println!();
    println!("| comparison | ratio |");
    println!("|---|---:|");
    println!("| (e) cuMemAlloc/cuMemFree ÷ (a) caching pool as DeviceResource | {:.0}x |", e / a_dev);
    println!("| (d) driver pool ÷ (a) caching pool as DeviceResource | {:.0}x |", d / a_dev);
    println!(
        "| (d) NativePoolResource ÷ raw cuMemAllocFromPoolAsync + cuMemFreeAsync (medians) | {:.3}x |",
        d / d_raw
    );
    println!("| (d) the same, median of the ratios of adjacent runs | {d_ratio:.3}x |");
    println!(
        "| (a) caching pool as DeviceResource ÷ host model (bookkeeping alone) | {:.2}x |",
        a_dev / a_host
    );
    println!(
        "| (a) caching pool as DeviceResource ÷ (h) two arena locks (a thread-cache hit takes none) | {:.2}x |",
        a_dev / h
    );
    println!("| (e) cuMemAlloc/cuMemFree ÷ (d) driver pool | {:.1}x |", e / d);
    println!("| (b) ÷ (a), DeviceResource: cost of 10,000 live blocks | {:.2}x |", b_dev / a_dev);
    println!("| (f) ÷ (a), DeviceResource: cost of a different size every time | {:.2}x |", f_dev / a_dev);
    for (threads, _, speedup) in &c_rows {
        println!("| (c) host model: throughput at {threads} threads ÷ 1 thread | {speedup:.2}x |");
    }
    for (threads, _, speedup) in &c_dev_rows {
        println!("| (c) DeviceResource: throughput at {threads} threads ÷ 1 thread | {speedup:.2}x |");
    }
    drop(native);
    caching.trim()?;
    caching_f.trim()?;
    println!();
    footprint_table(&ctx)?;
    Ok(())
}
