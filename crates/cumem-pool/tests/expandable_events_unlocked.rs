//! The expandable segments' events are logged with the pool's locks let go: a subscriber that
//! reads the pool's stats on them (which take those locks) must not deadlock, whether a stream's
//! reservation filled up (in growth and in the out-of-memory ladder) or unmapping a free chunk
//! failed (in a trim, the release threshold and the ladder; on the device through the
//! simulator's fault injection). The work runs on a thread, waited for under a bound, since a
//! deadlock hangs rather than fails. The ladder logs in the order things happened, and a
//! subscriber that panics on its events leaves the books consistent. The same holds for the
//! device's own warnings in growth: a chunk's physical memory whose release fails after mapping,
//! a new reservation whose free fails after its map failed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{
    CachingPool, CachingResource, HostOrdering, HostUpstream, PoolConfig, PoolError, PoolStats, TrimReport,
    UpstreamError,
};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::serial;
use tracing_subscriber::layer::SubscriberExt;

mod common;
use common::Free;
use common::events::{OnEvent, on_a_thread_within_20s};
use common::fails_once_on_this_thread;

const MIB: usize = 1 << 20;
const RESERVING: &str = "expandable segments full: reserving another";
const UNMAP_FAILED: &str = "unmapping a free chunk failed; kept cached";
const RELEASED: &str = "segments released";
const UNDO_FAILED: &str = "undoing a failed map: unmap failed; retried later";
const RELEASE_FAILED: &str = "cuMemRelease failed; the memory is leaked";
const FREE_FAILED: &str = "cuMemAddressFree failed; the reservation is leaked";

type Pool = CachingPool<HostUpstream, HostOrdering>;

/// Runs `work` on a thread under a subscriber that reads `stats` on every event named `wanted`;
/// what `work` returned and the stats read on each such event. Panics if the work does not end
/// within 20 seconds: the event was logged under a lock that `stats` takes.
fn reading_stats_on<T: Send + 'static>(
    wanted: &'static str,
    stats: impl Fn() -> PoolStats + Send + Sync + 'static,
    work: impl FnOnce() -> T + Send + 'static,
) -> (T, Vec<PoolStats>) {
    on_a_thread_within_20s(&format!("deadlocked: {wanted:?} was logged under a lock"), move || {
        let seen = Arc::new(Mutex::new(vec![]));
        let read = seen.clone();
        let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
            if m == wanted {
                let s = stats();
                read.lock().push(s);
            }
        }));
        let out = cumem_sys::testing::with_subscriber(subscriber, work);
        let seen = std::mem::take(&mut *seen.lock());
        (out, seen)
    })
}

/// [`reading_stats_on`] for a host pool: `work` gets the pool, and the subscriber reads its stats.
fn reading_pool_stats_on<T: Send + 'static>(
    wanted: &'static str,
    pool: &Arc<Pool>,
    work: impl FnOnce(&Pool) -> T + Send + 'static,
) -> (T, Vec<PoolStats>) {
    let (reader, p) = (pool.clone(), pool.clone());
    reading_stats_on(wanted, move || reader.stats(), move || work(&p))
}

/// The pool's next unmap of a chunk fails.
fn fail_next_unmap(pool: &Pool) {
    let up = pool.upstream();
    up.fail_unmap(up.unmap_calls(), UpstreamError::Other(1));
}

/// A 10 MiB host pool of 4 MiB reservations: stream 0 fills its reservation with one 4 MiB block;
/// stream 1 maps 4 MiB for a 2.5 MiB and a 1.5 MiB block and frees the first, caching one whole
/// free chunk that no 4 MiB request fits. Another 4 MiB on stream 0 then needs a new reservation
/// and, first, the ladder's unmapping of that chunk. Returns the pool (of release threshold
/// `release_threshold`) and the two live blocks.
fn full_reservation_and_a_free_chunk(release_threshold: usize) -> (Arc<Pool>, [cumem_pool::Block; 2]) {
    let config = PoolConfig {
        expandable_segments: true,
        expandable_reservation_bytes: Some(4 * MIB),
        release_threshold,
        ..PoolConfig::default()
    };
    let pool = Arc::new(CachingPool::new(HostUpstream::new(10 * MIB), HostOrdering::new(), config));
    let full = pool.allocate(4 * MIB, 512, 0).unwrap();
    let freed = pool.allocate(5 * MIB / 2, 512, 1).unwrap();
    let kept = pool.allocate(3 * MIB / 2, 512, 1).unwrap();
    pool.free(freed, 1).unwrap();
    let s = pool.stats();
    assert_eq!((s.segments, s.reserved_bytes, s.current_bytes), (2, 8 << 20, 11 << 19));
    (pool, [full, kept])
}

/// Frees `blocks` and the block `extra`, trims, and checks that everything went back.
fn clean_up(pool: &Pool, blocks: [cumem_pool::Block; 2], extra: Option<cumem_pool::Block>) {
    let [full, kept] = blocks;
    pool.free(full, 0).unwrap();
    pool.free(kept, 1).unwrap();
    if let Some(b) = extra {
        pool.free(b, 0).unwrap();
    }
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    assert_eq!(pool.upstream().live_bytes(), 0);
    assert!(pool.upstream().reservations().is_empty());
    assert!(pool.upstream().violations().is_empty(), "{:?}", pool.upstream().violations());
}

/// Stream 0's reservation is full: growth reserves another (logged), its map finds no physical
/// memory, and the ladder unmaps stream 1's free chunk, reserves again (logged) and maps.
#[test]
fn a_subscriber_that_reads_stats_when_a_reservation_fills_up_does_not_deadlock() {
    let (pool, blocks) = full_reservation_and_a_free_chunk(usize::MAX);
    let (grown, seen) = reading_pool_stats_on(RESERVING, &pool, |p| p.allocate(4 * MIB, 512, 0));
    let grown = grown.unwrap();
    let seen: Vec<(u64, u64)> = seen.iter().map(|s| (s.segments, s.reserved_bytes)).collect();
    // In growth the new reservation went back with nothing mapped; in the ladder it stays, mapped,
    // beside stream 1's reservation left with one chunk.
    assert_eq!(seen, [(2, 8 << 20), (3, 10 << 20)], "(segments, reserved bytes) at each event");
    let s = pool.stats();
    assert_eq!((s.segments, s.reserved_bytes, s.current_bytes, s.oom_ladders), (3, 10 << 20, 19 << 19, 1));
    clean_up(&pool, blocks, Some(grown));
}

/// Unmapping stream 1's free chunk fails in a trim (nothing released), then in a ladder (which
/// reports out of memory); a third try succeeds.
#[test]
fn a_subscriber_that_reads_stats_when_an_unmap_fails_does_not_deadlock() {
    let (pool, blocks) = full_reservation_and_a_free_chunk(usize::MAX);
    let (results, seen) = reading_pool_stats_on(UNMAP_FAILED, &pool, |p| {
        fail_next_unmap(p);
        let trimmed = p.trim();
        fail_next_unmap(p);
        let failed = p.allocate(4 * MIB, 512, 0);
        (trimmed, failed)
    });
    assert_eq!(results.0.unwrap(), TrimReport::default(), "the one free chunk stayed mapped");
    let err = results.1.unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { requested, .. } if requested == 4 * MIB), "{err:?}");
    let seen: Vec<(u64, u64, u64)> =
        seen.iter().map(|s| (s.segments, s.reserved_bytes, s.upstream_frees)).collect();
    assert_eq!(seen, [(2, 8 << 20, 0); 2], "(segments, reserved bytes, upstream frees) at each event");
    // The unmap works again: the ladder unmaps the chunk and maps the block.
    let grown = pool.allocate(4 * MIB, 512, 0).unwrap();
    assert_eq!((pool.stats().reserved_bytes, pool.stats().oom_ladders), (10 << 20, 2));
    clean_up(&pool, blocks, Some(grown));
}

/// The release threshold (0 here) unmaps the free chunk when the pool synchronises: that unmap
/// fails once (nothing released), and the next synchronisation unmaps it.
#[test]
fn a_subscriber_that_reads_stats_when_the_release_threshold_cannot_unmap_does_not_deadlock() {
    let (pool, blocks) = full_reservation_and_a_free_chunk(0);
    let (report, seen) = reading_pool_stats_on(UNMAP_FAILED, &pool, |p| {
        fail_next_unmap(p);
        p.synchronize()
    });
    assert_eq!(report.unwrap(), TrimReport::default(), "the one free chunk stayed mapped");
    let seen: Vec<(u64, u64, u64)> =
        seen.iter().map(|s| (s.segments, s.reserved_bytes, s.current_bytes)).collect();
    assert_eq!(seen, [(2, 8 << 20, 11 << 19)], "(segments, reserved bytes, live bytes) at the event");
    let report = pool.synchronize().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (2 << 20, 0));
    assert_eq!(pool.stats().reserved_bytes, 6 << 20);
    clean_up(&pool, blocks, None);
}

/// The messages of the events named in `wanted` that `work` logs, in the order logged.
fn events_of<T>(wanted: &'static [&'static str], work: impl FnOnce() -> T) -> (T, Vec<&'static str>) {
    let seen = Arc::new(Mutex::new(vec![]));
    let log = seen.clone();
    let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
        if let Some(&w) = wanted.iter().find(|&&w| w == m) {
            log.lock().push(w);
        }
    }));
    let out = cumem_sys::testing::with_subscriber(subscriber, work);
    let seen = std::mem::take(&mut *seen.lock());
    (out, seen)
}

/// Stream 0's 4 MiB reservation is full and stream 1's is entirely free (a 4 MiB block freed), in
/// a 10 MiB pool: a 6 MiB block on stream 0 fits neither, and growth's new reservation finds
/// 2 MiB to map. The ladder releases stream 1's reservation, then reserves again: its events say
/// so in that order.
#[test]
fn the_ladder_logs_its_release_before_the_reservation_it_made_room_for() {
    let config = PoolConfig {
        expandable_segments: true,
        expandable_reservation_bytes: Some(4 * MIB),
        ..PoolConfig::default()
    };
    let pool = CachingPool::new(HostUpstream::new(10 * MIB), HostOrdering::new(), config);
    let full = pool.allocate(4 * MIB, 512, 0).unwrap();
    let freed = pool.allocate(4 * MIB, 512, 1).unwrap();
    pool.free(freed, 1).unwrap();
    let (grown, seen) = events_of(&[RESERVING, RELEASED], || pool.allocate(6 * MIB, 512, 0));
    let grown = grown.unwrap();
    assert_eq!(seen, [RESERVING, RELEASED, RESERVING], "growth's try, then the ladder's release and try");
    let s = pool.stats();
    assert_eq!((s.segments, s.reserved_bytes, s.current_bytes, s.oom_ladders), (2, 10 << 20, 10 << 20, 1));
    pool.free(full, 0).unwrap();
    pool.free(grown, 0).unwrap();
    pool.validate().unwrap();
    pool.trim().unwrap();
    assert_eq!((pool.stats().reserved_bytes, pool.upstream().live_bytes()), (0, 0));
    assert!(pool.upstream().reservations().is_empty());
    assert!(pool.upstream().violations().is_empty(), "{:?}", pool.upstream().violations());
}

/// A subscriber panics on the ladder's "reserving another" (the second, after growth's): the
/// block the ladder took is counted live before it is logged, so the panic leaks a block the
/// books still count (cached plus live is what is reserved), not a range neither cached nor live.
#[test]
fn a_subscriber_that_panics_in_the_ladder_leaves_the_books_consistent() {
    let (pool, [full, kept]) = full_reservation_and_a_free_chunk(usize::MAX);
    let reserving = AtomicUsize::new(0);
    let subscriber = tracing_subscriber::registry().with(OnEvent(move |m: &str| {
        if m == RESERVING && reserving.fetch_add(1, Ordering::Relaxed) == 1 {
            panic!("a subscriber panics on the ladder's new reservation");
        }
    }));
    let caught = cumem_sys::testing::with_subscriber(subscriber, || {
        catch_unwind(AssertUnwindSafe(|| pool.allocate(4 * MIB, 512, 0)))
    });
    assert!(caught.is_err(), "the subscriber's panic reached the caller");
    pool.validate().unwrap();
    let s = pool.stats();
    assert_eq!((s.segments, s.reserved_bytes, s.current_bytes, s.oom_ladders), (3, 10 << 20, 19 << 19, 1));
    pool.free(full, 0).unwrap();
    pool.free(kept, 1).unwrap();
    pool.validate().unwrap();
    pool.trim().unwrap();
    // The leaked block keeps its chunks mapped; the rest went back.
    let s = pool.stats();
    assert_eq!((s.segments, s.reserved_bytes, s.current_bytes), (1, 4 << 20, 4 << 20));
    assert_eq!(pool.upstream().live_bytes(), 4 << 20);
    assert!(pool.upstream().violations().is_empty(), "{:?}", pool.upstream().violations());
}

/// An expandable caching pool on device 0 of the simulator, whose faults the tests inject.
struct DevicePool {
    ctl: cumem_sim::control::Control,
    ctx: cumem_core::Context,
    /// The device's mapping granularity (the pool's chunk).
    chunk: u64,
    pool: Arc<CachingResource>,
    stream: Stream,
}

/// [`DevicePool`], or `None` (the skip said why) off the simulator or without virtual memory.
fn device_pool() -> Option<DevicePool> {
    testing::init_with("devices=1");
    let device = Device::get(0).unwrap();
    if !device.capabilities().unwrap().virtual_memory {
        testing::skip("device 0 has no virtual memory management");
        return None;
    }
    // Injecting failures needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return None;
    };
    let ctx = device.context().unwrap();
    let chunk = cumem_vmm::Granularity::of(device).unwrap().recommended as u64;
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(&ctx, config));
    let stream = Stream::non_blocking(&ctx).unwrap();
    Some(DevicePool { ctl, ctx, chunk, pool, stream })
}

/// On the device: the simulator fails the trim's second `cuMemUnmap` (the middle chunk of three,
/// from the top), so one chunk goes back and two stay, and the subscriber reads the stats then.
#[test]
#[serial]
fn a_subscriber_that_reads_stats_when_a_device_unmap_fails_does_not_deadlock() {
    let Some(DevicePool { ctl, ctx, chunk: c, pool, stream }) = device_pool() else { return };
    let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, (3 * c) as usize).unwrap();
    let base = a.device_ptr();
    drop(a);
    let (reader, p) = (pool.clone(), pool.clone());
    let (report, seen) = reading_stats_on(
        UNMAP_FAILED,
        move || reader.stats(),
        move || {
            let ctl = testing::sim_control().expect("the simulator, checked above");
            let rule = ctl.inject_fault(fails_once_on_this_thread("cuMemUnmap", 2));
            let report = p.trim();
            ctl.remove_fault(rule);
            report
        },
    );
    let report = report.unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (c, 0));
    let seen: Vec<(u64, u64)> = seen.iter().map(|s| (s.reserved_bytes, s.upstream_frees)).collect();
    assert_eq!(seen, [(2 * c, 1)], "(reserved bytes, upstream frees) at the event: the top chunk is gone");
    assert_eq!(pool.pool().segments(), vec![(base, 2 * c)]);
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (2 * c, 1));
    assert_eq!(pool.stats().reserved_bytes, 0);
    drop((pool, stream, ctx));
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}

/// A growth on the device whose second map fails, and whose undoing of the first map fails too,
/// warns `undoing a failed map: unmap failed; retried later` (`DeviceExpandable`, called under the
/// pool's locks): the warning waits until the pool has let go of them, so a subscriber that reads
/// the stats on it does not deadlock; the chunk left mapped goes with the next trim.
#[test]
#[serial]
fn a_subscriber_that_reads_stats_when_undoing_a_failed_device_map_fails_does_not_deadlock() {
    let Some(DevicePool { ctl, ctx, chunk: c, pool, stream }) = device_pool() else { return };
    let a = DeviceBuffer::<u8>::zeroed_in(&pool, &stream, c as usize).unwrap();
    let (reader, p, s) = (pool.clone(), pool.clone(), stream.clone());
    let (grown, seen) = reading_stats_on(
        UNDO_FAILED,
        move || reader.stats(),
        move || {
            let ctl = testing::sim_control().expect("the simulator, checked above");
            // Growing by two chunks: the second map fails, and undoing the first one's fails too.
            let rules = [("cuMemMap", 2), ("cuMemUnmap", 1)]
                .map(|(function, nth)| ctl.inject_fault(fails_once_on_this_thread(function, nth)));
            let grown = DeviceBuffer::<u8>::new_in(&p, &s, (2 * c) as usize).map(drop);
            for rule in rules {
                ctl.remove_fault(rule);
            }
            grown
        },
    );
    assert!(grown.is_err(), "{grown:?}");
    let seen: Vec<u64> = seen.iter().map(|s| s.reserved_bytes).collect();
    assert_eq!(seen, [c], "reserved bytes at the warning: only the first chunk");
    drop(a);
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (c, 1));
    drop((pool, stream, ctx));
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}

/// A growth on the device whose chunk's `cuMemRelease` (right after mapping it: the mapping keeps
/// the memory) fails warns `cuMemRelease failed; the memory is leaked` under the pool's locks
/// (`DeviceExpandable::map_chunk`, from growth): the warning waits until the pool has let go of
/// them, so a subscriber that reads the stats on it does not deadlock. The block is served; the
/// chunk's memory keeps the reference that failed to go, which the test releases by its handle.
#[test]
#[serial]
fn a_subscriber_that_reads_stats_when_releasing_a_mapped_chunks_memory_fails_does_not_deadlock() {
    let Some(DevicePool { ctl, ctx, chunk: c, pool, stream }) = device_pool() else { return };
    let (reader, p, s) = (pool.clone(), pool.clone(), stream.clone());
    let (grown, seen) = reading_stats_on(
        RELEASE_FAILED,
        move || reader.stats(),
        move || {
            let ctl = testing::sim_control().expect("the simulator, checked above");
            let rule = ctl.inject_fault(fails_once_on_this_thread("cuMemRelease", 1));
            let grown = DeviceBuffer::<u8>::new_in(&p, &s, c as usize).map(drop);
            ctl.remove_fault(rule);
            grown
        },
    );
    grown.unwrap();
    let seen: Vec<(u64, u64)> = seen.iter().map(|s| (s.segments, s.reserved_bytes)).collect();
    assert_eq!(seen, [(1, c)], "(segments, reserved bytes) at the warning: the chunk is mapped");
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (c, 1));
    drop((pool, stream, ctx));
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    // Unmapped, but the creation's reference is still held: the one failed release.
    let live = ctl.live_report();
    let leaked: Vec<(u64, u32, u32)> =
        live.physical.iter().map(|p| (p.bytes, p.references, p.mappings)).collect();
    assert_eq!(leaked, [(c, 1, 0)], "{live}");
    // SAFETY: the handle of memory nothing maps or uses any more, whose one reference is released
    // once, here.
    let code = unsafe { cumem_core::sys::cuMemRelease(live.physical[0].handle) };
    assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}

/// A growth on the device reserves a new range and its first map fails: the pool gives the range
/// back at once (`release_if_unmapped`, under its locks), and that `cuMemAddressFree` failing warns
/// `cuMemAddressFree failed; the reservation is leaked` (`DeviceExpandable::release`, which frees
/// in place: the out-of-memory ladder may reserve again right after). The warning waits until the
/// pool has let go of its locks, so a subscriber that reads the stats on it does not deadlock. The
/// reservation that failed to go is freed by the test.
#[test]
#[serial]
fn a_subscriber_that_reads_stats_when_freeing_a_reservation_fails_does_not_deadlock() {
    let Some(DevicePool { ctl, ctx, chunk: c, pool, stream }) = device_pool() else { return };
    let (reader, p, s) = (pool.clone(), pool.clone(), stream.clone());
    let (grown, seen) = reading_stats_on(
        FREE_FAILED,
        move || reader.stats(),
        move || {
            let ctl = testing::sim_control().expect("the simulator, checked above");
            let rules = [("cuMemMap", 1), ("cuMemAddressFree", 1)]
                .map(|(function, nth)| ctl.inject_fault(fails_once_on_this_thread(function, nth)));
            let grown = DeviceBuffer::<u8>::new_in(&p, &s, c as usize).map(drop);
            for rule in rules {
                ctl.remove_fault(rule);
            }
            grown
        },
    );
    assert!(grown.is_err(), "{grown:?}");
    let seen: Vec<(u64, u64)> = seen.iter().map(|s| (s.segments, s.reserved_bytes)).collect();
    assert_eq!(seen, [(0, 0)], "(segments, reserved bytes) at the warning: the reservation left the books");
    // The pool works on: the next growth reserves and maps.
    DeviceBuffer::<u8>::new_in(&pool, &stream, c as usize).map(drop).unwrap();
    let report = pool.trim().unwrap();
    assert_eq!((report.released_bytes, report.released_segments), (c, 1));
    drop((pool, stream, ctx));
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    // Only the reservation whose free failed is left.
    let live = ctl.live_report();
    assert!(live.physical.is_empty() && live.mappings.is_empty(), "{live}");
    let [left] = live.reservations.as_slice() else { panic!("one reservation left: {live}") };
    // SAFETY: the reservation the pool gave back with nothing mapped in it (the free that failed),
    // which nothing uses; freed once, here.
    let code = unsafe { cumem_core::sys::cuMemAddressFree(left.ptr, left.bytes as usize) };
    assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
    let live = ctl.live_report();
    assert!(live.is_clean(), "{live}");
}
