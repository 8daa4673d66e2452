//! A client for the control interface of the *loaded* simulator.
//!
//! The copy of this crate linked into a program as an rlib has its own, unused statics; the live
//! simulator is the `libcumem_sim.so` that was loaded (by path, before cudarc's first call) and
//! that cudarc talks to. This client therefore opens that library with `RTLD_NOLOAD` and calls its
//! exported `cumemSim*` functions.
//!
//! ```no_run
//! use cumem_sim::control::Control;
//! let _lib = unsafe { libloading::Library::new(cumem_sim::library_path().unwrap()) }.unwrap();
//! let ctl = Control::attach().expect("simulator loaded");
//! ctl.configure("leak_check=1,latency_us=100").unwrap();
//! assert!(ctl.live_report().is_clean());
//! ```

use std::ffi::{CString, c_char, c_int};

use cudarc::driver::sys::CUresult;
use libloading::os::unix::{Library, Symbol};

pub use crate::report::{
    LiveAllocation, LiveContext, LiveEvent, LivePeerAccess, LivePool, LiveRegistration, LiveReport,
    LiveStream,
};
pub use crate::violation::Violation;

/// Why a control request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlError {
    /// The specification contains a NUL byte.
    NulInSpec,
    /// The simulator refused the request with this code (bad syntax, or a key that cannot
    /// change after `cuInit`).
    Rejected(CUresult),
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlError::NulInSpec => write!(f, "configuration contains a NUL byte"),
            ControlError::Rejected(code) => write!(f, "simulator rejected the configuration: {code:?}"),
        }
    }
}

impl std::error::Error for ControlError {}

/// A fault-injection rule (see `cumemSimInjectFault`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Exact exported symbol name, e.g. `cuMemAlloc_v2`.
    pub function: String,
    /// Which subsequent matching call fails first (1-based).
    pub nth: u64,
    /// The code the call returns.
    pub code: CUresult,
    /// How many consecutive calls fail (0 = all from the nth on).
    pub times: u64,
    /// Count and fail only calls made on the calling thread.
    pub this_thread_only: bool,
}

impl FaultRule {
    /// Fails the `nth` subsequent call of `function` once with `code`, on any thread.
    pub fn nth_call(function: &str, nth: u64, code: CUresult) -> Self {
        Self { function: function.to_string(), nth, code, times: 1, this_thread_only: false }
    }
}

/// Identifies an injected fault rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultId(pub u64);

type VersionFn = unsafe extern "C" fn() -> c_int;
type ConfigureFn = unsafe extern "C" fn(*const c_char) -> CUresult;
type DumpFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type VoidFn = unsafe extern "C" fn();
type InjectFn = unsafe extern "C" fn(*const c_char, u64, CUresult, u64, u64) -> u64;
type RemoveFn = unsafe extern "C" fn(u64);
type CountFn = unsafe extern "C" fn(*const c_char, u64) -> u64;

/// A handle on the loaded simulator's control functions.
pub struct Control {
    configure: Symbol<ConfigureFn>,
    live_report: Symbol<DumpFn>,
    violations: Symbol<DumpFn>,
    clear_violations: Symbol<VoidFn>,
    inject_fault: Symbol<InjectFn>,
    clear_faults: Symbol<VoidFn>,
    remove_fault: Symbol<RemoveFn>,
    call_count: Symbol<CountFn>,
    // Keeps the library referenced for as long as the symbols are used.
    _lib: Library,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control").finish_non_exhaustive()
    }
}

/// The calling thread's OS thread id (`gettid`), as recorded in violations and used by
/// thread-scoped fault rules.
pub fn current_os_tid() -> u64 {
    // SAFETY: gettid has no preconditions.
    (unsafe { libc::gettid() }) as u64
}

fn open_loaded() -> Option<Library> {
    let flags = libc::RTLD_NOLOAD | libc::RTLD_NOW;
    if let Some(path) = crate::library_path() {
        // SAFETY: RTLD_NOLOAD only returns a library that is already loaded (its initialisers
        // have run); nothing new is loaded.
        if let Ok(lib) = unsafe { Library::open(Some(&path), flags) } {
            return Some(lib);
        }
    }
    // SAFETY: as above.
    unsafe { Library::open(Some("libcuda.so"), flags) }.ok()
}

impl Control {
    /// Attaches to the already-loaded simulator; `None` if no library with the simulator's
    /// control ABI (v1) is loaded (e.g. the real driver is in use).
    pub fn attach() -> Option<Control> {
        let lib = open_loaded()?;
        // SAFETY: each symbol is looked up by its exported name and typed with the signature the
        // simulator exports; `cumemSimVersion` is checked before anything else is called.
        unsafe {
            let version: Symbol<VersionFn> = lib.get(b"cumemSimVersion\0").ok()?;
            if version() != 1 {
                return None;
            }
            Some(Control {
                configure: lib.get(b"cumemSimConfigure\0").ok()?,
                live_report: lib.get(b"cumemSimLiveReport\0").ok()?,
                violations: lib.get(b"cumemSimViolations\0").ok()?,
                clear_violations: lib.get(b"cumemSimClearViolations\0").ok()?,
                inject_fault: lib.get(b"cumemSimInjectFault\0").ok()?,
                clear_faults: lib.get(b"cumemSimClearFaults\0").ok()?,
                remove_fault: lib.get(b"cumemSimRemoveFault\0").ok()?,
                call_count: lib.get(b"cumemSimCallCount\0").ok()?,
                _lib: lib,
            })
        }
    }

    /// Applies a configuration in the `CUMEM_SIM` syntax (all keys before `cuInit`; only
    /// `latency_us`, `leak_check` and `schedule` after).
    pub fn configure(&self, spec: &str) -> Result<(), ControlError> {
        let c = CString::new(spec).map_err(|_| ControlError::NulInSpec)?;
        // SAFETY: `c` is NUL-terminated and outlives the call.
        match unsafe { (self.configure)(c.as_ptr()) } {
            CUresult::CUDA_SUCCESS => Ok(()),
            code => Err(ControlError::Rejected(code)),
        }
    }

    fn dump(f: &Symbol<DumpFn>) -> String {
        let mut cap = 4096;
        loop {
            let mut buf = vec![0u8; cap];
            // SAFETY: `buf` is valid for `cap` bytes of writes.
            let len = unsafe { f(buf.as_mut_ptr().cast::<c_char>(), cap) };
            if len <= cap {
                buf.truncate(len);
                return String::from_utf8(buf).expect("the simulator writes UTF-8");
            }
            cap = len;
        }
    }

    /// The simulator's live resources now.
    pub fn live_report(&self) -> LiveReport {
        serde_json::from_str(&Self::dump(&self.live_report))
            .expect("the simulator writes a valid live report")
    }

    /// The whole violation log.
    pub fn violations(&self) -> Vec<Violation> {
        serde_json::from_str(&Self::dump(&self.violations))
            .expect("the simulator writes a valid violation log")
    }

    /// The violations recorded for calls made on the calling thread.
    pub fn violations_on_this_thread(&self) -> Vec<Violation> {
        let tid = current_os_tid();
        self.violations().into_iter().filter(|v| v.os_tid == tid).collect()
    }

    /// Empties the violation log.
    pub fn clear_violations(&self) {
        // SAFETY: takes no arguments.
        unsafe { (self.clear_violations)() }
    }

    /// Installs a fault rule.
    ///
    /// # Panics
    /// If the simulator refuses the rule (a `function` containing NUL, or `code == CUDA_SUCCESS`).
    pub fn inject_fault(&self, rule: FaultRule) -> FaultId {
        let name = CString::new(rule.function).expect("function names contain no NUL");
        let tid = if rule.this_thread_only { current_os_tid() } else { 0 };
        // SAFETY: `name` is NUL-terminated and outlives the call.
        let id = unsafe { (self.inject_fault)(name.as_ptr(), rule.nth, rule.code, rule.times, tid) };
        assert_ne!(id, 0, "the simulator refused the fault rule");
        FaultId(id)
    }

    /// Removes one fault rule.
    pub fn remove_fault(&self, id: FaultId) {
        // SAFETY: plain integer argument.
        unsafe { (self.remove_fault)(id.0) }
    }

    /// Removes every fault rule.
    pub fn clear_faults(&self) {
        // SAFETY: takes no arguments.
        unsafe { (self.clear_faults)() }
    }

    /// How many times the exported function `function` (exact symbol name: `cuMemMap`,
    /// `cuMemAlloc_v2`) was called so far on any thread; failed and faulted calls count. A test
    /// proves a misuse made no driver call by comparing counts before and after it (prefer
    /// [`Control::calls_on_this_thread`] where other tests run in parallel).
    pub fn calls(&self, function: &str) -> u64 {
        self.count(function, 0)
    }

    /// As [`Control::calls`], counting only calls made on the calling thread.
    pub fn calls_on_this_thread(&self, function: &str) -> u64 {
        self.count(function, current_os_tid())
    }

    fn count(&self, function: &str, os_tid: u64) -> u64 {
        let Ok(name) = CString::new(function) else { return 0 };
        // SAFETY: `name` is NUL-terminated and outlives the call.
        unsafe { (self.call_count)(name.as_ptr(), os_tid) }
    }
}
