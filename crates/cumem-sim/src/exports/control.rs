//! The simulator's own control ABI (v1): configuration, live report, violation log, fault
//! injection. These never fail with injected faults and work before `cuInit`.

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::sys::CUresult;

use crate::lifecycle::configure;
use crate::state::SIM;
use crate::{errors, fault, violation};

/// Version of the control ABI.
pub const CONTROL_ABI_VERSION: c_int = 1;

/// `int cumemSimVersion(void)`: the control ABI version (1); its presence marks the simulator.
#[unsafe(no_mangle)]
pub extern "C" fn cumemSimVersion() -> c_int {
    CONTROL_ABI_VERSION
}

/// `CUresult cumemSimConfigure(const char *spec)`: applies a specification in the `CUMEM_SIM`
/// syntax. Before `cuInit` every key is accepted; afterwards only `latency_us`, `leak_check` and
/// `schedule`.
/// Bad syntax or a refused key gives `INVALID_VALUE` and changes nothing.
///
/// # Safety
/// 1. `spec` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cumemSimConfigure(spec: *const c_char) -> CUresult {
    let run = || {
        if spec.is_null() {
            return CUresult::CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: non-NULL and NUL-terminated per the caller contract.
        let Ok(text) = unsafe { CStr::from_ptr(spec) }.to_str() else {
            return CUresult::CUDA_ERROR_INVALID_VALUE;
        };
        match configure(text) {
            Ok(()) => CUresult::CUDA_SUCCESS,
            Err(_) => CUresult::CUDA_ERROR_INVALID_VALUE,
        }
    };
    std::panic::catch_unwind(run).unwrap_or(CUresult::CUDA_ERROR_UNKNOWN)
}

/// Copies `text` into `buf` if it fits; returns its full length either way.
///
/// # Safety
/// 1. `buf` is NULL or valid for writing `cap` bytes.
unsafe fn emit(text: &str, buf: *mut c_char, cap: usize) -> usize {
    if !buf.is_null() && cap >= text.len() {
        // SAFETY: `buf` is valid for `cap >= text.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, text.len()) };
    }
    text.len()
}

/// `size_t cumemSimLiveReport(char *buf, size_t cap)`: writes the live report as UTF-8 JSON (no
/// NUL) if `cap` is large enough; returns its full length (retry with a larger buffer if larger
/// than `cap`).
///
/// # Safety
/// 1. `buf` is NULL or valid for writing `cap` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cumemSimLiveReport(buf: *mut c_char, cap: usize) -> usize {
    std::panic::catch_unwind(|| {
        let json = serde_json::to_string(&SIM.st.lock().live_report()).unwrap_or_default();
        // SAFETY: forwarded caller contract.
        unsafe { emit(&json, buf, cap) }
    })
    .unwrap_or(0)
}

/// `size_t cumemSimViolations(char *buf, size_t cap)`: the violation log as a JSON array, same
/// convention as `cumemSimLiveReport`.
///
/// # Safety
/// 1. `buf` is NULL or valid for writing `cap` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cumemSimViolations(buf: *mut c_char, cap: usize) -> usize {
    std::panic::catch_unwind(|| {
        let json = violation::to_json();
        // SAFETY: forwarded caller contract.
        unsafe { emit(&json, buf, cap) }
    })
    .unwrap_or(0)
}

/// `void cumemSimClearViolations(void)`: empties the violation log.
#[unsafe(no_mangle)]
pub extern "C" fn cumemSimClearViolations() {
    let _ = std::panic::catch_unwind(violation::clear);
}

/// `uint64_t cumemSimInjectFault(const char *function, uint64_t nth, CUresult code, uint64_t
/// times, uint64_t os_tid)`: makes the `nth` (1-based; 0 counts as 1) subsequent call of the
/// exported function `function` fail with `code`, `times` consecutive times (0 = every call from
/// then on), counting only calls on OS thread `os_tid` unless it is 0. Returns the rule id, or 0
/// if refused (NULL/non-UTF-8 name, `code` not a defined error code, or `CUDA_SUCCESS`).
///
/// # Safety
/// 1. `function` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cumemSimInjectFault(
    function: *const c_char,
    nth: u64,
    code: u32,
    times: u64,
    os_tid: u64,
) -> u64 {
    let run = || {
        if function.is_null() {
            return 0;
        }
        // SAFETY: non-NULL and NUL-terminated per the caller contract.
        let Ok(name) = unsafe { CStr::from_ptr(function) }.to_str() else {
            return 0;
        };
        match errors::from_u32(code) {
            Some(c) if c != CUresult::CUDA_SUCCESS => fault::add(name.to_string(), nth, c, times, os_tid),
            _ => 0,
        }
    };
    std::panic::catch_unwind(run).unwrap_or(0)
}

/// `void cumemSimClearFaults(void)`: removes every fault rule.
#[unsafe(no_mangle)]
pub extern "C" fn cumemSimClearFaults() {
    let _ = std::panic::catch_unwind(fault::clear);
}

/// `void cumemSimRemoveFault(uint64_t id)`: removes one fault rule.
#[unsafe(no_mangle)]
pub extern "C" fn cumemSimRemoveFault(id: u64) {
    let _ = std::panic::catch_unwind(|| fault::remove(id));
}

/// `uint64_t cumemSimCallCount(const char *function, uint64_t os_tid)`: how many times the
/// exported function `function` (exact symbol name, e.g. `cuMemMap`) was called so far, on OS
/// thread `os_tid`, or on every thread for 0. Failed and faulted calls count; 0 for a NULL or
/// unknown name.
///
/// # Safety
/// 1. `function` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cumemSimCallCount(function: *const c_char, os_tid: u64) -> u64 {
    let run = || {
        if function.is_null() {
            return 0;
        }
        // SAFETY: non-NULL and NUL-terminated per the caller contract.
        let Ok(name) = unsafe { CStr::from_ptr(function) }.to_str() else {
            return 0;
        };
        crate::calls::total(name, os_tid)
    };
    std::panic::catch_unwind(run).unwrap_or(0)
}
