//! `cuDeviceGetByPCIBusId`: the inverse of `cuDeviceGetPCIBusId`, answered from the devices'
//! PCI_DOMAIN_ID / PCI_BUS_ID / PCI_DEVICE_ID attributes.

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::sys::{CUdevice, CUresult};

use crate::api::{self, Fail, Init};
use crate::exports::device::{cuDeviceGetAttribute, cuDeviceGetCount};
use crate::exports::legacy_names::forward;

/// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
const ATTR_PCI_BUS_ID: u32 = 33;
/// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
const ATTR_PCI_DEVICE_ID: u32 = 34;
/// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
const ATTR_PCI_DOMAIN_ID: u32 = 50;

/// `(domain, bus, device)` of `[domain]:[bus]:[device].[function]`, `[domain]:[bus]:[device]` or
/// `[bus]:[device].[function]` (hexadecimal), the forms the driver documents.
pub(crate) fn parse_bus_id(text: &str) -> Option<(u32, u32, u32)> {
    let hex = |s: &str| (!s.is_empty() && s.len() <= 8).then(|| u32::from_str_radix(s, 16).ok()).flatten();
    let (head, function) = match text.split_once('.') {
        Some((h, f)) => (h, Some(f)),
        None => (text, None),
    };
    if let Some(f) = function {
        hex(f)?;
    }
    let parts: Vec<&str> = head.split(':').collect();
    match (parts.as_slice(), function) {
        ([d, b, dev], _) => Some((hex(d)?, hex(b)?, hex(dev)?)),
        ([b, dev], Some(_)) => Some((0, hex(b)?, hex(dev)?)),
        _ => None,
    }
}

/// One device attribute through the export (the device exists: it was counted).
fn attribute(attr: u32, dev: CUdevice) -> Result<i32, Fail> {
    let mut v: c_int = 0;
    // SAFETY: writes one int into a local.
    forward(unsafe { cuDeviceGetAttribute(&raw mut v, attr, dev) })?;
    Ok(v)
}

/// `CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)`: the device whose PCI
/// domain, bus and device numbers the string names. NULL arguments or a malformed string →
/// `INVALID_VALUE`; no such device → `INVALID_DEVICE`.
///
/// # Safety
/// 1. `dev` is NULL or valid for writing a `CUdevice`; `bus_id` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus_id: *const c_char) -> CUresult {
    api::call("cuDeviceGetByPCIBusId", Init::Required, || {
        api::non_null(dev, "dev")?;
        api::non_null(bus_id, "pciBusId")?;
        // SAFETY: non-NULL and NUL-terminated (caller contract).
        let text = unsafe { CStr::from_ptr(bus_id) }.to_string_lossy().into_owned();
        let Some((domain, bus, device)) = parse_bus_id(text.trim()) else {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("malformed PCI bus id {text:?}"),
            ));
        };
        let mut count: c_int = 0;
        // SAFETY: writes one int into a local.
        forward(unsafe { cuDeviceGetCount(&raw mut count) })?;
        for d in 0..count {
            let here = (
                attribute(ATTR_PCI_DOMAIN_ID, d)? as u32,
                attribute(ATTR_PCI_BUS_ID, d)? as u32,
                attribute(ATTR_PCI_DEVICE_ID, d)? as u32,
            );
            if here == (domain, bus, device) {
                // SAFETY: caller contract (checked non-NULL).
                return unsafe { api::out(dev, d, "dev") };
            }
        }
        Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_DEVICE, format!("no device at PCI bus id {text:?}")))
    })
}

#[cfg(test)]
mod tests {
    use super::parse_bus_id;

    #[test]
    fn bus_id_forms() {
        assert_eq!(parse_bus_id("0000:18:00.0"), Some((0, 0x18, 0)));
        assert_eq!(parse_bus_id("0001:1a:02"), Some((1, 0x1a, 2)));
        assert_eq!(parse_bus_id("19:00.0"), Some((0, 0x19, 0)));
        assert_eq!(parse_bus_id("19:00"), None);
        assert_eq!(parse_bus_id("zz:00.0"), None);
        assert_eq!(parse_bus_id(""), None);
    }
}
