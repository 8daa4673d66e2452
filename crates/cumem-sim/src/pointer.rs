//! Pointer queries: what the driver answers about an address (`cuPointerGetAttribute(s)`,
//! `cuMemHostGetFlags`, `cuMemHostGetDevicePointer`). Unknown addresses get the driver's
//! defaults in the batch form and `INVALID_VALUE` (a probe, not recorded) in the single form.

use cudarc::driver::sys::CUresult;

use crate::alloc::HOST_DEVICEMAP;
use crate::api::Fail;
use crate::context;
use crate::memory::{AllocKind, Allocation};
use crate::state::{SIM, State};

/// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`.
const ATTR_CAN_MAP_HOST_MEMORY: u32 = 19;

/// `cuMemGetAddressRange`: `(base, size)` of the allocation containing `ptr`, `NOT_FOUND` (a
/// probe answer) for any other address.
pub(crate) fn address_range(ptr: u64) -> Result<(u64, u64), Fail> {
    let st = SIM.st.lock();
    context::require(&st)?;
    let a = st.find_alloc(ptr).ok_or(Fail::quiet(CUresult::CUDA_ERROR_NOT_FOUND))?;
    if !crate::vmm::address_range_found(&st, a) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_FOUND));
    }
    Ok((a.base, a.bytes))
}

/// The `cuMemHostGetFlags` answer for the memory containing `p` (pinned, registered or managed),
/// or `INVALID_VALUE` (a probe answer, not recorded).
pub(crate) fn host_flags(p: u64) -> Result<u32, Fail> {
    let st = SIM.st.lock();
    context::require(&st)?;
    match st.find_alloc(p) {
        Some(a) if a.kind == AllocKind::PinnedHost => Ok(a.host_flags),
        // IOMEMORY and READ_ONLY are not reported; DEVICEMAP always is (UVA).
        Some(a) if a.kind == AllocKind::Registered => Ok((a.host_flags & 0x3) | HOST_DEVICEMAP),
        Some(a) if a.kind == AllocKind::Managed => Ok(HOST_DEVICEMAP),
        _ => Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE)),
    }
}

/// `cuMemHostGetDevicePointer`: checks that `p` is pinned or registered memory the current
/// device may map (the device address is then `p` itself, UVA).
pub(crate) fn host_device_pointer(p: u64, flags: u32) -> Result<(), Fail> {
    let st = SIM.st.lock();
    let d = context::require(&st)?;
    if flags != 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("Flags {flags:#x} must be 0")));
    }
    if st.devices[d].attr(ATTR_CAN_MAP_HOST_MEMORY) == Some(0) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if st.find_alloc(p).is_none_or(|a| !a.kind.pinned()) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{:#x} is neither pinned nor registered host memory", p),
        ));
    }
    Ok(())
}

/// One pointer attribute value, with the driver's size.
pub(crate) enum AttrValue {
    U32(u32),
    U64(u64),
    /// The batch form leaves the caller's buffer untouched.
    Untouched,
}

/// Whether `attribute` is a number the bindings define (P2P_TOKENS included).
pub(crate) fn known_pointer_attribute(attribute: u32) -> bool {
    (1..=21).contains(&attribute)
}

/// The value of `attribute` for `ptr`; `a` is the allocation containing it. Single form
/// (`batch == false`): HOST_POINTER of device-only memory is `INVALID_VALUE`; batch form: NULL.
pub(crate) fn pointer_attribute(
    st: &State,
    a: &Allocation,
    attribute: u32,
    ptr: u64,
    batch: bool,
) -> Result<AttrValue, Fail> {
    use AttrValue::{U32, U64};
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    const ATTR_GPU_DIRECT_RDMA_SUPPORTED: u32 = 116;
    if a.kind == AllocKind::Vmm {
        let device = context::current().and_then(|c| st.ctx_device(c));
        if let Some(v) = crate::vmm::pointer_attribute(st, a, attribute, device) {
            return Ok(v);
        }
    }
    let device_only = a.kind.device_only();
    let offset = ptr - a.base;
    Ok(match attribute {
        1 => U64(a.ctx),
        2 => U32(if device_only || a.kind == AllocKind::Managed { 2 } else { 1 }),
        3 => U64(ptr),
        4 if device_only && batch => U64(0),
        4 if device_only => return Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE)),
        4 => U64(a.base + offset),
        5 => {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                "CU_POINTER_ATTRIBUTE_P2P_TOKENS is not supported",
            ));
        }
        8 => U32(u32::from(a.kind == AllocKind::Managed)),
        6 => U32(u32::from(crate::sync_memops::is_set(a.buffer_id))),
        // ALLOWED_HANDLE_TYPES: POSIX_FD for a block of a pool created with it.
        14 => U32(u32::from(
            a.kind == AllocKind::Pool
                && st.pools.get(&a.pool).and_then(|p| p.shared.as_ref()).is_some_and(|s| !s.imported),
        )),
        21 => U32(0),
        7 | 20 => U64(a.buffer_id),
        9 => U32(a.device as u32),
        10 => U32(u32::from(matches!(a.kind, AllocKind::Device | AllocKind::Pitched))),
        // Device memory is RDMA-capable exactly where the device reports GPU_DIRECT_RDMA_SUPPORTED
        // (VMM mappings answer from their creation flags, in `vmm::pointer_attribute`).
        15 => U32(u32::from(
            device_only
                && st.devices[a.device as usize].attr(ATTR_GPU_DIRECT_RDMA_SUPPORTED).unwrap_or(0) != 0,
        )),
        // MAPPING_BASE_ADDR / MAPPING_SIZE of a pool block or an imported one: the 32 MiB piece
        // holding the address, while RANGE_* stay the block (observed on an H100, 2026-11-23).
        18 | 19 if matches!(a.kind, AllocKind::Pool | AllocKind::PoolImport) => {
            let (base, size) = crate::pool::mapping(st, a, ptr);
            U64(if attribute == 19 { base } else { size })
        }
        11 | 19 => U64(a.base),
        12 | 18 => U64(a.bytes),
        13 => U32(1),
        16 => U32(match (a.kind, st.pools.get(&a.pool)) {
            (AllocKind::Pool, Some(p)) => context::current()
                .and_then(|c| st.ctx_device(c))
                .map_or(crate::pool::PROT_READWRITE, |d| p.access_of(d)),
            _ => 3,
        }),
        _ => U64(a.pool), // 17: MEMPOOL_HANDLE, NULL outside pools.
    })
}

/// The batch form's answer for memory CUDA does not know.
pub(crate) fn unknown_pointer_attribute(attribute: u32, ptr: u64) -> AttrValue {
    match attribute {
        3 | 4 => AttrValue::U64(ptr),
        9 => AttrValue::U32(u32::MAX), // -1
        11 | 12 => AttrValue::Untouched,
        1 | 7 | 17 | 18 | 19 | 20 => AttrValue::U64(0),
        _ => AttrValue::U32(0),
    }
}

pub(crate) fn pointer_attribute_p2p() -> Result<AttrValue, Fail> {
    Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "CU_POINTER_ATTRIBUTE_P2P_TOKENS is not supported"))
}

/// `cuPointerGetAttributes`: every value, or the first error (nothing is written before all are
/// known).
pub(crate) fn attributes(attrs: &[u32], ptr: u64) -> Result<Vec<AttrValue>, Fail> {
    let st = SIM.st.lock();
    let a = st.find_alloc(ptr);
    let mut values = Vec::with_capacity(attrs.len());
    for (i, &attr) in attrs.iter().enumerate() {
        if !known_pointer_attribute(attr) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("unknown pointer attribute {attr} at index {i}"),
            ));
        }
        values.push(match a {
            Some(a) => pointer_attribute(&st, a, attr, ptr, true)?,
            None if attr == 5 => pointer_attribute_p2p()?,
            None => match crate::vmm::unmapped_attribute(&st, ptr, attr, true) {
                Some(v) => v?,
                None => unknown_pointer_attribute(attr, ptr),
            },
        });
    }
    Ok(values)
}

/// `cuPointerGetAttribute`: one value; unknown pointers give `INVALID_VALUE` (quietly: a probe;
/// reserved but unmapped VMM addresses are known, see `vmm::unmapped_attribute`),
/// DEVICE_POINTER needs a current context.
pub(crate) fn attribute(attribute: u32, ptr: u64) -> Result<AttrValue, Fail> {
    let st = SIM.st.lock();
    if attribute == 3 {
        context::require(&st)?;
    }
    match st.find_alloc(ptr) {
        Some(a) => pointer_attribute(&st, a, attribute, ptr, false),
        None => crate::vmm::unmapped_attribute(&st, ptr, attribute, false)
            .unwrap_or(Err(Fail::quiet(CUresult::CUDA_ERROR_INVALID_VALUE))),
    }
}
