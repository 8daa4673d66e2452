//! Contexts: the per-thread context stack and the checks every context-dependent call makes.
//!
//! Only primary contexts exist in v1. Their handles are stable across release/re-retain (as on
//! real drivers); a handle whose primary context is not active (released to zero, or reset) makes
//! context-dependent calls fail with `CUDA_ERROR_CONTEXT_IS_DESTROYED`.

use std::cell::{Cell, RefCell};

use cudarc::driver::sys::CUresult;

use crate::api::Fail;
use crate::state::{SIM, State};
use crate::stream::StreamKind;

thread_local! {
    /// The calling thread's context stack; the top is current.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// Set while the host-callback thread runs a `cuLaunchHostFunc` function.
    pub(crate) static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

/// The calling thread's current context handle.
pub(crate) fn current() -> Option<u64> {
    STACK.with(|s| s.borrow().last().copied())
}

/// `cuCtxSetCurrent`: replaces the top (or pops it for `None`).
pub(crate) fn set_current(ctx: Option<u64>) {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        match ctx {
            Some(c) => match s.last_mut() {
                Some(top) => *top = c,
                None => s.push(c),
            },
            None => {
                s.pop();
            }
        }
    });
}

/// `cuCtxPushCurrent`.
pub(crate) fn push(ctx: u64) {
    STACK.with(|s| s.borrow_mut().push(ctx));
}

/// `cuCtxPopCurrent`.
pub(crate) fn pop() -> Option<u64> {
    STACK.with(|s| s.borrow_mut().pop())
}

/// The device of the calling thread's current context, or the driver's error for its absence.
pub(crate) fn require(st: &State) -> Result<usize, Fail> {
    let Some(h) = current() else {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "no current context on this thread"));
    };
    let Some(d) = st.ctx_device(h) else {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            format!("current context {h:#x} is not valid"),
        ));
    };
    let pc = &st.devices[d].ctx;
    // A reset primary context that is still retained is re-initialised on use, as the driver does.
    if !pc.active && pc.retain == 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            format!(
                "current context is device {d}'s primary context, which is not active (released or reset)"
            ),
        ));
    }
    Ok(d)
}

/// Destroys everything a primary context owns, after its queued work has drained: allocations
/// (device, pitched, pool, managed, pinned) and host registrations, user and per-thread streams,
/// events. The device's memory pools survive, emptied of the context's allocations and trimmed.
pub(crate) fn reset(g: &mut parking_lot::MutexGuard<'_, State>, device: usize) {
    crate::copy::sync_device(g, device);
    destroy_resources(g, device);
}

/// The destroying half of [`reset`], for a caller that has drained the context's work itself and
/// must not let go of the lock in between.
pub(crate) fn destroy_resources(g: &mut parking_lot::MutexGuard<'_, State>, device: usize) {
    let ctx = crate::state::ctx_handle(device);
    let doomed: Vec<u64> = g.allocs.iter().filter(|(_, a)| a.ctx == ctx).map(|(&b, _)| b).collect();
    for base in doomed {
        if let Some(a) = g.allocs.remove(&base) {
            g.forget(&a, None);
        }
    }
    // The pools outlive the context (they are device objects) but give their memory back.
    let pools: Vec<u64> = g.pools.iter().filter(|(_, p)| p.device == device).map(|(&h, _)| h).collect();
    for h in pools {
        crate::pool::trim(g, h, 0);
    }
    g.streams.retain(|_, s| !(s.ctx == ctx && s.kind != StreamKind::Legacy));
    g.per_thread.retain(|(c, _), _| *c != ctx);
    g.events.retain(|_, e| e.ctx != ctx);
    SIM.changed.notify_all();
}
