//! Host access to memory the device may still be using: the pending-work tracker that every
//! host-visible memory kind shares, and the [`HostMemory`] trait that asynchronous copies accept.
//!
//! The device reads or writes host-visible memory (pinned, mapped, registered, managed) long after
//! the call that queued the work has returned. A [`HostAccess`] remembers that work, so that the
//! host can wait for exactly what matters before touching the memory: reading waits for pending
//! device writes, writing and freeing wait for everything. Work is tracked in one of two ways:
//!
//! - **streams** (the default), for memory that the device only reaches through the [`HostMemory`]
//!   hooks ([`PinnedBuffer`](crate::PinnedBuffer), `HostRegistered`): the tracker remembers the
//!   stream of the last write and the streams of the reads since, nothing more (no event is
//!   recorded after a copy, so queuing one costs the copy's own driver call; and the stream that
//!   first read the memory since its last write reads it again without taking the tracker's lock,
//!   which costs two atomic read-modify-writes per copy otherwise). Host access
//!   synchronises those streams, which covers the tracked work and whatever was queued on them
//!   after it: it may wait longer than the copy, never shorter. Device work on another stream is
//!   ordered after them with the stream's marker event (one per stream, made once and recorded
//!   again each time), which is the only time an event is needed. Because the whole stream is
//!   waited for, host access must not be what later work on that stream waits for (a host function
//!   or kernel polling for the host to act): that deadlocks;
//! - **a stream order** ([`HostAccess::with_order`]): for memory that is also handed out as device
//!   views ([`DeviceSlice`](crate::DeviceSlice)), whose copies only know the view's
//!   [`StreamOrder`]. Every device use goes through that order, and host access synchronises every
//!   stream the order names: its recorded users (more than one when streams used the memory at
//!   once, two readers or the halves of a split) and the streams of guards not dropped.
//!
//! Some memory must not be read by the host while *any* device work uses it, reads included:
//! managed memory on a device without concurrent managed access, where the host faults on pages
//! the device may be using. [`HostAccess::with_exclusive_order`] makes host reads exclusive with
//! device work: a shared host borrow waits for every device use (not only writes), and device work
//! through the order is refused (`NotSupported { feature: ConcurrentManagedAccess }`) from then on
//! until the owner, with exclusive access, proves the borrow is over
//! ([`HostAccess::end_host_reads`]). Reads that end inside a call ([`HostAccess::read_scoped`])
//! lift the refusal when they return.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, HostAccess, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let mut data = vec![1u8; 16];
//! let mut access = HostAccess::new();
//! // SAFETY: the closure queues nothing, so it reads nothing.
//! unsafe { access.device_write(&stream, data.as_mut_ptr(), data.len(), |_, _| Ok(()))? };
//! access.wait_idle()?; // waits for the (empty) work queued above
//! assert!(access.is_idle());
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::order::{AroundOrders, let_go, queuing_on_this_thread, used_inside_queue_on};
use crate::{Context, Result, Stream, StreamOrder};

/// How device work reached the memory through its stream order (views and order-tracked hooks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
enum OrderedUse {
    /// Nothing queued through the order since the host last waited.
    #[default]
    None,
    /// Reads only.
    Read,
    /// At least one write.
    Write,
}

/// An [`OrderedUse`] that views raise without the tracker's lock.
///
/// Handing out a view must not wait for the lock: it may be asked for inside a
/// [`StreamOrder::queue_on`] closure while another thread holds the lock and waits for that
/// closure's order (a copy from this memory into the closure's). Raising and lowering are single
/// atomic read-modify-writes (`fetch_max`, `fetch_min`), so no update is lost, and the updates
/// made concurrently commute: views taken through `&self` only ever raise to `Read`, and
/// `max(min(x, Read), Read) == min(max(x, Read), Read)`, so a shared view taken while a host wait
/// lowers `Write` to `Read` leaves `Read` whichever comes first. A raise to `Write` needs
/// exclusive access to the owner (an exclusive view), so no host wait runs meanwhile. The waits
/// of shared host access lower it after their synchronisation without the lock (two of them
/// lowering concurrently commute as well).
#[derive(Debug, Default)]
struct OrderedCell(AtomicU8);

impl OrderedCell {
    fn from_u8(value: u8) -> OrderedUse {
        match value {
            0 => OrderedUse::None,
            1 => OrderedUse::Read,
            _ => OrderedUse::Write,
        }
    }

    fn get(&self) -> OrderedUse {
        Self::from_u8(self.0.load(Ordering::Acquire))
    }

    fn raise(&self, to: OrderedUse) {
        self.0.fetch_max(to as u8, Ordering::AcqRel);
    }

    fn lower(&self, to: OrderedUse) {
        self.0.fetch_min(to as u8, Ordering::AcqRel);
    }

    fn set(&mut self, to: OrderedUse) {
        *self.0.get_mut() = to as u8;
    }
}

/// Device work still using the memory.
///
/// Invariant: every device operation on the memory that the host has not seen complete was queued
/// on `write` or on a stream in `reads`, or is ordered before work queued there (a later write
/// waited for it); every read is ordered after the last write before it. Synchronising `write`
/// therefore ends every device write, and synchronising all of them ends every device use.
#[derive(Debug, Default)]
struct Pending {
    /// The streams of device reads since the last write (each at most once; the `Vec` keeps its
    /// capacity, so tracking the same streams again allocates nothing), each with the number of
    /// its latest read (see `reads_queued`).
    reads: Vec<(Stream, u64)>,
    /// The stream of the last device write.
    write: Option<Stream>,
    /// How many device reads were tracked: a read stream is forgotten after a wait only if it
    /// took no read since the wait's snapshot (its number is unchanged).
    reads_queued: u64,
}

impl Pending {
    /// Blocks until every device read and write has completed. Every tracked stream is waited for
    /// even after one wait fails (one stream's failure, say on one device, says nothing of another
    /// device's work, which the owner's fallback must still cover): those seen complete are
    /// forgotten, those whose wait failed stay tracked, and the first error is returned. For an
    /// owner with exclusive access (no lock held).
    fn wait_all(&mut self) -> Result<()> {
        let mut first = None;
        if let Some(write) = &self.write {
            match write.synchronize() {
                Ok(()) => self.write.take().into_iter().for_each(let_go),
                Err(e) => first = Some(e),
            }
        }
        for i in (0..self.reads.len()).rev() {
            match self.reads[i].0.synchronize() {
                Ok(()) => let_go(self.reads.remove(i).0),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The contexts of the tracked streams, each once.
    fn contexts(&self) -> Vec<Context> {
        let mut contexts: Vec<Context> = Vec::new();
        let streams = self.write.iter().chain(self.reads.iter().map(|(read, _)| read));
        for ctx in streams.map(Stream::context) {
            if !contexts.contains(ctx) {
                contexts.push(ctx.clone());
            }
        }
        contexts
    }

    /// Forgets what a wait without the lock saw complete: the write stream if it is still the one
    /// waited for, and each read stream waited for that took no read since the snapshot. Returns
    /// the handles let go of, for the caller to drop once it has unlocked (a stream's last handle
    /// calls the driver and may log when dropped).
    fn forget(&mut self, write: Option<&Stream>, reads: &[(Stream, u64)], settled: u64) -> Gone {
        let write = match (write, &self.write) {
            (Some(waited), Some(tracked)) if waited == tracked => self.write.take(),
            _ => None,
        };
        let mut gone = Vec::new();
        // The settled reader stays: reads on it are not renumbered (see `HostAccess::settled`).
        for waited in reads.iter().filter(|(read, _)| read.id() != settled || settled == 0) {
            if let Some(i) = self.reads.iter().position(|tracked| tracked == waited) {
                gone.push(self.reads.swap_remove(i));
            }
        }
        Gone(write, gone)
    }
}

/// A tracker dropped (with its memory, perhaps inside a `queue_on` closure) lets go of its streams
/// as stream orders do (see [`Gone`]).
impl Drop for Pending {
    fn drop(&mut self) {
        self.write.take().into_iter().for_each(let_go);
        self.reads.drain(..).for_each(|(stream, _)| let_go(stream));
    }
}

/// Streams a tracker no longer tracks, taken out under its lock and let go of when this drops,
/// after the lock: destroyed as stream orders destroy the streams they let go of (after any lock
/// around orders the thread still holds, such as a `queue_on` closure's), if one was the last
/// handle; `cuStreamDestroy` waits behind another thread's `cuMemFree` on a real driver.
struct Gone(Option<Stream>, Vec<(Stream, u64)>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.take().into_iter().for_each(let_go);
        self.1.drain(..).for_each(|(stream, _)| let_go(stream));
    }
}

/// A tracker's locked [`Pending`]: the lock is let go of first, then the streams stream orders
/// let go of meanwhile are destroyed (fields drop in order).
struct PendingGuard<'a> {
    guard: parking_lot::MutexGuard<'a, Pending>,
    _around: AroundOrders,
}

impl std::ops::Deref for PendingGuard<'_> {
    type Target = Pending;
    fn deref(&self) -> &Pending {
        &self.guard
    }
}

impl std::ops::DerefMut for PendingGuard<'_> {
    fn deref_mut(&mut self) -> &mut Pending {
        &mut self.guard
    }
}

/// The device work pending on one piece of host-visible memory, and the waits host access needs.
///
/// Owners keep one per allocation and call [`HostAccess::wait_writes`] before handing out `&[T]`,
/// and [`HostAccess::wait_idle_mut`] before `&mut [T]` and before freeing ([`HostAccess::wait_idle`]
/// waits the same through `&self`, but cannot end a refusal of device work or forget the uses of
/// live views).
#[derive(Debug, Default)]
pub struct HostAccess {
    pending: Mutex<Pending>,
    /// The [`Stream::id`] of a read stream whose reads are tracked without the lock, or 0.
    ///
    /// Reads on it need no lock because the tracker already names it and keeps naming it: it is
    /// set (under the lock, only from 0) once the stream is in `reads`, ordered after the last
    /// write; only an owner with exclusive access forgets it, and clears this first (a device
    /// write, which needs `&mut`, clears it too); and a wait through `&self` never forgets it
    /// (`Pending::forget`), so its entry's number, which reads on it no longer bump, is not
    /// needed. Ids are never reused, and the tracked handle keeps the stream alive meanwhile.
    /// One stream at most, so a buffer read on many streams keeps at most one of them past
    /// shared waits (they are forgotten at the owner's next exclusive wait).
    settled: AtomicU64,
    /// How device work reached the memory through `order` since the host last waited for it.
    ordered: OrderedCell,
    order: Option<StreamOrder>,
    /// Host reads must not overlap any device work (see [`HostAccess::with_exclusive_order`]).
    exclusive: bool,
}

impl HostAccess {
    /// Locks the pending work, or answers `NotPermitted` inside a [`StreamOrder::queue_on`]
    /// closure: a copy may hold this lock while it waits for that closure's order.
    ///
    /// Streams that stream orders let go of while it is held (a copy orders the device side under
    /// it) are destroyed once it is let go of (see [`AroundOrders`]).
    fn lock_pending(&self) -> Result<PendingGuard<'_>> {
        if queuing_on_this_thread() {
            return Err(used_inside_queue_on());
        }
        Ok(PendingGuard { _around: AroundOrders::enter(), guard: self.pending.lock() })
    }

    /// A tracker that remembers the streams of queued operations.
    pub fn new() -> Self {
        HostAccess::default()
    }

    /// A tracker that orders all device work through a [`StreamOrder`] first used on `stream`, for
    /// memory that is also used through device views.
    pub fn with_order(stream: &Stream) -> Self {
        HostAccess {
            pending: Mutex::default(),
            settled: AtomicU64::new(0),
            ordered: OrderedCell::default(),
            order: Some(StreamOrder::new(stream)),
            exclusive: false,
        }
    }

    /// Like [`HostAccess::with_order`], for memory that the host must not read while any device
    /// work uses it (managed memory on a device without concurrent managed access): shared host
    /// access ([`HostAccess::wait_writes`]) waits for all device work and then refuses new device
    /// work until [`HostAccess::end_host_reads`].
    pub fn with_exclusive_order(stream: &Stream) -> Self {
        HostAccess { exclusive: true, ..HostAccess::with_order(stream) }
    }

    /// Whether host reads exclude device work (made with [`HostAccess::with_exclusive_order`]).
    pub fn is_exclusive(&self) -> bool {
        self.exclusive
    }

    /// Lets device work through the order again after [`HostAccess::wait_writes`] refused it: the
    /// caller has exclusive access to the owner, so no shared host borrow handed out before is
    /// alive. A no-op for other trackers.
    pub fn end_host_reads(&mut self) {
        if let Some(order) = &mut self.order {
            order.end_open_exclusion();
        }
    }

    /// Runs `read`, a host read that ends when it returns, after the device work that writes the
    /// memory (all device work, for an exclusive tracker, which also refuses new device work until
    /// `read` returns or unwinds, and answers `NotSupported { feature: ConcurrentManagedAccess }`
    /// without running `read` while device work is being queued, as [`HostAccess::wait_writes`]).
    pub fn read_scoped<R>(&self, read: impl FnOnce() -> R) -> Result<R> {
        match &self.order {
            Some(order) if self.exclusive => {
                // Held until `read` returns or unwinds; never created if the exclusion was refused.
                let _scope = order.exclude_device(false)?;
                Ok(read())
            }
            _ => {
                self.wait_writes()?;
                Ok(read())
            }
        }
    }

    /// The stream order, when the tracker has one, for what does not queue device work on the
    /// memory: waiting for it ([`StreamOrder::synchronize`], [`StreamOrder::join`]), asking about
    /// it ([`StreamOrder::last`], [`StreamOrder::users`]).
    ///
    /// Device work on the memory goes through [`HostAccess::view_order`] (or the hooks,
    /// [`HostAccess::device_read`] and [`HostAccess::device_write`]), never through this order's
    /// tickets or `queue_on`: this accessor does not tell the tracker, so host access does not
    /// know to wait for that work. [`HostAccess::wait_writes`] of a tracker that is not exclusive
    /// synchronises the order only after an exclusive view (a write) was handed out, so a write
    /// queued through this order is not
    /// waited for before a shared host borrow, and [`HostAccess::wait_idle`] skips the order
    /// while no view was handed out since the owner last waited with exclusive access
    /// ([`HostAccess::wait_idle_mut`]).
    ///
    /// It does not raise the tracker's state itself because it cannot know what the caller
    /// queues: raising to "read" would still miss writes, and raising to "write" through `&self`
    /// could be undone by a host wait on another thread lowering it after its synchronisation
    /// (only an exclusive view, with `&mut` access to the owner, may raise it to "write").
    pub fn order(&self) -> Option<&StreamOrder> {
        self.order.as_ref()
    }

    /// The stream order, for the owner (`&mut`: no view, ticket or host borrow is alive), which
    /// may change what the order admits ([`StreamOrder::admit_only`]). `None` for event-tracked
    /// memory.
    pub fn order_mut(&mut self) -> Option<&mut StreamOrder> {
        self.order.as_mut()
    }

    /// Records that a device view of the memory is being handed out (`write` for an exclusive one),
    /// and returns the order the view must use. `None` for event-tracked memory, which has no views.
    ///
    /// The view's work is queued after this call; host access later synchronises every stream the
    /// order names (its users and the streams of guards not dropped), which covers it. Never
    /// waits (no lock: it may be called inside a [`StreamOrder::queue_on`] closure). Hand out an
    /// exclusive view (`write`) only with exclusive access to the owner, when no host access can
    /// run meanwhile.
    pub fn view_order(&self, write: bool) -> Option<&StreamOrder> {
        let order = self.order.as_ref()?;
        self.ordered.raise(if write { OrderedUse::Write } else { OrderedUse::Read });
        Some(order)
    }

    /// Whether no device work is known to be pending (without asking the driver). The first stream
    /// that read the memory since its last device write stays tracked past [`wait_idle`](Self::wait_idle)
    /// (its later reads are tracked without the lock, so a shared wait cannot tell whether one was
    /// queued after it looked), so after reads this is `true` only once the owner waited with
    /// exclusive access ([`wait_idle_mut`](Self::wait_idle_mut), a `&mut [T]` borrow). Never waits:
    /// while another thread holds the tracker (tracking work, or taking a wait's snapshot), the
    /// answer is `false`, as nothing is known to be idle then; so it may be asked inside a
    /// [`StreamOrder::queue_on`] closure.
    pub fn is_idle(&self) -> bool {
        let Some(pending) = self.pending.try_lock() else {
            return false;
        };
        pending.reads.is_empty() && pending.write.is_none() && self.ordered.get() == OrderedUse::None
    }

    fn sync_order(&self) -> Result<()> {
        match &self.order {
            Some(order) => order.synchronize(),
            None => Ok(()),
        }
    }

    /// Blocks until no pending device work writes the memory: call it before handing out a shared
    /// host borrow. For an exclusive tracker, blocks until no device work uses the memory at all,
    /// and refuses device work through the order from then on, until [`HostAccess::end_host_reads`].
    ///
    /// An exclusive tracker answers `NotSupported { feature: ConcurrentManagedAccess }` instead of
    /// waiting while device work is being queued through the order (an [`OrderTicket`] is held,
    /// perhaps by the calling thread): waiting for it could wait forever.
    ///
    /// The tracker is not locked while it waits: copies from the memory on other threads go on.
    ///
    /// [`OrderTicket`]: crate::OrderTicket
    pub fn wait_writes(&self) -> Result<()> {
        if let Some(order) = &self.order
            && self.exclusive
        {
            // Refuse first, then wait (without holding `pending`, which views need): work that
            // slipped in between would otherwise run under the host's borrow.
            order.exclude_device(true)?;
            let _pending = self.lock_pending()?;
            self.ordered.lower(OrderedUse::Read);
            return Ok(());
        }
        self.wait_unlocked(false)?;
        if self.ordered.get() == OrderedUse::Write {
            self.sync_order()?;
            // Every write queued so far is done. Shared views may still be alive and queue reads
            // through the order without telling this tracker, so only an exclusive wait may
            // forget about device reads.
            self.ordered.lower(OrderedUse::Read);
        }
        Ok(())
    }

    /// Blocks until no device work uses the memory. The tracker is not locked while it waits.
    /// It forgets the streams it saw complete, except the one whose reads are tracked without
    /// the lock (see [`is_idle`](Self::is_idle)), which it waits for all the same.
    pub fn wait_idle(&self) -> Result<()> {
        self.wait_unlocked(true)?;
        if self.ordered.get() != OrderedUse::None {
            self.sync_order()?;
            // As in `wait_writes`: a live shared view may still queue reads.
            self.ordered.lower(OrderedUse::Read);
        }
        Ok(())
    }

    /// Waits for the tracked write stream (and the read streams, with `reads`) with the tracker
    /// unlocked, then forgets what it saw complete. A failed wait leaves what it did not see
    /// complete tracked.
    ///
    /// What may happen while it waits, through `&self` only (a device write, which replaces
    /// `write` and clears `reads`, takes `&mut self`, so it cannot; neither can `wait_idle_mut`):
    /// - a device read on the settled stream (`HostAccess::settled`), without the lock: that
    ///   stream is never forgotten here;
    /// - a device read on a stream not tracked yet: it is added to `reads`, which the snapshot
    ///   does not hold, so it stays tracked;
    /// - a device read on a read stream of the snapshot: its work may be queued after the wait
    ///   began and not be covered by it; it renumbers the stream's entry, so `forget` keeps it;
    /// - a device read on the write stream: it is tracked in `reads` too, and forgetting `write`
    ///   leaves it there;
    /// - another wait: both wait, and whichever forgets first removes the entries (the other finds
    ///   them gone or renumbered, and removes nothing it did not see complete).
    fn wait_unlocked(&self, reads: bool) -> Result<()> {
        let (write, reads) = {
            let pending = self.lock_pending()?;
            let reads = if reads { pending.reads.clone() } else { Vec::new() };
            (pending.write.clone(), reads)
        };
        // As in `wait_all`, every stream is waited for even after a failure; those seen complete
        // are forgotten, and the first error is returned.
        let mut first = None;
        let mut waited_write = false;
        if let Some(write) = &write {
            match write.synchronize() {
                Ok(()) => waited_write = true,
                Err(e) => first = Some(e),
            }
        }
        let mut done = Vec::with_capacity(reads.len());
        let mut failed = Vec::new();
        for (read, number) in reads.into_iter().rev() {
            match read.synchronize() {
                Ok(()) => done.push((read, number)),
                Err(e) => {
                    first.get_or_insert(e);
                    failed.push(read);
                }
            }
        }
        if waited_write || !done.is_empty() {
            let mut pending = self.lock_pending()?;
            let settled = self.settled.load(Ordering::Relaxed);
            let gone = pending.forget(write.as_ref().filter(|_| waited_write), &done, settled);
            // After the lock is released (see `Pending::forget`).
            drop(pending);
            drop(gone);
        }
        // The snapshot's handles: once the tracker forgot a stream (here or in another wait), one of
        // these may be its last, destroyed as the tracker's own (with cumem locks refused).
        write.into_iter().for_each(let_go);
        done.into_iter().for_each(|(read, _)| let_go(read));
        failed.into_iter().for_each(let_go);
        first.map_or(Ok(()), Err)
    }

    /// [`wait_idle`](Self::wait_idle) for an owner with exclusive access (its drop, a `&mut [T]`
    /// host borrow): no view or shared host borrow can be alive, so once the device is done the
    /// tracker forgets every use and ends a refusal of device work begun by host reads.
    ///
    /// Takes no lock: `&mut self` proves that no other thread holds or can take the tracker's lock,
    /// and the stream order is synchronised with
    /// [`StreamOrder::synchronize_mut`]. So unlike `wait_idle` it is not refused inside a
    /// [`StreamOrder::queue_on`] closure, and with nothing pending it returns at once. With work
    /// pending it synchronises the streams of that work, there too while the closure's order stays
    /// locked: that ends unless the work waited for itself waits on the host for something the
    /// calling thread holds (a host function that uses the locked memory), the caveat of waiting
    /// for whole streams in the module docs.
    ///
    /// A failed wait for one tracked stream does not stop the others: every tracked stream is
    /// waited for (and the order, whose own synchronisation stops at its first failing stream),
    /// those seen complete are forgotten, and the first error is returned.
    pub fn wait_idle_mut(&mut self) -> Result<()> {
        // Exclusive access: no read is being tracked without the lock; the streams may be
        // forgotten below.
        *self.settled.get_mut() = 0;
        let streams = self.pending.get_mut().wait_all();
        let mut order_result = Ok(());
        if let Some(order) = &mut self.order
            && self.ordered.get() != OrderedUse::None
        {
            order_result = order.synchronize_mut();
        }
        streams?;
        order_result?;
        self.ordered.set(OrderedUse::None);
        self.end_host_reads();
        Ok(())
    }

    /// The fallback of an owner with exclusive access whose [`wait_idle_mut`](Self::wait_idle_mut)
    /// failed and that cannot leak the memory (it hands it back to its owner): synchronises the
    /// context of every stream still tracked, and `also` (`cuCtxSynchronize` waits for all of a
    /// context's work, that of destroyed streams included), going on past a failure. Once every
    /// one succeeded, no tracked work is pending and the tracker forgets it; the first error is
    /// returned otherwise. A tracker that orders its work through a [`StreamOrder`] that has been
    /// used synchronises the order's streams too (stopping at the first that fails).
    pub(crate) fn synchronize_contexts(&self, also: &Context) -> Result<()> {
        // Exclusive access: nobody else holds the lock. `try_lock`, not `lock`, so that a wrong
        // caller gets an error rather than a deadlock; let go before the waits, which may wait
        // without bound (a host function queued in one of the contexts).
        let mut contexts = self.pending.try_lock().ok_or_else(used_inside_queue_on)?.contexts();
        if !contexts.contains(also) {
            contexts.push(also.clone());
        }
        let mut first = None;
        for ctx in &contexts {
            if let Err(e) = ctx.synchronize() {
                first.get_or_insert(e);
            }
        }
        if let Some(order) = &self.order
            && self.ordered.get() != OrderedUse::None
            && let Err(e) = order.synchronize()
        {
            first.get_or_insert(e);
        }
        if let Some(e) = first {
            return Err(e);
        }
        let mut pending = self.pending.try_lock().ok_or_else(used_inside_queue_on)?;
        // Exclusive access (see above): no read is being tracked without the lock.
        self.settled.store(0, Ordering::Relaxed);
        let gone = Gone(pending.write.take(), std::mem::take(&mut pending.reads));
        drop(pending);
        // Dropped after the lock is released (see `Pending::forget`).
        drop(gone);
        Ok(())
    }

    /// Queues device work that reads the memory on `stream`, ordered after pending device writes,
    /// and tracks it so that later host writes (and the free) wait for it.
    ///
    /// The tracker stays locked from the ordering through `enqueue` (a host wait's snapshot of the
    /// tracked streams, and the lowering of the views' state, must not fall between the tracking
    /// and the work), except on the one stream that first read the memory since its last write
    /// (tracked already and kept tracked until the owner waits with exclusive access), whose
    /// reads take no lock. Streams that stream orders let go of meanwhile, and their marker events, are
    /// destroyed only after the tracker is unlocked. Every other driver call in between is made
    /// with it locked: the ordering's `cuEventCreate` (a marker's first use) and `cuEventRecord`
    /// of the streams waited for, and whatever `enqueue` calls (a copy's profiler events, the
    /// `cuMemcpy*Async` itself). Each of those waits behind another thread's `cuMemFree` that
    /// waits for a stream held by a host function (driver brief §17, docs/observed-on-gpu.md), and
    /// holds up host access to this memory on other threads meanwhile. So a host function must not
    /// take host access to this memory while another thread may be queueing device work reading it
    /// and any thread may free memory in the context: the free waits for the host function, the
    /// enqueue for the free, and the host function for the tracker.
    ///
    /// # Safety
    /// 1. `ptr` points to `len` values that stay valid until the tracker is idle again.
    /// 2. `enqueue` queues work on `stream` only, and that work only reads, at most `len` values
    ///    from the pointer it is given.
    /// 3. Nothing on the host writes the values (through a Rust reference or otherwise) until
    ///    the tracker has waited for the reads ([`HostAccess::wait_idle`] or
    ///    [`HostAccess::wait_idle_mut`]): the reads may still be running.
    pub unsafe fn device_read<T, R>(
        &self,
        stream: &Stream,
        ptr: *const T,
        len: usize,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // The settled reader (see `HostAccess::settled`): tracked already, ordered after the last
        // write (a write would have cleared it), and kept tracked until an owner with exclusive
        // access waits, so a read on it is queued without the lock. The Acquire pairs with the
        // store below: the setter's wait for the last write was queued on the stream first.
        let settled = self.settled.load(Ordering::Acquire);
        if settled != 0 && settled == stream.id() {
            // As with the lock: the rule is one rule (no cumem memory used inside a closure).
            if queuing_on_this_thread() {
                return Err(used_inside_queue_on());
            }
            return enqueue(ptr, len);
        }
        let mut pending = self.lock_pending()?;
        // Tracked before `enqueue` runs: it may queue work and then fail or unwind, and host
        // access must still wait for that work (waiting for a stream with nothing queued costs
        // only the wait).
        if let Some(order) = &self.order {
            let _ticket = order.use_on(stream)?;
            self.ordered.raise(OrderedUse::Read);
            return enqueue(ptr, len);
        }
        if let Some(write) = &pending.write {
            stream.wait_for(write)?;
        }
        pending.reads_queued += 1;
        let number = pending.reads_queued;
        match pending.reads.iter_mut().find(|(s, _)| s == stream) {
            Some(entry) => entry.1 = number,
            None => pending.reads.push((stream.clone(), number)),
        }
        // `stream` is tracked and ordered after the last write: it may read without the lock
        // from now on, if no other stream does (the legacy stream, id 0, never does).
        if self.settled.load(Ordering::Relaxed) == 0 {
            self.settled.store(stream.id(), Ordering::Release);
        }
        enqueue(ptr, len)
    }

    /// Queues device work that writes the memory on `stream`, ordered after all pending device
    /// reads and writes, and tracks it so that every later host access (and the free) waits for it.
    ///
    /// # Safety
    /// 1. `ptr` points to `len` values that stay valid until the tracker is idle again, and no
    ///    Rust reference to them is used until then (owners take `&mut self` to call this).
    /// 2. `enqueue` queues work on `stream` only, writing at most `len` values through the pointer
    ///    it is given, and only bytes that are valid values of `T`.
    pub unsafe fn device_write<T, R>(
        &mut self,
        stream: &Stream,
        ptr: *mut T,
        len: usize,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // `&mut self`: no shared host borrow is alive (safety contract 1), so device work may run.
        self.end_host_reads();
        // Nor is a read being tracked without the lock; the next read settles after this write.
        *self.settled.get_mut() = 0;
        let pending = self.pending.get_mut();
        // Tracked before `enqueue` runs, as in `device_read`.
        if let Some(order) = &self.order {
            let _ticket = order.use_on(stream)?;
            self.ordered.set(OrderedUse::Write);
            return enqueue(ptr, len);
        }
        // Wait for everything before forgetting anything: a failed wait leaves the streams tracked.
        if let Some(write) = &pending.write {
            stream.wait_for(write)?;
        }
        for (read, _) in &pending.reads {
            stream.wait_for(read)?;
        }
        // `stream` is ordered after every earlier read and write (the waits above), so it alone
        // stands for all of them, and for whatever `enqueue` queues, however it ends.
        pending.reads.drain(..).for_each(|(stream, _)| let_go(stream));
        if pending.write.as_ref() != Some(stream) {
            pending.write.replace(stream.clone()).into_iter().for_each(let_go);
        }
        enqueue(ptr, len)
    }
}

/// Page-locked host memory that asynchronous copies may read and write: the hooks through which
/// copy code registers its device work, so that host access waits for it.
///
/// Implemented by [`PinnedBuffer`](crate::PinnedBuffer), [`MappedBuffer`](crate::MappedBuffer) and
/// [`HostRegistered`](crate::HostRegistered).
///
/// # Safety
/// Implementors promise that
/// 1. the pointer given to `enqueue` is page-locked host memory (allocated or registered with the
///    driver) holding `len()` initialised values of `T`, valid until the work completes;
/// 2. no host access through the implementor (and no free or unregistration) happens before device
///    work queued by `device_write` has completed, and no host write before work queued by
///    `device_read` has completed;
/// 3. work queued by `device_write` is ordered after all earlier device work on the memory, and
///    work queued by `device_read` after all earlier device writes.
pub unsafe trait HostMemory<T> {
    /// Number of values.
    fn len(&self) -> usize;

    /// Whether there are no values.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues device work that reads the memory on `stream` (see [`HostAccess::device_read`]).
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, and that work only reads, at most `len` values
    ///    from the pointer it is given.
    unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R>;

    /// Queues device work that writes the memory on `stream` (see [`HostAccess::device_write`]).
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, writing at most `len` values through the pointer
    ///    it is given, and only bytes that are valid values of `T`.
    unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R>;
}
