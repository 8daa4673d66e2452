//! A deadline for tests of code that could deadlock: the test process aborts, saying why, instead
//! of hanging the run.
//!
//! ```
//! cumem_sys::testing::within_watchdog("a quick step", || assert_eq!(1 + 1, 2));
//! ```

use std::io::Write as _;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

/// How long a step that would deadlock without its fix may take before the test process aborts
/// instead: far longer than any step takes on a loaded machine.
pub const DEADLOCK_WATCHDOG: Duration = Duration::from_secs(60);

/// Runs `test` on a thread of its own and aborts the whole test process if it has not returned
/// within [`DEADLOCK_WATCHDOG`], after saying so on stderr: a deadlock then ends the run instead of
/// hanging it.
///
/// An abort rather than a failed test: the stuck thread cannot be stopped and keeps whatever locks
/// it holds (the simulator's, a registry's), so the other tests of the binary could hang on them
/// with no deadline of their own, and the harness would never report this one. The price: the
/// harness's end-of-run summary is lost with the process, including the captured output of other
/// tests that failed before it (rerun those alone, or with `--nocapture`).
///
/// # Panics
/// If `test` panics (after its unwinding has let go of its locks).
pub fn within_watchdog(what: &str, test: impl FnOnce() + Send + 'static) {
    within(what, DEADLOCK_WATCHDOG, test)
}

/// [`within_watchdog`] with a deadline of `limit`.
fn within(what: &str, limit: Duration, test: impl FnOnce() + Send + 'static) {
    let (done, finished) = channel();
    std::thread::spawn(move || {
        test();
        let _ = done.send(());
    });
    match finished.recv_timeout(limit) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => {
            // Straight to the stream: the test harness captures `eprintln!`, and an abort never
            // shows what it captured.
            let _ = writeln!(
                std::io::stderr(),
                "deadlock: {what} had not returned after {limit:?}; aborting the test process"
            );
            std::process::abort();
        }
        Err(RecvTimeoutError::Disconnected) => panic!("{what} panicked (see above)"),
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;
    use std::time::Duration;

    use crate::testing::child_process::run_child_test;

    const CHILD_ENV: &str = "CUMEM_TEST_DEADLINE_CHILD";

    /// A step stuck past its deadline ends the process with `SIGABRT`, saying which step: the
    /// watchdog used to panic, failing the test while the stuck thread kept its locks.
    #[test]
    fn a_step_past_its_deadline_aborts_the_process_saying_so() {
        if std::env::var_os(CHILD_ENV).is_some() {
            super::within("a step that never returns", Duration::from_millis(200), || {
                loop {
                    std::thread::park();
                }
            });
            return;
        }
        let name = "testing::deadline::tests::a_step_past_its_deadline_aborts_the_process_saying_so";
        let child = run_child_test(name, &[(CHILD_ENV, "1")], &[], Duration::from_secs(60));
        let status = child.status.expect("the child ended by itself");
        assert_eq!(status.signal(), Some(6), "ended by SIGABRT, not a failed test: {status}\n{}", child.log);
        assert!(
            child.log.contains("deadlock: a step that never returns had not returned after 200ms; aborting"),
            "{}",
            child.log
        );
    }

    #[test]
    fn a_step_in_time_returns() {
        super::within_watchdog("a quick step", || {});
    }
}
