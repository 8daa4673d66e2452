//! Physical memory: `cuMemGetAllocationGranularity`, `cuMemCreate`, `cuMemRelease`,
//! `cuMemRetainAllocationHandle`, `cuMemGetAllocationPropertiesFromHandle`.
//!
//! Creation charges the device's capacity at once (`cuMemGetInfo`'s free drops by the size);
//! the memory and the charge go when the last reference is released and the last mapping
//! unmapped, in whichever order.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys::CUresult;

use super::{GRANULARITY, Physical, invalid, prop_device, require_vmm};
use crate::abi::AllocationProp;
use crate::api::Fail;
use crate::state::{SIM, State};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_POSIX_FD: u32 = 0x1;
/// `CU_MEM_HANDLE_TYPE_WIN32` | `CU_MEM_HANDLE_TYPE_WIN32_KMT`.
const HANDLE_WIN32: u32 = 0x6;
/// `CU_MEM_HANDLE_TYPE_FABRIC`.
const HANDLE_FABRIC: u32 = 0x8;

/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
const ATTR_POSIX_FD: u32 = 103;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`.
const ATTR_FABRIC: u32 = 128;
/// `CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED`.
const ATTR_GENERIC_COMPRESSION: u32 = 107;

/// `cuMemGetAllocationGranularity`: 2 MiB for both MINIMUM (0) and RECOMMENDED (1), as observed.
pub(crate) fn granularity(prop: &AllocationProp, option: u32) -> Result<u64, Fail> {
    let st = SIM.st.lock();
    let d = prop_device(&st, prop)?;
    require_vmm(&st, d)?;
    if option > 1 {
        return Err(invalid(format!(
            "granularity option {option} is neither MINIMUM (0) nor RECOMMENDED (1)"
        )));
    }
    Ok(GRANULARITY)
}

/// Which requested handle types the device can honour. Observed on an H100: Win32 kinds and
/// POSIX|WIN32 → `INVALID_VALUE`; FABRIC → `NOT_PERMITTED` (no IMEX channel); undefined bits are
/// ignored. A kind whose device attribute is 0 (FABRIC by default; POSIX_FD where the
/// configuration turns it off) is refused with `NOT_SUPPORTED`, the driver's answer for a
/// missing capability.
fn check_handle_types(st: &State, d: usize, types: u32) -> Result<(), Fail> {
    if types & HANDLE_WIN32 != 0 {
        return Err(invalid(format!("requestedHandleTypes {types:#x} asks for a Win32 handle on Linux")));
    }
    let unsupported = |attr: u32| st.devices[d].attr(attr) != Some(1);
    if types & HANDLE_POSIX_FD != 0 && unsupported(ATTR_POSIX_FD) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if types & HANDLE_FABRIC != 0 {
        if unsupported(ATTR_FABRIC) {
            return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
        }
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_NOT_PERMITTED,
            "CU_MEM_HANDLE_TYPE_FABRIC without an IMEX channel",
        ));
    }
    Ok(())
}

/// A memory file of `size` bytes; `None` when the kernel refuses.
pub(super) fn memory_file(size: u64) -> Option<OwnedFd> {
    // SAFETY: a NUL-terminated name; the result is checked before use.
    let fd = unsafe { libc::memfd_create(c"cumem-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = libc::off_t::try_from(size).ok()?;
    // SAFETY: `fd` is the memory file created above.
    (unsafe { libc::ftruncate(fd, len) } == 0).then_some(file)
}

/// `cuMemCreate`: `size` bytes of physical memory described by `prop`; returns the handle.
pub(crate) fn create(size: usize, prop: &AllocationProp, flags: u64) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let d = prop_device(&st, prop)?;
    require_vmm(&st, d)?;
    if flags != 0 {
        return Err(invalid(format!("cuMemCreate flags {flags:#x} must be 0")));
    }
    let size = size as u64;
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(invalid(format!(
            "size {size} is not a non-zero multiple of the granularity {GRANULARITY}"
        )));
    }
    check_handle_types(&st, d, prop.handle_types)?;
    // `allocFlags.compressionType` is a request: the CUmemAllocationProp docs tell the program to
    // check the handle's properties for the compression it got, so a device without
    // GENERIC_COMPRESSION_SUPPORTED reports it cleared (how the driver reports it is a guess [I]).
    // `gpuDirectRDMACapable` is kept as requested: the handle's properties are the create-time
    // ones (§9, §17), and the pointer attribute IS_GPU_DIRECT_RDMA_CAPABLE already answers 0 on a
    // device without GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED.
    let mut prop = *prop;
    if st.devices[d].attr(ATTR_GENERIC_COMPRESSION).unwrap_or(0) == 0 {
        prop.compression_type = 0;
    }
    let prop = &prop;
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let dev = &st.devices[d];
    if size > dev.total - dev.used {
        return Err(oom());
    }
    let file = memory_file(size + super::shareable::TRAILER).ok_or_else(oom)?;
    super::shareable::write_trailer(&file, size, prop).ok_or_else(oom)?;
    st.devices[d].used += size;
    let handle = st.vmm.new_handle();
    let physical = Physical { size, device: d, prop: *prop, refs: 1, mappings: 0, file, charged: true };
    st.vmm.physical.insert(handle, physical);
    Ok(handle)
}

/// Frees physical memory that has neither references nor mappings left.
pub(crate) fn collect(st: &mut State, handle: u64) {
    if let Some(p) = st.vmm.physical.get(&handle)
        && p.refs == 0
        && p.mappings == 0
    {
        let p = st.vmm.physical.remove(&handle).expect("just found");
        if p.charged {
            st.devices[p.device].used -= p.size;
        }
    }
}

/// The live (not fully released) physical allocation `handle`, or `INVALID_VALUE`.
fn referenced<'a>(st: &'a mut State, handle: u64, what: &str) -> Result<&'a mut Physical, Fail> {
    match st.vmm.physical.get_mut(&handle) {
        Some(p) if p.refs > 0 => Ok(p),
        Some(_) => {
            Err(invalid(format!("{what}: handle {handle:#x} was already released (it is only mapped)")))
        }
        None => Err(invalid(format!("{what}: {handle:#x} is not a live allocation handle"))),
    }
}

/// `cuMemRelease`: drops one reference.
pub(crate) fn release(handle: u64) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    referenced(&mut st, handle, "cuMemRelease")?.refs -= 1;
    collect(&mut st, handle);
    Ok(())
}

/// `cuMemRetainAllocationHandle`: the handle mapped at `addr`, with one more reference.
pub(crate) fn retain(addr: u64) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let Some((_, m)) = st.vmm.mapping_of(addr) else {
        return Err(invalid(format!("{addr:#x} is not inside a VMM mapping")));
    };
    let handle = m.handle;
    st.vmm.physical.get_mut(&handle).expect("a mapping keeps its physical memory").refs += 1;
    Ok(handle)
}

/// `cuMemGetAllocationPropertiesFromHandle`: the properties `handle` was created with.
pub(crate) fn properties(handle: u64) -> Result<AllocationProp, Fail> {
    let mut st = SIM.st.lock();
    Ok(referenced(&mut st, handle, "cuMemGetAllocationPropertiesFromHandle")?.prop)
}
