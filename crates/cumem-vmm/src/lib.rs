//! Virtual memory management: reservations, physical memory, mappings, and buffers that grow in
//! place.
//!
//! CUDA's VMM API splits an allocation in three: a [`VirtualRange`] of reserved addresses,
//! [`PhysicalMemory`] on a device, and a mapping ([`Mapping`], [`SharedMapping`]) that binds the
//! second into the first, made usable by granting devices [`Access`]. Each is an owning type that
//! undoes itself when dropped, and a mapping cannot outlive its range. Every size, offset and
//! address is checked against the device's [`Granularity`] before the driver is called.
//! [`GrowableBuffer`] builds on them: a typed buffer whose device address never moves while it
//! grows, because it maps new memory at the end of a large reservation instead of reallocating.
//! Mappings and growable buffers can be made accessible from peer devices, and physical memory
//! created with [`HandleTypes::POSIX_FD`] can be exported as a file descriptor and imported in
//! another process ([`PhysicalMemory::export_fd`], [`PhysicalMemory::import_fd`], which is
//! `unsafe`: two objects over the same bytes are ordered by the program, not by cumem).
//!
//! A device without VMM support gives `NotSupported { feature: VirtualMemory }` before any VMM
//! call. See `docs/vmm.md` for a guide.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, Stream};
//! use cumem_vmm::GrowableBuffer;
//! let ctx = Device::get(0)?.context()?;
//! if ctx.device().capabilities()?.virtual_memory {
//!     let stream = Stream::new(&ctx)?;
//!     let mut buf = GrowableBuffer::<u32>::new(&stream)?;
//!     buf.extend_from_slice(&[1, 2, 3])?;
//!     let base = buf.device_ptr();
//!     buf.resize(1 << 20, 7)?;           // grows by mapping more memory at the end
//!     assert_eq!(buf.device_ptr(), base); // ... so the buffer never moves
//!     assert_eq!(buf.slice(..4)?.to_vec()?, [1, 2, 3, 7]);
//! }
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod access;
mod ffi;
mod granularity;
mod growable;
mod handle_types;
mod intervals;
mod mapping;
mod physical;
mod range;

pub use access::Access;
pub use granularity::Granularity;
pub use growable::{GrowableBuffer, GrowableConfig};
pub use handle_types::HandleTypes;
pub use mapping::{Mapping, MappingIn, RangeHolder, SharedMapping};
pub use physical::PhysicalMemory;
pub use range::{ReserveOptions, VirtualRange};

// The guide's examples run as doctests, so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/vmm.md")]
struct GuideExamples;
