//! 8 threads × 10,000 alloc/free cycles on 4 streams through the simulator: every block is filled
//! with its owner's pattern and checked before it is freed; at the end the simulator has seen no
//! misuse and the pool returns everything.

use std::sync::Arc;

use cumem_copy::StreamCopy;
use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;

const THREADS: usize = 8;
const STREAMS: usize = 4;
const CYCLES: usize = 10_000;

#[test]
fn eight_threads_on_four_streams_never_see_each_others_data() {
    testing::init_with("latency_us=0");
    let ctx = Device::get(0).unwrap().context().unwrap();
    let streams: Vec<Stream> = (0..STREAMS).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let resource = pool.clone();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (stream, resource) = (&streams[t % STREAMS], &resource);
            scope.spawn(move || {
                let mut rng = 0x9E37_79B9u32.wrapping_mul(t as u32 + 1);
                // A few blocks stay live across cycles, so frees and allocations interleave.
                let mut held: Vec<(DeviceBuffer<u32>, u32)> = Vec::new();
                for cycle in 0..CYCLES {
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    let len = 64 + (rng as usize % 4096);
                    let pattern = ((t as u32) << 24) | (cycle as u32 & 0x00FF_FFFF);
                    let mut buf = DeviceBuffer::<u32>::new_in(resource, stream, len).unwrap();
                    stream.fill(&mut buf, pattern).unwrap();
                    held.push((buf, pattern));
                    if held.len() > 3 || cycle == CYCLES - 1 {
                        let (buf, pattern) = held.remove((rng as usize >> 8) % held.len());
                        let seen = buf.to_vec().unwrap();
                        assert!(
                            seen.iter().all(|&v| v == pattern),
                            "thread {t} cycle {cycle}: block overwritten"
                        );
                    }
                }
                for (buf, pattern) in held.drain(..) {
                    assert!(buf.to_vec().unwrap().iter().all(|&v| v == pattern));
                }
            });
        }
    });
    let stats = pool.stats();
    assert_eq!((stats.current_bytes, stats.current_count), (0, 0));
    assert_eq!(stats.allocations_total, (THREADS * CYCLES) as u64);
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        assert!(ctl.live_report().allocations.is_empty(), "{}", ctl.live_report());
    }
}
