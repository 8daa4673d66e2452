//! `Auto` on a machine whose real driver is there but unusable runs on the simulator, and says so
//! with a warning that names the error (not a debug line that a default log level hides), and in
//! `driver::description()`: the real driver is never replaced silently. Shown with stand-in
//! drivers found as `libcuda.so.1` (as a driver install has it), each in a child process of its
//! own (the driver is chosen once per process, and the library path is read at process start):
//! - one whose `cuInit` says `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH` (803), as a driver whose kernel
//!   module is of another version does;
//! - one that initialises and counts zero devices.

use std::sync::{Arc, Mutex};

use cumem_sys::driver::{self, DriverChoice, DriverKind};
use cumem_sys::testing::{self, OnEvent, event_message, stand_in};
use tracing::{Event, Level};

/// Set in the child that runs with the driver whose `cuInit` fails.
const INIT_FAILS_ENV: &str = "CUMEM_TEST_AUTO_UNUSABLE_INIT_FAILS";
/// Set in the child that runs with the driver that sees no device.
const NO_DEVICES_ENV: &str = "CUMEM_TEST_AUTO_UNUSABLE_NO_DEVICES";

const INIT_FAILS: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 803 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(_count: *mut i32) -> i32 { 803 }
"#;

const NO_DEVICES: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut i32) -> i32 { unsafe { *count = 0 }; 0 }
"#;

/// Whether the children can go on to the simulator: without its library (a GPU machine given the
/// test binaries but not the simulator) `Auto` fails with `DriverNotFound` instead.
fn simulator_found() -> bool {
    cumem_sim::library_path().is_some_and(|p| p.is_file())
}

#[test]
fn auto_warns_when_the_real_drivers_cuinit_fails() {
    if !simulator_found() {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    stand_in::run_child_with_driver("auto-unusable-init", INIT_FAILS, "child_init_fails", INIT_FAILS_ENV);
    testing::init();
}

#[test]
fn auto_warns_when_the_real_driver_sees_no_device() {
    if !simulator_found() {
        return testing::skip("the simulator library cannot be found (CUMEM_SIM_LIB, or beside the tests)");
    }
    stand_in::run_child_with_driver("auto-unusable-none", NO_DEVICES, "child_no_devices", NO_DEVICES_ENV);
    testing::init();
}

/// In a child: selects `Auto` and checks that it runs on the simulator, having warned with a
/// message that contains `why`, which `description()` names too.
fn auto_selects_the_simulator_with_a_warning(why: &str) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let subscriber = OnEvent(move |event: &Event<'_>| {
        log.lock().unwrap().push((*event.metadata().level(), event_message(event)))
    });
    let kind = testing::with_subscriber(subscriber, || {
        driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
    });
    assert_eq!(kind.unwrap(), DriverKind::Simulator);
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|(level, message)| *level == Level::WARN
            && message.starts_with("the CUDA driver (libcuda.so.1) was found but is not usable")
            && message.contains(why)),
        "no warning naming {why:?}: {seen:?}"
    );
    let description = driver::description().unwrap();
    assert!(
        description.starts_with("cumem-sim (")
            && description.contains("the CUDA driver (libcuda.so.1) was found but not used")
            && description.contains(why),
        "{description}"
    );
}

#[test]
fn child_init_fails() {
    if std::env::var_os(INIT_FAILS_ENV).is_none() {
        return;
    }
    auto_selects_the_simulator_with_a_warning("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH in cuInit");
}

#[test]
fn child_no_devices() {
    if std::env::var_os(NO_DEVICES_ENV).is_none() {
        return;
    }
    auto_selects_the_simulator_with_a_warning("no CUDA device in cuDeviceGetCount");
}
