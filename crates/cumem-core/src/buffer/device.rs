//! `DeviceBuffer<T>`: an owning array of `T` in device memory, the device analogue of `Vec<T>`
//! (without growth; see `cumem-vmm` for buffers that grow in place).
//!
//! Constructors without `_in` allocate from the current resource of the stream's device (the
//! caching pool by default, see [`crate::current_resource`]); the `_in` ones take any
//! `&Arc<R>` of a [`DeviceResource`]. A buffer remembers the resource it came from and the stream
//! it was last used on; dropping it returns the memory to that resource on that stream, from any
//! thread.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{DeviceBuffer, Device, Stream};
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let buf = DeviceBuffer::from_slice(&stream, &[1.0f32, 2.0, 3.0])?;
//! assert_eq!((buf.len(), buf.bytes()), (3, 12));
//! let bytes = buf.cast::<u8>()?;          // reinterpretation via bytemuck
//! assert_eq!(bytes.len(), 12);
//! assert_eq!(bytes.cast::<f32>()?.to_vec()?, [1.0, 2.0, 3.0]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit, Pod, Zeroable};
use cumem_sys::sys::CUdeviceptr;

use crate::buffer::view::{AsDeviceSlice, AsDeviceSliceMut, DeviceSlice, DeviceSliceMut, cast_parts};
use crate::{
    AllocLayout, Allocation, Context, DeviceResource, Error, Feature, Result, Stream, StreamOrder, ffi,
};

/// The largest alignment the `*_aligned*` constructors accept: 64 KiB, the largest page size of the
/// platforms CUDA runs on (4 KiB on x86-64, up to 64 KiB on aarch64 and ppc64le). Resources serve
/// alignments above their native one by over-allocating, so this also bounds the waste of a buffer
/// made by a `*_aligned*` constructor; the other constructors ask for `align_of::<T>()`, which is
/// not checked against it (a `T` aligned above it over-allocates by up to its alignment).
pub const MAX_ALIGNMENT: usize = 64 * 1024;

/// Checks a requested alignment: a power of two, at most [`MAX_ALIGNMENT`].
fn check_alignment(align: usize) -> Result<()> {
    crate::resource::check_power_of_two(align)?;
    if align > MAX_ALIGNMENT {
        return Err(Error::NotSupported { feature: Feature::Alignment(align), device: None });
    }
    Ok(())
}

/// An owning array of `len` values of `T` in device memory.
pub struct DeviceBuffer<T> {
    ptr: CUdeviceptr,
    /// The resource's token of the allocation at `ptr`, given back with it.
    token: [u64; 2],
    len: usize,
    /// `None` when nothing was allocated (zero bytes).
    layout: Option<AllocLayout>,
    resource: Arc<dyn DeviceResource>,
    order: StreamOrder,
    _marker: PhantomData<T>,
}

impl<T> DeviceBuffer<T> {
    /// The current resource of `stream`'s device (see [`crate::current_resource`]).
    fn current(stream: &Stream) -> Result<Arc<dyn DeviceResource>> {
        crate::current::current_for(stream.context())
    }

    /// Allocates room for `len` values from `resource`, usable in order on `stream`. The contents
    /// are whatever the memory held, which is why this needs `T: AnyBitPattern`.
    pub fn new_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
    ) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        // SAFETY: any bytes are a valid T.
        unsafe { Self::uninit_in(resource, stream, len) }
    }

    /// Allocates room for `len` values from the current resource of `stream`'s device (see
    /// [`crate::current_resource`]); see [`DeviceBuffer::new_in`].
    pub fn new(stream: &Stream, len: usize) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        // SAFETY: any bytes are a valid T.
        unsafe { Self::uninit_layout_in(Self::current(stream)?, stream, len, align_of::<T>()) }
    }

    /// Allocates without initialising.
    ///
    /// # Safety
    /// 1. The caller writes every element before the contents are read as `T`, or every bit
    ///    pattern is a valid `T`.
    pub unsafe fn uninit_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
    ) -> Result<Self> {
        // SAFETY: forwarded contract.
        unsafe { Self::uninit_layout_in(resource.clone().into_dyn_resource(), stream, len, align_of::<T>()) }
    }

    /// Allocates without initialising, at an address that is a multiple of `align` (a power of
    /// two up to [`MAX_ALIGNMENT`]; `T`'s own alignment applies if larger).
    ///
    /// # Safety
    /// 1. As for [`DeviceBuffer::uninit_in`].
    pub unsafe fn uninit_aligned_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
        align: usize,
    ) -> Result<Self> {
        check_alignment(align)?;
        let resource = resource.clone().into_dyn_resource();
        // SAFETY: forwarded contract.
        unsafe { Self::uninit_layout_in(resource, stream, len, align.max(align_of::<T>())) }
    }

    /// Takes the resource by value, so that the constructors without `_in` hand over the `Arc`
    /// they looked up instead of cloning it once more.
    ///
    /// # Safety
    /// 1. As for [`DeviceBuffer::uninit_in`]; `align` is a power of two.
    unsafe fn uninit_layout_in(
        resource: Arc<dyn DeviceResource>,
        stream: &Stream,
        len: usize,
        align: usize,
    ) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(crate::Error::SizeOverflow { count: len, elem_size: size_of::<T>() })?;
        // Checked for empty buffers too: an empty buffer still frees and orders on `stream`.
        if resource.context() != stream.context() {
            return Err(crate::Error::WrongDevice {
                expected: resource.context().device().ordinal() as i32,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        let (alloc, layout) = if bytes == 0 {
            (Allocation::from_ptr(0), None)
        } else {
            let layout = AllocLayout::new(bytes, align)?;
            (resource.allocate(layout, stream)?, Some(layout))
        };
        Ok(DeviceBuffer {
            ptr: alloc.ptr,
            token: alloc.token,
            len,
            layout,
            resource,
            order: StreamOrder::new(stream),
            _marker: PhantomData,
        })
    }

    /// Allocates room for `len` values from `resource` at an address that is a multiple of `align`;
    /// see [`DeviceBuffer::new_in`] and [`DeviceBuffer::uninit_aligned_in`].
    pub fn new_aligned_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
        align: usize,
    ) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        // SAFETY: any bytes are a valid T.
        unsafe { Self::uninit_aligned_in(resource, stream, len, align) }
    }

    /// `len` zeroed values from `resource`, zeroed in order on `stream`.
    pub fn zeroed_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
    ) -> Result<Self>
    where
        T: Zeroable,
    {
        // SAFETY: every byte is written with zero below, and all-zero is a valid T.
        let buf = unsafe { Self::uninit_in(resource, stream, len)? };
        buf.zero(stream)
    }

    /// `len` zeroed values from `resource` at an address that is a multiple of `align` (a power of
    /// two up to [`MAX_ALIGNMENT`]: `ZeroSize` for 0, `InvalidValue` for another value that is not
    /// a power of two, `NotSupported` for a larger one). Works with any resource: resources serve large alignments by over-allocating.
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use std::sync::Arc;
    /// use cumem_core::{DeviceBuffer, Device, DriverResource, Stream};
    /// let stream = Stream::new(&Device::get(0)?.context()?)?;
    /// let resource = Arc::new(DriverResource::new(stream.context()));
    /// let buf = DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 100, 4096)?;
    /// assert_eq!(buf.device_ptr() % 4096, 0);
    /// assert_eq!(buf.alignment(), Some(4096));
    /// assert!(DeviceBuffer::<u8>::zeroed_aligned_in(&resource, &stream, 100, 3000).is_err());
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn zeroed_aligned_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        len: usize,
        align: usize,
    ) -> Result<Self>
    where
        T: Zeroable,
    {
        // SAFETY: every byte is written with zero below, and all-zero is a valid T.
        let buf = unsafe { Self::uninit_aligned_in(resource, stream, len, align)? };
        buf.zero(stream)
    }

    /// `len` zeroed values from the device's current resource at an address that is a multiple of `align`; see
    /// [`DeviceBuffer::zeroed_aligned_in`].
    pub fn zeroed_aligned(stream: &Stream, len: usize, align: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        check_alignment(align)?;
        // SAFETY: every byte is written with zero below, and all-zero is a valid T.
        let buf = unsafe {
            Self::uninit_layout_in(Self::current(stream)?, stream, len, align.max(align_of::<T>()))?
        };
        buf.zero(stream)
    }

    /// Queues zeroing the whole (fresh) allocation on `stream`.
    fn zero(self, stream: &Stream) -> Result<Self> {
        let buf = self;
        if buf.bytes() > 0 {
            stream.context().bind()?;
            // SAFETY: the range is exactly this fresh allocation, usable on `stream`.
            unsafe { ffi::memset_d8_async(buf.ptr, 0, buf.bytes(), stream.raw())? };
        }
        Ok(buf)
    }

    /// `len` zeroed values from the current resource of `stream`'s device.
    pub fn zeroed(stream: &Stream, len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        // SAFETY: every byte is written with zero below, and all-zero is a valid T.
        let buf = unsafe { Self::uninit_layout_in(Self::current(stream)?, stream, len, align_of::<T>())? };
        buf.zero(stream)
    }

    /// A buffer from `resource` holding a copy of `data`. `data` may be reused as soon as this returns.
    pub fn from_slice_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        data: &[T],
    ) -> Result<Self>
    where
        T: NoUninit,
    {
        // SAFETY: every element is written by the copy below before anything can read it.
        let buf = unsafe { Self::uninit_in(resource, stream, data.len())? };
        buf.fill_from(data)
    }

    /// A buffer from `resource` at an address that is a multiple of `align`, holding a copy of
    /// `data`; see [`DeviceBuffer::zeroed_aligned_in`] for `align`.
    pub fn from_slice_aligned_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        data: &[T],
        align: usize,
    ) -> Result<Self>
    where
        T: NoUninit,
    {
        // SAFETY: every element is written by the copy below before anything can read it.
        let buf = unsafe { Self::uninit_aligned_in(resource, stream, data.len(), align)? };
        buf.fill_from(data)
    }

    /// Copies `data` (same length) into the fresh allocation.
    fn fill_from(self, data: &[T]) -> Result<Self>
    where
        T: NoUninit,
    {
        let buf = self;
        if buf.bytes() > 0 {
            let ctx = buf.resource.context();
            // A synchronous copy runs on the legacy stream and has taken the pageable source by the
            // time it returns; the tracker orders it after the allocation's stream.
            let legacy = Stream::legacy(ctx);
            let _ticket = buf.order.use_on(&legacy)?;
            // `data` may be managed memory, which the driver reads as device work.
            crate::blocking_host_copy(ctx, data.as_ptr().cast(), || {
                // SAFETY: `data` is valid for `bytes` bytes of reads (NoUninit: all initialised);
                // the destination is exactly this allocation.
                unsafe { ffi::memcpy_htod(buf.ptr, data.as_ptr().cast(), buf.bytes()) }
            })?;
        }
        Ok(buf)
    }

    /// A buffer from the current resource of `stream`'s device holding a copy of `data`.
    pub fn from_slice(stream: &Stream, data: &[T]) -> Result<Self>
    where
        T: NoUninit,
    {
        Self::from_slice_in(&Self::current(stream)?, stream, data)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Device address of the first element (0 when nothing is allocated).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context of the memory.
    pub fn context(&self) -> &Context {
        self.resource.context()
    }

    /// The resource the memory came from and returns to.
    pub fn resource(&self) -> &Arc<dyn DeviceResource> {
        &self.resource
    }

    /// The alignment the memory was allocated with (`None` when nothing is allocated).
    pub fn alignment(&self) -> Option<usize> {
        self.layout.map(|l| l.align)
    }

    /// The stream-order tracker: the stream the buffer was last used on.
    pub fn order(&self) -> &StreamOrder {
        &self.order
    }

    /// A shared view of the whole buffer.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice::from_parts(self.ptr, self.len, &self.order, self.resource.context())
    }

    /// An exclusive view of the whole buffer.
    pub fn as_mut_slice(&mut self) -> DeviceSliceMut<'_, T> {
        // The buffer holds its order by value and lends it to nothing but its views (no host
        // tracker, no resource keeps it), so while this view lives it is the only way to the
        // order: work queued through it needs no lock (see `StreamOrder::queue_on_mut`).
        DeviceSliceMut::from_parts_exclusive(self.ptr, self.len, &mut self.order, self.resource.context())
    }

    crate::device_view_methods!();

    /// Reinterprets the buffer as values of `U`, keeping the allocation. The byte length must be a
    /// multiple of `U`'s size and the address aligned for `U`.
    pub fn cast<U: Pod>(self) -> Result<DeviceBuffer<U>>
    where
        T: Pod,
    {
        let (ptr, len) = cast_parts::<T, U>(self.ptr, self.len)?;
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again; each field is moved out exactly once.
        let (resource, order) = unsafe { (std::ptr::read(&this.resource), std::ptr::read(&this.order)) };
        Ok(DeviceBuffer {
            ptr,
            token: this.token,
            len,
            layout: this.layout,
            resource,
            order,
            _marker: PhantomData,
        })
    }
}

impl<T> AsDeviceSlice<T> for DeviceBuffer<T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        self.as_slice()
    }
}

impl<T> AsDeviceSliceMut<T> for DeviceBuffer<T> {
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.as_mut_slice()
    }
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.context().device().ordinal())
            .finish()
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            let stream = match self.order.join_mut() {
                Ok(stream) => stream,
                Err(e) => {
                    // No stream is known to follow every use: returning the memory could hand it to
                    // new work while old work still runs. Leak it instead.
                    tracing::warn!(ptr = self.ptr, bytes = layout.bytes, error = %e, "ordering the free failed; leaking");
                    return;
                }
            };
            let alloc = Allocation { ptr: self.ptr, token: self.token };
            // SAFETY: `ptr` and `token` came unchanged from `allocate` on this resource with `layout`
            // and are returned once; every use of the memory was queued through `order`, and
            // `stream` is ordered after all of them; the buffer is going away, so nothing refers to
            // the memory afterwards.
            unsafe { self.resource.deallocate(alloc, layout, stream) };
        }
    }
}
