//! The simulator's global state: the device table, allocations, streams and events, behind one
//! lock, plus the condition variable every completion is announced on.
//!
//! One lock keeps the model simple and makes every state transition atomic; the stream engine
//! releases it while it moves bytes, so long copies do not stall API calls.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::address_space::AddressSpace;
use crate::config::{Config, DeviceSpec};
use crate::context::{Created, Limits};
use crate::event::Event;
use crate::managed::Managed;
use crate::memory::{AllocKind, Allocation, Freed};
use crate::pool::Pool;
use crate::report::{
    LiveAllocation, LiveContext, LiveEvent, LivePeerAccess, LivePool, LiveRegistration, LiveReport,
    LiveStream,
};
use crate::stream::{Stream, StreamKind};

/// The primary context of one device.
#[derive(Debug, Default)]
pub(crate) struct PrimaryCtx {
    pub(crate) retain: u32,
    pub(crate) flags: u32,
    pub(crate) active: bool,
}

/// One simulated device.
pub(crate) struct Device {
    pub(crate) name: String,
    pub(crate) total: u64,
    pub(crate) used: u64,
    pub(crate) attrs: Vec<Option<i32>>,
    pub(crate) va: AddressSpace,
    pub(crate) ctx: PrimaryCtx,
    /// Handle of the device's default memory pool (undeletable).
    pub(crate) default_pool: u64,
    /// Handle of the device's current memory pool (`cuDeviceSetMemPool`).
    pub(crate) current_pool: u64,
    /// OS threads waiting in an implicitly synchronising call on this device: while any is, other
    /// threads' calls that queue work or allocate here wait (see `crate::hold`).
    pub(crate) held_by: Vec<u64>,
    /// Threads waiting to queue onto a full stream of this device: while any is, some calls of
    /// other threads in that stream's context wait (see `crate::hold::wait_room`).
    pub(crate) full_by: Vec<crate::hold::FullWaiter>,
}

impl Device {
    /// An attribute value (`None` for numbers the bindings do not define).
    pub(crate) fn attr(&self, n: u32) -> Option<i32> {
        self.attrs.get(n as usize).copied().flatten()
    }
}

/// One operation of the engine's batch.
pub(crate) struct InFlight {
    /// Its stream.
    pub(crate) sid: u64,
    /// Its enqueueing call.
    pub(crate) api: &'static str,
    /// Its byte spans.
    pub(crate) spans: Vec<(u64, u64)>,
    /// Whether its bytes move: false for work that reaches unmapped (or unmapping) VMM memory,
    /// decided as the batch is taken (`crate::vmm::reaches_unmapped`).
    pub(crate) moves: bool,
}

/// Everything behind the lock.
pub(crate) struct State {
    pub(crate) devices: Vec<Device>,
    pub(crate) peer: Vec<Vec<bool>>,
    /// Keyed by base (device/UVA) address.
    pub(crate) allocs: BTreeMap<u64, Arc<Allocation>>,
    /// User streams, the legacy stream of every device, per-thread default streams.
    pub(crate) streams: BTreeMap<u64, Stream>,
    pub(crate) events: BTreeMap<u64, Event>,
    /// Managed-memory state (attachment, advice, prefetch) keyed by allocation base.
    pub(crate) managed: BTreeMap<u64, Managed>,
    /// Memory pools (default pools included), keyed by handle.
    pub(crate) pools: BTreeMap<u64, Pool>,
    /// (context, thread key) -> hidden stream standing for `CU_STREAM_PER_THREAD` (the key is
    /// unique to one thread, see `crate::stream::thread_key`; its entries go when it exits).
    pub(crate) per_thread: BTreeMap<(u64, u64), u64>,
    /// Contexts made by `cuCtxCreate`, destroyed ones included (their handles are never reused,
    /// so a stale handle keeps its "destroyed" answer).
    pub(crate) contexts: BTreeMap<u64, Created>,
    /// `cuCtxSetLimit` values by context (absent: the defaults).
    pub(crate) limits: BTreeMap<u64, Limits>,
    /// Virtual memory management: reservations, physical allocations, mappings.
    pub(crate) vmm: crate::vmm::Vmm,
    /// Enabled peer access, as (accessing context, peer context) pairs (`cuCtxEnablePeerAccess`).
    pub(crate) peer_access: std::collections::BTreeSet<(u64, u64)>,
    /// Allocations imported from other processes (`cuIpcOpenMemHandle`).
    pub(crate) ipc: crate::ipc::Imports,
    /// The engine's current batch (see `engine::take_batch`): each operation's stream, enqueueing
    /// call and byte spans. Off their queues while their bytes move with the lock released, they
    /// must still be found by the checks for work queued over memory about to change
    /// (`vmm::pending`).
    pub(crate) in_flight: Vec<InFlight>,
    pub(crate) next_handle: u64,
    pub(crate) next_seq: u64,
    pub(crate) next_buffer_id: u64,
    /// Pool allocations whose stream order the host has not yet observed (`crate::order`).
    pub(crate) pool_order: crate::order::Pending,
    /// Streams removed while something may still ask what other streams waited for of them
    /// (`crate::stream::remove_drained`).
    pub(crate) retired: BTreeMap<u64, crate::stream::Retired>,
}

/// The process-wide simulator.
pub(crate) struct Sim {
    pub(crate) st: Mutex<State>,
    /// Notified on every enqueue and every completion.
    pub(crate) changed: Condvar,
    pub(crate) initialized: AtomicBool,
    pub(crate) latency_us: AtomicU64,
    pub(crate) leak_check: AtomicBool,
    /// `schedule=reversed` is in force (see `crate::config::Schedule`).
    pub(crate) reversed: AtomicBool,
    /// Pre-init `cumemSimConfigure` specifications, applied after `CUMEM_SIM` at `cuInit`;
    /// after `cuInit`, the merged configuration.
    pub(crate) config: Mutex<ConfigSlot>,
}

/// Configuration storage before and after `cuInit`.
pub(crate) enum ConfigSlot {
    /// Specifications given before `cuInit`, in order.
    Pending(Vec<String>),
    /// The configuration in force.
    Active(Box<Config>),
}

/// The one simulator instance of this copy of the library.
pub(crate) static SIM: Sim = Sim {
    st: Mutex::new(State::empty()),
    changed: Condvar::new(),
    initialized: AtomicBool::new(false),
    latency_us: AtomicU64::new(200),
    leak_check: AtomicBool::new(false),
    reversed: AtomicBool::new(false),
    config: Mutex::new(ConfigSlot::Pending(Vec::new())),
};

const CTX_TAG: u64 = 0x0000_c7c7_0000_0000;
const CREATED_CTX_TAG: u64 = 0x0000_c8c8_0000_0000;
const LEGACY_TAG: u64 = 0x0000_5c5c_0000_0000;
const STREAM_TAG: u64 = 0x0000_5a5a_0000_0000;
const EVENT_TAG: u64 = 0x0000_e7e7_0000_0000;
const POOL_TAG: u64 = 0x0000_9b9b_0000_0000;

/// The (stable) handle of a device's primary context.
pub(crate) fn ctx_handle(ordinal: usize) -> u64 {
    CTX_TAG + ((ordinal as u64 + 1) << 8)
}

/// The internal id of a device's legacy default stream.
pub(crate) fn legacy_id(ordinal: usize) -> u64 {
    LEGACY_TAG + ((ordinal as u64 + 1) << 8)
}

/// Whether `initialized` was set by a successful `cuInit`.
pub(crate) fn is_initialized() -> bool {
    SIM.initialized.load(Ordering::Acquire)
}

/// The current per-op latency.
pub(crate) fn latency_us() -> u64 {
    SIM.latency_us.load(Ordering::Relaxed)
}

impl State {
    /// No devices, streams or anything else: the state before `cuInit`.
    pub(crate) const fn empty() -> State {
        State {
            devices: Vec::new(),
            peer: Vec::new(),
            allocs: BTreeMap::new(),
            streams: BTreeMap::new(),
            events: BTreeMap::new(),
            pools: BTreeMap::new(),
            managed: BTreeMap::new(),
            per_thread: BTreeMap::new(),
            contexts: BTreeMap::new(),
            limits: BTreeMap::new(),
            vmm: crate::vmm::Vmm::new(),
            peer_access: std::collections::BTreeSet::new(),
            ipc: crate::ipc::Imports { by_base: BTreeMap::new() },
            in_flight: Vec::new(),
            next_handle: 1,
            next_seq: 0,
            next_buffer_id: 1,
            pool_order: BTreeMap::new(),
            retired: BTreeMap::new(),
        }
    }

    /// The ordinal a `CUdevice` names, or `INVALID_DEVICE`.
    pub(crate) fn ordinal(&self, dev: i32) -> Result<usize, crate::api::Fail> {
        usize::try_from(dev).ok().filter(|&d| d < self.devices.len()).ok_or_else(|| {
            crate::api::Fail::misuse(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_DEVICE,
                format!("device {dev} does not exist ({} devices)", self.devices.len()),
            )
        })
    }

    /// The device a context handle names: a primary context, or a created context that has not
    /// been destroyed.
    pub(crate) fn ctx_device(&self, handle: u64) -> Option<usize> {
        match self.contexts.get(&handle) {
            Some(c) => (!c.destroyed).then_some(c.device),
            None => self.primary_device(handle),
        }
    }

    /// The device whose primary context `handle` is.
    pub(crate) fn primary_device(&self, handle: u64) -> Option<usize> {
        (0..self.devices.len()).find(|&d| ctx_handle(d) == handle)
    }

    /// The internal id of the legacy (NULL) stream of context `ctx` on `device`.
    pub(crate) fn legacy_stream(&self, ctx: u64, device: usize) -> u64 {
        self.contexts.get(&ctx).map_or(legacy_id(device), |c| c.legacy)
    }

    /// A fresh, never reused handle for a created context.
    pub(crate) fn new_ctx_handle(&mut self) -> u64 {
        self.next_handle += 1;
        CREATED_CTX_TAG + (self.next_handle << 4)
    }

    /// A fresh, never reused stream handle.
    pub(crate) fn new_stream_handle(&mut self) -> u64 {
        self.next_handle += 1;
        STREAM_TAG + (self.next_handle << 4)
    }

    /// A fresh, never reused event handle.
    pub(crate) fn new_event_handle(&mut self) -> u64 {
        self.next_handle += 1;
        EVENT_TAG + (self.next_handle << 4)
    }

    /// A fresh, never reused memory pool handle.
    pub(crate) fn new_pool_handle(&mut self) -> u64 {
        self.next_handle += 1;
        POOL_TAG + (self.next_handle << 4)
    }

    /// The allocation containing `addr`, if any.
    pub(crate) fn find_alloc(&self, addr: u64) -> Option<&Arc<Allocation>> {
        self.allocs.range(..=addr).next_back().map(|(_, a)| a).filter(|a| a.contains(addr))
    }

    /// Undoes the bookkeeping of an allocation just removed from `allocs`: device capacity and
    /// address space, or the pool block (`tag`: the stream-ordered free releasing it). Without a
    /// tag the free takes effect now (marked on the allocation, for queued work still naming it);
    /// with one it takes effect when the engine reaches the free (`Work::Free`).
    pub(crate) fn forget(&mut self, a: &Allocation, tag: Option<(u64, u64)>) {
        if tag.is_none() {
            a.mark_freed(Freed::AtCall { api: crate::api::caller().0 });
        }
        crate::sync_memops::forget(a.buffer_id);
        match a.kind {
            // An import is charged nothing (`charged` is 0).
            AllocKind::PoolImport => {
                self.devices[a.device as usize].va.release(a.base);
                // A stream-ordered free ends the import when it executes (`Work::Free`).
                if tag.is_none() {
                    crate::pool::shared::forget_import(self, a);
                }
            }
            AllocKind::Device | AllocKind::Pitched | AllocKind::IpcImport => {
                let dev = &mut self.devices[a.device as usize];
                dev.used -= a.charged;
                dev.va.release(a.base);
            }
            AllocKind::Pool => {
                crate::order::forget(self, a.buffer_id);
                crate::pool::release_block(self, a, tag)
            }
            AllocKind::Managed => {
                self.managed.remove(&a.base);
            }
            // A mapping's bookkeeping is `crate::vmm`'s (cuMemUnmap).
            AllocKind::PinnedHost | AllocKind::Registered | AllocKind::Vmm => {}
        }
    }

    /// Whether `addr` lies in a simulator-reserved device address range (live or not).
    pub(crate) fn in_device_space(&self, addr: u64) -> bool {
        self.devices.iter().any(|d| d.va.contains(addr)) || self.vmm.in_space(addr)
    }

    /// Builds the device table at `cuInit`; an error string if address space cannot be reserved.
    pub(crate) fn install(&mut self, specs: Vec<DeviceSpec>, peer: Vec<Vec<bool>>) -> Result<(), String> {
        let mut devices = Vec::with_capacity(specs.len());
        for (d, spec) in specs.into_iter().enumerate() {
            self.vmm.plan(d, spec.vmm_space);
            // Room for fragmentation and guard gaps, without committing anything.
            let span = spec.memory.saturating_mul(4).max(64 << 30).next_multiple_of(1 << 30);
            let va = AddressSpace::reserve(span).ok_or("cannot reserve device address space")?;
            devices.push(Device {
                name: spec.name,
                total: spec.memory,
                used: 0,
                attrs: spec.attrs,
                va,
                ctx: PrimaryCtx::default(),
                default_pool: 0,
                current_pool: 0,
                held_by: Vec::new(),
                full_by: Vec::new(),
            });
        }
        for d in 0..devices.len() {
            self.streams.insert(legacy_id(d), Stream::new(d, ctx_handle(d), StreamKind::Legacy, 0, 0));
        }
        self.devices = devices;
        for d in 0..self.devices.len() {
            let h = self.new_pool_handle();
            self.pools.insert(h, Pool::new(d, true, 0));
            self.devices[d].default_pool = h;
            self.devices[d].current_pool = h;
        }
        self.peer = peer;
        Ok(())
    }

    /// What the program currently holds.
    pub(crate) fn live_report(&self) -> LiveReport {
        LiveReport {
            allocations: self
                .allocs
                .values()
                .filter(|a| !matches!(a.kind, AllocKind::Registered | AllocKind::Vmm))
                .map(|a| LiveAllocation {
                    kind: a.kind.report_name().to_string(),
                    id: a.buffer_id,
                    ptr: a.base,
                    bytes: a.bytes,
                    device: a.device,
                    context: a.ctx,
                    pool: matches!(a.kind, AllocKind::Pool | AllocKind::PoolImport).then_some(a.pool),
                    attach: self
                        .managed
                        .get(&a.base)
                        .filter(|_| a.kind == AllocKind::Managed)
                        .map(|m| m.attach),
                    attach_stream: self
                        .managed
                        .get(&a.base)
                        .filter(|m| a.kind == AllocKind::Managed && m.stream != 0)
                        .map(|m| m.stream),
                })
                .collect(),
            streams: self
                .streams
                .iter()
                .filter(|(_, s)| s.kind == StreamKind::User && !s.destroyed)
                .map(|(&h, s)| LiveStream { handle: h, device: s.device as i32, pending_ops: s.pending() })
                .collect(),
            events: self
                .events
                .iter()
                .map(|(&h, e)| LiveEvent { handle: h, device: e.device as i32 })
                .collect(),
            pools: self
                .pools
                .iter()
                .filter(|(_, p)| !p.destroyed)
                .map(|(&h, p)| LivePool {
                    handle: h,
                    device: p.device as i32,
                    reserved: p.reserved,
                    used: p.used,
                    default: p.is_default,
                    imported: p.shared.as_ref().is_some_and(|s| s.imported),
                })
                .collect(),
            mappings: self.vmm.live_mappings(),
            reservations: self.vmm.live_reservations(),
            physical: self.vmm.live_physical(),
            registrations: self
                .allocs
                .values()
                .filter(|a| a.kind == AllocKind::Registered)
                .map(|a| LiveRegistration {
                    ptr: a.base,
                    bytes: a.bytes,
                    flags: a.host_flags,
                    device: a.device,
                    context: a.ctx,
                })
                .collect(),
            contexts: self
                .devices
                .iter()
                .enumerate()
                .filter(|(_, d)| d.ctx.retain > 0)
                .map(|(i, d)| LiveContext {
                    device: i as i32,
                    retain_count: d.ctx.retain,
                    handle: ctx_handle(i),
                    primary: true,
                })
                .chain(self.contexts.iter().filter(|(_, c)| !c.destroyed).map(|(&h, c)| LiveContext {
                    device: c.device as i32,
                    retain_count: 1,
                    handle: h,
                    primary: false,
                }))
                .collect(),
            peer_access: self
                .peer_access
                .iter()
                .map(|&(context, peer_context)| LivePeerAccess {
                    context,
                    device: self.ctx_device(context).map_or(-1, |d| d as i32),
                    peer_context,
                    peer_device: self.ctx_device(peer_context).map_or(-1, |d| d as i32),
                })
                .collect(),
        }
    }
}
