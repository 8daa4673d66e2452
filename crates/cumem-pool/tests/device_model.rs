//! Random alloc/free/stream/sync sequences against the caching pool on the device: after every
//! step no two live blocks overlap, every live block lies in a segment the pool holds (for an
//! expandable segment, in its mapped part), reserved memory is live or cached, and the statistics
//! equal the model's counts; with and without expandable segments.

use std::sync::Arc;

use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc { stream: usize, len: usize, tag: u8 },
    Free { which: usize },
    Sync,
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..3, 1usize..3_000_000, any::<u8>()).prop_map(|(stream, len, tag)| Op::Alloc { stream, len, tag }),
        4 => any::<usize>().prop_map(|which| Op::Free { which }),
        1 => Just(Op::Sync),
        1 => Just(Op::Trim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_device_pool_matches_its_model(
        expandable_segments in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        testing::init();
        let ctx = Device::get(0).unwrap().context().unwrap();
        let streams: Vec<Stream> = (0..3).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
        let config = PoolConfig { expandable_segments, ..PoolConfig::default() };
        let pool = Arc::new(CachingResource::with_driver(&ctx, config));
        let r = pool.clone();
        let mut live: Vec<(DeviceBuffer<u8>, u8)> = Vec::new();
        let mut allocations = 0u64;
        for op in ops {
            match op {
                Op::Alloc { stream, len, tag } => {
                    let mut buf = DeviceBuffer::<u8>::new_in(&r, &streams[stream], len).unwrap();
                    streams[stream].memset_d8(&mut buf, tag).unwrap();
                    live.push((buf, tag));
                    allocations += 1;
                }
                Op::Free { which } if !live.is_empty() => {
                    let (buf, tag) = live.remove(which % live.len());
                    let seen = buf.slice(buf.len() - 1..).unwrap().to_vec().unwrap();
                    prop_assert_eq!(seen[0], tag, "a live block was overwritten");
                }
                Op::Free { .. } => {}
                Op::Sync => { pool.synchronize().unwrap(); }
                Op::Trim => { pool.trim().unwrap(); }
            }
            let mut spans: Vec<(u64, u64)> =
                live.iter().map(|(b, _)| (b.device_ptr(), b.device_ptr() + b.bytes() as u64)).collect();
            spans.sort_unstable();
            prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlap: {:x?}", spans);
            let segments = pool.pool().segments();
            prop_assert!(spans.iter().all(|&(a, b)| segments.iter().any(|&(s, n)| s <= a && b <= s + n)));
            let stats = pool.stats();
            prop_assert_eq!(stats.current_count, live.len() as u64);
            prop_assert_eq!(stats.allocations_total, allocations);
            prop_assert_eq!(stats.reserved_bytes, segments.iter().map(|&(_, n)| n).sum::<u64>());
            prop_assert_eq!(stats.reserved_bytes, stats.current_bytes + stats.cached_bytes);
            pool.pool().validate().map_err(TestCaseError::fail)?;
        }
        drop(live);
        pool.trim().unwrap();
        prop_assert_eq!(pool.stats().reserved_bytes, 0);
    }
}
