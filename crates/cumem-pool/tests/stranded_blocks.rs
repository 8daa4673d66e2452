//! A block freed on a stream without an arena whose ordering fails cannot be reused by any stream
//! yet: it is counted as cached and stranded (in `stats`, `validate` and `cached_ranges`), no
//! longer live, and goes back to the cache once `trim` has synchronised, so its segment can be
//! released.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use common::Free;
use cumem_pool::{CachingPool, HostUpstream, PoolConfig, UpstreamError};
use serial_test::parallel;

/// An ordering that retires streams and fails to retire any while `failing`.
#[derive(Debug, Default)]
struct FailingRetire {
    failing: AtomicBool,
}

impl cumem_pool::Ordering for FailingRetire {
    type Stream = u32;
    fn wait(&self, _: u32, _: u32) -> Result<(), UpstreamError> {
        Ok(())
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        Ok(())
    }
    fn retired_stream(&self) -> Option<u32> {
        Some(0)
    }
    fn retire(&self, _: u32) -> Result<(), UpstreamError> {
        if self.failing.load(Relaxed) { Err(UpstreamError::Other(999)) } else { Ok(()) }
    }
}

/// Stream 1 holds a 3000-byte block in the only stream arena; stream 2 (no arena: the table is
/// full) frees a 1000-byte block while its ordering fails.
fn strand_one(thread_cache: bool) {
    let config = PoolConfig { thread_cache, ..PoolConfig::default() };
    let pool =
        CachingPool::with_stream_arenas(HostUpstream::new(1 << 30), FailingRetire::default(), config, 1);
    let kept = pool.allocate(3000, 256, 1).unwrap();
    let freed = pool.allocate(1000, 256, 2).unwrap();
    let freed_addr = freed.addr();
    pool.ordering().failing.store(true, Relaxed);
    pool.free(freed, 2).unwrap();
    // Flushes the thread caches: the block reaches the pool's books here at the latest.
    pool.validate().unwrap();
    let s = pool.stats();
    assert_eq!((s.current_bytes, s.current_count), (3072, 1), "the freed block is not live");
    assert_eq!(s.stranded_bytes, 1024);
    assert_eq!(s.cached_bytes, s.reserved_bytes - 3072);
    assert!(pool.cached_ranges().contains(&(freed_addr, 1024)), "{:?}", pool.cached_ranges());
    // Nothing may reuse it before a synchronisation: a new block of its size lands elsewhere.
    let again = pool.allocate(1000, 256, 1).unwrap();
    assert_ne!(again.addr(), freed_addr);
    pool.free(again, 1).unwrap();
    assert_eq!(pool.stats().stranded_bytes, 1024);

    // The ordering works again; a trim synchronises, which makes the block safe for every stream.
    pool.ordering().failing.store(false, Relaxed);
    pool.free(kept, 1).unwrap();
    pool.trim().unwrap();
    pool.validate().unwrap();
    let s = pool.stats();
    assert_eq!((s.stranded_bytes, s.current_bytes, s.reserved_bytes, s.cached_bytes), (0, 0, 0, 0));
    assert_eq!(pool.upstream().live_bytes(), 0, "every segment went back");
    assert!(pool.upstream().violations().is_empty(), "{:?}", pool.upstream().violations());
}

#[test]
#[parallel]
fn a_thread_cached_block_whose_stream_cannot_be_ordered_is_stranded_then_reclaimed() {
    strand_one(true);
}

#[test]
#[parallel]
fn a_freed_block_whose_stream_cannot_be_ordered_is_stranded_then_reclaimed() {
    strand_one(false);
}
