//! With expandable segments, `trim` unmaps free chunks with no lock of the pool held: an unmap
//! may take long (the host model's upstream below takes 200 ms per chunk), and must not keep other
//! threads from allocating, growing and freeing meanwhile (a host function that uses the pool on a
//! stream the unmap waited for would deadlock). On the host, an upstream whose `unmap` reads the
//! pool (standing for such a host function) sees the chunks out of the books, in
//! `returning_bytes`, and the pool consistent, from `trim` and from the out-of-memory ladder, under
//! a watchdog, since a lock held across the call hangs rather than fails. On the device, a trim
//! while a stream the pool never used is held waits for nothing: cumem waits only for the chunks'
//! users, and `cuMemUnmap` waits for no unrelated stream (observed on an H100, 2026-11-24; the
//! simulator's unmap drained every device before that and is honest since). The device test holds
//! a stream, so it is `#[serial]` and the others `#[parallel]`.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use cumem_core::{Context, Device, DeviceBuffer, Stream};
use cumem_pool::{
    CachingPool, CachingResource, ExpandableUpstream, HostOrdering, HostUpstream, PoolConfig, TrimReport,
    Upstream, UpstreamError,
};
use cumem_sys::testing;
use cumem_sys::testing::within_watchdog;
use parking_lot::Mutex;
use serial_test::{parallel, serial};

mod common;
mod gate;

use common::{Free, HostModel};

fn vmm_ctx() -> Option<Context> {
    testing::init();
    let device = Device::get(0).unwrap();
    let found = device.capabilities().unwrap().virtual_memory.then(|| device.context().unwrap());
    if found.is_none() {
        testing::skip("device 0 has no virtual memory management");
    }
    found
}

/// The device's chunk: the recommended granularity (what the pool maps).
fn chunk(ctx: &Context) -> u64 {
    cumem_vmm::Granularity::of(ctx.device()).unwrap().recommended as u64
}

/// An expandable pool with a whole free chunk cached on stream P, between live blocks at `base`
/// and `base + 21c/8` (`c`: the chunk), while a stream H that the pool never used is held: `trim`
/// runs on one thread and `on_p(pool, P, c)` on another, once the trim's unmap started; the trim
/// must return before H is let go (it has no reason to wait for H). `check(pool, c, base, answer,
/// report)` gets what `on_p` returned within 2 s, before H was let go (a timeout: it waited), and
/// the trim's report; then the pool is checked and emptied, and the simulator must have seen no
/// violation and nothing left alive.
fn while_a_trim_unmaps<T: Send + 'static>(
    on_p: impl FnOnce(&Arc<CachingResource>, &Stream, u64) -> T + Send + 'static,
    check: impl FnOnce(&CachingResource, u64, u64, Result<T, mpsc::RecvTimeoutError>, TrimReport),
) {
    let Some(ctx) = vmm_ctx() else { return };
    let c = chunk(&ctx);
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(&ctx, config));
    assert!(pool.pool().expandable().is_some());
    let p = Arc::new(Stream::non_blocking(&ctx).unwrap());
    let h = Stream::non_blocking(&ctx).unwrap(); // never used by the pool
    // Large blocks (past the thread cache) back to back on P: [0, 5c/8), [5c/8, 21c/8),
    // [21c/8, 26c/8); four chunks mapped.
    let a = DeviceBuffer::<u8>::new_in(&pool, &p, (5 * c / 8) as usize).unwrap();
    let b = DeviceBuffer::<u8>::new_in(&pool, &p, (2 * c) as usize).unwrap();
    let d = DeviceBuffer::<u8>::new_in(&pool, &p, (5 * c / 8) as usize).unwrap();
    assert_eq!(d.device_ptr(), a.device_ptr() + 21 * c / 8, "one segment: the layout is as planned");
    assert_eq!(pool.stats().reserved_bytes, 4 * c);
    drop(b); // the chunk [c, 2c) is whole and free; pieces of 3c/8 and 5c/8 around it
    let gate = gate::hold(&h);
    let unmaps = testing::sim_control().map_or(0, |ctl| ctl.calls("cuMemUnmap"));
    let trimmer = {
        let (pool, ctx) = (pool.clone(), ctx.clone());
        std::thread::spawn(move || {
            ctx.bind().unwrap();
            pool.trim().unwrap()
        })
    };
    // The trim has reached its unmap (the simulator counts a call as it starts).
    match testing::sim_control() {
        Some(ctl) => until("the trim's unmap started", || ctl.calls("cuMemUnmap") > unmaps),
        None => std::thread::sleep(Duration::from_millis(50)),
    }
    let (done, served) = mpsc::channel();
    let user = {
        let (pool, ctx, p) = (pool.clone(), ctx.clone(), p.clone());
        std::thread::spawn(move || {
            ctx.bind().unwrap();
            // A late answer (the test failed) is dropped with the receiver.
            let _ = done.send(on_p(&pool, &p, c));
        })
    };
    let got = served.recv_timeout(Duration::from_secs(2));
    until("the trim returned while H is held", || trimmer.is_finished());
    gate.release();
    let report = trimmer.join().unwrap();
    user.join().unwrap();
    check(&pool, c, a.device_ptr(), got, report);
    pool.pool().validate().unwrap();
    h.synchronize().unwrap();
    drop((a, d));
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    drop((pool, p, h));
    common::assert_sim_clean();
}

/// On the device, a trim returns while a stream the pool never used is held (the live check: the
/// trim thread finishes before the gate opens), and an allocation on P made once the trim's unmap
/// started is served from the piece above the unmapped chunk. Since `cuMemUnmap` waits for no
/// unrelated stream (the simulator's unmap returns at once here), that allocation cannot be held
/// up by the unmap whether or not a lock of the pool is held across it, so it no longer tests the
/// lock: that property is the host-model tests' below, whose upstream unmap is slow
/// (`trim_unmaps_with_the_chunks_out_of_the_books_and_no_lock_held`,
/// `growth_maps_while_a_slow_trim_unmaps`).
#[test]
#[serial]
fn a_trim_returns_while_a_stream_the_pool_never_used_is_held() {
    let on_p = |pool: &Arc<CachingResource>, p: &Stream, c: u64| {
        // Cached in P's arena (the 5c/8 piece above the chunk), not in any thread cache.
        let x = DeviceBuffer::<u8>::new_in(pool, p, (c / 2 + 4096) as usize).unwrap();
        x.device_ptr()
    };
    while_a_trim_unmaps(on_p, |pool, c, base, got, report| {
        let addr = got.expect("an allocation on P made during a trim, with H held, returns");
        assert!(addr >= base + 2 * c && addr < base + 21 * c / 8, "from the piece above the chunk");
        assert_eq!((report.released_bytes, report.released_segments), (c, 0));
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.returning_bytes), (3 * c, 0));
    });
}

const MIB: u64 = 1 << 20;

type HostPool = CachingPool<Probing, HostOrdering>;

/// What an `unmap` saw of the pool: `reserved_bytes`, `returning_bytes`, `validate`'s answer.
type Seen = (u64, u64, Result<(), String>);

/// A host upstream whose `unmap` reads the pool it serves first, once per call, and then takes
/// `slow` (as a `cuMemUnmap` waiting for the device would).
struct Probing {
    host: HostUpstream,
    pool: OnceLock<Weak<HostPool>>,
    seen: Mutex<Vec<Seen>>,
    slow: Mutex<Duration>,
    /// Whether `unmap` resets the pool's peaks after reading it.
    reset_peaks: AtomicBool,
    /// Bytes the next `unmap` allocates from the pool (on stream 2, freed at once), and what
    /// that allocation answered.
    allocate_in_unmap: Mutex<Option<usize>>,
    allocated_in_unmap: Mutex<Vec<Result<(), cumem_pool::PoolError>>>,
}

impl Upstream for Probing {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        // SAFETY: the caller's contract, forwarded to the model this upstream wraps.
        unsafe { self.host.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        Some(self)
    }
}

impl ExpandableUpstream for Probing {
    fn chunk_bytes(&self) -> usize {
        self.host.chunk_bytes()
    }
    fn reservation_bytes(&self) -> usize {
        self.host.reservation_bytes()
    }
    fn reserve(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.reserve(bytes)
    }
    fn map(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        self.host.map(addr, bytes)
    }
    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<(), UpstreamError> {
        if let Some(pool) = self.pool.get().and_then(Weak::upgrade) {
            let stats = pool.stats();
            let valid = pool.validate();
            self.seen.lock().push((stats.reserved_bytes, stats.returning_bytes, valid));
            if self.reset_peaks.load(Relaxed) {
                pool.reset_peaks();
            }
            let bytes = self.allocate_in_unmap.lock().take();
            if let Some(bytes) = bytes {
                let got = pool.allocate(bytes, 512, 2).map(|b| pool.free(b, 2).unwrap());
                self.allocated_in_unmap.lock().push(got);
            }
        }
        std::thread::sleep(*self.slow.lock());
        // SAFETY: the caller's contract, forwarded to the model this upstream wraps.
        unsafe { self.host.unmap(addr, bytes) }
    }
    unsafe fn release(&self, base: u64, bytes: usize) {
        // SAFETY: the caller's contract, forwarded to the model this upstream wraps.
        unsafe { self.host.release(base, bytes) }
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl HostModel for Probing {}

/// Polls `cond` until it holds (a failure after 10 s): orders the test's threads without
/// guessing how long another one takes to get somewhere.
fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}: not after 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Trims `pool` on another thread, 200 ms per unmapped chunk, and meanwhile, once the first
/// unmap started, asks for `bytes` on stream 2 (`what` says what failing means): the block, the
/// trim's report, and how many unmaps had started when the allocation returned.
fn allocate_during_a_slow_trim(
    pool: &Arc<HostPool>,
    bytes: usize,
    what: &str,
) -> (cumem_pool::Block, TrimReport, usize) {
    *pool.upstream().slow.lock() = Duration::from_millis(200);
    let trimmer = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.trim().unwrap())
    };
    until("the trim's first unmap started", || !pool.upstream().seen.lock().is_empty());
    let b = pool.allocate(bytes, 512, 2).expect(what);
    let unmaps = pool.upstream().seen.lock().len();
    (b, trimmer.join().unwrap(), unmaps)
}

/// The host model saw no misuse, and the pool's books are consistent.
fn assert_model_clean(pool: &HostPool) {
    assert!(pool.upstream().host.violations().is_empty(), "{:?}", pool.upstream().host.violations());
    pool.validate().unwrap();
}

fn probing_pool(capacity: u64) -> Arc<HostPool> {
    probing_pool_with(capacity, PoolConfig { expandable_segments: true, ..PoolConfig::default() })
}

fn probing_pool_with(capacity: u64, config: PoolConfig) -> Arc<HostPool> {
    let up = Probing {
        host: HostUpstream::new(capacity as usize),
        pool: OnceLock::new(),
        seen: Mutex::new(vec![]),
        slow: Mutex::new(Duration::ZERO),
        reset_peaks: AtomicBool::new(false),
        allocate_in_unmap: Mutex::new(None),
        allocated_in_unmap: Mutex::new(vec![]),
    };
    let pool = Arc::new(CachingPool::new(up, HostOrdering::new(), config));
    pool.upstream().pool.set(Arc::downgrade(&pool)).unwrap();
    pool
}

#[test]
#[parallel]
fn trim_unmaps_with_the_chunks_out_of_the_books_and_no_lock_held() {
    within_watchdog("an unmap that reads the pool, from trim", || {
        let pool = probing_pool(64 * MIB);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let report = pool.trim().unwrap();
        assert_eq!((report.released_bytes, report.released_segments), (6 * MIB, 1));
        // Three chunks, one unmap each, all while the 6 MiB are on their way back.
        let seen = std::mem::take(&mut *pool.upstream().seen.lock());
        assert_eq!(seen, vec![(0, 6 * MIB, Ok(())); 3]);
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.returning_bytes, stats.upstream_frees), (0, 0, 3));
        assert_eq!((pool.upstream().host.live_bytes(), pool.upstream().host.reservations().len()), (0, 0));
        assert_model_clean(&pool);
    });
}

/// Another stream's allocation grows the pool (maps new chunks) while a trim unmaps, slowly,
/// with no lock held: the growth does not wait for the unmaps. (A device form of this test slowed
/// the driver's unmap by holding a stream the pool never used; a GPU's `cuMemUnmap` waits for no
/// such stream, as an H100 showed on 2026-11-24, nor does the simulator's any more, so the
/// slowness is the model's here.)
#[test]
#[parallel]
fn growth_maps_while_a_slow_trim_unmaps() {
    within_watchdog("growth during a slow trim", || {
        let pool = probing_pool(64 * MIB);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let maps = pool.upstream().host.allocate_calls();
        let (b, report, unmaps) =
            allocate_during_a_slow_trim(&pool, 4 * MIB as usize, "growth failed during a trim");
        assert!(unmaps < 3, "the growth waited for the trim's three unmaps ({unmaps} started)");
        assert!(pool.upstream().host.allocate_calls() > maps, "the allocation grew the pool");
        assert_eq!((report.released_bytes, report.released_segments), (6 * MIB, 1));
        assert_eq!(pool.stats().reserved_bytes, 4 * MIB);
        pool.free(b, 2).unwrap();
        *pool.upstream().slow.lock() = Duration::ZERO;
        assert_eq!(pool.trim().unwrap().released_bytes, 4 * MIB);
        assert_model_clean(&pool);
    });
}

#[test]
#[parallel]
fn the_out_of_memory_ladder_unmaps_with_no_lock_held() {
    within_watchdog("an unmap that reads the pool, from the ladder", || {
        // Room for 8 MiB: stream 2's 8 MiB need stream 1's cached 6 MiB unmapped first.
        let pool = probing_pool(8 * MIB);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let b = pool.allocate(8 * MIB as usize, 512, 2).unwrap();
        let stats = pool.stats();
        assert_eq!((stats.oom_ladders, stats.reserved_bytes, stats.returning_bytes), (1, 8 * MIB, 0));
        let seen = std::mem::take(&mut *pool.upstream().seen.lock());
        assert_eq!(seen, vec![(0, 6 * MIB, Ok(())); 3]);
        pool.free(b, 2).unwrap();
        assert_eq!(pool.trim().unwrap().released_bytes, 8 * MIB);
        assert_model_clean(&pool);
    });
}

#[test]
#[parallel]
fn the_out_of_memory_ladder_waits_for_another_threads_unmaps() {
    within_watchdog("a ladder waiting for a trim's unmaps", || {
        // Room for 8 MiB: stream 2's 8 MiB need stream 1's 6 MiB, which a trim is unmapping,
        // slowly, with no lock held.
        let config =
            PoolConfig { expandable_segments: true, oom_free_wait: Duration::MAX, ..PoolConfig::default() };
        let pool = probing_pool_with(8 * MIB, config);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let (b, report, _) = allocate_during_a_slow_trim(
            &pool,
            8 * MIB as usize,
            "the ladder did not wait for the unmaps in flight",
        );
        assert_eq!((report.released_bytes, report.released_segments), (6 * MIB, 1));
        let stats = pool.stats();
        assert_eq!((stats.oom_ladders, stats.oom_errors, stats.reserved_bytes), (1, 0, 8 * MIB));
        pool.free(b, 2).unwrap();
        *pool.upstream().slow.lock() = Duration::ZERO;
        assert_eq!(pool.trim().unwrap().released_bytes, 8 * MIB);
        assert_model_clean(&pool);
    });
}

#[test]
#[parallel]
fn a_ladder_out_of_address_space_waits_for_a_reservation_being_released() {
    within_watchdog("a ladder waiting for a trim's release of a reservation", || {
        // Address space for one 8 MiB reservation: stream 2's growth needs one of its own, which
        // it gets once the trim has unmapped stream 1's chunks and released their reservation.
        let reservation = 8 * MIB as usize;
        let config = PoolConfig {
            expandable_segments: true,
            expandable_reservation_bytes: Some(reservation),
            oom_free_wait: Duration::MAX,
            ..PoolConfig::default()
        };
        let pool = probing_pool_with(64 * MIB, config);
        pool.upstream().host.limit_address_space(reservation as u64);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        let (b, report, _) = allocate_during_a_slow_trim(
            &pool,
            2 * MIB as usize,
            "the ladder did not wait for the reservation being released",
        );
        assert_eq!((report.released_bytes, report.released_segments), (6 * MIB, 1));
        let stats = pool.stats();
        assert_eq!((stats.oom_errors, stats.reserved_bytes, stats.returning_bytes), (0, 2 * MIB, 0));
        pool.free(b, 2).unwrap();
        *pool.upstream().slow.lock() = Duration::ZERO;
        pool.trim().unwrap();
        assert_model_clean(&pool);
    });
}

#[test]
#[parallel]
fn chunks_whose_unmap_failed_come_back_under_the_peak() {
    within_watchdog("a failed unmap after a peak reset", || {
        let pool = probing_pool(64 * MIB);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        // The first unmap (the top chunk) fails: all three chunks stay, cached, after a window in
        // which they were out of `reserved_bytes` and the peaks were reset.
        pool.upstream().host.fail_unmap(0, UpstreamError::Other(7));
        pool.upstream().reset_peaks.store(true, Relaxed);
        let report = pool.trim().unwrap();
        assert_eq!(report.released_bytes, 0);
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.returning_bytes), (6 * MIB, 0));
        assert!(
            stats.peak_reserved_bytes >= stats.reserved_bytes,
            "peak {} below reserved {}",
            stats.peak_reserved_bytes,
            stats.reserved_bytes
        );
        pool.upstream().reset_peaks.store(false, Relaxed);
        assert_eq!(pool.trim().unwrap().released_bytes, 6 * MIB);
        assert_model_clean(&pool);
    });
}

#[test]
#[parallel]
fn an_allocation_from_inside_an_unmap_does_not_wait_for_that_unmap() {
    within_watchdog("a ladder inside an unmap", || {
        // Room for 8 MiB, 6 of them cached on stream 1 and being unmapped: the upstream's unmap
        // asks for 4 MiB on stream 2, which only those chunks could give. Its ladder must not wait
        // for the unmap in flight (its own caller's): with no bound on the wait, it would hang.
        let config =
            PoolConfig { expandable_segments: true, oom_free_wait: Duration::MAX, ..PoolConfig::default() };
        let pool = probing_pool_with(8 * MIB, config);
        let a = pool.allocate(6 * MIB as usize, 512, 1).unwrap();
        pool.free(a, 1).unwrap();
        *pool.upstream().allocate_in_unmap.lock() = Some(4 * MIB as usize);
        let report = pool.trim().unwrap();
        assert_eq!(report.released_bytes, 6 * MIB);
        let answers = std::mem::take(&mut *pool.upstream().allocated_in_unmap.lock());
        assert!(
            matches!(answers.as_slice(), [Err(cumem_pool::PoolError::OutOfMemory { .. })]),
            "{answers:?}"
        );
        pool.trim().unwrap();
        assert_model_clean(&pool);
    });
}
