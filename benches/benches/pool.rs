//! Criterion benches of the allocators: the caching pool (host model and as a device resource), the
//! driver's pool and cuMemAlloc, on the real driver when present, else the simulator.
//! `cargo bench -p cumem-benches --bench pool`; `cargo xtask bench pool` prints the one-run table.
#![allow(missing_docs)]

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use cumem_benches::{host_fast_path, host_many_live, host_pool, resource_fast_path, resource_many_live};
use cumem_core::{Device, DriverResource, Stream};
use cumem_pool::{CachingResource, MemPool, MemPoolOptions, NativePoolResource, PoolConfig};

fn allocators(c: &mut Criterion) {
    cumem_sys::driver::init().expect("a driver (or the simulator)");
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let host = host_pool();
    let caching = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let native = NativePoolResource::new(
        MemPool::create(&ctx, MemPoolOptions { max_size: None, release_threshold: u64::MAX }).unwrap(),
    );
    let driver = DriverResource::new(&ctx);

    let mut g = c.benchmark_group("alloc_free_256B");
    g.bench_function("caching_host_model", |b| b.iter_custom(|n| time(|| host_fast_path(&host, n, 256))));
    g.bench_function("caching_device_resource", |b| {
        b.iter_custom(|n| time(|| resource_fast_path(caching.as_ref(), &stream, n, 256)))
    });
    g.bench_function("driver_pool", |b| {
        b.iter_custom(|n| time(|| resource_fast_path(&native, &stream, n, 256)))
    });
    g.bench_function("cuMemAlloc", |b| {
        b.iter_custom(|n| time(|| resource_fast_path(&driver, &stream, n, 256)))
    });
    g.finish();

    let mut g = c.benchmark_group("alloc_free_10k_live");
    g.bench_function("caching_host_model", |b| {
        b.iter_custom(|n| time(|| host_many_live(&host, 10_000, n, 7)))
    });
    g.bench_function("caching_device_resource", |b| {
        b.iter_custom(|n| time(|| resource_many_live(caching.as_ref(), &stream, 10_000, n, 7)))
    });
    g.finish();
    stream.synchronize().unwrap();
}

fn time(f: impl FnOnce()) -> std::time::Duration {
    let t = std::time::Instant::now();
    f();
    t.elapsed()
}

criterion_group!(benches, allocators);
criterion_main!(benches);
