//! A ladder must not report out-of-memory while another thread's release is still returning
//! memory to the upstream: segments leave the books under the locks but reach the upstream only
//! after the locks are let go. Here one thread's trim is held inside the upstream's free until
//! another thread's ladder has failed to grow once; the ladder must wait for that free and retry,
//! not fail. Under a watchdog, since a wrong wait hangs rather than fails. The wait is bounded
//! (`PoolConfig::oom_free_wait`): a free that itself waits for the allocating thread (as
//! `cuMemFree` waits for a host function) must not hang the allocation, which reports out of
//! memory instead.
//! A release that panics (here in a tracing subscriber) before its frees are made must not leave
//! them counted as in flight, nor panic again while unwinding (in a child process: that aborts).
//! A free that panics leaks its segment: a ladder waiting for it must not ask the upstream again.
//! A ladder waits only for the frees in flight when it starts waiting: one that started later and
//! is held until the ladder returns must not keep it waiting (here with no bound at all).
//! With `oom_free_wait` zero a ladder does not wait, and logs no wait. Release and out-of-memory
//! events are logged with the pool's locks let go (a subscriber may read its stats).

use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use cumem_pool::{
    CachingPool, ExpandableUpstream, HostOrdering, HostUpstream, PoolConfig, PoolError, Upstream,
    UpstreamError,
};
use cumem_sys::testing::within_watchdog;
use parking_lot::{Condvar, Mutex};

mod common;
use common::Free;
use common::events::{OnEvent, message, on_a_thread_within_20s};

type Pool = CachingPool<GatedUpstream, HostOrdering>;

#[derive(Default)]
struct Gate {
    /// The trim's free has started (and is held).
    freeing: bool,
    /// The ladder's growth failed while the free was held.
    ladder_failed: bool,
}

/// Waits on `changed` until `done` holds for what `mutex` guards.
fn wait_until<T>(mutex: &Mutex<T>, changed: &Condvar, done: impl Fn(&T) -> bool) {
    let mut guard = mutex.lock();
    while !done(&guard) {
        changed.wait(&mut guard);
    }
}

/// A host upstream whose first free waits until a ladder's growth has failed.
struct GatedUpstream {
    host: HostUpstream,
    pool: OnceLock<Weak<Pool>>,
    gate: Mutex<Gate>,
    changed: Condvar,
}

impl Upstream for GatedUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        let r = self.host.allocate(bytes);
        let in_ladder = self.pool.get().and_then(Weak::upgrade).is_some_and(|p| p.stats().oom_ladders > 0);
        if r.is_err() && in_ladder {
            self.gate.lock().ladder_failed = true;
            self.changed.notify_all();
        }
        r
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        let mut gate = self.gate.lock();
        if !gate.freeing {
            gate.freeing = true;
            self.changed.notify_all();
            while !gate.ladder_failed {
                self.changed.wait(&mut gate);
            }
        }
        drop(gate);
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for GatedUpstream {}

#[test]
fn a_ladder_waits_for_memory_another_thread_is_returning() {
    within_watchdog("a ladder racing another thread's release", || {
        // Room for the 20 MiB segment and 4 MiB more: stream 2's 22 MiB request fits only once
        // the trim has returned the segment.
        let up = GatedUpstream {
            host: HostUpstream::new(24 << 20),
            pool: OnceLock::new(),
            gate: Mutex::new(Gate::default()),
            changed: Condvar::new(),
        };
        // Long enough for the trim to finish its free once let go on any machine (a ladder that
        // gives up first reports out of memory), and below the watchdog.
        let config = PoolConfig { oom_free_wait: Duration::from_secs(30), ..PoolConfig::default() };
        let pool = Arc::new(CachingPool::new(up, HostOrdering::new(), config));
        pool.upstream().pool.set(Arc::downgrade(&pool)).unwrap();
        let big = pool.allocate(4 << 20, 512, 1).unwrap();
        pool.free(big, 1).unwrap();
        assert_eq!(pool.stats().reserved_bytes, 20 << 20);
        let trimmer = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.trim().unwrap())
        };
        wait_until(&pool.upstream().gate, &pool.upstream().changed, |gate| gate.freeing);
        // The segment is out of the books but not back with the upstream yet.
        let stats = pool.stats();
        assert_eq!((stats.reserved_bytes, stats.returning_bytes), (0, 20 << 20));
        let larger = pool.allocate(22 << 20, 512, 2);
        let report = trimmer.join().unwrap();
        assert_eq!(report.released_bytes, 20 << 20);
        let larger = match larger {
            Ok(b) => b,
            Err(e @ PoolError::OutOfMemory { .. }) => {
                panic!("out of memory while memory was on its way back: {e}")
            }
            Err(e) => panic!("{e}"),
        };
        assert!(pool.upstream().gate.lock().ladder_failed);
        assert_eq!(pool.stats().oom_ladders, 1);
        assert_eq!(pool.stats().returning_bytes, 0);
        pool.free(larger, 2).unwrap();
        pool.validate().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.upstream().host.live_bytes(), 0);
    });
}

/// A host upstream whose first free is held until the test says the allocating thread has
/// returned: a stand-in for `cuMemFree` waiting for a host function that waits for something that
/// thread does after its allocation.
struct HeldUpstream {
    host: HostUpstream,
    /// (the free has started, the allocating thread has returned)
    gate: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Upstream for HeldUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        let mut gate = self.gate.lock();
        if !gate.0 {
            gate.0 = true;
            self.changed.notify_all();
            while !gate.1 {
                self.changed.wait(&mut gate);
            }
        }
        drop(gate);
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for HeldUpstream {}

impl HeldUpstream {
    fn let_go(&self) {
        self.gate.lock().1 = true;
        self.changed.notify_all();
    }
}

#[test]
fn a_ladder_does_not_wait_without_bound_for_a_free_that_waits_for_it() {
    let pool = Arc::new(CachingPool::new(
        HeldUpstream { host: HostUpstream::new(24 << 20), gate: Mutex::default(), changed: Condvar::new() },
        HostOrdering::new(),
        // The bound itself is under test: short, far below the guard below.
        PoolConfig { oom_free_wait: Duration::from_millis(100), ..PoolConfig::default() },
    ));
    let big = pool.allocate(4 << 20, 512, 1).unwrap();
    pool.free(big, 1).unwrap();
    let trimmer = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.trim().unwrap())
    };
    {
        let mut gate = pool.upstream().gate.lock();
        while !gate.0 {
            pool.upstream().changed.wait(&mut gate);
        }
    }
    // The trim's free is held until this allocation has returned; it needs that free's memory.
    // Its thread's subscriber reads the pool's stats when the ladder gives up waiting (which must
    // not find the pool's locks held by that very thread).
    let (tx, rx) = std::sync::mpsc::channel();
    let allocating = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            use tracing_subscriber::layer::SubscriberExt;
            let reader = pool.clone();
            let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = fired.clone();
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m.contains("still in flight") {
                    let _ = reader.stats();
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }));
            let r = cumem_sys::testing::with_subscriber(subscriber, || pool.allocate(22 << 20, 512, 2));
            tx.send((r.map(|b| b.addr()), fired.load(std::sync::atomic::Ordering::SeqCst))).unwrap()
        })
    };
    let result = rx.recv_timeout(Duration::from_secs(20));
    pool.upstream().let_go();
    let (result, fired) = result.expect("the allocation was still waiting for a free that waits for it");
    assert!(fired, "the ladder never logged that it gave up waiting");
    assert!(
        matches!(result, Err(PoolError::OutOfMemory { requested, .. }) if requested == 22 << 20),
        "{result:?}"
    );
    allocating.join().unwrap();
    assert_eq!(trimmer.join().unwrap().released_bytes, 20 << 20);
    // The memory is back now.
    let larger = pool.allocate(22 << 20, 512, 2).unwrap();
    pool.free(larger, 2).unwrap();
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().host.live_bytes(), 0);
    assert!(pool.upstream().host.violations().is_empty());
}

/// `oom_free_wait: Duration::ZERO` is no waiting: a ladder with a free in flight reports out of
/// memory at once, and logs no wait it does not make.
#[test]
fn a_ladder_with_a_zero_free_wait_does_not_wait() {
    use tracing_subscriber::layer::SubscriberExt;
    let pool = Arc::new(CachingPool::new(
        HeldUpstream { host: HostUpstream::new(24 << 20), gate: Mutex::default(), changed: Condvar::new() },
        HostOrdering::new(),
        PoolConfig { oom_free_wait: Duration::ZERO, ..PoolConfig::default() },
    ));
    let big = pool.allocate(4 << 20, 512, 1).unwrap();
    pool.free(big, 1).unwrap();
    let trimmer = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.trim().unwrap())
    };
    {
        let mut gate = pool.upstream().gate.lock();
        while !gate.0 {
            pool.upstream().changed.wait(&mut gate);
        }
    }
    let waits = Arc::new(Mutex::new(Vec::new()));
    let seen = waits.clone();
    let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
        if m.contains("waiting for segment frees") || m.contains("still in flight") {
            seen.lock().push(m.to_string());
        }
    }));
    let result = cumem_sys::testing::with_subscriber(subscriber, || pool.allocate(22 << 20, 512, 2));
    pool.upstream().let_go();
    assert!(
        matches!(result, Err(PoolError::OutOfMemory { requested, .. }) if requested == 22 << 20),
        "{result:?}"
    );
    assert_eq!(trimmer.join().unwrap().released_bytes, 20 << 20);
    assert!(waits.lock().is_empty(), "a ladder that does not wait logged waits: {:?}", waits.lock());
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().host.live_bytes(), 0);
}

/// A tracing layer that panics on the pool's "segments released" event (the release has taken
/// segments out of the books and not given them back yet) and, with `on_warn`, on every warning.
struct PanicOnRelease {
    on_warn: bool,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PanicOnRelease {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let m = message(event);
        if m.contains("segments released")
            || (self.on_warn && *event.metadata().level() == tracing::Level::WARN)
        {
            panic!("a subscriber panics on {m:?}");
        }
    }
}

/// A 24 MiB host pool caching a 20 MiB segment (a 4 MiB block allocated and freed), trimmed on
/// another thread under [`PanicOnRelease`] (`on_warn`): the trim panics, and the segment left the
/// books and never reached the upstream (leaked), so nothing is on its way back (a free counted as
/// in flight forever would make every later ladder wait for it).
fn after_a_panicking_trim(on_warn: bool) -> Arc<CachingPool<HostUpstream, HostOrdering>> {
    use tracing_subscriber::layer::SubscriberExt;
    let pool =
        Arc::new(CachingPool::new(HostUpstream::new(24 << 20), HostOrdering::new(), PoolConfig::default()));
    let big = pool.allocate(4 << 20, 512, 1).unwrap();
    pool.free(big, 1).unwrap();
    let trimmer = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let subscriber = tracing_subscriber::registry().with(PanicOnRelease { on_warn });
            cumem_sys::testing::with_subscriber(subscriber, || pool.trim())
        })
    };
    assert!(trimmer.join().is_err(), "the trim was to panic");
    assert_eq!(pool.stats().returning_bytes, 0, "a free that was never made is still counted in flight");
    pool
}

#[test]
fn a_release_that_panics_leaves_no_free_for_a_ladder_to_wait_for() {
    let pool = after_a_panicking_trim(false);
    let err = pool.allocate(22 << 20, 512, 2).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { requested, .. } if requested == 22 << 20), "{err:?}");
    assert_eq!(pool.stats().reserved_bytes, 0);
    assert_eq!(pool.upstream().live_bytes(), 20 << 20);
    pool.validate().unwrap();
}

/// A cross-stream migration is logged with the arena's lock let go: a subscriber that reads the
/// pool's stats on it must not deadlock (under a bound, since a deadlock hangs rather than fails).
#[test]
fn a_subscriber_that_reads_stats_on_a_migration_does_not_deadlock() {
    use tracing_subscriber::layer::SubscriberExt;
    let pool =
        Arc::new(CachingPool::new(HostUpstream::new(24 << 20), HostOrdering::new(), PoolConfig::default()));
    let seen = {
        let pool = pool.clone();
        on_a_thread_within_20s("deadlocked: the migration was logged under a lock", move || {
            let reader = pool.clone();
            let seen = Arc::new(Mutex::new(0u32));
            let counts = seen.clone();
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m.contains("cross-stream migration") {
                    let _ = reader.stats();
                    *counts.lock() += 1;
                }
            }));
            cumem_sys::testing::with_subscriber(subscriber, || {
                // Stream 1's cached 4 MiB block serves stream 2 (only 4 MiB of upstream left).
                let b = pool.allocate(4 << 20, 512, 1).unwrap();
                pool.free(b, 1).unwrap();
                let b = pool.allocate(4 << 20, 512, 2).unwrap();
                pool.free(b, 2).unwrap();
            });
            *seen.lock()
        })
    };
    assert_eq!(seen, 1, "migration events seen");
    assert_eq!(pool.stats().upstream_allocations, 1, "served by migration, not growth");
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().live_bytes(), 0);
}

/// The pool's release and out-of-memory events are logged with its locks let go: a subscriber that
/// reads the pool's stats on them (which take those locks) must not deadlock. Under a bound, since
/// a deadlock hangs rather than fails.
#[test]
fn a_subscriber_that_reads_stats_on_release_and_oom_events_does_not_deadlock() {
    use tracing_subscriber::layer::SubscriberExt;
    let config = PoolConfig { release_threshold: 0, ..PoolConfig::default() };
    let pool = Arc::new(CachingPool::new(HostUpstream::new(24 << 20), HostOrdering::new(), config));
    let seen = {
        let pool = pool.clone();
        on_a_thread_within_20s("deadlocked: an event was logged with the pool's locks held", move || {
            let reader = pool.clone();
            let seen = Arc::new(Mutex::new((0u32, 0u32)));
            let counts = seen.clone();
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m.contains("segments released") {
                    let _ = reader.stats();
                    counts.lock().0 += 1;
                } else if m.contains("caching pool out of memory") {
                    let _ = reader.stats();
                    counts.lock().1 += 1;
                }
            }));
            cumem_sys::testing::with_subscriber(subscriber, || {
                // Released by `trim`, by `synchronize` (threshold 0), then by a ladder (22 MiB
                // fits only without the cached 20 MiB segment), which then fails once more.
                let b = pool.allocate(4 << 20, 512, 1).unwrap();
                pool.free(b, 1).unwrap();
                assert_eq!(pool.trim().unwrap().released_bytes, 20 << 20);
                let b = pool.allocate(4 << 20, 512, 1).unwrap();
                pool.free(b, 1).unwrap();
                assert_eq!(pool.synchronize().unwrap().released_bytes, 20 << 20);
                let b = pool.allocate(4 << 20, 512, 1).unwrap();
                pool.free(b, 1).unwrap();
                let larger = pool.allocate(22 << 20, 512, 2).unwrap();
                let err = pool.allocate(22 << 20, 512, 2).unwrap_err();
                assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err:?}");
                pool.free(larger, 2).unwrap();
            });
            *seen.lock()
        })
    };
    assert_eq!(seen, (3, 1), "(segments released, out of memory) events seen");
    assert_eq!(pool.stats().oom_ladders, 2);
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().live_bytes(), 0);
    assert!(pool.upstream().violations().is_empty());
}

const CHILD: &str = "CUMEM_TEST_LADDER_PANIC_CHILD";

/// The child's half of the next test: a release that panics under a subscriber that also panics
/// on every warning.
#[test]
fn panicking_release_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    after_a_panicking_trim(true);
}

/// What the pool does while a panic unwinds through a release must not panic again (that aborts
/// the process), even under a subscriber that panics on warnings.
#[test]
fn a_release_that_panics_does_not_abort_the_process_under_a_subscriber_that_panics_on_warnings() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "panicking_release_child", "--test-threads=1"])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Read on a thread of its own: a child blocked on a full pipe would never exit.
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).map(|_| out)
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("the child never exited");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the child failed (a panic while unwinding aborts): {status:?}");
    // A filter that matches nothing runs no test and succeeds too.
    let out = reader.join().unwrap().unwrap();
    assert!(out.contains("1 passed"), "the child did not run exactly its one test:\n{out}");
}

/// A host upstream whose first free panics once a ladder's growth has failed (the segment is
/// leaked), counting the allocations asked for during ladders.
struct PanickingFreeUpstream {
    host: HostUpstream,
    pool: OnceLock<Weak<PanickingPool>>,
    gate: Mutex<Gate>,
    changed: Condvar,
    ladder_allocations: std::sync::atomic::AtomicU32,
}

type PanickingPool = CachingPool<PanickingFreeUpstream, HostOrdering>;

impl Upstream for PanickingFreeUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        let r = self.host.allocate(bytes);
        let in_ladder = self.pool.get().and_then(Weak::upgrade).is_some_and(|p| p.stats().oom_ladders > 0);
        if in_ladder {
            self.ladder_allocations.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if r.is_err() {
                self.gate.lock().ladder_failed = true;
                self.changed.notify_all();
            }
        }
        r
    }
    unsafe fn deallocate(&self, _: u64, _: usize) {
        self.gate.lock().freeing = true;
        self.changed.notify_all();
        wait_until(&self.gate, &self.changed, |gate| gate.ladder_failed);
        panic!("the upstream's free panics");
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for PanickingFreeUpstream {}

#[test]
fn a_ladder_does_not_retry_for_a_free_that_panicked() {
    within_watchdog("a ladder racing a free that panics", || {
        let up = PanickingFreeUpstream {
            host: HostUpstream::new(24 << 20),
            pool: OnceLock::new(),
            gate: Mutex::new(Gate::default()),
            changed: Condvar::new(),
            ladder_allocations: Default::default(),
        };
        // No bound: with one, a free that panics only after it would go undetected (the ladder
        // would give up first). The free always ends (it panics).
        let config = PoolConfig { oom_free_wait: Duration::MAX, ..PoolConfig::default() };
        let pool = Arc::new(CachingPool::new(up, HostOrdering::new(), config));
        pool.upstream().pool.set(Arc::downgrade(&pool)).unwrap();
        let big = pool.allocate(4 << 20, 512, 1).unwrap();
        pool.free(big, 1).unwrap();
        let trimmer = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.trim())
        };
        wait_until(&pool.upstream().gate, &pool.upstream().changed, |gate| gate.freeing);
        let err = pool.allocate(22 << 20, 512, 2).unwrap_err();
        assert!(matches!(err, PoolError::OutOfMemory { requested, .. } if requested == 22 << 20), "{err:?}");
        assert!(trimmer.join().is_err(), "the trim was to panic");
        // The free that panicked brought no memory back: asking the upstream again is pointless.
        assert_eq!(
            pool.upstream().ladder_allocations.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the ladder asked the upstream again after a free that leaked its segment"
        );
        assert_eq!(pool.stats().returning_bytes, 0);
        assert_eq!(pool.upstream().host.live_bytes(), 20 << 20);
        pool.validate().unwrap();
    });
}

/// A host upstream that holds the frees of the segments the test names until it lets them go.
struct HoldingUpstream {
    host: HostUpstream,
    /// Segment base → (its free has started, it may finish).
    held: Mutex<std::collections::HashMap<u64, (bool, bool)>>,
    changed: Condvar,
}

impl Upstream for HoldingUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        self.host.allocate(bytes)
    }
    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        let mut held = self.held.lock();
        if let Some(h) = held.get_mut(&addr) {
            h.0 = true;
            self.changed.notify_all();
            while !held[&addr].1 {
                self.changed.wait(&mut held);
            }
        }
        drop(held);
        // SAFETY: forwarded from this method's caller, who keeps its contract.
        unsafe { self.host.deallocate(addr, bytes) }
    }
    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        None
    }
}

// SAFETY: hands out its `HostUpstream`'s addresses only.
unsafe impl common::HostModel for HoldingUpstream {}

impl HoldingUpstream {
    /// The free of the segment at `addr` is to be held.
    fn hold(&self, addr: u64) {
        self.held.lock().insert(addr, (false, false));
    }

    /// Waits until the free of the segment at `addr` has started.
    fn wait_for_free(&self, addr: u64) {
        let mut held = self.held.lock();
        while !held[&addr].0 {
            self.changed.wait(&mut held);
        }
    }

    fn let_go(&self, addr: u64) {
        self.held.lock().get_mut(&addr).unwrap().1 = true;
        self.changed.notify_all();
    }
}

#[test]
fn a_ladder_does_not_wait_for_frees_that_start_after_it_waits() {
    use tracing_subscriber::layer::SubscriberExt;
    // No bound: a ladder that waits for the later free waits until the guard below lets it go.
    let config = PoolConfig { oom_free_wait: Duration::MAX, thread_cache: false, ..PoolConfig::default() };
    let up = HoldingUpstream {
        host: HostUpstream::new(24 << 20),
        held: Mutex::default(),
        changed: Condvar::new(),
    };
    let pool = Arc::new(CachingPool::new(up, HostOrdering::new(), config));
    // Segment A (20 MiB, cached) and segment B (2 MiB, holding a live small block): 2 MiB left.
    let a = pool.allocate(4 << 20, 512, 1).unwrap();
    let seg_a = pool.segments()[0].0;
    pool.free(a, 1).unwrap();
    let small = pool.allocate(4096, 512, 1).unwrap();
    let seg_b = pool.segments().into_iter().map(|s| s.0).find(|&s| s != seg_a).unwrap();
    pool.upstream().hold(seg_a);
    pool.upstream().hold(seg_b);
    // A's free starts, and is held.
    let trim_a = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.trim().unwrap())
    };
    pool.upstream().wait_for_free(seg_a);
    // A ladder for 22 MiB (which fits once A is back) fails to grow and waits for A's free.
    let (waiting_tx, waiting) = std::sync::mpsc::channel();
    let waiting_tx = Mutex::new(waiting_tx);
    let (tx, rx) = std::sync::mpsc::channel();
    let ladder = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
                if m.contains("waiting for segment frees") {
                    waiting_tx.lock().send(()).unwrap();
                }
            }));
            let r = cumem_sys::testing::with_subscriber(subscriber, || pool.allocate(22 << 20, 512, 2));
            tx.send(r).unwrap()
        })
    };
    waiting.recv_timeout(Duration::from_secs(20)).expect("the ladder never waited for A's free");
    // Then B's free starts, and is held until the ladder has returned.
    pool.free(small, 1).unwrap();
    let trim_b = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.trim().unwrap())
    };
    pool.upstream().wait_for_free(seg_b);
    pool.upstream().let_go(seg_a);
    let result = rx.recv_timeout(Duration::from_secs(20));
    pool.upstream().let_go(seg_b);
    let block = match result {
        Ok(r) => r.unwrap(),
        Err(RecvTimeoutError::Timeout) => {
            panic!("the ladder was still waiting after A's free: it waits for B's, which started later")
        }
        Err(RecvTimeoutError::Disconnected) => panic!("the ladder panicked (see above)"),
    };
    ladder.join().unwrap();
    assert_eq!(trim_a.join().unwrap().released_bytes, 20 << 20);
    assert_eq!(trim_b.join().unwrap().released_bytes, 2 << 20);
    assert_eq!(pool.stats().returning_bytes, 0);
    pool.free(block, 2).unwrap();
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.upstream().host.live_bytes(), 0);
    assert!(pool.upstream().host.violations().is_empty());
}
