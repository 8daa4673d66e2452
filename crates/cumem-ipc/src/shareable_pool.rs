//! [`ShareablePool`]: a driver memory pool whose memory other processes can import.
//!
//! The pool is created with POSIX-descriptor handle types. It serves typed buffers like any
//! [`DeviceResource`]; [`ShareablePool::export_fd`] gives the descriptor another process imports
//! as an [`ImportedPool`](crate::ImportedPool) (send it with
//! [`fd_passing::send_fds`](crate::fd_passing::send_fds)), and
//! [`ShareablePool::export_pointer`] the bytes that name one buffer in it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_ipc::{PoolPointerExport, ShareablePool};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let pool = Arc::new(ShareablePool::new(&ctx)?);
//! let buf = DeviceBuffer::<u32>::zeroed_in(&pool, &stream, 1024)?;
//! let fd = pool.export_fd()?; // an OwnedFd: send it over a Unix socket (SCM_RIGHTS)
//! let export = pool.export_pointer(&buf)?;
//! let wire = export.to_bytes(); // send these over any channel
//! assert_eq!(PoolPointerExport::from_bytes(&wire)?.bytes(), 4096);
//! # drop(fd);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};

use cumem_core::sys::{CUdevice_attribute, CUmemoryPool};
use cumem_core::{
    AllocLayout, Allocation, Context, DeviceBuffer, DeviceResource, Error, ErrorContext, Feature, HomeStream,
    Result, Stream,
};

use crate::PoolPointerExport;
use crate::ffi;

/// The alignment pool allocations are known to have without padding.
const POOL_ALIGNMENT: usize = 256;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as a bit of MEMPOOL_SUPPORTED_HANDLE_TYPES.
const POSIX_FD_BIT: i32 = 1;

/// A stream-ordered memory pool of one device, created with POSIX-descriptor handle types, so
/// that other processes can import it and pointers allocated from it.
///
/// Allocate from it through [`DeviceResource`] (wrap it in an `Arc` and use the `*_in`
/// constructors of [`DeviceBuffer`]); the pool is destroyed when the last `Arc` goes, which is
/// after its last buffer. Importers must have dropped their imports of a buffer before the
/// buffer is dropped here (the driver's contract); [`ImportedPool::import_pointer`](crate::ImportedPool::import_pointer)
/// states it as its safety contract.
///
/// Alignments above 256 bytes are served as `NativePoolResource` (cumem-pool) does: the exact
/// size when the pool's address is aligned enough, else padded. Memory whose last stream belongs
/// to another context is freed on a non-blocking stream of the pool's context, created at the
/// first such free and kept, after that stream's work so far.
pub struct ShareablePool {
    ctx: Context,
    raw: RawPool,
    /// The pool was exported once (`cuMemPoolExportToShareableHandle`): only then does the
    /// driver export its pointers (see [`ShareablePool::export_pointer`]).
    exported: AtomicBool,
    /// Where memory last used on another context's stream is freed (see `free_after_foreign`):
    /// a stream of `ctx`, created at the first such free and kept.
    home: HomeStream,
}

struct RawPool(CUmemoryPool);

// SAFETY: a CUmemoryPool is an opaque handle the driver lets any thread use; it is never
// dereferenced.
unsafe impl Send for RawPool {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawPool {}

impl ShareablePool {
    /// A new pool on `ctx`'s device with no size cap but the device's memory.
    ///
    /// A device without memory pools, or whose MEMPOOL_SUPPORTED_HANDLE_TYPES lacks POSIX
    /// descriptors, gives [`Error::NotSupported`] before any pool is created.
    pub fn new(ctx: &Context) -> Result<ShareablePool> {
        Self::with_max_size(ctx, None)
    }

    /// A new pool on `ctx`'s device that reserves at most `max_size` bytes (`None`: the device's
    /// memory), rounded up by the driver to a multiple of 32 MiB: the pool reserves device memory
    /// in 32 MiB chunks, so a 4 MiB limit still holds 3 + 3 MiB in one 32 MiB chunk (observed on
    /// an H100, 2026-11-23, on pools *without* handle types; for these POSIX_FD pools it is
    /// assumed, not measured; the simulator rounds the same way for both, and does not pack an
    /// allocation across chunks as the H100 does, so a limited pool may run out earlier there).
    /// Use a multiple of 32 MiB for an exact cap. `Some(0)` gives [`Error::ZeroSize`]: the driver
    /// would read a maxSize of 0 as no cap at all.
    pub fn with_max_size(ctx: &Context, max_size: Option<usize>) -> Result<ShareablePool> {
        if max_size == Some(0) {
            return Err(Error::ZeroSize { what: "pool size cap" });
        }
        let device = ctx.device();
        device.capabilities()?.require(Feature::MemoryPools)?;
        let types =
            device.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
        if types & POSIX_FD_BIT == 0 {
            return Err(Error::NotSupported {
                feature: Feature::ShareableHandle("a POSIX file descriptor (memory pool)"),
                device: Some(device.raw()),
            });
        }
        ctx.bind()?;
        let raw = ffi::pool_create_shareable(device.raw(), max_size.unwrap_or(0))?;
        Ok(ShareablePool {
            ctx: ctx.clone(),
            raw: RawPool(raw),
            exported: AtomicBool::new(false),
            home: HomeStream::new(),
        })
    }

    /// The driver's handle; valid while `self` lives.
    pub fn raw(&self) -> CUmemoryPool {
        self.raw.0
    }

    /// A new descriptor of the pool (one per call), for another process's
    /// [`ImportedPool::from_fd`](crate::ImportedPool::from_fd). Closing it here after sending
    /// is fine: the receiver holds its own copy.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.ctx.bind()?;
        let fd = ffi::pool_export_fd(self.raw.0)?;
        self.exported.store(true, Ordering::Release);
        Ok(fd)
    }

    /// Exports the pool once if it never was, so that its pointers export.
    ///
    /// A real driver refuses `cuMemPoolExportPointer` (INVALID_VALUE) until the pool itself was
    /// exported with `cuMemPoolExportToShareableHandle`, once, before or after the allocation (an
    /// H100, 2026-11-23), but nothing makes a caller send the pool before its pointers. Done
    /// lazily rather than at creation, so that a pool whose pointers are never exported costs no
    /// descriptor and cannot fail for lack of one; the descriptor is closed at once (the export
    /// is what counts, not the open descriptor: on the H100, pointers allocated before and after
    /// an export whose descriptor was already closed exported). Two threads may both get here and both export:
    /// each closes its own descriptor, and a second export is as harmless as the user's calls of
    /// `export_fd`, so no lock. A failure leaves the flag unset: the next call tries again.
    fn ensure_exported(&self) -> Result<()> {
        if self.exported.load(Ordering::Acquire) {
            return Ok(());
        }
        drop(ffi::pool_export_fd(self.raw.0)?);
        self.exported.store(true, Ordering::Release);
        Ok(())
    }

    /// The bytes that name `buf` for another process that imported this pool. `buf`'s memory
    /// must come from this pool: a buffer of any other resource (another pool, cumem's caching
    /// pool over another resource, `cuMemAlloc` memory) gives [`Error::InvalidValue`]. A block of
    /// a caching pool over *this* pool is exported with the whole allocation (segment) it lies
    /// in, as the driver exports it: the importer's mapping reaches the segment's other blocks
    /// too, and a second block of that segment cannot be imported while the first import lives
    /// (`AlreadyMapped`). The importer may read as
    /// soon as it imports: synchronise `buf.order()` (or record an
    /// [`IpcEvent`](crate::IpcEvent)) after writing and before sending.
    ///
    /// It may come before, after or without any [`ShareablePool::export_fd`]: the driver exports
    /// pointers only of a pool that was exported, so the first call on a pool never exported
    /// exports it once (a descriptor made and closed at once); an error of that export is
    /// returned as is.
    pub fn export_pointer<T>(&self, buf: &DeviceBuffer<T>) -> Result<PoolPointerExport> {
        self.ctx.bind()?;
        let not_ours = || Error::InvalidValue {
            ctx: ErrorContext::op("ShareablePool::export_pointer (the buffer is not from this pool)")
                .bytes(buf.bytes()),
        };
        if buf.context() != &self.ctx {
            return Err(not_ours());
        }
        let (base, size) = ffi::address_range(buf.device_ptr())?;
        if ffi::pointer_pool(base)? != self.raw.0 {
            return Err(not_ours());
        }
        self.ensure_exported()?;
        let raw = ffi::pool_export_pointer(base)?;
        let offset = buf.device_ptr() - base;
        debug_assert!(offset as usize + buf.bytes() <= size, "a buffer lies inside its allocation");
        Ok(PoolPointerExport::new(raw, offset, buf.bytes() as u64))
    }
}

impl ShareablePool {
    /// Frees `base` when the buffer's last stream, `stream`, belongs to another context: on the
    /// pool's [`HomeStream`], ordered after `stream`, or leaked with a warning when no ordering
    /// can be proven (rather than freed under its uses).
    ///
    /// # Safety
    /// 1. `base` came from `cuMemAllocFromPoolAsync` on this pool and is freed once.
    /// 2. Every use of it is ordered before work queued on `stream` next.
    unsafe fn free_after_foreign(&self, base: u64, ptr: u64, stream: &Stream) -> Result<()> {
        let Some(follower) = self.home.after(&self.ctx, stream) else {
            tracing::warn!(ptr, "the memory is leaked: its last stream's work cannot be waited for");
            return Ok(());
        };
        self.ctx.bind()?;
        // SAFETY: `base` is freed once (item 1), and every use is ordered before the free: before
        // work queued on `stream` next (item 2), which `follower` follows.
        unsafe { ffi::mem_free_async(base, follower.raw()) }
    }
}

// SAFETY: cuMemAllocFromPoolAsync returns fresh memory usable in order on the stream, aligned to
// 256 bytes. A larger alignment is served by an exact-size block whose address is checked, or by
// padding `align - 256` bytes and rounding the 256-aligned base up (which stays inside the
// block); the base travels in the allocation's token so it is what gets freed. Frees are
// stream-ordered on the buffer's last stream, as the trait's contract provides, or on a stream of
// the pool's context ordered after it when it belongs to another context.
unsafe impl DeviceResource for ShareablePool {
    fn context(&self) -> &Context {
        &self.ctx
    }

    /// A stream of another context gives [`Error::WrongDevice`] (`DeviceBuffer`'s constructors
    /// check it too; a direct call through the trait does not go through them).
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        let layout = AllocLayout::new(layout.bytes, layout.align)?;
        let device = self.ctx.device().ordinal() as i32;
        if stream.context() != &self.ctx {
            // The driver would queue the allocation on a stream of another context, for memory
            // of this pool's device: work on that stream would use memory of another device.
            return Err(Error::WrongDevice {
                expected: device,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        self.ctx.bind()?;
        let exact = ffi::mem_alloc_from_pool_async(layout.bytes, self.raw.0, stream.raw(), device)?;
        if layout.align <= POOL_ALIGNMENT || exact.is_multiple_of(layout.align as u64) {
            return Ok(Allocation { ptr: exact, token: [exact, 0] });
        }
        // SAFETY: `exact` was allocated on `stream` just above, is freed once, and was never
        // handed out, so no work uses it.
        unsafe { ffi::mem_free_async(exact, stream.raw()) }.inspect_err(|e| {
            tracing::warn!(ptr = exact, error = %e, "freeing a misaligned trial block failed; it stays in the pool");
        })?;
        let padded = layout
            .bytes
            .checked_add(layout.align - POOL_ALIGNMENT)
            .ok_or(Error::SizeOverflow { count: layout.bytes, elem_size: 1 })?;
        let base = ffi::mem_alloc_from_pool_async(padded, self.raw.0, stream.raw(), device)?;
        Ok(Allocation { ptr: base.next_multiple_of(layout.align as u64), token: [base, 0] })
    }

    unsafe fn deallocate(&self, allocation: Allocation, _layout: AllocLayout, stream: &Stream) {
        let (ptr, base) = (allocation.ptr, allocation.token[0]);
        let result = if stream.context() == &self.ctx {
            self.ctx.bind().and_then(|()| {
                // SAFETY: `base` came from cuMemAllocFromPoolAsync (caller's item 1) and every use
                // of it is ordered before work queued on `stream` next (item 2).
                unsafe { ffi::mem_free_async(base, stream.raw()) }
            })
        } else {
            // SAFETY: the caller's items 1 and 2, passed on.
            unsafe { self.free_after_foreign(base, ptr, stream) }
        };
        if let Err(e) = result {
            tracing::warn!(ptr, error = %e, "cuMemFreeAsync failed; the memory stays in the pool");
        }
    }
}

impl Drop for ShareablePool {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::warn!(error = %e, "cumem-ipc: cannot bind a shareable pool's context; the pool leaks");
            return;
        }
        // SAFETY: the pool was created in `with_max_size` and is destroyed only here; every buffer
        // allocated from it holds an `Arc` of it, so none is outstanding through cumem.
        if let Err(e) = unsafe { ffi::pool_destroy(self.raw.0) } {
            tracing::warn!(error = %e, "cumem-ipc: destroying a shareable pool failed");
        }
    }
}

impl std::fmt::Debug for ShareablePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareablePool")
            .field("device", &self.ctx.device().ordinal())
            .field("raw", &self.raw.0)
            .finish()
    }
}
