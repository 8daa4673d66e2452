//! A driver memory pool as a [`DeviceResource`]: `cuMemAllocFromPoolAsync` / `cuMemFreeAsync`.
//!
//! Allocation and free are stream-ordered: a buffer's memory returns to the pool on the stream the
//! buffer was last used on, and the pool reuses it in stream order. When that stream belongs to
//! another context (a peer device's stream, last to use the memory), the free is queued on a
//! stream of the pool's own context that the resource keeps, ordered after that stream first.
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

use cumem_core::{AllocLayout, Allocation, Context, DeviceResource, Error, HomeStream, Result, Stream};

use crate::{MemPool, ffi};

/// The alignment pool allocations are known to have without padding.
const POOL_ALIGNMENT: usize = 256;

/// Runs `call`, a `cuMemAllocFromPoolAsync` or `cuMemFreeAsync` on `stream`, first without making
/// `ctx` current, and again after binding it if that fails while another context (or none) is
/// current: binding costs a `cuCtxGetCurrent` per call, as much as a tenth of the call itself.
///
/// Why every outcome on a real driver is right:
/// - Both calls name everything they act on: the pool (hence the device whose memory is
///   allocated), the pointer, and the stream (hence the context and device the work is ordered
///   in). The current context only resolves a special stream handle (NULL, `CU_STREAM_LEGACY`,
///   `CU_STREAM_PER_THREAD`: the current context's default streams), and the header lists
///   `INVALID_CONTEXT` for these calls only for the default stream with no context current
///   (driver-api.md G2). So a special handle is never passed unbound: the first try happens only
///   for a created stream, whose work cannot land anywhere else whatever is current.
/// - Only a failure that a context check gives is tried again: `INVALID_CONTEXT`,
///   `CONTEXT_IS_DESTROYED` and `INVALID_HANDLE` come from the checks that precede all work
///   (driver-api.md G3), so that call did nothing and the retry cannot do the work twice. Any
///   other failure stands, as it would have with the bind first: both calls carry `\notefnerr`
///   ("may also return error codes from previous, asynchronous launches"), and nothing says such
///   an answer comes before the work, so a `cuMemFreeAsync` answering one may have freed the
///   block, and freeing it again could free the block the pool has handed out since (to another
///   stream, another thread). If the right context was current already, no failure is retried.
/// - A driver that checks the stream against the current context (not documented, not observed)
///   fails the first try with one of those check errors; the retry, bound as before, then gives
///   the answer the bound call always gave.
fn unbound_first<T>(ctx: &Context, stream: &Stream, call: impl Fn() -> Result<T>) -> Result<T> {
    // NULL, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) resolve through the current context.
    if stream.raw() as usize > 2 {
        match call() {
            Ok(done) => return Ok(done),
            Err(e) => {
                let from_a_check = matches!(
                    e,
                    Error::InvalidContext { .. }
                        | Error::ContextIsDestroyed { .. }
                        | Error::InvalidHandle { .. }
                );
                // Unknown whether our context was current (the question failed): the answer stands.
                if !from_a_check || ctx.is_current().unwrap_or(true) {
                    return Err(e);
                }
            }
        }
    }
    ctx.bind()?;
    call()
}

/// A [`MemPool`] serving [`DeviceResource`] requests.
///
/// Alignments above 256 bytes first try the exact size and keep it when the pool's address is
/// aligned enough (the driver's pools hand out 512-byte granules, so 512 always is); otherwise the
/// trial goes back to the pool in stream order and the request is padded by `align - 256` bytes.
///
/// Memory whose last stream belongs to another context is freed on a non-blocking stream of the
/// pool's context, created at the first such free and kept, after that stream's work so far.
#[derive(Debug)]
pub struct NativePoolResource {
    /// Where memory last used on another context's stream is freed (see `free_after_foreign`).
    /// Destroyed before the pool here, though either order is sound: the driver lets a pool be
    /// destroyed with frees still queued, and releases it once they have run.
    home: HomeStream,
    pool: MemPool,
}

impl NativePoolResource {
    /// Serves allocations from `pool`.
    pub fn new(pool: MemPool) -> Self {
        NativePoolResource { pool, home: HomeStream::new() }
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

impl NativePoolResource {
    /// One trace event per allocation or free, with the fields the other resources give (read
    /// only when trace is enabled for this target).
    #[inline]
    fn trace(device: i32, stream: &Stream, bytes: usize, ptr: u64, what: &'static str) {
        tracing::trace!(device, stream = stream.id(), bytes, ptr, "{what}");
    }

    /// Frees `base`, whose uses are all ordered before work queued on `stream` next, when
    /// `stream` belongs to another context than the pool's: on the resource's [`HomeStream`],
    /// ordered after `stream`, or leaked with a warning when no ordering can be proven (rather
    /// than freed under its uses).
    ///
    /// # Safety
    /// 1. `base` came from `cuMemAllocFromPoolAsync` on this resource's pool and is freed once.
    /// 2. Every use of it is ordered before work queued on `stream` next.
    unsafe fn free_after_foreign(&self, base: u64, ptr: u64, stream: &Stream) -> Result<()> {
        let ctx = self.pool.context();
        let Some(follower) = self.home.after(ctx, stream) else {
            tracing::warn!(ptr, "the memory is leaked: its last stream's work cannot be waited for");
            return Ok(());
        };
        // SAFETY: `base` is freed once (item 1), and every use is ordered before the free: before
        // work queued on `stream` next (item 2), which `follower` follows.
        unbound_first(ctx, &follower, || unsafe { ffi::mem_free_async(base, follower.raw()) })
    }
}

// SAFETY: cuMemAllocFromPoolAsync returns fresh memory usable in order on the stream, aligned to
// 256 bytes. A larger alignment is served by an exact-size block whose address is checked, or by
// padding `align - 256` bytes and rounding the 256-aligned base up (which stays inside the block);
// the base travels in the allocation's token so it is what gets freed. Frees are stream-ordered on the buffer's last
// stream, as the trait's contract provides, or on a stream of the pool's context ordered after it
// when it belongs to another context.
unsafe impl DeviceResource for NativePoolResource {
    fn context(&self) -> &Context {
        self.pool.context()
    }

    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> Result<Allocation> {
        let layout = AllocLayout::new(layout.bytes, layout.align)?;
        let ctx = self.pool.context();
        let device = ctx.device().ordinal() as i32;
        let exact = unbound_first(ctx, stream, || {
            ffi::mem_alloc_from_pool_async(layout.bytes, self.pool.raw(), stream.raw(), device)
        })?;
        if layout.align <= POOL_ALIGNMENT || exact.is_multiple_of(layout.align as u64) {
            Self::trace(device, stream, layout.bytes, exact, "allocate");
            return Ok(Allocation { ptr: exact, token: [exact, 0] });
        }
        // Not aligned enough: give the trial back in stream order (the pool can reuse it for the
        // padded request at once) and pad.
        // SAFETY: `exact` was allocated on `stream` just above, is freed once, and was never handed
        // out, so no work uses it.
        let freed = unbound_first(ctx, stream, || unsafe { ffi::mem_free_async(exact, stream.raw()) });
        freed.inspect_err(|e| {
            tracing::warn!(ptr = exact, error = %e, "freeing a misaligned trial block failed; it stays in the pool");
        })?;
        let padded = layout
            .bytes
            .checked_add(layout.align - POOL_ALIGNMENT)
            .ok_or(Error::SizeOverflow { count: layout.bytes, elem_size: 1 })?;
        let base = unbound_first(ctx, stream, || {
            ffi::mem_alloc_from_pool_async(padded, self.pool.raw(), stream.raw(), device)
        })?;
        let ptr = base.next_multiple_of(layout.align as u64);
        Self::trace(device, stream, layout.bytes, ptr, "allocate");
        Ok(Allocation { ptr, token: [base, 0] })
    }

    unsafe fn deallocate(&self, allocation: Allocation, layout: AllocLayout, stream: &Stream) {
        // The token holds the base the pool returned (the address itself unless padded).
        let (ptr, base) = (allocation.ptr, allocation.token[0]);
        Self::trace(self.pool.context().device().ordinal() as i32, stream, layout.bytes, ptr, "free");
        let result = if stream.context() == self.pool.context() {
            // SAFETY: `base` came from cuMemAllocFromPoolAsync (caller's item 1), is freed once (a
            // failed try frees nothing), and every use of it is ordered before work queued on
            // `stream` next (item 2).
            unbound_first(self.pool.context(), stream, || unsafe { ffi::mem_free_async(base, stream.raw()) })
        } else {
            // SAFETY: the caller's items 1 and 2, passed on.
            unsafe { self.free_after_foreign(base, ptr, stream) }
        };
        if let Err(e) = result {
            tracing::warn!(ptr, error = %e, "cuMemFreeAsync failed; the memory stays in the pool");
        }
    }
}
