//! Multi-GPU memory: the peer topology, peer access, and copies between devices.
//!
//! - [`Topology`] — which device can access which (`cuDeviceCanAccessPeer`) and the link
//!   attributes (performance rank, access supported, native atomics); `Display` prints the matrix.
//! - [`PeerAccess`] — access from one context to another's memory, enabled while a guard lives;
//!   enabling a pair twice is not an error (guards of one pair share one enablement).
//! - [`copy_peer`] and [`PeerStreamCopy::copy_peer`] — typed copies between devices, blocking or
//!   queued, ordered after the work of both buffers exactly as same-device copies are; two devices
//!   without a peer link copy through pinned host memory instead, and the returned [`PeerCopy`]
//!   says which [`PeerPath`] was taken.
//! - [`PeerStreamCopy3D::copy_3d_peer`] — a box of pitched memory copied between devices
//!   (`cuMemcpy3DPeerAsync`), with `cumem-copy`'s `Copy3D` extents.
//!
//! See `docs/multi-gpu.md` for the choices behind these.
//!
//! ```
//! # cumem_sys::testing::init_with("devices=2");
//! use cumem_core::{Device, DeviceBuffer, Stream};
//! use cumem_peer::{PeerAccess, Topology, copy_peer};
//! let (c0, c1) = (Device::get(0)?.context()?, Device::get(1)?.context()?);
//! if Topology::probe()?.can_access(0, 1) {
//!     let _access = PeerAccess::enable(&c0, &c1)?; // device-0 code may now read device 1's memory
//! }
//! let a = DeviceBuffer::from_slice(&Stream::new(&c0)?, &[1u8, 2, 3])?;
//! let mut b = DeviceBuffer::<u8>::zeroed(&Stream::new(&c1)?, 3)?;
//! let done = copy_peer(&a, &mut b)?;
//! println!("copied {} bytes ({:?})", done.bytes(), done.path());
//! assert_eq!(b.to_vec()?, [1, 2, 3]);
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod access;
mod copy;
mod copy_3d;
mod ffi;
mod topology;

pub use access::PeerAccess;
pub use copy::{PeerCopy, PeerPath, PeerStreamCopy, copy_peer};
pub use copy_3d::PeerStreamCopy3D;
pub use topology::{Link, Topology};

/// `docs/multi-gpu.md`, whose examples run as doctests on the simulator.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/multi-gpu.md")]
pub struct MultiGpuGuide;
