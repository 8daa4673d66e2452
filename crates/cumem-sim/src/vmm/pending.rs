//! Queued work over memory whose mapping or access is about to change, and the engine's work that
//! must finish before a mapping's pages leave the host view.
//!
//! Observed on an H100 (2026-11-24, raw driver calls, driver 580.159.04; `docs/vmm.md`):
//! `cuMemUnmap` and `cuMemSetAccess` do not wait for unrelated streams (an unmap of a mapping no
//! work used returned in 0.1 ms while a non-blocking stream was held by a host function), nor
//! behind another thread's implicit synchronisation. Whether they wait for work queued over their
//! own bytes was not observed (`docs/vmm.md`, "To verify on a GPU"); the documentation says nothing
//! of it, and PyTorch's expandable segments synchronise the stream themselves before unmapping. The
//! simulator's choice is that they do not, the work faulting when it runs: queued work over the
//! bytes is reported at the call ([`report_queued_work`]), and the call goes on. When that work runs
//! later, the engine finds its mapping gone (`crate::vmm::reaches_unmapped`): it moves no bytes
//! (the pages are `PROT_NONE` by then) and reports a use after free.
//!
//! The one wait left is the simulator's own: the engine moves a batch's bytes with the state lock
//! released, so `cuMemUnmap` waits until no operation of the current batch moves bytes in the
//! range it unmaps ([`executing_over`]) before their pages leave the host view. That batch is at
//! most 32 operations (1 MiB together, or one larger one), already taken off their queues; the
//! range is marked as being unmapped meanwhile (`Vmm::unmapping`), so batches taken later move
//! none of their bytes there ([`reaches_unmapped`]) and the unmap waits for that one batch only,
//! not for the rest of the work queued over its bytes. The unmap waits for no stream, and holds no
//! device (other threads' calls go on).

use crate::copy::Work;
use crate::memory::AllocKind;
use crate::state::State;
use crate::violation::{self, Violation};

/// Whether one of the `(address, length)` spans overlaps `[lo, hi)`.
fn overlaps(spans: &[(u64, u64)], lo: u64, hi: u64) -> bool {
    spans.iter().any(|&(addr, len)| addr < hi && lo < addr.saturating_add(len))
}

/// Whether an operation of the engine's current batch (taken off its queue) moves bytes in
/// `[lo, hi)`, or is about to, with the state lock released.
pub(crate) fn executing_over(st: &State, lo: u64, hi: u64) -> bool {
    st.in_flight.iter().any(|f| f.moves && overlaps(&f.spans, lo, hi))
}

/// The enqueueing call of the first operation not yet started, on a stream of `device` (any
/// device for `None`), that touches `[lo, hi)`, and the stream it is on.
fn queued_over(st: &State, device: Option<usize>, lo: u64, hi: u64) -> Option<(&'static str, u64)> {
    let over = |spans: &[(u64, u64)]| overlaps(spans, lo, hi);
    let on_device = |sid: u64| device.is_none_or(|d| st.streams.get(&sid).is_some_and(|s| s.device == d));
    // The engine's batch first: taken off their queues, its operations may not have started.
    if let Some(f) = st.in_flight.iter().find(|f| on_device(f.sid) && over(&f.spans)) {
        return Some((f.api, f.sid));
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

/// Whether `work` reaches VMM memory that is no longer mapped, or is being unmapped: a mapping it
/// touches was unmapped (its allocation's free took effect), a span that runs on from a mapping
/// into the next one finds no mapping there any more, or a span overlaps a range a `cuMemUnmap`
/// in progress is unmapping (`Vmm::unmapping`). Such work was queued before the unmap (which
/// reported it); the engine moves none of its bytes, since the host view has (or is about to have)
/// `PROT_NONE` pages there. Called with the state lock held, as the engine takes the work for a
/// batch: the unmap of anything the batch moves bytes in waits for it ([`executing_over`]), so the
/// answer holds until the batch is done.
pub(crate) fn reaches_unmapped(st: &State, work: &Work) -> bool {
    if work.spans().iter().any(|&(addr, len)| overlaps(&st.vmm.unmapping, addr, addr.saturating_add(len))) {
        return true;
    }
    let touched = work.touched();
    if !touched.iter().any(|a| a.kind == AllocKind::Vmm) {
        return false;
    }
    if touched.iter().any(|a| a.kind == AllocKind::Vmm && a.freed.get().is_some()) {
        return true;
    }
    let mapped = |addr: u64, len: u64| {
        let end = addr.saturating_add(len);
        let mut at = addr;
        while at < end {
            let Some((base, m)) = st.vmm.mapping_of(at) else { return false };
            at = base + m.size;
        }
        true
    };
    work.spans().iter().any(|&(addr, len)| st.vmm.in_space(addr) && !mapped(addr, len))
}
