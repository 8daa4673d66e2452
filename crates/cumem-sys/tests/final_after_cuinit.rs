//! Once a driver's `cuInit` has run, the selection's outcome is final for the process, failure
//! included, and the failure is logged; and the library stays loaded (NVIDIA's driver starts
//! threads in `cuInit`, which unloading it could crash), which only the `Auto` case can show:
//! after `Real`, cudarc holds a reference of its own (the check of its handle, before `cuInit`,
//! opened it), so the library could not be unloaded even if cumem let its handle go. Shown with a stand-in driver whose
//! `cuInit` says `CUDA_ERROR_NO_DEVICE` (as the real driver does on a machine with no visible
//! device), found first on `LD_LIBRARY_PATH` as a driver install has it (`libcuda.so.1`, and
//! `libcuda.so` linking to it), which writes a file when it is unloaded: each case runs in a child
//! process of its own (the driver is chosen once per process, and the library path is read at
//! process start).
//! - `Real`: the stand-in's `cuInit` fails; the failure is logged as a warning and every later
//!   selection returns it.
//! - `Auto`: the probe runs the stand-in's `cuInit`, then the simulator cannot be used (its
//!   configuration is refused); that failure is remembered, so a later selection neither probes
//!   the real driver again nor takes the simulator.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice};
use cumem_sys::testing::child_process::run_child_test;
use cumem_sys::testing::{OnEvent, event_message, stand_in};
use cumem_sys::{Error, sys, testing};
use tracing::{Event, Level};

/// Set in a child process, to the case it runs.
const CHILD_ENV: &str = "CUMEM_TEST_FINAL_AFTER_CUINIT";

/// Where the stand-in writes when it is unloaded: set in a child process.
const UNLOADED_ENV: &str = "CUMEM_TEST_STAND_IN_UNLOADED";

/// The stand-in driver: every call says `CUDA_ERROR_NO_DEVICE` (100).
const STAND_IN: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 100 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(_count: *mut i32) -> i32 { 100 }
"#;

/// Added to every stand-in: a destructor, run when the library is unloaded (by its last close, or
/// at the process's exit), that writes the file `UNLOADED_ENV` names.
const ON_UNLOAD: &str = r#"
#[used]
#[link_section = ".fini_array"]
static ON_UNLOAD: extern "C" fn() = on_unload;
extern "C" fn on_unload() {
    if let Some(path) = std::env::var_os("CUMEM_TEST_STAND_IN_UNLOADED") {
        let _ = std::fs::write(path, b"unloaded");
    }
}
"#;

/// Runs `test` of this binary in a child process with the stand-in (built as `libcuda.so.1`, with
/// a `libcuda.so` link, into a directory of its own) first on the library path, within a deadline:
/// a selection that hangs fails the test instead of hanging the run.
fn run_child(test: &str, case: &str) {
    run_child_with(test, case, STAND_IN);
}

/// [`run_child`] with the stand-in built from `source`.
fn run_child_with(test: &str, case: &str, source: &str) {
    let Some(dir) = stand_in::build(
        &format!("final-after-cuinit-{case}"),
        &format!("{source}{ON_UNLOAD}"),
        "libcuda.so.1",
        &["libcuda.so"],
        &[],
    ) else {
        testing::skip("no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)");
        return;
    };
    let unloaded = dir.join("unloaded");
    let outcome = run_child_test(
        test,
        &[
            (CHILD_ENV, case),
            ("LD_LIBRARY_PATH", dir.to_str().expect("a UTF-8 temporary directory")),
            (UNLOADED_ENV, unloaded.to_str().expect("a UTF-8 temporary directory")),
        ],
        &[DRIVER_ENV],
        Duration::from_secs(120),
    );
    // The child found no such file before it ended; its exit ran the destructor, so the file
    // shows that the check in the child could see an unload.
    let destructor_ran = unloaded.is_file();
    let _ = std::fs::remove_dir_all(&dir);
    let Some(status) = outcome.status else {
        panic!("child {case} was still running after its deadline:\n{}", outcome.log);
    };
    assert!(status.success(), "child {case} failed ({status}):\n{}", outcome.log);
    assert!(outcome.log.contains("1 passed"), "the child ran no test:\n{}", outcome.log);
    assert!(destructor_ran, "the stand-in's destructor never ran, not even at the child's exit");
}

/// In a child: the stand-in, whose `cuInit` ran, has not been unloaded. Meaningful only where
/// cumem's handle is the only one (`Auto`'s probe, before cudarc is asked for its library).
fn assert_stand_in_still_loaded() {
    let unloaded = std::env::var_os(UNLOADED_ENV).expect("set for the child");
    assert!(
        !std::path::Path::new(&unloaded).exists(),
        "the driver whose cuInit ran was unloaded (its destructor wrote {unloaded:?})"
    );
}

fn is_child(case: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|c| c == case)
}

/// Every event: its level and message.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<(Level, String)>>>);

impl Events {
    /// A subscriber that records every event here.
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let seen = self.0.clone();
        OnEvent(move |event: &Event<'_>| {
            seen.lock().unwrap().push((*event.metadata().level(), event_message(event)))
        })
    }
}

#[test]
fn real_whose_cuinit_fails_is_logged_and_final() {
    run_child("child_real", "real");
    testing::init();
}

#[test]
fn auto_failing_after_the_real_cuinit_ran_is_final() {
    // The child's `Auto` goes on to the simulator after the stand-in's `cuInit`: without its library
    // (a GPU machine given the test binaries but not the simulator) that is `DriverNotFound`, not
    // the refused configuration this case is about. Decided here, before any driver is selected.
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    run_child("child_auto", "auto");
    testing::init();
}

#[test]
fn child_real() {
    if !is_child("real") {
        return;
    }
    let events = Events::default();
    let failed =
        cumem_sys::testing::with_subscriber(events.subscriber(), || driver::select(DriverChoice::Real));
    assert!(matches!(&failed, Err(Error::NoDevice { ctx }) if ctx.op == "cuInit"), "{failed:?}");
    let seen = events.0.lock().unwrap().clone();
    assert!(
        seen.iter().any(|(level, message)| *level == Level::WARN
            && message.starts_with("CUDA driver initialisation failed")),
        "the failed cuInit was not logged: {seen:?}"
    );
    assert_eq!(driver::current(), None);
    let again = driver::select_with_sim_config(DriverChoice::Simulator, Some(testing::DEFAULT_SIM_CONFIG));
    assert!(matches!(&again, Err(Error::NoDevice { ctx }) if ctx.op == "cuInit"), "{again:?}");
    assert!(matches!(driver::init(), Err(Error::NoDevice { .. })));
}

/// A driver newer than cudarc's bindings (CUDA 12.8) whose `cuInit` fails with a code they do not
/// know (36, `CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER` of CUDA 13): read as the C `int` it is, the
/// code is `CUDA_ERROR_UNKNOWN`, not a `CUresult` that has no such variant.
const NEWER_DRIVER: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 36 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(_count: *mut i32) -> i32 { 36 }
"#;

#[test]
fn real_whose_cuinit_returns_a_code_newer_than_the_bindings_is_unknown() {
    run_child_with("child_real_newer", "real-newer", NEWER_DRIVER);
    testing::init();
}

#[test]
fn child_real_newer() {
    if !is_child("real-newer") {
        return;
    }
    let failed = driver::select(DriverChoice::Real);
    assert!(
        matches!(&failed, Err(Error::Cuda { code: sys::CUresult::CUDA_ERROR_UNKNOWN, raw: 36, ctx }) if ctx.op == "cuInit"),
        "{failed:?}"
    );
}

#[test]
fn child_auto() {
    if !is_child("auto") {
        return;
    }
    let events = Events::default();
    let first = cumem_sys::testing::with_subscriber(events.subscriber(), || {
        driver::select_with_sim_config(DriverChoice::Auto, Some("no_such_key=1"))
    });
    let first = first.expect_err("the simulator's configuration is refused");
    assert!(matches!(&first, Error::InvalidValue { ctx } if ctx.op == "cumemSimConfigure"), "{first:?}");
    assert_eq!(driver::current(), None);
    assert_stand_in_still_loaded();

    // A configuration the simulator takes changes nothing now: the failure was final.
    let again = cumem_sys::testing::with_subscriber(events.subscriber(), || {
        driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
    });
    assert_eq!(again.map_err(|e| e.to_string()), Err(first.to_string()));
    let sim = driver::select_with_sim_config(DriverChoice::Simulator, Some(testing::DEFAULT_SIM_CONFIG));
    assert_eq!(sim.map_err(|e| e.to_string()), Err(first.to_string()));
    assert_eq!(driver::init().map_err(|e| e.to_string()), Err(first.to_string()));
    assert_eq!(driver::current(), None);

    let seen = events.0.lock().unwrap().clone();
    let probes = seen
        .iter()
        .filter(|(_, message)| {
            message.starts_with("the CUDA driver (libcuda.so.1) was found but is not usable")
        })
        .count();
    assert_eq!(probes, 1, "the real driver was probed again: {seen:?}");
    assert!(
        seen.iter().any(|(level, message)| *level == Level::WARN
            && message.starts_with("no usable CUDA driver nor simulator")),
        "the final failure was not logged: {seen:?}"
    );
}
