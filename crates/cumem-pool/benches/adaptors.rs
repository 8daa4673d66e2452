//! What each adaptor adds to an allocation: a warmed caching pool on the simulator (a hit in the
//! calling thread's cache, so the driver is not called) served bare and through each adaptor. Every iteration is one
//! allocation plus one free through the `DeviceResource` trait; criterion's time per iteration is
//! ns per alloc+free pair, and an adaptor's cost is its time minus the bare pool's.
//!
//! The logging adaptor is measured twice: in bursts of 10,000 pairs with the log flushed between
//! bursts (untimed), which is its hot path (a program whose log keeps up), and sustained, where the
//! writer thread formatting rows sets the pace once the queue is full.
//!
//! `cargo bench -p cumem-pool --bench adaptors -- --quick`
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use cumem_core::{AllocLayout, Device, DeviceResource, Stream};
use cumem_pool::{
    CachingResource, FailureCallbackResource, LimitingResource, LoggingResource, PoolConfig,
    StatisticsResource, TrackingResource,
};

fn alloc_free(c: &mut Criterion, name: &str, resource: &dyn DeviceResource, stream: &Stream) {
    let layout = AllocLayout::new(256, 256).unwrap();
    // Warm: the pool's segment and the stream's arena exist, the block sits in the calling thread's cache.
    let warm = resource.allocate(layout, stream).unwrap();
    // SAFETY: allocated just above with `layout` on `stream`, never used, freed once.
    unsafe { resource.deallocate(warm, layout, stream) };
    c.bench_function(name, |b| {
        b.iter(|| {
            let a = resource.allocate(black_box(layout), stream).unwrap();
            // SAFETY: as above.
            unsafe { resource.deallocate(black_box(a), layout, stream) };
        })
    });
}

/// Pairs per timed burst: 20,000 rows, within the logging adaptor's queue.
const BURST: u64 = 10_000;

fn logged_bursts<R: DeviceResource + ?Sized>(
    c: &mut Criterion,
    name: &str,
    log: &LoggingResource<R>,
    stream: &Stream,
) {
    let layout = AllocLayout::new(256, 256).unwrap();
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(BURST);
                left -= n;
                let start = Instant::now();
                for _ in 0..n {
                    let a = log.allocate(black_box(layout), stream).unwrap();
                    // SAFETY: allocated just above with `layout` on `stream`, never used, freed once.
                    unsafe { log.deallocate(black_box(a), layout, stream) };
                }
                timed += start.elapsed();
                log.flush().unwrap();
            }
            timed
        })
    });
}

fn adaptors(c: &mut Criterion) {
    cumem_sys::testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    alloc_free(c, "adaptor/none (caching pool)", &*pool, &stream);
    alloc_free(c, "adaptor/statistics", &StatisticsResource::new(pool.clone()), &stream);
    alloc_free(c, "adaptor/limiting", &LimitingResource::new(pool.clone(), 1 << 40), &stream);
    alloc_free(
        c,
        "adaptor/failure_callback",
        &FailureCallbackResource::new(pool.clone(), 1, |_| false),
        &stream,
    );
    alloc_free(c, "adaptor/tracking", &TrackingResource::new(pool.clone()), &stream);
    alloc_free(c, "adaptor/tracking_with_sites", &TrackingResource::with_sites(pool.clone()), &stream);
    let log = LoggingResource::new(pool.clone(), std::io::sink()).unwrap();
    logged_bursts(c, "adaptor/logging (bursts)", &log, &stream);
    alloc_free(c, "adaptor/logging (sustained)", &log, &stream);
    let path = std::env::temp_dir().join(format!("cumem-bench-log-{}.csv", std::process::id()));
    let file_log = LoggingResource::to_file(pool.clone(), &path).unwrap();
    logged_bursts(c, "adaptor/logging to a file (bursts)", &file_log, &stream);
    drop(file_log);
    std::fs::remove_file(&path).ok();
}

criterion_group!(benches, adaptors);
criterion_main!(benches);
