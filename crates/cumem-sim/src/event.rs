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

/// One live event.
pub(crate) struct Event {
    pub(crate) device: usize,
    pub(crate) ctx: u64,
    pub(crate) flags: u32,
    /// The marker of the latest recording.
    pub(crate) record: Option<(u64, u64)>,
    /// When that marker executed.
    pub(crate) done_at: Option<Instant>,
}

impl Event {
    /// Whether the latest recording's work is complete (true if never recorded).
    pub(crate) fn complete(&self, st: &State) -> bool {
        self.record.is_none_or(|(s, q)| done_through(&st.streams, s, q))
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
