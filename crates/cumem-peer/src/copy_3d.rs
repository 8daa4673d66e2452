//! 3D peer copies: a box of pitched device memory on one device copied into pitched device
//! memory on another (`cuMemcpy3DPeerAsync`), with `cumem-copy`'s [`Copy3D`] extents.
//!
//! Both sides are device views seen as rows and slices ([`Pitched`] with a height, as
//! [`PitchedBuffer::as_pitched`](cumem_copy::PitchedBuffer::as_pitched) gives); the box is
//! checked against each side (`OutOfRange`, `ZeroSize`) before anything is queued, and padding
//! outside it is never touched. Ordering is that of
//! [`PeerStreamCopy::copy_peer`](crate::PeerStreamCopy::copy_peer). The driver copies between any
//! two devices, over the link when there is one and through host memory otherwise: the returned
//! [`PeerCopy`] says which.
//!
//! ```
//! # cumem_sys::testing::init_with("devices=2,peer=0-1");
//! use cumem_copy::{Copy3D, PitchedBuffer, StreamCopy, Pitched};
//! use cumem_core::{Device, PinnedBuffer, Stream};
//! use cumem_peer::PeerStreamCopy3D;
//! let s: Vec<Stream> = (0..2).map(|d| Stream::new(&Device::get(d)?.context()?)).collect::<Result<_, _>>()?;
//! let host = PinnedBuffer::from_slice(s[0].context(), &(0..24u32).collect::<Vec<_>>())?;
//! let mut a = PitchedBuffer::<u32>::zeroed_3d(&s[0], 4, 3, 2)?;
//! s[0].copy_3d(&Pitched::new(&host, 4).with_height(3), &mut a.as_pitched_mut(), Copy3D::new(4, 3, 2))?;
//! let mut b = PitchedBuffer::<u32>::zeroed_3d(&s[1], 4, 3, 2)?;
//! // The last two elements of row 2 of slice 1 (22, 23), to the start of b.
//! s[0].copy_3d_peer(a.as_pitched(), b.as_pitched_mut(), Copy3D::new(2, 1, 1).src_at(2, 2, 1))?;
//! assert_eq!(b.row(0)?.to_vec()?[..2], [22, 23]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use bytemuck::Pod;
use cumem_copy::{Copy3D, Pitched};
use cumem_core::{DeviceSlice, DeviceSliceMut, Error, Result, Stream};
use cumem_sys::sys;

use crate::copy::{PeerCopy, PeerPath, linked, order_after};
use crate::ffi;

/// 3D copies queued on a stream between two devices' pitched memory.
pub trait PeerStreamCopy3D {
    /// Queues a copy of the `extent` box of `src` into `dst` on this stream, which must belong to
    /// the source's or the destination's device (`WrongDevice` otherwise). Both sides need their
    /// rows per slice ([`Pitched::with_height`]); a box outside either side is `OutOfRange`.
    fn copy_3d_peer<T: Pod>(
        &self,
        src: Pitched<DeviceSlice<'_, T>>,
        dst: Pitched<DeviceSliceMut<'_, T>>,
        extent: Copy3D,
    ) -> Result<PeerCopy>;
}

impl PeerStreamCopy3D for Stream {
    fn copy_3d_peer<T: Pod>(
        &self,
        src: Pitched<DeviceSlice<'_, T>>,
        dst: Pitched<DeviceSliceMut<'_, T>>,
        extent: Copy3D,
    ) -> Result<PeerCopy> {
        queue_3d(self, src, dst, &extent)
    }
}

/// One side's shape in elements, and where the box starts in it.
struct Side {
    len: usize,
    pitch: usize,
    width: usize,
    height: Option<usize>,
    at: (usize, usize, usize),
}

fn end(start: usize, count: usize) -> Result<usize> {
    start.checked_add(count).ok_or(Error::OutOfRange { start, end: usize::MAX, len: usize::MAX })
}

fn bytes(count: usize, size: usize) -> Result<usize> {
    count.checked_mul(size).ok_or(Error::SizeOverflow { count, elem_size: size })
}

/// Checks that the box lies inside the side, as `cumem_copy::copy_3d` does.
fn check(s: &Side, b: &Copy3D) -> Result<()> {
    let (x, y, z) = s.at;
    if s.pitch == 0 {
        return Err(Error::ZeroSize { what: "pitch" });
    }
    let row_end = end(x, b.width)?;
    if row_end > s.width {
        return Err(Error::OutOfRange { start: x, end: row_end, len: s.width });
    }
    let height = match s.height {
        Some(h) if h > 0 => h,
        _ => return Err(Error::ZeroSize { what: "rows per slice" }),
    };
    let rows_end = end(y, b.height)?;
    if rows_end > height {
        return Err(Error::OutOfRange { start: y, end: rows_end, len: height });
    }
    // Row r holds the segment [x, x + width) while r * pitch + row_end <= len; slice k holds the
    // box's rows while its last one, k * height + rows_end - 1, does.
    let rows_in_memory = if s.len < row_end { 0 } else { (s.len - row_end) / s.pitch + 1 };
    let slices_in_memory = rows_in_memory.checked_sub(rows_end).map_or(0, |spare| spare / height + 1);
    let slices_end = end(z, b.depth)?;
    if slices_end > slices_in_memory {
        return Err(Error::OutOfRange { start: z, end: slices_end, len: slices_in_memory });
    }
    Ok(())
}

/// The side's shape (its length is filled in once the view is unwrapped).
fn side<M>(p: &Pitched<M>, at: (usize, usize, usize)) -> Side {
    let pitch = p.pitch();
    Side { len: 0, pitch, width: p.width().map_or(pitch, |w| w.min(pitch)), height: p.height(), at }
}

fn queue_3d<T: Pod>(
    stream: &Stream,
    src: Pitched<DeviceSlice<'_, T>>,
    dst: Pitched<DeviceSliceMut<'_, T>>,
    b: &Copy3D,
) -> Result<PeerCopy> {
    let mut s = side(&src, (b.src_x, b.src_y, b.src_z));
    let mut d = side(&dst, (b.dst_x, b.dst_y, b.dst_z));
    let (src, mut dst) = (src.into_inner(), dst.into_inner());
    (s.len, d.len) = (src.len(), dst.len());
    let (src_ctx, dst_ctx) = (src.context().clone(), dst.context().clone());
    let (a, c) = (src_ctx.device().ordinal(), dst_ctx.device().ordinal());
    let on = stream.context().device().ordinal();
    if on != a && on != c {
        return Err(Error::WrongDevice { expected: a as i32, actual: on as i32 });
    }
    let path = if linked(src_ctx.device(), dst_ctx.device())? { PeerPath::Direct } else { PeerPath::Staged };
    if b.width == 0 || b.height == 0 || b.depth == 0 {
        return Ok(PeerCopy::done(path, 0));
    }
    check(&s, b)?;
    check(&d, b)?;
    let size = size_of::<T>();
    let width_bytes = bytes(b.width, size)?;
    let moved = width_bytes.checked_mul(b.height).and_then(|n| n.checked_mul(b.depth));
    let moved = moved.ok_or(Error::SizeOverflow { count: b.width, elem_size: size })?;
    let (src_x, dst_x) = (bytes(b.src_x, size)?, bytes(b.dst_x, size)?);
    let (src_pitch, dst_pitch) = (bytes(s.pitch, size)?, bytes(d.pitch, size)?);
    tracing::debug!(target: "cumem_peer", src_device = a, dst_device = c, bytes = moved, ?path, "3D peer copy");
    let src_stream = if on == a { stream.clone() } else { Stream::legacy(&src_ctx) };
    let dst_stream = if on == c { stream.clone() } else { Stream::legacy(&dst_ctx) };
    let other = if on == a { &dst_stream } else { &src_stream };
    let from = src.on(&src_stream)?;
    let to = dst.on(&dst_stream)?;
    stream.wait_for(other)?;
    stream.context().bind()?;
    let dev = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let p = sys::CUDA_MEMCPY3D_PEER {
        srcXInBytes: src_x,
        srcY: b.src_y,
        srcZ: b.src_z,
        srcLOD: 0,
        srcMemoryType: dev,
        srcHost: std::ptr::null(),
        srcDevice: from.device_ptr(),
        srcArray: std::ptr::null_mut(),
        srcContext: src_ctx.raw(),
        srcPitch: src_pitch,
        srcHeight: s.height.unwrap_or(0),
        dstXInBytes: dst_x,
        dstY: b.dst_y,
        dstZ: b.dst_z,
        dstLOD: 0,
        dstMemoryType: dev,
        dstHost: std::ptr::null_mut(),
        dstDevice: to.device_ptr(),
        dstArray: std::ptr::null_mut(),
        dstContext: dst_ctx.raw(),
        dstPitch: dst_pitch,
        dstHeight: d.height.unwrap_or(0),
        WidthInBytes: width_bytes,
        Height: b.height,
        Depth: b.depth,
    };
    // SAFETY: both sides are the guards' device memory, ordered on `stream` (each guard's stream
    // is `stream` or was waited for above), and the box was checked to lie inside each (every row
    // of every slice, pitch and rows per slice as given); `dst` is exclusively borrowed, so they
    // do not overlap; `T: Pod`, so any bytes copied are valid values.
    unsafe { ffi::memcpy_3d_peer_async(&p, stream.raw())? };
    order_after(stream, other)?;
    Ok(PeerCopy::done(path, moved))
}
