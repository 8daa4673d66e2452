//! A copy from page-locked memory holds the host memory's tracker locked while it orders and
//! queues the device side. When that ordering lets go of the last handle of a stream the program
//! dropped (a stream order kept it: the device buffer's, or the host memory's own), the stream is
//! destroyed once the tracker is let go of: `cuStreamDestroy` (and the `cuEventDestroy` of the stream's marker) waits behind another
//! thread's `cuMemFree` on a real driver (docs/observed-on-gpu.md, measured 2026-11-24), and a host
//! function that needs the tracker (host access to the memory, which makes no driver call) while
//! that free waits for it would deadlock with the copy.
//!
//! Seen through the warning of a destroy that fails (the simulator's fault injection), logged
//! where the destroy happens: a thread the subscriber starts must get the tracker then. Once the
//! simulator holds `cuStreamDestroy` behind a free as the driver does, the same scene with a
//! host function taking the tracker is a deadlock rather than a late answer.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, HostMemory, MappedBuffer, PinnedBuffer, Stream, sys};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing::{self, OnEvent, event_message, within_watchdog};
use serial_test::serial;

const DESTROY_FAILED: &str = "destroying a stream failed";

/// What a test's scene makes: the host memory, the device buffer, and the handle of the stream
/// whose last handle the scene left to a stream order.
type Scene<H> = (Arc<H>, DeviceBuffer<u8>, u64);

/// The threads a subscriber started, joined at the end.
type Threads = Mutex<Vec<std::thread::JoinHandle<()>>>;

/// Whether another thread gets a shared host borrow of `host` (which takes its tracker) within
/// two seconds, and its first value if so (`first` borrows it). The thread is left to finish either
/// way (joined by the caller).
fn borrowed_from_another_thread<H: Send + Sync + 'static>(
    host: &Arc<H>,
    first: fn(&H) -> u8,
    threads: &Threads,
) -> Option<u8> {
    let (tx, rx) = mpsc::channel();
    let h = host.clone();
    threads.lock().unwrap().push(std::thread::spawn(move || {
        let _ = tx.send(first(&h));
    }));
    rx.recv_timeout(Duration::from_secs(2)).ok()
}

/// `scene` makes page-locked memory of 4096 sevens, a device buffer whose order holds the last
/// handle of a stream it dropped, and that stream's handle; a copy from the host memory to the
/// device buffer on another stream then lets go of that stream, whose destroy fails. Checks that
/// another thread could borrow the host memory (`first`) from the failure's warning, that the copy
/// ran, and destroys the stream that failed to be.
fn the_tracker_is_free_when_the_stream_is_destroyed<H: HostMemory<u8> + Send + Sync + 'static>(
    scene: fn(&Context) -> Scene<H>,
    first: fn(&H) -> u8,
) {
    testing::init();
    // Injecting failures needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return;
    };
    within_watchdog("a copy from page-locked memory whose stream destroy failed", move || {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let b = Stream::non_blocking(&ctx).unwrap();
        let (host, mut dev, dropped) = scene(&ctx);
        let seen: Arc<Mutex<Vec<Option<u8>>>> = Arc::default();
        let threads: Arc<Threads> = Arc::default();
        let subscriber = {
            let (host, seen, threads) = (host.clone(), seen.clone(), threads.clone());
            OnEvent(move |event: &tracing::Event<'_>| {
                if event_message(event) == DESTROY_FAILED {
                    seen.lock().unwrap().push(borrowed_from_another_thread(&host, first, &threads));
                }
            })
        };
        testing::with_subscriber(subscriber, || {
            let rule = ctl.inject_fault(FaultRule {
                this_thread_only: true,
                ..FaultRule::nth_call("cuStreamDestroy_v2", 1, sys::CUresult::CUDA_ERROR_UNKNOWN)
            });
            // On `b`: waits for the dropped stream, then lets go of it (`b` stands for its work).
            b.copy_h2d(&*host, &mut dev).unwrap();
            ctl.remove_fault(rule);
        });
        for t in std::mem::take(&mut *threads.lock().unwrap()) {
            t.join().unwrap();
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [Some(7)],
            "one failed destroy, with the host memory's tracker free for another thread"
        );
        assert_eq!(dev.to_vec().unwrap(), vec![7u8; 4096], "the copy ran");
        // The stream whose destroy failed stays with the driver: destroyed here.
        let live = ctl.live_report();
        assert_eq!(live.streams.iter().filter(|s| s.handle == dropped).count(), 1, "{live}");
        ctx.bind().unwrap();
        // SAFETY: the handle is of a live stream of the current context that nothing holds any
        // more (its last `Stream` handle was dropped when the destroy failed).
        let code = unsafe { sys::cuStreamDestroy_v2(dropped as sys::CUstream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        drop((dev, host, b, ctx));
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    });
}

/// Pinned memory's tracker is held around the device side's ordering (the device buffer's own
/// order, taken without a lock through `&mut`).
#[test]
#[serial]
fn a_copy_from_pinned_memory_destroys_a_stream_it_lets_go_of_with_the_tracker_unlocked() {
    the_tracker_is_free_when_the_stream_is_destroyed(
        |ctx| {
            // Zeroed on `a`, which is then dropped: the buffer's order holds its last handle.
            let a = Stream::non_blocking(ctx).unwrap();
            let dev = DeviceBuffer::<u8>::zeroed(&a, 4096).unwrap();
            (Arc::new(PinnedBuffer::from_slice(ctx, &[7u8; 4096]).unwrap()), dev, a.raw() as u64)
        },
        |pinned| pinned.as_slice().unwrap()[0],
    );
}

/// Mapped memory orders its device work through its own stream order, whose ticket for the copy is
/// dropped with the tracker held: here that order holds the dropped stream.
#[test]
#[serial]
fn a_copy_from_mapped_memory_destroys_a_stream_it_lets_go_of_with_the_tracker_unlocked() {
    the_tracker_is_free_when_the_stream_is_destroyed(
        |ctx| {
            // Set on `a` through a device view, which is then dropped: the mapped memory's order
            // holds its last handle.
            let a = Stream::non_blocking(ctx).unwrap();
            let mut mapped = MappedBuffer::<u8>::zeroed(ctx, 4096).unwrap();
            a.memset_d8(&mut mapped.as_device_slice_mut(), 7).unwrap();
            let dev = DeviceBuffer::<u8>::zeroed(&Stream::legacy(ctx), 4096).unwrap();
            (Arc::new(mapped), dev, a.raw() as u64)
        },
        |mapped| mapped.as_slice().unwrap()[0],
    );
}
