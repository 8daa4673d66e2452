//! Copies and memsets queued on a stream: the [`StreamCopy`] trait, implemented for [`Stream`]
//! (its user-facing rules are on the trait).

use bytemuck::{AnyBitPattern, NoUninit, Pod};
use cumem_core::{AsDeviceSlice, AsDeviceSliceMut, DeviceSliceMut, Error, HostMemory, Result, Stream};

use crate::ffi::{self, Width};
use crate::profile::{self, CopyKind};
use crate::region::{Pitched, QueuedDst, QueuedSrc};
use crate::{Copy2D, Copy3D, Rect2D, nd, validate};

/// Transfers queued on a stream: copies and memsets that return once queued, safe because each
/// memory kind tracks them.
///
/// Host memory in a queued copy must be page-locked, and must not be touched by the host until
/// the device is done with it. These methods take any [`HostMemory`] — a
/// [`PinnedBuffer`](cumem_core::PinnedBuffer), [`MappedBuffer`](cumem_core::MappedBuffer) or
/// [`HostRegistered`](cumem_core::HostRegistered) — whose tracker records the queued copy: reading
/// its host data waits for a pending device write, writing it waits for pending device reads and
/// writes, and dropping it waits for both. Device memory is ordered by its stream tracker, so a
/// buffer last used on another stream is waited for first. 2D/3D copies and 2D memsets are here
/// too ([`StreamCopy::copy_2d`], [`StreamCopy::copy_3d`], [`StreamCopy::fill_2d`]).
///
/// # Copies between two host memories block
///
/// A copy between two host memories is not queued: when both ends are host memory (a
/// [`PinnedBuffer`](cumem_core::PinnedBuffer) or [`HostRegistered`](cumem_core::HostRegistered)
/// and the device view of a [`MappedBuffer`](cumem_core::MappedBuffer), or two mapped views, or,
/// in 2D/3D, two page-locked host sides), the driver waits in the call for the stream's earlier
/// work, copies on the calling thread and returns with the bytes in place (observed on an H100,
/// 2026-11-23; the simulator does the same). Such a copy on a stream that a kernel or a host
/// function occupies therefore blocks the caller until that work is done; meanwhile the copy
/// keeps both buffers' cumem bookkeeping locked (their stream orders and host-access trackers), so
/// another thread that uses either buffer waits too. To keep it queued, go through device memory
/// (pinned → device and device → mapped are both queued), or write mapped memory from the host
/// directly. Copies with one end in device memory (a mapped view included) and memsets of mapped
/// memory stay queued.
///
/// # Errors
///
/// Every method checks its arguments before the copy is queued and answers, besides the errors
/// each one lists, `WrongDevice` when device memory belongs to a device other than the stream's,
/// and `NotPermitted` when called inside a
/// [`StreamOrder::queue_on`](cumem_core::StreamOrder::queue_on) closure where the transfer would
/// lock cumem memory (see there); the driver's own errors come as their variants. An empty
/// transfer is `Ok` and queues nothing, once the devices (and a 1D copy's lengths) are checked.
///
/// ```
/// # cumem_sys::testing::init();
/// use cumem_core::{DeviceBuffer, Device, PinnedBuffer, Stream};
/// use cumem_copy::StreamCopy;
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::non_blocking(&ctx)?;
/// let src = PinnedBuffer::from_slice(&ctx, &[5u32; 256])?;
/// let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 256)?;
/// let mut dst = PinnedBuffer::<u32>::zeroed(&ctx, 256)?;
/// stream.copy_h2d(&src, &mut dev)?;
/// stream.fill(&mut dev.slice_mut(128..)?, 9u32)?;
/// stream.copy_d2h(&dev, &mut dst)?;
/// // No explicit synchronisation: reading the pinned buffer waits for the copy into it.
/// assert_eq!(dst.as_slice()?[..2], [5, 5]);
/// assert_eq!(dst.as_slice()?[254..], [9, 9]);
/// # Ok::<(), cumem_core::Error>(())
/// ```
pub trait StreamCopy {
    /// Queues a copy of page-locked host memory into device memory (same length).
    ///
    /// # Errors
    /// `LengthMismatch` when the lengths differ; `WrongDevice` when `dst` is not on the stream's
    /// device; see also the [trait's errors](StreamCopy#errors).
    fn copy_h2d<T: NoUninit>(
        &self,
        src: &impl HostMemory<T>,
        dst: &mut impl AsDeviceSliceMut<T>,
    ) -> Result<()>;

    /// Queues a copy of device memory into page-locked host memory (same length).
    ///
    /// # Errors
    /// `LengthMismatch` when the lengths differ; `WrongDevice` when `src` is not on the stream's
    /// device; see also the [trait's errors](StreamCopy#errors).
    fn copy_d2h<T: AnyBitPattern>(
        &self,
        src: &impl AsDeviceSlice<T>,
        dst: &mut impl HostMemory<T>,
    ) -> Result<()>;

    /// Queues a device-to-device copy (same length, same device).
    ///
    /// # Errors
    /// `LengthMismatch` when the lengths differ; `WrongDevice` when `dst` is not on the stream's
    /// device or `src` not on `dst`'s; see also the [trait's errors](StreamCopy#errors).
    fn copy_d2d<T>(&self, src: &impl AsDeviceSlice<T>, dst: &mut impl AsDeviceSliceMut<T>) -> Result<()>;

    /// Queues setting every element of `dst` to `value` (with [`StreamCopy::memset_d8`],
    /// [`StreamCopy::memset_d16`] or [`StreamCopy::memset_d32`], by the width of `T`).
    ///
    /// # Errors
    /// `InvalidValue` when `T` is not 1, 2 or 4 bytes wide (before anything else is checked);
    /// otherwise those of the memset used.
    fn fill<T: Pod>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: T) -> Result<()>;

    /// Queues setting every byte of `dst` to `value`. `T: AnyBitPattern` because the bytes written
    /// may be read back on the host as `T` (mapped and unified memory hand out `&[T]`).
    ///
    /// # Errors
    /// `WrongDevice` when `dst` is not on the stream's device; see also the
    /// [trait's errors](StreamCopy#errors).
    fn memset_d8<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u8) -> Result<()>;

    /// Queues setting every 16-bit word of `dst` to `value`.
    ///
    /// # Errors
    /// `WrongDevice` when `dst` is not on the stream's device (checked first, even for an empty
    /// `dst`); `Misaligned { what: "memset length in bytes" }` or `Misaligned { what: "memset
    /// address" }` when its size or address is not a multiple of 2 bytes, unless it is empty: an
    /// empty `dst` is a no-op wherever it starts. See also the [trait's errors](StreamCopy#errors).
    fn memset_d16<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u16) -> Result<()>;

    /// Queues setting every 32-bit word of `dst` to `value`.
    ///
    /// # Errors
    /// As [`StreamCopy::memset_d16`], with multiples of 4 bytes.
    fn memset_d32<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u32) -> Result<()>;

    /// Queues a 2D copy between page-locked host memory and device memory (any direction).
    /// Extents are checked against both sides first (see [`Copy2D`]).
    ///
    /// Between two device sides this is `cuMemcpy2DAsync`, which the CUDA documentation says may
    /// fail (`InvalidValue`) for intra-device copies whose pitches were not computed by
    /// `cuMemAllocPitch`, and which has no unaligned form. [`PitchedBuffer`](crate::PitchedBuffer)
    /// pitches are laid out as `cuMemAllocPitch` lays them out (multiples of
    /// [`PITCHED_ROW_ALIGNMENT`](crate::PITCHED_ROW_ALIGNMENT)); a device view wrapped in
    /// [`Pitched`](crate::Pitched) with any other pitch may be refused on a GPU (the simulator
    /// accepts every pitch, as the documentation allows). The blocking [`copy_2d`](crate::copy_2d)
    /// uses `cuMemcpy2DUnaligned` for device-to-device copies and has no such restriction.
    ///
    /// Between two page-locked host sides the copy is not queued: the driver runs it in the call
    /// (see [Copies between two host memories block](StreamCopy#copies-between-two-host-memories-block)).
    ///
    /// # Errors
    /// Before the copy is queued, in this order: `WrongDevice` when the two sides are device memory
    /// of different devices, or a device side is not on the stream's device (checked even for an
    /// empty extent); an empty extent (zero width or height) is then `Ok` and checks nothing else;
    /// the extent against each side is refused as [`Copy2D`] lists (`OutOfRange`, `ZeroSize {
    /// what: "pitch" }`); then `SizeOverflow` when a byte count overflows, and `InvalidValue` when
    /// a side's pitch in bytes passes the device's `MAX_PITCH` (only a caller-built [`Pitched`]
    /// view can have such a pitch). See also the [trait's errors](StreamCopy#errors).
    fn copy_2d<T: Pod>(
        &self,
        src: &impl QueuedSrc<T>,
        dst: &mut impl QueuedDst<T>,
        extent: Copy2D,
    ) -> Result<()>;

    /// Queues a 3D copy (see [`StreamCopy::copy_2d`]); both sides need their rows per slice
    /// ([`Pitched::with_height`]).
    ///
    /// # Errors
    /// As [`StreamCopy::copy_2d`], the extent checked as [`Copy3D`] lists (a zero depth is an
    /// empty extent too; a side without rows per slice is `ZeroSize { what: "rows per slice" }`).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_copy::{Copy3D, Pitched, PitchedBuffer, StreamCopy};
    /// use cumem_core::{Device, PinnedBuffer, Stream};
    /// let ctx = Device::get(0)?.context()?;
    /// let stream = Stream::non_blocking(&ctx)?;
    /// // A 4 × 3 × 2 volume, dense on the host.
    /// let host = PinnedBuffer::from_slice(&ctx, &(0..24u32).collect::<Vec<_>>())?;
    /// let mut vol = PitchedBuffer::<u32>::zeroed_3d(&stream, 4, 3, 2)?;
    /// stream.copy_3d(&Pitched::new(&host, 4).with_height(3), &mut vol.as_pitched_mut(), Copy3D::new(4, 3, 2))?;
    /// let mut back = PinnedBuffer::<u32>::zeroed(&ctx, 4)?;
    /// // One row back: row 2 of slice 1, i.e. elements 20..24.
    /// let row = Copy3D::new(4, 1, 1).src_at(0, 2, 1);
    /// stream.copy_3d(&vol.as_pitched(), &mut Pitched::new(&mut back, 4).with_height(1), row)?;
    /// assert_eq!(back.as_slice()?, &[20, 21, 22, 23]); // waits for the copy
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    fn copy_3d<T: Pod>(
        &self,
        src: &impl QueuedSrc<T>,
        dst: &mut impl QueuedDst<T>,
        extent: Copy3D,
    ) -> Result<()>;

    /// Queues setting every element of `rect` in pitched device memory to `value`
    /// (`cuMemsetD2D*`).
    ///
    /// # Errors
    /// Before any driver call, in this order: `InvalidValue` when `T` is not 1, 2 or 4 bytes
    /// wide; `WrongDevice` when `dst` is not on the stream's device; an empty `rect` (zero width
    /// or height) is then `Ok` and checks nothing else; `rect` against `dst` is refused as
    /// [`Copy2D`] lists (`OutOfRange`, `ZeroSize { what: "pitch" }`); `Misaligned { what: "memset
    /// address" }` when the view does not start at a multiple of `T`'s size; `SizeOverflow` when
    /// a byte offset overflows. See also the [trait's errors](StreamCopy#errors).
    fn fill_2d<T: Pod>(&self, dst: &mut Pitched<DeviceSliceMut<'_, T>>, value: T, rect: Rect2D)
    -> Result<()>;
}

impl StreamCopy for Stream {
    fn copy_h2d<T: NoUninit>(
        &self,
        src: &impl HostMemory<T>,
        dst: &mut impl AsDeviceSliceMut<T>,
    ) -> Result<()> {
        let dst = dst.as_device_slice_mut();
        validate::same_len(dst.len(), src.len())?;
        validate::on_stream_device(self, dst.context())?;
        if dst.bytes() == 0 {
            return Ok(());
        }
        // The host side is tracked first and the device side inside its closure: the host
        // tracker's lock may be held while the device memory's order is locked, never the reverse
        // (the closure below locks nothing, and `queue_on` refuses any cumem lock taken inside a
        // closure), so two copies in opposite directions between two memories cannot deadlock.
        let bytes = dst.bytes();
        let mut dst = dst;
        // Traced before any lock is taken, and what it logs is logged after they are let go.
        let mut trace = profile::begin(self, CopyKind::HostToDevice, bytes);
        let enqueue = |from: *const T, _| {
            dst.queue_on(self, |to| {
                // SAFETY: `from` is page-locked memory of `bytes` bytes kept alive and unwritten
                // until the copy completes; `to` is exclusively borrowed device memory, ordered on
                // `self`.
                trace.around(self, || unsafe { ffi::htod_async(to, from.cast(), bytes, self.raw()) })
            })
        };
        // SAFETY: `enqueue` queues one copy on `self` that reads exactly `len` values from the
        // page-locked pointer; the host kind keeps the memory unwritten until it completes.
        unsafe { src.device_read(self, enqueue) }
    }

    fn copy_d2h<T: AnyBitPattern>(
        &self,
        src: &impl AsDeviceSlice<T>,
        dst: &mut impl HostMemory<T>,
    ) -> Result<()> {
        let src = src.as_device_slice();
        validate::same_len(dst.len(), src.len())?;
        validate::on_stream_device(self, src.context())?;
        if src.bytes() == 0 {
            return Ok(());
        }
        let bytes = src.bytes();
        // Traced outside the locks (see `copy_h2d`).
        let mut trace = profile::begin(self, CopyKind::DeviceToHost, bytes);
        // Host side first, device side inside (see `copy_h2d`).
        let enqueue = |to: *mut T, _| {
            src.queue_on(self, |from| {
                // SAFETY: `to` is page-locked memory of `bytes` bytes that the host will not touch
                // until the copy completes; `from` is device memory ordered on `self`.
                trace.around(self, || unsafe { ffi::dtoh_async(to.cast(), from, bytes, self.raw()) })
            })
        };
        // SAFETY: `enqueue` queues one copy on `self` writing exactly `len` values of `T` (any
        // bytes are valid: AnyBitPattern); the host kind blocks host access until it completes.
        unsafe { dst.device_write(self, enqueue) }
    }

    fn copy_d2d<T>(&self, src: &impl AsDeviceSlice<T>, dst: &mut impl AsDeviceSliceMut<T>) -> Result<()> {
        let (src, dst) = (src.as_device_slice(), dst.as_device_slice_mut());
        validate::same_len(dst.len(), src.len())?;
        validate::on_stream_device(self, dst.context())?;
        validate::same_device(dst.context(), src.context())?;
        if dst.bytes() == 0 {
            return Ok(());
        }
        // The source through a guard, which holds no lock while the copy is queued, so that the
        // destination can take the scoped door (no lock at all through `&mut` of a buffer) even
        // when both are views of one buffer (two halves of a split, whose order the guard
        // shares): a scoped door taken inside another would be refused.
        // Traced outside the locks (see `copy_h2d`).
        let mut trace = profile::begin(self, CopyKind::DeviceToDevice, dst.bytes());
        let source = src.on(self)?;
        let (from, bytes) = (source.device_ptr(), dst.bytes());
        let mut dst = dst;
        let queued = dst.queue_on(self, |to| {
            // SAFETY: both ranges are device memory of `bytes` bytes, ordered on `self` (the
            // source's guard lives until after the copy is queued); `dst` is exclusively
            // borrowed, so the ranges do not overlap.
            trace.around(self, || unsafe { ffi::dtod_async(to, from, bytes, self.raw()) })
        });
        // Recorded as a user of the source once the copy is queued (or failed to be).
        drop(source);
        queued
    }

    fn fill<T: Pod>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: T) -> Result<()> {
        let bytes = bytemuck::bytes_of(&value);
        match *bytes {
            [b] => self.memset_d8(dst, b),
            [a, b] => self.memset_d16(dst, u16::from_ne_bytes([a, b])),
            [a, b, c, d] => self.memset_d32(dst, u32::from_ne_bytes([a, b, c, d])),
            _ => Err(fill_width_refused(bytes.len())),
        }
    }

    fn memset_d8<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u8) -> Result<()> {
        memset(self, dst, Width::W8(value))
    }

    fn memset_d16<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u16) -> Result<()> {
        memset(self, dst, Width::W16(value))
    }

    fn memset_d32<T: AnyBitPattern>(&self, dst: &mut impl AsDeviceSliceMut<T>, value: u32) -> Result<()> {
        memset(self, dst, Width::W32(value))
    }

    fn copy_2d<T: Pod>(
        &self,
        src: &impl QueuedSrc<T>,
        dst: &mut impl QueuedDst<T>,
        extent: Copy2D,
    ) -> Result<()> {
        nd::copy_2d_on(self, src, dst, extent)
    }

    fn copy_3d<T: Pod>(
        &self,
        src: &impl QueuedSrc<T>,
        dst: &mut impl QueuedDst<T>,
        extent: Copy3D,
    ) -> Result<()> {
        nd::copy_3d_on(self, src, dst, extent)
    }

    fn fill_2d<T: Pod>(
        &self,
        dst: &mut Pitched<DeviceSliceMut<'_, T>>,
        value: T,
        rect: Rect2D,
    ) -> Result<()> {
        nd::fill_2d_on(self, dst, value, rect)
    }
}

/// The refusal of a fill whose element is not 1, 2 or 4 bytes wide: the driver's memsets store
/// only those widths, and the request is a bad argument rather than a misaligned address.
pub(crate) fn fill_width_refused(size: usize) -> Error {
    Error::InvalidValue {
        ctx: cumem_sys::ErrorContext::op("fill: the element must be 1, 2 or 4 bytes wide").bytes(size),
    }
}

fn memset<T: AnyBitPattern>(stream: &Stream, dst: &mut impl AsDeviceSliceMut<T>, value: Width) -> Result<()> {
    let dst = dst.as_device_slice_mut();
    validate::on_stream_device(stream, dst.context())?;
    if dst.bytes() == 0 {
        // Nothing is stored, so no address or length can be misaligned for the stores.
        return Ok(());
    }
    let width = match value {
        Width::W8(_) => 1,
        Width::W16(_) => 2,
        Width::W32(_) => 4,
    };
    if dst.bytes() % width != 0 {
        return Err(Error::Misaligned {
            what: "memset length in bytes",
            value: dst.bytes() as u64,
            align: width as u64,
        });
    }
    if dst.device_ptr() % width as u64 != 0 {
        return Err(Error::Misaligned {
            what: "memset address",
            value: dst.device_ptr(),
            align: width as u64,
        });
    }
    let bytes = dst.bytes();
    let mut dst = dst;
    // Traced outside the locks (see `copy_h2d`).
    let mut trace = profile::begin(stream, CopyKind::Memset, bytes);
    dst.queue_on(stream, |to| {
        // SAFETY: the range is exclusively borrowed device memory of `bytes` bytes, aligned to
        // the width (checked above), ordered on `stream`.
        trace.around(stream, || unsafe { ffi::memset_async(to, value, bytes / width, stream.raw()) })
    })
}
