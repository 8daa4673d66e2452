//! Skips that say so: a test that cannot run on this machine reports why, where a reader of the
//! log sees it, and is counted by `cargo xtask gpu-test`; on the simulator nothing may be skipped.
//!
//! A test that needs more devices than the driver has returns early through [`needs_devices`]
//! (or [`skip`] for another reason). Returning early alone passes silently, so the skip is
//! reported three ways: a line `skipped: <test>: <why>` on stderr, written past the test
//! harness's output capture (which would show it only for failed tests); a line appended to the
//! file named by [`SKIP_LOG_ENV`], which `cargo xtask gpu-test` sets and lists in its summary; and
//! nowhere on the simulator, where a skip panics instead: the tests configure every simulated
//! device they use, so a skip there is a test whose configuration is wrong and would hide a path
//! that CI never runs.
//!
//! ```
//! use cumem_sys::testing;
//! testing::init_with("devices=2");
//! if !testing::needs_devices(2) {
//!     return; // on a real machine with one GPU: "skipped: …: needs 2 devices, the real driver has 1"
//! }
//! // … the two-device test
//! ```

use std::io::Write;

use crate::api;
use crate::driver::{self, DriverKind};

/// Names the file to which every skip appends a line `<test>\t<why>` (set by
/// `cargo xtask gpu-test`, one file per test binary).
pub const SKIP_LOG_ENV: &str = "CUMEM_TEST_SKIP_LOG";

/// The number of devices the driver in use reports (the driver is initialised first, with
/// [`init`](super::init), if no test has done it yet).
///
/// # Panics
/// If the driver cannot count its devices: a test cannot go on without knowing.
pub fn device_count() -> usize {
    if driver::current().is_none() {
        super::init();
    }
    let mut n = 0;
    // SAFETY: a driver is loaded and initialised (above); `n` is a valid out-pointer.
    let code = unsafe { api::cuDeviceGetCount(&mut n) };
    assert!(code.is_success(), "cuDeviceGetCount failed: {code:?}");
    usize::try_from(n).unwrap_or(0)
}

/// Whether the driver has at least `n` devices, so that a test needing devices `0..n` can go on.
/// When it has fewer, the skip is reported by [`skip`] and `false` returned:
/// `if !testing::needs_devices(2) { return; }`.
///
/// # Panics
/// On the simulator, when it has fewer than `n` devices: the test's simulator configuration
/// (`devices=N` in [`init_with`](super::init_with)) must give it what it needs.
pub fn needs_devices(n: usize) -> bool {
    let count = device_count();
    if count >= n {
        return true;
    }
    skip(format_args!("needs {n} devices, {} has {count}", driver_name()));
    false
}

/// Reports that the calling test skips the rest of its body, and why; the test then returns.
///
/// The report is a line `skipped: <test>: <why>` on stderr, written past the test harness's output
/// capture (`eprintln!` would show only for failed tests), and a line `<test>\t<why>` appended to
/// the file named by [`SKIP_LOG_ENV`] when it is set (`cargo xtask gpu-test` lists those).
///
/// # Panics
/// On the simulator: nothing is skipped there.
pub fn skip(why: impl std::fmt::Display) {
    let test = std::thread::current().name().unwrap_or("<unnamed thread>").to_owned();
    assert_ne!(
        driver::current(),
        Some(DriverKind::Simulator),
        "{test} would be skipped on the simulator ({why}): configure the simulator it needs, nothing is \
         skipped there"
    );
    report(&test, &why.to_string(), std::env::var_os(SKIP_LOG_ENV).as_deref());
}

/// Writes the skip's line to stderr and, when `log` names a file, appends `<test>\t<why>` to it.
fn report(test: &str, why: &str, log: Option<&std::ffi::OsStr>) {
    // Straight to the stream: `eprintln!` is captured by the test harness and shown only on failure.
    let _ = writeln!(std::io::stderr(), "skipped: {test}: {why}");
    if let Some(path) = log {
        let line = format!("{test}\t{why}\n");
        // One `write` of a short line in append mode: lines from parallel tests do not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            let _ = writeln!(std::io::stderr(), "could not log the skip to {}: {e}", path.to_string_lossy());
        }
    }
}

fn driver_name() -> &'static str {
    match driver::current() {
        Some(DriverKind::Simulator) => "the simulator",
        _ => "the real driver",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_skip_is_appended_to_the_log_one_line_each() {
        let path = std::env::temp_dir().join(format!("cumem-skip-log-{}.txt", std::process::id()));
        let _ = std::fs::remove_file(&path);
        report("peer::two", "needs 2 devices, the real driver has 1", Some(path.as_os_str()));
        report("vmm::three", "needs a device without virtual memory management", Some(path.as_os_str()));
        report("not::logged", "no log named", None);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            text,
            "peer::two\tneeds 2 devices, the real driver has 1\n\
             vmm::three\tneeds a device without virtual memory management\n"
        );
    }
}
