//! Transfer profiling: a profiled workload reports each copy's kind, count and bytes by value, with
//! positive device times; copies outside the observed stream or outside the guard's life are not
//! counted; a global observer sees blocking copies too; the event pool is reused, not regrown;
//! a copy held on one stream keeps neither the other streams' copies pending nor, while a report
//! waits for it, their profiling blocked; one device's legacy stream is not another's; a profiler
//! attached twice counts a copy once.
//!
//! The tests with a global observer, a gate (see `common`) or a legacy stream are `#[serial]`
//! (they would count, or hold up, the copies of tests running beside them); the others are
//! `#[parallel]`.

mod common;

use std::sync::{Arc, Mutex};

use common::{OnEvent, message};

use cumem_copy::{
    Copy2D, CopyKind, Pitched, PitchedBuffer, Profiler, Rect2D, SizeClass, StagingConfig, StagingRing,
    StreamCopy, copy_d2h, copy_h2d, profile,
};
use cumem_core::{Context, Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_sys::testing;
use serial_test::{parallel, serial};

const SIM: &str = "devices=2,latency_us=2000";

fn setup() -> (Context, Stream) {
    testing::init_with(SIM);
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    (ctx, stream)
}

/// [`setup`] and the simulator's control; `None` on a real driver, the test skipped for `why`.
fn sim_setup(why: &str) -> Option<(Context, Stream, cumem_sim::control::Control)> {
    let (ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        testing::skip(why);
        return None;
    };
    Some((ctx, stream, ctl))
}

#[test]
#[parallel]
fn a_profiled_workload_reports_kinds_counts_and_bytes_by_value() {
    let (ctx, stream) = setup();
    let small = PinnedBuffer::from_slice(&ctx, &[1u32; 16]).unwrap(); // 64 B
    let big = PinnedBuffer::from_slice(&ctx, &vec![2u8; 100 << 10]).unwrap(); // 100 KiB
    let mut d_small = DeviceBuffer::<u32>::zeroed(&stream, 16).unwrap();
    let mut d_big = DeviceBuffer::<u8>::zeroed(&stream, 100 << 10).unwrap();
    let mut d_big2 = DeviceBuffer::<u8>::zeroed(&stream, 100 << 10).unwrap();
    let mut back = PinnedBuffer::<u32>::zeroed(&ctx, 16).unwrap();
    let mut img = PitchedBuffer::<u16>::zeroed(&stream, 32, 8).unwrap();
    // Zeroed before observing: its memset would count too.
    let mut img2 = img_copy(&stream);
    let other = Stream::non_blocking(&ctx).unwrap();

    let profiler = Profiler::new();
    {
        let _on = profiler.observe(&stream);
        stream.copy_h2d(&small, &mut d_small).unwrap();
        stream.copy_h2d(&small, &mut d_small).unwrap();
        stream.copy_h2d(&big, &mut d_big).unwrap();
        stream.copy_d2h(&d_small, &mut back).unwrap();
        stream.copy_d2d(&d_big, &mut d_big2).unwrap();
        stream.memset_d32(&mut d_small, 7).unwrap();
        stream.fill_2d(&mut img.as_pitched_mut(), 3u16, Rect2D::new(32, 8)).unwrap();
        stream.copy_2d(&img.as_pitched(), &mut img2.as_pitched_mut(), Copy2D::new(32, 8)).unwrap();
        // Another stream is not observed.
        other.copy_h2d(&big, &mut d_big2).unwrap();
    }
    // Nor is anything after the guard is gone.
    stream.copy_h2d(&big, &mut d_big).unwrap();

    let r = profiler.report().unwrap();
    let h2d = r.total(CopyKind::HostToDevice);
    assert_eq!((h2d.count, h2d.bytes), (3, 2 * 64 + (100 << 10)));
    assert_eq!(r.get(CopyKind::HostToDevice, SizeClass::UpTo4KiB).count, 2);
    assert_eq!(r.get(CopyKind::HostToDevice, SizeClass::UpTo1MiB).bytes, 100 << 10);
    assert_eq!((r.total(CopyKind::DeviceToHost).count, r.total(CopyKind::DeviceToHost).bytes), (1, 64));
    assert_eq!(r.total(CopyKind::DeviceToDevice).bytes, 100 << 10);
    let memset = r.total(CopyKind::Memset);
    assert_eq!((memset.count, memset.bytes), (2, 64 + 32 * 8 * 2));
    assert_eq!((r.total(CopyKind::Copy2D).count, r.total(CopyKind::Copy2D).bytes), (1, 32 * 8 * 2));
    assert_eq!(r.total(CopyKind::Copy3D), Default::default());
    for (kind, size, t) in r.rows() {
        assert!(t.device_time.as_nanos() > 0, "{kind:?} {size:?}: no device time");
        assert!(t.throughput() > 0.0);
    }
    assert_eq!(r.rows().count(), 6); // both memsets are ≤ 4 KiB
    assert!(r.to_string().contains("| h2d | ≤ 4 KiB | 2 | 128 |"), "{r}");
    // The data went where it should (profiling changes no copy).
    assert_eq!(back.as_slice().unwrap(), &[1u32; 16]);
    assert_eq!(d_small.to_vec().unwrap(), vec![7u32; 16]);
}

fn img_copy(stream: &Stream) -> PitchedBuffer<u16> {
    PitchedBuffer::<u16>::zeroed(stream, 32, 8).unwrap()
}

#[test]
#[parallel]
fn staged_chunks_are_profiled_as_their_copies_and_the_event_pool_is_reused() {
    let (ctx, stream) = setup();
    let mut ring = StagingRing::with_config(&ctx, StagingConfig { chunk_bytes: 1000, chunks: 2 }).unwrap();
    let data = vec![9u8; 2500];
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 2500).unwrap();
    let profiler = Profiler::new();
    let _on = profiler.observe(&stream);
    for _ in 0..3 {
        ring.copy_h2d(&stream, &data, &mut dev).unwrap();
        let r = profiler.report().unwrap();
        // Three chunks per call: 1000 + 1000 + 500 bytes.
        assert_eq!(r.total(CopyKind::HostToDevice).bytes % 2500, 0);
    }
    let mut back = vec![0u8; 2500];
    ring.copy_d2h(&stream, &dev, &mut back).unwrap();
    assert_eq!(back, data);
    let r = profiler.report().unwrap();
    assert_eq!((r.total(CopyKind::HostToDevice).count, r.total(CopyKind::HostToDevice).bytes), (9, 7500));
    assert_eq!((r.total(CopyKind::DeviceToHost).count, r.total(CopyKind::DeviceToHost).bytes), (3, 2500));
    // Reports return every pair to the pool: at most three copies were ever in flight at once
    // between two reports (a call's chunks), so the pool never grew beyond three pairs.
    let pairs = profiler.pooled_pairs();
    assert!((1..=3).contains(&pairs), "{pairs} pairs pooled");
    profiler.reset();
    assert_eq!(profiler.report().unwrap().rows().count(), 0);
}

#[test]
#[serial] // a global observer counts every copy of the process
fn a_global_observer_sees_blocking_copies_and_detaches_on_drop() {
    let (_ctx, stream) = setup();
    assert!(!profile::active());
    let mut dev = DeviceBuffer::<u16>::zeroed(&stream, 300).unwrap();
    let profiler = Profiler::new();
    let guard = profiler.observe_all();
    assert!(profile::active());
    copy_h2d(&[4u16; 300], &mut dev).unwrap();
    let mut out = [0u16; 300];
    copy_d2h(&dev, &mut out).unwrap();
    assert_eq!(out, [4; 300]);
    drop(guard);
    assert!(!profile::active());
    copy_h2d(&[5u16; 300], &mut dev).unwrap();
    let r = profiler.report().unwrap();
    assert_eq!((r.total(CopyKind::HostToDevice).count, r.total(CopyKind::HostToDevice).bytes), (1, 600));
    assert_eq!(r.total(CopyKind::DeviceToHost).bytes, 600);
    assert!(r.total(CopyKind::DeviceToHost).device_time.as_nanos() > 0);
}

#[test]
#[serial] // a global observer counts every copy of the process
fn a_profiler_attached_twice_counts_each_copy_once() {
    let (_ctx, stream) = setup();
    let mut dev = DeviceBuffer::<u16>::zeroed(&stream, 300).unwrap();
    let host = PinnedBuffer::from_slice(stream.context(), &[6u16; 300]).unwrap();
    let profiler = Profiler::new();
    // Both attachments match the copy, and a clone is the same profiler.
    let (_one, _all, _clone) =
        (profiler.observe(&stream), profiler.observe_all(), profiler.clone().observe(&stream));
    stream.copy_h2d(&host, &mut dev).unwrap();
    let r = profiler.report().unwrap();
    assert_eq!((r.total(CopyKind::HostToDevice).count, r.total(CopyKind::HostToDevice).bytes), (1, 600));
}

#[test]
#[serial] // counts blocking copies on device 0's legacy stream, which other tests use too
fn observing_one_devices_legacy_stream_does_not_count_another_devices_copies() {
    let (ctx, stream) = setup();
    if !testing::needs_devices(2) {
        return;
    }
    let ctx1 = Device::get(1).unwrap().context().unwrap();
    let stream1 = Stream::non_blocking(&ctx1).unwrap();
    let mut dev0 = DeviceBuffer::<u8>::zeroed(&stream, 100).unwrap();
    let mut dev1 = DeviceBuffer::<u8>::zeroed(&stream1, 300).unwrap();
    stream.synchronize().unwrap();
    stream1.synchronize().unwrap();
    let profiler = Profiler::new();
    {
        // Both legacy streams have id 0; only device 0's is observed.
        let _on = profiler.observe(&Stream::legacy(&ctx));
        copy_h2d(&[1u8; 300], &mut dev1).unwrap();
        copy_h2d(&[2u8; 100], &mut dev0).unwrap();
    }
    let h2d = profiler.report().unwrap().total(CopyKind::HostToDevice);
    assert_eq!((h2d.count, h2d.bytes), (1, 100), "device 1's copy was counted");
}

/// Queues `n` observed memsets on `stream`, at most 100 in flight (a synchronisation every 100),
/// and returns the most copies `profiler` had pending at once.
fn most_pending_over(profiler: &Profiler, stream: &Stream, buf: &mut DeviceBuffer<u8>, n: usize) -> usize {
    let mut most_pending = 0;
    for i in 0..n {
        stream.memset_d8(buf, i as u8).unwrap();
        if i % 100 == 99 {
            stream.synchronize().unwrap();
        }
        most_pending = most_pending.max(profiler.pending_copies());
    }
    most_pending
}

#[test]
#[serial] // holds a gate, and a global observer counts every copy of the process
fn a_copy_held_on_one_stream_does_not_keep_every_later_copy_pending() {
    let (ctx, held) = setup();
    let other = Stream::non_blocking(&ctx).unwrap();
    let host = PinnedBuffer::from_slice(&ctx, &[1u8; 64]).unwrap();
    let mut on_held = DeviceBuffer::<u8>::zeroed(&held, 64).unwrap();
    let mut on_other = DeviceBuffer::<u8>::zeroed(&other, 64).unwrap();
    held.synchronize().unwrap();
    other.synchronize().unwrap();
    let profiler = Profiler::new();
    let observing = profiler.observe_all();
    let gate = common::hold(&held);
    held.copy_h2d(&host, &mut on_held).unwrap(); // stays queued until the gate opens
    let most_pending = most_pending_over(&profiler, &other, &mut on_other, 3000);
    // At most 100 copies on `other` and the held one are in flight at any time: once more than
    // 1024 are pending, every completed one is folded in and its events pooled again.
    assert!(most_pending <= 1025, "{most_pending} copies pending at once");
    assert!(profiler.pooled_pairs() > 0, "no event pair was returned to the pool");
    gate.release();
    drop(observing);
    let r = profiler.report().unwrap();
    assert_eq!(r.total(CopyKind::HostToDevice).count, 1);
    assert_eq!(r.total(CopyKind::Memset).count, 3000);
    assert_eq!(profiler.pending_copies(), 0);
}

#[test]
#[serial] // holds a gate
fn after_a_backlog_and_a_report_completed_copies_are_folded_again_past_1024() {
    let (ctx, first) = setup();
    // Three held streams of 1,000 copies each: a GPU's stream takes 1,021 queued copies or memsets
    // and the next one waits in the call (observed on an H100, 2026-11-24), so one held stream
    // cannot carry the whole backlog.
    let held = [first, Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap()];
    let other = Stream::non_blocking(&ctx).unwrap();
    let mut on_held: Vec<DeviceBuffer<u8>> =
        held.iter().map(|s| DeviceBuffer::<u8>::zeroed(s, 64).unwrap()).collect();
    let mut on_other = DeviceBuffer::<u8>::zeroed(&other, 64).unwrap();
    held.iter().for_each(|s| s.synchronize().unwrap());
    other.synchronize().unwrap();
    let profiler = Profiler::new();
    let observing = profiler.observe_all();
    // A backlog: 3,000 copies genuinely in flight raise the fold threshold past 4,000.
    let gates: Vec<_> = held.iter().map(common::hold).collect();
    for (s, buf) in held.iter().zip(&mut on_held) {
        for i in 0..1000 {
            s.memset_d8(buf, i as u8).unwrap();
        }
    }
    gates.into_iter().for_each(|g| g.release());
    assert_eq!(profiler.report().unwrap().total(CopyKind::Memset).count, 3000);
    // Then copies that complete: past 1,024 pending, every completed one is folded in again.
    let most_pending = most_pending_over(&profiler, &other, &mut on_other, 2000);
    assert!(most_pending <= 1025, "{most_pending} copies pending at once");
    drop(observing);
    assert_eq!(profiler.report().unwrap().total(CopyKind::Memset).count, 5000);
    assert_eq!(profiler.pending_copies(), 0);
}

#[test]
#[serial] // holds a gate
fn a_report_waiting_for_a_held_copy_does_not_block_copies_on_other_streams() {
    let (ctx, held) = setup();
    let other = Stream::non_blocking(&ctx).unwrap();
    let host = PinnedBuffer::from_slice(&ctx, &[1u8; 64]).unwrap();
    let mut on_held = DeviceBuffer::<u8>::zeroed(&held, 64).unwrap();
    let mut on_other = DeviceBuffer::<u8>::zeroed(&other, 64).unwrap();
    held.synchronize().unwrap();
    other.synchronize().unwrap();
    let profiler = Profiler::new();
    let _on_held = profiler.observe(&held);
    let _on_other = profiler.observe(&other);
    let gate = common::hold(&held);
    held.copy_h2d(&host, &mut on_held).unwrap(); // stays queued until the gate opens
    let (go, opened) = std::sync::mpsc::channel::<()>();
    let gave_up = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // Opens the gate when told, or after a long while if this test is stuck (so that a
        // regression fails instead of hanging).
        let gave_up = &gave_up;
        s.spawn(move || {
            if opened.recv_timeout(std::time::Duration::from_secs(10)).is_err() {
                gave_up.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            gate.release();
        });
        let reporter = s.spawn(|| profiler.report());
        // The report has taken the pending copy (it waits for it now), or has finished.
        while profiler.pending_copies() != 0 {
            std::thread::yield_now();
        }
        other.memset_d8(&mut on_other, 5).unwrap(); // observed: records events under the lock
        // Before the gate opens, the held copy and so the report cannot have finished.
        let blocked = gave_up.load(std::sync::atomic::Ordering::SeqCst);
        let _ = go.send(());
        assert!(!blocked, "an observed copy waited for a report to finish");
        let r = reporter.join().unwrap().unwrap();
        assert_eq!(r.total(CopyKind::HostToDevice).count, 1);
    });
    let r = profiler.report().unwrap();
    assert_eq!((r.total(CopyKind::HostToDevice).count, r.total(CopyKind::Memset).count), (1, 1));
}

/// Timed events are recorded only for observed copies: with no profiler attached, or one attached
/// to another stream, a copy records only the events it records anyway (the same number in both);
/// observed, exactly two more per copy.
#[test]
#[parallel]
fn timed_events_are_recorded_only_while_the_copy_is_observed() {
    let Some((ctx, stream, ctl)) = sim_setup("counts driver calls: simulator only") else { return };
    let host = PinnedBuffer::from_slice(&ctx, &[6u8; 256]).unwrap();
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 256).unwrap();
    let other = Stream::non_blocking(&ctx).unwrap();
    let profiler = Profiler::new();
    let mut records_for = |copies: usize| {
        let before = ctl.calls_on_this_thread("cuEventRecord");
        for _ in 0..copies {
            stream.copy_h2d(&host, &mut dev).unwrap();
        }
        ctl.calls_on_this_thread("cuEventRecord") - before
    };
    let off = records_for(10);
    let elsewhere = {
        let _on = profiler.observe(&other);
        records_for(10)
    };
    let observed = {
        let _on = profiler.observe(&stream);
        records_for(10)
    };
    let after = records_for(10);
    assert_eq!(elsewhere, off, "a profiler on another stream records nothing for this one");
    assert_eq!(observed, off + 2 * 10, "a start and an end event per observed copy");
    assert_eq!(after, off, "nothing once the guard is gone");
    let r = profiler.report().unwrap();
    assert_eq!((r.total(CopyKind::HostToDevice).count, r.total(CopyKind::HostToDevice).bytes), (10, 2560));
    assert_eq!(dev.to_vec().unwrap(), vec![6u8; 256]);
}

/// `PitchedBuffer::zeroed` and `zeroed_3d` clear their allocation with a memset that a profiler
/// attached to the stream counts, padding included, like every other memset of the crate.
#[test]
#[parallel]
fn the_memset_of_a_zeroed_pitched_buffer_is_profiled() {
    let (_ctx, stream) = setup();
    let profiler = Profiler::new();
    let (flat, cube) = {
        let _on = profiler.observe(&stream);
        (
            PitchedBuffer::<u16>::zeroed(&stream, 32, 8).unwrap(),
            PitchedBuffer::<u32>::zeroed_3d(&stream, 5, 3, 2).unwrap(),
        )
    };
    let r = profiler.report().unwrap();
    let memset = r.total(CopyKind::Memset);
    let expected = flat.pitch_bytes() * 8 + cube.pitch_bytes() * 3 * 2;
    assert_eq!((memset.count, memset.bytes), (2, expected as u64), "{r}");
    assert_eq!(r.rows().count(), 1, "nothing but the two memsets: {r}");
    assert_eq!(flat.to_vec().unwrap(), vec![0u16; 32 * 8]);
    assert_eq!(cube.to_vec().unwrap(), vec![0u32; 5 * 3 * 2]);
}

/// When folding completed copies fails (here `cuEventElapsedTime`, injected), the profiler warns
/// with its lock let go: a subscriber that reads the profiler from inside the warning gets an
/// answer instead of deadlocking the copying thread. Under a watchdog, since the bug hangs.
#[test]
#[parallel]
fn a_failed_fold_warns_to_a_subscriber_that_reads_the_profiler() {
    let Some((_ctx, stream, ctl)) = sim_setup("injects a driver fault: simulator only") else { return };
    testing::within_watchdog("a failed fold, with a subscriber reading the profiler", move || {
        let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 64).unwrap();
        let profiler = Profiler::new();
        // Each `warn` event's message, with the pending count read from inside it (every event
        // reads the profiler).
        let warnings = Arc::new(Mutex::new(Vec::<(String, usize)>::new()));
        let subscriber = {
            let (profiler, warnings) = (profiler.clone(), warnings.clone());
            OnEvent(move |event: &tracing::Event<'_>| {
                let pending = profiler.pending_copies();
                if *event.metadata().level() == tracing::Level::WARN {
                    warnings.lock().unwrap().push((message(event), pending));
                }
            })
        };
        // More than the 1024 pending copies past which recording a copy folds the completed ones.
        const COPIES: usize = 1025;
        {
            let _on = profiler.observe(&stream);
            for _ in 0..COPIES - 1 {
                stream.memset_d8(&mut dev, 1).unwrap();
            }
            // Every copy so far completes, so that the fold reads (and fails on) their times.
            stream.synchronize().unwrap();
            let rule = ctl.inject_fault(cumem_sys::sim_control::FaultRule {
                function: "cuEventElapsedTime".into(),
                nth: 1,
                code: cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN,
                times: 0,
                this_thread_only: true,
            });
            cumem_sys::testing::with_subscriber(subscriber, || stream.memset_d8(&mut dev, 2).unwrap());
            ctl.remove_fault(rule);
        }
        let warnings = warnings.lock().unwrap().clone();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].0.contains("reading a profiled copy's events failed"), "{warnings:?}");
        assert_eq!(warnings[0].1, COPIES, "every copy whose time could not be read stays pending");
        let r = profiler.report().unwrap();
        assert_eq!(r.total(CopyKind::Memset).count, COPIES as u64, "{r}");
        assert_eq!(profiler.pending_copies(), 0);
        assert_eq!(dev.to_vec().unwrap(), vec![2u8; 64]);
    });
}

/// A profiling failure (here `cuEventRecord` of the profiler's start event, injected) is logged
/// once the copy has let go of cumem's locks: a subscriber that, on the warning, copies from the
/// same pinned buffer on another thread and waits for that thread would otherwise wait for the
/// copying thread's own lock on the buffer's tracker. Both the 1D and the 2D path; under a
/// watchdog, since the bug hangs.
#[test]
#[parallel]
fn a_profiling_failure_is_logged_after_the_copy_let_go_of_the_buffers_locks() {
    let Some((ctx, stream, ctl)) = sim_setup("injects a driver fault: simulator only") else { return };
    testing::within_watchdog(
        "a profiling failure logged to a subscriber that copies the same buffer",
        move || {
            let host = Arc::new(PinnedBuffer::from_slice(&ctx, &(0..256u32).collect::<Vec<_>>()).unwrap());
            let other = Stream::non_blocking(&ctx).unwrap();
            // Each warning's message, and what the other thread's copy of the same buffer saw.
            let seen = Arc::new(Mutex::new(Vec::<(String, Vec<u32>)>::new()));
            let subscriber = {
                let (host, seen) = (host.clone(), seen.clone());
                OnEvent(move |event: &tracing::Event<'_>| {
                    if *event.metadata().level() != tracing::Level::WARN {
                        return;
                    }
                    let copied = common::copied_on_another_thread(&other, &host);
                    seen.lock().unwrap().push((message(event), copied));
                })
            };
            let mut flat = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
            let mut img = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
            let profiler = Profiler::new();
            let _on = profiler.observe(&stream);
            let start_fails = || {
                ctl.inject_fault(cumem_sys::sim_control::FaultRule {
                    function: "cuEventRecord".into(),
                    nth: 1,
                    code: cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN,
                    times: 1,
                    this_thread_only: true,
                })
            };
            cumem_sys::testing::with_subscriber(subscriber, || {
                let rule = start_fails();
                stream.copy_h2d(&*host, &mut flat).unwrap();
                ctl.remove_fault(rule);
                let rule = start_fails();
                let (src, mut dst) = (Pitched::new(&*host, 16), Pitched::new(img.as_mut_slice(), 16));
                stream.copy_2d(&src, &mut dst, Copy2D::new(16, 16)).unwrap();
                ctl.remove_fault(rule);
            });
            let expected: Vec<u32> = (0..256).collect();
            let seen = seen.lock().unwrap().clone();
            assert_eq!(seen.len(), 2, "one warning per copy: {seen:?}");
            for (message, copied) in &seen {
                assert!(message.contains("profiling a copy failed"), "{message}");
                assert_eq!(copied, &expected);
            }
            assert_eq!(flat.to_vec().unwrap(), expected);
            assert_eq!(img.to_vec().unwrap(), expected);
            let r = profiler.report().unwrap();
            assert_eq!(
                (r.total(CopyKind::HostToDevice).count, r.total(CopyKind::Copy2D).count),
                (0, 0),
                "{r}"
            );
        },
    );
}

/// A fault on this thread's `nth` next call of `function`, once.
fn fails_once(ctl: &cumem_sim::control::Control, function: &str, nth: u64) -> cumem_sim::control::FaultId {
    ctl.inject_fault(cumem_sys::sim_control::FaultRule {
        function: function.into(),
        nth,
        code: cumem_sys::sys::CUresult::CUDA_ERROR_UNKNOWN,
        times: 1,
        this_thread_only: true,
    })
}

/// Each warning's message and what the other thread's copy read.
type Seen = Arc<Mutex<Vec<(String, Vec<u32>)>>>;

/// A subscriber that, on each warning, copies `host` on another thread (which waits for any lock
/// this thread holds on the buffer's tracker) and keeps the message with what that copy read.
fn copying_on_warnings(
    ctx: &Context,
    host: &Arc<PinnedBuffer<u32>>,
) -> (impl tracing::Subscriber + Send + Sync + 'static, Seen) {
    let other = Stream::non_blocking(ctx).unwrap();
    let seen = Seen::default();
    let (host, kept) = (host.clone(), seen.clone());
    let subscriber = OnEvent(move |event: &tracing::Event<'_>| {
        if *event.metadata().level() == tracing::Level::WARN {
            let copied = common::copied_on_another_thread(&other, &host);
            kept.lock().unwrap().push((message(event), copied));
        }
    });
    (subscriber, seen)
}

/// A copy that ran but whose end event could not be recorded (here the end event's
/// `cuEventRecord`, injected; the start event's succeeds) is not counted, and says so, as when
/// the start event cannot be recorded: a warning, logged once the copy let go of the buffer's
/// locks (the subscriber copies the same pinned buffer on another thread). Under a watchdog,
/// since a warning logged under the lock hangs.
#[test]
#[parallel]
fn a_copy_whose_end_event_cannot_be_recorded_warns_that_it_is_not_counted() {
    let Some((ctx, stream, ctl)) = sim_setup("injects a driver fault: simulator only") else { return };
    testing::within_watchdog(
        "a failed end record, logged to a subscriber that copies the same buffer",
        move || {
            let expected: Vec<u32> = (0..256).collect();
            let host = Arc::new(PinnedBuffer::from_slice(&ctx, &expected).unwrap());
            let (subscriber, seen) = copying_on_warnings(&ctx, &host);
            let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
            let profiler = Profiler::new();
            let _on = profiler.observe(&stream);
            // Counted, and its pair back in the pool: the copy below records events and makes none.
            stream.copy_h2d(&*host, &mut dev).unwrap();
            assert_eq!(profiler.report().unwrap().total(CopyKind::HostToDevice).count, 1);
            stream.memset_d8(&mut dev, 0).unwrap();
            let records = ctl.calls_on_this_thread("cuEventRecord");
            let rule = fails_once(&ctl, "cuEventRecord", 2);
            cumem_sys::testing::with_subscriber(subscriber, || stream.copy_h2d(&*host, &mut dev).unwrap());
            ctl.remove_fault(rule);
            assert_eq!(
                ctl.calls_on_this_thread("cuEventRecord") - records,
                2,
                "the start event's record, then the end event's (which failed)"
            );
            let seen = seen.lock().unwrap().clone();
            assert_eq!(seen.len(), 1, "{seen:?}");
            assert!(seen[0].0.contains("profiling a copy failed; it is not counted"), "{seen:?}");
            assert_eq!(seen[0].1, expected);
            assert_eq!(dev.to_vec().unwrap(), expected, "the copy itself ran");
            let r = profiler.report().unwrap();
            assert_eq!(r.total(CopyKind::HostToDevice).count, 1, "only the first copy: {r}");
            assert_eq!((profiler.pending_copies(), profiler.pooled_pairs()), (0, 2), "the pair is reused");
        },
    );
}

/// A new pair of profiling events whose second event cannot be made (here the second
/// `cuEventCreate`, injected) misses the copy, and the first event, already made, is destroyed
/// once the copy has let go of the buffer's locks: its destroy (failed too, injected) warns to a
/// subscriber that copies the same pinned buffer on another thread. Serial: the event whose
/// destroy failed is found among the live ones afterwards, to destroy it. Under a watchdog.
#[test]
#[serial] // finds the leaked event by comparing the live events before and after
fn a_half_made_event_pair_is_destroyed_after_the_copy_let_go_of_the_buffers_locks() {
    let Some((ctx, stream, ctl)) = sim_setup("injects driver faults: simulator only") else { return };
    let before: Vec<u64> = ctl.live_report().events.iter().map(|e| e.handle).collect();
    let c = ctx.clone();
    testing::within_watchdog("a half-made event pair destroyed under the buffer's lock", move || {
        let expected: Vec<u32> = (0..256).collect();
        let host = Arc::new(PinnedBuffer::from_slice(&c, &expected).unwrap());
        let (subscriber, seen) = copying_on_warnings(&c, &host);
        let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
        // Unobserved, so that the buffers already know the stream: the copy below makes no
        // events but the profiler's.
        stream.copy_h2d(&*host, &mut dev).unwrap();
        stream.memset_d8(&mut dev, 0).unwrap();
        let profiler = Profiler::new();
        let _on = profiler.observe(&stream);
        let creates = ctl.calls_on_this_thread("cuEventCreate");
        let create = fails_once(&ctl, "cuEventCreate", 2);
        let destroy = fails_once(&ctl, "cuEventDestroy_v2", 1);
        cumem_sys::testing::with_subscriber(subscriber, || stream.copy_h2d(&*host, &mut dev).unwrap());
        ctl.remove_fault(create);
        ctl.remove_fault(destroy);
        assert_eq!(ctl.calls_on_this_thread("cuEventCreate") - creates, 2, "the pair's two events");
        let seen = seen.lock().unwrap().clone();
        let messages: Vec<&str> = seen.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(messages, ["profiling a copy failed; it is not counted", "destroying an event failed"]);
        for (_, copied) in &seen {
            assert_eq!(copied, &expected);
        }
        assert_eq!(dev.to_vec().unwrap(), expected, "the copy itself ran");
        let r = profiler.report().unwrap();
        assert_eq!(r.total(CopyKind::HostToDevice).count, 0, "{r}");
        assert_eq!(profiler.pooled_pairs(), 0, "no pair was made");
    });
    // The event whose destroy failed stays with the driver, and nothing else: destroyed here.
    let ctl = testing::sim_control().expect("the simulator, checked above");
    let leaked: Vec<u64> =
        ctl.live_report().events.iter().map(|e| e.handle).filter(|h| !before.contains(h)).collect();
    assert_eq!(leaked.len(), 1, "{leaked:?}");
    ctx.bind().unwrap();
    // SAFETY: the handle is of a live event of the current context, which nothing else holds (its
    // `Event` was dropped when the destroy failed).
    let code = unsafe { cumem_core::sys::cuEventDestroy_v2(leaked[0] as cumem_core::sys::CUevent) };
    assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
}
