//! A gate that holds a stream back at the point it is queued until opened, so that "work still
//! running" is deterministic on the simulator (and on a GPU).
#![allow(dead_code)]

use std::ffi::c_void;
use std::sync::Arc;

use cumem_core::Stream;
use cumem_core::sys;
use parking_lot::{Condvar, Mutex};

/// Blocks a stream until [`Gate::open`] is called.
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // SAFETY: `user` is the `Arc<Gate>` count leaked by `hold`, reclaimed only by `release` after
    // the stream has passed the gate.
    let gate = unsafe { &*user.cast::<Gate>() };
    let mut open = gate.open.lock();
    while !*open {
        gate.cv.wait(&mut open);
    }
}

/// Queues a gate on `stream`: nothing queued after it runs before the gate is opened.
pub fn hold(stream: &Stream) -> Arc<Gate> {
    let gate = Arc::new(Gate { open: Mutex::new(false), cv: Condvar::new() });
    let user = Arc::into_raw(gate.clone()) as *mut c_void;
    stream.context().bind().unwrap();
    // SAFETY: the callback only waits on the gate, which stays alive (one leaked count) until
    // released.
    let code = unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(wait_at_gate), user) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    gate
}

impl Gate {
    /// Lets the stream pass.
    pub fn open(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }
}

/// Opens the gate, waits for `stream` to pass it and reclaims the count `hold` leaked.
pub fn release(gate: Arc<Gate>, stream: &Stream) -> cumem_core::Result<()> {
    gate.open();
    let done = stream.synchronize();
    // If synchronising failed the callback may not have run: leak the count then.
    if done.is_ok() {
        // SAFETY: the count leaked by `hold`; the callback has returned (the stream is synchronised).
        drop(unsafe { Arc::from_raw(Arc::as_ptr(&gate)) });
    }
    done
}

/// Opens the gate when dropped, so a failing test unwinds instead of hanging behind it (dropping
/// device memory or pinned memory waits for the device).
pub struct OpenOnDrop(pub Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}
