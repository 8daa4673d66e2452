//! What pointer queries answer on mapped memory where it differs from other device memory
//! (reference §9): RANGE_START_ADDR/RANGE_SIZE name the reservation, MAPPING_BASE_ADDR/
//! MAPPING_SIZE the mapping, ALLOWED_HANDLE_TYPES the creation's requested handle types and
//! ACCESS_FLAGS the current device's access. `cuMemGetAddressRange` answers the mapping (as
//! observed), which needs nothing here.

use super::State;
use crate::memory::Allocation;
use crate::pointer::AttrValue;

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
        _ => None,
    }
}
