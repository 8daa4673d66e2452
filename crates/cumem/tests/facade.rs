//! A program that depends only on `cumem` reaches the whole API through it (issue 7, item 9).
//!
//! Every item the sub-crates re-export at their roots is imported below (as of its last edit: an
//! item added later is not listed until someone adds it), and every name is spelled through
//! `cumem::` (never `cumem_core::`, `cumem_copy::`, … nor `bytemuck::`), so this file stops
//! compiling when a listed item stops being reachable from the facade; the tests use each of the kinds that were once unreachable (mapped and registered host
//! memory, the host-access tracker, the out-of-memory report, the maximum alignment, the ticket of
//! `use_on`, deriving `Pod`) and check what they do.

#![allow(unused_imports)] // the import list is the compile test; not every name is used below

use std::sync::Arc;

// Every item each sub-crate re-exports at its root, through the facade (the default features'
// crates; `ipc`'s under its feature).
use cumem::channel::{
    C_HEADER, CONTROL_LINE, CONTROL_OFFSETS, CacheLineAligned, CacheLineAligned128, ChannelError,
    ChannelStats, ControlBlock, DEFAULT_POLL_INTERVAL, DeviceSide, Direction, FLAG_CLOSED,
    FLAG_DEVICE_TO_HOST, MemoryVisibility, Platform, Poll, RING_ARGS_OFFSETS, Refusal, RingArgs, RingChannel,
    SendStatus, Slot, SlotPool, SlotPoolStats, StrategyKind, TransferStrategy, VisibilityReport,
};
use cumem::copy::{
    Copy2D, Copy3D, CopyDst, CopyKind, CopySrc, MAX_FILL_THREADS, Observing, PITCHED_ROW_ALIGNMENT, Pitched,
    PitchedBuffer, ProfileReport, Profiler, QueuedDst, QueuedSrc, Rect2D, SizeClass, StagingConfig,
    StagingRing, StagingStats, StreamCopy, Totals, copy_2d, copy_3d, copy_d2d, copy_d2h, copy_h2d,
};
use cumem::driver::{DriverChoice, DriverKind, driver_version, has_symbol};
#[cfg(feature = "ipc")]
use cumem::ipc::{
    ImportedBuffer, ImportedPool, IpcEvent, IpcEventHandle, IpcMemHandle, PoolPointerExport, ShareablePool,
};
use cumem::peer::{
    Link, PeerAccess, PeerCopy, PeerPath, PeerStreamCopy, PeerStreamCopy3D, Topology, copy_peer,
};
use cumem::pool::{
    AllocationFailure, Block, CachingPool, CachingResource, DeviceExpandable, DeviceUpstream,
    ExpandableUpstream, FailureCallbackResource, ForeignBlock, Growth, HISTOGRAM_BUCKETS, Histogram,
    HostOrdering, HostUpstream, LeakReport, LimitingResource, LiveAllocation, LoggingResource, MAX_ALIGN,
    MemPool, MemPoolOptions, MemoryPressureMonitor, MonitorHandle, NativePoolResource, Ordering, PoolConfig,
    PoolError, PoolStats, PoolUsage, Pressure, PressureEvent, ReusePolicy, SEGMENT_ALIGN, STREAM_ARENAS,
    ScopeCounters, StatisticsResource, StreamKey, StreamOrdering, TrackingResource, TrimReport,
    TrimmablePool, Upstream, UpstreamError, current_caching, replay, trim_current,
};
use cumem::prelude::*;
use cumem::unified::{
    Advice, Attach, Location, MigrationPolicy, PrefetchPlan, RangeAttributes, UnifiedBuffer,
};
use cumem::vmm::{
    Access, Granularity, GrowableBuffer, GrowableConfig, HandleTypes, Mapping, MappingIn, PhysicalMemory,
    RangeHolder, ReserveOptions, SharedMapping, VirtualRange,
};
use cumem::{
    ALLOCATOR_ENV, AllocatorKind, CurrentResourceGuard, DefaultResourceFactory, IntoDynResource,
    current_resource, default_allocator, install_default_factory, reset_current_resources,
    scoped_current_resource, set_current_resource,
};
use cumem::{
    AllocLayout, AsDeviceSlice, AsDeviceSliceMut, CacheUsage, Capabilities, Chunks, ChunksMut, Context,
    DRIVER_ALIGNMENT, Device, DeviceBuffer, DeviceResource, DeviceSlice, DeviceSliceMut, DriverResource,
    Error, ErrorContext, Event, Feature, HostAccess, HostMemory, HostRegistered, MAX_ALIGNMENT, MappedBuffer,
    MemInfo, MemoryReport, OrderTicket, PinnedBuffer, PinnedFlags, RegisterFlags, Result, Stream,
    StreamOptions, StreamOrder, resolve_range, sys,
};

#[derive(Clone, Copy, Debug, PartialEq, cumem::bytemuck::Pod, cumem::bytemuck::Zeroable)]
#[bytemuck(crate = "cumem::bytemuck")]
#[repr(C)]
struct Sample {
    at: u32,
    value: f32,
}

fn ctx() -> Context {
    // Test setup only: the simulator as the driver (the facade's `sim` feature is off here).
    cumem_sys::testing::init();
    Device::get(0).unwrap().context().unwrap()
}

/// Sums through the `HostMemory` trait, whatever the host kind.
fn len_of<T>(memory: &impl HostMemory<T>) -> usize {
    memory.len()
}

#[test]
fn host_kinds_and_pod_types_round_trip_through_the_facade() {
    let ctx = ctx();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let samples: Vec<Sample> = (0..256).map(|i| Sample { at: i, value: i as f32 * 0.5 }).collect();

    // A user-derived Pod type, device memory aligned to the largest alignment cumem serves.
    let mut dev = DeviceBuffer::<Sample>::zeroed_aligned(&stream, samples.len(), MAX_ALIGNMENT).unwrap();
    assert_eq!(dev.device_ptr() % MAX_ALIGNMENT as u64, 0);

    // Mapped memory: zero-copy host memory with a device address.
    let mapped: MappedBuffer<Sample> = MappedBuffer::from_slice(&ctx, &samples).unwrap();
    assert_eq!(len_of(&mapped), samples.len());
    stream.copy_h2d(&mapped, &mut dev).unwrap();

    // Registered memory: an existing Vec, page-locked for a scope.
    let mut back = vec![Sample { at: 0, value: 0.0 }; samples.len()];
    HostRegistered::scope_with_flags(&ctx, &mut back, RegisterFlags::default(), |registered| {
        assert_eq!(len_of(registered), samples.len());
        stream.copy_d2h(&dev, registered)
    })
    .unwrap();
    assert_eq!(back, samples);
    assert!(ctx.mem_info().unwrap().total > 0);
}

#[test]
fn the_ticket_of_use_on_orders_a_stream_after_the_memory_s_users() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut dev = DeviceBuffer::<u32>::zeroed(&a, 1 << 16).unwrap();
    a.fill(&mut dev, 7u32).unwrap();
    // External work on `b` (a kernel, say) is queued while the ticket is held.
    let order: &StreamOrder = dev.order();
    let ticket: OrderTicket<'_> = order.use_on(&b).unwrap();
    drop(ticket);
    assert_eq!(dev.to_vec().unwrap(), vec![7; 1 << 16]);

    // A fresh tracker has nothing pending.
    let access = HostAccess::new();
    assert!(access.is_idle());
}

#[test]
fn an_exhausted_pool_reports_through_the_facade_s_error_type() {
    let ctx = ctx();
    let stream = Stream::new(&ctx).unwrap();
    let total = ctx.mem_info().unwrap().total;
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let resource = pool.clone();
    let too_big = total + (64 << 20);
    match DeviceBuffer::<u8>::new_in(&resource, &stream, too_big) {
        Err(Error::OutOfMemory { report: Some(report), .. }) => {
            let report: MemoryReport = report;
            assert_eq!(report.requested, too_big as u64);
            assert_eq!(report.allocated, 0);
        }
        other => panic!("expected OutOfMemory with a report, got {other:?}"),
    }
    assert_eq!(pool.stats().current_bytes, 0);
}
