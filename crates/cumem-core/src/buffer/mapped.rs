//! `MappedBuffer<T>`: zero-copy host memory with a device address.
//!
//! Page-locked host memory allocated with `CU_MEMHOSTALLOC_DEVICEMAP`: the host reads and writes it
//! like a pinned buffer, and the device reaches the same bytes through [`MappedBuffer::device_ptr`]
//! (kernels read them over the bus; copies accept the buffer as a device view). Whichever way the
//! device uses it, the work goes through the buffer's [`StreamOrder`](crate::StreamOrder), and host
//! access first waits for that work, as for [`PinnedBuffer`](crate::PinnedBuffer). Needs a device
//! that can map host memory (`NotSupported { feature: HostMapping }` otherwise, before any allocation).
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, MappedBuffer};
//! let ctx = Device::get(0)?.context()?;
//! let mut mapped = MappedBuffer::from_slice(&ctx, &[1u32, 2, 3])?;
//! mapped.as_mut_slice()?[0] = 10;
//! let view = mapped.as_device_slice();     // the same bytes, seen from the device
//! assert_eq!(view.device_ptr(), mapped.device_ptr());
//! assert_eq!(view.to_vec()?, [10, 2, 3]);  // a device-to-host copy through the mapping
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;

use bytemuck::Zeroable;
use cumem_sys::sys::CUdeviceptr;

use crate::buffer::view::{AsDeviceSlice, AsDeviceSliceMut, DeviceSlice, DeviceSliceMut};
use crate::{Context, Feature, HostAccess, HostMemory, PinnedBuffer, PinnedFlags, Result, Stream, ffi};

/// An owning array of `len` values of `T` in page-locked host memory mapped into the device's
/// address space.
pub struct MappedBuffer<T> {
    /// The host allocation; its tracker orders device work through a stream order.
    host: PinnedBuffer<T>,
    /// The device address of the first element (0 when nothing is allocated).
    device_ptr: CUdeviceptr,
}

impl<T: Copy> MappedBuffer<T> {
    /// `len` zeroed values.
    pub fn zeroed(ctx: &Context, len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_with_flags(ctx, len, PinnedFlags::default())
    }

    /// `len` zeroed values, with extra flags (`device_mapped` is always set).
    pub fn zeroed_with_flags(ctx: &Context, len: usize, flags: PinnedFlags) -> Result<Self>
    where
        T: Zeroable,
    {
        let flags = Self::check(ctx, flags)?;
        Self::map(PinnedBuffer::zeroed_tracked(ctx, len, flags, Self::tracker(ctx))?)
    }

    /// A mapped copy of `data`.
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        Self::from_slice_with_flags(ctx, data, PinnedFlags::default())
    }

    /// A mapped copy of `data`, with extra flags (`device_mapped` is always set).
    pub fn from_slice_with_flags(ctx: &Context, data: &[T], flags: PinnedFlags) -> Result<Self> {
        let flags = Self::check(ctx, flags)?;
        Self::map(PinnedBuffer::from_slice_tracked(ctx, data, flags, Self::tracker(ctx))?)
    }

    fn check(ctx: &Context, flags: PinnedFlags) -> Result<PinnedFlags> {
        ctx.device().capabilities()?.require(Feature::HostMapping)?;
        Ok(PinnedFlags { device_mapped: true, ..flags })
    }

    fn tracker(ctx: &Context) -> HostAccess {
        // Device views order their work through the tracker; it starts on the legacy stream, where
        // the allocation (a synchronous call) happened.
        HostAccess::with_order(&Stream::legacy(ctx))
    }

    fn map(host: PinnedBuffer<T>) -> Result<Self> {
        let device_ptr = if host.is_empty() || size_of::<T>() == 0 {
            0
        } else {
            host.context().bind()?;
            ffi::mem_host_get_device_pointer(host.as_ptr().cast_mut().cast())?
        };
        Ok(MappedBuffer { host, device_ptr })
    }
}

impl<T> MappedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.host.bytes()
    }

    /// The flags it was allocated with (`device_mapped` is always set).
    pub fn flags(&self) -> PinnedFlags {
        self.host.flags()
    }

    /// The context it was allocated in.
    pub fn context(&self) -> &Context {
        self.host.context()
    }

    /// Host address of the first element. Reading or writing through it races with pending
    /// device work; use the slice accessors.
    pub fn as_ptr(&self) -> *const T {
        self.host.as_ptr()
    }

    /// Device address of the first element (0 when nothing is allocated). Work that uses it
    /// outside cumem's copies (a kernel) must go through the door instead
    /// (`as_device_slice_mut().on(&stream)`, whose guard hands out the pointer), so that host
    /// access waits for it.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }

    /// The host values, after any pending device write to them has completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.host.as_slice()
    }

    /// The host values for writing, after all pending device work on them has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.host.as_mut_slice()
    }

    /// A copy of the host values, after any pending device write.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Copy,
    {
        self.host.to_vec()
    }

    /// Blocks until no device work uses the buffer.
    pub fn wait_idle(&self) -> Result<()> {
        self.host.wait_idle()
    }

    /// The device's view of the whole buffer, for copies that read it.
    pub fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        let order = self.host.access().view_order(false).expect(ORDERED);
        DeviceSlice::from_parts(self.device_ptr, self.len(), order, self.context())
    }

    /// The device's exclusive view of the whole buffer, for copies and memsets that write it.
    pub fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        let order = self.host.access().view_order(true).expect(ORDERED);
        DeviceSliceMut::from_parts(self.device_ptr, self.len(), order, self.host.context())
    }
}

/// Every mapped buffer's tracker is created with a stream order (`tracker`), so views always get one.
const ORDERED: &str = "a MappedBuffer's tracker always has a stream order";

impl<T> AsDeviceSlice<T> for MappedBuffer<T> {
    fn as_device_slice(&self) -> DeviceSlice<'_, T> {
        MappedBuffer::as_device_slice(self)
    }
}

impl<T> AsDeviceSliceMut<T> for MappedBuffer<T> {
    fn as_device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        MappedBuffer::as_device_slice_mut(self)
    }
}

// SAFETY: the memory is cuMemHostAlloc'd (page-locked) and holds `len` initialised values; the
// pinned buffer's tracker orders every device use and makes host access, and the free, wait.
unsafe impl<T> HostMemory<T> for MappedBuffer<T> {
    fn len(&self) -> usize {
        self.host.len()
    }

    unsafe fn device_read<R>(
        &self,
        stream: &Stream,
        enqueue: impl FnOnce(*const T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.host.device_read(stream, enqueue) }
    }

    unsafe fn device_write<R>(
        &mut self,
        stream: &Stream,
        enqueue: impl FnOnce(*mut T, usize) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: forwarded contract.
        unsafe { self.host.device_write(stream, enqueue) }
    }
}

impl<T> fmt::Debug for MappedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedBuffer")
            .field("host", &self.host.as_ptr())
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .field("len", &self.len())
            .finish()
    }
}
