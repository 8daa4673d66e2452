//! `PhysicalMemory`: device memory with no address, released when dropped.
//!
//! `cuMemCreate` allocates physical memory on one device; it becomes usable once mapped into a
//! [`VirtualRange`](crate::VirtualRange) and given access. Dropping it drops the creation's
//! reference (`cuMemRelease`): the driver keeps the memory for as long as a mapping of it
//! remains, so it may be dropped right after mapping, and the memory is freed at the unmap.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! use cumem_vmm::{Granularity, HandleTypes, PhysicalMemory};
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let g = Granularity::of(ctx.device())?.minimum;
//!     let memory = PhysicalMemory::new(&ctx, 2 * g)?;
//!     assert_eq!((memory.bytes(), memory.device()), (2 * g, ctx.device()));
//!     assert_eq!(memory.handle_types(), HandleTypes::NONE);
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cumem_core::sys::CUmemGenericAllocationHandle;
use cumem_core::{Context, Device, Error, Result};

use crate::{Granularity, HandleTypes, ffi};

/// Physical device memory (`cuMemCreate` / `cuMemRelease`).
pub struct PhysicalMemory {
    handle: CUmemGenericAllocationHandle,
    ctx: Context,
    bytes: usize,
    granularity: Granularity,
    /// Set while a mapping of this memory exists (shared with that mapping, which clears it when it
    /// unmaps): two mappings would be two views with separate stream orders over the same bytes.
    mapped: Arc<AtomicBool>,
}

impl PhysicalMemory {
    /// `bytes` of pinned memory on `ctx`'s device, private to this process.
    pub fn new(ctx: &Context, bytes: usize) -> Result<PhysicalMemory> {
        PhysicalMemory::with_handle_types(ctx, bytes, HandleTypes::NONE)
    }

    /// `bytes` of pinned memory on `ctx`'s device that may later be exported as `handle_types`.
    ///
    /// Refused before any VMM call: a device without VMM (`NotSupported { feature:
    /// VirtualMemory }`), a handle type the device cannot export (`NotSupported { feature:
    /// ShareableHandle(name) }`, from its attributes), zero bytes (`ZeroSize`), a size that is not a multiple of the minimum
    /// granularity for these handle types (`Misaligned`). The device's capacity is charged now.
    pub fn with_handle_types(
        ctx: &Context,
        bytes: usize,
        handle_types: HandleTypes,
    ) -> Result<PhysicalMemory> {
        let granularity = Granularity::with_handle_types(ctx.device(), handle_types)?;
        if bytes == 0 {
            return Err(Error::ZeroSize { what: "physical allocation" });
        }
        granularity.check("physical allocation size", bytes as u64)?;
        ctx.bind()?;
        let handle = ffi::create(bytes, ctx.device().raw(), handle_types.bits())?;
        Ok(PhysicalMemory { handle, ctx: ctx.clone(), bytes, granularity, mapped: Arc::default() })
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// The context of that device.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The handle types it may be exported as.
    pub fn handle_types(&self) -> HandleTypes {
        self.granularity.handle_types
    }

    /// The granularity it was created with.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// The driver's handle (valid while `self` lives).
    pub fn raw(&self) -> CUmemGenericAllocationHandle {
        self.handle
    }

    /// Whether a mapping of this memory exists now (it may be mapped again once that one is gone).
    pub fn is_mapped(&self) -> bool {
        self.mapped.load(Ordering::Acquire)
    }

    /// Marks the memory mapped and returns the flag the mapping clears when it unmaps, or `None`
    /// if a mapping of it exists already.
    pub(crate) fn claim_mapping(&self) -> Option<Arc<AtomicBool>> {
        (!self.mapped.swap(true, Ordering::AcqRel)).then(|| Arc::clone(&self.mapped))
    }
}

impl fmt::Debug for PhysicalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhysicalMemory")
            .field("handle", &self.handle)
            .field("bytes", &self.bytes)
            .field("device", &self.device().ordinal())
            .field("handle_types", &self.handle_types())
            .finish()
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: `handle` came from cuMemCreate in `with_handle_types` and this is the one
            // release of that reference; mappings keep their own hold on the memory in the driver.
            unsafe { ffi::release(self.handle) }
        });
        if let Err(e) = result {
            tracing::warn!(handle = self.handle, bytes = self.bytes, error = %e, "cuMemRelease failed; the memory is leaked");
        }
    }
}
