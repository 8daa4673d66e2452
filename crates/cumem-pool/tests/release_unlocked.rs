//! Segments go back to the upstream with no pool lock held: `cuMemFree` waits for the whole device,
//! host functions included, and a host function may be using the pool. Here the upstream's
//! `deallocate` itself allocates from the pool and frees, standing for such a host function; under
//! a watchdog, since a lock held across the call hangs rather than fails.

mod common;

use std::sync::{Arc, OnceLock, Weak};

use common::Free;
use cumem_pool::{
    CachingPool, ExpandableUpstream, HostOrdering, HostUpstream, PoolConfig, Upstream, UpstreamError,
};
use cumem_sys::testing::within_watchdog;
use parking_lot::Mutex;

type Pool = CachingPool<UsingThePool, HostOrdering>;

/// A host upstream whose `deallocate` uses the pool it serves (on stream 9) before it returns.
struct UsingThePool {
    host: HostUpstream,
    pool: OnceLock<Weak<Pool>>,
    /// The address of each block the pool served from inside a `deallocate`.
    served: Mutex<Vec<u64>>,
}

impl Upstream for UsingThePool {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        if let Some(pool) = self.pool.get().and_then(Weak::upgrade) {
            let b = pool.allocate(4096, 512, 9).unwrap();
            self.served.lock().push(b.addr());
            pool.free(b, 9).unwrap();
        }
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for UsingThePool {}

fn pool(capacity: usize, config: PoolConfig) -> Arc<Pool> {
    let up =
        UsingThePool { host: HostUpstream::new(capacity), pool: OnceLock::new(), served: Mutex::new(vec![]) };
    let pool = Arc::new(CachingPool::new(up, HostOrdering::new(), config));
    pool.upstream().pool.set(Arc::downgrade(&pool)).unwrap();
    pool
}

#[test]
fn trim_frees_segments_with_no_lock_held() {
    within_watchdog("an upstream free that uses the pool, from trim", || {
        let pool = pool(1 << 30, PoolConfig::default());
        let big = pool.allocate(4 << 20, 512, 1).unwrap();
        pool.free(big, 1).unwrap();
        let report = pool.trim().unwrap();
        assert_eq!((report.released_segments, report.released_bytes), (1, 20 << 20));
        // The upstream's free was served a block from a new small segment, which stays cached.
        assert_eq!(pool.upstream().served.lock().len(), 1);
        assert_eq!(pool.stats().reserved_bytes, 2 << 20);
        pool.validate().unwrap();
    });
}

#[test]
fn the_release_threshold_frees_segments_with_no_lock_held() {
    within_watchdog("an upstream free that uses the pool, from synchronize", || {
        let config = PoolConfig { release_threshold: 0, ..PoolConfig::default() };
        let pool = pool(1 << 30, config);
        let big = pool.allocate(4 << 20, 512, 1).unwrap();
        pool.free(big, 1).unwrap();
        assert_eq!(pool.synchronize().unwrap().released_bytes, 20 << 20);
        assert_eq!(pool.upstream().served.lock().len(), 1);
        pool.validate().unwrap();
    });
}

#[test]
fn the_out_of_memory_ladder_frees_segments_with_no_lock_held() {
    within_watchdog("an upstream free that uses the pool, from the ladder", || {
        // Room for one 20 MiB segment and a small one: the second stream's 24 MiB request needs
        // the first stream's cached segment released.
        let pool = pool(24 << 20, PoolConfig::default());
        let big = pool.allocate(4 << 20, 512, 1).unwrap();
        pool.free(big, 1).unwrap();
        let larger = pool.allocate(22 << 20, 512, 2).unwrap();
        assert_eq!(pool.stats().oom_ladders, 1);
        assert_eq!(pool.upstream().served.lock().len(), 1);
        pool.free(larger, 2).unwrap();
        pool.validate().unwrap();
    });
}
