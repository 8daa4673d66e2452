//! Events: markers in a stream's work, for ordering, waiting and timing.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Event, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let (mut start, mut end) = (Event::timed(&ctx)?, Event::timed(&ctx)?);
//! start.record(&stream)?;
//! end.record(&stream)?;
//! end.synchronize()?;
//! assert!(end.elapsed_since(&start)?.as_secs_f64() >= 0.0);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::time::Duration;

use cumem_sys::sys::{CUevent, CUevent_flags};

use crate::{Context, Error, Result, Stream, ffi};

/// A CUDA event of one context.
pub struct Event {
    ctx: Context,
    raw: RawEvent,
    timed: bool,
}

struct RawEvent(CUevent);

// SAFETY: a CUevent is an opaque handle usable from any thread; cumem never dereferences it.
unsafe impl Send for RawEvent {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawEvent {}

impl Event {
    /// An event for ordering and waiting only (timing disabled, the cheapest kind).
    pub fn new(ctx: &Context) -> Result<Event> {
        Event::create(ctx, false)
    }

    /// An event that records a timestamp, for [`Event::elapsed_since`].
    pub fn timed(ctx: &Context) -> Result<Event> {
        Event::create(ctx, true)
    }

    fn create(ctx: &Context, timed: bool) -> Result<Event> {
        ctx.bind()?;
        let flags = if timed { 0 } else { CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 };
        let raw = ffi::event_create(flags)?;
        Ok(Event { ctx: ctx.clone(), raw: RawEvent(raw), timed })
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUevent {
        self.raw.0
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Captures everything queued on `stream` so far. The stream must belong to the event's context.
    ///
    /// Takes `&mut self`: recording moves what the event stands for, so only its owner may do it.
    /// An event shared through an `Arc` (a [`StreamTail`](crate::StreamTail)'s ticket or retired
    /// event, which a pool keeps as the proof that a stream's work on a block is done) can then
    /// only be waited on, queried or synchronised: if any holder could record it again on an idle
    /// stream, the others would see it complete while the work it stood for still runs.
    ///
    /// ```compile_fail,E0596
    /// # cumem_sys::testing::init();
    /// use std::sync::Arc;
    /// use cumem_core::{Device, Event, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let stream = Stream::new(&ctx)?;
    /// let shared: Arc<Event> = Arc::new(Event::new(&ctx)?);
    /// shared.record(&stream)?; // cannot borrow data in an `Arc` as mutable
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        if stream.context() != &self.ctx {
            return Err(Error::WrongDevice {
                expected: self.ctx.device().ordinal() as i32,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        self.ctx.bind()?;
        ffi::event_record(self.raw(), stream.raw())
    }

    /// `true` if the captured work has completed (or the event was never recorded).
    pub fn query(&self) -> Result<bool> {
        self.ctx.bind()?;
        ffi::event_query(self.raw())
    }

    /// Blocks until the captured work has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        ffi::event_synchronize(self.raw())
    }

    /// Time between `start` and this event, both timed, recorded and complete.
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        if !self.timed || !start.timed {
            return Err(Error::InvalidHandle {
                ctx: cumem_sys::ErrorContext::op("Event::elapsed_since (untimed event)"),
            });
        }
        self.ctx.bind()?;
        let ms = ffi::event_elapsed_ms(start.raw(), self.raw())?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1000.0))
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw()).field("timed", &self.timed).finish()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: the event was created by `event_create` and this is its only owner.
            unsafe { ffi::event_destroy(self.raw.0) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "destroying an event failed");
        }
    }
}
