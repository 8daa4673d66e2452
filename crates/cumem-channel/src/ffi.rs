//! The device attributes the channel reads beyond [`cumem_core::Capabilities`]: the only place
//! this crate names the driver's bindings.

use cumem_core::{Device, Result};
use cumem_sys::sys::CUdevice_attribute as A;

/// Attributes that decide how host and device see each other's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CoherenceAttributes {
    pub(crate) pageable_memory_access: bool,
    pub(crate) host_native_atomics: bool,
}

pub(crate) fn coherence_attributes(device: Device) -> Result<CoherenceAttributes> {
    Ok(CoherenceAttributes {
        pageable_memory_access: device.attribute(A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)? != 0,
        host_native_atomics: device.attribute(A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED)? != 0,
    })
}
