//! `cuGetErrorName` and `cuGetErrorString`: static C strings, usable before `cuInit`.

use std::ffi::c_char;

use cudarc::driver::sys::CUresult;

use crate::api::{self, Fail, Init};
use crate::errors;

/// # Safety
/// 1. `p_str` is NULL or valid for writing a pointer.
unsafe fn describe(
    p_str: *mut *const c_char,
    error: u32,
    pick: fn((&'static std::ffi::CStr, &'static std::ffi::CStr)) -> *const c_char,
) -> api::ApiResult {
    api::non_null(p_str, "pStr")?;
    match errors::lookup(error) {
        Some(pair) => {
            // SAFETY: checked non-NULL; valid per the caller contract.
            unsafe { p_str.write(pick(pair)) };
            Ok(())
        }
        None => {
            // SAFETY: as above; the driver writes NULL for an unknown code.
            unsafe { p_str.write(std::ptr::null()) };
            Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE))
        }
    }
}

/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`: the enumerator name; an
/// unknown code gives `INVALID_VALUE` and `*pStr = NULL`.
///
/// # Safety
/// 1. `p_str` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: u32, p_str: *mut *const c_char) -> CUresult {
    api::call("cuGetErrorName", Init::NotRequired, || {
        // SAFETY: forwarded caller contract.
        unsafe { describe(p_str, error, |(n, _)| n.as_ptr()) }
    })
}

/// `CUresult cuGetErrorString(CUresult error, const char **pStr)`: the description; an unknown
/// code gives `INVALID_VALUE` and `*pStr = NULL`.
///
/// # Safety
/// 1. `p_str` is NULL or valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: u32, p_str: *mut *const c_char) -> CUresult {
    api::call("cuGetErrorString", Init::NotRequired, || {
        // SAFETY: forwarded caller contract.
        unsafe { describe(p_str, error, |(_, d)| d.as_ptr()) }
    })
}
