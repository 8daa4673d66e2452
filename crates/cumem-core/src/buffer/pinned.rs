//! `PinnedBuffer<T>`: page-locked host memory that asynchronous copies can use safely.
//!
//! The device may read or write a pinned buffer long after the call that queued the copy has
//! returned. The buffer therefore remembers the streams of device work still using it (the stream
//! of the last write and of the reads since; no event is recorded per copy), and every host access
//! first synchronises those streams: reading waits for the last device write's stream, writing for
//! every tracked stream, and dropping for all of them before the memory is freed. A whole stream
//! is waited for, so a host access also waits for whatever was queued on it later, and must not be
//! what later work on that stream waits for (see [`HostAccess`](crate::HostAccess)). This is what
//! makes `cumem-copy`'s asynchronous copies safe functions.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, PinnedBuffer, PinnedFlags};
//! let ctx = Device::get(0)?.context()?;
//! let mut pinned = PinnedBuffer::<u16>::zeroed_with_flags(&ctx, 8, PinnedFlags { portable: true, ..Default::default() })?;
//! pinned.as_mut_slice()?.copy_from_slice(&[7; 8]);
//! assert_eq!(pinned.as_slice()?, &[7; 8]);
//! assert!(pinned.flags().portable);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::ptr::NonNull;

use bytemuck::Zeroable;
use cumem_sys::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED};

use crate::buffer::host_span::HostSpan;
use crate::{Context, Error, Feature, HostAccess, HostMemory, Result, Stream, ffi};

/// Allocation flags of a [`PinnedBuffer`] (`cuMemHostAlloc`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedFlags {
    /// Pinned for every context, not only the allocating one.
    pub portable: bool,
    /// Mapped into the device address space (zero-copy access from kernels).
    pub device_mapped: bool,
    /// Write-combined: fast for the host to write and the device to read, very slow for the host to read.
    pub write_combined: bool,
}

impl PinnedFlags {
    /// The `CU_MEMHOSTALLOC_*` bits.
    pub fn bits(&self) -> u32 {
        let mut bits = 0;
        if self.portable {
            bits |= CU_MEMHOSTALLOC_PORTABLE;
        }
        if self.device_mapped {
            bits |= CU_MEMHOSTALLOC_DEVICEMAP;
        }
        if self.write_combined {
            bits |= CU_MEMHOSTALLOC_WRITECOMBINED;
        }
        bits
    }
}

/// An owning array of `len` values of `T` in page-locked host memory.
pub struct PinnedBuffer<T> {
    /// The values and their pending-work tracker (`Send`/`Sync` like `Vec<T>` through it).
    span: HostSpan<T>,
    /// Whether the span's pointer came from the driver (false for zero bytes).
    allocated: bool,
    flags: PinnedFlags,
    ctx: Context,
}

impl<T: Copy> PinnedBuffer<T> {
    /// `len` zeroed values with default flags.
    pub fn zeroed(ctx: &Context, len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_with_flags(ctx, len, PinnedFlags::default())
    }

    /// `len` zeroed values with explicit flags. `device_mapped` needs a device that can map host
    /// memory (`NotSupported { feature: HostMapping }` otherwise, before any allocation).
    pub fn zeroed_with_flags(ctx: &Context, len: usize, flags: PinnedFlags) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_tracked(ctx, len, flags, HostAccess::new())
    }

    /// Like [`PinnedBuffer::zeroed_with_flags`], with a given pending-work tracker.
    pub(crate) fn zeroed_tracked(
        ctx: &Context,
        len: usize,
        flags: PinnedFlags,
        access: HostAccess,
    ) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::alloc(ctx, len, flags, access, |p| {
            // SAFETY: the allocation holds `len` values; all-zero bytes are a valid T.
            unsafe { std::ptr::write_bytes(p, 0, len) };
        })
    }

    /// A pinned copy of `data`.
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        Self::from_slice_with_flags(ctx, data, PinnedFlags::default())
    }

    /// A pinned copy of `data` with explicit flags (see [`PinnedBuffer::zeroed_with_flags`]).
    pub fn from_slice_with_flags(ctx: &Context, data: &[T], flags: PinnedFlags) -> Result<Self> {
        Self::from_slice_tracked(ctx, data, flags, HostAccess::new())
    }

    /// Like [`PinnedBuffer::from_slice_with_flags`], with a given pending-work tracker.
    pub(crate) fn from_slice_tracked(
        ctx: &Context,
        data: &[T],
        flags: PinnedFlags,
        access: HostAccess,
    ) -> Result<Self> {
        Self::alloc(ctx, data.len(), flags, access, |p| {
            // SAFETY: the allocation holds `data.len()` values and does not overlap `data`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        })
    }

    /// Allocates `len` values and has `init` initialise all of them (only when bytes were
    /// allocated) before the buffer takes them over.
    fn alloc(
        ctx: &Context,
        len: usize,
        flags: PinnedFlags,
        access: HostAccess,
        init: impl FnOnce(*mut T),
    ) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::SizeOverflow { count: len, elem_size: size_of::<T>() })?;
        if flags.device_mapped {
            ctx.device().capabilities()?.require(Feature::HostMapping)?;
        }
        let (ptr, allocated) = if bytes == 0 {
            (NonNull::dangling(), false)
        } else {
            ctx.bind()?;
            let p = ffi::mem_host_alloc(bytes, flags.bits())?.cast::<T>();
            if !p.is_aligned() {
                // SAFETY: `p` came from cuMemHostAlloc just now and nothing uses it.
                if let Err(e) = unsafe { ffi::mem_free_host(p.cast()) } {
                    tracing::warn!(error = %e, "freeing a misaligned pinned allocation failed; leaked");
                }
                return Err(Error::Misaligned {
                    what: "pinned allocation",
                    value: p as u64,
                    align: align_of::<T>() as u64,
                });
            }
            let p = NonNull::new(p).ok_or(Error::OutOfMemory {
                ctx: cumem_sys::ErrorContext::op("cuMemHostAlloc"),
                report: None,
            })?;
            init(p.as_ptr());
            (p, true)
        };
        // SAFETY: `ptr` is aligned and holds `len` values that `init` initialised (or takes no
        // bytes); the buffer owns the allocation, uses it only through the span, and its `Drop`
        // frees it only after `wait_idle_mut` has succeeded.
        let span = unsafe { HostSpan::new(ptr, len, access) };
        Ok(PinnedBuffer { span, allocated, flags, ctx: ctx.clone() })
    }
}

impl<T> PinnedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.span.len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.span.is_empty()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.span.bytes()
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> PinnedFlags {
        self.flags
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Host address of the first element. Reading or writing through it races with pending
    /// device work; use the slice accessors.
    pub fn as_ptr(&self) -> *const T {
        self.span.as_ptr()
    }

    /// The host values, after any pending device write to them has completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.span.as_slice()
    }

    /// The host values for writing, after all pending device work on them has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.span.as_mut_slice()
    }

    /// A copy of the host values, after any pending device write.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Copy,
    {
        self.span.to_vec()
    }

    /// Blocks until no device work uses the buffer.
    ///
    /// Through `&self` it cannot end the tracking of the first stream that read the buffer since its
    /// last device write (that stream's later reads are tracked without a lock): it waits for that
    /// stream, and so do the next host write and the drop, again, for whatever was queued on it
    /// since; a stream whose later work waits on the host (a host function, a persistent kernel)
    /// must not be the one that reads the buffer. An exclusive wait (`as_mut_slice`) ends it.
    pub fn wait_idle(&self) -> Result<()> {
        self.span.wait_idle()
    }

    /// The pending-work tracker.
    pub(crate) fn access(&self) -> &HostAccess {
        self.span.access()
    }

    /// Queues device work that reads the buffer on `stream`.
    ///
    /// `stream` is first ordered after any pending device write; `enqueue` receives the host
    /// pointer and length and queues the work; `stream` is tracked as a reader, so later host
    /// writes (and the buffer's drop) synchronise it, which covers the read.
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, and that work only reads, at most `len` values
    ///    from the pointer it is given.
    pub unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.span.device_read(stream, enqueue) }
    }

    /// Queues device work that writes the buffer on `stream`.
    ///
    /// `stream` is first ordered after all pending device reads and writes and tracked as the
    /// writer, so every later host access (and the drop) synchronises it, which covers the work.
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, writing at most `len` values through the pointer
    ///    it is given, and only bytes that are valid values of `T`.
    pub unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.span.device_write(stream, enqueue) }
    }
}

// SAFETY: the memory is cuMemHostAlloc'd (page-locked) and holds `len` initialised values; host
// access, drop and new device work all go through `access`, which waits as required.
unsafe impl<T> HostMemory<T> for PinnedBuffer<T> {
    fn len(&self) -> usize {
        self.span.len()
    }

    unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { PinnedBuffer::device_read(self, stream, enqueue) }
    }

    unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { PinnedBuffer::device_write(self, stream, enqueue) }
    }
}

impl<T> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.span.ptr())
            .field("len", &self.span.len())
            .field("flags", &self.flags)
            .finish()
    }
}

impl<T> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // Lock-free (exclusive access), so a buffer dropped inside another memory's `queue_on`
        // closure is still freed when its work is done.
        if let Err(e) = self.span.wait_idle_mut() {
            // Freeing memory that the device may still write would be unsound: leak it instead.
            tracing::warn!(error = %e, bytes = self.bytes(), "waiting for device work on a pinned buffer failed; leaking it");
            return;
        }
        if !self.allocated {
            return;
        }
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuMemHostAlloc, is freed once, and no device work or Rust
            // reference uses it any more (waited for above; `&mut self`).
            unsafe { ffi::mem_free_host(self.span.ptr().as_ptr().cast()) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}
