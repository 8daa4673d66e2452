//! The wrapper every exported driver function runs through.
//!
//! It contains panics (returning `CUDA_ERROR_UNKNOWN`), refuses calls from inside host
//! functions, applies injected faults, enforces `cuInit`, and records misuse in the violation log.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::sys::CUresult;

use crate::violation::{self, Violation};
use crate::{errors, fault, state};

/// Why a call failed; `message: Some` marks misuse to be recorded as a violation.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) code: CUresult,
    pub(crate) message: Option<String>,
}

impl Fail {
    /// A misuse of the API: returned and recorded in the violation log.
    pub(crate) fn misuse(code: CUresult, message: impl Into<String>) -> Self {
        Self { code, message: Some(message.into()) }
    }

    /// A legitimate non-success answer (`NOT_READY`, `OUT_OF_MEMORY`, `NOT_FOUND` for a probe…).
    pub(crate) fn quiet(code: CUresult) -> Self {
        Self { code, message: None }
    }
}

/// Result of an API body.
pub(crate) type ApiResult = Result<(), Fail>;

/// The calling thread's OS thread id.
pub(crate) fn os_tid() -> u64 {
    thread_local! {
        // A thread's id never changes: one system call per thread, not one per driver call.
        // SAFETY: gettid has no preconditions.
        static TID: u64 = (unsafe { libc::gettid() }) as u64;
    }
    TID.with(|t| *t)
}

thread_local! {
    /// The exported function this thread is executing and its OS thread id (empty name outside
    /// calls): stream operations remember who enqueued them, to name it in violations detected
    /// when they run.
    static CALLER: Cell<(&'static str, u64)> = const { Cell::new(("", 0)) };
}

/// The exported function the calling thread is inside (`""` outside any) and the thread's OS id.
pub(crate) fn caller() -> (&'static str, u64) {
    let (name, tid) = CALLER.with(Cell::get);
    if tid == 0 { (name, os_tid()) } else { (name, tid) }
}

/// Whether a call may proceed before `cuInit`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Init {
    /// Needs a successful `cuInit` first.
    Required,
    /// `cuInit`, `cuDriverGetVersion`, `cuGetErrorName/String`.
    NotRequired,
}

/// Runs `body` as the exported function `name`.
pub(crate) fn call(name: &'static str, init: Init, body: impl FnOnce() -> ApiResult) -> CUresult {
    let tid = os_tid();
    crate::calls::count(name, tid);
    let outer = CALLER.with(|c| c.replace((name, tid)));
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if crate::context::IN_HOST_FN.with(|f| f.get()) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_NOT_PERMITTED,
                "CUDA call from inside a host function (cuLaunchHostFunc)",
            ));
        }
        if let Some(code) = fault::check(name, tid) {
            return Err(Fail::quiet(code));
        }
        if init == Init::Required && !state::is_initialized() {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_NOT_INITIALIZED, "called before cuInit"));
        }
        body()
    }));
    CALLER.with(|c| c.set(outer));
    let fail = match outcome {
        Ok(Ok(())) => return CUresult::CUDA_SUCCESS,
        Ok(Err(fail)) => fail,
        Err(_) => Fail::misuse(CUresult::CUDA_ERROR_UNKNOWN, "internal simulator panic"),
    };
    if let Some(message) = fail.message {
        violation::record(Violation {
            function: name.to_string(),
            code: fail.code as u32,
            code_name: errors::name_str(fail.code).to_string(),
            message,
            os_tid: tid,
        });
    }
    fail.code
}

/// Writes `value` through a non-NULL out-pointer or fails with `INVALID_VALUE`.
///
/// # Safety
/// 1. `ptr` is NULL or valid for writing a `T` (the C caller's contract).
pub(crate) unsafe fn out<T>(ptr: *mut T, value: T, what: &str) -> ApiResult {
    if ptr.is_null() {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("NULL {what} out-pointer")));
    }
    // SAFETY: non-NULL, and valid for a write of `T` per this function's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Fails with `INVALID_VALUE` if an out-pointer is NULL (checked before anything else happens).
pub(crate) fn non_null<T>(ptr: *const T, what: &str) -> ApiResult {
    if ptr.is_null() {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("NULL {what} out-pointer")));
    }
    Ok(())
}
