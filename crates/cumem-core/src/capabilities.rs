//! What a device supports, read once from its attributes.
//!
//! Features that a device may lack are checked here before any driver call, so that an
//! unsupported feature is `NotSupported { feature }` rather than a driver error halfway through.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Feature};
//! let caps = Device::get(0)?.capabilities()?;
//! if caps.require(Feature::ManagedMemory).is_ok() {
//!     assert!(caps.managed_memory);
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_sys::sys::CUdevice_attribute as A;

use crate::{Device, Error, Feature, Result, ffi};

/// A device's memory-related capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The device these describe.
    pub device: Device,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// One address space for host and devices (UVA).
    pub unified_addressing: bool,
    /// `cuMemAllocManaged` is allowed.
    pub managed_memory: bool,
    /// The GPU can fault on managed memory (prefetch to the device, concurrent host access).
    pub concurrent_managed_access: bool,
    /// Stream-ordered allocation and memory pools.
    pub memory_pools: bool,
    /// Virtual memory management.
    pub virtual_memory: bool,
    /// Page-locked host memory can be mapped into the device's address space.
    pub host_mapping: bool,
    /// Existing host memory can be page-locked.
    pub host_register: bool,
    /// Required alignment of pitched rows, in bytes.
    pub texture_pitch_alignment: usize,
    /// The widest row, in bytes, that pitched allocations and 2D/3D copies accept (`MAX_PITCH`).
    pub max_pitch: usize,
    /// This device can access the memory of at least one other device (`cuDeviceCanAccessPeer`
    /// answers 1 for some other device the driver sees); `false` where it is the only device.
    /// Peer access belongs to a pair of devices, which this cannot name: `true` does not say that
    /// a given device is reachable (cumem-peer's `PeerAccess::enable` and `Topology` ask the
    /// driver for the pair), and `false` says that none is.
    pub peer_access: bool,
}

impl Capabilities {
    /// Reads the capabilities of `device`.
    pub fn query(device: Device) -> Result<Self> {
        let flag = |attr| device.attribute(attr).map(|v| v != 0);
        Ok(Capabilities {
            device,
            compute_capability: device.compute_capability()?,
            unified_addressing: flag(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?,
            managed_memory: flag(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)?,
            concurrent_managed_access: flag(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)?,
            memory_pools: flag(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?,
            virtual_memory: flag(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
            host_mapping: flag(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?,
            host_register: flag(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)?,
            texture_pitch_alignment: device.attribute(A::CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT)?.max(1)
                as usize,
            max_pitch: device.max_pitch()?,
            peer_access: reaches_a_peer(device)?,
        })
    }

    /// Whether the device has `feature` (entry points and driver refusals are not device features and
    /// count as supported here). [`Feature::PeerAccess`] is [`Capabilities::peer_access`]: whether
    /// the device reaches any other device, not a particular one.
    pub fn supports(&self, feature: Feature) -> bool {
        match feature {
            Feature::ManagedMemory => self.managed_memory,
            Feature::ConcurrentManagedAccess => self.concurrent_managed_access,
            Feature::MemoryPools => self.memory_pools,
            Feature::VirtualMemory => self.virtual_memory,
            Feature::HostMapping => self.host_mapping,
            Feature::HostRegister => self.host_register,
            Feature::PeerAccess => self.peer_access,
            _ => true,
        }
    }

    /// `Ok(())` if the device has `feature`, else `NotSupported { feature, device }`.
    pub fn require(&self, feature: Feature) -> Result<()> {
        if self.supports(feature) {
            Ok(())
        } else {
            Err(Error::NotSupported { feature, device: Some(self.device.ordinal() as i32) })
        }
    }
}

/// Whether `device` can access the memory of any other device the driver sees.
fn reaches_a_peer(device: Device) -> Result<bool> {
    let me = device.raw();
    for other in 0..ffi::device_count()? {
        let peer = ffi::device_get(other)?;
        if peer != me && ffi::device_can_access_peer(me, peer)? {
            return Ok(true);
        }
    }
    Ok(false)
}
