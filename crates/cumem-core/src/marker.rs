//! A stream's reusable marker event: what other streams wait on to be ordered after it.
//!
//! Ordering stream B after stream A needs an event recorded on A and waited on by B, for an
//! instant only: once the wait is queued the driver has captured what it waits for, and the event
//! may be recorded again. Creating and destroying an event for each such wait would cost two more
//! driver calls per ordering (and, on a real driver, a lock the whole context shares), so each
//! [`Stream`](crate::Stream) keeps one untimed event, created the first time another stream waits
//! for it and destroyed with the stream. It is recorded only when something waits on it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
//! b.wait_for(&a)?; // creates a's marker, records it on a, queues b's wait
//! b.wait_for(&a)?; // records the same event again: nothing created or destroyed
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_sys::sys::{CUevent, CUevent_flags, CUstream};
use parking_lot::Mutex;

use crate::{Context, Result, ffi};

/// An event handle owned by a marker; only dereferenced by the driver.
struct RawEvent(CUevent);

// SAFETY: a CUevent is an opaque handle usable from any thread; cumem never dereferences it.
unsafe impl Send for RawEvent {}

/// The marker event of one stream, created on first use.
#[derive(Default)]
pub(crate) struct Marker {
    /// Locked from the record until the waits are queued, so that no other thread re-records it
    /// in between (which would only make the waiter wait longer, but keeps the reasoning simple).
    event: Mutex<Option<RawEvent>>,
}

impl Marker {
    /// Records the marker after everything queued so far on `stream` and hands it to
    /// `use_marker`, which must only queue waits on it.
    ///
    /// The caller binds the stream's context first; `use_marker` may bind another.
    pub(crate) fn with_recorded<R>(
        &self,
        stream: CUstream,
        use_marker: impl FnOnce(CUevent) -> Result<R>,
    ) -> Result<R> {
        let mut event = self.event.lock();
        let raw = match &*event {
            Some(e) => e.0,
            None => {
                event.insert(RawEvent(ffi::event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)?)).0
            }
        };
        ffi::event_record(raw, stream)?;
        use_marker(raw)
    }

    /// Destroys the event, if one was created (in `ctx`, the stream's context), as the stream
    /// goes away.
    pub(crate) fn destroy(&mut self, ctx: &Context) {
        if let Some(event) = self.event.get_mut().take() {
            let result = ctx.bind().and_then(|()| {
                // SAFETY: created by `event_create`, owned by this marker only, never used again
                // (waits already queued on it keep their capture).
                unsafe { ffi::event_destroy(event.0) }
            });
            if let Err(e) = result {
                tracing::warn!(error = %e, "destroying a stream's marker event failed; it is leaked");
            }
        }
    }
}

impl std::fmt::Debug for Marker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Marker").finish_non_exhaustive()
    }
}
