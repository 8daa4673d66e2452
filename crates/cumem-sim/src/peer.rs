//! Peer access between contexts of different devices: `cuCtxEnablePeerAccess`,
//! `cuCtxDisablePeerAccess`, `cuDeviceGetP2PAttribute`, and the context checks of the peer
//! copies.
//!
//! Which device may reach which is the configured matrix (`peer=` in `CUMEM_SIM`, answered by
//! `cuDeviceCanAccessPeer`). Enabled access is recorded per (current context, peer context) and is
//! lost when either context is destroyed or reset. The codes are the measured ones (§17 and §11
//! of the driver reference): a NULL peer context gives `INVALID_CONTEXT`, flags ≠ 0
//! `INVALID_VALUE`, the context itself or another context of the same device
//! `PEER_ACCESS_UNSUPPORTED`, a pair the matrix refuses `PEER_ACCESS_UNSUPPORTED`, enabling twice
//! `PEER_ACCESS_ALREADY_ENABLED`, disabling what is not enabled `PEER_ACCESS_NOT_ENABLED`.
//! Copies never consult the record: a real driver copies between devices' memory with
//! `cuMemcpy` (unified addressing) and `cuMemcpyPeer` whether or not peer access is enabled.

use cudarc::driver::sys::CUresult;

use crate::api::{self, Fail};
use crate::context;
use crate::memory::AllocKind;
use crate::state::SIM;
use crate::violation::{self, Violation};

/// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`.
const ATTR_PERFORMANCE_RANK: u32 = 1;
/// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
const ATTR_ACCESS_SUPPORTED: u32 = 2;
/// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
const ATTR_NATIVE_ATOMIC_SUPPORTED: u32 = 3;
/// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED`.
const ATTR_CUDA_ARRAY_ACCESS_SUPPORTED: u32 = 4;

/// The device of `peer` for an enable or disable, or the measured error for a NULL or dead one.
fn peer_device(st: &crate::state::State, peer: u64) -> Result<usize, Fail> {
    if peer == 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "NULL peer context"));
    }
    context::live(st, peer, "peer context")
}

/// `cuCtxEnablePeerAccess(peer, flags)`: lets the current context reach `peer`'s memory.
pub(crate) fn enable(peer: u64, flags: u32) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    if peer == 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "NULL peer context"));
    }
    if flags != 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("cuCtxEnablePeerAccess flags must be 0 (got {flags:#x})"),
        ));
    }
    let (ctx, dev) = context::current_ctx(&st)?;
    let peer_dev = peer_device(&st, peer)?;
    if peer_dev == dev {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            format!("peer context {peer:#x} is on the current context's own device {dev}"),
        ));
    }
    if !st.peer[dev][peer_dev] {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            format!("device {dev} cannot access device {peer_dev} (no peer link in the configured matrix)"),
        ));
    }
    if !st.peer_access.insert((ctx, peer)) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            format!("access from device {dev} to device {peer_dev}'s context is already enabled"),
        ));
    }
    Ok(())
}

/// `cuCtxDisablePeerAccess(peer)`: withdraws what [`enable`] granted.
pub(crate) fn disable(peer: u64) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    if peer == 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, "NULL peer context"));
    }
    let (ctx, dev) = context::current_ctx(&st)?;
    peer_device(&st, peer)?;
    if !st.peer_access.remove(&(ctx, peer)) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
            format!("access from device {dev}'s current context to context {peer:#x} is not enabled"),
        ));
    }
    Ok(())
}

/// `cuDeviceGetP2PAttribute` for devices `src` and `dst` (the NULL check on the output is the
/// caller's, made first). Devices are checked before the attribute (measured); every attribute
/// follows the matrix, and a linked pair ranks 0 (the best: one kind of link is simulated).
pub(crate) fn attribute(attrib: u32, src: i32, dst: i32) -> Result<i32, Fail> {
    let st = SIM.st.lock();
    let a = st.ordinal(src)?;
    let b = st.ordinal(dst)?;
    if a == b {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            format!("cuDeviceGetP2PAttribute of device {a} with itself"),
        ));
    }
    let linked = st.peer[a][b];
    match attrib {
        ATTR_PERFORMANCE_RANK => Ok(0),
        ATTR_ACCESS_SUPPORTED | ATTR_NATIVE_ATOMIC_SUPPORTED | ATTR_CUDA_ARRAY_ACCESS_SUPPORTED => {
            Ok(i32::from(linked))
        }
        other => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("unknown CUdevice_P2PAttribute {other}"),
        )),
    }
}

/// Checks the two contexts a peer copy names (`INVALID_CONTEXT` for an unknown one,
/// `CONTEXT_IS_DESTROYED` for a dead one; NULL where `null_ok`, else `INVALID_CONTEXT`), each with the device memory it is named for (`None`
/// when that side is not device memory).
///
/// A live context of another device than its memory's is accepted, as a real driver does: it
/// finds both ends by address (unified addressing; a NULL context is accepted on real hardware
/// for that reason, §6.2 of the driver reference), so the context arguments do not steer the
/// copy. The mismatch is still a caller bug (the API names `dstContext` as `dstDevice`'s), so it
/// is logged as a violation, with the call's `CUDA_SUCCESS`, for tests to catch.
///
/// NULL contexts were observed accepted by `cuMemcpyPeer`/`Async` (`null_ok`); for
/// `cuMemcpy3DPeer`/`Async` nothing was observed, and refusing them is a simulator choice.
pub(crate) fn check_copy_contexts(
    dst_ctx: u64,
    dst: Option<u64>,
    src_ctx: u64,
    src: Option<u64>,
    null_ok: bool,
) -> Result<(), Fail> {
    let st = SIM.st.lock();
    let mut mismatches = Vec::new();
    for (h, ptr, what) in [(dst_ctx, dst, "destination"), (src_ctx, src, "source")] {
        if h == 0 && null_ok {
            // Observed: the driver then finds the memory by its address alone.
            continue;
        }
        if h == 0 {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_CONTEXT, format!("NULL {what} context")));
        }
        let device = context::live(&st, h, &format!("{what} context"))?;
        // VMM ranges belong to no context (their device is the mapping's), so only memory
        // allocated in a context is compared.
        let owner =
            ptr.and_then(|p| st.find_alloc(p)).filter(|a| a.kind.device_only() && a.kind != AllocKind::Vmm);
        if let Some(a) = owner.filter(|a| usize::try_from(a.device).ok() != Some(device)) {
            mismatches.push(format!(
                "the {what} context {h:#x} is device {device}'s, but the {what} memory {:#x} is device {}'s \
                 (accepted, as the driver locates memory by address)",
                a.base, a.device
            ));
        }
    }
    drop(st);
    let (function, os_tid) = api::caller();
    for message in mismatches {
        violation::record(Violation {
            function: function.to_string(),
            code: CUresult::CUDA_SUCCESS as u32,
            code_name: "CUDA_SUCCESS".to_string(),
            message,
            os_tid,
        });
    }
    Ok(())
}
