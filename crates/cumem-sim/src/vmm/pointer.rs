//! What pointer queries answer on mapped memory where it differs from other device memory
//! (reference §9): RANGE_START_ADDR/RANGE_SIZE name the reservation, MAPPING_BASE_ADDR/
//! MAPPING_SIZE the mapping, ALLOWED_HANDLE_TYPES the creation's requested handle types and
//! ACCESS_FLAGS the current device's access. `cuMemGetAddressRange` answers the mapping (as
//! observed), but only once some device may access it: observed on an H100, 2026-11-23, it is
//! `NOT_FOUND` before `cuMemSetAccess` (while `cuPointerGetAttribute` already answers every
//! attribute, ACCESS_FLAGS 0).
//!
//! A reserved but unmapped address is known to pointer queries too: it reports the reservation
//! as RANGE_START_ADDR/RANGE_SIZE with MAPPED 0 (reference §5/§9, [E:DALI#3064], which reads
//! exactly those three through `cuPointerGetAttributes`). The reference is silent on every other
//! attribute there; the answers in [`unmapped_attribute`] are the simulator's guesses [I].

use super::State;
use crate::api::Fail;
use crate::memory::Allocation;
use crate::pointer::AttrValue;

/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
const ATTR_RDMA_WITH_VMM: u32 = 110;

/// The answer for `attribute` at `ptr` in mapping `a`, where it is VMM-specific.
pub(crate) fn attribute(
    st: &State,
    a: &Allocation,
    attribute: u32,
    device: Option<usize>,
) -> Option<AttrValue> {
    let m = st.vmm.mappings.get(&a.base)?;
    match attribute {
        11 => Some(AttrValue::U64(m.reservation)),
        12 => Some(AttrValue::U64(st.vmm.reservations.get(&m.reservation)?.size)),
        14 => Some(AttrValue::U32(st.vmm.physical.get(&m.handle)?.prop.handle_types)),
        16 => Some(AttrValue::U32(device.and_then(|d| m.access.get(&d)).copied().unwrap_or(0) as u32)),
        // IS_GPU_DIRECT_RDMA_CAPABLE: created with `allocFlags.gpuDirectRDMACapable` on a device
        // reporting GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED.
        15 => {
            let p = st.vmm.physical.get(&m.handle)?;
            let capable = st.devices[p.device].attr(ATTR_RDMA_WITH_VMM).unwrap_or(0) != 0;
            Some(AttrValue::U32(u32::from(capable && p.prop.gpu_direct_rdma_capable != 0)))
        }
        _ => None,
    }
}

/// Whether `cuMemGetAddressRange` finds allocation `a`: anything but a mapping that grants no
/// device any access (observed on an H100, 2026-11-23: `NOT_FOUND` before `cuMemSetAccess`,
/// the mapping after it). A mapping that only another device may access was not measured; it
/// counts as found.
pub(crate) fn address_range_found(st: &State, a: &Allocation) -> bool {
    st.vmm.mappings.get(&a.base).is_none_or(|m| m.access.values().any(|&f| f != 0))
}

/// The answer for `attribute` at `ptr` when `ptr` lies in a reservation but in no mapping;
/// `None` when no reservation holds `ptr`. `batch`: the `cuPointerGetAttributes` form.
pub(crate) fn unmapped_attribute(
    st: &State,
    ptr: u64,
    attribute: u32,
    batch: bool,
) -> Option<Result<AttrValue, Fail>> {
    let (&base, r) = st.vmm.reservations.range(..=ptr).next_back()?;
    if ptr - base >= r.size {
        return None;
    }
    use AttrValue::{U32, U64};
    Some(Ok(match attribute {
        // Stated by the reference (§5, §9).
        11 => U64(base),
        12 => U64(r.size),
        13 => U32(0),
        // The rest are unrecorded [I]: the address is device address space of the device the
        // reservation was carved from, with no allocation behind it, so MEMORY_TYPE DEVICE and that
        // device's ordinal, the address itself as DEVICE_POINTER, no host view (as for mapped VMM
        // memory), and the null value (no context, buffer, pool, mapping, access or capability)
        // for everything else.
        2 => U32(2),
        3 => U64(ptr),
        4 if batch => U64(0),
        4 => return Some(Err(Fail::quiet(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE))),
        5 => return Some(crate::pointer::pointer_attribute_p2p()),
        9 => U32(r.device as u32),
        1 | 7 | 17 | 18 | 19 | 20 => U64(0),
        _ => U32(0),
    }))
}
