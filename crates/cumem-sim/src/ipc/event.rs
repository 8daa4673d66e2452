//! Interprocess events: `cuIpcGetEventHandle`, `cuIpcOpenEventHandle`, and the shared counters
//! that order work across processes.
//!
//! An event created with `CU_EVENT_INTERPROCESS` (which requires DISABLE_TIMING) owns one page of
//! a memory file holding two counters: recordings issued and the highest one completed. Every
//! process that holds the event (the creator and each importer) numbers a recording from the
//! first counter and publishes it to the second when the engine reaches the marker, so a query,
//! synchronize or stream wait in any process sees the latest recording made anywhere. A stream
//! wait whose latest recording was made in another process blocks the calling thread until it
//! completes: one process's engine cannot see another's queues, and waiting early only orders
//! more, never less.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{CUevent, CUresult};

use super::handle::{Handle, Kind, SIZE};
use crate::api::Fail;
use crate::event::{DISABLE_TIMING, Event, INTERPROCESS};
use crate::memory::Backing;
use crate::state::SIM;

/// Size of the shared page.
const PAGE: usize = 4096;

/// The shared counters of one interprocess event.
pub(crate) struct SharedEvent {
    page: Backing,
    file: OwnedFd,
}

impl std::fmt::Debug for SharedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedEvent")
            .field("issued", &self.latest())
            .field("done", &self.done_through())
            .finish()
    }
}

impl SharedEvent {
    /// A fresh page (both counters 0); `None` when the kernel refuses.
    pub(crate) fn new() -> Option<Self> {
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"cumem-sim-ipc-event".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `fd` is the memory file created above.
        if unsafe { libc::ftruncate(fd, PAGE as libc::off_t) } != 0 {
            return None;
        }
        Self::from_file(file)
    }

    /// The page of an exported event's file.
    fn from_file(file: OwnedFd) -> Option<Self> {
        let page = Backing::from_file(&file, PAGE)?;
        Some(Self { page, file })
    }

    fn counter(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the page is PAGE bytes, page aligned and mapped for as long as `self`; other
        // processes touch these words only atomically too.
        unsafe { AtomicU64::from_ptr(self.page.as_ptr().cast::<u64>().add(i)) }
    }

    /// Numbers a new recording.
    pub(crate) fn issue(&self) -> u64 {
        self.counter(0).fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Marks recording `ticket` (and every earlier one) complete.
    pub(crate) fn publish(&self, ticket: u64) {
        self.counter(1).fetch_max(ticket, Ordering::SeqCst);
    }

    /// The latest recording issued in any process (0: never recorded).
    pub(crate) fn latest(&self) -> u64 {
        self.counter(0).load(Ordering::SeqCst)
    }

    /// The highest completed recording.
    pub(crate) fn done_through(&self) -> u64 {
        self.counter(1).load(Ordering::SeqCst)
    }
}

/// Waits, releasing the state lock, until recording `ticket` of `shared` is complete.
pub(crate) fn wait_ticket(
    g: &mut parking_lot::MutexGuard<'_, crate::state::State>,
    shared: &SharedEvent,
    ticket: u64,
) {
    while shared.done_through() < ticket {
        parking_lot::MutexGuard::unlocked(g, || std::thread::sleep(std::time::Duration::from_micros(200)));
    }
}

/// `cuIpcGetEventHandle`: the handle of an event created with INTERPROCESS (`INVALID_VALUE`
/// otherwise; `INVALID_HANDLE` for a dead event).
pub(crate) fn get_handle(h: CUevent) -> Result<[u8; SIZE], Fail> {
    let st = SIM.st.lock();
    let e = crate::event::lookup(&st, h)?;
    let Some(shared) = &e.shared else {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("event {:#x} was not created with CU_EVENT_INTERPROCESS", h as u64),
        ));
    };
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    Ok(Handle::of_file(Kind::Event, &shared.file, PAGE as u64, 0).ok_or_else(oom)?.encode())
}

/// `cuIpcOpenEventHandle`: a new event of the current context that shares the exported event's
/// recordings (flags INTERPROCESS | DISABLE_TIMING); destroy it with `cuEventDestroy`.
pub(crate) fn open(bytes: &[u8; SIZE]) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = crate::context::current_ctx(&st)?;
    let handle = Handle::decode(bytes, Kind::Event)?;
    // The shared page is mapped whole: `Handle::open` then checks the file holds it.
    if handle.size != PAGE as u64 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("IPC event handle of {} bytes; events share one {PAGE}-byte page", handle.size),
        ));
    }
    let file = handle.open()?;
    let shared = SharedEvent::from_file(file).ok_or(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
    let h = st.new_event_handle();
    let mut event = Event::new(d, ctx, INTERPROCESS | DISABLE_TIMING);
    event.shared = Some(std::sync::Arc::new(shared));
    st.events.insert(h, event);
    Ok(h)
}
