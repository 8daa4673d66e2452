//! Every driver call cumem-peer makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! Callers bind the right context and uphold each function's `# Safety` list; the typed modules
//! are the only callers.

use std::ffi::c_int;

use cumem_sys::sys::{self, CUcontext, CUdevice, CUdevice_P2PAttribute, CUdeviceptr, CUstream};
use cumem_sys::{ErrorContext as Ctx, Result, api, check};

/// `cuDeviceGetP2PAttribute` for two different devices.
pub(crate) fn p2p_attribute(attr: CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) -> Result<i32> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out-pointer; the driver checks the ordinals.
    let code = unsafe { api::cuDeviceGetP2PAttribute(&mut value, attr, src, dst) };
    check(code, Ctx::op("cuDeviceGetP2PAttribute"))?;
    Ok(value)
}

/// `cuCtxEnablePeerAccess(peer, 0)` from the current context.
pub(crate) fn enable_peer_access(peer: CUcontext) -> Result<()> {
    // SAFETY: plain FFI call; the driver checks the handle.
    check(unsafe { api::cuCtxEnablePeerAccess(peer, 0) }, Ctx::op("cuCtxEnablePeerAccess"))
}

/// `cuCtxDisablePeerAccess(peer)` from the current context.
pub(crate) fn disable_peer_access(peer: CUcontext) -> Result<()> {
    // SAFETY: plain FFI call; the driver checks the handle.
    check(unsafe { api::cuCtxDisablePeerAccess(peer) }, Ctx::op("cuCtxDisablePeerAccess"))
}

/// `cuMemcpyPeerAsync`.
///
/// # Safety
/// 1. `[dst, dst + bytes)` is device memory of `dst_ctx` and `[src, src + bytes)` of `src_ctx`,
///    both usable by work on `stream` (ordered on it) until the copy completes, not overlapping.
pub(crate) unsafe fn memcpy_peer_async(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream) };
    check(code, Ctx::op("cuMemcpyPeerAsync").bytes(bytes))
}

/// `cuMemcpyPeer`: on the current context's legacy stream.
///
/// # Safety
/// 1. As [`memcpy_peer_async`], with the current context's legacy stream as the stream.
pub(crate) unsafe fn memcpy_peer(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    bytes: usize,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { api::cuMemcpyPeer(dst, dst_ctx, src, src_ctx, bytes) };
    check(code, Ctx::op("cuMemcpyPeer").bytes(bytes))
}

/// `cuMemcpy3DPeerAsync`.
///
/// # Safety
/// 1. `p` describes two device-memory sides (`CU_MEMORYTYPE_DEVICE`) of the contexts it names,
///    every row of every slice named lying inside memory usable by work on `stream` (ordered on
///    it) until the copy completes, the two not overlapping.
pub(crate) unsafe fn memcpy_3d_peer_async(p: &sys::CUDA_MEMCPY3D_PEER, stream: CUstream) -> Result<()> {
    let bytes = p.WidthInBytes.saturating_mul(p.Height).saturating_mul(p.Depth);
    // SAFETY: guaranteed by the caller; `p` is a valid parameter block.
    let code = unsafe { api::cuMemcpy3DPeerAsync(p, stream) };
    check(code, Ctx::op("cuMemcpy3DPeerAsync").bytes(bytes))
}
