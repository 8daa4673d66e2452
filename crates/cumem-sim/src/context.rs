//! Contexts: the per-thread context stack and the checks every context-dependent call makes.
//!
//! Only primary contexts exist in v1. Their handles are stable across release/re-retain (as on
//! real drivers); a handle whose primary context is not active (released to zero, or reset) makes
//! context-dependent calls fail with `CUDA_ERROR_CONTEXT_IS_DESTROYED`.

use std::cell::{Cell, RefCell};

use cudarc::driver::sys::CUresult;

use crate::api::Fail;
use crate::state::{SIM, State, ctx_handle};
use crate::stream::StreamKind;
use crate::stream::{all_targets, wait_for};

/// `CU_CTX_MAP_HOST`: always reported by a primary context, never settable on one.
pub(crate) const CTX_MAP_HOST: u32 = 0x8;

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

/// `cuDevicePrimaryCtxRetain`: activates (first time) and references the primary context of
/// `dev`; returns its handle.
pub(crate) fn primary_retain(dev: i32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let d = st.ordinal(dev)?;
    let pc = &mut st.devices[d].ctx;
    pc.retain += 1;
    pc.active = true;
    Ok(ctx_handle(d))
}

/// `cuDevicePrimaryCtxRelease`: at retain count zero the context is reset (its queued work
/// drains, then everything it owns is freed).
pub(crate) fn primary_release(dev: i32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let d = st.ordinal(dev)?;
    if st.devices[d].ctx.retain == 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            format!("primary context of device {d} released more often than retained"),
        ));
    }
    // Releasing the last reference destroys the context. Its queued work drains first, which
    // lets go of the lock; another thread may retain the context meanwhile, and the context
    // it gets (with the streams and allocations it creates) must not be destroyed by this
    // release. So drain while still retained, and decide only once the count is settled.
    loop {
        match st.devices[d].ctx.retain {
            0 => return Ok(()), // released by another thread while we drained
            1 => {}
            _ => {
                st.devices[d].ctx.retain -= 1;
                return Ok(());
            }
        }
        let before = st.devices[d].ctx.retain;
        crate::copy::sync_device(&mut st, d);
        if st.devices[d].ctx.retain == before {
            break;
        }
    }
    st.devices[d].ctx.retain = 0;
    destroy_resources(&mut st, d);
    st.devices[d].ctx.active = false;
    Ok(())
}

/// `cuDevicePrimaryCtxReset`: frees everything the context owns and clears its flags and active
/// state, leaving the retain count unchanged.
pub(crate) fn primary_reset(dev: i32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let d = st.ordinal(dev)?;
    reset(&mut st, d);
    let pc = &mut st.devices[d].ctx;
    pc.flags = 0;
    pc.active = false;
    Ok(())
}

/// `cuDevicePrimaryCtxSetFlags`: one scheduling value plus LMEM_RESIZE/COREDUMP/SYNC_MEMOPS bits.
pub(crate) fn primary_set_flags(dev: i32, flags: u32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let d = st.ordinal(dev)?;
    let sched = flags & 0x7;
    if flags > 0xff || flags & CTX_MAP_HOST != 0 || !matches!(sched, 0 | 1 | 2 | 4) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("invalid primary context flags {flags:#x}"),
        ));
    }
    st.devices[d].ctx.flags = flags;
    Ok(())
}

/// `cuCtxSynchronize`: waits for all work queued so far in the current context's device, then
/// lets its pools release memory above their thresholds.
pub(crate) fn synchronize() -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let d = require(&st)?;
    let targets = all_targets(&st, d);
    wait_for(&mut st, &targets);
    crate::pool::on_synchronize(&mut st, d);
    Ok(())
}
