//! Driver selection for test binaries, doctests and examples (feature `sim`).
//!
//! Tests opt in to the simulator by default: [`init`] selects `cumem-sim` unless `CUMEM_DRIVER`
//! says otherwise (`cargo xtask gpu-test` sets `CUMEM_DRIVER=real`), and turns on the simulator's
//! leak check at process exit, so every test binary ends by checking the live-resource report.
//!
//! ```
//! let kind = cumem_sys::testing::init();
//! assert_eq!(cumem_sys::driver::current(), Some(kind));
//! ```

use crate::driver::{self, DriverChoice, DriverKind};

/// The simulator configuration every test process starts from: two devices, so multi-device
/// code paths run, and the leak check at exit.
pub const DEFAULT_SIM_CONFIG: &str = "leak_check=1";

/// Selects the test driver (the simulator unless `CUMEM_DRIVER` says otherwise) and initialises it.
///
/// # Panics
/// Panics if no driver can be initialised: a test binary cannot do anything useful without one,
/// and the message says why.
pub fn init() -> DriverKind {
    init_with("")
}

/// Like [`init`], passing extra simulator configuration (e.g. `"devices=3,dev2.managed_memory=0"`)
/// when this call is the one that starts the simulator. Every test in a binary must pass the same
/// configuration, since the driver is initialised once per process.
///
/// # Panics
/// As [`init`].
pub fn init_with(sim_config: &str) -> DriverKind {
    let choice = match std::env::var(driver::DRIVER_ENV) {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("{e}")),
        Err(_) => DriverChoice::Simulator,
    };
    let config = if sim_config.is_empty() {
        DEFAULT_SIM_CONFIG.to_string()
    } else {
        format!("{DEFAULT_SIM_CONFIG},{sim_config}")
    };
    driver::select_with_sim_config(choice, Some(&config)).unwrap_or_else(|e| panic!("test driver: {e}"))
}

/// The simulator's control client, when the simulator is the driver in use.
pub fn sim_control() -> Option<cumem_sim::control::Control> {
    (driver::current()? == DriverKind::Simulator).then(cumem_sim::control::Control::attach).flatten()
}
