//! The wrapper every exported driver function runs through.
//!
//! It contains panics (returning `CUDA_ERROR_UNKNOWN`), refuses calls from inside host
//! functions, applies injected faults, enforces `cuInit`, and records misuse in the violation log.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::sys::CUresult;

use crate::violation::{self, Violation};
use crate::{calls, errors, fault, state};

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

/// What the call wrapper keeps per thread, in one thread-local so that a call reaches it once
/// (each thread-local of a shared library is a `__tls_get_addr` call). Nothing in it needs
/// dropping, so it stays usable while the thread's other thread-locals are destroyed.
struct ApiThread {
    /// The OS thread id, fetched on first use (0 until then): one system call per thread, not
    /// one per driver call.
    tid: Cell<u64>,
    /// The exported function this thread is executing and its OS thread id (empty name outside
    /// calls): stream operations remember who enqueued them, to name it in violations detected
    /// when they run.
    caller: Cell<(&'static str, u64)>,
    /// Set while the host-callback thread runs a `cuLaunchHostFunc` function.
    in_host_fn: Cell<bool>,
    /// The call counters this thread used last, by the address and length of the function's name
    /// (direct-mapped: a call of a function used recently finds its counter in one probe, without
    /// the counting table's own thread-local, hash and borrow).
    recent: [Cell<RecentCounter>; RECENT],
}

/// A slot of [`ApiThread::recent`]: a name's address and length, and its counter.
type RecentCounter = (usize, usize, Option<calls::Counter>);

/// Slots in [`ApiThread::recent`]: more than the calls a hot loop makes.
const RECENT: usize = 16;

thread_local! {
    static THREAD: ApiThread = const {
        ApiThread {
            tid: Cell::new(0),
            caller: Cell::new(("", 0)),
            in_host_fn: Cell::new(false),
            recent: [const { Cell::new((0, 0, None)) }; RECENT],
        }
    };
}

impl ApiThread {
    fn tid(&self) -> u64 {
        match self.tid.get() {
            0 => {
                // SAFETY: gettid has no preconditions.
                let tid = (unsafe { libc::gettid() }) as u64;
                self.tid.set(tid);
                tid
            }
            tid => tid,
        }
    }

    /// Counts one call of `name` by this thread (whose OS id is `tid`).
    #[inline]
    fn count(&self, name: &'static str, tid: u64) {
        let (address, len) = (name.as_ptr() as usize, name.len());
        let slot = &self.recent[((address >> 3) ^ len) % RECENT];
        let counter = match slot.get() {
            (a, l, Some(counter)) if (a, l) == (address, len) => counter,
            _ => {
                let counter = calls::counter(name, tid);
                slot.set((address, len, Some(counter)));
                counter
            }
        };
        calls::bump(counter);
    }
}

/// The calling thread's OS thread id.
pub(crate) fn os_tid() -> u64 {
    THREAD.with(ApiThread::tid)
}

/// Marks the calling thread as running a host function (`true`) or not any more.
pub(crate) fn set_in_host_fn(running: bool) {
    THREAD.with(|t| t.in_host_fn.set(running));
}

/// The exported function the calling thread is inside (`""` outside any) and the thread's OS id.
pub(crate) fn caller() -> (&'static str, u64) {
    THREAD.with(|t| {
        let (name, tid) = t.caller.get();
        if tid == 0 { (name, t.tid()) } else { (name, tid) }
    })
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
    let (tid, outer, in_host_fn) = THREAD.with(|t| {
        let tid = t.tid();
        t.count(name, tid);
        (tid, t.caller.replace((name, tid)), t.in_host_fn.get())
    });
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if in_host_fn {
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
    THREAD.with(|t| t.caller.set(outer));
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
