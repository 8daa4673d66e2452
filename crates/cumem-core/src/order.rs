//! Stream ordering of device memory: every stream with work on it that nothing has waited for yet.
//!
//! Device work on one stream is unordered with work on another. Before work on memory is queued on
//! stream X, X waits (an event recorded on each, waited on by X) for every stream that may still have
//! work on it; once the work is queued, X is recorded as such a stream. Recording happens when the
//! [`OrderTicket`] returned by [`StreamOrder::use_on`] is dropped, so the ticket must be held until
//! the work is queued: two threads using disjoint halves of a buffer on two streams (or reading it
//! on two streams) then both end up recorded, and whatever comes next — another use, host access,
//! the free — waits for both. [`StreamOrder::join`] gives one stream ordered after all of them,
//! which is where a buffer returns its memory.
//!
//! Waiting for a user costs one `cuEventRecord` of that stream's own marker event and one
//! `cuStreamWaitEvent`; a stream that is already the only user waits for nothing, so work queued
//! again and again on one stream makes no ordering call at all (unless a guard on another stream
//! is held or was forgotten).
//!
//! Work queued inside one call (cumem's own copies and memsets) uses [`StreamOrder::queue_on`]
//! instead of a ticket: the users stay locked while the closure queues the work and record the
//! stream when it returns, one lock and unlock in all where a ticket takes two, and no handle is
//! cloned: a queued copy's ordering costs little more than the driver call itself. An owner with
//! exclusive access to the order (a `&mut DeviceBuffer`'s view) uses
//! [`StreamOrder::queue_on_mut`], the same without the lock. Its closure
//! is for driver calls only: any cumem lock taken inside it (another order, a host tracker) is
//! refused with `NotPermitted`, since waiting there could close a cycle with another thread (on
//! the calling thread only: another thread that the closure waits for is not refused, and
//! deadlocks if it takes such a lock).
//!
//! Code outside cumem that queues work on device memory (a kernel) uses the door on views and
//! buffers instead, [`DeviceSlice::on`](crate::DeviceSlice::on) and friends, whose guard holds
//! a ticket and hands out the raw pointer; tickets are for memory kinds built on this crate.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, StreamOrder, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
//! let order = StreamOrder::new(&a);
//! {
//!     let _ticket = order.use_on(&b)?; // b now waits for everything queued on a so far
//!     // ... queue work on b ...
//! } // b is recorded as a user
//! assert_eq!(order.join()?, b); // b is after a's work, so b alone stands for both
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use cumem_sys::ErrorContext;
use parking_lot::{Mutex, MutexGuard};

use crate::stream::LastStream;
use crate::{Error, Feature, Result, Stream};

thread_local! {
    /// How many [`StreamOrder::queue_on`] and [`StreamOrder::queue_on_mut`] closures the calling
    /// thread is running (each holding its order's lock, or its owner's exclusive borrow). While it
    /// is not zero the thread must not wait for any other cumem lock: a thread holding that lock
    /// may be waiting for a locked closure's order (a copy in the other direction).
    static QUEUING: Cell<usize> = const { Cell::new(0) };
}

thread_local! {
    /// How many cumem locks the calling thread holds around stream orders ([`AroundOrders`]: a
    /// host tracker's, while a copy orders the device side). While it is not zero, streams an
    /// order lets go of for good wait in [`LET_GO`] instead of being destroyed.
    static AROUND: Cell<usize> = const { Cell::new(0) };
    /// Streams let go of while [`AROUND`] was not zero, destroyed when the outermost such lock is
    /// let go of.
    static LET_GO: RefCell<Vec<LastStream>> = const { RefCell::new(Vec::new()) };
}

/// Held (declared after the guard it stands for, so dropped after it) while the calling thread
/// holds a cumem lock around stream orders: a host tracker's lock, held while a copy orders the
/// device memory on the other side, and a [`StreamOrder::queue_on`] closure's order lock, held
/// while the closure runs (other memory's tickets or guards dropped there, an owner's order
/// joined, admitting another stream or dropped there, e.g. with its buffer). The streams orders let go of for good meanwhile
/// are destroyed when the outermost one is dropped, after its lock: `cuStreamDestroy` and the
/// `cuEventDestroy` of the stream's marker wait behind another thread's `cuMemFree` on a real
/// driver (docs/observed-on-gpu.md, measured 2026-11-24), and a host function that needs the lock
/// (another thread's host access to the tracked memory) would then deadlock with that free.
///
/// It covers those destroys only. The driver calls of the work done under the lock are still made
/// with it held, and wait behind such a free all the same: for a copy holding a host tracker's
/// lock, the ordering's `cuEventCreate` (a marker's first use) and `cuEventRecord` of the
/// waited-for streams' markers, the profiler's events, and the `cuMemcpy*Async` itself (the lock
/// cannot be let go of before the enqueue: a host wait's snapshot of the tracked streams would
/// miss a copy not queued yet); for a `queue_on` closure, everything it calls. So a host function
/// must not take host access to memory that another thread may be copying to or from (or queueing
/// work on in a closure) while any thread may free memory in that context (docs/safety.md).
pub(crate) struct AroundOrders(());

impl AroundOrders {
    /// Counts the lock the caller has just taken (or is about to take).
    pub(crate) fn enter() -> AroundOrders {
        AROUND.with(|n| n.set(n.get() + 1));
        AroundOrders(())
    }
}

impl Drop for AroundOrders {
    fn drop(&mut self) {
        let outermost = AROUND.with(|n| {
            n.set(n.get().saturating_sub(1));
            n.get() == 0
        });
        if outermost {
            // Empty (no heap) unless a stream was let go of meanwhile.
            let mut dead = LET_GO.try_with(|l| std::mem::take(&mut *l.borrow_mut())).unwrap_or_default();
            destroy_let_go(&mut dead);
        }
    }
}

/// Whether the calling thread is inside a [`StreamOrder::queue_on`] closure, or destroying streams
/// an order let go of (a stream's drop may log, and a subscriber of it must not use cumem memory
/// from inside the bookkeeping).
pub(crate) fn queuing_on_this_thread() -> bool {
    QUEUING.with(Cell::get) > 0
}

/// The refusal of cumem memory used inside a [`StreamOrder::queue_on`] closure, or while the
/// thread destroys streams an order let go of (from a subscriber of what their drop logs).
pub(crate) fn used_inside_queue_on() -> Error {
    Error::NotPermitted {
        ctx: ErrorContext::op(
            "using cumem memory inside a StreamOrder::queue_on closure (or while an order destroys a stream it let go of)",
        ),
    }
}

/// The streams that may have work pending on a piece of device memory.
#[derive(Debug)]
pub struct StreamOrder {
    /// Taken out only by the order's `Drop`, which lets go of the streams it still names through
    /// the same deferral as the bookkeeping's (see `Users::dead`).
    inner: ManuallyDrop<Mutex<Users>>,
    /// What a `Drop` could not apply because `inner` was held while the dropping thread was inside
    /// a [`StreamOrder::queue_on`] closure (of this order or another), where it must not wait for
    /// `inner`: the holder may be waiting for that closure's order. Applied by whoever locks
    /// `inner` next (every acquisition drains it, see [`StreamOrder::drained`], and so does the
    /// owner's exclusive access, `users_mut`), so nobody reads the users without it. A leaf lock:
    /// held only to push or to take the list, never while waiting for anything else.
    deferred: Mutex<Vec<Deferred>>,
    /// Whether `deferred` may hold something: set under its lock after a push, cleared under it
    /// by the drain, so an acquisition of `inner` with nothing deferred costs one load. A change
    /// pushed before a thread locks `inner` (happens-before) is seen by it: it reads `true`, or a
    /// later `false` stored by a drain that applied the change under `inner` before it got it.
    has_deferred: AtomicBool,
    /// The ordinal of the memory's device (the device of the stream it was first used on), named
    /// by refusals.
    device: i32,
}

#[derive(Debug)]
struct Users {
    /// The most recently recorded user, with the generation of that recording (the highest of
    /// all). Kept apart from the others so that memory used on one stream, the common case, needs
    /// no heap allocation and its bookkeeping touches one field.
    latest: (Stream, u64),
    /// Every other stream with work that no recorded user has been ordered after, with the
    /// generation of its latest recording (to tell whether a waited-for entry changed since).
    others: Vec<(Stream, u64)>,
    next_gen: u64,
    /// The streams of tickets handed out and not yet dropped (work that may be being queued right
    /// now), each once, with its number of tickets: empty when no ticket is held. Work queued
    /// through a ticket is covered by the users only once the ticket is dropped; a ticket that never is
    /// (`mem::forget`) keeps its stream here, so that the free, `synchronize`, the host and
    /// later device work on any stream (`order_after_users`) still wait for it, until an owner's
    /// exclusive access turns it into a user ([`Users::settle_forgotten`]).
    pending: Vec<(Stream, usize)>,
    /// Why device work is refused for now: the host may be reading the memory, and its device
    /// cannot run work on it meanwhile (managed memory without concurrent managed access).
    excluded: Exclusion,
    /// Streams whose last handle the bookkeeping let go of, destroyed once the users are unlocked
    /// ([`Locked`]) or, for an owner with exclusive access, right away (in both cases after any
    /// lock the thread holds around orders, a host tracker's or a `queue_on` closure's order's,
    /// see [`AroundOrders`]), with cumem locks refused on the thread meanwhile: a stream's drop
    /// calls the driver and may log, and a subscriber that used this order (or a lock held around
    /// it) would wait for its own thread. (An owner with exclusive access holds no such lock; its
    /// paths refuse too only so that a subscriber sees one behaviour. So does the order's own
    /// drop: the streams it still names, its latest user, other users, forgotten tickets' streams,
    /// the stream it admits, go the same way, with the refusal, and after such a lock when it is
    /// dropped inside one, a buffer dropped inside a `queue_on` closure.) Empty (no heap) unless a
    /// stream was actually let go of for good, which costs driver calls anyway.
    dead: Vec<LastStream>,
}

/// Lets go of `stream`, keeping it in `dead` when it was the last handle.
fn bury(dead: &mut Vec<LastStream>, stream: Stream) {
    if let Some(last) = stream.release() {
        dead.push(last);
    }
}

impl Users {
    /// Every stream that may have work pending on the memory, recorded or not.
    fn all(&self) -> impl Iterator<Item = &Stream> {
        let pending = self.pending.iter().map(|(s, _)| s);
        std::iter::once(&self.latest.0).chain(self.others.iter().map(|(s, _)| s)).chain(pending)
    }

    /// Makes `stream` wait for every recorded user, and for the stream of every ticket not
    /// dropped yet.
    ///
    /// The tickets' streams are waited for because a ticket that is forgotten (`mem::forget` of a
    /// view's guard) is never recorded: its work, queued before its borrow ended, would otherwise
    /// race with every later use on another stream. The cost falls on a ticket that is merely
    /// still held: `stream` also waits for the work queued on that ticket's stream so far, which
    /// the two uses may not need (the halves of a split). What a held ticket queues afterwards is
    /// covered when it is dropped. Where that cost lands:
    ///
    /// - another thread queueing through a guard right now: work queued there before must not
    ///   itself wait for this use (a kernel polling for it would never see it);
    /// - the same thread: `let g = left.on(&t)?;` and then a use of the right half on `u` makes
    ///   `u` wait for `t`;
    /// - two readers: shared guards on two streams wait for each other's work so far;
    /// - the host: a blocking call on the other half (`to_vec`, blocking copies, a pinned→mapped
    ///   asynchronous copy, which an H100 showed blocking) waits for the held guard's stream; if
    ///   that stream's work waits on the host (a host function, `cuStreamWaitValue` on a flag the
    ///   host sets later), the thread deadlocks;
    /// - forgotten guards, until the owner's next exclusive access ([`Users::settle_forgotten`]):
    ///   each later use on another stream pays one record and one wait per forgotten guard's
    ///   stream.
    fn order_after_users(&self, stream: &Stream) -> Result<()> {
        stream.wait_for(&self.latest.0)?;
        for (user, _) in &self.others {
            stream.wait_for(user)?;
        }
        for (ticket, _) in &self.pending {
            // One wait per stream: a ticket's stream is often a user already, and each wait
            // records that stream's marker again (`pending` names each stream once).
            let waited = *ticket == self.latest.0 || self.others.iter().any(|(user, _)| user == ticket);
            if !waited {
                stream.wait_for(ticket)?;
            }
        }
        Ok(())
    }

    /// Records `stream` as the latest user. Entries recorded before `waited_before` were waited
    /// for by `stream` and are covered by it from now on, unless recorded again since.
    fn record(&mut self, stream: &Stream, waited_before: u64) {
        let generation = self.next_gen;
        self.next_gen += 1;
        if self.latest.0 == *stream {
            // The common case, one stream using the memory again: only its generation changes.
            self.latest.1 = generation;
            if !self.others.is_empty() {
                self.forget_others(stream, waited_before);
            }
            return;
        }
        let previous = std::mem::replace(&mut self.latest, (stream.clone(), generation));
        self.forget_others(stream, waited_before);
        if previous.1 >= waited_before {
            self.others.push(previous);
        } else {
            bury(&mut self.dead, previous.0);
        }
    }

    /// Drops from `others` `stream` and every entry recorded before `waited_before` (covered by a
    /// stream that waited for them), burying them (order does not matter among `others`).
    fn forget_others(&mut self, stream: &Stream, waited_before: u64) {
        let mut i = 0;
        while i < self.others.len() {
            let (s, g) = &self.others[i];
            if s == stream || *g < waited_before {
                let (gone, _) = self.others.swap_remove(i);
                bury(&mut self.dead, gone);
            } else {
                i += 1;
            }
        }
    }
}

/// Bookkeeping of a `Drop` that found the users locked by its own thread.
#[derive(Debug)]
enum Deferred {
    /// An [`OrderTicket`] dropped: its stream, and what it waited for.
    Ticket(Stream, u64),
    /// A [`ScopedExclusion`] ended.
    EndScope,
}

impl Users {
    fn apply(&mut self, deferred: Deferred) {
        match deferred {
            Deferred::Ticket(stream, waited_before) => {
                self.end_ticket(&stream, waited_before);
                bury(&mut self.dead, stream);
            }
            Deferred::EndScope => self.excluded.scoped = self.excluded.scoped.saturating_sub(1),
        }
    }

    fn end_ticket(&mut self, stream: &Stream, waited_before: u64) {
        if let Some(i) = self.pending.iter().position(|(s, _)| s == stream) {
            self.pending[i].1 -= 1;
            if self.pending[i].1 == 0 {
                let (ticket, _) = self.pending.swap_remove(i);
                bury(&mut self.dead, ticket);
            }
        }
        self.record(stream, waited_before);
    }

    /// Counts a ticket handed out for `stream`.
    fn start_ticket(&mut self, stream: &Stream) {
        match self.pending.iter_mut().find(|(s, _)| s == stream) {
            Some((_, tickets)) => *tickets += 1,
            None => self.pending.push((stream.clone(), 1)),
        }
    }

    /// For an owner with exclusive access, which proves that no ticket is alive: those still
    /// counted were forgotten, and all their work was queued before their borrows ended (the
    /// argument of [`StreamOrder::queue_on_mut`]). Nothing is in flight any more, so host reads
    /// of memory that excludes device work are no longer refused for them; their streams stay
    /// to be waited for, as users that no recorded user has been ordered after (a stream that is
    /// one already needs no second entry: waiting for a stream covers all its work so far).
    fn settle_forgotten(&mut self) {
        for (stream, _) in std::mem::take(&mut self.pending) {
            if stream == self.latest.0 || self.others.iter().any(|(user, _)| *user == stream) {
                bury(&mut self.dead, stream);
            } else {
                let generation = self.next_gen;
                self.next_gen += 1;
                self.others.push((stream, generation));
            }
        }
    }
}

/// Host reads that device work must not overlap, and the streams that may queue device work at
/// all.
#[derive(Debug, Default)]
struct Exclusion {
    /// A shared host borrow was handed out whose end nobody is told of: lifted only by an owner
    /// that proves, with exclusive access, that no such borrow is alive.
    open_ended: bool,
    /// Host reads in progress inside a call (e.g. a copy to a `Vec`), each lifted when it returns.
    scoped: usize,
    /// The streams admitted ([`StreamOrder::admit_only`]); every stream unless the owner says
    /// otherwise.
    admits: Admits,
}

/// Which streams may queue device work on the memory (managed memory on a device without
/// concurrent managed access: its attachment).
#[derive(Debug, Default)]
enum Admits {
    /// Every stream (the memory of every kind but such managed memory).
    #[default]
    Any,
    /// No stream (memory attached to the host).
    None,
    /// This one stream (memory attached to it).
    Only(Stream),
}

impl Exclusion {
    fn active(&self) -> bool {
        self.open_ended || self.scoped > 0
    }

    /// Whether device work on `stream` is refused: host reads in progress, or a stream the memory
    /// does not admit. Memory that admits every stream (all but managed memory on a device without
    /// concurrent managed access) pays one comparison more than the exclusion alone.
    #[inline]
    fn refuses(&self, stream: &Stream) -> bool {
        match &self.admits {
            Admits::Any => self.active(),
            Admits::None => true,
            Admits::Only(only) => only != stream || self.active(),
        }
    }
}

/// Proof that a stream was ordered after the memory's users; dropping it records the stream as a
/// user. Hold it until the work is queued.
#[must_use = "hold the ticket until the work is queued; dropping it early loses track of the work"]
#[derive(Debug)]
pub struct OrderTicket<'a> {
    order: &'a StreamOrder,
    /// Borrowed, not cloned: a ticket that is forgotten leaks nothing (its stream is kept, for the
    /// free, host access and later device work to wait for, in the order's `pending` list).
    stream: &'a Stream,
    /// Every entry recorded before this generation was waited for by `use_on` (generations only
    /// grow, and an entry recorded again gets a new one), so this is all the ticket must remember.
    waited_before: u64,
}

impl<'a> OrderTicket<'a> {
    /// The stream the ticket orders work on.
    pub fn stream(&self) -> &'a Stream {
        self.stream
    }
}

impl StreamOrder {
    /// Memory first used (allocated) on `stream`, a stream of the memory's device.
    pub fn new(stream: &Stream) -> Self {
        StreamOrder {
            device: stream.context().device().ordinal() as i32,
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
            inner: ManuallyDrop::new(Mutex::new(Users {
                latest: (stream.clone(), 0),
                others: Vec::new(),
                next_gen: 1,
                pending: Vec::new(),
                excluded: Exclusion::default(),
                dead: Vec::new(),
            })),
        }
    }

    /// Device work and host reads that must not overlap (see [`StreamOrder::use_on`]): refused on
    /// the memory's device.
    fn refusal(&self) -> Error {
        refusal_on(self.device)
    }

    /// Locks the users, or answers `NotPermitted` when the calling thread is inside a
    /// [`StreamOrder::queue_on`] closure (of any order) or destroying streams an order let go of
    /// (a subscriber of what their drop logs): locking this order's users again would
    /// wait for itself, and waiting for another order's could wait for a thread that waits for
    /// this one (two copies crossing between two memories).
    fn lock(&self) -> Result<Locked<'_>> {
        if queuing_on_this_thread() {
            return Err(used_inside_queue_on());
        }
        Ok(self.drained(self.inner.lock()))
    }

    /// The users just locked, with every change deferred by a `Drop` applied (see `deferred`).
    #[inline]
    fn drained<'o>(&'o self, inner: MutexGuard<'o, Users>) -> Locked<'o> {
        let mut inner = Locked { guard: ManuallyDrop::new(inner) };
        if self.has_deferred.load(Ordering::Acquire) {
            self.apply_deferred(&mut inner);
        }
        inner
    }

    #[cold]
    fn apply_deferred(&self, inner: &mut Users) {
        let changes = {
            let mut deferred = self.deferred.lock();
            self.has_deferred.store(false, Ordering::Relaxed);
            std::mem::take(&mut *deferred)
        };
        // Applied without holding `deferred`; the streams let go of are destroyed once `inner` is
        // unlocked too (see `Users::dead`).
        for change in changes {
            inner.apply(change);
        }
    }

    /// Runs `change` on the users from a `Drop`, which must neither fail nor wait for a lock
    /// inside a closure: when the users are held and the calling thread is inside a
    /// [`StreamOrder::queue_on`] closure (this order's, whose lock it holds itself, or another's,
    /// whose holder may be waiting for the other order, or be inside a closure dropping a ticket
    /// of that order: two threads crossing), the change is left in `deferred` for whoever locks
    /// the users next.
    fn change_from_drop(&self, change: Deferred) {
        if let Some(inner) = self.inner.try_lock() {
            return self.drained(inner).apply(change);
        }
        if queuing_on_this_thread() {
            let mut deferred = self.deferred.lock();
            deferred.push(change);
            self.has_deferred.store(true, Ordering::Release);
            return;
        }
        // Outside any closure this thread holds no order's lock, and a thread holding this one
        // never waits for another cumem lock while holding it (`lock` refuses that inside a
        // closure, and drops there defer), so this wait ends.
        self.drained(self.inner.lock()).apply(change);
    }

    /// Orders `stream` after all work queued so far on the memory by its recorded users, and by
    /// the streams of tickets handed out and not dropped (a ticket that was forgotten is never
    /// recorded; one still held on another thread costs a wait that may not be needed). Queue
    /// the work on `stream` while holding the returned ticket.
    ///
    /// While the host may be reading memory whose device cannot run work on it at the same time
    /// (see [`HostAccess::with_exclusive_order`](crate::HostAccess::with_exclusive_order)), device
    /// work is refused: `NotSupported { feature: ConcurrentManagedAccess, device }` naming the
    /// memory's device, before anything waits. So is work on a stream the memory does not admit
    /// ([`StreamOrder::admit_only`]: managed memory attached to the host, or to another stream).
    ///
    /// Conversely, such host reads are refused with the same error while a ticket is held (work
    /// may be being queued): queue the work and drop the ticket before reading on the host. A
    /// ticket that is never dropped (`mem::forget`) keeps refusing them until the owner next uses
    /// the order exclusively (which proves no ticket alive: the memory's drop, a `&mut` host
    /// borrow, ending host reads, making a `&mut` device view of host-visible memory, work through
    /// a whole-buffer `&mut` view of a device buffer).
    ///
    /// On success, `stream`'s context is current on the calling thread, ready for the work.
    pub fn use_on<'s>(&'s self, stream: &'s Stream) -> Result<OrderTicket<'s>> {
        // Waiting under the lock keeps the set from changing between the waits and the snapshot
        // of what was waited for.
        let mut inner = self.lock()?;
        if inner.excluded.refuses(stream) {
            return Err(self.refusal());
        }
        inner.order_after_users(stream)?;
        inner.start_ticket(stream);
        let ticket = OrderTicket { order: self, stream, waited_before: inner.next_gen };
        // Unlocking may destroy a stream the order let go of, which binds that stream's context.
        drop(inner);
        // The work is queued right after, perhaps by raw driver calls on a thread where no
        // context (or another) is current. On failure the ticket's drop records the stream as a
        // user that queued nothing.
        stream.context().bind()?;
        Ok(ticket)
    }

    /// Runs `queue`, which queues work on the memory on `stream` and returns, ordered as
    /// [`StreamOrder::use_on`] orders it, and records `stream` as a user when it returns (also
    /// when it fails: whatever it queued is waited for). The same ordering as a ticket at a
    /// third of the bookkeeping: one lock and unlock, no ticket to track, no handle to clone.
    ///
    /// The users stay locked while `queue` runs, so `queue` is for raw driver work on `stream`
    /// only (a kernel launch, another library's call), never for other cumem memory: any use of
    /// cumem memory or host-memory trackers from inside `queue` (this memory's or another's: a
    /// copy, a view's door, a shared host borrow of pinned memory) answers `NotPermitted` instead of
    /// waiting, since the thread holding that other lock may be waiting for this one. Work that
    /// needs other cumem memory takes the guard of [`StreamOrder::use_on`] (for views,
    /// [`DeviceSlice::on`](crate::DeviceSlice::on)), which holds no lock while the work is queued.
    /// What needs exclusive access to other memory takes no order's or tracker's lock and is not
    /// refused: dropping a device, pitched, pinned or mapped buffer, ending a `HostRegistered`
    /// scope, an exclusive host borrow (`as_mut_slice`) of pinned memory (see
    /// [`HostAccess::wait_idle_mut`](crate::HostAccess::wait_idle_mut): those that wait for device
    /// work do so with this order still locked). Freeing waits too: `cuMemFree`, `cuMemFreeHost`
    /// and their kin wait for every host function queued in the context to return (driver brief
    /// §17), even for idle memory, so a host function that waits for a thread needing this order
    /// deadlocks with a drop inside `queue`; drop buffers after it returns. A memory kind whose
    /// drop must still wait through a lock leaks its memory with a warning when dropped inside
    /// `queue`. Another thread using
    /// this memory waits until `queue` returns. A ticket (or a view's guard) dropped inside
    /// `queue` never waits either: if its order is locked (this one, or another that a thread
    /// crossing this one holds in its own closure), its stream is recorded by the next lock of
    /// that order (the closure holding it applies it when it returns, if it came in time), before
    /// anyone reads that order's users again. Refusals are as in [`StreamOrder::use_on`].
    /// `queue` runs with `stream`'s context current on the calling thread.
    ///
    /// The refusal is per thread: it knows which thread runs `queue`, not what that thread waits
    /// for. A thread that `queue` starts or waits for (a scoped thread, a pool's worker) and that
    /// uses this memory, or any cumem memory another thread may be copying to or from this one,
    /// waits for a lock that `queue` holds until that thread is done: a deadlock, not
    /// `NotPermitted`. Keep other threads' cumem work out of `queue` too.
    ///
    /// The lock also covers `queue`'s driver calls, which the driver itself may hold back (an
    /// asynchronous copy waits while another thread is inside `cuMemFree`), so other threads
    /// using the memory wait for those too.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{Device, Error, Stream, StreamOrder};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    /// let order = StreamOrder::new(&a);
    /// order.queue_on(&b, || Ok(()))?; // b waited for a; queue work on b here
    /// assert_eq!(order.join()?, b);
    /// let inside = order.queue_on(&b, || order.queue_on(&a, || Ok(())));
    /// assert!(matches!(inside, Err(Error::NotPermitted { .. })));
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn queue_on<R>(&self, stream: &Stream, queue: impl FnOnce() -> Result<R>) -> Result<R> {
        let inner = self.lock()?;
        if inner.excluded.refuses(stream) {
            return Err(self.refusal());
        }
        inner.order_after_users(stream)?;
        // `queue` makes raw driver calls, perhaps on a thread where no context is current.
        stream.context().bind()?;
        let _queuing = Queuing {
            waited_before: inner.next_gen,
            inner,
            order: self,
            stream,
            _around: AroundOrders::enter(),
            _refusal: Refusal::raise(),
        };
        queue()
    }

    /// [`StreamOrder::queue_on`] for an owner with exclusive access to the order: the same
    /// ordering, the same refusals (`NotPermitted` inside any `queue_on` closure, and any cumem
    /// lock taken inside `queue` refused as there), and no lock: nothing else can reach the users
    /// while `&mut self` is held.
    ///
    /// This is what an exclusive view made from an owner that holds its order by value uses
    /// ([`DeviceBuffer::as_mut_slice`](crate::DeviceBuffer::as_mut_slice), and a single sub-view
    /// of it); views that may be used from two threads at once (the halves of a split, chunks)
    /// use the locked form.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{Device, Error, Stream, StreamOrder};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    /// let mut order = StreamOrder::new(&a);
    /// order.queue_on_mut(&b, || Ok(()))?; // b waited for a
    /// assert_eq!(order.join()?, b);
    /// let other = StreamOrder::new(&a);
    /// let inside = order.queue_on_mut(&b, || other.queue_on(&a, || Ok(())));
    /// assert!(matches!(inside, Err(Error::NotPermitted { .. })));
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn queue_on_mut<R>(&mut self, stream: &Stream, queue: impl FnOnce() -> Result<R>) -> Result<R> {
        // No lock is taken here, so none could close a cycle; the refusal is kept anyway so that
        // the rule stays one rule (no cumem memory used inside a closure), whichever form a view
        // holds.
        if queuing_on_this_thread() {
            return Err(used_inside_queue_on());
        }
        let device = self.device;
        // Why no lock is needed. Everything that reads or changes the users borrows the order:
        // views, tickets and scoped exclusions hold `&StreamOrder`, a `queue_on` in progress holds
        // it and its lock, and an owner that shares its order with anything else (a host tracker,
        // `HostAccess::with_order`) hands out only `&StreamOrder`. `&mut self` proves that none of
        // them is alive, on any thread, and that whatever they did happened before this call
        // (the borrow could not end otherwise): a ticket dropped on another thread has applied
        // its change or left it in `deferred` (drained below); one that was forgotten left its
        // stream in `pending`, which `users_mut` turns into a user (its work was all queued).
        // Nothing can take the lock or push to `deferred` while `queue` runs either: that needs
        // `&StreamOrder`, and `queue` cannot make one (`self` is borrowed).
        let inner = self.users_mut();
        if inner.excluded.refuses(stream) {
            return Err(refusal_on(device));
        }
        inner.order_after_users(stream)?;
        // As in `queue_on`.
        stream.context().bind()?;
        let _queuing =
            QueuingMut { waited_before: inner.next_gen, inner, stream, _refusal: Refusal::raise() };
        queue()
    }

    /// The users, for an owner with exclusive access: no lock, and the changes deferred by drops
    /// applied first (exclusive access: none is being pushed now).
    fn users_mut(&mut self) -> &mut Users {
        if *self.has_deferred.get_mut() {
            *self.has_deferred.get_mut() = false;
            let changes = std::mem::take(self.deferred.get_mut());
            for change in changes {
                self.inner.get_mut().apply(change);
            }
        }
        let users = self.inner.get_mut();
        if !users.pending.is_empty() {
            users.settle_forgotten();
        }
        // Exclusive access: no lock is held, so streams let go of are destroyed now.
        destroy_let_go(&mut users.dead);
        users
    }

    /// Refuses device work from now on (`open_ended`: until [`StreamOrder::end_open_exclusion`];
    /// otherwise until the returned guard is dropped), then waits until all work queued so far has
    /// completed.
    ///
    /// Never waits for tickets: while one is held (its work may be being queued, possibly by the
    /// calling thread), the exclusion is not begun and the answer is `NotSupported { feature:
    /// ConcurrentManagedAccess }`. Once begun, no ticket can be handed out (`use_on` checks under
    /// the same lock), so synchronising the recorded users covers all work. If that wait fails, an
    /// open-ended exclusion stays in place (refusing work is always safe); a scoped one ends with
    /// its guard.
    pub(crate) fn exclude_device(&self, open_ended: bool) -> Result<Option<ScopedExclusion<'_>>> {
        let scope = {
            let mut inner = self.lock()?;
            if !inner.pending.is_empty() {
                return Err(self.refusal());
            }
            if open_ended {
                inner.excluded.open_ended = true;
                None
            } else {
                inner.excluded.scoped += 1;
                // Created right after the count went up: every way out (errors, panics) ends it.
                Some(ScopedExclusion { order: self })
            }
        };
        self.synchronize()?;
        Ok(scope)
    }

    /// Confines device work on the memory to `stream` (`None`: to no stream at all), or, after
    /// [`StreamOrder::admit_any`], lets every stream queue it again: for managed memory on a device
    /// without concurrent managed access, where the attachment decides which streams may use it
    /// (attached to the host: none; to one stream: that one). Work on another stream is refused
    /// by [`StreamOrder::use_on`], [`StreamOrder::queue_on`] and [`StreamOrder::queue_on_mut`]
    /// with `NotSupported { feature: ConcurrentManagedAccess, device }`, before anything waits,
    /// as while host reads exclude device work. Takes effect for work ordered from now on; the
    /// owner changes it around queueing the attachment (whose own ticket it must admit).
    /// `&mut self`: only the memory's owner decides (views hand out `&StreamOrder`), and no ticket,
    /// view or closure of the order is alive meanwhile.
    ///
    /// ```compile_fail
    /// # cumem_sys::testing::init();
    /// use cumem_core::{Device, DeviceBuffer, Stream};
    /// let stream = Stream::new(&Device::get(0)?.context()?)?;
    /// let buf = DeviceBuffer::<u8>::zeroed(&stream, 16)?;
    /// buf.order().admit_any(); // a shared order cannot change what it admits
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn admit_only(&mut self, stream: Option<&Stream>) {
        self.set_admits(match stream {
            Some(stream) => Admits::Only(stream.clone()),
            None => Admits::None,
        })
    }

    /// Lets every stream queue device work on the memory again (see [`StreamOrder::admit_only`]).
    pub fn admit_any(&mut self) {
        self.set_admits(Admits::Any)
    }

    fn set_admits(&mut self, admits: Admits) {
        let users = self.users_mut();
        if let Admits::Only(before) = std::mem::replace(&mut users.excluded.admits, admits) {
            bury(&mut users.dead, before);
        }
        // Exclusive access: the order holds no lock, so a stream let go of is destroyed now (or,
        // inside a lock around orders, a `queue_on` closure of another order or a host tracker's,
        // once the outermost is let go of).
        destroy_let_go(&mut users.dead);
    }

    /// Ends the open-ended exclusion: the owner has exclusive access, so no host borrow that
    /// began it is alive any more.
    pub(crate) fn end_open_exclusion(&mut self) {
        self.users_mut().excluded.open_ended = false;
    }

    /// One stream ordered after every recorded user: the latest user, made to wait for the others.
    /// Afterwards it is the only recorded user. Call with no use in flight (e.g. when freeing); the
    /// stream of a ticket that was forgotten instead of dropped is waited for too (its work was
    /// queued before now, as the ticket's borrow has ended), and stays pending.
    pub fn join(&self) -> Result<Stream> {
        let mut inner = self.lock()?;
        Self::join_users(&mut inner).cloned()
    }

    /// [`StreamOrder::join`] for an owner with exclusive access (the memory's drop): no lock, and
    /// the stream is lent rather than cloned.
    pub fn join_mut(&mut self) -> Result<&Stream> {
        let users = self.users_mut();
        Self::join_users(users)?;
        // Exclusive access: no lock is held, so streams let go of are destroyed now.
        destroy_let_go(&mut users.dead);
        Ok(&users.latest.0)
    }

    fn join_users(inner: &mut Users) -> Result<&Stream> {
        let latest = &inner.latest.0;
        for user in inner.others.iter().map(|(s, _)| s).chain(inner.pending.iter().map(|(s, _)| s)) {
            latest.wait_for(user)?;
        }
        for (gone, _) in inner.others.drain(..) {
            bury(&mut inner.dead, gone);
        }
        inner.latest.1 = inner.next_gen;
        inner.next_gen += 1;
        Ok(&inner.latest.0)
    }

    /// Blocks until all work of every recorded user (and of every ticket not dropped) has
    /// completed.
    pub fn synchronize(&self) -> Result<()> {
        let users: Vec<Stream> = self.lock()?.all().cloned().collect();
        for user in &users {
            user.synchronize()?;
        }
        Ok(())
    }

    /// [`StreamOrder::synchronize`] for an owner with exclusive access (the memory's drop, an
    /// exclusive host borrow): no lock, so it is not refused inside a [`StreamOrder::queue_on`]
    /// closure. `&mut self` proves no ticket, view or closure of this order is alive (see
    /// [`StreamOrder::queue_on_mut`]), so every user was recorded or left its stream pending, and
    /// no thread can be holding this order's lock while it waits for the caller.
    ///
    /// It still blocks, and inside a closure it blocks while the closure's own order stays
    /// locked: other threads using that order wait meanwhile, and if the work waited for itself
    /// waits on the host (a host function, a stream memory operation) for something that needs
    /// that order or this thread, it never ends.
    pub fn synchronize_mut(&mut self) -> Result<()> {
        for user in self.users_mut().all() {
            user.synchronize()?;
        }
        Ok(())
    }

    /// The most recently recorded user. `NotPermitted` inside a [`StreamOrder::queue_on`]
    /// closure, as every use of the order there.
    pub fn last(&self) -> Result<Stream> {
        Ok(self.lock()?.latest.0.clone())
    }

    /// How many streams may still have work on the memory: the recorded users and the streams of
    /// tickets not dropped (held, or forgotten), each stream counted once. `NotPermitted` inside a
    /// [`StreamOrder::queue_on`] closure, as every use of the order there.
    pub fn users(&self) -> Result<usize> {
        let inner = self.lock()?;
        let mut seen: Vec<&Stream> = Vec::new();
        for stream in inner.all() {
            if !seen.contains(&stream) {
                seen.push(stream);
            }
        }
        Ok(seen.len())
    }
}

/// A [`StreamOrder::queue_on`] in progress: its users stay locked until the closure has
/// returned, failed or unwound, and then record the stream (whatever the closure queued before
/// it stopped is waited for by later users).
struct Queuing<'o> {
    inner: Locked<'o>,
    order: &'o StreamOrder,
    stream: &'o Stream,
    /// The users were locked since the waits, so every entry recorded so far was waited for.
    waited_before: u64,
    /// Declared after `inner`, so dropped after it: the closure runs with this order locked, a
    /// lock around orders ([`AroundOrders`]). Streams let go of inside it (a ticket or view's
    /// guard of other memory dropped there, an owner's order joined, admitting another stream or
    /// dropped there) and by the recording when it returns are destroyed once `inner` has unlocked the
    /// users (or once a lock held around this one, a host tracker's, is let go of), not while
    /// another thread needing this order (a host function reading the memory on the host) waits.
    _around: AroundOrders,
    /// Declared after `inner` and `_around`, so dropped after them: the streams the bookkeeping let
    /// go of are destroyed (when `_around` goes, after `inner` unlocks) while cumem locks are still
    /// refused on this thread. A stream's drop may log, and a subscriber that takes a lock this
    /// thread holds around the closure (a host tracker's, in a copy) is refused then instead of
    /// waiting for itself.
    _refusal: Refusal,
}

/// Lets go of `stream`, a handle another tracker of the crate kept (a host tracker's): if it was
/// the last, the stream is destroyed as the orders' own are (see [`destroy_let_go`]), after the
/// outermost lock around orders the thread holds, or now with cumem locks refused.
pub(crate) fn let_go(stream: Stream) {
    let mut dead = Vec::new();
    bury(&mut dead, stream);
    destroy_let_go(&mut dead);
}

/// Destroys the streams an order let go of, with cumem locks refused on this thread meanwhile: a
/// stream's drop may log, and a subscriber is refused rather than left to use cumem memory from
/// inside the bookkeeping.
///
/// While the thread holds a cumem lock around orders (a host tracker's, around a ticket or a
/// copy's device side, or a [`StreamOrder::queue_on`] closure's order lock: [`AroundOrders`]), the
/// streams are kept and destroyed once the outermost such lock is let go of: destroying a stream
/// (and its marker event) waits behind another thread's `cuMemFree` on a real driver, and nobody
/// should wait for that lock meanwhile.
fn destroy_let_go(dead: &mut Vec<LastStream>) {
    if dead.is_empty() {
        return;
    }
    if AROUND.with(Cell::get) > 0 && LET_GO.try_with(|l| l.borrow_mut().append(dead)).is_ok() {
        return;
    }
    let _refusal = Refusal::raise();
    dead.clear();
}

/// Refuses cumem locks on this thread while it lives (see [`queuing_on_this_thread`]).
struct Refusal;

impl Refusal {
    fn raise() -> Refusal {
        QUEUING.with(|q| q.set(q.get() + 1));
        Refusal
    }
}

impl Drop for Refusal {
    fn drop(&mut self) {
        QUEUING.with(|q| q.set(q.get().saturating_sub(1)));
    }
}

impl Drop for Queuing<'_> {
    fn drop(&mut self) {
        // Tickets dropped inside the closure (by this thread, or by another thread's closure
        // while this one held the users) recorded their streams before this one returns.
        if self.order.has_deferred.load(Ordering::Acquire) {
            self.order.apply_deferred(&mut self.inner);
        }
        self.inner.record(self.stream, self.waited_before);
    }
}

/// A [`StreamOrder::queue_on_mut`] in progress: as [`Queuing`], holding the users through the
/// owner's exclusive borrow instead of a lock. Nothing can be deferred meanwhile (deferring needs
/// `&StreamOrder`), so there is nothing to drain when it ends.
struct QueuingMut<'o> {
    inner: &'o mut Users,
    stream: &'o Stream,
    waited_before: u64,
    /// Lowered after the drop has destroyed the streams let go of (see `Queuing::_refusal`).
    _refusal: Refusal,
}

impl Drop for QueuingMut<'_> {
    fn drop(&mut self) {
        self.inner.record(self.stream, self.waited_before);
        // Exclusive access: the order holds no lock, so the streams let go of are destroyed now
        // (or, where the thread holds a lock around orders, a host tracker's or another order's in
        // a `queue_on` closure, once the outermost is let go of), while cumem locks are still
        // refused on this thread (`_refusal` goes after this; see `Queuing::_refusal`).
        destroy_let_go(&mut self.inner.dead);
    }
}

/// The users, locked. Streams the bookkeeping let go of for good (`Users::dead`) are destroyed
/// when it unlocks them, after the lock is released.
struct Locked<'o> {
    guard: ManuallyDrop<MutexGuard<'o, Users>>,
}

impl Deref for Locked<'_> {
    type Target = Users;
    fn deref(&self) -> &Users {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Users {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Empty (nothing allocated, nothing to drop) unless a stream was let go of for good.
        let dead = std::mem::take(&mut self.guard.dead);
        // SAFETY: the guard is dropped here once, and `self.guard` is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        let mut dead = dead;
        destroy_let_go(&mut dead);
    }
}

impl std::fmt::Debug for Locked<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.guard.fmt(f)
    }
}

/// Device work and host reads that must not overlap: refused on the memory's `device`.
fn refusal_on(device: i32) -> Error {
    Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(device) }
}

/// One scoped exclusion begun by [`StreamOrder::exclude_device`]; dropping it ends it.
#[derive(Debug)]
pub(crate) struct ScopedExclusion<'a> {
    order: &'a StreamOrder,
}

impl Drop for ScopedExclusion<'_> {
    fn drop(&mut self) {
        // Never meets its own thread's `queue_on` of this order (which refuses to start while a
        // scoped exclusion is alive), but deferring is as safe as waiting would be.
        self.order.change_from_drop(Deferred::EndScope);
    }
}

impl Drop for StreamOrder {
    fn drop(&mut self) {
        // Exclusive access: the changes deferred by tickets' drops are applied first (a deferred
        // ticket holds a handle of its stream, perhaps the last), and forgotten tickets' streams
        // become users.
        self.users_mut();
        // SAFETY: `inner` is taken once, here, and not used afterwards: the order is being
        // dropped, and no other field's drop reads it.
        let users = unsafe { ManuallyDrop::take(&mut self.inner) }.into_inner();
        let Users { latest, others, pending, excluded, mut dead, .. } = users;
        bury(&mut dead, latest.0);
        let pending = pending.into_iter().map(|(stream, _)| stream);
        for stream in others.into_iter().map(|(stream, _)| stream).chain(pending) {
            bury(&mut dead, stream);
        }
        if let Admits::Only(admitted) = excluded.admits {
            bury(&mut dead, admitted);
        }
        // As the bookkeeping's: destroyed now with cumem locks refused on this thread, or, where
        // it holds a lock around orders (a buffer dropped inside another order's `queue_on`
        // closure), once the outermost is let go of.
        destroy_let_go(&mut dead);
    }
}

impl Drop for OrderTicket<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.order.inner.try_lock() {
            return self.order.drained(inner).end_ticket(self.stream, self.waited_before);
        }
        // Contended, or dropped inside a `queue_on` closure: the rare paths clone the stream.
        self.order.change_from_drop(Deferred::Ticket(self.stream.clone(), self.waited_before));
    }
}
