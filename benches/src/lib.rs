//! Shared workloads for cumem's benchmarks, so the criterion benches and the side-by-side table of
//! `cargo xtask bench pool` measure exactly the same thing.
//!
//! Every workload returns after `iters` alloc+free pairs; time per pair is what is reported.

pub mod channel;

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cumem_core::{AllocLayout, DeviceResource, Stream};
use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};

/// The caching pool on its host model (pure bookkeeping, no driver).
pub type HostPool = CachingPool<HostUpstream, HostOrdering>;

/// A fresh host-model caching pool with room for everything the benches do.
pub fn host_pool() -> HostPool {
    CachingPool::new(HostUpstream::new(1 << 40), HostOrdering::new(), PoolConfig::default())
}

/// Gives a block of the host model back on `stream`.
#[inline(always)]
pub fn host_free(pool: &HostPool, block: cumem_pool::Block, stream: u32) {
    // SAFETY: the host model's addresses have no memory behind them: no work uses a block, now or
    // later, so nothing needs ordering after `stream`, whichever stream is named.
    unsafe { pool.deallocate(block, stream) }.expect("own block");
}

/// A xorshift generator: cheap, deterministic sizes.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A log-uniform size in [256 B, 1 MiB).
    #[inline]
    pub fn size(&mut self) -> usize {
        let r = self.next_u64();
        let exp = 8 + (r % 12) as u32;
        (1usize << exp) + ((r >> 8) as usize & ((1 << exp) - 1))
    }
}

/// (a) on the host model: the same size allocated and freed on one stream, warmed.
pub fn host_fast_path(pool: &HostPool, iters: u64, size: usize) {
    for _ in 0..iters {
        let b = pool.allocate(black_box(size), 256, 0).expect("host pool");
        host_free(pool, black_box(b), 0);
    }
}

/// (b) on the host model: with `live` blocks of random sizes held, free a random one and allocate a
/// random size, `iters` times.
pub fn host_many_live(pool: &HostPool, live: usize, iters: u64, seed: u64) {
    let mut rng = Rng(seed);
    let mut held: Vec<_> = (0..live).map(|_| pool.allocate(rng.size(), 256, 0).expect("host pool")).collect();
    let start_len = held.len();
    for _ in 0..iters {
        let i = rng.next_u64() as usize % start_len;
        let b = std::mem::replace(&mut held[i], pool.allocate(rng.size(), 256, 0).expect("host pool"));
        host_free(pool, b, 0);
    }
    for b in held {
        host_free(pool, b, 0);
    }
}

/// Blocks the varying-size workloads hold at once: few, like one step's temporaries.
pub const FEW_LIVE: usize = 4;

/// A size for the varying-size workloads: uniform in [256 B, 64 KiB + 256 B), so consecutive
/// requests almost never share a 512 B size class.
#[inline]
fn varying_size(rng: &mut Rng) -> usize {
    256 + (rng.next_u64() % (64 << 10)) as usize
}

/// (f) on the host model: one stream, a different size every time, few live blocks. Each pair
/// allocates a new size and frees the block allocated [`FEW_LIVE`] pairs earlier.
pub fn host_varying_sizes(pool: &HostPool, iters: u64, seed: u64) {
    let mut rng = Rng(seed);
    let mut ring: Vec<Option<cumem_pool::Block>> = (0..FEW_LIVE).map(|_| None).collect();
    for i in 0..iters {
        let b = pool.allocate(black_box(varying_size(&mut rng)), 256, 0).expect("host pool");
        if let Some(old) = ring[i as usize % FEW_LIVE].replace(b) {
            host_free(pool, black_box(old), 0);
        }
    }
    for b in ring.into_iter().flatten() {
        host_free(pool, b, 0);
    }
}

/// (f) on a device resource: like [`host_varying_sizes`], through the `DeviceResource` interface.
pub fn resource_varying_sizes(resource: &dyn DeviceResource, stream: &Stream, iters: u64, seed: u64) {
    let mut rng = Rng(seed);
    let mut ring: Vec<Option<(_, AllocLayout)>> = (0..FEW_LIVE).map(|_| None).collect();
    for i in 0..iters {
        let layout = AllocLayout::new(varying_size(&mut rng), 256).expect("non-zero size");
        let p = resource.allocate(layout, stream).expect("allocation");
        if let Some((old, layout)) = ring[i as usize % FEW_LIVE].replace((p, layout)) {
            // SAFETY: allocated above with this layout on this stream; never used.
            unsafe { resource.deallocate(black_box(old), layout, stream) };
        }
    }
    for (p, layout) in ring.into_iter().flatten() {
        // SAFETY: as above.
        unsafe { resource.deallocate(p, layout, stream) };
    }
}

/// A device resource's allocate+deallocate of one size on one stream, warmed.
pub fn resource_fast_path(resource: &dyn DeviceResource, stream: &Stream, iters: u64, size: usize) {
    let layout = AllocLayout::new(size, 256).expect("non-zero size");
    for _ in 0..iters {
        let p = resource.allocate(layout, stream).expect("allocation");
        // SAFETY: allocated just above with this layout on this stream; never used.
        unsafe { resource.deallocate(black_box(p), layout, stream) };
    }
}

/// A device resource with `live` allocations of random sizes held: free a random one and allocate
/// a random size, `iters` times.
pub fn resource_many_live(
    resource: &dyn DeviceResource,
    stream: &Stream,
    live: usize,
    iters: u64,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let alloc = |rng: &mut Rng| {
        let layout = AllocLayout::new(rng.size(), 256).expect("non-zero size");
        (resource.allocate(layout, stream).expect("allocation"), layout)
    };
    let mut held: Vec<_> = (0..live).map(|_| alloc(&mut rng)).collect();
    for _ in 0..iters {
        let i = rng.next_u64() as usize % held.len();
        let (p, layout) = std::mem::replace(&mut held[i], alloc(&mut rng));
        // SAFETY: allocated by `alloc` with this layout on this stream; never used.
        unsafe { resource.deallocate(p, layout, stream) };
    }
    for (p, layout) in held {
        // SAFETY: as above.
        unsafe { resource.deallocate(p, layout, stream) };
    }
}

/// The driver entry points [`NativePoolResource`](cumem_pool::NativePoolResource) calls, made
/// directly through cudarc's bindings (the raw baseline): `cuMemAllocFromPoolAsync` +
/// `cuMemFreeAsync` of one size on one stream, `iters` times, with the pool's context already
/// current (the caller binds it).
pub fn raw_pool_fast_path(pool: &cumem_pool::MemPool, stream: &Stream, iters: u64, size: usize) {
    use cumem_core::sys;
    let (raw_pool, raw_stream) = (pool.raw(), stream.raw());
    for _ in 0..iters {
        let mut ptr = 0;
        // SAFETY: valid out-pointer, live pool and stream handles of the current context.
        let code = unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, black_box(size), raw_pool, raw_stream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemAllocFromPoolAsync");
        // SAFETY: allocated just above on this stream, never used, freed once.
        let code = unsafe { sys::cuMemFreeAsync(black_box(ptr), raw_stream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemFreeAsync");
    }
}

/// Runs `work(thread)` on `threads` threads at once (after a barrier) and returns the wall time.
pub fn in_parallel(threads: usize, work: impl Fn(usize) + Sync) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (barrier, work) = (barrier.clone(), &work);
            scope.spawn(move || {
                barrier.wait();
                work(t);
            });
        }
        barrier.wait();
        let start = Instant::now();
        // The scope joins every thread before returning.
        start
    })
    .elapsed()
}

/// What the footprint workloads allocate through: the host-model pool or a device resource.
pub trait Allocator {
    /// A live allocation.
    type Handle;
    /// Allocates `bytes` bytes.
    fn alloc(&self, bytes: usize) -> Self::Handle;
    /// Frees an allocation.
    fn free(&self, handle: Self::Handle);
}

impl Allocator for HostPool {
    type Handle = cumem_pool::Block;
    fn alloc(&self, bytes: usize) -> cumem_pool::Block {
        self.allocate(bytes, 256, 0).expect("host pool")
    }
    fn free(&self, block: cumem_pool::Block) {
        host_free(self, block, 0);
    }
}

/// A device resource used on one stream.
#[derive(Clone, Copy)]
pub struct OnStream<'a>(pub &'a dyn DeviceResource, pub &'a Stream);

impl Allocator for OnStream<'_> {
    type Handle = (cumem_core::Allocation, AllocLayout);
    fn alloc(&self, bytes: usize) -> Self::Handle {
        let layout = AllocLayout::new(bytes, 256).expect("non-zero size");
        (self.0.allocate(layout, self.1).expect("allocation"), layout)
    }
    fn free(&self, (p, layout): Self::Handle) {
        // SAFETY: allocated by `alloc` with this layout on this stream; never used.
        unsafe { self.0.deallocate(p, layout, self.1) };
    }
}

/// The largest sum of requested bytes held at once, kept by a footprint workload.
#[derive(Debug, Default)]
struct Held {
    now: u64,
    peak: u64,
}

impl Held {
    fn add(&mut self, bytes: usize) {
        self.now += bytes as u64;
        self.peak = self.peak.max(self.now);
    }
    fn sub(&mut self, bytes: usize) {
        self.now -= bytes as u64;
    }
}

impl Rng {
    /// A log-uniform size in [2^lo, 2^hi).
    fn log_size(&mut self, lo: u32, hi: u32) -> usize {
        let r = self.next_u64();
        let exp = lo + (r % u64::from(hi - lo)) as u32;
        (1usize << exp) + ((r >> 8) as usize & ((1 << exp) - 1))
    }
}

/// A training-like loop: 20 weights (1–16 MiB) held throughout; each of `iters` steps picks a batch
/// size in 8..=64, allocates 16 layers' activations forward (each with a workspace of half its size,
/// freed at once) and frees them backward, each after its gradient's allocation. Returns the
/// largest sum of requested bytes held at once; allocations made: about `50 * iters`.
pub fn training_loop<A: Allocator>(a: &A, iters: u64, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let mut held = Held::default();
    let weights: Vec<_> = (0..20)
        .map(|_| {
            let n = rng.log_size(20, 24);
            held.add(n);
            (a.alloc(n), n)
        })
        .collect();
    let layers: Vec<usize> = (0..16).map(|_| rng.log_size(16, 19)).collect();
    for _ in 0..iters {
        let batch = 8 + (rng.next_u64() % 57) as usize;
        let mut acts = Vec::with_capacity(layers.len());
        for &l in &layers {
            held.add(l * batch);
            acts.push(a.alloc(l * batch));
            held.add(l * batch / 2);
            a.free(a.alloc(l * batch / 2));
            held.sub(l * batch / 2);
        }
        for (act, &l) in acts.into_iter().zip(&layers).rev() {
            held.add(l * batch);
            let grad = a.alloc(l * batch);
            a.free(act);
            a.free(grad);
            held.sub(2 * l * batch);
        }
    }
    for (w, n) in weights {
        a.free(w);
        held.sub(n);
    }
    held.peak
}

/// A random-size loop: each of `iters` steps allocates 1 to 48 blocks of log-uniform sizes in
/// [64 KiB, 32 MiB) (a request of a model with dynamic shapes) and frees them in random order.
/// Returns the largest sum of requested bytes held at once.
pub fn random_size_loop<A: Allocator>(a: &A, iters: u64, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let mut held = Held::default();
    for _ in 0..iters {
        let n = 1 + rng.next_u64() % 48;
        let mut live: Vec<_> = (0..n)
            .map(|_| {
                let n = rng.log_size(16, 25);
                held.add(n);
                (a.alloc(n), n)
            })
            .collect();
        while !live.is_empty() {
            let (h, n) = live.swap_remove(rng.next_u64() as usize % live.len());
            a.free(h);
            held.sub(n);
        }
    }
    held.peak
}

/// Like [`random_size_loop`], but allocations and frees interleave within a step (two allocations
/// for each free, 20 to 119 operations), so blocks die in the middle of the live set. Returns the
/// largest sum of requested bytes held at once.
pub fn interleaved_loop<A: Allocator>(a: &A, iters: u64, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let mut held = Held::default();
    for _ in 0..iters {
        let mut live = vec![];
        for _ in 0..20 + rng.next_u64() % 100 {
            if live.is_empty() || !rng.next_u64().is_multiple_of(3) {
                let n = rng.log_size(16, 25);
                held.add(n);
                live.push((a.alloc(n), n));
            } else {
                let (h, n) = live.swap_remove(rng.next_u64() as usize % live.len());
                a.free(h);
                held.sub(n);
            }
        }
        for (h, n) in live {
            a.free(h);
            held.sub(n);
        }
    }
    held.peak
}

/// Steady churn: `steps` times, allocate a log-uniform size in [64 KiB, 32 MiB) while under a
/// slowly rising target of 256–506 MiB held, else free a random live block; random lifetimes
/// with no point where everything is free. Returns the largest sum of requested bytes held.
pub fn churn_loop<A: Allocator>(a: &A, steps: u64, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let mut held = Held::default();
    let mut live = vec![];
    for step in 0..steps {
        if held.now < (256 << 20) + (step % 4000) * (64 << 10) {
            let n = rng.log_size(16, 25);
            held.add(n);
            live.push((a.alloc(n), n));
        } else {
            let (h, n) = live.swap_remove(rng.next_u64() as usize % live.len());
            a.free(h);
            held.sub(n);
        }
    }
    for (h, n) in live {
        a.free(h);
        held.sub(n);
    }
    held.peak
}
