//! Contexts: primary contexts, contexts made by `cuCtxCreate`, the per-thread context stack,
//! and the checks every context-dependent call makes.
//!
//! A primary context's handle is stable across release/re-retain (as on real drivers); a handle
//! whose primary context is not active (released to zero, or reset) makes context-dependent calls
//! fail with `CUDA_ERROR_CONTEXT_IS_DESTROYED`. A created context has its own legacy (NULL)
//! stream, flags and limits; destroying it drains its work, then frees its allocations, streams
//! and events (observed on an H100, §17 of the driver reference: a later memset or `cuMemFree` of
//! such an allocation gives `INVALID_VALUE`, a second destroy `CONTEXT_IS_DESTROYED`). Its handle
//! is never reused, so threads that still have it current get `CONTEXT_IS_DESTROYED`. Memory
//! belongs to a context but any context can use it (unified addressing): copies and frees do not
//! check the owner.

use std::cell::RefCell;

use cudarc::driver::sys::CUresult;

use crate::api::Fail;
use crate::state::{SIM, State, ctx_handle};
use crate::stream::StreamKind;
use crate::stream::{ctx_targets, wait_for};

/// `CU_CTX_MAP_HOST`: always reported by a primary context, never settable on one.
pub(crate) const CTX_MAP_HOST: u32 = 0x8;
/// The `CUlimit` values a context answers for (STACK_SIZE .. PERSISTING_L2_CACHE_SIZE).
const LIMIT_COUNT: usize = 7;
/// `CU_LIMIT_PERSISTING_L2_CACHE_SIZE`.
const LIMIT_PERSISTING_L2: u32 = 6;
/// `CU_LIMIT_MAX` of the cuda-12080 bindings: 7..=9 are the CIG limits (SHMEM_SIZE, CIG_ENABLED,
/// CIG_SHMEM_FALLBACK_ENABLED).
const LIMIT_MAX: u32 = 10;
/// `CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE`.
const ATTR_MAX_PERSISTING_L2_CACHE_SIZE: u32 = 108;
/// What `cuCtxGetApiVersion` answers for every context: the capability level of every context
/// since CUDA 3.2 (a real driver answers 3020; the value is not the driver version).
pub(crate) const API_VERSION: u32 = 3020;

/// A context made by `cuCtxCreate`.
#[derive(Debug)]
pub(crate) struct Created {
    pub(crate) device: usize,
    pub(crate) flags: u32,
    /// Internal id of its legacy (NULL) stream.
    pub(crate) legacy: u64,
    /// Destroyed by `cuCtxDestroy` (the handle stays known, to answer `CONTEXT_IS_DESTROYED`).
    pub(crate) destroyed: bool,
}

/// `cuCtxGetLimit` values of one context, indexed by `CUlimit`.
pub(crate) type Limits = [u64; LIMIT_COUNT];

/// The limits of a new context: the defaults CUDA documents (printf FIFO 1 MiB, malloc heap
/// 8 MiB, device-runtime sync depth 2 and 2048 pending launches, no persisting L2) and, where the
/// default depends on the device, common values (stack 1 KiB, L2 fetch granularity 64 B). Not
/// observed on the H100 of §17.
const DEFAULT_LIMITS: Limits = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0];

thread_local! {
    /// The calling thread's context stack; the top is current.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
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
    current_ctx(st).map(|(_, d)| d)
}

/// The calling thread's current context and its device, or the driver's error for its absence.
pub(crate) fn current_ctx(st: &State) -> Result<(u64, usize), Fail> {
    let Some(h) = current() else {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "no current context on this thread"));
    };
    live(st, h, "current context").map(|d| (h, d))
}

/// The device of context `h` if it may be used, or why not (`what` names it in the message).
pub(crate) fn live(st: &State, h: u64, what: &str) -> Result<usize, Fail> {
    if let Some(c) = st.contexts.get(&h) {
        if c.destroyed {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
                format!("{what} {h:#x} was destroyed by cuCtxDestroy"),
            ));
        }
        return Ok(c.device);
    }
    let Some(d) = st.primary_device(h) else {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            format!("{what} {h:#x} is not valid"),
        ));
    };
    let pc = &st.devices[d].ctx;
    // A reset primary context that is still retained is re-initialised on use, as the driver does.
    if !pc.active && pc.retain == 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            format!("{what} is device {d}'s primary context, which is not active (released or reset)"),
        ));
    }
    Ok(d)
}

/// Destroys everything a primary context owns, after its queued work has drained: allocations
/// (device, pitched, pool, managed, pinned) and host registrations, user and per-thread streams,
/// events. The device's memory pools survive, emptied of the context's allocations and trimmed.
pub(crate) fn reset(g: &mut parking_lot::MutexGuard<'_, State>, device: usize) {
    crate::hold::drain_devices(g, &[device]);
    destroy_resources(g, device);
}

/// The destroying half of [`reset`], for a caller that has drained the context's work itself and
/// must not let go of the lock in between.
pub(crate) fn destroy_resources(g: &mut parking_lot::MutexGuard<'_, State>, device: usize) {
    destroy_owned(g, ctx_handle(device));
    // The pools outlive the context (they are device objects) but give their memory back.
    let pools: Vec<u64> = g.pools.iter().filter(|(_, p)| p.device == device).map(|(&h, _)| h).collect();
    for h in pools {
        crate::pool::trim(g, h, 0);
    }
    g.limits.remove(&ctx_handle(device));
}

/// Frees everything context `ctx` owns (its work has drained): allocations and registrations,
/// streams but its legacy stream, per-thread streams, events.
fn destroy_owned(g: &mut parking_lot::MutexGuard<'_, State>, ctx: u64) {
    let doomed: Vec<u64> = g.allocs.iter().filter(|(_, a)| a.ctx == ctx).map(|(&b, _)| b).collect();
    for base in doomed {
        if let Some(a) = g.allocs.remove(&base) {
            g.forget(&a, None);
        }
    }
    // Through `remove_drained`, like any drained destroyed stream: another context's managed
    // memory may be attached to one of these, and must not keep naming a stream that is gone.
    let streams: Vec<u64> = g
        .streams
        .iter()
        .filter(|(_, s)| s.ctx == ctx && s.kind != StreamKind::Legacy)
        .map(|(&id, _)| id)
        .collect();
    for id in streams {
        crate::stream::remove_drained(g, id);
    }
    g.per_thread.retain(|(c, _), _| *c != ctx);
    g.events.retain(|_, e| e.ctx != ctx);
    // Peer access is lost with either context of the pair.
    g.peer_access.retain(|&(a, b)| a != ctx && b != ctx);
    SIM.changed.notify_all();
}

/// `cuCtxCreate`: a new context on `dev`, pushed onto the calling thread's stack. Flags: one
/// scheduling value (0, 1, 2 or 4) plus MAP_HOST (8), LMEM_RESIZE (0x10), the COREDUMP bits
/// and SYNC_MEMOPS (0x80); anything above 0xff or two scheduling bits give `INVALID_VALUE` and
/// create nothing (observed on an RTX 3060, §4 of the driver reference).
pub(crate) fn create(flags: u32, dev: i32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let d = st.ordinal(dev)?;
    if flags > 0xff || !matches!(flags & 0x7, 0 | 1 | 2 | 4) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("invalid context flags {flags:#x}"),
        ));
    }
    let h = st.new_ctx_handle();
    let legacy = st.new_stream_handle();
    st.streams.insert(legacy, crate::stream::Stream::new(d, h, StreamKind::Legacy, 0, 0));
    st.contexts.insert(h, Created { device: d, flags, legacy, destroyed: false });
    push(h);
    Ok(h)
}

/// `cuCtxDestroy`: drains the context's work (an implicit synchronisation, holding the device
/// meanwhile), then frees everything it owns and pops it if it is the calling thread's current
/// context. Other threads that have it current keep it and get `CONTEXT_IS_DESTROYED`.
pub(crate) fn destroy(h: u64) -> Result<(), Fail> {
    if h == 0 {
        // The documented error list has INVALID_VALUE; NULL is the one value it can be about.
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "cuCtxDestroy(NULL)"));
    }
    let mut st = SIM.st.lock();
    let device = match st.contexts.get(&h) {
        Some(c) if c.destroyed => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
                format!("context {h:#x} was already destroyed"),
            ));
        }
        Some(c) => c.device,
        // Not observed; the documentation manages primary contexts through
        // cuDevicePrimaryCtxRelease/Reset only, and cuCtxDestroy lists INVALID_CONTEXT.
        None if st.primary_device(h).is_some() => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_CONTEXT,
                format!("{h:#x} is a primary context: release it with cuDevicePrimaryCtxRelease"),
            ));
        }
        None => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_CONTEXT,
                format!("{h:#x} is not a context"),
            ));
        }
    };
    let targets: Vec<(u64, u64)> =
        st.streams.iter().filter(|(_, s)| s.ctx == h).map(|(&id, s)| (id, s.last_seq)).collect();
    crate::hold::drain(&mut st, &[device], &targets);
    // Another thread may have destroyed it while this one waited.
    let c = st.contexts.get_mut(&h).expect("created contexts are never forgotten");
    if c.destroyed {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            format!("context {h:#x} was destroyed by another thread meanwhile"),
        ));
    }
    c.destroyed = true;
    let legacy = c.legacy;
    destroy_owned(&mut st, h);
    // Drained above; GLOBAL and HOST attachments may name it too.
    crate::stream::remove_drained(&mut st, legacy);
    st.limits.remove(&h);
    drop(st);
    if current() == Some(h) {
        pop();
    }
    Ok(())
}

/// Checks a `cuCtxPushCurrent` / `cuCtxSetCurrent` argument: a primary context, or a created one
/// not destroyed (`INVALID_CONTEXT` otherwise, per the documentation).
pub(crate) fn check_bindable(h: u64) -> Result<(), Fail> {
    if SIM.st.lock().ctx_device(h).is_none() {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            format!("{h:#x} is not a (live) context"),
        ));
    }
    Ok(())
}

/// `cuCtxGetFlags`: a primary context's flags always include MAP_HOST (observed); a created
/// context answers the flags it was created (or last set) with.
pub(crate) fn flags() -> Result<u32, Fail> {
    let st = SIM.st.lock();
    let (h, d) = current_ctx(&st)?;
    Ok(match st.contexts.get(&h) {
        Some(c) => c.flags,
        None => st.devices[d].ctx.flags | CTX_MAP_HOST,
    })
}

/// `cuCtxSetFlags`: the documentation points to `cuDevicePrimaryCtxSetFlags` for the values, so
/// the same rules apply (MAP_HOST, two scheduling bits or bits above 0xff give `INVALID_VALUE`).
pub(crate) fn set_flags(flags: u32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let (h, d) = current_ctx(&st)?;
    if flags > 0xff || flags & CTX_MAP_HOST != 0 || !matches!(flags & 0x7, 0 | 1 | 2 | 4) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("invalid context flags {flags:#x}"),
        ));
    }
    match st.contexts.get_mut(&h) {
        Some(c) => c.flags = flags,
        None => st.devices[d].ctx.flags = flags,
    }
    Ok(())
}

/// The index of a limit the simulator answers for, `UNSUPPORTED_LIMIT` for the CIG limits (CIG
/// contexts are not modelled), `INVALID_VALUE` for numbers the bindings do not define.
fn limit_index(limit: u32) -> Result<usize, Fail> {
    match limit {
        l if (l as usize) < LIMIT_COUNT => Ok(l as usize),
        l if l < LIMIT_MAX => Err(Fail::misuse(
            CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT,
            format!("limit {l} belongs to CIG contexts, which are not modelled"),
        )),
        l => Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("unknown limit {l}"))),
    }
}

/// `cuCtxGetLimit` for the current context.
pub(crate) fn limit(limit: u32) -> Result<u64, Fail> {
    let st = SIM.st.lock();
    let (h, _) = current_ctx(&st)?;
    let i = limit_index(limit)?;
    Ok(st.limits.get(&h).unwrap_or(&DEFAULT_LIMITS)[i])
}

/// `cuCtxSetLimit` for the current context. The persisting L2 size is clamped to the device's
/// MAX_PERSISTING_L2_CACHE_SIZE (the documentation says the driver may adjust it); other values
/// are kept as given.
pub(crate) fn set_limit(limit: u32, value: u64) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let (h, d) = current_ctx(&st)?;
    let i = limit_index(limit)?;
    let value = if limit == LIMIT_PERSISTING_L2 {
        value.min(st.devices[d].attr(ATTR_MAX_PERSISTING_L2_CACHE_SIZE).unwrap_or(0).max(0) as u64)
    } else {
        value
    };
    st.limits.entry(h).or_insert(DEFAULT_LIMITS)[i] = value;
    Ok(())
}

/// `cuCtxGetApiVersion`: [`API_VERSION`] for a usable context (NULL: the current one).
pub(crate) fn api_version(h: u64) -> Result<u32, Fail> {
    let st = SIM.st.lock();
    if h == 0 {
        current_ctx(&st)?;
    } else {
        live(&st, h, "context")?;
        // A reset primary context answers as destroyed until it is retained again, even while
        // still retained: libraries rely on this to notice a reset (UCX, openucx/ucx#11437).
        if let Some(d) = st.primary_device(h)
            && !st.devices[d].ctx.active
        {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED,
                format!("device {d}'s primary context is not active (released or reset)"),
            ));
        }
    }
    Ok(API_VERSION)
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
            // Another thread's release brought the count to 0 while we drained: this one
            // releases a context no longer retained, as a release after it would.
            0 => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_CONTEXT,
                    format!(
                        "primary context of device {d} released by another thread meanwhile: not retained"
                    ),
                ));
            }
            1 => {}
            _ => {
                st.devices[d].ctx.retain -= 1;
                return Ok(());
            }
        }
        let before = st.devices[d].ctx.retain;
        crate::hold::drain_devices(&mut st, &[d]);
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

/// `cuCtxSynchronize`: waits for all work queued so far in the current context's streams (not
/// other contexts' on the same device: driver-api.md §4), then lets the device's pools release
/// memory above their thresholds.
pub(crate) fn synchronize() -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = current_ctx(&st)?;
    let targets = ctx_targets(&st, ctx);
    wait_for(&mut st, &targets);
    crate::pool::on_synchronize(&mut st, d);
    Ok(())
}
