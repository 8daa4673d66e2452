//! Events: create, record, query, synchronize, elapsed time, destroy.

use std::ffi::c_uint;

use cudarc::driver::sys::{CUevent, CUresult, CUstream};

use crate::api::{self, Fail, Init};
use crate::copy::Work;
pub(crate) use crate::event::lookup;
use crate::event::{ALL_FLAGS, DISABLE_TIMING, Event, INTERPROCESS};
use crate::state::SIM;
use crate::stream::{enqueue, wait_for};

/// `CUresult cuEventCreate(CUevent *phEvent, unsigned Flags)`: flags from BLOCKING_SYNC (1),
/// DISABLE_TIMING (2), INTERPROCESS (4, which requires DISABLE_TIMING).
///
/// # Safety
/// 1. `ph_event` is NULL or valid for writing a `CUevent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(ph_event: *mut CUevent, flags: c_uint) -> CUresult {
    api::call("cuEventCreate", Init::Required, || {
        api::non_null(ph_event, "phEvent")?;
        let mut st = SIM.st.lock();
        // Also waits while another thread waits for room on a full stream (observed).
        let (ctx, d) = crate::hold::current_gated_full(&mut st)?;
        if flags & !ALL_FLAGS != 0 || (flags & INTERPROCESS != 0 && flags & DISABLE_TIMING == 0) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("invalid event flags {flags:#x}"),
            ));
        }
        let mut event = Event::new(d, ctx, flags);
        if flags & INTERPROCESS != 0 {
            let page = crate::ipc::event::SharedEvent::new();
            event.shared =
                Some(std::sync::Arc::new(page.ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?));
        }
        let h = st.new_event_handle();
        st.events.insert(h, event);
        // SAFETY: forwarded caller contract.
        unsafe { api::out(ph_event, h as CUevent, "phEvent") }
    })
}

fn record(h_event: CUevent, h_stream: CUstream, flags: c_uint) -> api::ApiResult {
    let mut st = SIM.st.lock();
    let mut stall = crate::ipc::event::Stall::new();
    let (sid, eid, shared) = loop {
        let sid = crate::hold::resolve_gated(&mut st, h_stream)?;
        let ev_ctx = lookup(&st, h_event)?.ctx;
        if st.streams[&sid].ctx != ev_ctx {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_HANDLE,
                "event and stream belong to different contexts",
            ));
        }
        if flags != 0 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("record flags {flags:#x}: only 0 is valid outside stream capture"),
            ));
        }
        // A recording takes no slot of the stream's queue but needs a free one, and waits while
        // another thread's launch or recording waits for room in this context (observed).
        if crate::hold::gate_full(&mut st, sid, crate::hold::Gated::Record)
            || crate::hold::wait_room(&mut st, sid, crate::hold::Full::Record)
        {
            continue;
        }
        let eid = h_event as u64;
        let Some(page) = st.events[&eid].shared.clone() else {
            break (sid, eid, None);
        };
        match page.try_issue() {
            Some(ticket) => break (sid, eid, Some((page, ticket))),
            // An interprocess event's recordings in flight are bounded by its shared page, as a
            // driver's queues are bounded: the call waits for room, like a launch into a full
            // queue. The handles are checked again afterwards: they may have died meanwhile.
            // A recording whose process exited with its marker queued is never published, so
            // this wait is unbounded (see `Stall`).
            None => {
                let note = stall.check(|| {
                    format!(
                        "cuEventRecord on interprocess event {eid:#x} has waited {} s for room: its \
                         shared page holds {} incomplete recordings, the oldest recording {}; if the \
                         process that made it exited with it queued, nothing completes it and this \
                         call waits forever",
                        crate::ipc::event::STALL_NOTE.as_secs(),
                        crate::ipc::event::SLOTS,
                        page.oldest_pending()
                    )
                });
                parking_lot::MutexGuard::unlocked(&mut st, || {
                    note.iter().for_each(crate::ipc::event::say);
                    std::thread::sleep(crate::ipc::event::POLL);
                })
            }
        }
    };
    if let Some((_, ticket)) = shared {
        st.events.get_mut(&eid).expect("looked up above").ticket = ticket;
    }
    let seq = enqueue(&mut st, sid, Work::Marker { event: eid, shared }, Vec::new());
    let e = st.events.get_mut(&eid).expect("looked up above");
    e.record = Some((sid, seq));
    e.done_at = None;
    Ok(())
}

/// `CUresult cuEventRecord(CUevent hEvent, CUstream hStream)`: captures the stream's queued work
/// (for the legacy stream, also the prior work of blocking streams); re-recording replaces the
/// previous capture. Event and stream must share a context (`INVALID_HANDLE` otherwise).
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(h_event: CUevent, h_stream: CUstream) -> CUresult {
    api::call("cuEventRecord", Init::Required, || record(h_event, h_stream, 0))
}

/// `CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned flags)`: as
/// `cuEventRecord`; `flags` must be 0 (EXTERNAL is for stream capture).
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags(h_event: CUevent, h_stream: CUstream, flags: c_uint) -> CUresult {
    api::call("cuEventRecordWithFlags", Init::Required, || record(h_event, h_stream, flags))
}

/// `CUresult cuEventQuery(CUevent hEvent)`: `SUCCESS` if the captured work is complete or the
/// event was never recorded, `NOT_READY` otherwise.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(h_event: CUevent) -> CUresult {
    api::call("cuEventQuery", Init::Required, || {
        let mut st = SIM.st.lock();
        let e = lookup(&st, h_event)?;
        if e.complete(&st) {
            // The host has seen the recorded work complete (an interprocess event's remote
            // recording orders nothing of this process).
            if let Some(r) = e.record.filter(|_| e.remote_ticket().is_none()) {
                crate::order::observed(&mut st, &[r]);
            }
            Ok(())
        } else {
            Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_READY))
        }
    })
}

/// `CUresult cuEventSynchronize(CUevent hEvent)`: waits for the captured work (returns at once
/// for a never-recorded event); then every memory pool of the event's device releases unused
/// memory above its RELEASE_THRESHOLD.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(h_event: CUevent) -> CUresult {
    api::call("cuEventSynchronize", Init::Required, || {
        let mut st = SIM.st.lock();
        let (record, device, remote) = {
            let e = lookup(&st, h_event)?;
            (e.record, e.device, e.remote_ticket())
        };
        if let Some((shared, ticket)) = remote {
            crate::ipc::event::wait_ticket(&mut st, &shared, ticket, h_event);
        } else if let Some(r) = record {
            wait_for(&mut st, &[r]);
        }
        crate::pool::on_synchronize(&mut st, device);
        Ok(())
    })
}

/// # Safety
/// 1. `ms` is NULL or valid for writing an `f32`.
unsafe fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> api::ApiResult {
    // The H100 answers a NULL out-pointer with INVALID_HANDLE, not INVALID_VALUE (§17).
    if ms.is_null() {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_HANDLE, "NULL pMilliseconds out-pointer"));
    }
    let value = crate::event::elapsed_ms(&SIM.st.lock(), start as u64, end as u64)?;
    // SAFETY: forwarded caller contract.
    unsafe { api::out(ms, value, "pMilliseconds") }
}

/// `CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)`: host time
/// between the two markers' completion. A NULL out-pointer, dead handles, never-recorded or
/// DISABLE_TIMING events and events of different contexts give `INVALID_HANDLE` (as on the H100);
/// a recording not yet complete gives `NOT_READY`; `*pMilliseconds` is written only on success.
///
/// # Safety
/// 1. `ms` is NULL or valid for writing an `f32`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuEventElapsedTime", Init::Required, || unsafe { elapsed(ms, start, end) })
}

/// `CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)`: same
/// contract as `cuEventElapsedTime`.
///
/// # Safety
/// 1. `ms` is NULL or valid for writing an `f32`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuEventElapsedTime_v2", Init::Required, || unsafe { elapsed(ms, start, end) })
}

/// `CUresult cuEventDestroy(CUevent hEvent)` (symbol `_v2`): allowed while pending; the handle
/// is dead immediately.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(h_event: CUevent) -> CUresult {
    api::call("cuEventDestroy_v2", Init::Required, || {
        let mut st = SIM.st.lock();
        // Waits while another thread holds the device in an implicit synchronisation (observed
        // on an H100, see `crate::hold`); the handle is looked up again afterwards.
        let device = lookup(&st, h_event)?.device;
        crate::hold::gate(&mut st, device);
        lookup(&st, h_event)?;
        st.events.remove(&(h_event as u64));
        Ok(())
    })
}
