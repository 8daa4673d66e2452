//! The retained primary context of a device, bound before every driver call.
//!
//! CUDA's current context is per-thread state, so a buffer dropped on a thread that never touched
//! CUDA would otherwise fail with `INVALID_CONTEXT`. Every owning cumem type therefore keeps its
//! [`Context`] alive and binds it before calling the driver. [`Device::context`] retains each
//! device's primary context once and keeps it in a process-wide cache, so it stays retained for
//! the life of the process (as the CUDA runtime keeps it), not only while owners are alive.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! let ctx = Device::get(0)?.context()?;
//! let info = ctx.mem_info()?;
//! assert!(info.free <= info.total);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;

use cumem_sys::sys::CUcontext;

use crate::{Device, Result, Stream, ffi};

/// A device's primary context, retained for as long as any clone lives (and [`Device::context`]
/// keeps one for the life of the process).
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    raw: RawContext,
}

/// The driver handle; only dereferenced by the driver.
#[derive(Clone, Copy)]
struct RawContext(CUcontext);

// SAFETY: a CUcontext is an opaque handle that the driver lets any thread use; cumem never
// dereferences it.
unsafe impl Send for RawContext {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawContext {}

/// Free and total memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes the driver reports as free.
    pub free: usize,
    /// Total bytes of device memory.
    pub total: usize,
}

impl Context {
    pub(crate) fn retain_primary(device: Device) -> Result<Context> {
        let raw = ffi::primary_ctx_retain(device.raw())?;
        Ok(Context { inner: Arc::new(Inner { device, raw: RawContext(raw) }) })
    }

    /// The device this context belongs to.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUcontext {
        self.inner.raw.0
    }

    /// Whether this context is the calling thread's current one (one `cuCtxGetCurrent`; no
    /// cache, as in [`Context::bind`]).
    #[inline]
    pub fn is_current(&self) -> Result<bool> {
        Ok(ffi::ctx_get_current()? == self.raw())
    }

    /// Makes this context current on the calling thread.
    ///
    /// Asks the driver which context is current first (a thread-local read in the driver, much
    /// cheaper than `cuCtxSetCurrent`, which the simulator serialises on its global state) and sets
    /// it only when it differs. No cache of ours: code that changes the current context with raw
    /// driver calls in between is seen at once. Setting replaces the top of the thread's context
    /// stack and nothing restores it: code that pushed a context of its own and then calls cumem
    /// finds cumem's context current afterwards.
    #[inline]
    pub fn bind(&self) -> Result<()> {
        if self.is_current()? {
            return Ok(());
        }
        ffi::ctx_set_current(self.raw())
    }

    /// Waits for all work in all streams of this context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        ffi::ctx_synchronize()
    }

    /// Free and total memory of this context's device.
    pub fn mem_info(&self) -> Result<MemInfo> {
        self.bind()?;
        let (free, total) = ffi::mem_get_info()?;
        Ok(MemInfo { free, total })
    }

    /// The legacy default stream, which synchronises with every blocking stream of the context.
    pub fn default_stream(&self) -> Stream {
        Stream::legacy(self)
    }

    /// The range of stream priorities as (least, greatest); greater priorities are more negative.
    pub fn stream_priority_range(&self) -> Result<(i32, i32)> {
        self.bind()?;
        ffi::ctx_stream_priority_range()
    }
}

impl PartialEq for Context {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.raw() == other.raw() && self.device() == other.device())
    }
}

impl Eq for Context {}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("device", &self.inner.device.ordinal()).finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Err(e) = ffi::primary_ctx_release(self.device.raw()) {
            tracing::warn!(device = self.device.ordinal(), error = %e, "releasing the primary context failed");
        }
    }
}
