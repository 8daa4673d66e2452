//! Caching pool on the host upstream: (a) the warmed fast path, (b) alloc+free with 10,000 live blocks
//! of random sizes, (c) 1 vs 2 threads, each on its own stream, (f) a different size every time on
//! one stream with 4 live blocks. Every iteration is one allocation plus
//! one free; criterion's time per iteration is therefore ns per alloc+free pair.
//!
//! `cargo bench -p cumem-pool --bench caching_host -- --quick`
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cumem_pool::{Block, CachingPool, HostOrdering, HostUpstream, PoolConfig};

type Pool = CachingPool<HostUpstream, HostOrdering>;

fn pool() -> Pool {
    CachingPool::new(HostUpstream::new(1 << 40), HostOrdering::new(), PoolConfig::default())
}

/// Gives a block of the host model back on `stream`.
#[inline(always)]
fn free(pool: &Pool, block: Block, stream: u32) {
    // SAFETY: the host model's addresses have no memory behind them: no work uses a block, now or
    // later, so nothing needs ordering after `stream`, whichever stream is named.
    unsafe { pool.deallocate(block, stream) }.unwrap();
}

struct Rng(u64);
impl Rng {
    #[inline]
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Log-uniform size in [256 B, 1 MiB).
    #[inline]
    fn size(&mut self) -> usize {
        let r = self.next();
        let exp = 8 + (r % 12) as u32; // 2^8 ..= 2^19
        (1usize << exp) + ((r >> 8) as usize & ((1 << exp) - 1))
    }
}

fn fast_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("a_fast_path");
    for size in [256usize, 4096, 256 << 10] {
        let pool = pool();
        let warm = pool.allocate(size, 256, 0).unwrap();
        free(&pool, warm, 0);
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| {
                let blk = pool.allocate(black_box(size), 256, 0).unwrap();
                free(&pool, black_box(blk), 0);
            })
        });
    }
    g.finish();
}

fn live_10k(c: &mut Criterion) {
    let mut g = c.benchmark_group("b_10k_live_random");
    let pool = pool();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<Option<Block>> =
        (0..10_000).map(|_| Some(pool.allocate(rng.size(), 256, 0).unwrap())).collect();
    // Warm up: churn until the cache reaches a steady state.
    for _ in 0..200_000 {
        let i = (rng.next() % live.len() as u64) as usize;
        free(&pool, live[i].take().unwrap(), 0);
        live[i] = Some(pool.allocate(rng.size(), 256, 0).unwrap());
    }
    g.bench_function("free_random+alloc_random", |b| {
        b.iter(|| {
            let i = (rng.next() % live.len() as u64) as usize;
            free(&pool, live[i].take().unwrap(), 0);
            live[i] = Some(pool.allocate(rng.size(), 256, 0).unwrap());
        })
    });
    g.finish();
    let s = pool.stats();
    eprintln!(
        "10k live: reserved {} MiB, in use {} MiB, fragmentation {:.3}, upstream allocations {}",
        s.reserved_bytes >> 20,
        s.current_bytes >> 20,
        s.fragmentation(),
        s.upstream_allocations
    );
    for b in live.into_iter().flatten() {
        free(&pool, b, 0);
    }
}

fn varying_sizes(c: &mut Criterion) {
    let mut g = c.benchmark_group("f_varying_sizes_4_live");
    let pool = pool();
    let mut rng = Rng(11);
    let mut size = move || 256 + (rng.next() % (64 << 10)) as usize;
    let mut ring: Vec<Option<Block>> = (0..4).map(|_| None).collect();
    let mut i = 0;
    g.bench_function("alloc_new_size+free_4th_oldest", |b| {
        b.iter(|| {
            let blk = pool.allocate(black_box(size()), 256, 0).unwrap();
            if let Some(old) = ring[i % 4].replace(blk) {
                free(&pool, black_box(old), 0);
            }
            i += 1;
        })
    });
    g.finish();
    for b in ring.into_iter().flatten() {
        free(&pool, b, 0);
    }
}

/// Each thread keeps a ring of 64 live blocks on its own stream: free the oldest, allocate a size
/// from a small working set.
fn thread_loop(pool: &Pool, stream: u32, iters: u64, barrier: &Barrier) -> Duration {
    const SIZES: [usize; 8] = [512, 1000, 4096, 6000, 16384, 40000, 65536, 200_000];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(stream + 1));
    let mut ring: Vec<Block> = (0..64).map(|i| pool.allocate(SIZES[i % 8], 256, stream).unwrap()).collect();
    for i in 0..10_000 {
        let b = std::mem::replace(&mut ring[i % 64], pool.allocate(SIZES[i % 8], 256, stream).unwrap());
        free(pool, b, stream);
    }
    barrier.wait();
    let t = Instant::now();
    for i in 0..iters as usize {
        let size = SIZES[(rng.next() & 7) as usize];
        let b = std::mem::replace(&mut ring[i % 64], pool.allocate(size, 256, stream).unwrap());
        free(pool, b, stream);
    }
    let elapsed = t.elapsed();
    for b in ring {
        free(pool, b, stream);
    }
    elapsed
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("c_threads_own_stream");
    for n in [1u32, 2] {
        let pool = pool();
        g.throughput(Throughput::Elements(u64::from(n)));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                let barrier = Barrier::new(n as usize);
                std::thread::scope(|s| {
                    let hs: Vec<_> = (0..n)
                        .map(|t| {
                            s.spawn({
                                let (p, b) = (&pool, &barrier);
                                move || thread_loop(p, t, iters, b)
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).max().unwrap_or_default()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, fast_path, live_10k, threads, varying_sizes);
criterion_main!(benches);
