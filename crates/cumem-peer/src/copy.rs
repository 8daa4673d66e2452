//! Typed copies between two devices' memory, blocking ([`copy_peer`]) or queued on a stream
//! ([`PeerStreamCopy::copy_peer`]), each taking the best path the topology allows.
//!
//! Two devices with a peer link (either direction) copy directly (`cuMemcpyPeer`/`Async`); two
//! without one copy through page-locked host memory: device → pinned on the source device's
//! stream, pinned → device on the destination's. The choice is automatic and reported: the
//! returned [`PeerCopy`] says which [`PeerPath`] was taken, and a `debug` event of target
//! `cumem_peer` names it with the devices and the byte count.
//!
//! Ordering is the same as for same-device copies: the copy waits for all work queued so far on
//! both buffers, on whatever streams, and later users of either buffer wait for it. A queued copy
//! runs on `stream`, a stream of the source's or the destination's device; the other device's
//! side is ordered through that device's legacy stream (waiting on events, both directions), so
//! synchronising `stream` completes the copy.
//!
//! A queued copy between devices without a link returns a [`PeerCopy`] holding its page-locked
//! staging buffer. Dropping it synchronises the two streams the staging copies ran on (`stream`
//! and the other device's legacy stream), everything queued on them so far included, and then
//! frees the staging memory with `cuMemFreeHost`, which waits while a host function holds *any*
//! stream (§17 of the driver brief): drop it before queuing work that waits on the host, or keep it
//! until that work has ended.
//!
//! ```
//! # cumem_sys::testing::init_with("devices=3,peer=0-1");
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_peer::{PeerPath, PeerStreamCopy, copy_peer};
//! let s: Vec<Stream> = (0..3).map(|d| Stream::new(&Device::get(d)?.context()?)).collect::<Result<_, _>>()?;
//! let src = DeviceBuffer::from_slice(&s[0], &[7u32; 1000])?;
//! let mut near = DeviceBuffer::<u32>::zeroed(&s[1], 1000)?;
//! let mut far = DeviceBuffer::<u32>::zeroed(&s[2], 1000)?;
//! assert_eq!(copy_peer(&src, &mut near)?.path(), PeerPath::Direct);
//! let queued = s[0].copy_peer(&src, &mut far)?; // devices 0 and 2 have no link
//! assert_eq!(queued.path(), PeerPath::Staged);
//! assert_eq!(far.to_vec()?, vec![7; 1000]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::any::Any;
use std::fmt;

use bytemuck::Pod;
use cumem_copy::StreamCopy;
use cumem_core::{AsDeviceSlice, AsDeviceSliceMut, Error, PinnedBuffer, PinnedFlags, Result, Stream};

use crate::ffi;

/// How a peer copy moved its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerPath {
    /// Device to device (`cuMemcpyPeer`): the devices have a peer link, or are the same device.
    Direct,
    /// Through page-locked host memory: the devices cannot access each other.
    Staged,
}

/// What a peer copy did. A queued staged copy owns its pinned staging memory, which must outlive
/// the copies through it: dropping the `PeerCopy` synchronises both streams those copies ran on
/// (the stream the copy was queued on and the other device's legacy stream), so it waits for
/// everything queued on either of them so far, not only for the copy (on the legacy stream, that
/// includes the device's earlier blocking-stream work). It then frees the staging memory with
/// `cuMemFreeHost`, which waits while a host function holds any stream of any device (§17 of the
/// driver brief). Drop it before queuing work that waits on the host (a kernel polling a host
/// flag, a host function waiting for this thread), on whatever stream, or keep it until that work
/// has ended: dropped in between, it waits for that work, which waits for the host, and neither
/// ends.
#[must_use = "says which path the copy took; dropping a queued staged copy waits for its streams"]
pub struct PeerCopy {
    path: PeerPath,
    bytes: usize,
    /// The pinned buffer of a queued staged copy, whose drop synchronises the copies' two streams.
    staging: Option<Box<dyn Any + Send + Sync>>,
}

impl PeerCopy {
    /// The path the copy took.
    pub fn path(&self) -> PeerPath {
        self.path
    }

    /// Whether the copy went through host memory.
    pub fn staged(&self) -> bool {
        self.path == PeerPath::Staged
    }

    /// Bytes copied.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl PeerCopy {
    /// A copy that holds nothing.
    pub(crate) fn done(path: PeerPath, bytes: usize) -> Self {
        PeerCopy { path, bytes, staging: None }
    }
}

impl fmt::Debug for PeerCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerCopy")
            .field("path", &self.path)
            .field("bytes", &self.bytes)
            .field("holds_staging", &self.staging.is_some())
            .finish()
    }
}

/// Copies queued on a stream between two devices' memory.
pub trait PeerStreamCopy {
    /// Queues a copy of `src` into `dst` (same length, any two devices) on this stream, which
    /// must belong to the source's or the destination's device (`WrongDevice` otherwise).
    fn copy_peer<T: Pod + Send + Sync>(
        &self,
        src: &impl AsDeviceSlice<T>,
        dst: &mut impl AsDeviceSliceMut<T>,
    ) -> Result<PeerCopy>;
}

impl PeerStreamCopy for Stream {
    fn copy_peer<T: Pod + Send + Sync>(
        &self,
        src: &impl AsDeviceSlice<T>,
        dst: &mut impl AsDeviceSliceMut<T>,
    ) -> Result<PeerCopy> {
        queue(self, src, dst, false)
    }
}

/// Copies `src` into `dst` (same length, any two devices) and returns once the bytes have
/// arrived, after all work queued so far on either buffer.
///
/// Between two devices that cannot reach each other's memory the copy is staged through
/// page-locked host memory, which this call frees before it returns: `cuMemFreeHost` waits while
/// a host function holds *any* stream, on any device (§17 of the driver brief; the simulator
/// does the same), so a staged copy also waits for such unrelated work, and must not be made
/// while work that waits on the calling thread runs (a host function waiting for it, a persistent
/// kernel polling a flag it would set). Devices with peer access copy directly and free nothing.
pub fn copy_peer<T: Pod + Send + Sync>(
    src: &impl AsDeviceSlice<T>,
    dst: &mut impl AsDeviceSliceMut<T>,
) -> Result<PeerCopy> {
    let legacy = Stream::legacy(src.as_device_slice().context());
    let done = queue(&legacy, src, dst, true)?;
    Ok(PeerCopy { staging: None, ..done })
}

/// Orders `other`, the side of a copy just queued on `stream` that recorded `other` as its
/// buffer's last user, after that copy. If it cannot be ordered so, the guards still name `other`:
/// the copy is waited for here, or freeing that buffer would wait only for `other` while the copy
/// still runs.
pub(crate) fn order_after(stream: &Stream, other: &Stream) -> Result<()> {
    let Err(e) = other.wait_for(stream) else { return Ok(()) };
    if let Err(sync) = stream.synchronize() {
        tracing::warn!(
            target: "cumem_peer",
            error = %sync,
            "waiting for a peer copy after its ordering failed also failed"
        );
    }
    Err(e)
}

/// Whether a copy between devices `a` and `b` goes over a peer link.
pub(crate) fn linked(a: cumem_core::Device, b: cumem_core::Device) -> Result<bool> {
    if a == b {
        return Ok(true);
    }
    Ok(a.can_access_peer(b)? || b.can_access_peer(a)?)
}

/// The copy on `stream`; `blocking` returns only once it is complete.
fn queue<T: Pod + Send + Sync>(
    stream: &Stream,
    src: &impl AsDeviceSlice<T>,
    dst: &mut impl AsDeviceSliceMut<T>,
    blocking: bool,
) -> Result<PeerCopy> {
    let (src, mut dst) = (src.as_device_slice(), dst.as_device_slice_mut());
    if src.len() != dst.len() {
        return Err(Error::LengthMismatch { expected: dst.len(), actual: src.len() });
    }
    let (src_ctx, dst_ctx) = (src.context().clone(), dst.context().clone());
    let (a, b) = (src_ctx.device().ordinal(), dst_ctx.device().ordinal());
    let on = stream.context().device().ordinal();
    if on != a && on != b {
        return Err(Error::WrongDevice { expected: a as i32, actual: on as i32 });
    }
    let path = if linked(src_ctx.device(), dst_ctx.device())? { PeerPath::Direct } else { PeerPath::Staged };
    let bytes = src.bytes();
    tracing::debug!(target: "cumem_peer", src_device = a, dst_device = b, bytes, ?path, blocking, "peer copy");
    if bytes == 0 {
        return Ok(PeerCopy { path, bytes, staging: None });
    }
    // One stream per side: `stream` on its own device, the legacy stream on the other.
    let src_stream = if on == a { stream.clone() } else { Stream::legacy(&src_ctx) };
    let dst_stream = if on == b { stream.clone() } else { Stream::legacy(&dst_ctx) };
    let other = if on == a { &dst_stream } else { &src_stream };
    let mut staging = None;
    match path {
        PeerPath::Direct => {
            let from = src.on(&src_stream)?;
            let to = dst.on(&dst_stream)?;
            stream.wait_for(other)?;
            stream.context().bind()?;
            let (to_ptr, from_ptr) = (to.device_ptr(), from.device_ptr());
            if blocking {
                // SAFETY: both ranges are the guards' device memory of `bytes` bytes, ordered on
                // `stream` (the legacy stream of the current context, which cuMemcpyPeer uses);
                // `dst` is exclusively borrowed, so they do not overlap.
                unsafe { ffi::memcpy_peer(to_ptr, dst_ctx.raw(), from_ptr, src_ctx.raw(), bytes)? };
            } else {
                // SAFETY: as above, on `stream`.
                unsafe {
                    ffi::memcpy_peer_async(
                        to_ptr,
                        dst_ctx.raw(),
                        from_ptr,
                        src_ctx.raw(),
                        bytes,
                        stream.raw(),
                    )?
                };
            }
            order_after(stream, other)?;
        }
        PeerPath::Staged => {
            let portable = PinnedFlags { portable: true, ..PinnedFlags::default() };
            let mut pinned = PinnedBuffer::<T>::zeroed_with_flags(&src_ctx, src.len(), portable)?;
            src_stream.copy_d2h(&src, &mut pinned)?;
            dst_stream.copy_h2d(&pinned, &mut dst)?;
            stream.wait_for(other)?;
            staging = Some(Box::new(pinned) as Box<dyn Any + Send + Sync>);
        }
    }
    if blocking {
        stream.synchronize()?;
    }
    Ok(PeerCopy { path, bytes, staging })
}
