//! The library cudarc calls through is the one selected. cudarc opens its own handle by name on
//! first use and keeps it for the process; when something made it open another library before
//! cumem selects the simulator (a crate calling cudarc first), selecting the simulator is refused
//! rather than reporting the simulator while every call goes elsewhere. Shown with a stand-in
//! `libcuda.so.1` (every call succeeds) found on `LD_LIBRARY_PATH`, in a child process of its own
//! (the library path is read at process start, and the driver is chosen once per process).

use std::time::Duration;

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice};
use cumem_sys::testing::child_process::run_child_test;
use cumem_sys::testing::{self, stand_in};
use cumem_sys::{Error, sys};

/// Set in the child process.
const CHILD_ENV: &str = "CUMEM_TEST_CUDARC_HANDLE";

/// A driver that says yes to everything: its `cuInit` succeeds, so only the check of cudarc's
/// handle can refuse it.
const STAND_IN: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut i32) -> i32 { unsafe { *count = 1 }; 0 }
"#;

#[test]
fn the_simulator_is_refused_when_cudarc_already_calls_another_driver() {
    // The child selects the simulator: it must be found beside the tests.
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    // Versioned name only, as a driver-only install has it: cudarc reaches it after `libcuda.so`.
    let Some(dir) = stand_in::build("cudarc-handle", STAND_IN, "libcuda.so.1", &[]) else {
        return testing::skip(
            "no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)",
        );
    };
    let outcome = run_child_test(
        "child",
        &[(CHILD_ENV, "1"), ("LD_LIBRARY_PATH", dir.to_str().unwrap())],
        &[DRIVER_ENV],
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let status = outcome.status.expect("the child finished within its deadline");
    assert!(status.success(), "the child failed ({status}):\n{}", outcome.log);
    assert!(outcome.log.contains("1 passed"), "the child ran no test:\n{}", outcome.log);
    testing::init();
}

#[test]
fn child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // What any crate calling cudarc before cumem does: cudarc opens its library (the stand-in,
    // the only one on the path here) and keeps it.
    // SAFETY: the stand-in is on the library path, so cudarc finds a library; nothing is called.
    let theirs = unsafe { sys::culib() };
    // SAFETY: only the symbol's presence is checked.
    assert!(unsafe { theirs.get::<*const ()>(b"cumemSimVersion") }.is_err(), "cudarc opened cumem-sim");

    let chosen = driver::select_with_sim_config(DriverChoice::Simulator, Some(testing::DEFAULT_SIM_CONFIG));
    assert!(
        matches!(&chosen, Err(Error::DriverSelection { reason }) if reason.contains("cudarc already calls another libcuda.so")),
        "{chosen:?}"
    );
    assert_eq!(driver::current(), None, "a refused selection put nothing in use");
}
