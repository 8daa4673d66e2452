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
//! again and again on one stream makes no ordering call at all.
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

use parking_lot::Mutex;

use crate::{Error, Feature, Result, Stream};

/// The streams that may have work pending on a piece of device memory.
#[derive(Debug)]
pub struct StreamOrder {
    inner: Mutex<Users>,
    /// The ordinal of the memory's device (the device of the stream it was first used on), named
    /// by refusals.
    device: i32,
}

#[derive(Debug)]
struct Users {
    /// Each stream with work that no recorded user has been ordered after, with the generation of
    /// its latest recording (to tell whether a waited-for entry changed since).
    users: Vec<(Stream, u64)>,
    next_gen: u64,
    /// Tickets handed out and not yet dropped: work that may be being queued right now.
    in_flight: usize,
    /// The stream of each such ticket (one entry per ticket). Work queued through a ticket is
    /// covered by `users` only once the ticket is dropped; a ticket that never is (`mem::forget`)
    /// keeps its stream here, so that the free, `synchronize` and the host still wait for it.
    pending: Vec<Stream>,
    /// Why device work is refused for now: the host may be reading the memory, and its device
    /// cannot run work on it meanwhile (managed memory without concurrent managed access).
    excluded: Exclusion,
}

/// Host reads that device work must not overlap.
#[derive(Debug, Default, Clone, Copy)]
struct Exclusion {
    /// A shared host borrow was handed out whose end nobody is told of: lifted only by an owner
    /// that proves, with exclusive access, that no such borrow is alive.
    open_ended: bool,
    /// Host reads in progress inside a call (e.g. a copy to a `Vec`), each lifted when it returns.
    scoped: usize,
}

impl Exclusion {
    fn active(self) -> bool {
        self.open_ended || self.scoped > 0
    }
}

/// Proof that a stream was ordered after the memory's users; dropping it records the stream as a
/// user. Hold it until the work is queued.
#[must_use = "hold the ticket until the work is queued; dropping it early loses track of the work"]
#[derive(Debug)]
pub struct OrderTicket<'a> {
    order: &'a StreamOrder,
    /// Borrowed, not cloned: a ticket that is forgotten leaks nothing (its stream is kept, for the
    /// free and host access to wait for, in the order's `pending` list).
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
            inner: Mutex::new(Users {
                users: vec![(stream.clone(), 0)],
                next_gen: 1,
                in_flight: 0,
                pending: Vec::new(),
                excluded: Exclusion::default(),
            }),
        }
    }

    /// Device work and host reads that must not overlap (see [`StreamOrder::use_on`]): refused on
    /// the memory's device.
    fn refusal(&self) -> Error {
        Error::NotSupported { feature: Feature::ConcurrentManagedAccess, device: Some(self.device) }
    }

    /// Orders `stream` after all work queued so far on the memory by its recorded users. Queue the
    /// work on `stream` while holding the returned ticket.
    ///
    /// While the host may be reading memory whose device cannot run work on it at the same time
    /// (see [`HostAccess::with_exclusive_order`](crate::HostAccess::with_exclusive_order)), device
    /// work is refused: `NotSupported { feature: ConcurrentManagedAccess, device }` naming the
    /// memory's device, before anything waits.
    ///
    /// Conversely, such host reads are refused with the same error while a ticket is held (work
    /// may be being queued): queue the work and drop the ticket before reading on the host. A
    /// ticket that is never dropped (`mem::forget`) keeps refusing them.
    pub fn use_on<'s>(&'s self, stream: &'s Stream) -> Result<OrderTicket<'s>> {
        // Waiting under the lock keeps the set from changing between the waits and the snapshot
        // of what was waited for.
        let mut inner = self.inner.lock();
        if inner.excluded.active() {
            return Err(self.refusal());
        }
        for (user, _) in &inner.users {
            stream.wait_for(user)?;
        }
        inner.in_flight += 1;
        inner.pending.push(stream.clone());
        Ok(OrderTicket { order: self, stream, waited_before: inner.next_gen })
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
            let mut inner = self.inner.lock();
            if inner.in_flight > 0 {
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

    /// Ends the open-ended exclusion: the owner has exclusive access, so no host borrow that
    /// began it is alive any more.
    pub(crate) fn end_open_exclusion(&mut self) {
        self.inner.get_mut().excluded.open_ended = false;
    }

    /// One stream ordered after every recorded user: the latest user, made to wait for the others.
    /// Afterwards it is the only recorded user. Call with no use in flight (e.g. when freeing); the
    /// stream of a ticket that was forgotten instead of dropped is waited for too (its work was
    /// queued before now, as the ticket's borrow has ended), and stays pending.
    pub fn join(&self) -> Result<Stream> {
        let mut inner = self.inner.lock();
        let latest = inner.users.iter().max_by_key(|(_, g)| *g).map(|(s, _)| s.clone()).expect("never empty");
        for user in inner.users.iter().map(|(s, _)| s).chain(&inner.pending) {
            latest.wait_for(user)?;
        }
        let generation = inner.next_gen;
        inner.next_gen += 1;
        inner.users = vec![(latest.clone(), generation)];
        Ok(latest)
    }

    /// Blocks until all work of every recorded user (and of every ticket not dropped) has
    /// completed.
    pub fn synchronize(&self) -> Result<()> {
        let users: Vec<Stream> = {
            let inner = self.inner.lock();
            inner.users.iter().map(|(s, _)| s).chain(&inner.pending).cloned().collect()
        };
        for user in &users {
            user.synchronize()?;
        }
        Ok(())
    }

    /// The most recently recorded user.
    pub fn last(&self) -> Stream {
        let inner = self.inner.lock();
        inner.users.iter().max_by_key(|(_, g)| *g).map(|(s, _)| s.clone()).expect("never empty")
    }

    /// How many streams may still have work on the memory.
    pub fn users(&self) -> usize {
        self.inner.lock().users.len()
    }
}

/// One scoped exclusion begun by [`StreamOrder::exclude_device`]; dropping it ends it.
#[derive(Debug)]
pub(crate) struct ScopedExclusion<'a> {
    order: &'a StreamOrder,
}

impl Drop for ScopedExclusion<'_> {
    fn drop(&mut self) {
        let mut inner = self.order.inner.lock();
        inner.excluded.scoped = inner.excluded.scoped.saturating_sub(1);
    }
}

impl Drop for OrderTicket<'_> {
    fn drop(&mut self) {
        let mut inner = self.order.inner.lock();
        inner.in_flight -= 1;
        if let Some(i) = inner.pending.iter().position(|s| s == self.stream) {
            inner.pending.swap_remove(i);
        }
        let generation = inner.next_gen;
        inner.next_gen += 1;
        // Entries this stream was ordered after, and that nobody recorded again since, are covered
        // by this stream from now on.
        let (stream, waited_before) = (self.stream, self.waited_before);
        // The common case, one stream using the memory again: only its generation changes.
        if let [(only, g)] = inner.users.as_mut_slice()
            && only == stream
        {
            *g = generation;
            return;
        }
        inner.users.retain(|(s, g)| s != stream && *g >= waited_before);
        inner.users.push((stream.clone(), generation));
    }
}
