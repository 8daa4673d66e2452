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
//! whole device. Which calls are gated follows what an H100 (driver 580.159.04) showed on
//! 2026-11-24, with a third thread timing one call while a second waits in `cuMemFree` for a
//! stream held by a blocking host function:
//! - gated (blocked until the host function ended): `cuEventCreate`, `cuEventDestroy` (of a
//!   completed and of a never-recorded event), `cuStreamDestroy` (of an idle stream),
//!   `cuMemHostRegister`, `cuMemHostUnregister`, synchronous `cuMemcpyHtoD` and `cuMemsetD8`,
//!   `cuMemAllocPitch`, `cuMemAllocManaged`, `cuMemHostAlloc`, `cuStreamAttachMemAsync`, and
//!   asynchronous copies and memsets on another stream; with those of §17 and the calls that
//!   queue work the same way (every copy and memset form, prefetches, `cuLaunchHostFunc`,
//!   `cuEventRecord`, `cuStreamCreate`, `cuMemAllocHost`);
//! - not gated (returned): `cuStreamWaitEvent` (on another stream, of a completed event),
//!   `cuIpcGetMemHandle`, event queries, synchronisation and elapsed time, the stream-ordered
//!   allocator and pool calls (`cuMemAllocAsync`, `cuMemFreeAsync`, `cuMemPoolTrimTo`,
//!   `cuMemPoolDestroy`, the pool imports), pointer queries, `cuStreamQuery`,
//!   `cuStreamSynchronize` of an idle stream, `cuCtxGetCurrent`/`SetCurrent`, `cuMemGetInfo`, and
//!   the VMM calls (none of which drains or holds a device either: `crate::vmm`); nor are the
//!   implicitly synchronising calls themselves (each drains on its own).
//!
//! An asynchronous copy between two host memories waits for its own stream's earlier work
//! (`crate::copy`, observed) without holding the device: it is gated like any copy, but nothing
//! observed says that other threads' calls wait for it, and it waits for one stream, not the
//! device.
//!
//! A full stream holds its context too, for fewer calls. A stream accepts [`QUEUE_DEPTH`] work
//! items (copies, memsets and host functions) not yet started; a further one, or an event
//! recording, waits in the call until the stream moves ([`wait_room`]). Observed on the same H100
//! the same day (single runs), with another thread's calls timed while one waited so, which calls
//! wait depends on what the waiting thread queues ([`Full::holds`]):
//! - a copy or memset: `cuEventCreate` and `cuMemAlloc` blocked ([`current_gated_full`]); a memset
//!   and an event recording on another stream returned;
//! - an event recording: recordings on another stream, `cuEventCreate` and `cuMemAlloc` blocked
//!   ([`gate_full`]); a memset on another stream returned;
//! - a host function launch: memsets and recordings on another stream, `cuEventCreate` and
//!   `cuMemAlloc` all blocked. Only an asynchronous `cuMemsetD8Async` on another stream was
//!   measured; every other copy and memset form (2D/3D, the synchronous ones on the legacy
//!   stream) is held the same way by inference, the one exception to "not measured, not held".
//!
//! The hold is per context, not per device: while a memset waited for room in the primary
//! context, `cuMemAlloc` in that context blocked, but `cuMemAlloc` and `cuEventCreate` in a second
//! context (`cuCtxCreate`) of the same device returned. Nothing else was measured, so nothing else
//! waits for a full stream. An invalid copy or memset on a full stream failed at once with its
//! error, so the calls check their arguments before waiting for room (`crate::copy`).

use cudarc::driver::sys::CUstream;
use parking_lot::MutexGuard;

use crate::api::{Fail, os_tid};
use crate::copy::Work;
use crate::state::{SIM, State};
use crate::stream::{Stream, all_targets, resolve, wait_for};

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

/// Work items (copies, memsets and host functions) a stream accepts before the call queueing the
/// next one waits until the stream moves. Observed on an H100 (driver 580.159.04, 2026-11-24,
/// single runs), on a fresh non-blocking stream held by a blocking host function: it accepted
/// 1021 `cuMemsetD8Async` calls and the 1022nd blocked until the host function returned; 1021
/// `cuMemcpyDtoDAsync` likewise, and a `cuMemsetD2D8Async` counted as one. A queued host function
/// takes a slot (1020 memsets and a host function, then a memset: blocked; 1019 and a host
/// function, then a memset: returned), and `cuLaunchHostFunc` on a full stream blocked.
/// `cuEventRecord` takes no slot (100,000 recordings on an otherwise empty held stream returned)
/// but needs a free one: on a full stream it blocked. `cuStreamWaitEvent`, `cuMemAllocAsync` and
/// `cuMemFreeAsync` on a full stream returned, so they neither count nor wait; prefetches and
/// attachments were not measured and do neither: the simulator must not block what a GPU was not
/// seen to block.
pub(crate) const QUEUE_DEPTH: usize = 1021;

/// Whether `work` is a work item counted against [`QUEUE_DEPTH`].
pub(crate) fn takes_slot(work: &Work) -> bool {
    matches!(
        work,
        Work::Copy { .. }
            | Work::Fill { .. }
            | Work::Rows { .. }
            | Work::FillRows { .. }
            | Work::HostFn { .. }
    )
}

/// Whether `s` has room for one more work item: fewer than [`QUEUE_DEPTH`] not yet started
/// (`Stream::slots`, kept as the queue changes; checked against a count in debug builds).
fn has_room(s: &Stream) -> bool {
    debug_assert!(
        s.queue.len() < QUEUE_DEPTH || s.slots == s.queue.iter().filter(|op| takes_slot(&op.work)).count(),
        "the slot count drifted from the queue"
    );
    s.slots < QUEUE_DEPTH
}

/// What a call waiting for room on a full stream queues: it decides which other threads' calls
/// wait meanwhile ([`Gated`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Full {
    /// A copy or memset (of any form).
    Work,
    /// `cuLaunchHostFunc`.
    HostFn,
    /// `cuEventRecord` (takes no slot, but needs a free one).
    Record,
}

/// A call that waits while another thread waits for room on a full stream, depending on what
/// that thread queues ([`Full`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Gated {
    /// `cuMemAlloc` and `cuEventCreate`: wait for every kind of waiter (observed).
    Create,
    /// A copy or memset on another stream: waits for a host function launch only (observed for
    /// `cuMemsetD8Async`, inferred for the other forms; a waiting memset or recording let it
    /// return).
    Work,
    /// An event recording on another stream: waits for a host function launch or a recording
    /// (observed; a waiting memset let it return).
    Record,
}

impl Full {
    /// Whether a thread waiting to queue this on a full stream holds back `call` of other threads.
    fn holds(self, call: Gated) -> bool {
        match call {
            Gated::Create => true,
            Gated::Work => self == Full::HostFn,
            Gated::Record => matches!(self, Full::HostFn | Full::Record),
        }
    }
}

/// A thread waiting for room on a full stream ([`wait_room`]).
pub(crate) struct FullWaiter {
    /// Its OS thread.
    pub(crate) tid: u64,
    /// The full stream's context: only calls in that context wait for it (observed).
    pub(crate) ctx: u64,
    /// The full stream.
    pub(crate) sid: u64,
    /// What it queues.
    pub(crate) kind: Full,
}

/// Waits (releasing the lock) while stream `sid` has no room for one more work item, holding
/// other threads' calls in the stream's context meanwhile as `kind` does (see [`Full::holds`]).
/// Returns whether it waited: state read before the call is then stale, and the caller looks
/// again (the stream may have been destroyed, or another thread may hold the device now). A
/// stream that no longer exists has room (the caller's lookup then fails). Host functions cannot
/// get here (`crate::api::call` refuses their calls), so a host function can never wait for room
/// on its own stream, which would deadlock on a GPU.
pub(crate) fn wait_room(g: &mut MutexGuard<'_, State>, sid: u64, kind: Full) -> bool {
    let Some((device, ctx)) = g.streams.get(&sid).filter(|s| !has_room(s)).map(|s| (s.device, s.ctx)) else {
        return false;
    };
    let me = os_tid();
    g.devices[device].full_by.push(FullWaiter { tid: me, ctx, sid, kind });
    while g.streams.get(&sid).is_some_and(|s| !has_room(s)) {
        SIM.changed.wait(g);
    }
    let full = &mut g.devices[device].full_by;
    if let Some(i) = full.iter().position(|w| w.tid == me) {
        full.swap_remove(i);
    }
    SIM.changed.notify_all();
    true
}

/// Whether a thread other than the caller waits for room on a full stream of `device` in context
/// `ctx` (other than `sid`, the caller's own stream, if any) in a way that holds back `call`.
fn full_by_other(st: &State, device: usize, ctx: u64, sid: Option<u64>, call: Gated) -> bool {
    let me = os_tid();
    st.devices[device]
        .full_by
        .iter()
        .any(|w| w.tid != me && w.ctx == ctx && Some(w.sid) != sid && w.kind.holds(call))
}

/// Waits (releasing the lock) while another thread's wait for room holds back `call` on stream
/// `sid` (a copy, memset or recording queued there, in the stream's context). Returns whether it
/// waited: state read before the call is then stale, and the caller looks again.
pub(crate) fn gate_full(g: &mut MutexGuard<'_, State>, sid: u64, call: Gated) -> bool {
    let mut waited = false;
    while let Some((d, ctx)) = g.streams.get(&sid).map(|s| (s.device, s.ctx))
        && full_by_other(g, d, ctx, Some(sid), call)
    {
        SIM.changed.wait(g);
        waited = true;
    }
    waited
}

/// [`current_gated`], also waiting while another thread waits for room on a full stream of the
/// current context (`cuEventCreate` and `cuMemAlloc`, as observed).
pub(crate) fn current_gated_full(g: &mut MutexGuard<'_, State>) -> Result<(u64, usize), Fail> {
    loop {
        let (ctx, d) = current_gated(g)?;
        if !full_by_other(g, d, ctx, None, Gated::Create) {
            return Ok((ctx, d));
        }
        while full_by_other(g, d, ctx, None, Gated::Create) {
            SIM.changed.wait(g);
        }
    }
}
