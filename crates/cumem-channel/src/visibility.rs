//! What host and device can see of each other's writes while a kernel runs: read from the platform
//! (native Linux or WSL2) and the device's attributes.
//!
//! Under WSL2 the GPU is reached through a paravirtualised driver: there is no concurrent managed
//! access, and mapped host memory is coherent only at synchronisation points, so a persistent
//! kernel cannot poll host memory for messages and must receive them by explicit copies. On native
//! Linux, page-locked mapped memory is coherent at system scope. Without host mapping at all, only
//! explicit DMA (copies) reaches the device.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_channel::{MemoryVisibility, Platform, VisibilityReport};
//! use cumem_core::Device;
//! let device = Device::get(0)?;
//! let wsl = VisibilityReport::detect_with_os(device, "5.15.153.1-microsoft-standard-WSL2")?;
//! assert_eq!(wsl.platform, Platform::Wsl2);
//! assert_eq!(wsl.visibility, MemoryVisibility::DeviceScope);
//! let native = VisibilityReport::detect_with_os(device, "6.8.0-45-generic")?;
//! assert_eq!(native.platform, Platform::NativeLinux);
//! # Ok::<(), cumem_channel::ChannelError>(())
//! ```

use std::fmt;

use cumem_core::Device;

use crate::{ChannelError, ffi};

/// The operating system the process runs on, as far as visibility is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// Linux on the machine that holds the GPU.
    NativeLinux,
    /// Linux in a WSL2 virtual machine (the kernel release names Microsoft).
    Wsl2,
    /// Anything else (the read failed, or the string is not a Linux kernel's): treated like WSL2,
    /// the cautious choice.
    Unknown,
}

impl Platform {
    /// Classifies a kernel release or version string (`/proc/sys/kernel/osrelease`, such as
    /// `6.8.0-45-generic`, or `/proc/version`, `Linux version …`): WSL kernels name Microsoft. A
    /// string that starts neither with `Linux` nor with a release number (`Darwin Kernel …`, an
    /// empty one) is `Unknown`. A bare release number cannot name its kernel, and is taken as
    /// Linux's: pass only what `/proc` gives (as [`Platform::detect`] does; those files exist on
    /// Linux only), not another system's `uname -r`.
    pub fn from_os_string(os: &str) -> Platform {
        let lower = os.trim().to_ascii_lowercase();
        let linux = lower.starts_with("linux") || lower.starts_with(|c: char| c.is_ascii_digit());
        if !linux {
            Platform::Unknown
        } else if lower.contains("microsoft") || lower.contains("wsl") {
            Platform::Wsl2
        } else {
            Platform::NativeLinux
        }
    }

    /// Reads the running kernel's release (`/proc/sys/kernel/osrelease`, else `/proc/version`).
    pub fn detect() -> Platform {
        let os = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .or_else(|_| std::fs::read_to_string("/proc/version"))
            .unwrap_or_default();
        Platform::from_os_string(&os)
    }
}

/// How far a write by one side is visible to the other while a kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MemoryVisibility {
    /// Mapped memory is unavailable: only explicit copies (DMA) reach a running kernel.
    DmaOnly,
    /// Host writes to mapped or managed memory reach a running kernel only at synchronisation
    /// points (WSL2, or no concurrent managed access): messages go by explicit copies.
    DeviceScope,
    /// Mapped page-locked memory is coherent at system scope: a running kernel can poll it.
    SystemScope,
}

impl fmt::Display for MemoryVisibility {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryVisibility::DmaOnly => "explicit DMA only",
            MemoryVisibility::DeviceScope => "device scope",
            MemoryVisibility::SystemScope => "system scope",
        })
    }
}

impl MemoryVisibility {
    /// The visibility on `device` on this platform (see [`VisibilityReport::detect`]).
    pub fn detect(device: Device) -> Result<MemoryVisibility, ChannelError> {
        Ok(VisibilityReport::detect(device)?.visibility)
    }
}

/// Everything [`MemoryVisibility`] was decided from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct VisibilityReport {
    /// The device.
    pub device: Device,
    /// The platform.
    pub platform: Platform,
    /// The verdict.
    pub visibility: MemoryVisibility,
    /// `CAN_MAP_HOST_MEMORY`.
    pub host_mapping: bool,
    /// `MANAGED_MEMORY`.
    pub managed_memory: bool,
    /// `CONCURRENT_MANAGED_ACCESS`: host and device may touch managed memory at the same time.
    pub concurrent_managed_access: bool,
    /// `PAGEABLE_MEMORY_ACCESS`: the device can read ordinary (pageable) host memory.
    pub pageable_memory_access: bool,
    /// `HOST_NATIVE_ATOMIC_SUPPORTED`: atomics between host and device are native (coherent link).
    pub host_native_atomics: bool,
}

impl VisibilityReport {
    /// Reads the platform from `/proc` and the device's attributes.
    pub fn detect(device: Device) -> Result<VisibilityReport, ChannelError> {
        Self::decide(device, Platform::detect())
    }

    /// As [`VisibilityReport::detect`] with the kernel release given (for tests and for callers that
    /// know better than `/proc`).
    pub fn detect_with_os(device: Device, os_release: &str) -> Result<VisibilityReport, ChannelError> {
        Self::decide(device, Platform::from_os_string(os_release))
    }

    pub(crate) fn decide(device: Device, platform: Platform) -> Result<VisibilityReport, ChannelError> {
        let caps = device.capabilities()?;
        let coherence = ffi::coherence_attributes(device)?;
        // Without mapped memory, nothing but copies reaches the device while a kernel runs (managed
        // memory alone migrates at faults or synchronisation, never under a polling kernel).
        let visibility = if !caps.host_mapping {
            MemoryVisibility::DmaOnly
        } else if platform == Platform::NativeLinux && caps.host_mapping && caps.concurrent_managed_access {
            MemoryVisibility::SystemScope
        } else {
            MemoryVisibility::DeviceScope
        };
        Ok(VisibilityReport {
            device,
            platform,
            visibility,
            host_mapping: caps.host_mapping,
            managed_memory: caps.managed_memory,
            concurrent_managed_access: caps.concurrent_managed_access,
            pageable_memory_access: coherence.pageable_memory_access,
            host_native_atomics: coherence.host_native_atomics,
        })
    }
}
