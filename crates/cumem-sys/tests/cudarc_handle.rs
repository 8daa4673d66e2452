//! The library cudarc calls through is the one selected. cudarc opens its own handle by name on
//! first use and keeps it for the process; when something made it open another library before
//! cumem selects the simulator (a crate calling cudarc first), selecting the simulator is refused
//! rather than reporting the simulator while every call goes elsewhere. Shown with a stand-in
//! `libcuda.so.1` (every call succeeds) found on `LD_LIBRARY_PATH`, in a child process of its own
//! (the library path is read at process start, and the driver is chosen once per process).

use std::time::Duration;

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice, DriverKind};
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

/// Runs the child test `case` with the stand-in on the library path; `false` when it cannot run
/// here (said as a skip).
fn run_child(case: &str) -> bool {
    // The child selects the simulator: it must be found beside the tests.
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
        return false;
    }
    // Versioned name only, as a driver-only install has it: cudarc reaches it after `libcuda.so`.
    let Some(dir) = stand_in::build(&format!("cudarc-handle-{case}"), STAND_IN, "libcuda.so.1", &[]) else {
        testing::skip("no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)");
        return false;
    };
    let outcome = run_child_test(
        case,
        &[(CHILD_ENV, case), ("LD_LIBRARY_PATH", dir.to_str().unwrap())],
        &[DRIVER_ENV],
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let status = outcome.status.expect("the child finished within its deadline");
    assert!(status.success(), "the child {case} failed ({status}):\n{}", outcome.log);
    assert!(outcome.log.contains("1 passed"), "the child {case} ran no test:\n{}", outcome.log);
    true
}

fn is_child(case: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|c| c == case)
}

#[test]
fn the_simulator_is_refused_when_cudarc_already_calls_another_driver() {
    run_child("child");
    testing::init();
}

/// A program that loaded cumem-sim itself has `libcuda.so` meaning the simulator: `Auto` takes it
/// without running a real driver found by its versioned name (whose selection cudarc, calling the
/// simulator, would refuse).
#[test]
fn auto_takes_the_simulator_a_program_loaded_before_probing_the_real_driver() {
    run_child("child_auto");
    testing::init();
}

#[test]
fn child_auto() {
    if !is_child("child_auto") {
        return;
    }
    let path = cumem_sim::library_path().expect("the simulator library is built beside the tests");
    // SAFETY: cumem-sim's initialisers only set up its own state; nothing is called through it.
    let sim = unsafe { libloading::Library::new(&path) }.unwrap();
    let chosen = driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG));
    assert_eq!(chosen.unwrap(), DriverKind::Simulator);
    assert!(driver::description().unwrap().contains("cumem-sim"));
    drop(sim);
}

#[test]
fn child() {
    if !is_child("child") {
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
