//! A copy from page-locked memory holds the host memory's tracker locked while it orders and
//! queues the device side, and a `queue_on` closure holds its memory's order locked while it runs.
//! When an order lets go of the last handle of a stream the program dropped there (a stream order
//! kept it: the device buffer's, the host memory's own, another buffer's whose guard is dropped in
//! a closure, or which is dropped there whole with its order), the stream is destroyed once the
//! outermost such lock is let go of: `cuStreamDestroy` (and the `cuEventDestroy` of the stream's marker) waits behind another
//! thread's `cuMemFree` on a real driver (docs/observed-on-gpu.md, measured 2026-11-24), and a host
//! function that needs the lock (host access to the memory, which makes no driver call) while that
//! free waits for it would deadlock with the copy or the closure.
//!
//! Only those destroys are deferred. The copy's own driver calls (the `cuEventCreate` and
//! `cuEventRecord` of the markers it orders after, the profiler's events, the asynchronous copy
//! itself) and a closure's calls are made with the lock held and wait behind such a free the same
//! way. Those are left to a rule for users instead, not tested here (docs/safety.md): a host
//! function must not take host access to memory that another thread may be copying to or from
//! while any thread may free memory in that context.
//!
//! Seen through the warning of a destroy that fails (the simulator's fault injection), logged
//! where the destroy happens: a thread the subscriber starts must get the lock then. The simulator
//! does hold `cuStreamDestroy` behind another thread's free, as the driver does
//! (crates/cumem-sim/src/hold.rs), but the deadlock itself is not staged here: it needs a host
//! function waiting for the lock and another thread's `cuMemFree` waiting for that host function,
//! both in place after the copy or closure took the lock and made its own gated calls (which
//! would otherwise wait behind that free first, the users' rule above) and before the destroy, and
//! nothing pauses the thread between those points.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumem_copy::{Copy2D, Pitched, StreamCopy};
use cumem_core::{
    Context, Device, DeviceBuffer, HostMemory, MappedBuffer, PinnedBuffer, Stream, StreamOrder, sys,
};
use cumem_sim::control::Control;
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

/// Runs `act` with the first `cuStreamDestroy_v2` of this thread failing, and answers, for each
/// warning of a failed destroy, whether another thread got `first(held)` (which takes a lock: a
/// tracker's, an order's) within two seconds of it, and its value if so. The threads are joined.
fn from_each_failed_destroy<H: Send + Sync + 'static>(
    ctl: &Control,
    held: &Arc<H>,
    first: fn(&H) -> u8,
    act: impl FnOnce(),
) -> Vec<Option<u8>> {
    let seen: Arc<Mutex<Vec<Option<u8>>>> = Arc::default();
    let threads: Arc<Threads> = Arc::default();
    let subscriber = {
        let (held, seen, threads) = (held.clone(), seen.clone(), threads.clone());
        OnEvent(move |event: &tracing::Event<'_>| {
            if event_message(event) == DESTROY_FAILED {
                seen.lock().unwrap().push(borrowed_from_another_thread(&held, first, &threads));
            }
        })
    };
    testing::with_subscriber(subscriber, || {
        let rule = ctl.inject_fault(FaultRule {
            this_thread_only: true,
            ..FaultRule::nth_call("cuStreamDestroy_v2", 1, sys::CUresult::CUDA_ERROR_UNKNOWN)
        });
        act();
        ctl.remove_fault(rule);
    });
    for t in std::mem::take(&mut *threads.lock().unwrap()) {
        t.join().unwrap();
    }
    std::mem::take(&mut *seen.lock().unwrap())
}

/// Runs `test` under the watchdog with the simulator's control (skipped on a real driver: it
/// injects faults) and a context. `test` answers the handle of the stream whose destroy failed,
/// having dropped everything else it made; that stream (left with the driver, held by nothing)
/// is destroyed here, and then nothing may be left and no violation seen.
fn in_the_simulator(what: &'static str, test: impl FnOnce(&Control, &Context) -> u64 + Send + 'static) {
    testing::init();
    let Some(ctl) = testing::sim_control() else {
        testing::skip("injects driver faults: simulator only");
        return;
    };
    within_watchdog(what, move || {
        let ctx = Device::get(0).unwrap().context().unwrap();
        let dropped = test(&ctl, &ctx);
        let live = ctl.live_report();
        assert_eq!(live.streams.iter().filter(|s| s.handle == dropped).count(), 1, "{live}");
        ctx.bind().unwrap();
        // SAFETY: the handle is of a live stream of the current context that nothing holds any
        // more (its last `Stream` handle was dropped when the destroy failed).
        let code = unsafe { sys::cuStreamDestroy_v2(dropped as sys::CUstream) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        drop(ctx);
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
        let live = ctl.live_report();
        assert!(live.is_clean(), "{live}");
    });
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
    in_the_simulator("a copy from page-locked memory whose stream destroy failed", move |ctl, ctx| {
        let b = Stream::non_blocking(ctx).unwrap();
        let (host, mut dev, dropped) = scene(ctx);
        // On `b`: waits for the dropped stream, then lets go of it (`b` stands for its work).
        let seen = from_each_failed_destroy(ctl, &host, first, || b.copy_h2d(&*host, &mut dev).unwrap());
        assert_eq!(
            seen,
            [Some(7)],
            "one failed destroy, with the host memory's tracker free for another thread"
        );
        assert_eq!(dev.to_vec().unwrap(), vec![7u8; 4096], "the copy ran");
        dropped
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

/// `x`, a device buffer zeroed on a stream that is then dropped (its order holds the stream's last
/// handle, its latest user: the handle is answered too), and mapped memory `y` of sevens written
/// on `b` through a device view (its host reads wait for its order).
fn x_on_a_dropped_stream_and_mapped_y(
    ctx: &Context,
    b: &Stream,
) -> (DeviceBuffer<u8>, Arc<MappedBuffer<u8>>, u64) {
    let a = Stream::non_blocking(ctx).unwrap();
    let x = DeviceBuffer::<u8>::zeroed(&a, 4096).unwrap();
    let mut y = MappedBuffer::<u8>::zeroed(ctx, 4096).unwrap();
    b.memset_d8(&mut y.as_device_slice_mut(), 7).unwrap();
    (x, Arc::new(y), a.raw() as u64)
}

/// Runs `inside` in a `queue_on` closure of `y`'s device view on `on`, with the first stream
/// destroy failing: whether another thread could read `y` on the host (which waits for its order,
/// taking its lock) from each failure, and what it read.
fn from_a_closure_of_mapped(
    ctl: &Control,
    y: &Arc<MappedBuffer<u8>>,
    on: &Stream,
    inside: impl FnOnce(),
) -> Vec<Option<u8>> {
    from_each_failed_destroy(
        ctl,
        y,
        |y| y.as_slice().unwrap()[0],
        || {
            y.as_device_slice()
                .queue_on(on, |_| {
                    inside();
                    Ok(())
                })
                .unwrap()
        },
    )
}

/// A `queue_on` closure holds its order's lock while it runs. A view's guard of another buffer
/// dropped inside it lets go of a stream that buffer's order held the last handle of: the stream
/// is destroyed once the closure's order is unlocked, so a host function that reads the closure's
/// memory on the host (mapped memory after a device write waits for its order) is not left
/// waiting for that lock while the destroy waits behind another thread's free.
#[test]
#[serial]
fn a_guard_dropped_in_a_closure_destroys_the_stream_it_lets_go_of_after_the_closure_s_order() {
    in_the_simulator(
        "a guard dropped inside a queue_on closure, whose stream destroy failed",
        move |ctl, ctx| {
            let b = Stream::non_blocking(ctx).unwrap();
            let (x, y, dropped) = x_on_a_dropped_stream_and_mapped_y(ctx, &b);
            let guard = x.as_slice().on(&b).unwrap();
            // The guard's drop records `b` on `x`, which then needs the dropped stream no more.
            let seen = from_a_closure_of_mapped(ctl, &y, &b, || drop(guard));
            assert_eq!(seen, [Some(7)], "one failed destroy, with y's order free for another thread");
            drop((x, y, b));
            dropped
        },
    );
}

/// A whole buffer dropped inside a `queue_on` closure (allowed: its drop takes no cumem lock)
/// drops its order, which may hold the last handle of a stream the buffer was used on: that
/// stream too is destroyed once the closure's order is unlocked, not by the order's own drop.
#[test]
#[serial]
fn a_buffer_dropped_in_a_closure_destroys_the_stream_its_order_held_after_the_closure_s_order() {
    in_the_simulator(
        "a buffer dropped inside a queue_on closure, whose stream destroy failed",
        move |ctl, ctx| {
            let b = Stream::non_blocking(ctx).unwrap();
            let (x, y, dropped) = x_on_a_dropped_stream_and_mapped_y(ctx, &b);
            // `x`'s free is ordered on the dropped stream, which its order then still names.
            let seen = from_a_closure_of_mapped(ctl, &y, &b, move || drop(x));
            assert_eq!(seen, [Some(7)], "one failed destroy, with y's order free for another thread");
            drop((y, b));
            dropped
        },
    );
}

/// Page-locked memory of ones whose tracker holds the last handle of a stream a copy (`track`,
/// between it and a zeroed device buffer, on that stream) used it on; exclusive host access to it
/// inside another memory's `queue_on` closure waits for that stream and lets go of it: destroyed
/// once the closure's order is unlocked. The host memory then reads `expected` (the copy ran).
fn host_access_in_a_closure_after(
    what: &'static str,
    track: fn(&Stream, &mut PinnedBuffer<u8>, &mut DeviceBuffer<u8>),
    expected: u8,
) {
    in_the_simulator(what, move |ctl, ctx| {
        let a = Stream::non_blocking(ctx).unwrap();
        let mut pinned = PinnedBuffer::<u8>::from_slice(ctx, &[1u8; 4096]).unwrap();
        let mut dev = DeviceBuffer::<u8>::zeroed(&a, 4096).unwrap();
        track(&a, &mut pinned, &mut dev);
        let dropped = a.raw() as u64;
        drop((dev, a));
        let b = Stream::non_blocking(ctx).unwrap();
        let (x, y, _) = x_on_a_dropped_stream_and_mapped_y(ctx, &b);
        drop(x);
        let seen = from_a_closure_of_mapped(ctl, &y, &b, || {
            assert_eq!(pinned.as_mut_slice().unwrap()[0], expected);
        });
        assert_eq!(seen, [Some(7)], "one failed destroy, with y's order free for another thread");
        drop((pinned, y, b));
        dropped
    });
}

/// The tracker's read stream: a copy from the page-locked memory read on it.
#[test]
#[serial]
fn host_access_in_a_closure_destroys_the_stream_its_tracker_held_after_the_closure_s_order() {
    host_access_in_a_closure_after(
        "exclusive host access inside a queue_on closure, whose stream destroy failed",
        |a, pinned, dev| a.copy_h2d(&*pinned, dev).unwrap(),
        1,
    );
}

/// The tracker's write stream: a copy into the page-locked memory wrote on it.
#[test]
#[serial]
fn host_access_in_a_closure_destroys_the_write_stream_its_tracker_held_after_the_closure_s_order() {
    host_access_in_a_closure_after(
        "exclusive host access after a write inside a queue_on closure, whose stream destroy failed",
        |a, pinned, dev| a.copy_d2h(&*dev, pinned).unwrap(),
        0,
    );
}

/// A queued copy between two host kinds orders the destination's write (its tracker's
/// `device_write`) inside the source's tracker lock. The destination's tracker holds the last
/// handle of a stream a copy into it wrote on; the copy replaces that write stream and lets go of
/// it: destroyed once the source's tracker is unlocked, so another thread can read the source on
/// the host meanwhile.
#[test]
#[serial]
fn a_copy_between_host_kinds_destroys_the_stream_it_lets_go_of_with_the_source_s_tracker_unlocked() {
    in_the_simulator("a 2D copy between pinned buffers, whose stream destroy failed", move |ctl, ctx| {
        const N: usize = 4096;
        let a = Stream::non_blocking(ctx).unwrap();
        let dev = DeviceBuffer::<u8>::zeroed(&a, N).unwrap();
        let mut q = PinnedBuffer::<u8>::from_slice(ctx, &[1u8; N]).unwrap();
        a.copy_d2h(&dev, &mut q).unwrap();
        let dropped = a.raw() as u64;
        // `q`'s tracker holds the last handle of `a`, its write stream.
        drop((dev, a));
        let p = Arc::new(PinnedBuffer::from_slice(ctx, &[7u8; N]).unwrap());
        let b = Stream::non_blocking(ctx).unwrap();
        let seen = from_each_failed_destroy(
            ctl,
            &p,
            |p| p.as_slice().unwrap()[0],
            || b.copy_2d(&Pitched::new(&*p, N), &mut Pitched::new(&mut q, N), Copy2D::new(N, 1)).unwrap(),
        );
        assert_eq!(seen, [Some(7)], "one failed destroy, with p's tracker free for another thread");
        assert_eq!(q.as_slice().unwrap(), &[7u8; N][..], "the copy ran");
        drop((p, q, b));
        dropped
    });
}

/// Runs `inside` in a `queue_on` closure of `y` on `on`, with the first stream destroy failing:
/// whether another thread could count `y`'s users (which takes its lock) from each failure.
fn from_a_closure_of(
    ctl: &Control,
    y: &Arc<StreamOrder>,
    on: &Stream,
    inside: impl FnOnce(),
) -> Vec<Option<u8>> {
    from_each_failed_destroy(
        ctl,
        y,
        |y| y.users().unwrap() as u8,
        || {
            y.queue_on(on, || {
                inside();
                Ok(())
            })
            .unwrap()
        },
    )
}

/// An owner changing what its order admits inside another order's `queue_on` closure lets go of
/// the stream it admitted before, whose last handle it held: destroyed once the closure's order
/// is unlocked.
#[test]
#[serial]
fn admitting_another_stream_in_a_closure_destroys_the_old_one_after_the_closure_s_order() {
    in_the_simulator("an order admitting another stream inside a queue_on closure", move |ctl, ctx| {
        let (a, b) = (Stream::non_blocking(ctx).unwrap(), Stream::non_blocking(ctx).unwrap());
        let dropped = a.raw() as u64;
        let mut x = StreamOrder::new(&b);
        // Only `a` admitted, which is then dropped: `x` holds its last handle.
        x.admit_only(Some(&a));
        drop(a);
        let y = Arc::new(StreamOrder::new(&b));
        let seen = from_a_closure_of(ctl, &y, &b, || x.admit_any());
        assert_eq!(seen, [Some(1)], "one failed destroy, with y's order free for another thread");
        drop((x, y, b));
        dropped
    });
}

/// An owner's order joined inside another order's `queue_on` closure (as a buffer's drop does)
/// lets go of the streams its latest user now stands for: destroyed once the closure's order is
/// unlocked.
#[test]
#[serial]
fn joining_an_order_in_a_closure_destroys_a_stream_it_lets_go_of_after_the_closure_s_order() {
    in_the_simulator("an order joined inside a queue_on closure", move |ctl, ctx| {
        let (a, b, c) = (
            Stream::non_blocking(ctx).unwrap(),
            Stream::non_blocking(ctx).unwrap(),
            Stream::non_blocking(ctx).unwrap(),
        );
        let dropped = c.raw() as u64;
        let mut x = StreamOrder::new(&a);
        {
            // Two tickets at once: `c` and `b` both end up users, `b` the latest.
            let (on_c, on_b) = (x.use_on(&c).unwrap(), x.use_on(&b).unwrap());
            drop((on_c, on_b));
        }
        assert_eq!(x.users().unwrap(), 2);
        // `x` holds `c`'s last handle.
        drop(c);
        let y = Arc::new(StreamOrder::new(&a));
        let seen = from_a_closure_of(ctl, &y, &a, || assert_eq!(*x.join_mut().unwrap(), b));
        assert_eq!(seen, [Some(1)], "one failed destroy, with y's order free for another thread");
        drop((x, y, a, b));
        dropped
    });
}
