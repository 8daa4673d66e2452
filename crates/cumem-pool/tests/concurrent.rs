//! Several threads, each on its own stream, allocating and freeing concurrently; some blocks are
//! handed to the next thread and freed on its stream. Stream safety is checked on every operation
//! and the invariants and leak freedom at the end; with and without expandable segments.

mod common;

use std::sync::mpsc;

use common::{Free, STREAMS, model_round, new_pool};
use cumem_pool::{Block, PoolConfig};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[rstest::rstest]
fn threads_on_their_own_streams(#[values(false, true)] expandable_segments: bool) {
    const ITERS: usize = 6000;
    let pool = new_pool(1 << 30, PoolConfig { expandable_segments, ..PoolConfig::default() });
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..STREAMS).map(|_| mpsc::channel::<Block>()).unzip();
    std::thread::scope(|scope| {
        for (t, rx) in rxs.into_iter().enumerate() {
            let pool = &pool;
            let next = txs[(t + 1) % STREAMS].clone();
            scope.spawn(move || {
                let s = t as u8;
                let clock = &pool.ordering().0;
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
                let mut live: Vec<Block> = vec![];
                let free = |b: Block| {
                    clock.lock().record_free(b.addr(), b.rounded_size() as u64, s);
                    pool.free(b, s).unwrap();
                };
                for i in 0..ITERS {
                    // Blocks handed over by the previous thread: last used here, freed here.
                    while let Ok(b) = rx.try_recv() {
                        free(b);
                    }
                    let r = rng.below(100);
                    if r < 55 || live.is_empty() {
                        let size = match rng.below(20) {
                            0 => (1 << 20) + rng.below(3 << 20) as usize,
                            1..=4 => 1 + rng.below(1 << 20) as usize,
                            _ => 1 + rng.below(8192) as usize,
                        };
                        let align = 1usize << rng.below(13);
                        let b = pool.allocate(size, align, s).unwrap();
                        assert_eq!(b.rounded_size() as u64, model_round(size));
                        assert_eq!(b.addr() % align as u64, 0);
                        clock.lock().record_alloc(b.addr(), b.rounded_size() as u64, s);
                        live.push(b);
                    } else if r < 90 || live.len() > 64 {
                        let b = live.swap_remove(rng.below(live.len() as u64) as usize);
                        free(b);
                    } else if r < 98 {
                        let b = live.swap_remove(rng.below(live.len() as u64) as usize);
                        next.send(b).unwrap();
                    } else if i % 7 == 0 {
                        pool.trim().unwrap();
                    } else {
                        let st = pool.stats();
                        assert!(st.peak_bytes >= st.current_bytes);
                    }
                }
                for b in live {
                    free(b);
                }
                drop(next);
                // Wait for the previous thread to finish handing blocks over.
                while let Ok(b) = rx.recv() {
                    free(b);
                }
            });
        }
        drop(txs);
    });
    let clock = pool.ordering().0.lock();
    assert!(
        clock.violations.is_empty(),
        "stream-safety violations: {:#?}",
        &clock.violations[..5.min(clock.violations.len())]
    );
    assert!(clock.waits > 0, "cross-stream frees must have caused migrations");
    drop(clock);
    pool.validate().unwrap();
    let s = pool.stats();
    assert_eq!((s.current_bytes, s.current_count, s.requested_bytes), (0, 0, 0));
    assert_eq!(s.allocations_total, s.histogram.0.iter().sum::<u64>());
    assert_eq!(s.reserved_bytes, pool.upstream().host.live_bytes());
    pool.trim().unwrap();
    assert_eq!(pool.upstream().host.live_bytes(), 0);
    assert!(pool.upstream().host.reservations().is_empty());
    assert!(pool.upstream().host.violations().is_empty());
    assert!(pool.ordering().0.lock().violations.is_empty());
}
