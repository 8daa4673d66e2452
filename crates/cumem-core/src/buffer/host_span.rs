//! `HostSpan<T>`: the host side that every page-locked host kind shares.
//!
//! [`PinnedBuffer`](crate::PinnedBuffer) (and through it [`MappedBuffer`](crate::MappedBuffer)) and
//! [`HostRegistered`](crate::HostRegistered) differ in where their memory comes from and how they
//! give it back, but not in how the host reaches it: a pointer to `len` values, and a
//! [`HostAccess`] tracker that every host access waits on first. That part lives here once, with
//! its `unsafe` blocks; each kind keeps its own constructor, `Drop` and public methods, which
//! delegate to the span. The span frees nothing: its owner waits for [`HostSpan::wait_idle_mut`]
//! in its `Drop` before it frees or returns the memory.

use std::ptr::NonNull;

use crate::{HostAccess, Result, Stream};

/// `len` values of `T` in host memory that the device may use, with the tracker of that use.
pub(crate) struct HostSpan<T> {
    ptr: NonNull<T>,
    len: usize,
    access: HostAccess,
}

// SAFETY: the span stands for exclusive access to its values, like `&mut [T]`; host access goes
// through `&self`/`&mut self` and waits for device work first.
unsafe impl<T: Send> Send for HostSpan<T> {}
// SAFETY: shared access only hands out `&[T]` (after waiting for device writes) and queues device
// reads, like `&[T]`.
unsafe impl<T: Sync> Sync for HostSpan<T> {}

impl<T> HostSpan<T> {
    /// A span over `len` values at `ptr`, tracked by `access`.
    ///
    /// # Safety
    /// 1. `ptr` is aligned and points to `len` initialised values of `T`, valid for reads and
    ///    writes for as long as the span lives (any aligned pointer will do when they take no bytes).
    /// 2. While the span lives, the values are used only through it.
    /// 3. The owner frees or gives back the memory only once no device work queued through the
    ///    span can still use it: after [`HostSpan::wait_idle_mut`] has succeeded (or a wait that covers
    ///    more, such as synchronising the whole context).
    pub(crate) unsafe fn new(ptr: NonNull<T>, len: usize, access: HostAccess) -> Self {
        HostSpan { ptr, len, access }
    }

    /// Number of values.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no values.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Address of the first value, for the owner's driver calls (allocation, free, registration).
    pub(crate) fn ptr(&self) -> NonNull<T> {
        self.ptr
    }

    /// Host address of the first value.
    pub(crate) fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// The values, after any pending device write to them has completed.
    pub(crate) fn as_slice(&self) -> Result<&[T]> {
        self.access.wait_writes()?;
        // SAFETY: `ptr` holds `len` initialised values (`new`'s item 1) used only through the span
        // (item 2); no device work writes them any more, and queueing a device write needs
        // `&mut self`, which cannot coexist with the returned borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The values for writing, after all pending device work on them has completed.
    pub(crate) fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.access.wait_idle_mut()?;
        // SAFETY: as in `as_slice`; no device work uses the values any more, and new device work
        // needs a borrow of `self`, which cannot coexist with the returned one.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// A copy of the values, after any pending device write.
    pub(crate) fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Copy,
    {
        Ok(self.as_slice()?.to_vec())
    }

    /// Blocks until no device work uses the values.
    pub(crate) fn wait_idle(&self) -> Result<()> {
        self.access.wait_idle()
    }

    /// [`HostSpan::wait_idle`] for the owner with exclusive access (its drop): takes no lock, so
    /// it also works inside a [`StreamOrder::queue_on`](crate::StreamOrder::queue_on) closure
    /// (see [`HostAccess::wait_idle_mut`]).
    pub(crate) fn wait_idle_mut(&mut self) -> Result<()> {
        self.access.wait_idle_mut()
    }

    /// The pending-work tracker.
    pub(crate) fn access(&self) -> &HostAccess {
        &self.access
    }

    /// Queues device work that reads the values on `stream` (see [`HostAccess::device_read`]).
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, and that work only reads, at most `len` values
    ///    from the pointer it is given.
    pub(crate) unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: `ptr` holds `len` values that outlive the pending work (`new`'s items 1 and 3:
        // the owner waits for it before freeing); the caller's item 1 is the tracker's item 2.
        unsafe { self.access.device_read(stream, self.ptr.as_ptr(), self.len, enqueue) }
    }

    /// Queues device work that writes the values on `stream` (see [`HostAccess::device_write`]).
    ///
    /// # Safety
    /// 1. `enqueue` queues work on `stream` only, writing at most `len` values through the pointer
    ///    it is given, and only bytes that are valid values of `T`.
    pub(crate) unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: as in `device_read`; `&mut self` rules out live host borrows, and every other use
        // of the values goes through the span (`new`'s item 2).
        unsafe { self.access.device_write(stream, self.ptr.as_ptr(), self.len, enqueue) }
    }
}
