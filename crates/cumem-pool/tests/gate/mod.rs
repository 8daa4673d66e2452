//! The shared gate ([`cumem_sys::testing::Gate`]) for this crate's new test files: it holds a
//! stream back at the point it is queued until released or dropped, so that "work still running"
//! is deterministic on the simulator and on a GPU. A test that holds one must be `#[serial]`.

use cumem_core::Stream;
pub use cumem_sys::testing::Gate;

/// Queues a gate on `stream`: nothing queued after it runs before the gate is released or dropped.
pub fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { cumem_sys::testing::hold(stream.raw()) }
}
