//! `PitchedBuffer<T>`: a 2D (or 3D) array in device memory whose rows start at aligned addresses.
//!
//! Allocation and layout rules are on [`PitchedBuffer`] and its constructors.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::{AnyBitPattern, Pod, Zeroable};
use cumem_core::{
    AllocLayout, Allocation, Context, DeviceResource, DeviceSlice, DeviceSliceMut, Error, Feature, Result,
    Stream, StreamOrder,
};
use cumem_sys::ErrorContext;
use cumem_sys::sys::{CUdevice_attribute, CUdeviceptr};

use crate::extent::{Copy3D, bytes};
use crate::ffi::{self, Width};
use crate::profile::{self, CopyKind};
use crate::region::Pitched;

/// The alignment, in bytes, that every row of a pitched allocation has: the base is allocated
/// aligned to this much and the pitch is a multiple of it, as `cuMemAllocPitch` does on current
/// GPUs (`driver-api.md`). Element types aligned more strictly cannot be laid out in pitched rows.
pub const PITCHED_ROW_ALIGNMENT: usize = 512;

/// An owning `width` × `height` × `depth` array of `T` in pitched device memory.
///
/// Each row is padded to the pitch `cuMemAllocPitch` would choose (the row width rounded up to
/// [`PITCHED_ROW_ALIGNMENT`], or to the device's texture pitch alignment if larger), so that every
/// row starts aligned, which is what 2D copies and row-wise device access want. The memory comes
/// from the current resource of the stream's device (the caching pool by default, see
/// [`cumem_core::current_resource`]), or from any resource with the `_in` constructors, and
/// returns there in stream order when the array drops. The buffer knows its width, height and
/// depth in elements and its pitch; it hands out rows as device views, and itself as a
/// [`Pitched`] side of 2D/3D copies and memsets. An empty array (a zero width, height or depth)
/// allocates nothing; its [`device_ptr`](PitchedBuffer::device_ptr) is 0.
///
/// ```
/// # cumem_sys::testing::init();
/// use cumem_copy::{Copy2D, Pitched, PitchedBuffer, copy_2d};
/// use cumem_core::{Device, Stream};
/// let stream = Stream::new(&Device::get(0)?.context()?)?;
/// let mut img = PitchedBuffer::<f32>::zeroed(&stream, 100, 3)?;
/// assert!(img.pitch() >= 100);
/// let rows: Vec<f32> = (0..300).map(|i| i as f32).collect();
/// copy_2d(&Pitched::new(&rows[..], 100), &mut img.as_pitched_mut(), Copy2D::new(100, 3))?;
/// assert_eq!(img.row(1)?.to_vec()?[..2], [100.0, 101.0]);
/// assert_eq!(img.to_vec()?, rows);
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub struct PitchedBuffer<T> {
    ptr: CUdeviceptr,
    /// What the resource's free needs besides the address (see [`Allocation`]).
    token: [u64; 2],
    /// Row stride in elements.
    pitch: usize,
    width: usize,
    height: usize,
    depth: usize,
    /// `pitch × height × depth`, checked when the array is made.
    len: usize,
    /// `None` when nothing was allocated (an empty array).
    layout: Option<AllocLayout>,
    resource: Arc<dyn DeviceResource>,
    order: StreamOrder,
    _marker: PhantomData<T>,
}

impl<T> PitchedBuffer<T> {
    /// A `width` × `height` array whose contents are whatever the memory held (hence
    /// `T: AnyBitPattern`), from the current resource of `stream`'s device, usable in order on
    /// `stream`.
    ///
    /// # Errors
    ///
    /// Refused before anything is allocated, in this order:
    /// - `ZeroSize { what: "element size" }` for a zero-sized `T`;
    /// - `NotSupported { feature: Alignment(align), .. }` when `T` is aligned more strictly than
    ///   [`PITCHED_ROW_ALIGNMENT`] bytes (rows are only as aligned as the allocation's base);
    /// - `SizeOverflow` when the row count (`height × depth`) or a row's bytes overflow, even for
    ///   an array that would be empty (for a non-empty one, the array's bytes too);
    /// - `WrongDevice` when the resource is not of `stream`'s context (the `_in` constructors);
    /// - then, for a non-empty array only: `InvalidValue` when a row is wider than the device's
    ///   `MAX_PITCH`, or when the pitch it needs (rounded up to the pitch alignment) passes it;
    ///   `Misaligned { what: "pitch" }` when that pitch is not a multiple of `T`'s size (never
    ///   for a power-of-two size up to the pitch alignment).
    ///
    /// The resource's own errors come as they are (`OutOfMemory` when it cannot serve the
    /// array), as do the driver's errors of the attribute queries.
    pub fn new(stream: &Stream, width: usize, height: usize) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        Self::new_3d(stream, width, height, 1)
    }

    /// A zeroed `width` × `height` array, zeroed in order on `stream`.
    ///
    /// # Errors
    /// As [`PitchedBuffer::new`], and the driver's errors of queueing the memset that zeroes it.
    pub fn zeroed(stream: &Stream, width: usize, height: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_3d(stream, width, height, 1)
    }

    /// A `width` × `height` × `depth` array: `depth` slices of `height` rows.
    ///
    /// # Errors
    /// As [`PitchedBuffer::new`].
    pub fn new_3d(stream: &Stream, width: usize, height: usize, depth: usize) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        Self::new_3d_in(
            &cumem_core::current_resource(&stream.context().device())?,
            stream,
            width,
            height,
            depth,
        )
    }

    /// A zeroed `width` × `height` × `depth` array.
    ///
    /// # Errors
    /// As [`PitchedBuffer::zeroed`].
    pub fn zeroed_3d(stream: &Stream, width: usize, height: usize, depth: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_3d_in(
            &cumem_core::current_resource(&stream.context().device())?,
            stream,
            width,
            height,
            depth,
        )
    }

    /// As [`PitchedBuffer::new`], from `resource` (any `Arc` of a resource of `stream`'s
    /// context).
    ///
    /// # Errors
    /// As [`PitchedBuffer::new`]; another context's resource is `WrongDevice`.
    pub fn new_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        width: usize,
        height: usize,
    ) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        Self::new_3d_in(resource, stream, width, height, 1)
    }

    /// As [`PitchedBuffer::zeroed`], from `resource`.
    ///
    /// # Errors
    /// As [`PitchedBuffer::zeroed`]; another context's resource is `WrongDevice`.
    pub fn zeroed_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        width: usize,
        height: usize,
    ) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_3d_in(resource, stream, width, height, 1)
    }

    /// As [`PitchedBuffer::new_3d`], from `resource`.
    ///
    /// # Errors
    /// As [`PitchedBuffer::new`]; another context's resource is `WrongDevice`.
    pub fn new_3d_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        width: usize,
        height: usize,
        depth: usize,
    ) -> Result<Self>
    where
        T: AnyBitPattern,
    {
        Self::alloc(resource, stream, width, height, depth)
    }

    /// As [`PitchedBuffer::zeroed_3d`], from `resource`.
    ///
    /// # Errors
    /// As [`PitchedBuffer::zeroed`]; another context's resource is `WrongDevice`.
    pub fn zeroed_3d_in<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        width: usize,
        height: usize,
        depth: usize,
    ) -> Result<Self>
    where
        T: Zeroable,
    {
        let buf = Self::alloc(resource, stream, width, height, depth)?;
        if buf.ptr != 0 {
            let all = bytes(buf.len(), size_of::<T>())?;
            // Traced and profiled like every other memset of this crate, the span entered before
            // the context is bound (see `profile::CopyTrace`).
            let mut trace = profile::begin(stream, CopyKind::Memset, all);
            stream.context().bind()?;
            trace.around(stream, || {
                // SAFETY: the range is exactly this fresh allocation (pitch × rows bytes), usable
                // on `stream`; all-zero bytes are a valid T.
                unsafe { ffi::memset_async(buf.ptr, Width::W8(0), all, stream.raw()) }
            })?;
        }
        Ok(buf)
    }

    /// The pitch `cuMemAllocPitch` chooses for rows of `width_bytes`: a multiple of
    /// [`PITCHED_ROW_ALIGNMENT`] and of the device's texture pitch alignment.
    fn pitch_for(ctx: &Context, width_bytes: usize) -> Result<usize> {
        let texture =
            ctx.device().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT)?;
        let align = usize::try_from(texture).unwrap_or(0).max(PITCHED_ROW_ALIGNMENT).next_power_of_two();
        width_bytes
            .checked_next_multiple_of(align)
            .ok_or(Error::SizeOverflow { count: width_bytes, elem_size: 1 })
    }

    /// Allocates the array; nothing is allocated unless every check passed.
    fn alloc<R: DeviceResource + ?Sized + 'static>(
        resource: &Arc<R>,
        stream: &Stream,
        width: usize,
        height: usize,
        depth: usize,
    ) -> Result<Self> {
        let size = size_of::<T>();
        if size == 0 {
            // A pitch of zero-sized elements means nothing, and element counts would be unbounded.
            return Err(Error::ZeroSize { what: "element size" });
        }
        let align = align_of::<T>();
        if align > PITCHED_ROW_ALIGNMENT {
            // Rows start at base + k × pitch; nothing makes the base more aligned than the
            // allocation, so a row could not hold a `T` at a valid address.
            return Err(Error::NotSupported { feature: Feature::Alignment(align), device: None });
        }
        let rows =
            height.checked_mul(depth).ok_or(Error::SizeOverflow { count: height, elem_size: depth })?;
        let width_bytes = bytes(width, size)?;
        let ctx = stream.context();
        if resource.context() != ctx {
            return Err(Error::WrongDevice {
                expected: resource.context().device().ordinal() as i32,
                actual: ctx.device().ordinal() as i32,
            });
        }
        let (alloc, pitch, layout) = if width_bytes == 0 || rows == 0 {
            (Allocation::from_ptr(0), width, None)
        } else {
            bytes(rows, width_bytes)?;
            let max_pitch = ctx.device().max_pitch()?;
            if width_bytes > max_pitch {
                // The driver refuses such rows as misuse; say so before asking it.
                return Err(Error::InvalidValue {
                    ctx: ErrorContext::op("PitchedBuffer: a row is wider than the device's MAX_PITCH")
                        .bytes(width_bytes)
                        .device(ctx.device().ordinal() as i32),
                });
            }
            let pitch_bytes = Self::pitch_for(ctx, width_bytes)?;
            if pitch_bytes > max_pitch {
                // A row that fits MAX_PITCH may still need a pitch past it once rounded up to the
                // pitch alignment; every 2D copy of the array would then be refused.
                return Err(Error::InvalidValue {
                    ctx: ErrorContext::op(
                        "PitchedBuffer: the pitch a row needs passes the device's MAX_PITCH",
                    )
                    .bytes(pitch_bytes)
                    .device(ctx.device().ordinal() as i32),
                });
            }
            if !pitch_bytes.is_multiple_of(size) {
                return Err(Error::Misaligned {
                    what: "pitch",
                    value: pitch_bytes as u64,
                    align: size as u64,
                });
            }
            let layout = AllocLayout::new(bytes(rows, pitch_bytes)?, PITCHED_ROW_ALIGNMENT)?;
            (resource.allocate(layout, stream)?, pitch_bytes / size, Some(layout))
        };
        // Cannot overflow: pitch × rows elements are the allocation's bytes divided by the size.
        let len = pitch * rows;
        Ok(PitchedBuffer {
            ptr: alloc.ptr,
            token: alloc.token,
            pitch,
            width,
            height,
            depth,
            len,
            layout,
            resource: resource.clone().into_dyn_resource(),
            order: StreamOrder::new(stream),
            _marker: PhantomData,
        })
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows per slice.
    pub fn height(&self) -> usize {
        self.height
    }

    /// Slices (1 for a 2D array).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Elements from one row to the next (at least the width).
    pub fn pitch(&self) -> usize {
        self.pitch
    }

    /// Bytes from one row to the next, as the driver chose.
    pub fn pitch_bytes(&self) -> usize {
        self.pitch * size_of::<T>()
    }

    /// Elements of the whole allocation, padding included (`pitch × height × depth`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0 || self.depth == 0
    }

    /// Device address of the first row (0 when nothing is allocated).
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

    /// The stream-order tracker: the stream the array was last used on.
    pub fn order(&self) -> &StreamOrder {
        &self.order
    }

    fn row_index(&self, z: usize, y: usize) -> Result<usize> {
        if z >= self.depth {
            return Err(Error::OutOfRange { start: z, end: z.saturating_add(1), len: self.depth });
        }
        if y >= self.height {
            return Err(Error::OutOfRange { start: y, end: y.saturating_add(1), len: self.height });
        }
        // Cannot overflow: z < depth and y < height, and height × depth was checked at construction.
        Ok(z * self.height + y)
    }

    fn row_ptr(&self, row: usize) -> CUdeviceptr {
        // Cannot overflow: the row lies inside the allocation.
        self.ptr + (row * self.pitch_bytes()) as u64
    }

    /// Row `y` (of slice 0) as a view of `width` elements.
    pub fn row(&self, y: usize) -> Result<DeviceSlice<'_, T>> {
        self.row_3d(0, y)
    }

    /// Row `y` of slice `z` as a view of `width` elements.
    pub fn row_3d(&self, z: usize, y: usize) -> Result<DeviceSlice<'_, T>> {
        let row = self.row_index(z, y)?;
        // SAFETY: the row's `width` elements lie inside this live allocation, aligned (pitch is a
        // multiple of T's size, hence of its alignment, and the base was checked to be aligned for
        // T at allocation) and initialised (zeroed or
        // AnyBitPattern); the view borrows `self`, and its work goes through `self.order`.
        Ok(unsafe {
            DeviceSlice::from_raw_parts(self.row_ptr(row), self.width, &self.order, self.resource.context())
        })
    }

    /// Row `y` (of slice 0) as an exclusive view of `width` elements.
    pub fn row_mut(&mut self, y: usize) -> Result<DeviceSliceMut<'_, T>> {
        self.row_3d_mut(0, y)
    }

    /// Row `y` of slice `z` as an exclusive view of `width` elements.
    pub fn row_3d_mut(&mut self, z: usize, y: usize) -> Result<DeviceSliceMut<'_, T>> {
        let row = self.row_index(z, y)?;
        // SAFETY: as in `row_3d`; the view borrows `self` exclusively.
        Ok(unsafe {
            DeviceSliceMut::from_raw_parts(
                self.row_ptr(row),
                self.width,
                &self.order,
                self.resource.context(),
            )
        })
    }

    /// The whole allocation as a side of 2D/3D copies (pitch, row width and rows per slice set, so
    /// that copies cannot reach the row padding).
    pub fn as_pitched(&self) -> Pitched<DeviceSlice<'_, T>> {
        // SAFETY: the range is this whole live allocation, initialised, borrowed with `self`.
        let all = unsafe {
            DeviceSlice::from_raw_parts(self.ptr, self.len(), &self.order, self.resource.context())
        };
        Pitched::new(all, self.pitch.max(1)).with_width(self.width).with_height(self.height)
    }

    /// The whole allocation as a writable side of 2D/3D copies and memsets.
    pub fn as_pitched_mut(&mut self) -> Pitched<DeviceSliceMut<'_, T>> {
        let (len, pitch, width, height) = (self.len(), self.pitch.max(1), self.width, self.height);
        // SAFETY: as in `as_pitched`; the view borrows `self` exclusively.
        let all =
            unsafe { DeviceSliceMut::from_raw_parts(self.ptr, len, &self.order, self.resource.context()) };
        Pitched::new(all, pitch).with_width(width).with_height(height)
    }

    /// The values without padding, row after row and slice after slice, after all work queued on
    /// the array so far.
    ///
    /// # Errors
    /// `OutOfMemory` when the host cannot hold the values (reserved fallibly, before the copy);
    /// the errors of the blocking [`copy_3d`](crate::copy_3d) that reads them.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Pod,
    {
        // width ≤ pitch and pitch × height × depth was checked at construction; checked anyway.
        let count = self
            .height
            .checked_mul(self.depth)
            .and_then(|rows| rows.checked_mul(self.width))
            .ok_or(Error::SizeOverflow { count: self.width, elem_size: size_of::<T>() })?;
        let mut out = Vec::new();
        // Reserved fallibly: an array larger than the host can hold is an error, not an abort.
        out.try_reserve_exact(count).map_err(|_| Error::OutOfMemory {
            ctx: ErrorContext::op("PitchedBuffer::to_vec: host Vec")
                .bytes(count.saturating_mul(size_of::<T>())),
            report: None,
        })?;
        out.resize(count, T::zeroed());
        if !out.is_empty() {
            let host = &mut Pitched::new(&mut out[..], self.width).with_height(self.height);
            crate::nd::copy_3d(&self.as_pitched(), host, Copy3D::new(self.width, self.height, self.depth))?;
        }
        Ok(out)
    }
}

impl<T> fmt::Debug for PitchedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PitchedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("width", &self.width)
            .field("height", &self.height)
            .field("depth", &self.depth)
            .field("pitch", &self.pitch)
            .finish()
    }
}

impl<T> Drop for PitchedBuffer<T> {
    fn drop(&mut self) {
        let Some(layout) = self.layout else { return };
        // `join_mut`, not `join`: exclusive access needs no lock, so a drop inside a
        // `StreamOrder::queue_on` closure (where locking an order is refused) frees the memory
        // instead of leaking it.
        let stream = match self.order.join_mut() {
            Ok(stream) => stream,
            Err(e) => {
                // No stream is known to follow every use: returning the memory could hand it to
                // new work while old work still runs. Leak it instead.
                tracing::warn!(ptr = self.ptr, bytes = layout.bytes, error = %e, "ordering the free of a pitched buffer failed; leaking");
                return;
            }
        };
        // SAFETY: `ptr` and its token came from `allocate` on this resource with `layout` and are
        // returned once, unchanged;
        // every use of it went through `order`, and `stream` is ordered after all of them; no view
        // outlives `self`.
        unsafe { self.resource.deallocate(Allocation { ptr: self.ptr, token: self.token }, layout, stream) };
    }
}
