//! Events: markers recorded into a stream that complete when the engine reaches them.
//!
//! An event remembers only its latest recording (`(stream, seq)` of the marker); queries, waits and
//! elapsed-time use that. A never-recorded event counts as complete, as the driver documents.

use std::time::Instant;

use cudarc::driver::sys::{CUevent, CUresult};

use crate::api::Fail;
use crate::state::State;
use crate::stream::done_through;

/// `CU_EVENT_DISABLE_TIMING`.
pub(crate) const DISABLE_TIMING: u32 = 2;
/// `CU_EVENT_INTERPROCESS`.
pub(crate) const INTERPROCESS: u32 = 4;
/// All defined `cuEventCreate` flags.
pub(crate) const ALL_FLAGS: u32 = 1 | DISABLE_TIMING | INTERPROCESS;

/// `cuEventElapsedTime`'s answer for the events with handles `start` and `end`, in the order
/// the H100 checks them (§17 of the driver reference): a dead handle, a DISABLE_TIMING event or a
/// never-recorded one is `INVALID_HANDLE`, as are events of two contexts; then a recording not yet
/// complete is `NOT_READY`. Milliseconds between the two markers' completion (negative when `end`
/// completed first; 0 for one event passed twice).
pub(crate) fn elapsed_ms(st: &State, start: u64, end: u64) -> Result<f32, crate::api::Fail> {
    use cudarc::driver::sys::CUresult::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_READY};
    let bad = |m: String| crate::api::Fail::misuse(CUDA_ERROR_INVALID_HANDLE, m);
    let live = |h: u64| st.events.get(&h).ok_or_else(|| bad(format!("event {h:#x} is not a live event")));
    let (s, e) = (live(start)?, live(end)?);
    for (h, ev) in [(start, s), (end, e)] {
        if ev.flags & DISABLE_TIMING != 0 {
            return Err(bad(format!("event {h:#x} was created with CU_EVENT_DISABLE_TIMING")));
        }
        if ev.record.is_none() {
            return Err(bad(format!("event {h:#x} was never recorded")));
        }
    }
    if s.ctx != e.ctx {
        return Err(bad(format!("events {start:#x} and {end:#x} belong to different contexts")));
    }
    // `done_at` is set when the latest recording's marker runs, so it also answers completion.
    let (Some(t0), Some(t1)) = (s.done_at, e.done_at) else {
        return Err(crate::api::Fail::quiet(CUDA_ERROR_NOT_READY));
    };
    let ms = if t1 >= t0 { (t1 - t0).as_secs_f64() * 1e3 } else { -((t0 - t1).as_secs_f64() * 1e3) };
    Ok(ms as f32)
}

/// One live event.
pub(crate) struct Event {
    pub(crate) device: usize,
    pub(crate) ctx: u64,
    pub(crate) flags: u32,
    /// The marker of the latest recording.
    pub(crate) record: Option<(u64, u64)>,
    /// When that marker executed.
    pub(crate) done_at: Option<Instant>,
    /// For an INTERPROCESS event: the counters shared with other processes.
    pub(crate) shared: Option<std::sync::Arc<crate::ipc::event::SharedEvent>>,
    /// For an INTERPROCESS event: the shared number of this process's latest recording.
    pub(crate) ticket: u64,
}

impl Event {
    /// A never-recorded event.
    pub(crate) fn new(device: usize, ctx: u64, flags: u32) -> Self {
        Self { device, ctx, flags, record: None, done_at: None, shared: None, ticket: 0 }
    }

    /// Whether the latest recording's work is complete (true if never recorded); for an
    /// interprocess event, the latest recording made in any process.
    pub(crate) fn complete(&self, st: &State) -> bool {
        if let Some(shared) = &self.shared {
            return shared.is_done(shared.latest());
        }
        self.record.is_none_or(|(s, q)| done_through(&st.streams, s, q))
    }

    /// For an interprocess event whose latest recording was made by another process: that
    /// recording's number, which only the shared counters can tell complete.
    pub(crate) fn remote_ticket(&self) -> Option<(std::sync::Arc<crate::ipc::event::SharedEvent>, u64)> {
        let shared = self.shared.as_ref()?;
        let latest = shared.latest();
        (latest != self.ticket).then(|| (std::sync::Arc::clone(shared), latest))
    }
}

/// The live event `h` names, or `INVALID_HANDLE`.
pub(crate) fn lookup(st: &State, h: CUevent) -> Result<&Event, Fail> {
    st.events.get(&(h as u64)).ok_or_else(|| {
        Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            format!("event {:#x} is not a live event", h as u64),
        )
    })
}
