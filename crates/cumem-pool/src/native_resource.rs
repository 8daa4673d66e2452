//! A driver memory pool as a [`DeviceResource`]: `cuMemAllocFromPoolAsync` / `cuMemFreeAsync`.
//!
//! Allocation and free are stream-ordered: a buffer's memory returns to the pool on the stream the
//! buffer was last used on, and the pool reuses it in stream order.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_pool::{MemPool, MemPoolOptions, NativePoolResource};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let pool = Arc::new(NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default())?));
//! let buf = DeviceBuffer::<u32>::zeroed_in(&pool, &stream, 1000)?;
//! assert_eq!(buf.to_vec()?, vec![0; 1000]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::collections::HashMap;

use cumem_core::sys::CUdeviceptr;
use cumem_core::{AllocLayout, Context, DeviceResource, Error, Result, Stream};
use parking_lot::Mutex;

use crate::{MemPool, ffi};

/// The alignment pool allocations are known to have without padding.
const POOL_ALIGNMENT: usize = 256;

/// A [`MemPool`] serving [`DeviceResource`] requests.
///
/// Alignments above 256 bytes first try the exact size and keep it when the pool's address is
/// aligned enough (the driver's pools hand out 512-byte granules, so 512 always is); otherwise the
/// trial goes back to the pool in stream order and the request is padded by `align - 256` bytes.
#[derive(Debug)]
pub struct NativePoolResource {
    pool: MemPool,
    /// For alignments above 256: the base the pool returned, by the address handed out (the same
    /// address unless the block was padded), so the free names the pool's own address.
    padded: Mutex<HashMap<CUdeviceptr, CUdeviceptr>>,
}

impl NativePoolResource {
    /// Serves allocations from `pool`.
    pub fn new(pool: MemPool) -> Self {
        NativePoolResource { pool, padded: Mutex::new(HashMap::new()) }
    }

    /// The device's default pool as a resource.
    pub fn default_pool(ctx: &Context) -> Result<Self> {
        Ok(Self::new(MemPool::default_pool(ctx)?))
    }

    /// The pool behind the resource.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }
}

// SAFETY: cuMemAllocFromPoolAsync returns fresh memory usable in order on the stream, aligned to
// 256 bytes. A larger alignment is served by an exact-size block whose address is checked, or by
// padding `align - 256` bytes and rounding the 256-aligned base up (which stays inside the block);
// the base is remembered so it is what gets freed. Frees are stream-ordered on the buffer's last
// stream, as the trait's contract provides.
unsafe impl DeviceResource for NativePoolResource {
    fn context(&self) -> &Context {
        self.pool.context()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<CUdeviceptr> {
        let layout = AllocLayout::new(layout.bytes, layout.align)?;
        let ctx = self.pool.context();
        let device = ctx.device().ordinal() as i32;
        ctx.bind()?;
        let exact = ffi::mem_alloc_from_pool_async(layout.bytes, self.pool.raw(), stream.raw(), device)?;
        if layout.align <= POOL_ALIGNMENT {
            return Ok(exact);
        }
        if exact.is_multiple_of(layout.align as u64) {
            self.padded.lock().insert(exact, exact);
            return Ok(exact);
        }
        // Not aligned enough: give the trial back in stream order (the pool can reuse it for the
        // padded request at once) and pad.
        // SAFETY: `exact` was allocated on `stream` just above, is freed once, and was never handed
        // out, so no work uses it.
        unsafe { ffi::mem_free_async(exact, stream.raw()) }.inspect_err(|e| {
            tracing::warn!(ptr = exact, error = %e, "freeing a misaligned trial block failed; it stays in the pool");
        })?;
        let padded = layout
            .bytes
            .checked_add(layout.align - POOL_ALIGNMENT)
            .ok_or(Error::SizeOverflow { count: layout.bytes, elem_size: 1 })?;
        let base = ffi::mem_alloc_from_pool_async(padded, self.pool.raw(), stream.raw(), device)?;
        let aligned = base.next_multiple_of(layout.align as u64);
        self.padded.lock().insert(aligned, base);
        Ok(aligned)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, layout: AllocLayout, stream: &Stream) {
        let base = if layout.align <= POOL_ALIGNMENT { Some(ptr) } else { self.padded.lock().remove(&ptr) };
        let Some(base) = base else {
            tracing::warn!(ptr, "freeing an address this pool resource did not hand out; ignored");
            return;
        };
        let result = self.pool.context().bind().and_then(|()| {
            // SAFETY: `base` came from cuMemAllocFromPoolAsync (caller's item 1) and every use of it is
            // ordered before work queued on `stream` next (item 2).
            unsafe { ffi::mem_free_async(base, stream.raw()) }
        });
        if let Err(e) = result {
            tracing::warn!(ptr, error = %e, "cuMemFreeAsync failed; the memory stays in the pool");
        }
    }
}
