//! Streams: ordered queues of device work.
//!
//! A [`Stream`] is a cheap, clonable handle; the driver stream is destroyed when the last clone is
//! dropped (the driver lets pending work finish first), or, if a cache is in the middle of a call
//! on it through its [`StreamTail`] then, when that call returns. [`Stream::legacy`] names the context's
//! legacy default stream, which implicitly synchronises with every blocking stream.
//!
//! Every stream has a [`StreamTail`], a small shared object that outlives it: a cache that must
//! order later work after a stream's work (the caching pool) keeps the tail, not the stream, so it
//! never keeps a stream alive. While the stream lives, the tail records events on it on demand;
//! when a stream whose tail is shared is dropped, an event recorded just before `cuStreamDestroy`
//! (the *retired* event) stands for all its work.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream, StreamOptions};
//! let ctx = Device::get(0)?.context()?;
//! let (least, greatest) = ctx.stream_priority_range()?;
//! let urgent = Stream::with_options(&ctx, StreamOptions { non_blocking: true, priority: greatest })?;
//! let background = Stream::new(&ctx)?;
//! let done = background.record()?; // an event after everything queued on `background`
//! urgent.wait(&done)?;             // later work on `urgent` runs after it
//! urgent.synchronize()?;
//! assert!(urgent.query()? && least >= greatest);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;

use cumem_sys::sys::{CUstream, CUstream_flags};
use parking_lot::Mutex;

use crate::marker::Marker;
use crate::{Context, Error, Event, Result, ffi};

/// Options for [`Stream::with_options`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamOptions {
    /// Do not synchronise with the legacy default stream.
    pub non_blocking: bool,
    /// Priority; 0 is the least, more negative is greater. Out-of-range values are clamped by the driver.
    pub priority: i32,
}

/// A stream of a context.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Context,
    raw: RawStream,
    /// Destroys the driver stream when the last holder lets go: this handle, or a tail user
    /// in the middle of a driver call on the stream (see [`StreamTail`]).
    handle: Arc<OwnedStream>,
    options: StreamOptions,
    /// See [`Stream::id`].
    id: u64,
    /// What other streams wait on (see `marker`).
    marker: Marker,
    /// See [`Stream::tail`].
    tail: Arc<StreamTail>,
}

/// What outlives a [`Stream`]: its id, its handle while it lives, and once a stream whose tail
/// was shared is dropped, an event standing for all its work.
///
/// ```
/// # cumem_sys::testing::init();
/// use cumem_core::{Device, Stream};
/// let ctx = Device::get(0)?.context()?;
/// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
/// let tail = a.tail().clone();
/// let ticket = tail.after_work()?.expect("a live stream records an event");
/// b.wait(&ticket)?; // later work on b runs after a's work so far
/// drop(a);
/// assert!(!tail.is_alive());
/// tail.synchronize()?; // waits for the retired event: everything `a` ever queued
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub struct StreamTail {
    ctx: Context,
    id: u64,
    legacy: bool,
    state: Mutex<TailState>,
}

struct TailState {
    /// The stream's handle while it lives. A tail user clones it under the lock and makes its
    /// driver call with the lock released: the clone keeps the driver stream from being destroyed
    /// meanwhile (the last holder destroys it), and nobody waits for the lock while the driver
    /// holds a call back (`cuEventRecord` waits behind another thread's `cuMemFree`, §17 of the
    /// driver brief).
    raw: Option<Arc<OwnedStream>>,
    /// Recorded by the stream's drop just before `cuStreamDestroy`; `None` while the stream lives,
    /// and after a drop that could not record it (it synchronised the stream instead).
    retired: Option<Arc<Event>>,
    /// Set by a drop that could neither record `retired` nor synchronise the stream: the error of
    /// that synchronisation. Nothing then tells when the stream's work ends, so `after_work`
    /// answers it rather than "nothing pending", until `synchronize` has synchronised the context
    /// (which covers the work) and cleared it.
    poisoned: Option<Error>,
}

impl StreamTail {
    /// The [`Stream::id`] of the stream.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The context of the stream.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Whether the stream is still alive (the legacy stream always is).
    pub fn is_alive(&self) -> bool {
        self.state.lock().raw.is_some()
    }

    /// Whether this is the tail of a legacy stream handle (whose driver stream never dies).
    pub fn is_legacy(&self) -> bool {
        self.legacy
    }

    /// An event after all the stream's work so far: recorded now while the stream lives, its
    /// retired event once it is dropped; `None` when nothing of it can still be pending (it was
    /// synchronised at its end).
    ///
    /// When the stream's drop could neither record the retired event nor synchronise the stream,
    /// its work may still be running and nothing can stand for it: the answer is then the error
    /// that synchronisation failed with (as the driver reported it, e.g. a sticky
    /// `IllegalAddress`, whose context is unusable anyway), until a
    /// [`StreamTail::synchronize`] waits the work out.
    pub fn after_work(&self) -> Result<Option<Arc<Event>>> {
        let handle = {
            let st = self.state.lock();
            if let Some(e) = &st.poisoned {
                return Err(e.clone());
            }
            match &st.raw {
                Some(handle) => handle.clone(),
                None => return Ok(st.retired.clone()),
            }
        };
        // Unlocked: `handle` keeps the driver stream alive until the record is queued. An event
        // recorded after the stream's drop published its retired event stands for the same work
        // (nothing can be queued on a dropped stream). When `handle` is the stream's last holder,
        // the stream is destroyed as it goes, here, with no lock held.
        let event = Event::new(&self.ctx)?;
        ffi::event_record(event.raw(), handle.raw.0)?;
        Ok(Some(Arc::new(event)))
    }

    /// The retired event (`None` while the stream lives, or when its drop synchronised it
    /// instead, or could do neither: [`StreamTail::after_work`] tells these apart).
    pub fn retired(&self) -> Option<Arc<Event>> {
        self.state.lock().retired.clone()
    }

    /// Makes the stream's work queued from now on wait for `event`; nothing when the stream is
    /// gone (no new work can be queued on it).
    pub fn wait(&self, event: &Event) -> Result<()> {
        // The handle is cloned under the lock and used without it (see `TailState::raw`).
        let handle = self.state.lock().raw.clone();
        if let Some(handle) = handle {
            self.ctx.bind()?;
            ffi::stream_wait_event(handle.raw.0, event.raw())?;
        }
        Ok(())
    }

    /// Blocks until all the stream's work queued so far (if dropped: ever) has completed.
    ///
    /// When the stream's drop could neither record its retired event nor synchronise it, this
    /// synchronises the whole context instead (`cuCtxSynchronize`, which waits for the work of
    /// destroyed streams too): once that succeeds, nothing of the stream is pending any more, and
    /// [`StreamTail::after_work`] answers `None` from then on. Its error is returned otherwise.
    pub fn synchronize(&self) -> Result<()> {
        // The waits happen with the tail unlocked: an event recorded after the work stands for
        // it, and the stream's drop, `is_alive` and `after_work` on other threads need not wait
        // for the stream's work to finish.
        let unknown = self.state.lock().poisoned.is_some();
        if unknown {
            self.ctx.synchronize()?;
            self.state.lock().poisoned = None;
            return Ok(());
        }
        match self.after_work()? {
            Some(event) => event.synchronize(),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for StreamTail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamTail").field("id", &self.id).field("alive", &self.is_alive()).finish()
    }
}

/// The next [`Stream::id`] of a created stream (0 is the legacy streams').
static NEXT_STREAM_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[derive(Clone, Copy, PartialEq, Eq)]
struct RawStream(CUstream);

/// A driver stream and whether cumem created it: one that was is destroyed when the last
/// holder of this lets go (the legacy stream never is).
struct OwnedStream {
    ctx: Context,
    raw: RawStream,
    owned: bool,
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: this stream was created by `stream_create`, and this is its last holder:
            // every `Stream` handle and every tail user's clone of it are gone.
            unsafe { ffi::stream_destroy(self.raw.0) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "destroying a stream failed");
        }
    }
}

// SAFETY: a CUstream is an opaque handle usable from any thread; cumem never dereferences it.
unsafe impl Send for RawStream {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawStream {}

impl Stream {
    /// A new blocking stream (ordered with the legacy default stream).
    pub fn new(ctx: &Context) -> Result<Stream> {
        Stream::with_options(ctx, StreamOptions::default())
    }

    /// A new stream that does not synchronise with the legacy default stream.
    pub fn non_blocking(ctx: &Context) -> Result<Stream> {
        Stream::with_options(ctx, StreamOptions { non_blocking: true, priority: 0 })
    }

    /// A new stream with explicit flags and priority.
    pub fn with_options(ctx: &Context, options: StreamOptions) -> Result<Stream> {
        ctx.bind()?;
        let flags = if options.non_blocking { CUstream_flags::CU_STREAM_NON_BLOCKING as u32 } else { 0 };
        let raw = ffi::stream_create(flags, options.priority)?;
        let id = NEXT_STREAM_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let handle = Arc::new(OwnedStream { ctx: ctx.clone(), raw: RawStream(raw), owned: true });
        let tail = Stream::new_tail(ctx, &handle, id, false);
        Ok(Stream {
            inner: Arc::new(Inner {
                ctx: ctx.clone(),
                raw: RawStream(raw),
                handle,
                options,
                id,
                marker: Marker::default(),
                tail,
            }),
        })
    }

    /// The legacy default stream of `ctx` (the NULL stream).
    pub fn legacy(ctx: &Context) -> Stream {
        let raw = RawStream(std::ptr::null_mut());
        let handle = Arc::new(OwnedStream { ctx: ctx.clone(), raw, owned: false });
        Stream {
            inner: Arc::new(Inner {
                ctx: ctx.clone(),
                raw,
                tail: Stream::new_tail(ctx, &handle, 0, true),
                handle,
                options: StreamOptions::default(),
                id: 0,
                marker: Marker::default(),
            }),
        }
    }

    fn new_tail(ctx: &Context, handle: &Arc<OwnedStream>, id: u64, legacy: bool) -> Arc<StreamTail> {
        Arc::new(StreamTail {
            ctx: ctx.clone(),
            id,
            legacy,
            state: Mutex::new(TailState { raw: Some(handle.clone()), retired: None, poisoned: None }),
        })
    }

    /// The stream's [`StreamTail`], which outlives it.
    pub fn tail(&self) -> &Arc<StreamTail> {
        &self.inner.tail
    }

    /// The context this stream belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The driver's handle (NULL for the legacy stream).
    pub fn raw(&self) -> CUstream {
        self.inner.raw.0
    }

    /// Whether this is the legacy default stream.
    pub fn is_legacy(&self) -> bool {
        self.raw().is_null()
    }

    /// A number naming this stream for the life of the process: distinct for every stream
    /// created, 0 for the legacy stream (which its context names). Unlike the driver's handle,
    /// which a real driver gives the next stream created as soon as this one is destroyed, it is
    /// never reused, so a cache keyed by it cannot mistake a new stream for an old one.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Whether this handle is the only clone of its stream (the legacy stream: of this handle).
    ///
    /// A snapshot, but a stable one in one direction: once `true`, only the holder of this handle
    /// can make it `false` again (by cloning it), so an owner that never gives out clones (a cache
    /// of streams) learns that nobody else can queue new work through this handle. Another handle
    /// naming the same driver stream (the legacy stream of the same context, from
    /// [`Stream::legacy`]) is not counted: check [`is_legacy`](Self::is_legacy) too.
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
    }

    /// The options the stream was created with.
    pub fn options(&self) -> StreamOptions {
        self.inner.options
    }

    /// Blocks until all work queued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.ctx.bind()?;
        ffi::stream_synchronize(self.raw())
    }

    /// `true` when all work queued so far has completed.
    pub fn query(&self) -> Result<bool> {
        self.inner.ctx.bind()?;
        ffi::stream_query(self.raw())
    }

    /// Makes all work queued on this stream from now on wait for `event`'s captured work.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.inner.ctx.bind()?;
        ffi::stream_wait_event(self.raw(), event.raw())
    }

    /// Records a new (untimed) event after everything queued so far.
    pub fn record(&self) -> Result<Event> {
        let mut event = Event::new(&self.inner.ctx)?;
        event.record(self)?;
        Ok(event)
    }

    /// Orders all future work on `self` after all work queued so far on `other`, through
    /// `other`'s own marker event (created on first use, recorded again each time; no event is
    /// created or destroyed per call). Nothing happens when both name the same stream.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        if self == other {
            return Ok(());
        }
        // `other`'s own marker: once the wait is queued it may be recorded again.
        other.inner.ctx.bind()?;
        other.inner.marker.with_recorded(other.raw(), |event| {
            if self.inner.ctx != other.inner.ctx {
                self.inner.ctx.bind()?;
            }
            ffi::stream_wait_event(self.raw(), event)
        })
    }
}

impl Stream {
    /// Lets go of this handle; when it was the stream's last, hands the stream back instead of
    /// destroying it here, so that a caller holding a lock can destroy it after releasing the lock
    /// (the destruction calls the driver and may log, and a subscriber may take that lock).
    pub(crate) fn release(self) -> Option<LastStream> {
        Arc::into_inner(self.inner).map(LastStream)
    }
}

/// A stream whose last handle was let go of ([`Stream::release`]): destroyed when dropped.
pub(crate) struct LastStream(#[allow(dead_code)] Inner);

impl fmt::Debug for LastStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LastStream").field("id", &self.0.id).finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.raw == other.inner.raw && self.inner.ctx == other.inner.ctx)
    }
}

impl Eq for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.inner.ctx.device().ordinal())
            .field("raw", &self.raw())
            .field("options", &self.inner.options)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.marker.destroy(&self.ctx);
        if !self.handle.owned {
            return;
        }
        // Someone (a cache) keeps the tail: leave it an event standing for all the stream's work.
        // Nobody can clone the tail any more (that needs the stream), so a count of 1 stays 1.
        if Arc::strong_count(&self.tail) > 1 {
            // Recorded (or the stream synchronised) before the tail is locked: the driver may hold
            // `cuEventRecord` back (behind another thread's `cuMemFree`, §17 of the driver brief)
            // and the fallback waits for all the stream's work, and neither should keep other
            // threads out of the tail meanwhile. The driver stream lives on while `self.handle`
            // or a tail user's clone of it does (see `TailState::raw`).
            let recorded =
                Event::new(&self.ctx).and_then(|e| ffi::event_record(e.raw(), self.raw.0).map(|()| e));
            let (retired, failures) = match recorded {
                Ok(event) => (Some(Arc::new(event)), None),
                Err(record) => {
                    // Without the event, waiters would have nothing to wait on: finish the work now.
                    let sync = self.ctx.bind().and_then(|()| ffi::stream_synchronize(self.raw.0));
                    (None, Some((record, sync.err())))
                }
            };
            let published = {
                let mut st = self.tail.state.lock();
                st.retired = retired;
                st.poisoned = failures.as_ref().and_then(|(_, sync)| sync.clone());
                st.raw.take()
            };
            // Not the last holder (`self.handle` is one), but let go of with the tail unlocked all
            // the same.
            drop(published);
            // Logged with the tail unlocked: a subscriber may use it (`is_alive`, `synchronize`).
            if let Some((record, sync)) = failures {
                tracing::warn!(error = %record, "recording a dropped stream's last event failed; synchronising it");
                if let Some(e) = sync {
                    tracing::warn!(error = %e, "synchronising a dropped stream failed");
                }
            }
        }
        // `self.handle` goes with the fields: the stream is destroyed then, unless a tail user is
        // in the middle of a call on it (that user's clone destroys it as it goes).
    }
}
