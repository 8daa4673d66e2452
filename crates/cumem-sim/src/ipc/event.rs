//! Interprocess events: `cuIpcGetEventHandle`, `cuIpcOpenEventHandle`, and the shared page that
//! orders work across processes.
//!
//! An event created with `CU_EVENT_INTERPROCESS` (which requires DISABLE_TIMING) owns one page of
//! a memory file. Every process that holds the event (the creator and each importer) numbers a
//! recording from the page's *issued* counter (its ticket) and publishes the ticket when its
//! engine reaches the marker. Recordings made in different processes complete in any order, so
//! completion is kept per ticket: publishing ticket `t` stores `t` in slot `t % SLOTS`, and the
//! *done-through* counter advances only over a contiguous prefix of published tickets. Ticket `t`
//! is complete when done-through has reached it or its slot holds exactly `t`. A slot is reused
//! by ticket `t + SLOTS` only, which is not issued before done-through reaches `t` (a recording is
//! held back while `SLOTS` earlier ones are incomplete), so a slot never lies about a ticket that is
//! still outstanding. A stream wait captures the latest ticket at the call, as the driver captures
//! the latest recording; when that recording was made by another process, the wait is a queued
//! operation whose dependency the engine polls (see `crate::engine`).
//!
//! ```text
//! process A: record on S   -> ticket 1 (S gated, incomplete)
//! process B: wait on T     -> captures ticket 1: queued on T, returns at once
//! process B: record on U   -> ticket 2, completes: slot 2 = 2, done-through stays 0
//! process A: S runs marker -> slot 1 = 1, done-through 0 -> 2; B's engine releases T
//! ```

use std::cell::Cell;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent, CUresult};

use super::handle::{Handle, Kind, SIZE};
use crate::api::Fail;
use crate::event::{DISABLE_TIMING, Event, INTERPROCESS};
use crate::memory::Backing;
use crate::state::SIM;

/// Size of the shared page.
const PAGE: usize = 4096;
/// Words of the page before the slots: recordings issued, done-through.
const HEADER: usize = 2;
/// Completion slots: the rest of the page.
pub(crate) const SLOTS: u64 = (PAGE / 8 - HEADER) as u64;
/// How often a thread or the engine looks at another process's progress: nothing in this
/// process is told when another process publishes.
pub(crate) const POLL: Duration = Duration::from_micros(200);
/// How long a wait for another process's recording lasts before the simulator says on stderr that
/// it may never end: far longer than any recording of a live process takes to run here.
pub(crate) const STALL_NOTE: Duration = Duration::from_secs(5);

/// A wait for a recording only another process can complete: a process that exited with that
/// recording's marker still queued never publishes it, and nothing here can tell a slow process
/// from a dead one (the driver would not either), so the wait stays unbounded; once it has lasted
/// [`STALL_NOTE`] it prints one line on stderr, so a hung program says why. The line is printed
/// with the state lock released ([`say`]): a stderr pipe nobody reads would otherwise stall the
/// engine and every API call behind the lock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stall {
    since: Instant,
    noted: bool,
}

impl Stall {
    /// A wait starting now.
    pub(crate) fn new() -> Self {
        Stall { since: Instant::now(), noted: false }
    }

    /// `what()`, once, when the wait has lasted [`STALL_NOTE`]: for the caller to [`say`] once it
    /// has released the state lock.
    #[must_use]
    pub(crate) fn check(&mut self, what: impl FnOnce() -> String) -> Option<String> {
        if !self.noted && self.since.elapsed() >= STALL_NOTE {
            self.noted = true;
            return Some(what());
        }
        None
    }
}

/// Prints a note from [`Stall::check`] on stderr. Call it without the state lock: the write may
/// block for as long as nobody drains the pipe.
pub(crate) fn say(note: impl std::fmt::Display) {
    eprintln!("cumem-sim: {note}");
}

/// A queued stream wait for another process's recording of an interprocess event.
#[derive(Debug)]
pub(crate) struct RemoteWait {
    pub(crate) page: Arc<SharedEvent>,
    pub(crate) ticket: u64,
    /// The event handle the wait was made with (it may be destroyed since), named in the note.
    pub(crate) event: u64,
    /// Set by the engine when it first finds the wait heading its stream, still pending.
    pub(crate) stall: Cell<Option<Stall>>,
}

/// The shared page of one interprocess event.
pub(crate) struct SharedEvent {
    page: Backing,
    file: OwnedFd,
}

impl std::fmt::Debug for SharedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedEvent")
            .field("issued", &self.latest())
            .field("done_through", &self.word(1).load(Ordering::SeqCst))
            .finish()
    }
}

impl SharedEvent {
    /// A fresh page (all words 0); `None` when the kernel refuses.
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

    /// Word `i` of the page (`i < PAGE / 8`).
    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < PAGE / 8);
        // SAFETY: the page is PAGE bytes, page aligned and mapped for as long as `self`, and `i`
        // is in it; other processes touch these words only atomically too.
        unsafe { AtomicU64::from_ptr(self.page.as_ptr().cast::<u64>().add(i)) }
    }

    fn slot(&self, ticket: u64) -> &AtomicU64 {
        // The remainder is below SLOTS, so the index stays in the page.
        self.word(HEADER + (ticket % SLOTS) as usize)
    }

    /// Numbers a new recording, or `None` while `SLOTS` earlier recordings are incomplete (the
    /// new one's slot would still be needed by one of them).
    pub(crate) fn try_issue(&self) -> Option<u64> {
        let issued = self.word(0);
        let mut current = issued.load(Ordering::SeqCst);
        loop {
            // Done-through, read after `current`, may already be past it.
            if current.saturating_sub(self.word(1).load(Ordering::SeqCst)) >= SLOTS {
                return None;
            }
            match issued.compare_exchange(current, current + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(current + 1),
                Err(now) => current = now,
            }
        }
    }

    /// Marks recording `ticket` complete, and advances done-through over every ticket now
    /// complete without a gap.
    pub(crate) fn publish(&self, ticket: u64) {
        self.slot(ticket).store(ticket, Ordering::SeqCst);
        // Any publisher may advance done-through over a published successor. A publisher whose
        // slot store came after another's advance looked at that slot (and stopped) sees that
        // advance here: both sides write, then read, sequentially consistent words.
        let done = self.word(1);
        loop {
            let d = done.load(Ordering::SeqCst);
            if self.slot(d + 1).load(Ordering::SeqCst) != d + 1 {
                return;
            }
            // A failure means another process advanced past `d` meanwhile: look again.
            let _ = done.compare_exchange(d, d + 1, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    /// Whether recording `ticket` has completed (ticket 0, "never recorded", has).
    pub(crate) fn is_done(&self, ticket: u64) -> bool {
        let done = self.word(1);
        // Done-through is read again after the slot: the slot may have passed to `ticket + SLOTS`
        // in between, which only happens after done-through reached `ticket`.
        done.load(Ordering::SeqCst) >= ticket
            || self.slot(ticket).load(Ordering::SeqCst) == ticket
            || done.load(Ordering::SeqCst) >= ticket
    }

    /// The oldest recording not known complete: the one a recording waiting for room waits for.
    pub(crate) fn oldest_pending(&self) -> u64 {
        self.word(1).load(Ordering::SeqCst) + 1
    }

    /// The latest recording issued in any process (0: never recorded).
    pub(crate) fn latest(&self) -> u64 {
        self.word(0).load(Ordering::SeqCst)
    }
}

/// Blocks the calling thread, releasing the state lock, until recording `ticket` of `shared` is
/// complete (`cuEventSynchronize`: the driver blocks the caller too).
pub(crate) fn wait_ticket(
    g: &mut parking_lot::MutexGuard<'_, crate::state::State>,
    shared: &SharedEvent,
    ticket: u64,
    event: CUevent,
) {
    let mut stall = Stall::new();
    while !shared.is_done(ticket) {
        let note = stall.check(|| {
            format!(
                "cuEventSynchronize on interprocess event {:#x} has waited {} s for recording {ticket}, \
                 made in another process; if that process exited with it queued, nothing completes \
                 it and this call waits forever",
                event as u64,
                STALL_NOTE.as_secs()
            )
        });
        parking_lot::MutexGuard::unlocked(g, || {
            note.iter().for_each(say);
            std::thread::sleep(POLL);
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_is_per_ticket_and_done_through_is_a_prefix() {
        let page = SharedEvent::new().expect("a memory file");
        let (one, two, three) =
            (page.try_issue().unwrap(), page.try_issue().unwrap(), page.try_issue().unwrap());
        assert_eq!((one, two, three, page.latest()), (1, 2, 3, 3));
        page.publish(two);
        assert!(page.is_done(two) && !page.is_done(one) && !page.is_done(three));
        assert_eq!(page.word(1).load(Ordering::SeqCst), 0, "2 completed before 1");
        page.publish(one);
        assert_eq!(page.word(1).load(Ordering::SeqCst), 2);
        assert!(page.is_done(one) && page.is_done(two) && !page.is_done(three));
        page.publish(three);
        assert_eq!(page.word(1).load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_slot_is_not_reissued_while_its_ticket_is_outstanding() {
        let page = SharedEvent::new().expect("a memory file");
        let first = page.try_issue().unwrap();
        let rest: Vec<u64> = (1..SLOTS).map(|_| page.try_issue().unwrap()).collect();
        assert_eq!(page.try_issue(), None, "ticket {} would share the first one's slot", SLOTS + 1);
        for &t in &rest {
            page.publish(t);
        }
        assert!(!page.is_done(first));
        assert_eq!(page.try_issue(), None);
        page.publish(first);
        assert_eq!(page.word(1).load(Ordering::SeqCst), SLOTS);
        assert_eq!(page.try_issue(), Some(SLOTS + 1));
        assert!(!page.is_done(SLOTS + 1) && page.is_done(first));
    }

    #[test]
    fn concurrent_publishers_leave_no_completed_prefix_behind() {
        // Two mappings of one file, as two processes would hold; publishers race on both.
        let a = SharedEvent::new().expect("a memory file");
        let b = SharedEvent::from_file(a.file.try_clone().unwrap()).expect("a second mapping");
        for round in 0..50u64 {
            let tickets: Vec<u64> = (0..64).map(|_| a.try_issue().unwrap()).collect();
            std::thread::scope(|scope| {
                for (k, page) in [&a, &b, &a, &b].into_iter().enumerate() {
                    let mine: Vec<u64> = tickets.iter().copied().skip(k).step_by(4).rev().collect();
                    scope.spawn(move || mine.into_iter().for_each(|t| page.publish(t)));
                }
            });
            assert_eq!(b.word(1).load(Ordering::SeqCst), (round + 1) * 64);
        }
    }
}
