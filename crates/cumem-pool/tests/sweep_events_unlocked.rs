//! A sweep that cannot retire a dropped stream warns with no lock of the pool held, on every path
//! that sweeps (trim, synchronize, the out-of-memory ladder, a full arena table): a subscriber
//! that reads the pool's statistics on that warning goes on instead of waiting for itself.

mod common;

use std::sync::Arc;

use common::Free;
use cumem_pool::{CachingPool, HostUpstream, PoolConfig, PoolError, UpstreamError};
use cumem_sys::testing::{self, OnEvent, event_message};
use parking_lot::Mutex;
use serial_test::parallel;

const WARNING: &str = "retiring a dropped stream failed; kept";

/// An ordering that retires streams, in which stream 7 was dropped and cannot be retired.
#[derive(Debug, Default)]
struct RetireFails;

impl cumem_pool::Ordering for RetireFails {
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
    fn orphans(&self) -> Vec<u32> {
        vec![7]
    }
    fn retire(&self, stream: u32) -> Result<(), UpstreamError> {
        if stream == 7 { Err(UpstreamError::Other(999)) } else { Ok(()) }
    }
}

type Pool = CachingPool<HostUpstream, RetireFails>;

/// Runs `work` on `pool` under a subscriber that reads the pool's statistics on each warning, within
/// the watchdog; returns the `current_bytes` each warning saw.
fn stats_on_each_warning(what: &'static str, pool: Pool, work: fn(&Pool)) -> Vec<u64> {
    let pool = Arc::new(pool);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = {
        let (pool, seen) = (pool.clone(), seen.clone());
        OnEvent(move |event: &tracing::Event<'_>| {
            if event_message(event) == WARNING {
                seen.lock().push(pool.stats().current_bytes);
            }
        })
    };
    testing::within_watchdog(what, move || {
        cumem_sys::testing::with_subscriber(subscriber, || work(&pool));
        pool.validate().unwrap();
        assert!(pool.upstream().violations().is_empty(), "{:?}", pool.upstream().violations());
    });
    seen.lock().clone()
}

/// One 3000-byte block live on stream 1, one freed on the dropped stream 7.
fn one_live_one_freed(pool: &Pool) -> cumem_pool::Block {
    let live = pool.allocate(3000, 256, 1).unwrap();
    let freed = pool.allocate(1000, 256, 7).unwrap();
    pool.free(freed, 7).unwrap();
    live
}

#[test]
#[parallel]
fn trim() {
    let pool = CachingPool::new(HostUpstream::new(1 << 30), RetireFails, PoolConfig::default());
    let seen = stats_on_each_warning("a trim whose sweep failed", pool, |pool| {
        let live = one_live_one_freed(pool);
        pool.trim().unwrap();
        pool.free(live, 1).unwrap();
    });
    assert_eq!(seen, [3072], "one warning, with the live block counted");
}

#[test]
#[parallel]
fn synchronize() {
    let config = PoolConfig { release_threshold: 0, ..PoolConfig::default() };
    let pool = CachingPool::new(HostUpstream::new(1 << 30), RetireFails, config);
    let seen = stats_on_each_warning("a synchronize whose sweep failed", pool, |pool| {
        let live = one_live_one_freed(pool);
        pool.synchronize().unwrap();
        pool.free(live, 1).unwrap();
    });
    assert_eq!(seen, [3072]);
}

#[test]
#[parallel]
fn out_of_memory_ladder() {
    let pool = CachingPool::new(HostUpstream::new(4 << 20), RetireFails, PoolConfig::default());
    let seen = stats_on_each_warning("a ladder whose sweep failed", pool, |pool| {
        let live = one_live_one_freed(pool);
        let err = pool.allocate(8 << 20, 256, 1).unwrap_err();
        assert!(matches!(err, PoolError::OutOfMemory { requested, .. } if requested == 8 << 20), "{err:?}");
        pool.free(live, 1).unwrap();
    });
    assert_eq!(seen, [3072]);
}

#[test]
#[parallel]
fn a_new_stream_in_a_full_table() {
    // One arena for streams (and one for retired ones): stream 2 finds the table full.
    let pool =
        CachingPool::with_stream_arenas(HostUpstream::new(1 << 30), RetireFails, PoolConfig::default(), 1);
    let seen = stats_on_each_warning("a full table's sweep that failed", pool, |pool| {
        let live = pool.allocate(3000, 256, 1).unwrap();
        let other = pool.allocate(5000, 256, 2).unwrap();
        assert_eq!(other.size(), 5000);
        pool.free(other, 2).unwrap();
        pool.free(live, 1).unwrap();
    });
    assert!(!seen.is_empty(), "the full table swept");
    assert_eq!(seen[0], 3072, "the first sweep ran before stream 2's block was counted");
}
