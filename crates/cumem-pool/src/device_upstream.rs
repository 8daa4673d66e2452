//! Any cumem [`DeviceResource`] as the caching pool's [`Upstream`] of segments.
//!
//! Segments are requested on the legacy stream. Unless the resource says its memory is usable on
//! every stream at once ([`DeviceResource::usable_on_every_stream_at_once`]: `DriverResource`,
//! and the adaptors over it), the upstream synchronises that stream before the pool uses a new
//! segment, so a stream-ordered upstream (a driver pool) is as safe as `cuMemAlloc`; that waits
//! for the work of every blocking stream, so a growth over `cuMemAlloc` does not pay it. The pool only
//! returns a segment after synchronising every stream, so releasing it on the legacy stream is safe.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DriverResource};
//! use cumem_pool::{DeviceUpstream, Upstream};
//! let ctx = Device::get(0)?.context()?;
//! let up = DeviceUpstream::new(Arc::new(DriverResource::new(&ctx)));
//! let segment = up.allocate(2 << 20).unwrap();
//! assert_eq!(segment % 512, 0);
//! // SAFETY: `segment` came from `up` for 2 MiB, is given back once, and nothing used it.
//! unsafe { up.deallocate(segment, 2 << 20) };
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use cumem_core::{AllocLayout, Allocation, DeviceResource, Stream};
use parking_lot::Mutex;

use crate::{DeviceExpandable, ExpandableUpstream, SEGMENT_ALIGN, Upstream, UpstreamError};

/// Segments from a device resource.
#[derive(Debug)]
pub struct DeviceUpstream {
    resource: Arc<dyn DeviceResource>,
    /// Mapping operations for expandable segments, when asked for and the device has them.
    expandable: Option<DeviceExpandable>,
    legacy: Stream,
    /// The resource's tokens of the segments held, by address: segments come and go rarely, so a
    /// map here costs nothing on the pool's fast path.
    tokens: Mutex<HashMap<u64, [u64; 2]>>,
}

impl DeviceUpstream {
    /// Takes segments from `resource`.
    pub fn new(resource: Arc<dyn DeviceResource>) -> Self {
        let legacy = Stream::legacy(resource.context());
        DeviceUpstream { resource, legacy, tokens: Mutex::new(HashMap::new()), expandable: None }
    }

    /// Takes segments from `resource`, and can also grow [expandable segments](crate::expandable)
    /// with memory of its device when the device has virtual memory management (if it has not,
    /// a warning, and segments only).
    pub fn with_expandable(resource: Arc<dyn DeviceResource>) -> Self {
        let expandable = match DeviceExpandable::new(resource.context()) {
            Ok(x) => Some(x),
            Err(e) => {
                tracing::warn!(error = %e, "no expandable segments on this device; the pool takes segments");
                None
            }
        };
        DeviceUpstream { expandable, ..Self::new(resource) }
    }

    /// The resource segments come from.
    pub fn resource(&self) -> &Arc<dyn DeviceResource> {
        &self.resource
    }
}

impl Upstream for DeviceUpstream {
    fn allocate(&self, bytes: usize) -> Result<u64, UpstreamError> {
        let layout = AllocLayout::new(bytes, SEGMENT_ALIGN).map_err(UpstreamError::Driver)?;
        let alloc = self.resource.allocate(layout, &self.legacy).map_err(UpstreamError::Driver)?;
        // A stream-ordered upstream hands out memory usable in order on the legacy stream only;
        // the pool will use it on any stream, so wait until it is usable everywhere. Not for
        // `cuMemAlloc`'s memory, usable everywhere already: synchronising the legacy stream
        // would wait for every blocking stream's work.
        if self.resource.usable_on_every_stream_at_once() {
            self.tokens.lock().insert(alloc.ptr, alloc.token);
            return Ok(alloc.ptr);
        }
        if let Err(e) = self.legacy.synchronize() {
            // SAFETY: allocated just above with this layout and never handed out.
            unsafe { self.resource.deallocate(alloc, layout, &self.legacy) };
            return Err(UpstreamError::Driver(e));
        }
        self.tokens.lock().insert(alloc.ptr, alloc.token);
        Ok(alloc.ptr)
    }

    unsafe fn deallocate(&self, addr: u64, bytes: usize) {
        let layout = AllocLayout { bytes, align: SEGMENT_ALIGN };
        let Some(token) = self.tokens.lock().remove(&addr) else {
            tracing::warn!(addr, bytes, "returning a segment this upstream did not hand out; ignored");
            return;
        };
        // SAFETY: by this method's contract, `(addr, bytes)` is a segment `allocate` returned for
        // `bytes` (its layout is this one: the same size and SEGMENT_ALIGN, and `token` is the one
        // the resource gave with it), given back once (its token was just removed), with no work
        // queued on it and nothing using it afterwards. The legacy stream is the one it was
        // allocated on.
        unsafe { self.resource.deallocate(Allocation { ptr: addr, token }, layout, &self.legacy) };
    }

    fn device(&self) -> Option<u64> {
        Some(self.resource.context().device().ordinal() as u64)
    }

    fn expandable(&self) -> Option<&dyn ExpandableUpstream> {
        self.expandable.as_ref().map(|x| x as &dyn ExpandableUpstream)
    }
}
