//! Driver selection for test binaries, doctests and examples (feature `sim`).
//!
//! Tests opt in to the simulator by default: [`init`] selects `cumem-sim` unless `CUMEM_DRIVER`
//! says otherwise (`cargo xtask gpu-test` sets `CUMEM_DRIVER=real`), and turns on the simulator's
//! leak check at process exit, so every test binary ends by checking the live-resource report.
//!
//! [`hold`] queues a [`Gate`] on a stream, so that a test can show that a read is right only
//! because a type waited. A gated test must be `#[serial]` and every other test of its binary
//! `#[parallel]`: host functions of all streams share one thread, and a real driver lets a free
//! that waits for a held stream block every other thread's work (see [`Gate`]).
//!
//! A test that needs more devices than the machine has skips through [`needs_devices`] (or
//! [`skip`]), which says so and is counted by `cargo xtask gpu-test`; on the simulator it fails
//! instead, so that nothing is skipped there.
//!
//! ```
//! let kind = cumem_sys::testing::init();
//! assert_eq!(cumem_sys::driver::current(), Some(kind));
//! ```

use std::ffi::c_void;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::driver::{self, DriverChoice, DriverKind};
use crate::{api, sys};

#[cfg(unix)]
pub mod child_process;
mod deadline;
mod events;
mod skip;
#[cfg(unix)]
pub mod stand_in;
pub use deadline::{DEADLOCK_WATCHDOG, within_watchdog};
pub use events::{OnEvent, event_message, with_subscriber};
pub use skip::{SKIP_LOG_ENV, device_count, needs_devices, skip};

/// The simulator configuration every test process starts from: the leak check at exit (and the
/// simulator's default of two devices, so multi-device code paths run; a test that needs more
/// passes `devices=N` to [`init_with`], and [`needs_devices`] refuses to skip on the simulator).
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
    let choice = driver::choice_from_env(std::env::var(driver::DRIVER_ENV), DriverChoice::Simulator)
        .unwrap_or_else(|e| panic!("{e}"));
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

/// Holds a stream at the point [`hold`] queued it, until the gate is released or dropped, or its
/// deadline passes.
///
/// A gate is a host function that blocks until the test opens it: everything queued on the stream
/// after it has certainly not run while the gate is closed, whatever the machine's load, so a test
/// can read memory behind a type's back and see the old values deterministically.
///
/// # The rule: a gated test is `#[serial]`
/// Host functions of *all* streams share one thread, on a real driver as in the simulator, so a
/// closed gate stops every host function of the process; and on a real driver (measured on an
/// H100, `driver-api.md` §17) a thread waiting in an implicitly synchronising call (`cuMemFree`,
/// `cuMemFreeHost`, `cuMemHostUnregister`, …) for the held stream *holds the context*: other
/// threads' calls that queue work or allocate (async copies and memsets, event records,
/// `cuLaunchHostFunc`, `cuMemAlloc`, `cuStreamCreate`, `cuMemAllocHost`) block until it returns.
/// A test holding a gate while another test frees memory therefore cannot queue the work that comes
/// before opening its gate, and both hang. Hence, in every test binary that may run on a GPU:
/// - a test that holds a gate (or otherwise blocks a stream or the host-function thread) is
///   `#[serial]` (`serial_test`), and calls [`hold`] on its own thread (the wrappers in the test
///   crates assert `serial_test::is_locked_serially(None)`, which is per thread);
/// - every other test of that binary is `#[parallel]`, so that none runs beside a gated one (a test
///   with neither attribute gives no guarantee); threads a test spawns are joined before it returns;
/// - while the gate is closed, the gated test queues nothing that waits for the held stream or the
///   whole device (synchronisation, host access, drops that free): it would wait for itself.
///
/// The attributes go after `#[rstest]` (they then apply to every case) and, inside `proptest!`,
/// after `#[test]` (they apply to the whole run of cases).
///
/// Declare the gate in a local *after* the buffers it holds work for: on a panic it is dropped,
/// so opened, before their drops wait for the stream.
///
/// A gate opens by itself after [`GATE_DEADLINE`], saying so on stderr, and then fails the test
/// at [`Gate::release`]: a gated test that waits for its own held stream fails instead of
/// hanging. End a gated test's hold with `release()` (or `release_after`, joined): a dropped gate
/// only opens, so an expired one dropped without `release()` fails nothing.
#[must_use = "the stream is held until the gate is released or dropped, or its deadline passes"]
pub struct Gate {
    state: Arc<GateState>,
}

struct GateState {
    open: Mutex<bool>,
    cv: Condvar,
    /// Set when the deadline, not the test, opened the gate.
    expired: AtomicBool,
}

/// How long a [`Gate`] stays closed at most. Past it the gate opens by itself, says so on stderr,
/// and [`Gate::release`] fails the test: a test whose own call waits for the stream it holds
/// fails instead of hanging its binary (four did hang on an H100, 2026-11-23, when a copy the
/// simulator queued turned out to wait in the call on a GPU).
pub const GATE_DEADLINE: Duration = Duration::from_secs(60);

impl GateState {
    fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }
}

impl Gate {
    /// Opens the gate: the held stream carries on. Does not wait for the stream, so that whatever
    /// the test calls next is what has to wait.
    ///
    /// # Panics
    /// If the gate's deadline ([`GATE_DEADLINE`], or the one given to [`hold_for`]) opened it
    /// first: something the test called while holding the stream waited for it.
    #[track_caller]
    pub fn release(self) {
        // Read under the lock that the deadline's thread sets it under: either it opened the gate
        // first, or this does and it will not.
        let expired = {
            let mut open = self.state.open.lock().unwrap_or_else(PoisonError::into_inner);
            *open = true;
            self.state.cv.notify_all();
            self.state.expired.load(Ordering::Relaxed)
        };
        drop(self);
        assert!(
            !expired,
            "the gate was opened by its deadline: a call the test made while holding the stream waited for it"
        );
    }

    /// Opens the gate from another thread after `delay`, while the calling thread goes on to block
    /// in a call that must wait for the held stream (the returned handle is joined afterwards; it
    /// carries [`Gate::release`]'s panic if the deadline opened the gate first).
    pub fn release_after(self, delay: Duration) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            self.release();
        })
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = *self.state.open.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Gate").field("open", &open).finish()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.state.open();
    }
}

/// The host function of a gate: blocks the host-function thread until the gate opens.
///
/// # Safety
/// 1. `user` is a count of an `Arc<GateState>` leaked with `Arc::into_raw` for this call alone
///    (as [`hold_for`] passes it), and the driver calls this once for it.
unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // SAFETY: `user` is a leaked count of an `Arc<GateState>`, ours alone to reclaim (1):
    // reclaiming it here keeps the state alive until the callback has returned.
    let state = unsafe { Arc::from_raw(user.cast_const().cast::<GateState>()) };
    let mut open = state.open.lock().unwrap_or_else(PoisonError::into_inner);
    while !*open {
        open = state.cv.wait(open).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Holds `stream` here: work queued on it from now on does not start until the returned [`Gate`]
/// is released or dropped. Read the rule on [`Gate`] first: the calling test must be `#[serial]`.
///
/// The test crates wrap this in a safe `hold(&Stream)` that binds the stream's context and asserts
/// that the test runs serially.
///
/// # Safety
/// 1. `stream` is a live stream handle (a destroyed one crashes a real driver), or null for the
///    legacy stream of the current context.
/// 2. The stream's context is current on the calling thread.
///
/// # Panics
/// If the driver refuses to queue the host function.
pub unsafe fn hold(stream: sys::CUstream) -> Gate {
    // SAFETY: the caller's promises (1, 2) are `hold_for`'s.
    unsafe { hold_for(stream, GATE_DEADLINE) }
}

/// [`hold`] with a deadline other than [`GATE_DEADLINE`] (for the tests of the deadline itself).
///
/// # Safety
/// 1. `stream` is a live stream handle, or null for the legacy stream of the current context.
/// 2. The stream's context is current on the calling thread.
///
/// # Panics
/// If the driver refuses to queue the host function.
pub unsafe fn hold_for(stream: sys::CUstream, deadline: Duration) -> Gate {
    let state =
        Arc::new(GateState { open: Mutex::new(false), cv: Condvar::new(), expired: AtomicBool::new(false) });
    let user = Arc::into_raw(state.clone()).cast_mut().cast::<c_void>();
    // SAFETY: the caller promises a live stream of the current context (1, 2); the callback only
    // waits on the state, and owns the count passed to it; a driver is loaded, since the caller
    // has a stream.
    let code = unsafe { api::cuLaunchHostFunc(stream, Some(wait_at_gate), user) };
    if !code.is_success() {
        // SAFETY: not queued, so the count passed as `user` is still ours to reclaim.
        drop(unsafe { Arc::from_raw(user.cast_const().cast::<GateState>()) });
        panic!("cuLaunchHostFunc failed: {code:?}");
    }
    let watched = Arc::clone(&state);
    let test = std::thread::current().name().unwrap_or("<unnamed thread>").to_owned();
    // Without its thread a gate has no deadline, as before; the test still runs.
    let _ = std::thread::Builder::new().name("cumem-gate-deadline".into()).spawn(move || {
        let open = watched.open.lock().unwrap_or_else(PoisonError::into_inner);
        let (open, _) = watched
            .cv
            .wait_timeout_while(open, deadline, |open| !*open)
            .unwrap_or_else(PoisonError::into_inner);
        if !*open {
            let mut open = open;
            *open = true;
            watched.expired.store(true, Ordering::Relaxed);
            watched.cv.notify_all();
            drop(open);
            // Straight to the stream: the harness captures `eprintln!` and a hung test shows nothing.
            let _ = writeln!(
                std::io::stderr(),
                "{test}: a held stream's gate was opened by its {deadline:?} deadline (a call made while \
                 holding it waited for it)"
            );
        }
    });
    Gate { state }
}
