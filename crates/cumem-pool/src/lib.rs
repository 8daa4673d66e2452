//! Memory resources for cumem: the algorithmic core of the caching pool, testable on the host.
//!
//! [`CachingPool`] keeps its own bookkeeping over device addresses it takes in segments from an
//! [`Upstream`] ([`DeviceUpstream`]: `cuMemAlloc` or any other
//! [`DeviceResource`](cumem_core::DeviceResource); the [`HostUpstream`] model in tests) and orders
//! reuse between streams through an [`Ordering`] ([`StreamOrdering`]: CUDA events and stream waits;
//! the [`HostOrdering`] model in tests). [`CachingResource`] is the pool over the device, as a
//! `DeviceResource`. It rounds requests to [size classes](size_class), serves repeated sizes
//! from per-stream [bins] in O(1), finds best fits with [splitting and coalescing](free_set) in
//! O(log n), moves free memory between streams only when needed and only after ordering them, and on
//! exhaustion releases its cache, synchronises and retries before reporting
//! [`PoolError::OutOfMemory`]. With [`PoolConfig::expandable_segments`] it instead grows
//! [expandable segments](expandable) (per stream and per kind, small and large: a virtual
//! reservation, more when one is full) by mapping chunks of physical memory, at the end or into
//! holes a trim unmapped ([`ExpandableUpstream`]: [`DeviceExpandable`] on a device,
//! [`HostUpstream`] in tests).
//!
//! Adaptors wrap any [`DeviceResource`](cumem_core::DeviceResource) and stack in any order:
//! [`StatisticsResource`], [`LimitingResource`], [`TrackingResource`], [`LoggingResource`] (RMM's
//! CSV, see [`trace_format`]) and [`FailureCallbackResource`]; a [`MemoryPressureMonitor`] watches a
//! device and a pool. The caching pool's slow paths open `debug` spans: `allocate_slow` (fields
//! `device`, `stream`, the pool's stream name through `Debug`, and `bytes`), `grow` (`device`,
//! `bytes`, `kind`), `oom_ladder` (`device`, `bytes`) and `trim` (`device`, `keep`); a
//! [`MemoryPressureMonitor`]'s trims open `pressure_trim` (`device`, `pool`). Each allocation and
//! free of a [`CachingResource`] is a `trace` event with `device`, `stream` (the stream's id, a
//! `u64`), `bytes` and `ptr`.
//!
//! Each thread keeps a small cache of recently freed blocks per pool ([`caching_thread_cache`]),
//! which is why [`Ordering::Stream`] is `'static` (a thread-local list holds each pool's cache,
//! whatever its stream type); [`PoolConfig::thread_cache`] turns the caches off.
//!
//! [`CachingPool::deallocate`] is `unsafe`: the stream it names is all that orders the block's
//! later users after its work (see its `# Safety`). [`CachingResource`] makes that call for
//! device buffers; a block of the host model, with no memory behind it, needs no more argument
//! than this example's.
//!
//! ```
//! use cumem_pool::{CachingPool, HostOrdering, HostUpstream, PoolConfig};
//!
//! let pool = CachingPool::new(HostUpstream::new(1 << 30), HostOrdering::new(), PoolConfig::default());
//! let block = pool.allocate(3000, 256, 0).unwrap();
//! assert_eq!((block.size(), block.rounded_size()), (3000, 3072));
//! // SAFETY: a block of the host model: no memory behind it, no work uses it.
//! unsafe { pool.deallocate(block, 0) }.unwrap();
//! let stats = pool.stats();
//! assert_eq!((stats.current_bytes, stats.peak_bytes, stats.reserved_bytes), (0, 3072, 2 << 20));
//! pool.trim().unwrap();
//! assert_eq!(pool.upstream().live_bytes(), 0);
//! ```

pub mod arena;
pub mod bins;
pub mod block;
pub mod caching;
mod caching_fence;
pub mod caching_resource;
pub mod caching_thread_cache;
pub mod config;
pub mod default_resource;
pub mod device_expandable;
pub mod device_upstream;
pub mod error;
pub mod expandable;
pub mod failure_callback_resource;
mod ffi;
pub mod free_set;
pub mod limiting_resource;
pub mod logging_resource;
pub mod memory_pressure;
pub mod native;
pub mod native_resource;
pub mod replay;
pub mod segment;
pub mod size_class;
pub mod statistics_resource;
pub mod stats;
pub mod stream_ordering;
pub mod table;
pub mod trace_format;
pub mod tracking_resource;
pub mod upstream;

pub use block::Block;
pub use caching::{CachingPool, STREAM_ARENAS, TrimReport};
pub use caching_resource::CachingResource;
pub use config::{Growth, PoolConfig};
pub use default_resource::{current_caching, trim_current};
pub use device_expandable::DeviceExpandable;
pub use device_upstream::DeviceUpstream;
pub use error::{ForeignBlock, PoolError, UpstreamError};
pub use failure_callback_resource::{AllocationFailure, FailureCallbackResource};
pub use limiting_resource::LimitingResource;
pub use logging_resource::LoggingResource;
pub use memory_pressure::{MemoryPressureMonitor, MonitorHandle, Pressure, PressureEvent, TrimmablePool};
pub use native::{MemPool, MemPoolOptions, PoolUsage, ReusePolicy};
pub use native_resource::NativePoolResource;
pub use statistics_resource::{HISTOGRAM_BUCKETS, ScopeCounters, StatisticsResource};
pub use stats::{Histogram, PoolStats};
pub use stream_ordering::{StreamKey, StreamOrdering};
pub use tracking_resource::{LeakReport, LiveAllocation, TrackingResource};
pub use upstream::{ExpandableUpstream, HostOrdering, HostUpstream, Ordering, Upstream};

/// Alignment every upstream segment address must have (and the minimum alignment of every block).
pub const SEGMENT_ALIGN: usize = size_class::QUANTUM;
/// The largest alignment [`CachingPool::allocate`] accepts.
pub const MAX_ALIGN: usize = 2 << 20;
