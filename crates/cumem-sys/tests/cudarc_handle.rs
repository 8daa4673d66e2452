//! The library cudarc calls through is the one selected. cudarc opens its own handle by name on
//! first use and keeps it for the process; when something made it open another library before
//! cumem selects the simulator (a crate calling cudarc first), selecting the simulator is refused
//! rather than reporting the simulator while every call goes elsewhere. Shown with a stand-in
//! `libcuda.so.1` (every call succeeds) found on `LD_LIBRARY_PATH`, in a child process of its own
//! (the library path is read at process start, and the driver is chosen once per process).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumem_sys::driver::{self, DRIVER_ENV, DriverChoice, DriverKind};
use cumem_sys::testing::child_process::run_child_test;
use cumem_sys::testing::{self, OnEvent, stand_in};
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
    let Some(dir) = stand_in::build(&format!("cudarc-handle-{case}"), STAND_IN, "libcuda.so.1", &[], &[])
    else {
        testing::skip("no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)");
        return false;
    };
    run_child_with(case, &[("LD_LIBRARY_PATH", dir.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&dir);
    true
}

/// Runs the child test `case` with `env` set, and checks that it passed.
fn run_child_with(case: &str, env: &[(&str, &str)]) {
    let mut set = vec![(CHILD_ENV, case)];
    set.extend_from_slice(env);
    let outcome = run_child_test(case, &set, &[DRIVER_ENV], Duration::from_secs(120));
    let status = outcome.status.expect("the child finished within its deadline");
    assert!(status.success(), "the child {case} failed ({status}):\n{}", outcome.log);
    assert!(outcome.log.contains("1 passed"), "the child {case} ran no test:\n{}", outcome.log);
}

/// A CUDA toolkit's stub `libcuda.so`, for linking without a driver: every call says
/// `CUDA_ERROR_STUB_LIBRARY` (34).
const STUB: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 34 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(_count: *mut i32) -> i32 { 34 }
"#;

/// Where the driver behind the stub writes when its `cuInit` runs: set in the child.
const INITIALISED_ENV: &str = "CUMEM_TEST_STAND_IN_INITIALISED";

/// A driver with one device, whose `cuInit` writes the file `INITIALISED_ENV` names.
const DRIVER: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 {
    if let Some(path) = std::env::var_os("CUMEM_TEST_STAND_IN_INITIALISED") {
        let _ = std::fs::write(path, b"cuInit ran");
    }
    0
}
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut i32) -> i32 { unsafe { *count = 1 }; 0 }
"#;

/// A stubs directory before the driver's on `LD_LIBRARY_PATH` (as a build setup may leave it on a
/// GPU machine): `auto` finds the driver as `libcuda.so.1`, but cudarc, opening `libcuda.so`, would
/// call the stub. The driver is not initialised; a warning names the stub and the library path;
/// the simulator is used, as where no driver is found.
#[test]
fn auto_leaves_a_driver_that_cudarc_would_not_call_uninitialised_and_uses_the_simulator() {
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    let (Some(stubs), Some(driver)) = (
        stand_in::build("cudarc-handle-stubs", STUB, "libcuda.so", &[], &[]),
        stand_in::build("cudarc-handle-driver", DRIVER, "libcuda.so.1", &[], &[]),
    ) else {
        return testing::skip("no rustc to build the stand-ins (a machine without a Rust toolchain)");
    };
    let initialised = driver.join("initialised");
    let path = format!("{}:{}", stubs.display(), driver.display());
    run_child_with(
        "child_stubs",
        &[("LD_LIBRARY_PATH", &path), (INITIALISED_ENV, initialised.to_str().unwrap())],
    );
    let ran = initialised.exists();
    let _ = std::fs::remove_dir_all(&stubs);
    let _ = std::fs::remove_dir_all(&driver);
    assert!(!ran, "the driver's cuInit ran, though cudarc would call the stub");
    testing::init();
}

#[test]
fn child_stubs() {
    if !is_child("child_stubs") {
        return;
    }
    // Every event, with all its fields.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = {
        let seen = seen.clone();
        OnEvent(move |event: &tracing::Event<'_>| {
            struct Fields(String);
            impl tracing::field::Visit for Fields {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                    self.0 += &format!(" {}={value:?}", field.name());
                }
            }
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            seen.lock().unwrap().push((*event.metadata().level(), fields.0));
        })
    };
    let chosen = cumem_sys::testing::with_subscriber(subscriber, || {
        driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
    });
    assert_eq!(chosen.map_err(|e| e.to_string()), Ok(DriverKind::Simulator));
    assert!(driver::description().unwrap().contains("cumem-sim"));
    // SAFETY: a driver is selected, so cudarc finds a library; only a symbol's presence is checked.
    let calls_the_simulator = unsafe { sys::culib().get::<*const ()>(b"cumemSimVersion") }.is_ok();
    assert!(calls_the_simulator, "cudarc does not call cumem-sim");

    let stub =
        std::env::var("LD_LIBRARY_PATH").unwrap().split(':').next().unwrap().to_owned() + "/libcuda.so";
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|(level, fields)| *level == tracing::Level::WARN
            && fields.contains(&stub)
            && fields.contains("LD_LIBRARY_PATH")
            && fields.contains("the CUDA driver is not used")
            && fields.contains("cudarc would call another libcuda.so")),
        "no warning names the stub {stub} and the library path: {seen:?}"
    );
    let initialised = std::env::var_os(INITIALISED_ENV).unwrap();
    assert!(!std::path::Path::new(&initialised).exists(), "the driver's cuInit ran");
}

/// A stubs directory whose stub is also linked as `libcuda.so.1` (as some container images make
/// it), first on `LD_LIBRARY_PATH`: `auto` takes it for the driver, and its `cuInit` says
/// `CUDA_ERROR_STUB_LIBRARY`. A warning says it is a stub and how to reach the GPU, and the
/// simulator is used (cudarc, opening `libcuda.so`, gets cumem-sim by its soname).
#[test]
fn auto_warns_of_a_stub_found_as_the_driver_and_uses_the_simulator() {
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    let Some(stubs) = stand_in::build("cudarc-handle-stub-so1", STUB, "libcuda.so.1", &["libcuda.so"], &[])
    else {
        return testing::skip("no rustc to build the stand-ins (a machine without a Rust toolchain)");
    };
    run_child_with("child_stub_as_driver", &[("LD_LIBRARY_PATH", stubs.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&stubs);
    testing::init();
}

#[test]
fn child_stub_as_driver() {
    if !is_child("child_stub_as_driver") {
        return;
    }
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let subscriber = {
        let warnings = warnings.clone();
        OnEvent(move |event: &tracing::Event<'_>| {
            if *event.metadata().level() == tracing::Level::WARN {
                warnings.lock().unwrap().push(cumem_sys::testing::event_message(event));
            }
        })
    };
    let chosen = cumem_sys::testing::with_subscriber(subscriber, || {
        driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
    });
    assert_eq!(chosen.map_err(|e| e.to_string()), Ok(DriverKind::Simulator));
    // SAFETY: a driver is selected, so cudarc finds a library; only a symbol's presence is checked.
    let calls_the_simulator = unsafe { sys::culib().get::<*const ()>(b"cumemSimVersion") }.is_ok();
    assert!(calls_the_simulator, "cudarc does not call cumem-sim");
    let warnings = warnings.lock().unwrap().clone();
    assert!(
        warnings.iter().any(|m| m
            == "the libcuda.so.1 found is the CUDA toolkit's stub, not a driver (take its folder off \
                LD_LIBRARY_PATH to use a GPU); trying the simulator"),
        "no warning says the driver found is a stub: {warnings:?}"
    );
}

/// A `libcuda.so` that `auto` cannot foresee: a stubs directory named on `LD_LIBRARY_PATH` through
/// `$ORIGIN` (which glibc expands and cumem does not read; a program's `RPATH` is the same case).
/// The driver, found as `libcuda.so.1`, is initialised, and only then is cudarc found to call the
/// stub: the selection is refused, finally, and the warning says so, not that the simulator was
/// tried.
#[test]
fn auto_refusing_an_initialised_driver_says_the_simulator_was_not_tried() {
    let (Some(stubs), Some(driver)) = (
        stand_in::build("cudarc-handle-unforeseen-stubs", STUB, "libcuda.so", &[], &[]),
        stand_in::build("cudarc-handle-unforeseen-driver", DRIVER, "libcuda.so.1", &[], &[]),
    ) else {
        return testing::skip("no rustc to build the stand-ins (a machine without a Rust toolchain)");
    };
    // From the test binary's directory up to `/` (`..` there stays at `/`), then down to `stubs`.
    let exe_dir = std::env::current_exe().unwrap().parent().unwrap().to_owned();
    let up = "/..".repeat(exe_dir.components().count());
    let path = format!("$ORIGIN{up}{}:{}", stubs.display(), driver.display());
    let initialised = driver.join("initialised");
    run_child_with(
        "child_unforeseen",
        &[("LD_LIBRARY_PATH", &path), (INITIALISED_ENV, initialised.to_str().unwrap())],
    );
    let ran = initialised.exists();
    let _ = std::fs::remove_dir_all(&stubs);
    let _ = std::fs::remove_dir_all(&driver);
    assert!(ran, "the driver's cuInit did not run: the stub was foreseen after all");
    testing::init();
}

#[test]
fn child_unforeseen() {
    if !is_child("child_unforeseen") {
        return;
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = {
        let seen = seen.clone();
        OnEvent(move |event: &tracing::Event<'_>| {
            seen.lock().unwrap().push((*event.metadata().level(), testing::event_message(event)))
        })
    };
    let chosen = cumem_sys::testing::with_subscriber(subscriber, || {
        driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
    });
    assert!(
        matches!(&chosen, Err(Error::DriverSelection { reason }) if reason.contains("cudarc already calls another libcuda.so")),
        "{chosen:?}"
    );
    let again = driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG));
    assert_eq!(again.map_err(|e| e.to_string()), chosen.map_err(|e| e.to_string()), "not final");
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|(level, message)| *level == tracing::Level::WARN
            && message.starts_with("the CUDA driver was initialised, but cudarc calls another library")),
        "the refusal was not logged as such: {seen:?}"
    );
    assert!(
        !seen.iter().any(|(_, message)| message.contains("simulator")),
        "the simulator was never tried, yet a message names it: {seen:?}"
    );
}

/// A stand-in directory left by an earlier run under the same name (a test that failed before
/// removing it, a process id come round again) is replaced, not a panic on its links.
#[test]
fn a_stand_in_directory_left_by_an_earlier_run_is_replaced() {
    let build = || stand_in::build("cudarc-handle-left", STAND_IN, "libcuda.so.1", &["libcuda.so"], &[]);
    let Some(left) = build() else {
        return testing::skip(
            "no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)",
        );
    };
    std::fs::write(left.join("stale"), b"from an earlier run").unwrap();
    let dir = build().expect("rustc ran the first time");
    assert_eq!(dir, left);
    assert!(dir.join("libcuda.so").is_file(), "the link to the new stand-in is missing");
    assert!(!dir.join("stale").exists(), "the earlier run's directory was kept");
    let _ = std::fs::remove_dir_all(&dir);
    testing::init();
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

/// A simulator selection refused for its configuration asks cudarc for nothing, but cumem-sim,
/// linked never to unload, stays loaded as `libcuda.so`: a later `Real` is refused as
/// `DriverNotFound`, though a driver is on the library path, and so is cudarc kept from calling
/// the simulator for it.
#[test]
fn real_after_a_refused_simulator_configuration_is_not_found() {
    if !cumem_sim::library_path().is_some_and(|p| p.is_file()) {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    let Some(dir) =
        stand_in::build("cudarc-handle-refused-config", STAND_IN, "libcuda.so.1", &["libcuda.so"], &[])
    else {
        return testing::skip(
            "no rustc to build the stand-in libcuda.so.1 (a machine without a Rust toolchain)",
        );
    };
    run_child_with("child_refused_config", &[("LD_LIBRARY_PATH", dir.to_str().unwrap())]);
    let _ = std::fs::remove_dir_all(&dir);
    testing::init();
}

#[test]
fn child_refused_config() {
    if !is_child("child_refused_config") {
        return;
    }
    let refused = driver::select_with_sim_config(DriverChoice::Simulator, Some("no_such_key=1"));
    assert!(
        matches!(&refused, Err(Error::InvalidValue { ctx }) if ctx.op == "cumemSimConfigure"),
        "{refused:?}"
    );
    let real = driver::select(DriverChoice::Real);
    assert!(
        matches!(&real, Err(Error::DriverNotFound { searched }) if searched.contains("resolves to cumem-sim")),
        "{real:?}"
    );
    assert_eq!(driver::current(), None);
}
