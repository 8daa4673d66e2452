//! Streams: ordered queues of device work.
//!
//! A [`Stream`] is a cheap, clonable handle; the driver stream is destroyed when the last clone is
//! dropped (the driver lets pending work finish first). [`Stream::legacy`] names the context's
//! legacy default stream, which implicitly synchronises with every blocking stream.
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

use crate::marker::Marker;
use crate::{Context, Event, Result, ffi};

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
    owned: bool,
    options: StreamOptions,
    /// See [`Stream::id`].
    id: u64,
    /// What other streams wait on (see `marker`).
    marker: Marker,
}

/// The next [`Stream::id`] of a created stream (0 is the legacy streams').
static NEXT_STREAM_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[derive(Clone, Copy, PartialEq, Eq)]
struct RawStream(CUstream);

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
        Ok(Stream {
            inner: Arc::new(Inner {
                ctx: ctx.clone(),
                raw: RawStream(raw),
                owned: true,
                options,
                id,
                marker: Marker::default(),
            }),
        })
    }

    /// The legacy default stream of `ctx` (the NULL stream).
    pub fn legacy(ctx: &Context) -> Stream {
        Stream {
            inner: Arc::new(Inner {
                ctx: ctx.clone(),
                raw: RawStream(std::ptr::null_mut()),
                owned: false,
                options: StreamOptions::default(),
                id: 0,
                marker: Marker::default(),
            }),
        }
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
        let event = Event::new(&self.inner.ctx)?;
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
        if !self.owned {
            return;
        }
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: this stream was created by `stream_create`, and this is the last owner.
            unsafe { ffi::stream_destroy(self.raw.0) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "destroying a stream failed");
        }
    }
}
