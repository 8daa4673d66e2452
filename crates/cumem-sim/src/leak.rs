//! The exit leak check (`leak_check=1`).
//!
//! An `atexit` handler reads the live report when the process exits: anything still live except
//! retained primary contexts is a leak, reported on stderr with exit status 86, so a test binary
//! that forgets to free something fails even if all its tests passed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::state::SIM;

static REGISTERED: AtomicBool = AtomicBool::new(false);

/// Exit status of a process that leaked simulator resources.
pub(crate) const LEAK_EXIT_STATUS: i32 = 86;

/// Registers the exit handler (once per process).
pub(crate) fn register() {
    if !REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: `at_exit` is a plain `extern "C" fn()` that lives as long as the process (the
        // library is linked with `-z nodelete`, so it is never unmapped).
        unsafe {
            libc::atexit(at_exit);
        }
    }
}

fn exe_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "<unknown>".to_string())
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if !SIM.leak_check.load(Ordering::Acquire) {
            return;
        }
        let exe = exe_name();
        // A thread that died holding the lock must not hang the exit.
        let Some(g) = SIM.st.try_lock_for(Duration::from_secs(2)) else {
            eprintln!("cumem-sim: leak check skipped at exit of {exe}: simulator state is locked");
            return;
        };
        let report = g.live_report();
        drop(g);
        if report.is_clean() {
            eprintln!("cumem-sim: leak check passed ({exe})");
        } else {
            let json = serde_json::to_string(&report).unwrap_or_default();
            eprintln!("cumem-sim: LEAK at exit of {exe}:\n{report}{json}");
            // SAFETY: `_exit` ends the process immediately; nothing runs after it.
            unsafe { libc::_exit(LEAK_EXIT_STATUS) };
        }
    });
}
