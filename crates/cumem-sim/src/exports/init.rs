//! `cuInit` and `cuDriverGetVersion`.

use std::ffi::c_int;

use cudarc::driver::sys::CUresult;

use crate::api::{self, Fail, Init};
use crate::lifecycle::initialize;

/// The driver version the simulator reports (CUDA 12.8, matching the bindings it serves).
pub const DRIVER_VERSION: c_int = 12080;

/// `CUresult cuInit(unsigned int Flags)`: reads the configuration and builds the devices.
/// `Flags` must be 0; repeated calls succeed without effect.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: u32) -> CUresult {
    api::call("cuInit", Init::NotRequired, || {
        if flags != 0 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("cuInit flags {flags:#x} must be 0"),
            ));
        }
        initialize()
    })
}

/// `CUresult cuDriverGetVersion(int *driverVersion)`: 12080; works before `cuInit`.
///
/// # Safety
/// 1. `driver_version` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(driver_version: *mut c_int) -> CUresult {
    api::call("cuDriverGetVersion", Init::NotRequired, || {
        // SAFETY: forwarded caller contract.
        unsafe { api::out(driver_version, DRIVER_VERSION, "driverVersion") }
    })
}
