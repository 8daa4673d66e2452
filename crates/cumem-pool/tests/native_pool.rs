//! The driver's stream-ordered pools through the safe API: attributes, accounting, stream-ordered
//! reuse, the release threshold, trimming, and devices without pools. What every resource does
//! for buffers (round trips, views, copies, errors, alignment, frees on other threads) is a table
//! in `every_resource.rs`, whose rows include the default and a created pool.

use std::sync::Arc;

use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, Error, Feature, Stream};
use cumem_pool::{MemPool, MemPoolOptions, NativePoolResource, ReusePolicy};
use cumem_sys::testing;
use proptest::prelude::*;

const SIM: &str = "devices=2,dev1.memory_pools_supported=0";

fn ctx() -> cumem_core::Context {
    testing::init_with(SIM);
    Device::get(0).unwrap().context().unwrap()
}

#[test]
fn the_default_pool_has_the_documented_defaults() {
    let ctx = ctx();
    let pool = MemPool::default_pool(&ctx).unwrap();
    assert_eq!(pool.reuse_policy().unwrap(), ReusePolicy::default());
    assert_eq!(MemPool::current(&ctx).unwrap().raw(), pool.raw(), "the default pool is current at first");
    assert_eq!(pool.context(), &ctx);
    assert!(format!("{pool:?}").contains("owned: false"));
}

#[test]
fn attributes_round_trip() {
    let ctx = ctx();
    let pool = MemPool::create(&ctx, MemPoolOptions { max_size: None, release_threshold: 1 << 20 }).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 1 << 20);
    pool.set_release_threshold(u64::MAX).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    let strict = ReusePolicy {
        follow_event_dependencies: true,
        allow_opportunistic: false,
        allow_internal_dependencies: false,
    };
    pool.set_reuse_policy(strict).unwrap();
    assert_eq!(pool.reuse_policy().unwrap(), strict);
}

#[test]
fn usage_counts_live_allocations_and_resets_its_high_marks() {
    let ctx = ctx();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let native = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    native.pool().set_release_threshold(u64::MAX).unwrap();
    let native = Arc::new(native);
    let r = native.clone();
    let a = DeviceBuffer::<u32>::zeroed_in(&r, &stream, 1000).unwrap();
    let b = DeviceBuffer::<u8>::zeroed_in(&r, &stream, 10_000).unwrap();
    let usage = native.pool().usage().unwrap();
    assert!(usage.used_current >= 14_000, "{usage:?}");
    assert!(usage.reserved_current >= usage.used_current);
    assert!(usage.used_high >= usage.used_current && usage.reserved_high >= usage.reserved_current);
    drop(b);
    stream.synchronize().unwrap();
    let after = native.pool().usage().unwrap();
    assert!(after.used_current < usage.used_current && after.used_high == usage.used_high, "{after:?}");
    native.pool().reset_high_watermarks().unwrap();
    let reset = native.pool().usage().unwrap();
    assert_eq!(reset.used_high, reset.used_current);
    drop(a);
}

#[test]
fn memory_freed_on_a_stream_is_reused_by_that_stream_at_once() {
    let ctx = ctx();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let r = Arc::new(NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap()));
    let a = DeviceBuffer::<u64>::zeroed_in(&r, &stream, 512).unwrap();
    let first = a.device_ptr();
    drop(a); // freed in stream order on `stream`
    let b = DeviceBuffer::<u64>::zeroed_in(&r, &stream, 512).unwrap();
    assert_eq!(b.device_ptr(), first);
}

#[test]
fn the_release_threshold_is_honoured_at_synchronisation() {
    let ctx = ctx();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let native = Arc::new(NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap()));
    let r = native.clone();
    drop(DeviceBuffer::<u8>::zeroed_in(&r, &stream, 8 << 20).unwrap());
    stream.synchronize().unwrap();
    assert_eq!(native.pool().usage().unwrap().reserved_current, 0, "threshold 0 releases everything");

    native.pool().set_release_threshold(u64::MAX).unwrap();
    drop(DeviceBuffer::<u8>::zeroed_in(&r, &stream, 8 << 20).unwrap());
    stream.synchronize().unwrap();
    let kept = native.pool().usage().unwrap().reserved_current;
    assert!(kept >= 8 << 20, "an unlimited threshold keeps the memory");
    native.pool().trim_to(0).unwrap();
    assert_eq!(native.pool().usage().unwrap().reserved_current, 0, "trim_to(0) releases it");
}

#[test]
fn a_device_without_pools_is_not_supported_before_any_driver_call() {
    let _ = ctx();
    if testing::sim_control().is_none() {
        testing::skip("needs the simulator's device 1, configured without memory pools");
        return;
    }
    let ctx1 = Device::get(1).unwrap().context().unwrap();
    for result in [
        MemPool::create(&ctx1, MemPoolOptions::default()).map(|_| ()),
        MemPool::default_pool(&ctx1).map(|_| ()),
        MemPool::current(&ctx1).map(|_| ()),
    ] {
        assert!(matches!(
            result,
            Err(Error::NotSupported { feature: Feature::MemoryPools, device: Some(1) })
        ));
    }
}

#[test]
fn a_capped_pool_runs_out_of_memory() {
    let ctx = ctx();
    let stream = Stream::new(&ctx).unwrap();
    let r = Arc::new(NativePoolResource::new(
        MemPool::create(&ctx, MemPoolOptions { max_size: Some(64 << 20), release_threshold: 0 }).unwrap(),
    ));
    let err = DeviceBuffer::<u8>::zeroed_in(&r, &stream, 128 << 20).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
}

#[test]
fn a_size_limit_of_zero_is_refused_not_read_as_no_limit() {
    let ctx = ctx();
    let err = MemPool::create(&ctx, MemPoolOptions { max_size: Some(0), release_threshold: 0 }).unwrap_err();
    assert!(matches!(err, Error::ZeroSize { .. }), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random stream-ordered allocation and frees on three streams: live allocations never overlap,
    /// the pool accounts for at least what is live, and every byte written reads back.
    #[test]
    fn random_stream_ordered_sequences_keep_allocations_apart(
        ops in proptest::collection::vec((0usize..3, 1usize..200_000, any::<bool>(), any::<u8>()), 1..24)
    ) {
        let ctx = ctx();
        let streams: Vec<Stream> = (0..3).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
        let native = Arc::new(NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap()));
        let r = native.clone();
        let mut live: Vec<(DeviceBuffer<u8>, u8)> = Vec::new();
        for (s, len, free, tag) in ops {
            if free && !live.is_empty() {
                let (buf, tag) = live.remove(tag as usize % live.len());
                prop_assert!(buf.to_vec().unwrap().iter().all(|&b| b == tag));
            } else {
                let mut buf = DeviceBuffer::<u8>::new_in(&r, &streams[s], len).unwrap();
                streams[s].fill(&mut buf, tag).unwrap();
                live.push((buf, tag));
            }
            let mut spans: Vec<(u64, u64)> = live.iter().map(|(b, _)| (b.device_ptr(), b.device_ptr() + b.bytes() as u64)).collect();
            spans.sort_unstable();
            prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlap: {spans:x?}");
            let used = native.pool().usage().unwrap().used_current;
            let live_bytes: u64 = spans.iter().map(|(a, b)| b - a).sum();
            prop_assert!(used >= live_bytes);
            if testing::sim_control().is_some() {
                // The simulator's accounting is exact: every allocation rounded up to 512 bytes.
                prop_assert_eq!(used, spans.iter().map(|(a, b)| (b - a).next_multiple_of(512)).sum::<u64>());
            }
        }
        for (buf, tag) in live {
            prop_assert!(buf.to_vec().unwrap().iter().all(|&b| b == tag));
        }
    }
}
