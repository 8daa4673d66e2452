//! `trim`, `synchronize` and the out-of-memory ladder wait for the streams
//! (`Ordering::synchronize`) with no lock of the pool held: on a device that wait covers host functions, and a host function may allocate or
//! free through the pool. Here the ordering's `synchronize` does not return before another
//! thread has allocated and freed through the pool, standing for such a host function; under a
//! watchdog, since a lock held across the wait hangs rather than fails. Memory freed while the
//! wait runs may be under work queued after it started: it is released only after another
//! synchronisation, and a block stranded meanwhile stays stranded until one.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock, Weak};

use common::Free;
use cumem_pool::{
    Block, CachingPool, HostOrdering, HostUpstream, Ordering, PoolConfig, PoolError, TrimReport,
    UpstreamError,
};
use cumem_sys::testing::{OnEvent, event_message, within_watchdog};
use parking_lot::Mutex;

type Pool = CachingPool<HostUpstream, UsingThePool>;

/// What one `synchronize` call does before synchronising the host model.
enum OnSync {
    /// Another thread allocates 1 MiB on stream 1 and frees it there (1 MiB skips the thread
    /// cache: both go through stream 1's arena).
    AllocateAndFree,
    /// Another thread frees this block on this stream.
    Free(Block, u32),
    /// The synchronisation fails.
    Fail,
    /// As `AllocateAndFree`, but waits for that thread only 2 s: were the pool's locks held it
    /// could not go on, and would finish once they are let go (`helpers` joins it).
    AllocateAndFreeIfUnlocked,
    /// Another thread allocates this many bytes on this stream (through the out-of-memory ladder,
    /// here), and sends the block back.
    Allocate(usize, u32, std::sync::mpsc::Sender<Block>),
    /// Another thread trims the pool (its own synchronisation finds nothing queued).
    Trim,
    /// Another thread allocates 4 KiB on stream 1 and frees it into its thread cache, then
    /// stays alive, its cache holding the block, until the sender is dropped.
    CacheInAThread(std::sync::mpsc::Receiver<()>),
}

/// A host ordering whose `synchronize` calls first do what was queued for them, in order (then
/// nothing).
#[derive(Default)]
struct UsingThePool {
    host: HostOrdering,
    pool: OnceLock<Weak<Pool>>,
    queued: Mutex<VecDeque<OnSync>>,
    helper: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The threads of `AllocateAndFreeIfUnlocked`, and whether each finished within its wait.
    helpers: Mutex<Vec<(std::thread::JoinHandle<()>, bool)>>,
}

impl Ordering for UsingThePool {
    type Stream = u32;
    fn wait(&self, waiter: u32, on: u32) -> Result<(), UpstreamError> {
        self.host.wait(waiter, on)
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        let next = self.queued.lock().pop_front();
        let pool = self.pool.get().and_then(Weak::upgrade).expect("the pool is alive");
        match next {
            Some(OnSync::AllocateAndFree) => std::thread::spawn(move || {
                let b = pool.allocate(1 << 20, 512, 1).unwrap();
                pool.free(b, 1).unwrap();
            })
            .join()
            .unwrap(),
            Some(OnSync::AllocateAndFreeIfUnlocked) => {
                let (done, finished) = std::sync::mpsc::channel();
                let helper = std::thread::spawn(move || {
                    let b = pool.allocate(1 << 20, 512, 1).unwrap();
                    pool.free(b, 1).unwrap();
                    let _ = done.send(());
                });
                let in_time = finished.recv_timeout(std::time::Duration::from_secs(2)).is_ok();
                self.helpers.lock().push((helper, in_time));
            }
            Some(OnSync::Allocate(bytes, stream, out)) => std::thread::spawn(move || {
                out.send(pool.allocate(bytes, 512, stream).unwrap()).unwrap();
            })
            .join()
            .unwrap(),
            Some(OnSync::Trim) => std::thread::spawn(move || {
                pool.trim().unwrap();
            })
            .join()
            .unwrap(),
            Some(OnSync::Free(b, stream)) => {
                std::thread::spawn(move || pool.free(b, stream).unwrap()).join().unwrap()
            }
            Some(OnSync::CacheInAThread(done)) => {
                let (cached, wait_cached) = std::sync::mpsc::channel();
                let helper = std::thread::spawn(move || {
                    let b = pool.allocate(4096, 512, 1).unwrap();
                    pool.free(b, 1).unwrap();
                    cached.send(()).unwrap();
                    // Alive (its cache with it) until the test lets go.
                    let _ = done.recv();
                });
                wait_cached.recv().unwrap();
                *self.helper.lock() = Some(helper);
            }
            Some(OnSync::Fail) => {
                self.host.synchronize()?;
                return Err(UpstreamError::Other(999));
            }
            None => {}
        }
        self.host.synchronize()
    }
}

fn pool(config: PoolConfig) -> Arc<Pool> {
    pool_of(1 << 30, config)
}

/// A pool over an upstream of `capacity` bytes.
fn pool_of(capacity: usize, config: PoolConfig) -> Arc<Pool> {
    with_arenas(CachingPool::new(HostUpstream::new(capacity), UsingThePool::default(), config))
}

/// Lets the pool's ordering reach the pool.
fn with_arenas(pool: Pool) -> Arc<Pool> {
    let pool = Arc::new(pool);
    pool.ordering().pool.set(Arc::downgrade(&pool)).unwrap();
    pool
}

/// Joins the helpers of `AllocateAndFreeIfUnlocked` (four of them) and asserts that each
/// finished within its wait: none waited for a lock `who` (the trim, the ladder) held.
fn assert_helpers_went_on(pool: &Pool, who: &str) {
    let helpers = std::mem::take(&mut *pool.ordering().helpers.lock());
    let in_time: Vec<bool> = helpers.into_iter().map(|(h, in_time)| (h.join().unwrap(), in_time).1).collect();
    assert_eq!(in_time, [true; 4], "a helper waited for the pool's locks: the {who} held them");
}

fn queue(pool: &Pool, on_sync: OnSync) {
    pool.ordering().queued.lock().push_back(on_sync);
}

fn syncs(pool: &Pool) -> u64 {
    pool.ordering().host.synchronizations()
}

/// `release` (trim or synchronize, with a configuration that makes it release) waits for the
/// ordering while a helper allocates and frees on stream 1: its free lands during the first
/// synchronisation, so a second one covers it before the segment goes.
fn releases_after_a_second_synchronisation(
    config: PoolConfig,
    release: fn(&Pool) -> Result<TrimReport, PoolError>,
) {
    let pool = pool(config);
    let a = pool.allocate(1 << 20, 512, 1).unwrap();
    pool.free(a, 1).unwrap();
    queue(&pool, OnSync::AllocateAndFree);
    let report = release(&pool).unwrap();
    assert_eq!(syncs(&pool), 2);
    assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20));
    assert_eq!((pool.upstream().live_bytes(), pool.stats().reserved_bytes), (0, 0));
    pool.validate().unwrap();
}

#[test]
fn trim_synchronises_with_no_lock_held() {
    within_watchdog("a trim whose synchronisation needs stream 1's arena", || {
        releases_after_a_second_synchronisation(PoolConfig::default(), |pool| pool.trim());
    });
}

#[test]
fn synchronize_synchronises_with_no_lock_held() {
    within_watchdog("a synchronize whose synchronisation needs stream 1's arena", || {
        let config = PoolConfig { release_threshold: 0, ..PoolConfig::default() };
        releases_after_a_second_synchronisation(config, |pool| pool.synchronize());
    });
}

#[test]
fn a_free_during_the_wait_is_not_released_without_another_synchronisation() {
    within_watchdog("a trim whose synchronisation frees into stream 1's arena", || {
        let pool = pool(PoolConfig::default());
        // Two 2 MiB segments: s1 = [a1, a2], s2 = [c1, c2].
        let a1 = pool.allocate(1 << 20, 512, 1).unwrap();
        let a2 = pool.allocate(1 << 20, 512, 1).unwrap();
        let c1 = pool.allocate(1 << 20, 512, 1).unwrap();
        let c2 = pool.allocate(1 << 20, 512, 1).unwrap();
        assert_eq!(pool.stats().reserved_bytes, 4 << 20);
        pool.free(c1, 1).unwrap();
        pool.free(c2, 1).unwrap();
        pool.free(a1, 1).unwrap();
        // s2 is releasable when the trim starts; a2's free during its synchronisation makes s1
        // free too, but a2's work may have been queued after that synchronisation started. The
        // synchronisation that would cover it fails: nothing may be released.
        queue(&pool, OnSync::Free(a2, 1));
        queue(&pool, OnSync::Fail);
        match pool.trim() {
            Err(PoolError::Ordering(UpstreamError::Other(999))) => {}
            other => panic!("expected the second synchronisation's failure, got {other:?}"),
        }
        assert_eq!(syncs(&pool), 2);
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.cached_bytes, stats.current_bytes), (4 << 20, 4 << 20, 0));
        assert_eq!(pool.upstream().live_bytes(), 4 << 20);
        pool.validate().unwrap();
        // Once a synchronisation follows the free, both segments go.
        let report = pool.trim().unwrap();
        assert_eq!((report.released_segments, report.released_bytes), (2, 4 << 20));
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

#[test]
fn a_block_freed_into_a_thread_cache_during_the_wait_is_not_released() {
    within_watchdog("a trim whose synchronisation allocates on stream 1", || {
        let pool = pool(PoolConfig::default());
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        // The segment is free when the trim starts; during its synchronisation a thread takes
        // 4 KiB of it and keeps them in its thread cache (no arena sees that free).
        let (done, stay) = std::sync::mpsc::channel();
        queue(&pool, OnSync::CacheInAThread(stay));
        let report = pool.trim().unwrap();
        assert_eq!(syncs(&pool), 1);
        assert_eq!(report, Default::default());
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.current_bytes), (2 << 20, 0));
        assert_eq!(pool.upstream().live_bytes(), 2 << 20);
        // The thread exits; the next trim finds its cache, and the whole segment goes.
        drop(done);
        pool.ordering().helper.lock().take().unwrap().join().unwrap();
        let report = pool.trim().unwrap();
        assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20));
        assert_eq!(pool.upstream().live_bytes(), 0);
        pool.validate().unwrap();
    });
}

/// Frees that land during every synchronisation (other threads allocating and freeing all along)
/// do not keep a trim waiting, nor make it wait under the pool's locks: after four races it
/// releases nothing and returns; a later trim, with the traffic paused, releases.
#[test]
fn a_trim_racing_frees_all_along_releases_nothing_and_ends() {
    within_watchdog("a trim racing a free during every synchronisation", || {
        let pool = pool(PoolConfig::default());
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        for _ in 0..20 {
            queue(&pool, OnSync::AllocateAndFreeIfUnlocked);
        }
        // The pool's events about the race are logged with no lock held: a subscriber may read
        // its stats (which take the arena locks) from inside them.
        let (seen, reader) = (Arc::new(Mutex::new(Vec::new())), Arc::downgrade(&pool));
        let subscriber = OnEvent({
            let seen = seen.clone();
            move |e: &tracing::Event<'_>| {
                let message = event_message(e);
                if message.starts_with("memory freed into the pool") {
                    let pool = reader.upgrade().expect("the pool is alive");
                    seen.lock().push((message, pool.stats().reserved_bytes));
                }
            }
        });
        let report = cumem_sys::testing::with_subscriber(subscriber, || pool.trim()).unwrap();
        assert_eq!(syncs(&pool), 4, "four synchronisations, each raced by a free");
        let seen = std::mem::take(&mut *seen.lock());
        assert_eq!(seen.len(), 4, "three retries and the give-up: {seen:?}");
        assert!(seen[3].0.ends_with("releasing nothing"), "{seen:?}");
        assert_eq!(report, TrimReport::default(), "nothing is known to be safe to release");
        assert_eq!(pool.stats().reserved_bytes, 2 << 20);
        assert_helpers_went_on(&pool, "trim");
        pool.ordering().queued.lock().clear();
        let report = pool.trim().unwrap();
        assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20));
        assert_eq!((pool.upstream().live_bytes(), pool.stats().reserved_bytes), (0, 0));
        pool.validate().unwrap();
    });
}

/// A pool over 5 MiB whose stream 1 caches a free 2 MiB small segment: a 4 MiB request on stream
/// 2 (a large one, which no small segment serves) can grow only after the ladder has released the
/// small segment.
fn ladder_pool() -> Arc<Pool> {
    let pool = pool_of(5 << 20, PoolConfig::default());
    let a = pool.allocate(1 << 20, 512, 1).unwrap();
    pool.free(a, 1).unwrap();
    assert_eq!(pool.upstream().live_bytes(), 2 << 20);
    pool
}

#[test]
fn a_ladder_synchronises_with_no_lock_held() {
    within_watchdog("a ladder whose synchronisation needs stream 1's arena", || {
        let pool = ladder_pool();
        // During the ladder's first synchronisation a helper allocates and frees on stream 1:
        // the free lands meanwhile, so a second synchronisation covers it before the release.
        queue(&pool, OnSync::AllocateAndFree);
        let big = pool.allocate(4 << 20, 512, 2).unwrap();
        assert_eq!(syncs(&pool), 2);
        assert_eq!(pool.stats().oom_ladders, 1);
        assert_eq!(pool.upstream().live_bytes(), 4 << 20, "the small segment was released");
        pool.free(big, 2).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

/// Frees that land during each of the ladder's synchronisations leave no cached memory known to
/// be safe for its stream: after four races it releases nothing and only asks the upstream,
/// which is full here, so it reports out of memory, having never waited under the pool's locks.
#[test]
fn a_ladder_racing_frees_all_along_only_grows() {
    within_watchdog("a ladder racing a free during every synchronisation", || {
        let pool = ladder_pool();
        for _ in 0..4 {
            queue(&pool, OnSync::AllocateAndFreeIfUnlocked);
        }
        match pool.allocate(4 << 20, 512, 2) {
            Err(PoolError::OutOfMemory { requested, .. }) => assert_eq!(requested, 4 << 20),
            other => panic!("expected out of memory, got {other:?}"),
        }
        assert_eq!(syncs(&pool), 4, "four synchronisations, each raced by a free");
        assert_helpers_went_on(&pool, "ladder");
        let stats = pool.stats();
        assert_eq!((stats.oom_ladders, stats.oom_errors, stats.reserved_bytes), (1, 1, 2 << 20));
        // With the traffic paused, the same request succeeds.
        let big = pool.allocate(4 << 20, 512, 2).unwrap();
        assert_eq!(pool.upstream().live_bytes(), 4 << 20);
        pool.free(big, 2).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

/// A block stranded while a trim synchronises (its free, on a stream without an arena, could not
/// be ordered) may be under work queued after that synchronisation started: the trim leaves it
/// stranded, and its segment cached; the next trim's synchronisation returns it to the cache and
/// releases the segment.
#[test]
fn a_block_stranded_during_the_wait_stays_stranded() {
    within_watchdog("a trim whose synchronisation strands a block", || {
        // One stream arena: stream 3 shares stream 1's, and its frees synchronise (this ordering
        // retires no stream).
        let config = PoolConfig::default();
        let up = HostUpstream::new(1 << 30);
        let pool = with_arenas(CachingPool::with_stream_arenas(up, UsingThePool::default(), config, 1));
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        let big = pool.allocate(4 << 20, 512, 3).unwrap();
        let segments_before = pool.segments().len();
        pool.free(a, 1).unwrap();
        // The trim's synchronisation: another thread frees `big` on stream 3, whose own
        // synchronisation fails, so `big` is stranded; then the trim's succeeds.
        queue(&pool, OnSync::Free(big, 3));
        queue(&pool, OnSync::Fail);
        let report = pool.trim().unwrap();
        assert_eq!(syncs(&pool), 2, "the strand's failed synchronisation, then the trim's");
        assert_eq!((report.released_segments, report.released_bytes), (1, 2 << 20), "the small segment");
        let stats = pool.stats();
        assert_eq!((stats.stranded_bytes, stats.current_bytes), (4 << 20, 0));
        assert_eq!(pool.segments().len(), segments_before - 1, "big's segment stays");
        // A 4 MiB request takes a 20 MiB segment (the growth policy's size for 1–10 MiB).
        let kept = pool.upstream().live_bytes();
        assert_eq!(kept, 20 << 20);
        pool.validate().unwrap();
        // The next trim synchronises after the strand: the block is back, its segment released.
        let report = pool.trim().unwrap();
        assert_eq!(syncs(&pool), 3);
        assert_eq!((report.released_segments, report.released_bytes), (1, kept));
        assert_eq!((pool.stats().stranded_bytes, pool.upstream().live_bytes()), (0, 0));
        pool.validate().unwrap();
    });
}

/// Two ladders at once: one runs whole while the other synchronises. Its consolidation (every
/// cached range re-inserted, merged across arenas) and its take put nothing into the pool that
/// may be under work: the other does not synchronise again for them, and both are served from
/// cached memory.
#[test]
fn a_ladder_does_not_take_another_ladders_consolidation_for_a_race() {
    within_watchdog("two ladders at once", || {
        // Two 2 MiB small segments fill the upstream, each cached in halves by streams 1 and 4.
        let pool = pool_of(4 << 20, PoolConfig::default());
        let blocks: Vec<Block> = (0..4).map(|_| pool.allocate(1 << 20, 512, 1).unwrap()).collect();
        assert_eq!(pool.upstream().live_bytes(), 4 << 20);
        for (i, b) in blocks.into_iter().enumerate() {
            pool.free(b, if i % 2 == 0 { 1 } else { 4 }).unwrap();
        }
        // 1.5 MiB fits in no cached range and the upstream is full: only a ladder's
        // consolidation serves it. Stream 3's ladder runs during stream 2's synchronisation.
        let (tx, rx) = std::sync::mpsc::channel();
        queue(&pool, OnSync::Allocate(3 << 19, 3, tx));
        let b = pool.allocate(3 << 19, 512, 2).unwrap();
        let a = rx.recv().unwrap();
        assert_eq!(syncs(&pool), 2, "one synchronisation per ladder");
        let stats = pool.stats();
        assert_eq!((stats.oom_ladders, stats.oom_errors, stats.reserved_bytes), (2, 0, 4 << 20));
        assert_ne!(a.addr() >> 21, b.addr() >> 21, "one segment each");
        pool.free(a, 3).unwrap();
        pool.free(b, 2).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

/// With expandable segments a ladder whose every synchronisation races a free reports out of
/// memory: its growth would join cached ranges that may be under work queued meanwhile.
#[test]
fn an_expandable_ladder_racing_frees_all_along_reports_out_of_memory() {
    within_watchdog("an expandable ladder racing a free during every synchronisation", || {
        let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
        let pool = pool_of(5 << 20, config);
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let mapped = pool.upstream().live_bytes();
        for _ in 0..4 {
            queue(&pool, OnSync::AllocateAndFreeIfUnlocked);
        }
        match pool.allocate(4 << 20, 512, 2) {
            Err(PoolError::OutOfMemory { requested, .. }) => assert_eq!(requested, 4 << 20),
            other => panic!("expected out of memory, got {other:?}"),
        }
        assert_eq!(syncs(&pool), 4);
        assert_helpers_went_on(&pool, "ladder");
        assert_eq!(pool.upstream().live_bytes(), mapped, "nothing mapped or unmapped");
        // With the traffic paused, the same request succeeds.
        let big = pool.allocate(4 << 20, 512, 2).unwrap();
        pool.free(big, 2).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

/// Growth maps fresh memory, on which nothing is queued: an expandable trim during each of whose
/// synchronisations another thread grows the pool (and frees nothing) takes none for a race, and
/// releases the free chunk.
#[test]
fn an_expandable_trim_is_not_raced_by_growth() {
    within_watchdog("an expandable trim while another thread grows", || {
        let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
        let pool = pool(config);
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        assert_eq!(pool.upstream().live_bytes(), 2 << 20, "one chunk mapped, free");
        // 3 MiB fits in no cached range: stream 3 grows each time.
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..4 {
            queue(&pool, OnSync::Allocate(3 << 20, 3, tx.clone()));
        }
        drop(tx);
        let report = pool.trim().unwrap();
        assert_eq!(syncs(&pool), 1, "the growth during it was no race");
        assert_eq!(report.released_bytes, 2 << 20, "stream 1's free chunk went");
        pool.ordering().queued.lock().clear();
        let grown: Vec<Block> = rx.iter().collect();
        assert_eq!(grown.len(), 1);
        assert_eq!(pool.upstream().live_bytes(), 4 << 20, "the grown block's two chunks");
        for b in grown {
            pool.free(b, 3).unwrap();
        }
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

/// Unmapping whole chunks out of a free range leaves its pieces around the gap cached, moved
/// under every lock after a synchronisation: an expandable trim during whose synchronisation
/// another trim does so takes them for no race (it synchronises once, the other trim once).
#[test]
fn an_expandable_trim_is_not_raced_by_another_trims_unmapping() {
    within_watchdog("an expandable trim while another trim unmaps", || {
        let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
        let pool = pool(config);
        // [0, 3 MiB) live; [3, 8 MiB) freed: chunks [4, 8) can go, the piece [3, 4) stays.
        let kept = pool.allocate(3 << 20, 512, 1).unwrap();
        let b = pool.allocate(5 << 20, 512, 1).unwrap();
        assert_eq!(b.addr(), kept.addr() + (3 << 20));
        pool.free(b, 1).unwrap();
        assert_eq!(pool.upstream().live_bytes(), 8 << 20);
        queue(&pool, OnSync::Trim);
        let report = pool.trim().unwrap();
        assert_eq!(syncs(&pool), 2, "its own and the other trim's, no second one of its own");
        assert_eq!(report, TrimReport::default(), "the other trim unmapped every whole free chunk");
        assert_eq!(pool.upstream().live_bytes(), 4 << 20);
        pool.free(kept, 1).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}
