//! Queued work over memory whose mapping or access is about to change.
//!
//! `cuMemUnmap` and `cuMemSetAccess` do not wait for queued work on a GPU (the documentation says
//! nothing of it; PyTorch's expandable segments synchronise the stream themselves before
//! unmapping): work still queued over the bytes faults when it runs. The simulator drains the
//! devices before it unmaps (its host view must not lose pages under a running copy), which would
//! hide the program's missing wait; so the queued work is looked for first, and reported.

use crate::state::State;
use crate::violation::{self, Violation};

/// The enqueueing call of the first operation not yet started, on a stream of `device` (any
/// device for `None`), that touches `[lo, hi)`, and the stream it is on.
fn queued_over(st: &State, device: Option<usize>, lo: u64, hi: u64) -> Option<(&'static str, u64)> {
    let over =
        |spans: &[(u64, u64)]| spans.iter().any(|&(addr, len)| addr < hi && lo < addr.saturating_add(len));
    let on_device = |sid: u64| device.is_none_or(|d| st.streams.get(&sid).is_some_and(|s| s.device == d));
    // The engine's batch first: taken off their queues, its operations may not have started.
    let batched = st.in_flight.iter().find(|(sid, _, spans)| on_device(*sid) && over(spans));
    if let Some(&(sid, api, _)) = batched {
        return Some((api, sid));
    }
    st.streams
        .iter()
        .filter(|(_, s)| device.is_none_or(|d| s.device == d))
        .find_map(|(&sid, s)| s.queue.iter().find_map(|op| over(&op.work.spans()).then_some((op.api, sid))))
}

/// Records a violation for the calling thread's `what` if queued work of `device` (any for
/// `None`) touches `[lo, hi)`; the call still succeeds, as on a GPU, where the work faults later.
pub(crate) fn report_queued_work(st: &State, device: Option<usize>, lo: u64, hi: u64, what: &str) {
    let Some((api, stream)) = queued_over(st, device, lo, hi) else { return };
    let (function, os_tid) = crate::api::caller();
    let ok = cudarc::driver::sys::CUresult::CUDA_SUCCESS;
    violation::record(Violation {
        function: function.to_string(),
        code: ok as u32,
        code_name: crate::errors::name_str(ok).to_string(),
        message: format!(
            "{what} under queued work: a GPU would fault ({api} on stream {stream:#x} still queued over \
             [{lo:#x}, {hi:#x}); synchronise first)"
        ),
        os_tid,
    });
}
