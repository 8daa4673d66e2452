//! Access: `cuMemSetAccess`, `cuMemGetAccess`, and the check copies and memsets make on mapped
//! memory.
//!
//! A new mapping gives no device access. Observed on an H100: a memset on a mapping before
//! `cuMemSetAccess` fails at the call with `INVALID_VALUE` (the context stays healthy), as does a
//! memset that runs off the end of a mapping into unmapped space; one across the boundary of two
//! adjacent mappings succeeds. `cuMemSetAccess` over part of a mapping is `INVALID_VALUE`.

use super::mapping::tiling;
use super::{PROT_READ, PROT_READWRITE, State, invalid};
use crate::abi::{AccessDesc, LOC_DEVICE, MemLocation};
use crate::api::Fail;
use crate::state::SIM;

/// `cuMemSetAccess`: applies every descriptor to the whole mappings making up `[ptr, ptr + size)`.
pub(crate) fn set_access(ptr: u64, size: usize, descs: &[AccessDesc]) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    if descs.is_empty() {
        return Err(invalid("cuMemSetAccess with no access descriptor"));
    }
    let bases = tiling(&st.vmm, ptr, size as u64, "cuMemSetAccess")?;
    let mut wanted = Vec::with_capacity(descs.len());
    for desc in descs {
        if desc.location.kind != LOC_DEVICE {
            return Err(invalid(format!("access location type {} is not a device", desc.location.kind)));
        }
        let d = st.ordinal(desc.location.id)?;
        let flags = u64::from(desc.flags);
        if !matches!(flags, 0 | PROT_READ | PROT_READWRITE) {
            return Err(invalid(format!(
                "access flags {flags:#x} are not PROT_NONE, PROT_READ or PROT_READWRITE"
            )));
        }
        wanted.push((d, flags));
    }
    // A device reaches another's memory only over a peer link.
    for &base in &bases {
        let owner = st.vmm.physical[&st.vmm.mappings[&base].handle].device;
        if let Some(&(d, _)) = wanted.iter().find(|&&(d, f)| f != 0 && d != owner && !st.peer[d][owner]) {
            return Err(Fail::misuse(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_DEVICE,
                format!("device {d} cannot access device {owner}'s memory (no peer link)"),
            ));
        }
    }
    // Taking access away does not wait on a GPU: the device's work still queued there would fault.
    for &base in &bases {
        let m = &st.vmm.mappings[&base];
        for &(d, flags) in &wanted {
            if m.access.get(&d).copied().unwrap_or(0) & !flags != 0 {
                super::pending::report_queued_work(
                    &st,
                    Some(d),
                    base,
                    base + m.size,
                    "cuMemSetAccess lowering access",
                );
            }
        }
    }
    for base in bases {
        let m = st.vmm.mappings.get_mut(&base).expect("tiled");
        for &(d, flags) in &wanted {
            m.access.insert(d, flags);
        }
    }
    Ok(())
}

/// `cuMemGetAccess`: the access `location` has to the mapping containing `ptr`.
pub(crate) fn get_access(location: &MemLocation, ptr: u64) -> Result<u64, Fail> {
    let st = SIM.st.lock();
    if location.kind != LOC_DEVICE {
        return Err(invalid(format!("access location type {} is not a device", location.kind)));
    }
    let d = st.ordinal(location.id)?;
    let Some((_, m)) = st.vmm.mapping_of(ptr) else {
        return Err(invalid(format!("{ptr:#x} is not inside a VMM mapping")));
    };
    Ok(m.access.get(&d).copied().unwrap_or(0))
}

/// Checks `[addr, addr + len)`, starting in a mapping, for a copy or memset issued on `device`:
/// it must be covered by adjacent mappings (of one device's address space, hence one host view),
/// each giving `device` at least read access (read-write with `write`).
pub(crate) fn check_span(st: &State, device: usize, addr: u64, len: u64, write: bool) -> Result<(), Fail> {
    let need = if write { PROT_READWRITE } else { PROT_READ };
    let end = addr.saturating_add(len.max(1));
    let mut at = addr;
    let mut space = None;
    while at < end {
        let Some((base, m)) = st.vmm.mapping_of(at) else {
            return Err(invalid(format!(
                "[{addr:#x}, +{len}) runs off the end of its mapping into unmapped address {at:#x}"
            )));
        };
        let owner = st.vmm.reservations[&m.reservation].device;
        if *space.get_or_insert(owner) != owner {
            return Err(invalid(format!(
                "[{addr:#x}, +{len}) runs from one device's address space into another's"
            )));
        }
        let has = m.access.get(&device).copied().unwrap_or(0);
        if has & need != need {
            return Err(invalid(format!(
                "the mapping [{base:#x}, +{}) gives device {device} access {has:#x}, {} needs {need:#x} (cuMemSetAccess)",
                m.size,
                if write { "a write" } else { "a read" }
            )));
        }
        at = base + m.size;
    }
    Ok(())
}
