//! A stream beyond the arena table shares the first arena: it may take that arena's memory only
//! after waiting for its stream. Memory that enters the arena while such a stream grows the pool
//! (a free on the arena's stream after the wait) must not be handed to it without another wait.
//! Checked on the vector-clock model, with segments and with expandable segments.

mod common;

use std::sync::{Arc, OnceLock, Weak};

use common::{CheckedUpstream, Clock, Free, ModelOrdering};
use cumem_pool::{Block, CachingPool, ExpandableUpstream, HostUpstream, PoolConfig, Upstream, UpstreamError};
use cumem_sys::testing::within_watchdog;
use parking_lot::Mutex;

type Hook = Box<dyn FnOnce() + Send>;

/// [`CheckedUpstream`] that runs a hook, once, on the first call it gets after being armed: how a
/// test makes another thread's free land while an allocation is between its wait and its growth,
/// deterministically (the pool holds no lock when it first asks its upstream anything there).
///
/// With `until_ladder` set, it refuses memory until that pool's out-of-memory ladder runs, and the
/// hook runs only from an allocation (so in the ladder's growth, which holds no lock).
struct HookedUpstream {
    inner: CheckedUpstream,
    hook: Mutex<Option<Hook>>,
    until_ladder: OnceLock<Weak<Pool>>,
}

impl HookedUpstream {
    fn fire(&self) {
        let hook = self.hook.lock().take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

impl Upstream for HookedUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        if let Some(pool) = self.until_ladder.get().and_then(Weak::upgrade)
            && pool.stats().oom_ladders == 0
        {
            return Err(UpstreamError::OutOfMemory);
        }
        self.fire();
        self.inner.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.inner.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        if self.until_ladder.get().is_none() {
            self.fire();
        }
        self.inner.expandable()
    }
}

// SAFETY: hands out its `CheckedUpstream`'s addresses only.
unsafe impl common::HostModel for HookedUpstream {}

type Pool = CachingPool<HookedUpstream, ModelOrdering>;

/// A pool whose one arena is stream 0's: every other stream shares it.
fn one_arena_pool(config: PoolConfig) -> (Arc<Pool>, Arc<Mutex<Clock>>) {
    let clock = Arc::new(Mutex::new(Clock::default()));
    let up = HookedUpstream {
        inner: CheckedUpstream { host: HostUpstream::new(1 << 30), clock: clock.clone() },
        hook: Mutex::new(None),
        until_ladder: OnceLock::new(),
    };
    (Arc::new(CachingPool::with_stream_arenas(up, ModelOrdering(clock.clone()), config, 1)), clock)
}

fn alloc(pool: &Pool, clock: &Mutex<Clock>, bytes: usize, stream: u8) -> Block {
    let b = pool.allocate(bytes, 512, stream).unwrap();
    clock.lock().record_alloc(b.addr(), b.rounded_size() as u64, stream);
    b
}

fn free(pool: &Pool, clock: &Mutex<Clock>, b: Block, stream: u8) {
    clock.lock().record_free(b.addr(), b.rounded_size() as u64, stream);
    pool.free(b, stream).unwrap();
}

/// Stream 0 holds `x` (and `rest`, so that its arena is empty); stream 1 asks for `x`'s size, and
/// stream 0 frees `x` just after stream 1 waited for it and before stream 1 grows the pool.
/// The pool's books hold, and once trimmed nothing is left upstream and nothing was misused.
fn ends_clean(pool: &Pool, clock: &Mutex<Clock>) {
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().inner.host.live_bytes(), 0);
    assert!(pool.upstream().inner.host.violations().is_empty());
    assert!(clock.lock().violations.is_empty());
}

/// `waits`: whether stream 1 must wait for stream 0 (to grow an expandable segment, which joins
/// the arena's free ranges; a new plain segment needs no wait, and the arena has nothing to take
/// before the free).
fn free_lands_while_a_sharing_stream_grows(
    config: PoolConfig,
    x_bytes: usize,
    rest_bytes: usize,
    waits: bool,
) {
    let (pool, clock) = one_arena_pool(config);
    let x = alloc(&pool, &clock, x_bytes, 0);
    let rest = (rest_bytes > 0).then(|| alloc(&pool, &clock, rest_bytes, 0));
    let x_addr = x.addr();
    let (p, c) = (Arc::downgrade(&pool), clock.clone());
    *pool.upstream().hook.lock() = Some(Box::new(move || {
        let pool = p.upgrade().unwrap();
        free(&pool, &c, x, 0);
    }));
    let waits_before = clock.lock().waits;
    let t = alloc(&pool, &clock, x_bytes, 1);
    assert!(pool.upstream().hook.lock().is_none(), "the hook ran during the allocation");
    assert_eq!(clock.lock().waits > waits_before, waits, "whether the sharing stream waited for stream 0");
    let violations = clock.lock().violations.clone();
    assert!(violations.is_empty(), "stream 1 got {:#x} (x at {x_addr:#x}): {violations:#?}", t.addr());
    free(&pool, &clock, t, 1);
    if let Some(rest) = rest {
        free(&pool, &clock, rest, 0);
    }
    ends_clean(&pool, &clock);
}

#[test]
fn a_sharing_stream_takes_no_block_freed_after_its_wait_from_a_segment() {
    // A 20 MiB segment: x is 4 MiB, the other 16 MiB stay live. The new segment is 20 MiB, so a
    // best fit over the whole arena would prefer x.
    free_lands_while_a_sharing_stream_grows(PoolConfig::default(), 4 << 20, 16 << 20, false);
}

#[test]
fn a_sharing_stream_grows_no_expandable_segment_into_a_block_freed_after_its_wait() {
    // x fills the first 2 MiB chunk; growth from the gap above it would start at x's free range.
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    free_lands_while_a_sharing_stream_grows(config, 2 << 20, 0, true);
}

/// The ladder grows with no lock held, then serves the request: for a sharing stream only from the
/// new segment. Stream 0 frees an exact fit for the request during that growth, after the ladder's
/// synchronisation and the sharing stream's wait; a best fit over the arena would take it.
#[test]
fn the_ladder_serves_a_sharing_stream_only_from_its_new_segment() {
    let (pool, clock) = one_arena_pool(PoolConfig::default());
    // A 20 MiB segment all live: x (3 MiB) and the rest. The ladder's minimal segment is 4 MiB, so
    // x is the better fit for a 3 MiB request.
    let x = alloc(&pool, &clock, 3 << 20, 0);
    let rest = alloc(&pool, &clock, 17 << 20, 0);
    let x_addr = x.addr();
    let (p, c) = (Arc::downgrade(&pool), clock.clone());
    *pool.upstream().hook.lock() = Some(Box::new(move || {
        let pool = p.upgrade().unwrap();
        free(&pool, &c, x, 0);
    }));
    pool.upstream().until_ladder.set(Arc::downgrade(&pool)).unwrap();
    let t = alloc(&pool, &clock, 3 << 20, 1);
    assert!(pool.upstream().hook.lock().is_none(), "the hook ran during the ladder's growth");
    assert_eq!(pool.stats().oom_ladders, 1);
    let violations = clock.lock().violations.clone();
    assert!(violations.is_empty(), "stream 1 got {:#x} (x at {x_addr:#x}): {violations:#?}", t.addr());
    assert_ne!(t.addr(), x_addr);
    free(&pool, &clock, t, 1);
    free(&pool, &clock, rest, 0);
    ends_clean(&pool, &clock);
}

/// [`ModelOrdering`] that runs a hook, once, just after the first wait it records: how a test
/// makes a free land in the shared arena between a sharing stream's wait (which the pool makes
/// with no lock held) and the growth that follows it.
struct HookedOrdering {
    inner: ModelOrdering,
    hook: Mutex<Option<Hook>>,
}

impl cumem_pool::Ordering for HookedOrdering {
    type Stream = u8;
    fn wait(&self, waiter: u8, on: u8) -> Result<(), UpstreamError> {
        self.inner.wait(waiter, on)?;
        let hook = self.hook.lock().take();
        if let Some(hook) = hook {
            hook();
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.inner.synchronize()
    }
}

/// A sharing stream grows an expandable segment after waiting, with no lock held, for the arena's
/// stream; stream 0 frees `x` (whose range the growth would join) just after that wait. The pool
/// must see the free when it locks the arena again and wait once more: the model reports any
/// memory stream 1 gets without being ordered after its free.
#[test]
fn a_free_between_a_sharing_streams_unlocked_wait_and_its_growth_is_waited_for_again() {
    // A wait under the arena lock would deadlock the hook (the same thread frees into that
    // arena): a failure, not a hang.
    within_watchdog("a growth whose unlocked wait sees a free into its arena", || {
        let clock = Arc::new(Mutex::new(Clock::default()));
        let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
        let ordering = HookedOrdering { inner: ModelOrdering(clock.clone()), hook: Mutex::new(None) };
        let up = CheckedUpstream { host: HostUpstream::new(1 << 30), clock: clock.clone() };
        let pool = Arc::new(CachingPool::with_stream_arenas(up, ordering, config, 1));
        let alloc = |bytes: usize, stream: u8| {
            let b = pool.allocate(bytes, 512, stream).unwrap();
            clock.lock().record_alloc(b.addr(), b.rounded_size() as u64, stream);
            b
        };
        // x fills the first 2 MiB chunk of stream 0's segment; growth from the gap above it would
        // start at x's free range.
        let x = alloc(2 << 20, 0);
        let x_addr = x.addr();
        let (p, c) = (Arc::downgrade(&pool), clock.clone());
        *pool.ordering().hook.lock() = Some(Box::new(move || {
            let pool = p.upgrade().unwrap();
            c.lock().record_free(x.addr(), x.rounded_size() as u64, 0);
            pool.free(x, 0).unwrap();
        }));
        let waits_before = clock.lock().waits;
        let t = alloc(2 << 20, 1);
        assert!(pool.ordering().hook.lock().is_none(), "the hook ran during the allocation");
        assert!(clock.lock().waits >= waits_before + 2, "stream 1 waited again after the free");
        let violations = clock.lock().violations.clone();
        assert!(violations.is_empty(), "stream 1 got {:#x} (x at {x_addr:#x}): {violations:#?}", t.addr());
        clock.lock().record_free(t.addr(), t.rounded_size() as u64, 1);
        pool.free(t, 1).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().host.live_bytes(), 0);
        assert!(pool.upstream().host.violations().is_empty());
        assert!(clock.lock().violations.is_empty());
    });
}
