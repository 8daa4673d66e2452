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

use cumem_core::Stream;
pub use cumem_sys::testing::Gate;

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
