//! `PrefetchPlan`: a batch of migrations of unified memory, queued on one stream.
//!
//! Before a phase of work, a program often knows which buffers (or parts of them) the next
//! processor will touch. A plan collects those ranges and destinations, checks them all (ranges,
//! devices, capabilities) and only then queues one prefetch per entry, each ordered after the work
//! that already uses its buffer. A prefetch is recorded as a device read of its range: it moves
//! pages but changes no data, so shared host reads ([`UnifiedBuffer::as_slice`],
//! [`UnifiedBuffer::with_host_slice`], [`UnifiedBuffer::to_vec`]) need not wait for it and do not
//! (unless they wait for an earlier device write, which synchronises every stream that used the
//! buffer, the prefetch's included), while exclusive host access ([`UnifiedBuffer::as_mut_slice`],
//! [`UnifiedBuffer::with_host_slice_mut`]) and [`UnifiedBuffer::wait_idle`] wait for it, like for
//! any other device work on the buffer. (Prefetching needs concurrent managed access, where host
//! and device reads may overlap.)
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_unified::{Location, PrefetchPlan, UnifiedBuffer};
//! let device = Device::get(0)?;
//! let stream = Stream::new(&device.context()?)?;
//! let (a, b) = (UnifiedBuffer::<u8>::zeroed(&stream, 4096)?, UnifiedBuffer::<u8>::zeroed(&stream, 4096)?);
//! let mut plan = PrefetchPlan::new();
//! plan.add(&a, Location::Device(device)).add_range(&b, ..2048, Location::Host)?;
//! assert_eq!((plan.len(), plan.bytes()), (2, 4096 + 2048));
//! plan.execute(&stream)?;
//! stream.synchronize()?;
//! assert_eq!(a.attributes()?.last_prefetch_location, Some(Location::Device(device)));
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::ops::RangeBounds;

use cumem_core::{Error, Feature, Result, Stream};

use crate::buffer::Span;
use crate::{Location, UnifiedBuffer, ffi};

/// A batch of prefetches of unified memory.
#[derive(Default)]
pub struct PrefetchPlan<'a> {
    items: Vec<(Span<'a>, Location)>,
    /// The first range error met by [`PrefetchPlan::add`]-style chaining, reported by `execute`.
    error: Option<Error>,
}

impl<'a> PrefetchPlan<'a> {
    /// An empty plan.
    pub fn new() -> Self {
        PrefetchPlan::default()
    }

    /// Adds migrating all of `buf` to `to`.
    pub fn add<T>(&mut self, buf: &'a UnifiedBuffer<T>, to: Location) -> &mut Self {
        match buf.span(..) {
            Ok(span) => self.items.push((span, to)),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
        self
    }

    /// Like [`PrefetchPlan::add`], consuming and returning the plan.
    pub fn with<T>(mut self, buf: &'a UnifiedBuffer<T>, to: Location) -> Self {
        self.add(buf, to);
        self
    }

    /// Adds migrating the elements of `buf` in `range` to `to`; an out-of-range `range` is an error.
    pub fn add_range<T>(
        &mut self,
        buf: &'a UnifiedBuffer<T>,
        range: impl RangeBounds<usize>,
        to: Location,
    ) -> Result<&mut Self> {
        self.items.push((buf.span(range)?, to));
        Ok(self)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the plan has no entries.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes the plan migrates, counting a range once per entry that names it; saturates at
    /// `usize::MAX` (entries naming the same large ranges many times over could otherwise overflow
    /// the sum).
    pub fn bytes(&self) -> usize {
        self.items.iter().fold(0usize, |total, (s, _)| total.saturating_add(s.bytes))
    }

    /// Checks every entry, then queues one prefetch per entry on `stream`, each after the work
    /// already using its buffer. Every buffer must belong to the stream's device; the stream's
    /// device, and a device destination, need concurrent managed access (the driver's rule for
    /// any prefetch; `NotSupported` before anything is queued, also for a plan with no entries or
    /// only empty ones, which queues nothing: the answer does not depend on the sizes).
    pub fn execute(&self, stream: &Stream) -> Result<()> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let stream_device = stream.context().device();
        stream_device.capabilities()?.require(Feature::ConcurrentManagedAccess)?;
        for (span, to) in &self.items {
            if span.ctx.device() != stream_device {
                return Err(Error::WrongDevice {
                    expected: stream_device.ordinal() as i32,
                    actual: span.ctx.device().ordinal() as i32,
                });
            }
            to.require_concurrent()?;
        }
        for (span, to) in &self.items {
            if span.bytes == 0 {
                continue;
            }
            // A prefetch changes no data the host can see, but it must not run before the work
            // that fills the range, and exclusive host access (a write) and `wait_idle` must wait
            // for it: recorded as a read, which shared host reads need not wait for.
            let _ticket = match span.access.view_order(false) {
                Some(order) => Some(order.use_on(stream)?),
                None => None,
            };
            stream.context().bind()?;
            ffi::mem_prefetch_async(span.ptr, span.bytes, to.target(), stream.raw())?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for PrefetchPlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: Vec<_> =
            self.items.iter().map(|(s, to)| (format!("{:#x}", s.ptr), s.bytes, *to)).collect();
        f.debug_struct("PrefetchPlan").field("entries", &entries).finish()
    }
}
