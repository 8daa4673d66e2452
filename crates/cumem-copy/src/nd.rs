//! 2D and 3D copies (`cuMemcpy2D`/`cuMemcpy3D` and their async forms) and 2D memsets: one engine
//! for every pair of sides, which checks the extents against both sides, lets each side order the
//! copy (device views through their stream order, host kinds through their pending-work tracker)
//! and makes one driver call. The rules users need are on [`copy_2d`], [`copy_3d`], [`Copy2D`]
//! and [`StreamCopy`](crate::StreamCopy).

use bytemuck::Pod;
use cumem_core::{DeviceSliceMut, Error, ErrorContext, Result, Stream, blocking_host_copy};
use cumem_sys::sys::{self, CUdeviceptr, CUmemorytype};

use crate::extent::{Copy2D, Copy3D, Origin, Rect2D, bytes, check_side};
use crate::ffi::{self, Width};
use crate::profile::{self, CopyKind};
use crate::region::{CopyDst, CopySrc, Mem, Pitched};
use crate::validate;

/// How a copy is queued: blocking on the legacy stream, or on a stream.
#[derive(Clone, Copy)]
enum Mode<'s> {
    Blocking,
    Queued(&'s Stream),
}

/// Copies a 2D region from `src` to `dst`, blocking, on the legacy stream of the device side's
/// context: a host destination holds the values and a host source may be reused when this
/// returns. The sides are [`Pitched`] views of pageable slices, page-locked host kinds or device
/// views, or a [`PitchedBuffer`](crate::PitchedBuffer)'s (the queued
/// [`StreamCopy::copy_2d`](crate::StreamCopy::copy_2d) takes no pageable slices, because its copy
/// may run after the call returns). Either side may be pageable, but at least one must be device
/// memory. Between two device sides this uses `cuMemcpy2DUnaligned`, so any pitch works.
///
/// A shared page-locked host source (a `Pitched<&H>` of a pinned, mapped or registered buffer)
/// keeps its host-access tracker locked until the copy returns, which is after the work already
/// queued on every blocking stream of the context (the legacy stream waits for it): another
/// thread that reads that buffer on the host, or queues work with it, waits meanwhile. The queued
/// form ([`StreamCopy::copy_2d`](crate::StreamCopy::copy_2d)) on a non-blocking stream holds the
/// lock only while it queues the copy (unless the other side is host memory too: the driver then
/// copies in the call).
///
/// # Errors
///
/// In this order: `WrongDevice` when both sides are device memory of different devices (checked
/// even for an empty extent); an empty extent is then `Ok` and checks nothing else; the extent
/// against each side as [`Copy2D`] lists (`OutOfRange`, `ZeroSize`); `InvalidValue` when both
/// sides are host memory (no context to run in: queue the copy between page-locked kinds with
/// [`StreamCopy::copy_2d`](crate::StreamCopy::copy_2d), or copy on the host); `SizeOverflow` when
/// a byte count overflows; `InvalidValue` when a side's pitch in bytes passes the device's
/// `MAX_PITCH` (only a caller-built [`Pitched`] view can have one). All of these come before the
/// copy reaches the driver. A pageable host side that is managed memory is waited for, or refused
/// with `NotSupported { feature: ConcurrentManagedAccess, .. }` where the device lacks concurrent
/// managed access (see [`cumem_core::blocking_host_copy`]). The driver's own errors come as their
/// variants.
pub fn copy_2d<T: Pod>(src: &impl CopySrc<T>, dst: &mut impl CopyDst<T>, extent: Copy2D) -> Result<()> {
    run(Mode::Blocking, src, dst, &extent.as_3d(), false)
}

/// Copies a 3D box from `src` to `dst`, blocking (see [`copy_2d`], whose notes on two host sides
/// and on page-locked host sources hold here too). Both sides need their rows per slice
/// ([`Pitched::with_height`]).
///
/// # Errors
///
/// As [`copy_2d`], the extent checked as [`Copy3D`] lists (a zero depth is an empty extent too; a
/// side without rows per slice is `ZeroSize { what: "rows per slice" }`).
pub fn copy_3d<T: Pod>(src: &impl CopySrc<T>, dst: &mut impl CopyDst<T>, extent: Copy3D) -> Result<()> {
    run(Mode::Blocking, src, dst, &extent, true)
}

pub(crate) fn copy_2d_on<T: Pod>(
    stream: &Stream,
    src: &impl CopySrc<T>,
    dst: &mut impl CopyDst<T>,
    extent: Copy2D,
) -> Result<()> {
    run(Mode::Queued(stream), src, dst, &extent.as_3d(), false)
}

pub(crate) fn copy_3d_on<T: Pod>(
    stream: &Stream,
    src: &impl CopySrc<T>,
    dst: &mut impl CopyDst<T>,
    extent: Copy3D,
) -> Result<()> {
    run(Mode::Queued(stream), src, dst, &extent, true)
}

/// Driver-facing description of one side.
struct Placed {
    mem: Mem,
    x_bytes: usize,
    y: usize,
    z: usize,
    pitch_bytes: usize,
    height: usize,
}

fn memory_type(mem: Mem) -> CUmemorytype {
    match mem {
        Mem::Host(_) => CUmemorytype::CU_MEMORYTYPE_HOST,
        Mem::Device(_) => CUmemorytype::CU_MEMORYTYPE_DEVICE,
    }
}

fn run<T: Pod>(
    mode: Mode<'_>,
    src: &impl CopySrc<T>,
    dst: &mut impl CopyDst<T>,
    b: &Copy3D,
    three_d: bool,
) -> Result<()> {
    let (sg, dg) = (src.geometry(), dst.geometry());
    // The devices are checked even for an empty extent, as the 1D copies check them for an empty
    // range: a copy with the wrong stream is refused whatever its size.
    let (sc, dc) = (src.device_context(), dst.device_context());
    if let (Some(s), Some(d)) = (sc, dc) {
        validate::same_device(d, s)?;
    }
    if let Mode::Queued(stream) = mode {
        for ctx in [sc, dc].into_iter().flatten() {
            validate::on_stream_device(stream, ctx)?;
        }
    }
    // Nothing to copy is never an error (the driver agrees: Height or Depth 0 succeeds), so the
    // sides' extents and pitches are not checked.
    if b.is_empty() {
        return Ok(());
    }
    check_side(sg, Origin { x: b.src_x, y: b.src_y, z: b.src_z }, b, three_d)?;
    check_side(dg, Origin { x: b.dst_x, y: b.dst_y, z: b.dst_z }, b, three_d)?;
    let stream = match mode {
        Mode::Queued(stream) => stream.clone(),
        Mode::Blocking => match dc.or(sc) {
            Some(ctx) => Stream::legacy(ctx),
            None => {
                // A host-to-host copy has no device, hence no context (nor legacy stream) to run
                // in: a bad pair of arguments, refused before any driver call.
                return Err(Error::InvalidValue {
                    ctx: ErrorContext::op(
                        "blocking 2D/3D copy between two host sides (one must be device memory)",
                    ),
                });
            }
        },
    };
    let size = size_of::<T>();
    let width_bytes = bytes(b.width, size)?;
    let place = |mem, g: crate::extent::Geometry, x: usize, y, z| -> Result<Placed> {
        Ok(Placed {
            mem,
            x_bytes: bytes(x, size)?,
            y,
            z,
            pitch_bytes: bytes(g.pitch, size)?,
            height: g.height.unwrap_or(0),
        })
    };
    // Check the byte conversions before any side effect.
    place(Mem::Device(0), sg, b.src_x, b.src_y, b.src_z)?;
    place(Mem::Device(0), dg, b.dst_x, b.dst_y, b.dst_z)?;
    // The driver refuses any pitch above the device's MAX_PITCH (driver brief §6.3), host sides'
    // too and for one row as well: refused here, before it sees the misuse. `PitchedBuffer`s
    // never have such a pitch; a caller-built `Pitched` view may.
    let device = stream.context().device();
    let max_pitch = device.max_pitch()?;
    for g in [sg, dg] {
        let pitch = bytes(g.pitch, size)?;
        if pitch > max_pitch {
            return Err(Error::InvalidValue {
                ctx: ErrorContext::op("2D/3D copy: a side's pitch passes the device's MAX_PITCH")
                    .bytes(pitch)
                    .device(device.ordinal() as i32),
            });
        }
    }
    let raw_stream = match mode {
        Mode::Blocking => None,
        Mode::Queued(s) => Some(s.raw()),
    };
    let kind = if three_d { CopyKind::Copy3D } else { CopyKind::Copy2D };
    let moved = width_bytes.saturating_mul(b.height).saturating_mul(if three_d { b.depth } else { 1 });
    // Traced before the sides take their locks and before the context is bound; what it logs is
    // logged after both sides let go (see `profile::CopyTrace`).
    let mut trace = profile::begin(&stream, kind, moved);
    let mut enqueue = |s: Mem, d: Mem| -> Result<()> {
        let (src_host, dst_host) = (host_side(s), host_side(d));
        let s = place(s, sg, b.src_x, b.src_y, b.src_z)?;
        let d = place(d, dg, b.dst_x, b.dst_y, b.dst_z)?;
        stream.context().bind()?;
        let copy = || -> Result<()> {
            if three_d {
                let p = params_3d(&s, &d, width_bytes, b);
                // SAFETY: both sides were checked to contain every row of every slice named (pitch,
                // rows per slice and memory length), and each side ordered the copy on `stream` and
                // keeps its memory valid (device views by borrow and stream order, host kinds by their
                // tracker, pageable slices only in blocking mode, which completes before returning).
                unsafe { ffi::memcpy_3d(&p, raw_stream) }
            } else {
                let p = params_2d(&s, &d, width_bytes, b.height);
                // SAFETY: as above, for every row named.
                unsafe { ffi::memcpy_2d(&p, raw_stream) }
            }
        };
        let ctx = stream.context();
        let mut copy = || trace.around(&stream, copy);
        match (mode, src_host, dst_host) {
            (Mode::Queued(_), ..) | (Mode::Blocking, None, None) => copy(),
            // A host side given as a plain slice may be managed memory, which the driver uses as
            // device memory: refused, or waited for.
            (Mode::Blocking, Some(h), None) | (Mode::Blocking, None, Some(h)) => {
                blocking_host_copy(ctx, h, copy)
            }
            // Refused above (a blocking copy between two host sides has no context); kept
            // correct rather than unreachable, should that refusal ever be lifted.
            (Mode::Blocking, Some(a), Some(b)) => {
                blocking_host_copy(ctx, a, || blocking_host_copy(ctx, b, copy))
            }
        }
    };
    // SAFETY: `enqueue` queues exactly one copy on `stream` that reads `src` and writes `dst` only
    // inside their checked geometries; `T: Pod`, so any bytes copied are valid values. Pageable
    // sides can only reach here in blocking mode (the queued entry points require `Queued*`,
    // sealed by `sealed::Queued`, which this crate implements for no pageable side).
    unsafe { src.with_read(&stream, |s| dst.with_write(&stream, |d| enqueue(s, d))) }
}

/// The host address of a host side.
fn host_side(mem: Mem) -> Option<*const std::ffi::c_void> {
    match mem {
        Mem::Host(h) => Some(h.cast_const()),
        Mem::Device(_) => None,
    }
}

/// The host pointer and device address fields of one side (the unused one null/0).
fn split(mem: Mem) -> (*mut std::ffi::c_void, CUdeviceptr) {
    match mem {
        Mem::Host(h) => (h, 0),
        Mem::Device(d) => (std::ptr::null_mut(), d),
    }
}

fn params_2d(s: &Placed, d: &Placed, width_bytes: usize, height: usize) -> sys::CUDA_MEMCPY2D {
    let ((src_host, src_device), (dst_host, dst_device)) = (split(s.mem), split(d.mem));
    sys::CUDA_MEMCPY2D {
        srcXInBytes: s.x_bytes,
        srcY: s.y,
        srcMemoryType: memory_type(s.mem),
        srcHost: src_host.cast_const(),
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        srcPitch: s.pitch_bytes,
        dstXInBytes: d.x_bytes,
        dstY: d.y,
        dstMemoryType: memory_type(d.mem),
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: d.pitch_bytes,
        WidthInBytes: width_bytes,
        Height: height,
    }
}

fn params_3d(s: &Placed, d: &Placed, width_bytes: usize, b: &Copy3D) -> sys::CUDA_MEMCPY3D {
    let ((src_host, src_device), (dst_host, dst_device)) = (split(s.mem), split(d.mem));
    // Level of detail and the reserved fields must be 0 / NULL.
    sys::CUDA_MEMCPY3D {
        srcXInBytes: s.x_bytes,
        srcY: s.y,
        srcZ: s.z,
        srcLOD: 0,
        srcMemoryType: memory_type(s.mem),
        srcHost: src_host.cast_const(),
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: s.pitch_bytes,
        srcHeight: s.height,
        dstXInBytes: d.x_bytes,
        dstY: d.y,
        dstZ: d.z,
        dstLOD: 0,
        dstMemoryType: memory_type(d.mem),
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: d.pitch_bytes,
        dstHeight: d.height,
        WidthInBytes: width_bytes,
        Height: b.height,
        Depth: b.depth,
    }
}

/// Queues setting every element of `rect` in device memory `dst` to `value` (`T` 1, 2 or 4 bytes).
pub(crate) fn fill_2d_on<T: Pod>(
    stream: &Stream,
    dst: &mut Pitched<DeviceSliceMut<'_, T>>,
    value: T,
    rect: Rect2D,
) -> Result<()> {
    let width = match *bytemuck::bytes_of(&value) {
        [b] => Width::W8(b),
        [a, b] => Width::W16(u16::from_ne_bytes([a, b])),
        [a, b, c, d] => Width::W32(u32::from_ne_bytes([a, b, c, d])),
        ref other => return Err(crate::stream_ordered::fill_width_refused(other.len())),
    };
    // Checked before the empty return, as the 1D memsets do.
    validate::on_stream_device(stream, dst.view_mut().context())?;
    if rect.width == 0 || rect.height == 0 {
        // Nothing is stored: no extent, pitch or address is checked.
        return Ok(());
    }
    let g = crate::region::sealed::Dst::<T>::geometry(dst);
    let b = Copy2D::new(rect.width, rect.height).as_3d();
    check_side(g, Origin { x: rect.x, y: rect.y, z: 0 }, &b, false)?;
    let mut view = dst.view_mut();
    let size = size_of::<T>();
    // A view is only as aligned as `T` (a `[u8; 4]` view may start at any byte), and the driver
    // needs every row aligned to the memset width: refused here, as the 1D memset does. Rows
    // start at the base plus multiples of `size` (pitch and x are counted in elements), so the
    // base is the only address to check.
    if !view.device_ptr().is_multiple_of(size as u64) {
        return Err(Error::Misaligned {
            what: "memset address",
            value: view.device_ptr(),
            align: size as u64,
        });
    }
    let pitch_bytes = bytes(g.pitch, size)?;
    let start = bytes(rect.y, pitch_bytes)?
        .checked_add(bytes(rect.x, size)?)
        .ok_or(Error::SizeOverflow { count: rect.y, elem_size: pitch_bytes })?;
    // Traced before `on` takes the view's order and binds the context (see `profile::CopyTrace`).
    let mut trace = profile::begin(stream, CopyKind::Memset, rect.width * rect.height * size);
    // `on` made the stream's context current.
    let on = view.on(stream)?;
    // SAFETY: the rectangle was checked to lie inside the view (rows of `width` elements from
    // `start`, `pitch_bytes` apart); the view is exclusively borrowed device memory ordered on
    // `stream`; its address was checked above to be a multiple of T's size, which is the memset
    // width, and the pitch and `start` are multiples of it (counted in elements of T).
    trace.around(stream, || unsafe {
        ffi::memset_2d_async(
            on.device_ptr() + start as u64,
            pitch_bytes,
            width,
            rect.width,
            rect.height,
            stream.raw(),
        )
    })
}
