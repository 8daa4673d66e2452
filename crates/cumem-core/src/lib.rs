//! Devices, contexts, streams, events and the owning memory types of cumem.
//!
//! Every kind of CUDA memory is an owning Rust type that frees itself, from any thread:
//! [`DeviceBuffer`] (device memory from any [`DeviceResource`], at any alignment up to
//! [`MAX_ALIGNMENT`]), [`PinnedBuffer`] (page-locked host memory), [`MappedBuffer`] (page-locked
//! host memory with a device address), [`HostRegistered`] (an existing `&mut [T]`, page-locked
//! while it lives). Host-visible kinds share one pending-work tracker, [`HostAccess`], and expose
//! it to asynchronous copies through [`HostMemory`]. Each keeps its [`Context`] alive and binds it
//! before calling the driver, and every device buffer keeps a [`StreamOrder`]: every stream with
//! work on it that nothing has waited for yet, so work on another stream is ordered after them and
//! the memory returns to its resource in stream order.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{DeviceBuffer, Device, Stream};
//!
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let data: Vec<u32> = (0..1024).collect();
//! let buf = DeviceBuffer::from_slice(&stream, &data)?;
//! assert_eq!(buf.to_vec()?, data);
//! # Ok::<(), cumem_core::Error>(())
//! ```

mod buffer;
mod capabilities;
mod context;
mod current;
mod device;
mod dyn_resource;
mod event;
mod ffi;
mod home_stream;
mod host_access;
mod marker;
mod order;
mod pageable;
mod resource;
mod stream;

pub use buffer::device::{DeviceBuffer, MAX_ALIGNMENT};
pub use buffer::mapped::MappedBuffer;
pub use buffer::pinned::{PinnedBuffer, PinnedFlags};
pub use buffer::registered::{HostRegistered, RegisterFlags};
pub use buffer::view::{
    AsDeviceSlice, AsDeviceSliceMut, Chunks, ChunksMut, DeviceSlice, DeviceSliceMut, OnStream, OnStreamMut,
    resolve_range,
};
pub use capabilities::Capabilities;
pub use context::{Context, MemInfo};
pub use cumem_sys::{Error, ErrorContext, Feature, MemoryReport, Result, check};
pub use current::{
    ALLOCATOR_ENV, AllocatorKind, CurrentResourceGuard, DefaultResourceFactory, current_resource,
    default_allocator, install_default_factory, reset_current_resources, scoped_current_resource,
    set_current_resource,
};
pub use device::Device;
pub use dyn_resource::IntoDynResource;
pub use event::Event;
pub use home_stream::HomeStream;
pub use host_access::{HostAccess, HostMemory};
pub use order::{OrderTicket, StreamOrder};
pub use pageable::blocking_host_copy;
pub use resource::{
    AllocLayout, Allocation, CacheUsage, DRIVER_ALIGNMENT, DeviceResource, DriverResource, check_power_of_two,
};
pub use stream::{Stream, StreamOptions, StreamTail};

/// The raw driver bindings, for code that needs a call cumem does not wrap: their types, and
/// entry points whose `CUresult` a newer driver's code would make undefined behaviour (see
/// [`api`]).
pub use cumem_sys::sys;

/// The driver entry points cumem calls, each returning its code as an `int` ([`Code`](api::Code)),
/// which any driver's code is: prefer them to [`sys`]'s for the calls they cover.
pub use cumem_sys::api;

/// What [`device_view_methods!`] names in the crates that invoke it; not part of the stable
/// interface.
#[doc(hidden)]
pub mod __private {
    pub use bytemuck::AnyBitPattern;
}
