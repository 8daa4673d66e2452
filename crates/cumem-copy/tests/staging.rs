//! Copies of pageable slices through a `StagingRing`: bitwise round trips at every size that
//! matters to the ring (empty, one element, around one chunk, many chunks, chunks that split
//! elements), the overlap of host fills with queued copies shown by ordering (a gate holds the
//! stream, so the copies of earlier chunks are certainly still queued while later ones are
//! filled; downloads of every chunk are queued before the first is copied out), and the soundness rules: the caller's slice is free on return, a chunk is never
//! overwritten while a copy still reads it (the simulator starts work 20 ms late, so an early
//! reuse would upload the wrong bytes), and dropping the ring waits before freeing; a panic
//! between queueing a chunk's copy and recording its event leaves the chunk guarded.
//!
//! The gated tests are `#[serial]` (see `common`); the others are `#[parallel]`.

mod common;

use std::sync::atomic::Ordering;

use bytemuck::Pod;
use common::{OnEvent, hold};
use cumem_copy::{MAX_FILL_THREADS, Profiler, StagingConfig, StagingRing, StreamCopy};
use cumem_core::sys::CUresult;
use cumem_core::{Context, Device, DeviceBuffer, Error, Stream};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use serial_test::{parallel, serial};

const SIM: &str = "devices=2,latency_us=20000";

fn setup() -> (Context, Stream) {
    testing::init_with(SIM);
    let ctx = Device::get(0).unwrap().context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    (ctx, stream)
}

fn ring_of(ctx: &Context) -> StagingRing {
    ring(ctx, 100, 2)
}

fn ring(ctx: &Context, chunk_bytes: usize, chunks: usize) -> StagingRing {
    StagingRing::with_config(ctx, StagingConfig { chunk_bytes, chunks }).unwrap()
}

/// Distinct bytes everywhere, so that a misplaced or stale chunk shows.
fn pattern<T: Pod>(n: usize, seed: u8) -> Vec<T> {
    let mut v = vec![T::zeroed(); n];
    for (i, b) in bytemuck::cast_slice_mut::<T, u8>(&mut v).iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ (i as u8) ^ seed;
    }
    v
}

/// Up and down through the ring, and through a fresh device buffer each time.
fn round_trip<T: Pod + PartialEq + std::fmt::Debug>(stream: &Stream, ring: &mut StagingRing, n: usize) {
    let data = pattern::<T>(n, n as u8);
    let mut dev = DeviceBuffer::<T>::zeroed(stream, n).unwrap();
    ring.copy_h2d(stream, &data, &mut dev).unwrap();
    let mut back = vec![T::zeroed(); n];
    ring.copy_d2h(stream, &dev, &mut back).unwrap();
    assert!(back == data, "{} values of {}: the round trip changed them", n, std::any::type_name::<T>());
    // The device holds the data (not only the ring's chunks).
    assert!(dev.to_vec().unwrap() == data);
}

/// The sizes around one chunk, in elements of `T` (a chunk of 60 bytes holds 20 values of 3 bytes,
/// 10 of 6, 7.5 of 8: the last splits values between chunks).
fn sizes(chunk_bytes: usize, elem: usize) -> Vec<usize> {
    let per = chunk_bytes / elem;
    vec![0, 1, per - 1, per, per + 1, 2 * per + 1, 13 * per + 3]
}

#[test]
#[parallel]
fn every_size_round_trips_bitwise_with_odd_element_types() {
    let (ctx, stream) = setup();
    const CHUNK: usize = 60;
    let mut ring = ring(&ctx, CHUNK, 3);
    for n in sizes(CHUNK, 3) {
        round_trip::<[u8; 3]>(&stream, &mut ring, n);
    }
    for n in sizes(CHUNK, 6) {
        round_trip::<[u16; 3]>(&stream, &mut ring, n);
    }
    for n in sizes(CHUNK, 8) {
        round_trip::<u64>(&stream, &mut ring, n);
    }
    // A byte-exact chunk edge, with values that split across chunks (8 bytes per value, 60 per chunk).
    round_trip::<u64>(&stream, &mut ring, 15);
    // The ring allocated its three chunks once and reused them for every call.
    let stats = ring.stats();
    assert_eq!(stats.pinned_bytes, 3 * CHUNK);
    let calls = 2 * (3 * sizes(CHUNK, 3).iter().filter(|&&n| n > 0).count() + 1) as u64;
    assert_eq!(stats.calls, calls);
}

#[test]
#[parallel]
fn fills_split_over_threads_round_trip_bitwise() {
    let (ctx, stream) = setup();
    // 256 KiB chunks in four parts of 64 KiB each; the last chunk of each copy is a short one whose
    // parts are uneven (or one part only).
    let mut ring = ring(&ctx, 256 << 10, 3);
    ring.set_fill_threads(4);
    assert_eq!(ring.fill_threads(), 4);
    for n in [1, (256 << 10) / 3 + 1, 350_001] {
        round_trip::<[u8; 3]>(&stream, &mut ring, n);
    }
    round_trip::<u64>(&stream, &mut ring, (1 << 20) / 8 + 7);
    ring.set_fill_threads(0);
    assert_eq!(ring.fill_threads(), 1, "0 threads means the calling one");
    // A thread count far above the parts a chunk has room for: capped, and the fills still land.
    ring.set_fill_threads(65_539);
    assert_eq!(ring.fill_threads(), MAX_FILL_THREADS);
    round_trip::<u8>(&stream, &mut ring, 3 * (256 << 10) + 65_539);
}

#[test]
#[parallel]
fn chunk_counts_and_bytes_are_reported_by_value() {
    let (ctx, stream) = setup();
    let mut ring = ring(&ctx, 100, 2);
    let data = pattern::<u8>(1001, 7);
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 1001).unwrap();
    ring.copy_h2d(&stream, &data, &mut dev).unwrap();
    let mut back = vec![0u8; 1001];
    ring.copy_d2h(&stream, &dev, &mut back).unwrap();
    assert_eq!(back, data);
    let s = ring.stats();
    assert_eq!((s.calls, s.chunks, s.bytes, s.pinned_bytes), (2, 22, 2002, 200));
    // Empty copies count nothing and allocate nothing.
    let mut empty = ring_of(&ctx);
    empty.copy_h2d::<u8>(&stream, &[], &mut dev.slice_mut(0..0).unwrap()).unwrap();
    assert_eq!(empty.stats(), Default::default());
}

#[test]
#[serial] // holds a gate
fn chunk_k_plus_1_is_filled_while_chunk_k_is_still_queued_and_the_source_is_free_on_return() {
    let (ctx, stream) = setup();
    let mut ring = ring(&ctx, 256, 4);
    let mut data = pattern::<u32>(256, 3); // 1 KiB: exactly the ring's four chunks, no reuse
    let expected = data.clone();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 256).unwrap();
    stream.synchronize().unwrap();
    let gate = hold(&stream);
    ring.copy_h2d(&stream, &data, &mut dev).unwrap();
    // Nothing on the stream has run, yet every chunk was filled and queued: chunks 1, 2 and 3 were
    // each filled while the copy of the chunk before was queued behind the gate.
    let s = ring.stats();
    assert_eq!((s.chunks, s.overlapped, s.reuse_waits), (4, 3, 0));
    // The call returned, so the caller may reuse its slice before the device has copied anything.
    data.fill(0);
    gate.release();
    assert_eq!(dev.to_vec().unwrap(), expected);
}

/// Device→host overlaps the other way round: the ring queues the download of every chunk it has
/// before it waits for the first, so while the host copies chunk *k* out to the caller's slice the
/// downloads of the chunks after it are queued or running. With the stream held, all four
/// downloads are queued and the call is still waiting for the first: nothing was copied out yet.
#[test]
#[serial] // holds a gate, and counts a driver call process-wide
fn every_chunks_download_is_queued_before_the_first_is_copied_out() {
    let (ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("counts driver calls: simulator only");
    };
    let mut ring = ring(&ctx, 256, 4);
    let data = pattern::<u8>(1024, 5); // four chunks
    let dev = DeviceBuffer::<u8>::from_slice(&stream, &data).unwrap();
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 1024];
    let before = ctl.calls("cuMemcpyDtoHAsync_v2");
    let gate = hold(&stream);
    let (queued, returned_early, stats) = std::thread::scope(|scope| {
        let copying = scope.spawn(|| {
            ring.copy_d2h(&stream, &dev, &mut back).unwrap();
            ring.stats()
        });
        // A bound so that a ring that waits after each download fails here instead of hanging.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut queued = 0;
        while std::time::Instant::now() < deadline {
            queued = ctl.calls("cuMemcpyDtoHAsync_v2") - before;
            if queued >= 4 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let returned_early = copying.is_finished();
        gate.release();
        (queued, returned_early, copying.join().unwrap())
    });
    assert_eq!(queued, 4, "every chunk's download was queued while the first had not run");
    assert!(!returned_early, "the call waited for the held downloads");
    assert_eq!((stats.chunks, stats.bytes), (4, 1024));
    assert_eq!(back, data);
}

#[test]
#[parallel]
fn a_chunk_is_not_refilled_while_its_copy_is_still_queued() {
    // Two chunks for 16 pieces: every piece after the second reuses a chunk whose copy the
    // simulator starts only 20 ms after it was queued. Refilling early would upload later bytes.
    let (ctx, stream) = setup();
    let mut ring = ring(&ctx, 64, 2);
    let data = pattern::<u16>(16 * 32, 9);
    let mut dev = DeviceBuffer::<u16>::zeroed(&stream, data.len()).unwrap();
    ring.copy_h2d(&stream, &data, &mut dev).unwrap();
    assert_eq!(dev.to_vec().unwrap(), data);
    assert_eq!(ring.stats().chunks, 16);
}

#[test]
#[parallel]
fn dropping_the_ring_with_copies_in_flight_waits_and_frees_its_chunks() {
    let (ctx, stream) = setup();
    let data = pattern::<u8>(4096, 1);
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 4096).unwrap();
    {
        let mut ring = ring(&ctx, 1024, 2);
        ring.copy_h2d(&stream, &data, &mut dev).unwrap();
    } // dropped while its last copies are queued (20 ms latency)
    assert_eq!(dev.to_vec().unwrap(), data);
    if let Some(ctl) = testing::sim_control() {
        let mine = ctl.violations_on_this_thread();
        assert!(mine.is_empty(), "freeing chunks in use: {mine:?}");
    }
}

#[test]
#[parallel]
fn bad_input_is_a_typed_error_before_any_copy() {
    let (ctx, stream) = setup();
    assert!(matches!(
        StagingRing::with_config(&ctx, StagingConfig { chunk_bytes: 64, chunks: 1 }),
        Err(Error::InvalidValue { .. })
    ));
    assert!(matches!(
        StagingRing::with_config(&ctx, StagingConfig { chunk_bytes: 0, chunks: 4 }),
        Err(Error::InvalidValue { .. })
    ));
    let mut ring = ring(&ctx, 64, 2);
    let mut dev = DeviceBuffer::<u32>::from_slice(&stream, &[5; 8]).unwrap();
    assert!(matches!(
        ring.copy_h2d(&stream, &[1u32; 9], &mut dev),
        Err(Error::LengthMismatch { expected: 8, actual: 9 })
    ));
    assert!(matches!(
        ring.copy_d2h(&stream, &dev, &mut [0u32; 7]),
        Err(Error::LengthMismatch { expected: 7, actual: 8 })
    ));
    if testing::needs_devices(2) {
        let other = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
        assert!(matches!(
            ring.copy_h2d(&other, &[1u32; 8], &mut dev),
            Err(Error::WrongDevice { expected: 0, actual: 1 })
        ));
    }
    assert_eq!(ring.stats(), Default::default(), "nothing was copied or allocated");
    assert_eq!(dev.to_vec().unwrap(), [5; 8]);
}

#[test]
#[serial] // holds a gate
fn a_panic_after_a_chunk_copy_is_queued_leaves_the_chunk_guarded() {
    let (ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let mut ring = ring(&ctx, 256, 2);
    let first = pattern::<u8>(256, 1);
    let second = pattern::<u8>(256, 2);
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 256).unwrap();
    let mut dev2 = DeviceBuffer::<u8>::zeroed(&stream, 256).unwrap();
    // A profiler with 1024 copies pending reads their events on the next copy it observes: make
    // that read fail, and the warning it logs panic, inside the chunk copy's profiling after the
    // copy was queued and before the chunk's event is recorded.
    let profiler = Profiler::new();
    let observing = profiler.observe(&stream);
    for _ in 0..1024 {
        stream.memset_d8(&mut dev2, 0).unwrap();
    }
    stream.synchronize().unwrap();
    let gate = hold(&stream);
    let rule = ctl.inject_fault(FaultRule {
        function: "cuEventQuery".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 1,
        this_thread_only: true,
    });
    // Panics on the first `warn` event it sees, then ignores everything: a subscriber that
    // misbehaves once.
    let panicked_once = std::sync::atomic::AtomicBool::new(false);
    let subscriber = OnEvent(move |event: &tracing::Event<'_>| {
        if *event.metadata().level() == tracing::Level::WARN && !panicked_once.swap(true, Ordering::Relaxed) {
            panic!("subscriber panics on a warning");
        }
    });
    let panicked = cumem_sys::testing::with_subscriber(subscriber, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ring.copy_h2d(&stream, &first, &mut dev)))
    });
    ctl.remove_fault(rule);
    drop(observing);
    assert!(panicked.is_err(), "the subscriber did not panic: {panicked:?}");
    // The first copy is still held behind the gate. The next call must wait for it before
    // refilling the chunk (the gate opens from another thread meanwhile); had it refilled the
    // chunk at once, `dev` would receive the second call's bytes.
    let opener = gate.release_after(std::time::Duration::from_millis(300));
    ring.copy_h2d(&stream, &second, &mut dev2).unwrap();
    opener.join().unwrap();
    assert_eq!(dev.to_vec().unwrap(), first, "the chunk was refilled while its copy was queued");
    assert_eq!(dev2.to_vec().unwrap(), second);
    let mine = ctl.violations_on_this_thread();
    assert!(mine.is_empty(), "{mine:?}");
}

#[test]
#[parallel]
fn a_chunk_event_that_cannot_be_recorded_fails_the_call_and_the_ring_recovers() {
    let (ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let mut ring = ring(&ctx, 256, 2);
    let first = pattern::<u8>(1024, 3);
    let second = pattern::<u8>(1024, 4);
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 1024).unwrap();
    let mut dev2 = DeviceBuffer::<u8>::zeroed(&stream, 1024).unwrap();
    stream.synchronize().unwrap();
    let records = ctl.calls_on_this_thread("cuEventRecord");
    // The first chunk's copy is queued, then recording its event fails: nothing says when the
    // chunk is free, so the ring must wait for the whole stream before anything reuses it.
    let rule = ctl.inject_fault(FaultRule {
        function: "cuEventRecord".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 1,
        this_thread_only: true,
    });
    let failed = ring.copy_h2d(&stream, &first, &mut dev);
    ctl.remove_fault(rule);
    assert!(
        matches!(failed, Err(Error::Cuda { code: CUresult::CUDA_ERROR_LAUNCH_FAILED, .. })),
        "{failed:?}"
    );
    assert_eq!(ctl.calls_on_this_thread("cuEventRecord"), records + 1, "the call went on after the failure");
    assert_eq!(ring.stats().calls, 0, "a failed call is not counted");
    // The next call reuses both chunks at once. The failed call's first chunk copy was queued
    // (the simulator runs it 20 ms later) and must still read the bytes it was given: the ring
    // waited for it before refilling the chunk with the second call's.
    ring.copy_h2d(&stream, &second, &mut dev2).unwrap();
    assert_eq!(dev.to_vec().unwrap()[..256], first[..256], "the chunk was refilled under its queued copy");
    assert_eq!(dev2.to_vec().unwrap(), second);
    let mut back = vec![0u8; 1024];
    ring.copy_d2h(&stream, &dev2, &mut back).unwrap();
    assert_eq!(back, second);
    let s = ring.stats();
    assert_eq!((s.calls, s.bytes, s.pinned_bytes), (2, 2048, 512));
    drop(ring); // freed, not leaked: the leak check at exit would report the chunks
    let mine = ctl.violations_on_this_thread();
    assert!(mine.is_empty(), "{mine:?}");
}

#[test]
#[parallel]
fn a_ring_whose_failed_copy_cannot_be_waited_for_is_not_ready_until_it_can() {
    let (ctx, stream) = setup();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let mut ring = ring(&ctx, 256, 2);
    let data = pattern::<u8>(1024, 5);
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 1024).unwrap();
    stream.synchronize().unwrap();
    // A chunk's copy is queued, its event cannot be recorded, and the stream cannot be waited
    // for either: nothing says when the chunk is free again.
    let fault = |function: &str, times| {
        ctl.inject_fault(FaultRule {
            function: function.into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
            times,
            this_thread_only: true,
        })
    };
    let (record, sync) = (fault("cuEventRecord", 1), fault("cuStreamSynchronize", 0));
    assert!(ring.copy_h2d(&stream, &data, &mut dev).is_err());
    ctl.remove_fault(record);
    let refused = ring.copy_h2d(&stream, &data, &mut dev);
    assert!(matches!(refused, Err(Error::NotReady { .. })), "{refused:?}");
    ctl.remove_fault(sync);
    // Once the wait succeeds the ring works again.
    ring.copy_h2d(&stream, &data, &mut dev).unwrap();
    assert_eq!(dev.to_vec().unwrap(), data);
    assert_eq!(ring.stats().calls, 1);
}
