//! The devices' peer topology: which device can access which, and the link attributes.
//!
//! [`Topology::probe`] asks the driver once per ordered pair of devices (`cuDeviceCanAccessPeer`
//! and `cuDeviceGetP2PAttribute`); the answer is a plain value, printed as a matrix by its
//! `Display` (`cumem info` shows it).
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_peer::Topology;
//! let topo = Topology::probe()?;
//! assert!(!topo.can_access(0, 0)); // a device is never its own peer
//! println!("{topo}");
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::fmt;

use cumem_core::{Device, Error, Result};
use cumem_sys::sys::CUdevice_P2PAttribute as Attr;

use crate::ffi;

/// What the driver says about access from one device to another.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Link {
    /// `cuDeviceCanAccessPeer`: the first device can access the second's memory.
    pub can_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: atomics over the link are native.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: relative speed of the link (lower is faster).
    pub performance_rank: i32,
}

/// The peer matrix of every device the driver sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// `links[a][b]`: access from device `a` to device `b` (the diagonal is all default).
    links: Vec<Vec<Link>>,
}

impl Topology {
    /// Queries the driver for every ordered pair of devices.
    pub fn probe() -> Result<Topology> {
        let n = Device::count()?;
        let mut links = vec![vec![Link::default(); n]; n];
        for (a, row) in links.iter_mut().enumerate() {
            for (b, link) in row.iter_mut().enumerate() {
                if a != b {
                    *link = probe_link(a, b)?;
                }
            }
        }
        Ok(Topology { links })
    }

    /// How many devices the matrix covers.
    pub fn devices(&self) -> usize {
        self.links.len()
    }

    /// Access from device `from` to device `to`, or `InvalidDevice` for an ordinal out of range.
    pub fn link(&self, from: usize, to: usize) -> Result<Link> {
        self.links.get(from).and_then(|row| row.get(to)).copied().ok_or(Error::InvalidDevice {
            ctx: cumem_core::ErrorContext::op("Topology::link").device(from.max(to) as i32),
        })
    }

    /// Whether device `from` can access device `to`'s memory (false out of range and for
    /// `from == to`, as the driver answers).
    pub fn can_access(&self, from: usize, to: usize) -> bool {
        self.link(from, to).is_ok_and(|l| l.can_access)
    }

    /// Whether a copy between the two devices goes over a peer link (either direction suffices:
    /// the copy engine of the device that has the link does the work).
    pub fn linked(&self, a: usize, b: usize) -> bool {
        self.can_access(a, b) || self.can_access(b, a)
    }
}

/// One ordered pair's link, from the driver.
pub(crate) fn probe_link(a: usize, b: usize) -> Result<Link> {
    let (a, b) = (Device::get(a)?, Device::get(b)?);
    let (da, db) = (a.raw(), b.raw());
    Ok(Link {
        can_access: a.can_access_peer(b)?,
        access_supported: ffi::p2p_attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, da, db)? != 0,
        native_atomics: ffi::p2p_attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, da, db)?
            != 0,
        performance_rank: ffi::p2p_attribute(Attr::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, da, db)?,
    })
}

/// The matrix, one row per accessing device: `P` = peer access (`A` with native atomics),
/// `.` = none, `-` = the device itself.
impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer access (row -> column):\n     ")?;
        for b in 0..self.devices() {
            write!(f, " {b:>3}")?;
        }
        for (a, row) in self.links.iter().enumerate() {
            write!(f, "\n  {a:>3}")?;
            for (b, link) in row.iter().enumerate() {
                let c = match (a == b, link.can_access, link.native_atomics) {
                    (true, ..) => '-',
                    (false, true, true) => 'A',
                    (false, true, false) => 'P',
                    (false, false, _) => '.',
                };
                write!(f, " {c:>3}")?;
            }
        }
        Ok(())
    }
}
