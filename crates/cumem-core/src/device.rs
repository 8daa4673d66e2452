//! Devices: enumeration, names, attributes, memory size and capabilities.
//!
//! A [`Device`] is a plain ordinal; it owns nothing. Work happens in a [`Context`], which
//! [`Device::context`] retains.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::Device;
//! for device in Device::all()? {
//!     let caps = device.capabilities()?;
//!     println!("{}: {} ({} bytes, pools: {})", device.ordinal(), device.name()?, device.total_memory()?, caps.memory_pools);
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

use cumem_sys::sys::{CUdevice, CUdevice_attribute};

use parking_lot::Mutex;

use crate::{Capabilities, Context, Result, ffi};

/// A CUDA device, by ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    raw: CUdevice,
}

impl Device {
    /// Number of devices the driver sees. Loads the driver on first use.
    pub fn count() -> Result<usize> {
        cumem_sys::driver::init()?;
        Ok(ffi::device_count()?.max(0) as usize)
    }

    /// The device with this ordinal; `InvalidDevice` if there is none.
    pub fn get(ordinal: usize) -> Result<Device> {
        cumem_sys::driver::init()?;
        let ordinal = i32::try_from(ordinal).unwrap_or(i32::MAX);
        Ok(Device { raw: ffi::device_get(ordinal)? })
    }

    /// Every device, in ordinal order.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// This device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.raw as usize
    }

    /// The driver's handle for this device.
    pub fn raw(&self) -> CUdevice {
        self.raw
    }

    /// The device's marketing name.
    pub fn name(&self) -> Result<String> {
        ffi::device_name(self.raw)
    }

    /// One device attribute.
    pub fn attribute(&self, attr: CUdevice_attribute) -> Result<i32> {
        ffi::device_attribute(self.raw, attr)
    }

    /// Whether this device can access `peer`'s memory once peer access is enabled
    /// (`cuDeviceCanAccessPeer`; `false` for the device itself, which needs no peer access).
    ///
    /// ```
    /// # cumem_sys::testing::init();
    /// use cumem_core::Device;
    /// let d = Device::get(0)?;
    /// assert!(!d.can_access_peer(d)?);
    /// # Ok::<(), cumem_core::Error>(())
    /// ```
    pub fn can_access_peer(&self, peer: Device) -> Result<bool> {
        ffi::device_can_access_peer(self.raw, peer.raw)
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        ffi::device_total_mem(self.raw)
    }

    /// Compute capability as (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use CUdevice_attribute as A;
        Ok((
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// The widest row, in bytes, that pitched allocations and 2D/3D copies accept (one attribute
    /// query, `MAX_PITCH`; also in [`Capabilities::max_pitch`]).
    pub fn max_pitch(&self) -> Result<usize> {
        // A negative answer would be a driver bug; treat it as "no row fits".
        Ok(usize::try_from(self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)?).unwrap_or(0))
    }

    /// What this device supports, read from its attributes once per process (attributes do not
    /// change while a driver is loaded), so that checking a capability costs no driver call.
    pub fn capabilities(&self) -> Result<Capabilities> {
        static CACHE: Mutex<Vec<Option<Capabilities>>> = Mutex::new(Vec::new());
        let i = self.ordinal();
        if let Some(Some(caps)) = CACHE.lock().get(i) {
            return Ok(*caps);
        }
        // Read outside the lock: a racing thread reads the same values.
        let caps = Capabilities::query(*self)?;
        let mut cache = CACHE.lock();
        if cache.len() <= i {
            cache.resize(i + 1, None);
        }
        cache[i] = Some(caps);
        Ok(caps)
    }

    /// This device's primary context.
    ///
    /// It is retained once per process and kept for its lifetime, as the CUDA runtime does:
    /// releasing the last reference would tear the context down (destroying every allocation,
    /// stream and pool in it), and the next call would pay for building it again.
    pub fn context(&self) -> Result<Context> {
        static CONTEXTS: Mutex<Vec<Option<Context>>> = Mutex::new(Vec::new());
        let mut cache = CONTEXTS.lock();
        let i = self.ordinal();
        if let Some(Some(ctx)) = cache.get(i) {
            return Ok(ctx.clone());
        }
        let ctx = Context::retain_primary(*self)?;
        if cache.len() <= i {
            cache.resize(i + 1, None);
        }
        cache[i] = Some(ctx.clone());
        Ok(ctx)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "device {}", self.raw)
    }
}
