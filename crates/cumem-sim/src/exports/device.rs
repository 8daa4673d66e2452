//! Device queries: count, handles, names, attributes, total memory, UUIDs, peer capability.
//! None of them needs a current context.

use std::ffi::{c_char, c_int};

use cudarc::driver::sys::{CUdevice, CUresult, CUuuid};

use crate::api::{self, ApiResult, Fail, Init};
use crate::state::{SIM, State};

/// The ordinal `dev` names, or `INVALID_DEVICE` (the model's [`State::ordinal`], named for the
/// shims).
pub(crate) fn device(st: &State, dev: CUdevice) -> Result<usize, Fail> {
    st.ordinal(dev)
}

/// Copies `text` into a caller buffer of `len` bytes, NUL-terminated (truncating).
///
/// # Safety
/// 1. `buf` is NULL or valid for writing `len` bytes.
unsafe fn write_c_string(buf: *mut c_char, len: c_int, text: &str) -> ApiResult {
    if buf.is_null() || len <= 0 {
        return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "NULL buffer or non-positive length"));
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: `buf` is valid for `len` bytes and `n + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        buf.add(n).write(0);
    }
    Ok(())
}

/// `CUresult cuDeviceGetCount(int *count)`.
///
/// # Safety
/// 1. `count` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    api::call("cuDeviceGetCount", Init::Required, || {
        let n = SIM.st.lock().devices.len() as c_int;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(count, n, "count") }
    })
}

/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`: the handle is the ordinal.
///
/// # Safety
/// 1. `out_device` is NULL or valid for writing a `CUdevice`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(out_device: *mut CUdevice, ordinal: c_int) -> CUresult {
    api::call("cuDeviceGet", Init::Required, || {
        api::non_null(out_device, "device")?;
        let d = device(&SIM.st.lock(), ordinal)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(out_device, d as CUdevice, "device") }
    })
}

/// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`.
///
/// # Safety
/// 1. `name` is NULL or valid for writing `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    api::call("cuDeviceGetName", Init::Required, || {
        api::non_null(name, "name")?;
        let st = SIM.st.lock();
        let d = device(&st, dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { write_c_string(name, len, &st.devices[d].name) }
    })
}

/// `CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`.
///
/// # Safety
/// 1. `bus_id` is NULL or valid for writing `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    api::call("cuDeviceGetPCIBusId", Init::Required, || {
        api::non_null(bus_id, "pciBusId")?;
        let st = SIM.st.lock();
        let d = device(&st, dev)?;
        let attr = |n| st.devices[d].attr(n).unwrap_or(0);
        // PCI_DOMAIN_ID, PCI_BUS_ID, PCI_DEVICE_ID: the numbers cuDeviceGetByPCIBusId matches.
        let (domain, bus, slot) = (attr(50), attr(crate::attributes::PCI_BUS_ID), attr(34));
        // SAFETY: forwarded caller contract.
        unsafe { write_c_string(bus_id, len, &format!("{domain:04x}:{bus:02x}:{slot:02x}.0")) }
    })
}

/// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`: the
/// configured (H100-like by default) profile; numbers the bindings do not define give
/// `INVALID_VALUE`.
///
/// # Safety
/// 1. `pi` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut c_int, attrib: u32, dev: CUdevice) -> CUresult {
    api::call("cuDeviceGetAttribute", Init::Required, || {
        api::non_null(pi, "pi")?;
        let st = SIM.st.lock();
        let d = device(&st, dev)?;
        let v = st.devices[d].attr(attrib).ok_or_else(|| {
            Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("unknown device attribute {attrib}"))
        })?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(pi, v, "pi") }
    })
}

/// `CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev)` (symbol `_v2`): the configured
/// capacity.
///
/// # Safety
/// 1. `bytes` is NULL or valid for writing a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    api::call("cuDeviceTotalMem_v2", Init::Required, || {
        api::non_null(bytes, "bytes")?;
        let st = SIM.st.lock();
        let d = device(&st, dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(bytes, st.devices[d].total as usize, "bytes") }
    })
}

fn uuid_of(d: usize) -> CUuuid {
    let mut bytes = [0 as c_char; 16];
    for (dst, src) in bytes.iter_mut().zip(b"cumem-sim-dev".iter()) {
        *dst = *src as c_char;
    }
    bytes[13] = (d >> 16) as c_char;
    bytes[14] = (d >> 8) as c_char;
    bytes[15] = d as c_char;
    CUuuid { bytes }
}

/// # Safety
/// 1. `uuid` is NULL or valid for writing a `CUuuid`.
unsafe fn get_uuid(name: &'static str, uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    api::call(name, Init::Required, || {
        api::non_null(uuid, "uuid")?;
        let d = device(&SIM.st.lock(), dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(uuid, uuid_of(d), "uuid") }
    })
}

/// `CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)`: a stable per-ordinal UUID.
///
/// # Safety
/// 1. `uuid` is NULL or valid for writing a `CUuuid`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { get_uuid("cuDeviceGetUuid", uuid, dev) }
}

/// `CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)`: same as `cuDeviceGetUuid`.
///
/// # Safety
/// 1. `uuid` is NULL or valid for writing a `CUuuid`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded caller contract.
    unsafe { get_uuid("cuDeviceGetUuid_v2", uuid, dev) }
}

/// `CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)`: from
/// the configured peer matrix; a device never "peers" with itself (0).
///
/// # Safety
/// 1. `can_access` is NULL or valid for writing an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can_access: *mut c_int,
    dev: CUdevice,
    peer: CUdevice,
) -> CUresult {
    api::call("cuDeviceCanAccessPeer", Init::Required, || {
        api::non_null(can_access, "canAccessPeer")?;
        let st = SIM.st.lock();
        let a = device(&st, dev)?;
        let b = device(&st, peer)?;
        // SAFETY: forwarded caller contract.
        unsafe { api::out(can_access, c_int::from(st.peer[a][b]), "canAccessPeer") }
    })
}
