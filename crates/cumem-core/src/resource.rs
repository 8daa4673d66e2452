//! The resource trait every device buffer allocates from, and the driver's own allocator.
//!
//! A [`DeviceResource`] hands out device memory for a layout on a stream as an [`Allocation`] (the
//! address and an opaque token the resource chooses), and takes the allocation back on the stream
//! where it was last used, so that stream-ordered resources (pools) can reuse it in stream order.
//! The token carries what the free needs (a pool's segment, a padded allocation's base), so no
//! resource has to look addresses up in a table. Adaptors and pools in `cumem-pool` implement the same trait and wrap any other resource,
//! as RMM's resources do. [`DriverResource`] is `cuMemAlloc`/`cuMemFree`.
//!
//! ```
//! # cumem_sys::testing::init();
//! use std::sync::Arc;
//! use cumem_core::{DeviceBuffer, Device, DriverResource, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let resource = Arc::new(DriverResource::new(&ctx));
//! let buf = DeviceBuffer::<u32>::zeroed_in(&resource, &stream, 1024)?;
//! assert_eq!(buf.to_vec()?, vec![0; 1024]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;

use cumem_sys::sys::CUdeviceptr;

use crate::{Context, Error, IntoDynResource, Result, Stream, ffi};

/// Size and alignment of a device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocLayout {
    /// Bytes requested (non-zero).
    pub bytes: usize,
    /// Required alignment of the address, a power of two.
    pub align: usize,
}

/// Checks that an alignment is a power of two: zero is `ZeroSize`, any other value that is not a
/// power of two is `InvalidValue` naming it (it is not "misaligned": no multiple would make it
/// valid).
pub fn check_power_of_two(align: usize) -> Result<()> {
    if align == 0 {
        return Err(Error::ZeroSize { what: "alignment" });
    }
    if !align.is_power_of_two() {
        return Err(Error::InvalidValue {
            ctx: crate::ErrorContext::op("an alignment that is not a power of two").bytes(align),
        });
    }
    Ok(())
}

impl AllocLayout {
    /// A layout, checked: `bytes` must be non-zero and `align` a power of two.
    pub fn new(bytes: usize, align: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::ZeroSize { what: "allocation size" });
        }
        check_power_of_two(align)?;
        Ok(AllocLayout { bytes, align })
    }

    /// The layout of `len` values of `T`, with at least `T`'s alignment.
    pub fn array<T>(len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::SizeOverflow { count: len, elem_size: size_of::<T>() })?;
        AllocLayout::new(bytes, align_of::<T>())
    }
}

/// Memory handed out by a [`DeviceResource`]: its address and what the resource needs to free it.
///
/// The holder keeps the value unchanged and gives it back to the same resource's
/// [`deallocate`](DeviceResource::deallocate) once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// Device address of the memory.
    pub ptr: CUdeviceptr,
    /// Opaque to everyone but the resource that chose it (a pool's segment, a base address).
    pub token: [u64; 2],
}

impl Allocation {
    /// An allocation whose free needs nothing but the address.
    #[inline]
    pub const fn from_ptr(ptr: CUdeviceptr) -> Self {
        Allocation { ptr, token: [0; 2] }
    }
}

/// A source of device memory.
///
/// # Safety
/// Implementors promise that
/// 1. `allocate` returns an [`Allocation`] whose `ptr` is the address of at least `layout.bytes`
///    bytes of device memory of `self.context()`'s device, aligned to `layout.align`, overlapping no
///    other live allocation;
/// 2. that memory is usable by work queued on `stream` after the call returns (and by work on other
///    streams once ordered after `stream`), and stays valid until the allocation is passed to
///    `deallocate`;
/// 3. `deallocate` relies on nothing but its documented contract: any token `allocate` returned,
///    passed back unchanged, frees exactly that allocation;
/// 4. if [`usable_on_every_stream_at_once`](Self::usable_on_every_stream_at_once) returns `true`,
///    the memory `allocate` returns may be used by work queued on any stream that can reach it
///    (those of the context, and of other contexts with access to the device's memory) and by the
///    host, for copies, as soon as `allocate` returns, with no ordering after `stream`.
pub unsafe trait DeviceResource: Send + Sync + fmt::Debug + IntoDynResource {
    /// The context whose device the memory belongs to.
    fn context(&self) -> &Context;

    /// Allocates memory for `layout`, usable in stream order on `stream`.
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation>;

    /// Returns memory to the resource. Failures are logged, not returned, as this runs in `Drop`.
    ///
    /// `stream` may belong to another context than [`context`](Self::context) (memory last used
    /// by a peer device's stream). An implementation then either frees through that stream's own
    /// context (waiting for it, or recording on it in its context), or orders a stream of its own
    /// context after it before freeing there: a special handle such as the legacy stream's NULL
    /// names the *current* context's stream, so passing `stream.raw()` while another context is
    /// bound would free out of order. If neither the ordering nor a wait for `stream` succeeds, it
    /// leaks the memory (logging why) rather than free it unordered.
    ///
    /// # Safety
    /// 1. `allocation` was returned by `allocate` on this resource with this `layout`, is passed
    ///    back unchanged (address and token), and is returned once.
    /// 2. All work that uses the memory has been queued on `stream` (or ordered before work queued
    ///    on it next); the resource may hand the memory to work queued on `stream` after this call.
    /// 3. No Rust value refers to the memory afterwards.
    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream);

    /// Whether memory returned by [`allocate`](Self::allocate) may be used on any stream that can
    /// reach it as soon as `allocate` returns, not only in order on the stream it was asked for
    /// (`cuMemAlloc`'s memory is; a stream-ordered pool's is not). `false`, the default, is always
    /// safe: a caller that hands the memory to other streams then orders them after `stream` (or
    /// synchronises it) first. An adaptor that only forwards to another resource answers what
    /// that resource answers. A resource answering `true` promises item 4 of the trait's safety
    /// contract.
    fn usable_on_every_stream_at_once(&self) -> bool {
        false
    }

    /// What the resource keeps cached for reuse, for a resource that caches and can tell (the
    /// caching pool); `None`, the default, for one that does not (`DriverResource`) or cannot
    /// tell (the driver's pools report no free-block sizes). An adaptor that only forwards to
    /// another resource answers what that resource answers, so cumem-pool's `StatisticsResource` over a
    /// caching pool reports its fragmentation.
    fn cache_usage(&self) -> Option<CacheUsage> {
        None
    }
}

/// What a caching resource holds from its upstream and keeps for reuse, in bytes
/// ([`DeviceResource::cache_usage`]).
///
/// ```
/// use cumem_core::CacheUsage;
/// let usage = CacheUsage { reserved_bytes: 8 << 20, cached_bytes: 4 << 20, largest_free_block: 1 << 20 };
/// assert_eq!(usage.fragmentation(), 0.75);
/// assert_eq!(CacheUsage::default().fragmentation(), 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheUsage {
    /// Bytes held from the upstream (in use or cached).
    pub reserved_bytes: u64,
    /// Of those, bytes not in use: kept for reuse (for the caching pool, stranded bytes too,
    /// which it reuses only after its next synchronisation).
    pub cached_bytes: u64,
    /// The largest contiguous cached block.
    pub largest_free_block: u64,
}

impl CacheUsage {
    /// `1 - largest_free_block / cached_bytes`: 0 when all cached memory is one block (or there is
    /// none), close to 1 when it is in many small pieces (a large request may then fail although
    /// enough bytes are cached). Kept in `0..=1` when the figures were read at different moments.
    pub fn fragmentation(&self) -> f64 {
        if self.cached_bytes == 0 {
            0.0
        } else {
            (1.0 - self.largest_free_block as f64 / self.cached_bytes as f64).clamp(0.0, 1.0)
        }
    }
}

/// The alignment `cuMemAlloc` guarantees.
///
/// Only 256 bytes are documented; real GPUs return at least 512-byte aligned addresses, and 2 MiB
/// aligned ones from 2 MiB up (the simulator models that). [`DriverResource`] relies on the
/// documented value only, but keeps an exact-size allocation whenever its address happens to be
/// aligned enough.
pub const DRIVER_ALIGNMENT: usize = 256;

/// The alignment real drivers give every `cuMemAlloc` (observed, not documented).
const OBSERVED_ALIGNMENT: usize = 512;
/// From this size up, real drivers align `cuMemAlloc` to this size (observed, not documented).
const LARGE_ALLOCATION: usize = 2 << 20;

/// `cuMemAlloc` and `cuMemFree`: simple, slow, and synchronising on free.
///
/// Alignments up to [`DRIVER_ALIGNMENT`] cost nothing extra. A larger alignment first tries the
/// exact size and keeps it when the driver's address is aligned enough, which on current GPUs is
/// always the case for 512 bytes and, from 2 MiB up, for 2 MiB; so a 2 MiB segment aligned to 512
/// costs 2 MiB, not the 4 MiB the driver would charge for 2 MiB + 511 bytes. Other alignments
/// (and a trial that misses, which is freed) are padded by `align - 256` bytes and rounded up.
#[derive(Debug, Clone)]
pub struct DriverResource {
    ctx: Context,
}

impl DriverResource {
    /// The driver allocator of `ctx`'s device.
    pub fn new(ctx: &Context) -> Self {
        DriverResource { ctx: ctx.clone() }
    }
}

// SAFETY: cuMemAlloc returns fresh, non-overlapping memory aligned to 256 bytes. A larger
// alignment is served either by an exact-size allocation whose address is checked to be aligned,
// or by over-allocating `align - 256` bytes and rounding the 256-aligned base up, which stays
// inside the allocation; in both cases the token carries the base cuMemAlloc returned, for the free.
// The free first waits for the stream that follows every use, so memory is never freed under
// pending work. cuMemAlloc is not stream-ordered: the memory is usable everywhere once it returns
// (item 4), and the padded path only adds an offset into it.
unsafe impl DeviceResource for DriverResource {
    fn context(&self) -> &Context {
        &self.ctx
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        let allocation = self.allocate_bound(layout)?;
        // Fields are evaluated only when trace is enabled for this target.
        tracing::trace!(
            device = self.ctx.device().ordinal(),
            stream = stream.id(),
            bytes = layout.bytes,
            ptr = allocation.ptr,
            "allocate"
        );
        Ok(allocation)
    }

    /// `cuMemAlloc` is synchronous: its memory is usable on every stream at once.
    fn usable_on_every_stream_at_once(&self) -> bool {
        true
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        tracing::trace!(
            device = self.ctx.device().ordinal(),
            stream = stream.id(),
            bytes = layout.bytes,
            ptr = allocation.ptr,
            "free"
        );
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.free_after(allocation, layout, stream) }
    }
}

impl DriverResource {
    /// `cuMemAlloc` in this resource's context, padded where the driver's alignment falls short.
    fn allocate_bound(&self, layout: AllocLayout) -> Result<Allocation> {
        let layout = AllocLayout::new(layout.bytes, layout.align)?;
        let device = self.ctx.device().ordinal() as i32;
        self.ctx.bind()?;
        if layout.align <= DRIVER_ALIGNMENT {
            return ffi::mem_alloc(layout.bytes, device).map(Allocation::from_ptr);
        }
        // Try the exact size only where real drivers are seen to align that far: a miss costs a
        // `cuMemFree`, which waits for the whole device and holds up other threads' work
        // (driver-api.md §17), so a request no driver aligns is padded at once.
        if layout.align <= OBSERVED_ALIGNMENT
            || (layout.bytes >= LARGE_ALLOCATION && layout.align <= LARGE_ALLOCATION)
        {
            let exact = ffi::mem_alloc(layout.bytes, device)?;
            if exact.is_multiple_of(layout.align as u64) {
                return Ok(Allocation { ptr: exact, token: [exact, 0] });
            }
            // Not aligned enough after all: give the trial back first, so the padded request
            // can use its memory.
            // SAFETY: `exact` was returned by cuMemAlloc just above in the bound context, is freed
            // once, and was never handed out or used.
            unsafe { ffi::mem_free(exact) }.inspect_err(|e| {
                tracing::warn!(ptr = exact, bytes = layout.bytes, error = %e, "freeing a misaligned trial allocation failed; it is leaked");
            })?;
        }
        let padded = layout
            .bytes
            .checked_add(layout.align - DRIVER_ALIGNMENT)
            .ok_or(Error::SizeOverflow { count: layout.bytes, elem_size: 1 })?;
        let base = ffi::mem_alloc(padded, device)?;
        Ok(Allocation { ptr: base.next_multiple_of(layout.align as u64), token: [base, 0] })
    }

    /// Frees `allocation` once `stream`'s work is done.
    ///
    /// # Safety
    /// 1. The caller upholds items 1–3 of [`DeviceResource::deallocate`] for these arguments:
    ///    `allocation` came from this resource's `allocate` with `layout` and is returned once,
    ///    every use of it is ordered before work queued on `stream` next, and no Rust value
    ///    refers to it any more.
    unsafe fn free_after(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        let ptr = allocation.ptr;
        // The driver only says cuMemFree *may* wait for the device; every use of the memory is
        // ordered before work queued on `stream` next (deallocate's item 2), so waiting for `stream`
        // is what makes the free safe. If that fails, leaking is the safe answer.
        if let Err(e) = stream.synchronize() {
            tracing::warn!(ptr, bytes = layout.bytes, error = %e, "waiting for the last stream failed; leaking");
            return;
        }
        // The token of an over-aligned allocation holds the base cuMemAlloc returned.
        let base = if layout.align <= DRIVER_ALIGNMENT { ptr } else { allocation.token[0] };
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: `base` is the address cuMemAlloc returned for this allocation, freed once
            // (deallocate's item 1), no Rust value uses it any more (its item 3), and the work
            // using it has completed (above).
            unsafe { ffi::mem_free(base) }
        });
        if let Err(e) = result {
            tracing::warn!(ptr, bytes = layout.bytes, error = %e, "cuMemFree failed; the memory is leaked");
        }
    }
}
