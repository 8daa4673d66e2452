//! `HostRegistered<'a, T>`: an existing `&mut [T]` page-locked for as long as the value lives.
//!
//! `cuMemHostRegister` pins memory the program already has (a `Vec`, an mmap'd file), so that
//! asynchronous copies can use it without a staging copy. The registration borrows the slice
//! exclusively, tracks device work like a [`PinnedBuffer`](crate::PinnedBuffer) (host access waits
//! for it), and on drop waits for that work and unregisters the range. Registering a range that
//! overlaps a registered one is `HostMemoryAlreadyRegistered`; the driver pins whole pages, so on
//! a GPU two disjoint slices that share a page may collide too (whether they do is not settled,
//! `driver-api.md` §15; the simulator compares bytes): register page-aligned slices, or one slice
//! around both, where that matters. A device without host registration gives `NotSupported {
//! feature: HostRegister }` before any driver call.
//!
//! The memory is the caller's, so it must not be handed back while the device may still use it,
//! even if the registration is leaked (`mem::forget` ends the borrow without running `Drop`). The
//! safe entry point is therefore a scope, [`HostRegistered::scope`], which waits for all device
//! work before it returns; [`HostRegistered::new`] is `unsafe` for callers who can promise not
//! to leak the value.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, HostRegistered};
//! let ctx = Device::get(0)?.context()?;
//! let mut data = vec![7u64; 1024];
//! let sum = HostRegistered::scope(&ctx, &mut data, |reg| {
//!     reg.as_mut_slice()?[0] = 1;          // waits for device work on the range, if any
//!     Ok(reg.as_slice()?.iter().sum::<u64>())
//! })?;
//! assert_eq!(sum, 1 + 7 * 1023);
//! assert_eq!(data[0], 1);                  // unregistered, and the borrow is back
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use cumem_sys::sys::{CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE};

use crate::buffer::host_span::HostSpan;
use crate::{Context, Feature, HostAccess, HostMemory, Result, Stream, ffi};

/// Flags of a host registration (`cuMemHostRegister`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegisterFlags {
    /// Pinned for every context, not only the registering one.
    pub portable: bool,
    /// Mapped into the device address space (needs a device that can map host memory).
    pub device_mapped: bool,
}

impl RegisterFlags {
    /// The `CU_MEMHOSTREGISTER_*` bits.
    pub fn bits(&self) -> u32 {
        let mut bits = 0;
        if self.portable {
            bits |= CU_MEMHOSTREGISTER_PORTABLE;
        }
        if self.device_mapped {
            bits |= CU_MEMHOSTREGISTER_DEVICEMAP;
        }
        bits
    }
}

/// An exclusively borrowed host slice, page-locked until the value is dropped.
pub struct HostRegistered<'a, T> {
    /// The borrowed values and their pending-work tracker (`Send`/`Sync` like `&mut [T]` through it).
    span: HostSpan<T>,
    /// Whether the driver registered the range (false for zero bytes).
    registered: bool,
    flags: RegisterFlags,
    ctx: Context,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<T> HostRegistered<'_, T> {
    /// Registers `data` with default flags, runs `f` with the registration, then waits for all
    /// device work on it and unregisters it.
    ///
    /// The borrow of `data` ends when this returns, so the device must be done with it by then:
    /// when neither waiting for the tracked work nor synchronising the contexts of the streams
    /// whose wait failed (and the registration's own) succeeds (a sticky
    /// error left by some kernel), nothing proves it is, and the process aborts (logged with
    /// `tracing::error!` first) rather than hand the slice back to code that could free it.
    pub fn scope<R>(
        ctx: &Context,
        data: &mut [T],
        f: impl FnOnce(&mut HostRegistered<'_, T>) -> Result<R>,
    ) -> Result<R> {
        Self::scope_with_flags(ctx, data, RegisterFlags::default(), f)
    }

    /// Like [`HostRegistered::scope`], with explicit flags.
    pub fn scope_with_flags<R>(
        ctx: &Context,
        data: &mut [T],
        flags: RegisterFlags,
        f: impl FnOnce(&mut HostRegistered<'_, T>) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: the registration lives in this frame and is dropped (never leaked) before the
        // borrow of `data` ends; `f` only gets a reference to it.
        let mut reg = unsafe { HostRegistered::with_flags(ctx, data, flags)? };
        let out = f(&mut reg);
        // Lock-free (exclusive access), so a scope inside another memory's `queue_on` closure
        // returns what `f` returned rather than a refusal of the wait.
        let waited = reg.span.wait_idle_mut();
        drop(reg);
        let out = out?;
        waited.map(|()| out)
    }
}

impl<'a, T> HostRegistered<'a, T> {
    /// Registers `data` with default flags until the value is dropped.
    ///
    /// # Safety
    /// 1. The value is dropped, not leaked (`mem::forget`, a reference cycle), before `'a` ends:
    ///    its `Drop` is what keeps the device from using `data` after the borrow is returned.
    pub unsafe fn new(ctx: &Context, data: &'a mut [T]) -> Result<Self> {
        // SAFETY: forwarded contract.
        unsafe { Self::with_flags(ctx, data, RegisterFlags::default()) }
    }

    /// Registers `data` with explicit flags until the value is dropped.
    ///
    /// # Safety
    /// 1. As for [`HostRegistered::new`].
    pub unsafe fn with_flags(ctx: &Context, data: &'a mut [T], flags: RegisterFlags) -> Result<Self> {
        let caps = ctx.device().capabilities()?;
        caps.require(Feature::HostRegister)?;
        if flags.device_mapped {
            caps.require(Feature::HostMapping)?;
        }
        let len = data.len();
        let bytes = size_of_val(data);
        let ptr = NonNull::from(data).cast::<T>();
        let registered = bytes > 0;
        if registered {
            ctx.bind()?;
            // SAFETY: the range is the borrowed slice, which stays allocated for `'a`; it is
            // unregistered in `Drop`, which the caller promises runs before `'a` ends.
            unsafe { ffi::mem_host_register(ptr.as_ptr().cast(), bytes, flags.bits())? };
        }
        // SAFETY: the slice is borrowed exclusively for `'a` and initialised; it is used only through
        // the span, and `Drop` (which the caller promises runs before `'a` ends) hands it back only
        // after `wait_idle_mut` (or, failing that, the synchronisation of every context still in use) has succeeded.
        let span = unsafe { HostSpan::new(ptr, len, HostAccess::new()) };
        Ok(HostRegistered { span, registered, flags, ctx: ctx.clone(), _borrow: PhantomData })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.span.len()
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.span.is_empty()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.span.bytes()
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> RegisterFlags {
        self.flags
    }

    /// The context it was registered in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Host address of the first element. Reading or writing through it races with pending
    /// device work; use the slice accessors.
    pub fn as_ptr(&self) -> *const T {
        self.span.as_ptr()
    }

    /// The values, after any pending device write to them has completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.span.as_slice()
    }

    /// The values for writing, after all pending device work on them has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.span.as_mut_slice()
    }

    /// A copy of the values, after any pending device write.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Copy,
    {
        self.span.to_vec()
    }

    /// Blocks until no device work uses the slice.
    ///
    /// Through `&self` it cannot end the tracking of the first stream that read the slice since its
    /// last device write (that stream's later reads are tracked without a lock): it waits for that
    /// stream, and so do the next host write and the end of the registration, again, for whatever was queued on it
    /// since; a stream whose later work waits on the host (a host function, a persistent kernel)
    /// must not be the one that reads the slice. An exclusive wait (`as_mut_slice`) ends it.
    pub fn wait_idle(&self) -> Result<()> {
        self.span.wait_idle()
    }
}

// SAFETY: the range is registered (page-locked) for as long as the value lives and holds `len`
// initialised values; host access and the drop go through `access`, which waits as required.
unsafe impl<T> HostMemory<T> for HostRegistered<'_, T> {
    fn len(&self) -> usize {
        self.span.len()
    }

    unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.span.device_read(stream, enqueue) }
    }

    unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.span.device_write(stream, enqueue) }
    }
}

impl<T> fmt::Debug for HostRegistered<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistered")
            .field("ptr", &self.span.ptr())
            .field("len", &self.span.len())
            .field("flags", &self.flags)
            .finish()
    }
}

impl<T> Drop for HostRegistered<'_, T> {
    fn drop(&mut self) {
        if let Err(e) = self.span.wait_idle_mut() {
            // The memory goes back to its owner when this returns, so it cannot be leaked like a
            // pinned buffer: wait for the whole context of every stream still using it instead
            // (a portable registration is used by other devices' streams too; the wait went on
            // past the failure, so only the streams it could not wait for are left), and if even
            // that fails, stop the process rather than let a device use memory that safe code may
            // use again. cuMemHostUnregister is not relied on to wait: the driver only says it
            // unpins the range.
            tracing::warn!(error = %e, bytes = self.bytes(), "waiting for device work on a registered range failed; synchronising the contexts of the streams still using it");
            if let Err(e) = self.span.access().synchronize_contexts(&self.ctx) {
                tracing::error!(error = %e, "cannot prove the devices are done with a registered host range; aborting");
                std::process::abort();
            }
        }
        if !self.registered {
            return;
        }
        let result = self.ctx.bind().and_then(|()| {
            // SAFETY: `ptr` is the base this value registered, unregistered once; no device work
            // uses it any more (waited for above).
            unsafe { ffi::mem_host_unregister(self.span.ptr().as_ptr().cast()) }
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, "cuMemHostUnregister failed; the range stays page-locked");
        }
    }
}
