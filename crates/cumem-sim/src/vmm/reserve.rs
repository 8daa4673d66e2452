//! Reservations: `cuMemAddressReserve` and `cuMemAddressFree`.
//!
//! A reservation is carved from the VMM address space of the calling thread's current device
//! (device 0 without a current context: reserving needs no context; that device's VMM support
//! then decides, stricter than the driver, as the README's "What is not modelled" says), aligned to
//! the granularity at least, with a granule left free after it so an unrelated reservation does
//! not start where this one ends; a caller that asks for exactly that end (`addr`, to grow a
//! range in place) gets it when it is free, as on the GPU, and any other address otherwise.

use cudarc::driver::sys::CUresult;

use super::{GRANULARITY, Reservation, invalid, require_vmm};
use crate::api::Fail;
use crate::state::SIM;

/// `cuMemAddressReserve`: `size` bytes of address space; returns the base.
pub(crate) fn address_reserve(size: usize, alignment: usize, addr: u64, flags: u64) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let d = crate::context::current().and_then(|c| st.ctx_device(c)).unwrap_or(0);
    if st.devices.is_empty() {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NO_DEVICE));
    }
    require_vmm(&st, d)?;
    let size = size as u64;
    if flags != 0 {
        return Err(invalid(format!("cuMemAddressReserve flags {flags:#x} must be 0")));
    }
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(invalid(format!(
            "size {size} is not a non-zero multiple of the granularity {GRANULARITY}"
        )));
    }
    if alignment != 0 && !alignment.is_power_of_two() {
        return Err(invalid(format!("alignment {alignment} is neither 0 nor a power of two")));
    }
    let align = (alignment as u64).max(GRANULARITY);
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let va = &mut st.vmm.space(d).ok_or_else(oom)?.va;
    // The hint is honoured only where it is aligned and free; otherwise it is ignored.
    let base = if addr != 0 && addr.is_multiple_of(align) && va.claim(addr, size) {
        addr
    } else {
        va.allocate_spaced(size, align, GRANULARITY).ok_or_else(oom)?
    };
    st.vmm.reservations.insert(base, Reservation { size, device: d });
    Ok(base)
}

/// `cuMemAddressFree`: `ptr` and `size` must be exactly a live reservation with nothing mapped.
pub(crate) fn address_free(ptr: u64, size: usize) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let size = size as u64;
    let Some(r) = st.vmm.reservations.get(&ptr) else {
        return Err(invalid(format!(
            "{ptr:#x} is not the base of a live reservation (freed or never reserved)"
        )));
    };
    if r.size != size {
        return Err(invalid(format!(
            "size {size} does not match the reservation at {ptr:#x} ({} bytes)",
            r.size
        )));
    }
    // Undocumented; refused so the mappings are not left pointing into freed address space.
    if let Some((&m, _)) = st.vmm.mappings.range(ptr..ptr + size).next() {
        return Err(invalid(format!(
            "the reservation at {ptr:#x} still has a mapping at {m:#x} (cuMemUnmap first)"
        )));
    }
    let r = st.vmm.reservations.remove(&ptr).expect("just found");
    st.vmm.spaces.get_mut(&r.device).expect("a reservation's space").va.release(ptr);
    Ok(())
}
