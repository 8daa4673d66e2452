//! A deadline for tests of code that could deadlock: the test fails instead of hanging the run.
//!
//! ```
//! cumem_sys::testing::within_watchdog("a quick step", || assert_eq!(1 + 1, 2));
//! ```

use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

/// How long a step that would deadlock without its fix may take before the test fails instead:
/// far longer than any step takes on a loaded machine.
pub const DEADLOCK_WATCHDOG: Duration = Duration::from_secs(60);

/// Runs `test` on a thread of its own and fails if it has not returned within
/// [`DEADLOCK_WATCHDOG`]: a deadlock then fails the test (leaving its threads behind) instead of
/// hanging the run.
///
/// # Panics
/// If `test` panics or does not return in time.
pub fn within_watchdog(what: &str, test: impl FnOnce() + Send + 'static) {
    let (done, finished) = channel();
    std::thread::spawn(move || {
        test();
        let _ = done.send(());
    });
    match finished.recv_timeout(DEADLOCK_WATCHDOG) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => {
            panic!("deadlock: {what} had not returned after {DEADLOCK_WATCHDOG:?}")
        }
        Err(RecvTimeoutError::Disconnected) => panic!("{what} panicked (see above)"),
    }
}
