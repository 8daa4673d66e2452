//! Shared test helpers: a gate that holds a stream at the point it is queued, so that work queued
//! after it has certainly not run until the test opens the gate.
//!
//! The gate itself is [`cumem_sys::testing::Gate`]; read its rule first. In short:
//! - a test that calls [`hold`] must be `#[serial]` (checked: `hold` panics otherwise), and every
//!   other test of a binary that has one is `#[parallel]`, because host functions of all streams
//!   share one thread and, on a real driver, a free in another test that waits for the held stream
//!   blocks this test's own queueing (driver-api.md §17);
//! - queue nothing that waits (synchronise, host access, drops that free) on a held stream, or on
//!   the whole device, before opening its gate;
//! - keep the [`Gate`] in a local declared *after* the buffers it holds work for, so that on a
//!   panic it is dropped (and opened) first: dropping a gate opens it.
//!
//! The ordering tests' common shapes are here too: two streams `a` and `b`, work held back on
//! `a`, and what `b` (or the host) then sees.
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{Context, Device, DeviceBuffer, PinnedBuffer, Stream};
pub use cumem_sys::testing::Gate;

/// Device 0's context, on the simulator or the driver the tests run on.
pub fn ctx() -> Context {
    cumem_sys::testing::init();
    Device::get(0).unwrap().context().unwrap()
}

/// Two non-blocking streams of `ctx`, `a` and `b`.
pub fn two_streams(ctx: &Context) -> (Stream, Stream) {
    (Stream::non_blocking(ctx).unwrap(), Stream::non_blocking(ctx).unwrap())
}

/// Holds `a` while `queue` queues its work (held back on `a`, then whatever must wait for it on
/// `b`), then opens the gate and waits for both streams.
///
/// # Panics
/// As [`hold`]; and if `queue` or a synchronisation panics (the gate opens first).
pub fn with_a_held(a: &Stream, b: &Stream, queue: impl FnOnce()) {
    let gate = hold(a);
    queue();
    let opener = gate.release_after(Duration::from_millis(100));
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    opener.join().unwrap();
}

/// Makes 1024 zeroed `u32`s on `b` (so that only the ordering under test can tell `b` about
/// `a`), lets `work` queue on the held stream `a` through them, copies them to the host on `b`
/// and returns what that copy saw once the gate opened.
///
/// # Panics
/// As [`hold`]; and if `work` or a call panics (the gate opens first).
pub fn seen_on_b_after_held_work_on_a(
    ctx: &Context,
    a: &Stream,
    b: &Stream,
    work: impl FnOnce(&mut DeviceBuffer<u32>),
) -> Vec<u32> {
    let mut buf = DeviceBuffer::<u32>::zeroed(b, 1024).unwrap();
    b.synchronize().unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(ctx, 1024).unwrap();
    let gate = hold(a);
    work(&mut buf); // held back on `a`
    b.copy_d2h(&buf, &mut seen).unwrap(); // on `b`: must wait for `a`
    let opener = gate.release_after(Duration::from_millis(100));
    let data = seen.as_slice().unwrap().to_vec(); // waits for `b`, hence for `a`
    opener.join().unwrap();
    data
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
///
/// # Panics
/// If the calling test is not `#[serial]` (on this thread), or the driver refuses the gate.
pub fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { cumem_sys::testing::hold(stream.raw()) }
}

// Not every test binary that includes this module watches events.
#[allow(unused_imports)]
pub use cumem_sys::testing::{OnEvent, event_message as message};

/// What a copy of `host` into a new device buffer on `stream` reads, made on another thread and
/// joined: a subscriber's code that must not deadlock with a copy of the same buffer holding its
/// locks on this thread.
pub fn copied_on_another_thread(stream: &Stream, host: &PinnedBuffer<u32>) -> Vec<u32> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut dev = DeviceBuffer::<u32>::zeroed(stream, host.len()).unwrap();
            stream.copy_h2d(host, &mut dev).unwrap();
            dev.to_vec().unwrap()
        })
        .join()
        .unwrap()
    })
}
