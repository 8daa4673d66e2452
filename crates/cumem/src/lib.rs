//! cumem: type-safe CUDA GPU memory management.
//!
//! Every kind of CUDA memory is an owning Rust type that frees itself; every transfer is a typed
//! call that cannot read or write memory it should not. This crate re-exports the cumem crates
//! behind features; most programs need only `use cumem::prelude::*`.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem::prelude::*;
//!
//! let ctx = Device::get(0)?.context()?;
//! let stream = Stream::new(&ctx)?;
//! let host = PinnedBuffer::from_slice(&ctx, &[3u32; 1024])?;
//! let mut dev = DeviceBuffer::<u32>::zeroed(&stream, 1024)?;
//! stream.copy_h2d(&host, &mut dev)?;      // queued; `host` stays borrowed by the device
//! assert_eq!(dev.to_vec()?, vec![3; 1024]);
//! # Ok::<(), cumem::Error>(())
//! ```
//!
//! Device buffers allocate from their device's current resource ([`current_resource`]): with the
//! `pool` feature (the default) that is the caching pool, which `cumem-pool` installs before `main`;
//! without it, `cuMemAlloc`. `CUMEM_ALLOCATOR=caching|native|driver`, [`set_current_resource`] and
//! the `_in` constructors choose another; `pool::trim_current` returns cached memory.
//!
//! | crate | feature | what |
//! |---|---|---|
//! | (the root: every item of [`cumem_core`]) | always | devices, contexts, streams, events, buffers, the resource trait, errors |
//! | [`copy`] | `copy` (default) | typed sync and async transfers and memsets |
//! | [`pool`] | `pool` (default) | the caching pool, the driver's pools, adaptors (statistics, limiting, tracking, logging, failure callback), a memory-pressure monitor |
//! | [`unified`] | `unified` (default) | managed memory, advice, prefetch, migration policies |
//! | [`channel`] | `channel` (default) | host ↔ device message rings for persistent kernels |
//! | [`vmm`] | `vmm` (default) | virtual memory: reservations, mappings, `GrowableBuffer` |
//! | [`peer`] | `peer` (default) | multi-GPU topology, peer access, peer copies (direct or staged) |
//! | `ipc` | `ipc` | device memory, pools and events shared with other processes, descriptors over Unix sockets |
//! | [`driver`] | always; `sim` adds the simulator | choosing the real driver or `cumem-sim` |

// Every public item of cumem-core (and through it cumem-sys's error types and raw bindings), so a
// crate that depends only on `cumem` can name all of them; a glob keeps this true as core grows.
pub use cumem_core::*;

/// The `bytemuck` this crate's bounds use (`Pod`, `AnyBitPattern`, `NoUninit`), so that user types
/// can derive them without a direct dependency: add `#[bytemuck(crate = "cumem::bytemuck")]` next
/// to the derive.
///
/// ```
/// # cumem_sys::testing::init();
/// use cumem::prelude::*;
///
/// #[derive(Clone, Copy, Debug, PartialEq, cumem::bytemuck::Pod, cumem::bytemuck::Zeroable)]
/// #[bytemuck(crate = "cumem::bytemuck")]
/// #[repr(C)]
/// struct Particle {
///     pos: [f32; 3],
///     mass: f32,
/// }
///
/// let ctx = Device::get(0)?.context()?;
/// let stream = Stream::new(&ctx)?;
/// let particles = [Particle { pos: [1.0, 2.0, 3.0], mass: 4.0 }; 16];
/// let dev = DeviceBuffer::from_slice(&stream, &particles)?;
/// assert_eq!(dev.to_vec()?, particles);
/// # Ok::<(), cumem::Error>(())
/// ```
pub use bytemuck;

/// Typed transfers (feature `copy`).
#[cfg(feature = "copy")]
pub use cumem_copy as copy;

/// Memory resources: the caching pool, the driver's pools, adaptors and the memory-pressure monitor (feature `pool`).
#[cfg(feature = "pool")]
pub use cumem_pool as pool;

/// Unified (managed) memory: `UnifiedBuffer`, advice, prefetch, migration policies (feature `unified`).
#[cfg(feature = "unified")]
pub use cumem_unified as unified;

/// Host ↔ device message channels for persistent kernels (feature `channel`).
#[cfg(feature = "channel")]
pub use cumem_channel as channel;
/// Virtual memory: reservations, physical memory, mappings, `GrowableBuffer` (feature `vmm`).
#[cfg(feature = "vmm")]
pub use cumem_vmm as vmm;

/// Multi-GPU topology, peer access and peer copies (feature `peer`).
#[cfg(feature = "peer")]
pub use cumem_peer as peer;

/// Device memory and events shared with other processes (feature `ipc`).
#[cfg(feature = "ipc")]
pub use cumem_ipc as ipc;

/// Choosing and loading the driver: the real one, or the simulator (feature `sim`).
pub mod driver {
    pub use cumem_sys::driver::*;
    pub use cumem_sys::probe::{driver_version, has_symbol};

    /// Selects the bundled simulated driver for this process (before any other CUDA call).
    ///
    /// # Errors
    /// `DriverSelection` if another driver is in use already, including one that cudarc opened
    /// for another crate's CUDA call before this one; `DriverNotFound` if the simulator's library
    /// cannot be found (set `CUMEM_SIM_LIB` to its path).
    #[cfg(feature = "sim")]
    pub fn use_simulator() -> crate::Result<DriverKind> {
        select(DriverChoice::Simulator)
    }

    /// The simulator's control interface: live-resource report, violation log, fault injection.
    #[cfg(feature = "sim")]
    pub use cumem_sys::sim_control;

    /// Test-binary driver selection: the simulator by default, with the leak check at exit.
    #[cfg(feature = "sim")]
    pub use cumem_sys::testing;
}

/// The names most programs need.
pub mod prelude {
    pub use bytemuck::{AnyBitPattern, NoUninit, Pod, Zeroable};
    #[cfg(feature = "copy")]
    pub use cumem_copy::{Copy2D, Copy3D, PitchedBuffer, StreamCopy};
    pub use cumem_core::{
        AsDeviceSlice, AsDeviceSliceMut, Context, Device, DeviceBuffer, DeviceResource, DeviceSlice,
        DeviceSliceMut, Error, Event, HostRegistered, MappedBuffer, PinnedBuffer, PinnedFlags, Result,
        Stream, StreamOptions,
    };
    #[cfg(feature = "pool")]
    pub use cumem_pool::{CachingResource, MemPool, NativePoolResource, PoolConfig, StatisticsResource};
    #[cfg(feature = "pool")]
    pub use cumem_pool::{
        FailureCallbackResource, LimitingResource, LoggingResource, MemoryPressureMonitor, TrackingResource,
    };
    #[cfg(feature = "unified")]
    pub use cumem_unified::{MigrationPolicy, PrefetchPlan, UnifiedBuffer};
    #[cfg(feature = "vmm")]
    pub use cumem_vmm::GrowableBuffer;
}

// The pool guide's examples run as doctests, so they stay true.
#[cfg(all(doctest, feature = "pool"))]
#[doc = include_str!("../../../docs/pools.md")]
struct PoolGuideExamples;
