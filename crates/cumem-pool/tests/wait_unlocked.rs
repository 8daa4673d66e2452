//! The pool orders a stream after another ([`Ordering::wait`]) with no arena lock held: on a
//! device the wait's driver calls block while another thread is in `cuMemFree`, which waits for
//! host functions, and a host function may allocate or free on the stream whose memory is being
//! taken. Here the ordering's `wait` does not return before another thread has allocated and
//! freed on the waited-for stream, standing for such a host function; under a watchdog, since a
//! lock held across the wait hangs rather than fails.

mod common;

use std::sync::{Arc, OnceLock, Weak};

use common::Free;
use cumem_pool::{CachingPool, HostOrdering, HostUpstream, Ordering, PoolConfig, UpstreamError};
use cumem_sys::testing::within_watchdog;
use parking_lot::Mutex;

type Pool = CachingPool<HostUpstream, UsingThePool>;

/// A host ordering whose `wait(waiter, on)` waits for another thread that allocates 4 KiB on `on`
/// and frees it.
#[derive(Default)]
struct UsingThePool {
    host: HostOrdering,
    pool: OnceLock<Weak<Pool>>,
    /// `(waiter, on)` of every wait, and the address each helper thread was served.
    waits: Mutex<Vec<(u32, u32, u64)>>,
}

impl Ordering for UsingThePool {
    type Stream = u32;
    fn wait(&self, waiter: u32, on: u32) -> Result<(), UpstreamError> {
        let pool = self.pool.get().and_then(Weak::upgrade).expect("the pool is alive");
        let served = std::thread::spawn(move || {
            let b = pool.allocate(4096, 512, on).unwrap();
            let addr = b.addr();
            pool.free(b, on).unwrap();
            addr
        })
        .join()
        .unwrap();
        self.waits.lock().push((waiter, on, served));
        self.host.wait(waiter, on)
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.host.synchronize()
    }
}

fn pool(arenas: usize) -> Arc<Pool> {
    let pool = Arc::new(CachingPool::with_stream_arenas(
        HostUpstream::new(1 << 30),
        UsingThePool::default(),
        PoolConfig::default(),
        arenas,
    ));
    pool.ordering().pool.set(Arc::downgrade(&pool)).unwrap();
    pool
}

#[test]
fn migration_waits_with_no_arena_lock_held() {
    within_watchdog("a migration whose wait needs the source stream's arena", || {
        let pool = pool(cumem_pool::STREAM_ARENAS);
        // 1 MiB blocks skip the thread cache: freed into stream 1's arena.
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        let addr = a.addr();
        pool.free(a, 1).unwrap();
        let b = pool.allocate(1 << 20, 512, 2).unwrap();
        assert_eq!(b.addr(), addr, "stream 2 did not migrate stream 1's block");
        let waits = pool.ordering().waits.lock().clone();
        assert_eq!(waits.len(), 1);
        assert_eq!((waits[0].0, waits[0].1), (2, 1));
        // The helper on stream 1 was served the other half of the segment, not the migrated block.
        assert_eq!(waits[0].2, addr + (1 << 20));
        pool.free(b, 2).unwrap();
        pool.validate().unwrap();
        assert_eq!(pool.trim().unwrap().released_bytes, 2 << 20);
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}

#[test]
fn a_stream_sharing_the_first_arena_waits_with_no_arena_lock_held() {
    within_watchdog("a shared-arena allocation whose wait needs that arena", || {
        // One arena: stream 1 has it, stream 2 shares it.
        let pool = pool(1);
        let a = pool.allocate(1 << 20, 512, 1).unwrap();
        let addr = a.addr();
        pool.free(a, 1).unwrap();
        // The segment's free upper half is taken (the freed lower half sits in a bin); the helper
        // on stream 1 gets the lower half's first 4 KiB.
        let b = pool.allocate(1 << 20, 512, 2).unwrap();
        assert_eq!(b.addr(), addr + (1 << 20), "stream 2 did not take the shared arena's memory");
        let waits = pool.ordering().waits.lock().clone();
        assert_eq!(waits.len(), 1);
        assert_eq!((waits[0].0, waits[0].1, waits[0].2), (2, 1, addr));
        pool.free(b, 1).unwrap();
        pool.validate().unwrap();
        assert_eq!(pool.trim().unwrap().released_bytes, 2 << 20);
        assert_eq!(pool.upstream().live_bytes(), 0);
    });
}
