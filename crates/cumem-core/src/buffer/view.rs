//! Borrowed views of device memory, the device analogues of `&[T]` and `&mut [T]`.
//!
//! Views carry the owning buffer's context and stream-order tracker, so work queued through a view
//! is ordered like work on the buffer itself. Out-of-range requests are errors, never panics.
//!
//! Device work that cumem does not queue itself (a kernel, another library's call) goes through
//! one door: [`DeviceSlice::on`] / [`DeviceSliceMut::on`] return a guard holding the raw device
//! pointer and the stream to queue the work on. Taking the guard orders the stream after the
//! memory's earlier users; dropping it orders the memory's later users (another stream, host
//! access, the free) after everything queued on that stream meanwhile. Work queued inside one call
//! can use the scoped form of the door, [`DeviceSlice::queue_on`] / [`DeviceSliceMut::queue_on`]
//! (the same ordering, cheaper), as cumem's own copies do. See `docs/safety.md` for a kernel
//! launched through it.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{DeviceBuffer, Device, Stream};
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let buf = DeviceBuffer::from_slice(&stream, &[1u32, 2, 3, 4, 5])?;
//! let (head, tail) = buf.split_at(2)?;
//! assert_eq!(head.to_vec()?, [1, 2]);
//! assert_eq!(tail.slice(1..)?.to_vec()?, [4, 5]);
//! let lens: Vec<usize> = buf.chunks(2)?.map(|c| c.len()).collect();
//! assert_eq!(lens, [2, 2, 1]);
//! assert!(buf.slice(4..9).is_err());
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use bytemuck::{AnyBitPattern, Pod};
use cumem_sys::sys::CUdeviceptr;

use crate::{Context, Error, OrderTicket, Result, Stream, StreamOrder, ffi};

/// A shared view of device memory holding `len` values of `T`.
pub struct DeviceSlice<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    order: &'a StreamOrder,
    ctx: &'a Context,
    _marker: PhantomData<&'a [T]>,
}

/// An exclusive view of device memory holding `len` values of `T`.
pub struct DeviceSliceMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    order: ViewOrder<'a>,
    ctx: &'a Context,
    _marker: PhantomData<&'a mut [T]>,
}

/// How an exclusive view reaches its memory's order.
///
/// `Exclusive` when the view is the only way to the order for its whole life: made from an owner
/// that holds its order by value and shares it with nothing (`DeviceBuffer::as_mut_slice`), or
/// passed on from such a view to exactly one other (a reborrow, one sub-view), never to two. Work
/// queued through it then skips the order's lock ([`StreamOrder::queue_on_mut`]). Views that can
/// exist side by side (the halves of a split, chunks) get `Shared`, and lock: two of them may be
/// used from two threads at once.
enum ViewOrder<'a> {
    Shared(&'a StreamOrder),
    Exclusive(&'a mut StreamOrder),
}

impl<'a> ViewOrder<'a> {
    fn get(&self) -> &StreamOrder {
        match self {
            ViewOrder::Shared(order) => order,
            ViewOrder::Exclusive(order) => order,
        }
    }

    /// The same access for a shorter life; the original is unusable meanwhile.
    fn reborrow(&mut self) -> ViewOrder<'_> {
        match self {
            ViewOrder::Shared(order) => ViewOrder::Shared(order),
            ViewOrder::Exclusive(order) => ViewOrder::Exclusive(order),
        }
    }

    /// Shared access for the whole life, for views that may be duplicated.
    fn into_shared(self) -> &'a StreamOrder {
        match self {
            ViewOrder::Shared(order) => order,
            ViewOrder::Exclusive(order) => order,
        }
    }

    /// [`StreamOrder::queue_on`], without the lock where the access is exclusive.
    fn queue_on<R>(&mut self, stream: &Stream, queue: impl FnOnce() -> Result<R>) -> Result<R> {
        match self {
            ViewOrder::Shared(order) => order.queue_on(stream, queue),
            // The borrow checker's proof that nothing else reaches the order while the view
            // lives, spelled out where the lock is skipped, in `StreamOrder::queue_on_mut`.
            ViewOrder::Exclusive(order) => order.queue_on_mut(stream, queue),
        }
    }
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceSlice<'_, T> {}

/// Resolves a range against a length, as slice indexing does, but as a `Result`: the
/// `(start, end)` it names, or [`Error::OutOfRange`].
///
/// ```
/// assert_eq!(cumem_core::resolve_range(2..=4, 10)?, (2, 5));
/// assert!(cumem_core::resolve_range(8..12, 10).is_err());
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub fn resolve_range(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1).ok_or(Error::OutOfRange { start: s, end: s, len })?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1).ok_or(Error::OutOfRange { start, end: e, len })?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfRange { start, end, len });
    }
    Ok((start, end))
}

fn offset<T>(ptr: CUdeviceptr, elems: usize) -> CUdeviceptr {
    // Cannot overflow: the offset stays within an allocation the driver handed out.
    ptr + (elems * size_of::<T>()) as u64
}

/// Reads `len` values of `T` from device memory, ordered after the memory's previous uses.
pub(crate) fn read_to_vec<T: AnyBitPattern>(
    ptr: CUdeviceptr,
    len: usize,
    order: &StreamOrder,
    ctx: &Context,
) -> Result<Vec<T>> {
    let bytes = len * size_of::<T>();
    let mut out = Vec::<T>::new();
    // Reserved fallibly: a view larger than the host can hold is an error, not an abort.
    out.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        ctx: cumem_sys::ErrorContext::op("read_to_vec: host Vec").bytes(bytes),
        report: None,
    })?;
    if bytes > 0 {
        // Synchronous copies run on the legacy stream and are complete on return.
        let legacy = Stream::legacy(ctx);
        let on = DeviceSlice::<T>::from_parts(ptr, len, order, ctx).on(&legacy)?;
        ctx.bind()?;
        // SAFETY: `out` has capacity for `len` values; the range is the view's, ordered on the
        // legacy stream by `on`; any bytes are a valid `T` (AnyBitPattern); the copy is complete
        // when the call returns.
        unsafe {
            ffi::memcpy_dtoh(out.as_mut_ptr().cast(), on.device_ptr(), bytes)?;
            out.set_len(len);
        }
    } else {
        // SAFETY: zero bytes to initialise: either len == 0, or T is zero-sized.
        unsafe { out.set_len(len) };
    }
    Ok(out)
}

macro_rules! common_view_methods {
    () => {
        /// Number of elements.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether the view has no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// Size in bytes.
        pub fn bytes(&self) -> usize {
            self.len * size_of::<T>()
        }

        /// Device address of the first element.
        pub fn device_ptr(&self) -> CUdeviceptr {
            self.ptr
        }

        /// The context of the memory.
        pub fn context(&self) -> &Context {
            self.ctx
        }

        /// The stream-order tracker of the owning buffer.
        pub fn order(&self) -> &StreamOrder {
            self.order_ref()
        }

        /// Copies the contents to a new `Vec`, after all work queued on the memory so far.
        pub fn to_vec(&self) -> Result<Vec<T>>
        where
            T: AnyBitPattern,
        {
            read_to_vec(self.ptr, self.len, self.order_ref(), self.ctx)
        }
    };
}

impl<'a, T> DeviceSlice<'a, T> {
    /// Assembles a view from its parts; the safe constructors are on the buffers.
    pub(crate) fn from_parts(ptr: CUdeviceptr, len: usize, order: &'a StreamOrder, ctx: &'a Context) -> Self {
        DeviceSlice { ptr, len, order, ctx, _marker: PhantomData }
    }

    fn order_ref(&self) -> &StreamOrder {
        self.order
    }

    /// A shared view of memory owned elsewhere, for crates that add memory kinds (managed,
    /// pitched, …). Buffers of this crate have safe accessors instead.
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len * size_of::<T>())` is device-accessible memory of `ctx`'s device (or 0
    ///    with `len * size_of::<T>() == 0`), aligned for `T`, holding initialised values of `T`,
    ///    and stays allocated for `'a`.
    /// 2. Nothing writes the memory during `'a` except work ordered through `order`, and every use
    ///    of the memory by device work is ordered through `order` (so the owner's free and host
    ///    access can wait for the view's work).
    pub unsafe fn from_raw_parts(
        ptr: CUdeviceptr,
        len: usize,
        order: &'a StreamOrder,
        ctx: &'a Context,
    ) -> Self {
        DeviceSlice::from_parts(ptr, len, order, ctx)
    }

    common_view_methods!();

    /// A shared sub-view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'a, T>> {
        let (start, end) = resolve_range(range, self.len)?;
        Ok(DeviceSlice::from_parts(offset::<T>(self.ptr, start), end - start, self.order, self.ctx))
    }

    /// Two shared views, of `[0, mid)` and `[mid, len)`.
    pub fn split_at(&self, mid: usize) -> Result<(DeviceSlice<'a, T>, DeviceSlice<'a, T>)> {
        if mid > self.len {
            return Err(Error::OutOfRange { start: mid, end: mid, len: self.len });
        }
        Ok((
            DeviceSlice::from_parts(self.ptr, mid, self.order, self.ctx),
            DeviceSlice::from_parts(offset::<T>(self.ptr, mid), self.len - mid, self.order, self.ctx),
        ))
    }

    /// Views of `chunk` elements each (the last may be shorter); `chunk` must be non-zero.
    pub fn chunks(&self, chunk: usize) -> Result<Chunks<'a, T>> {
        if chunk == 0 {
            return Err(Error::ZeroSize { what: "chunk size" });
        }
        Ok(Chunks { rest: *self, chunk })
    }

    /// The memory on `stream`, for device work that only reads it and that cumem does not queue
    /// itself (a kernel, another library): `stream` is ordered after every earlier use of the
    /// memory now, and every later use is ordered after the work queued on `stream` while the
    /// guard lives. `stream` must be on the memory's device (`WrongDevice` otherwise).
    ///
    /// Device work is refused meanwhile when the host may be reading memory that its device
    /// cannot share (`NotSupported { feature: ConcurrentManagedAccess }`; see
    /// [`StreamOrder::use_on`]).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{DeviceBuffer, Device, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    /// let buf = DeviceBuffer::from_slice(&a, &[1u32, 2, 3])?;
    /// {
    ///     let on = buf.as_slice().on(&b)?; // b waits for the upload on a
    ///     let (_ptr, _stream) = (on.device_ptr(), on.stream().raw());
    ///     // ... queue a kernel reading `_ptr` on `_stream` ...
    /// } // later users wait for b
    /// assert_eq!(buf.to_vec()?, [1, 2, 3]);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn on<'s>(&self, stream: &'s Stream) -> Result<OnStream<'s, T>>
    where
        'a: 's,
    {
        check_stream(self.ctx, stream)?;
        let ticket = self.order.use_on(stream)?;
        Ok(OnStream { ptr: self.ptr, len: self.len, ticket, _marker: PhantomData })
    }

    /// Runs `queue`, which queues device work reading the memory on `stream` and returns, with
    /// the ordering of [`DeviceSlice::on`] and the guard's life being the call: `queue` gets the
    /// device address. Cheaper than the guard (one lock, see [`StreamOrder::queue_on`]), but the
    /// memory's order stays locked while `queue` runs, so `queue` is for raw driver work on
    /// `stream` only (a kernel, another library): any use of cumem memory inside it, this
    /// memory's or another's (a copy, another view's door, a shared host borrow of pinned memory),
    /// answers `NotPermitted`, since waiting there could deadlock with a thread copying the other
    /// way (what has exclusive access to other memory, such as its drop, is not refused: see
    /// [`StreamOrder::queue_on`]). Work that needs other cumem memory takes the guard of
    /// [`DeviceSlice::on`] instead. The refusal is per thread: another thread that `queue` waits
    /// for (a scoped thread) and that uses this memory deadlocks instead.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{DeviceBuffer, Device, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    /// let buf = DeviceBuffer::from_slice(&a, &[1u32, 2, 3])?;
    /// let view = buf.as_slice();
    /// let ptr = view.queue_on(&b, |ptr| Ok(ptr))?; // b waited for the upload on a
    /// assert_eq!(ptr, buf.device_ptr());
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn queue_on<R>(&self, stream: &Stream, queue: impl FnOnce(CUdeviceptr) -> Result<R>) -> Result<R> {
        check_stream(self.ctx, stream)?;
        self.order.queue_on(stream, || queue(self.ptr))
    }

    /// Reinterprets the view as values of `U`; the byte length must be a multiple of `U`'s size
    /// and the address aligned for `U`.
    pub fn cast<U: Pod>(&self) -> Result<DeviceSlice<'a, U>>
    where
        T: Pod,
    {
        let (ptr, len) = cast_parts::<T, U>(self.ptr, self.len)?;
        Ok(DeviceSlice::from_parts(ptr, len, self.order, self.ctx))
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    /// A view through an order that other views may share (see `ViewOrder`).
    pub(crate) fn from_parts(ptr: CUdeviceptr, len: usize, order: &'a StreamOrder, ctx: &'a Context) -> Self {
        DeviceSliceMut { ptr, len, order: ViewOrder::Shared(order), ctx, _marker: PhantomData }
    }

    /// A view that is the only way to `order` while it lives: for owners that hold their order
    /// by value and share it with nothing else (never an order inside a host tracker).
    pub(crate) fn from_parts_exclusive(
        ptr: CUdeviceptr,
        len: usize,
        order: &'a mut StreamOrder,
        ctx: &'a Context,
    ) -> Self {
        DeviceSliceMut { ptr, len, order: ViewOrder::Exclusive(order), ctx, _marker: PhantomData }
    }

    fn order_ref(&self) -> &StreamOrder {
        self.order.get()
    }

    /// An exclusive view of memory owned elsewhere, for crates that add memory kinds.
    ///
    /// # Safety
    /// 1. As item 1 of [`DeviceSlice::from_raw_parts`].
    /// 2. Nothing else reads or writes the memory during `'a` (the view is exclusive), and every
    ///    use of it by device work is ordered through `order`.
    pub unsafe fn from_raw_parts(
        ptr: CUdeviceptr,
        len: usize,
        order: &'a StreamOrder,
        ctx: &'a Context,
    ) -> Self {
        DeviceSliceMut::from_parts(ptr, len, order, ctx)
    }

    common_view_methods!();

    /// The memory on `stream`, for device work that reads or writes it and that cumem does not
    /// queue itself: as [`DeviceSlice::on`], with exclusive access while the guard lives.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{DeviceBuffer, Device, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let stream = Stream::non_blocking(&ctx)?;
    /// let mut buf = DeviceBuffer::<u8>::zeroed(&stream, 64)?;
    /// let mut view = buf.as_mut_slice();
    /// let on = view.on(&stream)?;
    /// // SAFETY: the range is the guard's, and the memset is queued on the guard's stream.
    /// let code = unsafe {
    ///     cumem_core::api::cuMemsetD8Async(on.device_ptr(), 7, on.bytes(), on.stream().raw())
    /// };
    /// cumem_core::check(code, cumem_core::ErrorContext::op("cuMemsetD8Async"))?;
    /// drop(on); // the buffer's later users are ordered after the memset
    /// assert_eq!(buf.to_vec()?, [7; 64]);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn on<'s>(&'s mut self, stream: &'s Stream) -> Result<OnStreamMut<'s, T>> {
        check_stream(self.ctx, stream)?;
        let ticket = self.order.get().use_on(stream)?;
        Ok(OnStreamMut { ptr: self.ptr, len: self.len, ticket, _marker: PhantomData })
    }

    /// Runs `queue`, which queues device work reading or writing the memory on `stream` and
    /// returns: [`DeviceSlice::queue_on`] with exclusive access, and the same rule: raw driver
    /// work only, no cumem memory inside `queue` (`NotPermitted`; use [`DeviceSliceMut::on`]).
    /// A view of a whole `DeviceBuffer` (or a reborrow or single sub-view of one) takes no lock
    /// here: the buffer's exclusive borrow already proves that nothing else reaches its order
    /// (see [`StreamOrder::queue_on_mut`]); the halves of a split and chunks lock.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::{DeviceBuffer, Device, Stream};
    /// let stream = Stream::non_blocking(&Device::get(0)?.context()?)?;
    /// let mut buf = DeviceBuffer::<u8>::zeroed(&stream, 64)?;
    /// let mut view = buf.as_mut_slice();
    /// let bytes = view.bytes();
    /// view.queue_on(&stream, |ptr| {
    ///     // SAFETY: the range is the view's, and the memset is queued on the stream ordered for it.
    ///     let code = unsafe { cumem_core::api::cuMemsetD8Async(ptr, 7, bytes, stream.raw()) };
    ///     cumem_core::check(code, cumem_core::ErrorContext::op("cuMemsetD8Async"))
    /// })?; // the buffer's later users are ordered after the memset
    /// assert_eq!(buf.to_vec()?, [7; 64]);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn queue_on<R>(
        &mut self,
        stream: &Stream,
        queue: impl FnOnce(CUdeviceptr) -> Result<R>,
    ) -> Result<R> {
        check_stream(self.ctx, stream)?;
        let ptr = self.ptr;
        self.order.queue_on(stream, || queue(ptr))
    }

    /// Like [`DeviceSliceMut::on`], consuming the view to keep its lifetime.
    pub fn into_on<'s>(self, stream: &'s Stream) -> Result<OnStreamMut<'s, T>>
    where
        'a: 's,
    {
        check_stream(self.ctx, stream)?;
        let ticket = self.order.into_shared().use_on(stream)?;
        Ok(OnStreamMut { ptr: self.ptr, len: self.len, ticket, _marker: PhantomData })
    }

    /// A shared view of the same memory.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice::from_parts(self.ptr, self.len, self.order.get(), self.ctx)
    }

    /// A shorter-lived exclusive view of the same memory.
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_, T> {
        // One view replaces another for a while (`self` is unusable meanwhile), so an exclusive
        // order stays exclusive.
        DeviceSliceMut {
            ptr: self.ptr,
            len: self.len,
            order: self.order.reborrow(),
            ctx: self.ctx,
            _marker: PhantomData,
        }
    }

    /// A shared sub-view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        self.as_slice().slice(range)
    }

    /// Two shared views, of `[0, mid)` and `[mid, len)`.
    pub fn split_at(&self, mid: usize) -> Result<(DeviceSlice<'_, T>, DeviceSlice<'_, T>)> {
        self.as_slice().split_at(mid)
    }

    /// Shared views of `chunk` elements each (the last may be shorter).
    pub fn chunks(&self, chunk: usize) -> Result<Chunks<'_, T>> {
        self.as_slice().chunks(chunk)
    }

    /// An exclusive sub-view.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        self.reborrow().into_slice_mut(range)
    }

    /// Two exclusive views, of `[0, mid)` and `[mid, len)`.
    pub fn split_at_mut(&mut self, mid: usize) -> Result<(DeviceSliceMut<'_, T>, DeviceSliceMut<'_, T>)> {
        self.reborrow().into_split_at_mut(mid)
    }

    /// Exclusive views of `chunk` elements each (the last may be shorter).
    pub fn chunks_mut(&mut self, chunk: usize) -> Result<ChunksMut<'_, T>> {
        self.reborrow().into_chunks_mut(chunk)
    }

    /// Like [`DeviceSliceMut::slice_mut`], consuming the view to keep its lifetime.
    pub fn into_slice_mut(self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'a, T>> {
        let (start, end) = resolve_range(range, self.len)?;
        // One sub-view replaces the view, which is consumed: the order stays as exclusive as it was.
        Ok(DeviceSliceMut {
            ptr: offset::<T>(self.ptr, start),
            len: end - start,
            order: self.order,
            ctx: self.ctx,
            _marker: PhantomData,
        })
    }

    /// Like [`DeviceSliceMut::split_at_mut`], consuming the view to keep its lifetime.
    pub fn into_split_at_mut(self, mid: usize) -> Result<(DeviceSliceMut<'a, T>, DeviceSliceMut<'a, T>)> {
        if mid > self.len {
            return Err(Error::OutOfRange { start: mid, end: mid, len: self.len });
        }
        // The two halves cover disjoint memory, so two exclusive views are sound; they share the
        // order, and may be used from two threads at once, so neither may skip its lock.
        let order = self.order.into_shared();
        Ok((
            DeviceSliceMut::from_parts(self.ptr, mid, order, self.ctx),
            DeviceSliceMut::from_parts(offset::<T>(self.ptr, mid), self.len - mid, order, self.ctx),
        ))
    }

    /// Like [`DeviceSliceMut::chunks_mut`], consuming the view to keep its lifetime.
    pub fn into_chunks_mut(self, chunk: usize) -> Result<ChunksMut<'a, T>> {
        if chunk == 0 {
            return Err(Error::ZeroSize { what: "chunk size" });
        }
        // The chunks share the order and may be used from several threads: the locked form.
        Ok(ChunksMut {
            ptr: self.ptr,
            len: self.len,
            order: self.order.into_shared(),
            ctx: self.ctx,
            chunk,
            _marker: PhantomData,
        })
    }
}

pub(crate) fn cast_parts<T: Pod, U: Pod>(ptr: CUdeviceptr, len: usize) -> Result<(CUdeviceptr, usize)> {
    let bytes = len * size_of::<T>();
    if size_of::<U>() == 0 {
        return Err(Error::ZeroSize { what: "element size of the cast target" });
    }
    if !bytes.is_multiple_of(size_of::<U>()) {
        return Err(Error::Misaligned {
            what: "byte length",
            value: bytes as u64,
            align: size_of::<U>() as u64,
        });
    }
    if !ptr.is_multiple_of(align_of::<U>() as u64) {
        return Err(Error::Misaligned { what: "device address", value: ptr, align: align_of::<U>() as u64 });
    }
    Ok((ptr, bytes / size_of::<U>()))
}

/// Shared device memory on a stream: the door for device work that reads it and that cumem does
/// not queue itself (see [`DeviceSlice::on`]).
///
/// Queue the work on [`OnStream::stream`] while the guard is alive; the memory's later users are
/// ordered after it when the guard drops.
#[must_use = "queue the work while holding the guard; dropping it early loses track of the work"]
pub struct OnStream<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    ticket: OrderTicket<'a>,
    _marker: PhantomData<&'a [T]>,
}

/// Exclusive device memory on a stream: the door for device work that writes it (see
/// [`DeviceSliceMut::on`]).
#[must_use = "queue the work while holding the guard; dropping it early loses track of the work"]
pub struct OnStreamMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    ticket: OrderTicket<'a>,
    _marker: PhantomData<&'a mut [T]>,
}

macro_rules! guard_methods {
    () => {
        /// Device address of the first element, for the work queued on [`stream`](Self::stream).
        pub fn device_ptr(&self) -> CUdeviceptr {
            self.ptr
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether there are no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// Size in bytes.
        pub fn bytes(&self) -> usize {
            self.len * size_of::<T>()
        }

        /// The stream to queue the work on (ordered after the memory's earlier users).
        pub fn stream(&self) -> &Stream {
            self.ticket.stream()
        }
    };
}

impl<T> OnStream<'_, T> {
    guard_methods!();
}

impl<T> OnStreamMut<'_, T> {
    guard_methods!();
}

impl<T> std::fmt::Debug for OnStream<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnStream")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", self.stream())
            .finish()
    }
}

impl<T> std::fmt::Debug for OnStreamMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnStreamMut")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", self.stream())
            .finish()
    }
}

/// The memory's device must be the stream's.
fn check_stream(ctx: &Context, stream: &Stream) -> Result<()> {
    if stream.context().device() == ctx.device() {
        Ok(())
    } else {
        Err(Error::WrongDevice {
            expected: ctx.device().ordinal() as i32,
            actual: stream.context().device().ordinal() as i32,
        })
    }
}

/// Iterator over shared chunks of a view; see [`DeviceSlice::chunks`].
pub struct Chunks<'a, T> {
    rest: DeviceSlice<'a, T>,
    chunk: usize,
}

impl<'a, T> Iterator for Chunks<'a, T> {
    type Item = DeviceSlice<'a, T>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len == 0 {
            return None;
        }
        let n = self.chunk.min(self.rest.len);
        let head = DeviceSlice::from_parts(self.rest.ptr, n, self.rest.order, self.rest.ctx);
        self.rest = DeviceSlice::from_parts(
            offset::<T>(self.rest.ptr, n),
            self.rest.len - n,
            self.rest.order,
            self.rest.ctx,
        );
        Some(head)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.rest.len.div_ceil(self.chunk);
        (n, Some(n))
    }
}

impl<T> ExactSizeIterator for Chunks<'_, T> {}

/// Iterator over exclusive chunks of a view; see [`DeviceSliceMut::chunks_mut`].
pub struct ChunksMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    order: &'a StreamOrder,
    ctx: &'a Context,
    chunk: usize,
    _marker: PhantomData<&'a mut [T]>,
}

impl<'a, T> Iterator for ChunksMut<'a, T> {
    type Item = DeviceSliceMut<'a, T>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.len == 0 {
            return None;
        }
        let n = self.chunk.min(self.len);
        // Each chunk covers memory no other chunk covers, so handing out exclusive views is sound.
        let head = DeviceSliceMut::from_parts(self.ptr, n, self.order, self.ctx);
        self.ptr = offset::<T>(self.ptr, n);
        self.len -= n;
        Some(head)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.len.div_ceil(self.chunk);
        (n, Some(n))
    }
}

impl<T> ExactSizeIterator for ChunksMut<'_, T> {}

/// Anything that can be viewed as shared device memory of `T`s: buffers and views.
pub trait AsDeviceSlice<T> {
    /// The shared view.
    fn as_device_slice(&self) -> DeviceSlice<'_, T>;
}

/// Anything that can be viewed as exclusive device memory of `T`s.
pub trait AsDeviceSliceMut<T>: AsDeviceSlice<T> {
    /// The exclusive view.
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T>;
}

impl<T> AsDeviceSlice<T> for DeviceSlice<'_, T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        *self
    }
}

impl<T> AsDeviceSlice<T> for DeviceSliceMut<'_, T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        self.as_slice()
    }
}

impl<T> AsDeviceSliceMut<T> for DeviceSliceMut<'_, T> {
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.reborrow()
    }
}

impl<T> std::fmt::Debug for DeviceSlice<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T> std::fmt::Debug for DeviceSliceMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSliceMut")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::reversed_empty_ranges)] // a reversed range is exactly what is under test
    fn ranges_resolve_like_slice_indexing() {
        assert_eq!(resolve_range(.., 5).unwrap(), (0, 5));
        assert_eq!(resolve_range(1..3, 5).unwrap(), (1, 3));
        assert_eq!(resolve_range(1..=4, 5).unwrap(), (1, 5));
        assert_eq!(resolve_range(5.., 5).unwrap(), (5, 5));
        assert!(matches!(resolve_range(3..2, 5), Err(Error::OutOfRange { start: 3, end: 2, len: 5 })));
        assert!(matches!(resolve_range(0..6, 5), Err(Error::OutOfRange { end: 6, .. })));
        assert!(matches!(resolve_range(0..=usize::MAX, 5), Err(Error::OutOfRange { .. })));
    }

    #[test]
    fn casts_check_length_and_alignment() {
        assert_eq!(cast_parts::<u32, u8>(0x1000, 3).unwrap(), (0x1000, 12));
        assert_eq!(cast_parts::<u8, u32>(0x1000, 8).unwrap(), (0x1000, 2));
        assert!(matches!(
            cast_parts::<u8, u32>(0x1000, 7),
            Err(Error::Misaligned { what: "byte length", .. })
        ));
        assert!(matches!(
            cast_parts::<u8, u32>(0x1001, 8),
            Err(Error::Misaligned { what: "device address", .. })
        ));
    }
}
