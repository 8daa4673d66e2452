//! Implicit synchronisation holds the device: what other threads' calls do while one thread waits
//! in an implicitly synchronising call.
//!
//! Observed on an H100 (§17 of the driver reference): while one thread waits in `cuMemFree` (or
//! another implicitly synchronising call) for the device's queued work, other threads' calls that
//! queue work or allocate in that context block until it returns (`cuMemsetD8Async` and
//! `cuMemcpyHtoDAsync` on another stream, `cuEventCreate`, `cuEventRecord`, `cuLaunchHostFunc`,
//! `cuMemAlloc`, `cuStreamCreate`, `cuMemAllocHost`), while `cuStreamQuery`, `cuMemGetInfo` and
//! `cuMemAllocAsync` return. So a thread whose stream is held by a blocked host function, and that
//! then queues more work, deadlocks with any thread that frees memory, as on the GPU.
//!
//! The simulator holds the whole device (every context of it), since the waiting calls drain the
//! whole device. The gated calls are the observed ones plus those that queue work the same way
//! (synchronous copies and memsets, 2D/3D forms, `cuStreamWaitEvent`, prefetches and attachments,
//! `cuMemAllocPitch`, `cuMemAllocManaged`, `cuMemHostAlloc`): §17's rule is "calls that queue work
//! or allocate". Not gated, as observed or as the documentation gives no reason to: queries and
//! synchronisations, stream and event destruction, `cuMemHostRegister`, the stream-ordered
//! allocator (`cuMemAllocAsync` observed; `cuMemFreeAsync` unobserved, kept with it), the VMM
//! calls (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`,
//! `cuMemRelease` observed on an H100, 2026-11-24, to return at once; none of them drains or holds
//! a device either: `crate::vmm`), and the implicitly synchronising calls themselves (each drains
//! on its own). An asynchronous copy between
//! two host memories waits for its own stream's earlier work (`crate::copy`, observed) without
//! holding the device: it is gated like any copy, but nothing observed says that other threads'
//! calls wait for it, and it waits for one stream, not the device.

use cudarc::driver::sys::CUstream;
use parking_lot::MutexGuard;

use crate::api::{Fail, os_tid};
use crate::state::{SIM, State};
use crate::stream::{all_targets, resolve, wait_for};

/// Waits, holding `devices`, until every `(stream, seq)` target is complete.
pub(crate) fn drain(g: &mut MutexGuard<'_, State>, devices: &[usize], targets: &[(u64, u64)]) {
    let me = os_tid();
    for &d in devices {
        g.devices[d].held_by.push(me);
    }
    wait_for(g, targets);
    for &d in devices {
        let held = &mut g.devices[d].held_by;
        if let Some(i) = held.iter().position(|&t| t == me) {
            held.swap_remove(i);
        }
    }
    SIM.changed.notify_all();
}

/// Waits, holding them, until every stream of `devices` has drained what is queued now.
pub(crate) fn drain_devices(g: &mut MutexGuard<'_, State>, devices: &[usize]) {
    let targets: Vec<(u64, u64)> = devices.iter().flat_map(|&d| all_targets(g, d)).collect();
    drain(g, devices, &targets);
}

/// Whether a thread other than the caller holds `device`.
fn held_by_other(st: &State, device: usize) -> bool {
    let me = os_tid();
    st.devices[device].held_by.iter().any(|&t| t != me)
}

/// Waits (releasing the lock) while another thread holds `device`. State read before this call
/// may be stale after it.
pub(crate) fn gate(g: &mut MutexGuard<'_, State>, device: usize) {
    while held_by_other(g, device) {
        SIM.changed.wait(g);
    }
}

/// The current context and its device, once no other thread holds that device.
pub(crate) fn current_gated(g: &mut MutexGuard<'_, State>) -> Result<(u64, usize), Fail> {
    loop {
        let (ctx, d) = crate::context::current_ctx(g)?;
        if !held_by_other(g, d) {
            return Ok((ctx, d));
        }
        gate(g, d);
    }
}

/// [`resolve`], once no other thread holds the stream's device (the handle is resolved again
/// after a wait: the stream may have been destroyed meanwhile).
pub(crate) fn resolve_gated(g: &mut MutexGuard<'_, State>, h: CUstream) -> Result<u64, Fail> {
    loop {
        let sid = resolve(g, h)?;
        let d = g.streams[&sid].device;
        if !held_by_other(g, d) {
            return Ok(sid);
        }
        gate(g, d);
    }
}
