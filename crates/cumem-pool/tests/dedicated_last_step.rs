//! The out-of-memory ladder's last step with plain segments (a request that may not pin a
//! dedicated segment takes a range of one rather than be refused) when memory moves while the
//! ladder grows, with no lock held: frees into several arenas are joined before the step takes a
//! range, a block stranded meanwhile counts towards what the step may find, a step that cannot
//! find the request's bytes spends no synchronisation, and a failed synchronisation answers out of
//! memory. On the host model, with a 40 MiB upstream that one 40 MiB dedicated segment fills.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use common::Free;
use cumem_pool::size_class::Kind;
use cumem_pool::{Block, CachingPool, HostUpstream, PoolConfig, PoolError, Upstream, UpstreamError};
use cumem_sys::testing::{OnEvent, event_message, with_subscriber};

const MIB: usize = 1 << 20;

type Hook = Box<dyn FnOnce(&Pool) + Send>;

/// A 40 MiB host upstream that runs a hook, once, from the first allocation asked for while the
/// pool's `fire_in_ladder`-th out-of-memory ladder runs: the ladder's growth, which holds no lock,
/// so the hook may free into the pool as another thread would.
struct HookedUpstream {
    host: HostUpstream,
    pool: OnceLock<Weak<Pool>>,
    fire_in_ladder: AtomicU64,
    hook: Mutex<Option<Hook>>,
}

impl Upstream for HookedUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        if let Some(pool) = self.pool.get().and_then(Weak::upgrade)
            && pool.stats().oom_ladders == self.fire_in_ladder.load(Relaxed)
        {
            let hook = self.hook.lock().unwrap().take();
            if let Some(hook) = hook {
                hook(&pool);
            }
        }
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) }
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for HookedUpstream {}

/// Host ordering (every wait and synchronisation succeeds at once, and is counted) whose
/// synchronisation fails while `failing`.
#[derive(Default)]
struct Switched {
    failing: AtomicBool,
    syncs: AtomicU64,
}

impl cumem_pool::Ordering for Switched {
    type Stream = u32;
    fn wait(&self, _: u32, _: u32) -> Result<(), UpstreamError> {
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.syncs.fetch_add(1, Relaxed);
        if self.failing.load(Relaxed) { Err(UpstreamError::Other(999)) } else { Ok(()) }
    }
}

type Pool = CachingPool<HookedUpstream, Switched>;

/// A pool over a 40 MiB upstream with arenas for `arenas` streams (0, then the first others to
/// free), and the hook to run in its `fire_in_ladder`-th ladder.
fn pool(arenas: usize, fire_in_ladder: u64, hook: Hook) -> Arc<Pool> {
    let up = HookedUpstream {
        host: HostUpstream::new(40 * MIB),
        pool: OnceLock::new(),
        fire_in_ladder: AtomicU64::new(fire_in_ladder),
        hook: Mutex::new(Some(hook)),
    };
    let pool =
        Arc::new(CachingPool::with_stream_arenas(up, Switched::default(), PoolConfig::default(), arenas));
    pool.upstream().pool.set(Arc::downgrade(&pool)).ok().unwrap();
    pool
}

/// Fills the upstream with one 40 MiB dedicated segment, frees it on stream 0, and takes 31 MiB
/// of it back (the 9 MiB tail is within the 10 MiB split limit, so it stays dedicated and free).
fn fill(pool: &Pool) -> (Block, cumem_pool::free_set::Seg) {
    let whole = pool.allocate(40 * MIB, 256, 0).unwrap();
    let dedicated = whole.segment();
    assert_eq!((whole.kind(), dedicated.len), (Kind::Dedicated, 40 << 20));
    pool.free(whole, 0).unwrap();
    let x = pool.allocate(31 * MIB, 256, 0).unwrap();
    assert_eq!((x.segment(), x.addr()), (dedicated, dedicated.base));
    (x, dedicated)
}

/// Checks the pool's books and that a trim gives the whole 40 MiB segment back (its pieces may lie
/// in several arenas, which the trim joins).
fn released_whole(pool: &Pool) {
    pool.validate().unwrap();
    let report = pool.trim().unwrap();
    assert_eq!((report.released_segments, report.released_bytes), (1, 40 << 20));
    assert_eq!(pool.upstream().host.live_bytes(), 0);
}

/// A hook that frees what `blocks` holds then, each block on its stream.
fn freeing(blocks: Arc<Mutex<Vec<(Block, u32)>>>) -> Hook {
    Box::new(move |pool: &Pool| {
        for (block, stream) in blocks.lock().unwrap().drain(..) {
            pool.free(block, stream).unwrap();
        }
    })
}

#[test]
fn frees_into_two_arenas_during_the_growth_are_joined_before_the_last_step_takes_a_range() {
    let blocks = Arc::new(Mutex::new(Vec::new()));
    // The hook runs in the second ladder (the first serves `y`).
    let pool = pool(3, 2, freeing(blocks.clone()));
    let (x, dedicated) = fill(&pool);
    // 8 MiB may pin the segment only as the last resort: the first ladder serves it from the tail.
    let y = pool.allocate(8 * MIB, 256, 0).unwrap();
    assert_eq!((y.segment(), y.addr()), (dedicated, dedicated.base + (31 << 20)));
    assert_eq!(pool.stats().oom_ladders, 1);
    // While the ladder for 35 MiB grows (the device is full), `x` and `y` are freed on streams 1
    // and 2: the segment is free again, in pieces in three arenas ([0, 31), [31, 39) and the 1 MiB
    // tail in stream 0's), none of them 35 MiB.
    *blocks.lock().unwrap() = vec![(x, 1), (y, 2)];
    let z = pool.allocate(35 * MIB, 256, 0).unwrap();
    assert_eq!((z.segment(), z.addr(), z.kind()), (dedicated, dedicated.base, Kind::Dedicated));
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors, s.reserved_bytes), (2, 0, 40 << 20));
    assert!(blocks.lock().unwrap().is_empty(), "the hook ran");
    pool.free(z, 0).unwrap();
    released_whole(&pool);
}

#[test]
fn a_dedicated_block_stranded_during_the_growth_counts_towards_the_last_step() {
    let blocks = Arc::new(Mutex::new(Vec::new()));
    // One stream arena (stream 0's): a free on stream 7 has none, and is ordered by a
    // synchronisation, which fails while the hook frees `x` there, so `x` is stranded.
    let pool = pool(1, 1, {
        let free = freeing(blocks.clone());
        Box::new(move |pool: &Pool| {
            pool.ordering().failing.store(true, Relaxed);
            free(pool);
            pool.ordering().failing.store(false, Relaxed);
            assert_eq!(pool.stats().stranded_bytes, 31 << 20);
        })
    });
    let (x, dedicated) = fill(&pool);
    *blocks.lock().unwrap() = vec![(x, 7)];
    // The arenas hold 9 MiB of dedicated ranges, the stranded block 31 MiB: the last step
    // synchronises (which returns the block to the cache), joins it with the tail and serves
    // 35 MiB from the whole segment.
    let z = pool.allocate(35 * MIB, 256, 0).unwrap();
    assert_eq!((z.segment(), z.addr(), z.kind()), (dedicated, dedicated.base, Kind::Dedicated));
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors, s.stranded_bytes), (1, 0, 0));
    pool.free(z, 0).unwrap();
    released_whole(&pool);
}

#[test]
fn the_last_step_synchronises_only_when_the_dedicated_ranges_hold_the_requests_bytes() {
    let pool = pool(3, u64::MAX, Box::new(|_| {}));
    let (x, dedicated) = fill(&pool);
    let syncs = || pool.ordering().syncs.load(Relaxed);
    // 10 MiB: more than the 9 MiB tail, the only dedicated range. The ladder synchronises once,
    // the last step not at all.
    let before = syncs();
    let refused = pool.allocate(10 * MIB, 256, 0).unwrap_err();
    assert!(matches!(refused, PoolError::OutOfMemory { .. }), "{refused}");
    assert_eq!(syncs() - before, 1);
    // 9 MiB fits the tail: the last step synchronises again (memory may have been freed while
    // the ladder grew) and serves it.
    let before = syncs();
    let tail = pool.allocate(9 * MIB, 256, 0).unwrap();
    assert_eq!((tail.segment(), tail.addr()), (dedicated, dedicated.base + (31 << 20)));
    assert_eq!(syncs() - before, 2);
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors), (2, 1));
    pool.free(tail, 0).unwrap();
    pool.free(x, 0).unwrap();
    released_whole(&pool);
}

#[test]
fn a_failed_synchronisation_in_the_last_step_answers_out_of_memory_and_warns() {
    // The synchronisation fails from the ladder's growth on: the ladder's own succeeded, the last
    // step's does not.
    let pool = pool(3, 1, Box::new(|pool: &Pool| pool.ordering().failing.store(true, Relaxed)));
    let (x, dedicated) = fill(&pool);
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let log = warnings.clone();
    let subscriber = OnEvent(move |e: &tracing::Event<'_>| {
        if *e.metadata().level() == tracing::Level::WARN {
            log.lock().unwrap().push(event_message(e));
        }
    });
    let refused = with_subscriber(subscriber, || pool.allocate(9 * MIB, 256, 0)).unwrap_err();
    assert!(matches!(refused, PoolError::OutOfMemory { .. }), "{refused}");
    assert_eq!(
        *warnings.lock().unwrap(),
        ["the out-of-memory ladder's last synchronisation failed", "caching pool out of memory"]
    );
    // Nothing was taken or lost: with the ordering working again the same request is served.
    pool.ordering().failing.store(false, Relaxed);
    let tail = pool.allocate(9 * MIB, 256, 0).unwrap();
    assert_eq!((tail.segment(), tail.addr()), (dedicated, dedicated.base + (31 << 20)));
    let s = pool.stats();
    assert_eq!((s.oom_ladders, s.oom_errors), (2, 1));
    pool.free(tail, 0).unwrap();
    pool.free(x, 0).unwrap();
    released_whole(&pool);
}
