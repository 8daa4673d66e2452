//! Shared test helpers: a gate that holds a stream at the point it is queued, so that work queued
//! after it has certainly not run until the test opens the gate.
//!
//! The simulator (and a real driver) runs host functions in stream order; the gate's host function
//! blocks until the gate opens, and everything queued behind it waits. Reading memory behind a
//! type's back while the gate is closed therefore sees the old values deterministically, whatever
//! the machine's load. Rules for tests (the simulator runs every host function on one callback
//! thread, shared by the tests of a binary):
//! - queue nothing that waits (synchronise, host access, drops that free) on a held stream, or on
//!   the whole device, before opening its gate;
//! - keep the [`Gate`] in a local declared *after* the buffers it holds work for, so that on a
//!   panic it is dropped (and opened) first: dropping a gate opens it.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use cumem_core::Stream;
use cumem_core::sys;

struct State {
    open: Mutex<bool>,
    cv: Condvar,
}

impl State {
    fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }
}

/// Holds a stream until released (or dropped).
#[must_use = "the stream is held until the gate is released or dropped"]
pub struct Gate {
    state: Arc<State>,
}

impl Gate {
    /// Opens the gate: the held stream carries on. Does not wait for it, so that whatever the
    /// test calls next is what has to wait.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.state.open();
    }
}

unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // SAFETY: `user` is the count of the `Arc<State>` that `hold` leaked for this call, which runs
    // once: reclaiming it here keeps the state alive until the callback has returned.
    let state = unsafe { Arc::from_raw(user.cast_const().cast::<State>()) };
    let mut open = state.open.lock().unwrap_or_else(PoisonError::into_inner);
    while !*open {
        open = state.cv.wait(open).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Holds `stream` here: work queued on it from now on does not start until the gate opens.
pub fn hold(stream: &Stream) -> Gate {
    let state = Arc::new(State { open: Mutex::new(false), cv: Condvar::new() });
    let user = Arc::into_raw(state.clone()).cast_mut().cast::<c_void>();
    stream.context().bind().unwrap();
    // SAFETY: the callback only waits on the state, and owns the count passed to it.
    let code = unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(wait_at_gate), user) };
    if code != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: not queued, so the count passed as `user` is still ours to reclaim.
        drop(unsafe { Arc::from_raw(user.cast_const().cast::<State>()) });
        panic!("cuLaunchHostFunc failed: {code:?}");
    }
    Gate { state }
}
