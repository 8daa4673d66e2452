//! Peer access and peer copies: thin shims over `crate::peer` and the copy engine.

use std::ffi::{c_int, c_uint};

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUresult, CUstream};

use crate::abi::Memcpy3D;
use crate::api::{self, Init};
use crate::copy::{Role, memcpy, memcpy_3d};
use crate::exports::copy::decode_3d;
use crate::peer;

/// `CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)`: the current
/// context may access `peerContext`'s memory (one direction). Codes as measured: see
/// `crate::peer`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxEnablePeerAccess(peer_context: CUcontext, flags: c_uint) -> CUresult {
    api::call("cuCtxEnablePeerAccess", Init::Required, || peer::enable(peer_context as u64, flags))
}

/// `CUresult cuCtxDisablePeerAccess(CUcontext peerContext)`: withdraws enabled access;
/// `PEER_ACCESS_NOT_ENABLED` when there is none.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDisablePeerAccess(peer_context: CUcontext) -> CUresult {
    api::call("cuCtxDisablePeerAccess", Init::Required, || peer::disable(peer_context as u64))
}

/// `CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice src,
/// CUdevice dst)`: NULL `value` → `INVALID_VALUE`, then the devices (`INVALID_DEVICE`, also for
/// `src == dst`), then the attribute (`INVALID_VALUE`).
///
/// # Safety
/// 1. `value` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetP2PAttribute(
    value: *mut c_int,
    attrib: u32,
    src: CUdevice,
    dst: CUdevice,
) -> CUresult {
    api::call("cuDeviceGetP2PAttribute", Init::Required, || {
        api::non_null(value, "value")?;
        let v = peer::attribute(attrib, src, dst)?;
        // SAFETY: forwarded caller contract (checked non-NULL).
        unsafe { api::out(value, v, "value") }
    })
}

/// `CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx,
/// size_t n)`: a device-to-device copy between two contexts' memory, on the current context's
/// legacy stream; it works whether or not peer access is enabled (observed).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyPeer(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    n: usize,
) -> CUresult {
    api::call("cuMemcpyPeer", Init::Required, || {
        peer::check_copy_contexts(dst_ctx as u64, Some(dst), src_ctx as u64, Some(src), true)?;
        // SAFETY: both endpoints must be CUDA memory (Role::Device): no host pointer is read.
        unsafe { memcpy(dst, Role::Device, src, Role::Device, n, None) }
    })
}

/// `CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext
/// srcCtx, size_t n, CUstream hStream)`: as `cuMemcpyPeer`, in `hStream`'s order.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyPeerAsync(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    n: usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemcpyPeerAsync", Init::Required, || {
        peer::check_copy_contexts(dst_ctx as u64, Some(dst), src_ctx as u64, Some(src), true)?;
        // SAFETY: both endpoints must be CUDA memory (Role::Device): no host pointer is read.
        unsafe { memcpy(dst, Role::Device, src, Role::Device, n, Some(h_stream)) }
    })
}

/// Decodes a `CUDA_MEMCPY3D_PEER`: the `CUDA_MEMCPY3D` layout with the two reserved pointers
/// replaced by the source and destination contexts, which are checked here.
///
/// # Safety
/// 1. `p` is NULL or valid for reading a `CUDA_MEMCPY3D_PEER`.
unsafe fn decode_3d_peer(
    p: *const cudarc::driver::sys::CUDA_MEMCPY3D_PEER,
) -> Result<crate::copy::Copy3D, api::Fail> {
    api::non_null(p, "pCopy")?;
    // SAFETY: non-NULL and valid (caller contract); the two layouts are the same size.
    let raw = unsafe { p.cast::<Memcpy3D>().read() };
    const DEVICE: u32 = cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    let device_side = |ty: u32, ptr: u64| (ty == DEVICE).then_some(ptr);
    peer::check_copy_contexts(
        raw.reserved1 as u64,
        device_side(raw.dst_type, raw.dst_device),
        raw.reserved0 as u64,
        device_side(raw.src_type, raw.src_device),
        false,
    )?;
    // SAFETY: as above; the layouts agree field for field.
    let mut c = unsafe { decode_3d(p.cast()) }?;
    c.reserved_set = false;
    Ok(c)
}

/// `CUresult cuMemcpy3DPeer(const CUDA_MEMCPY3D_PEER *pCopy)`: a 3D copy between two contexts'
/// memory, with `cuMemcpy3D`'s rules.
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3DPeer(p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D_PEER) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy3DPeer", Init::Required, || unsafe { memcpy_3d(decode_3d_peer(p_copy)?, None) })
}

/// `CUresult cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream)`: as
/// `cuMemcpy3DPeer`, in stream order.
///
/// # Safety
/// 1. `p_copy` is NULL or valid for reading; its host rows are valid for the copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3DPeerAsync(
    p_copy: *const cudarc::driver::sys::CUDA_MEMCPY3D_PEER,
    h_stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded caller contract.
    api::call("cuMemcpy3DPeerAsync", Init::Required, || unsafe {
        memcpy_3d(decode_3d_peer(p_copy)?, Some(h_stream))
    })
}

const _: () = assert!(size_of::<Memcpy3D>() == size_of::<cudarc::driver::sys::CUDA_MEMCPY3D_PEER>());
