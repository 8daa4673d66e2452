//! Virtual memory management (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, …): the state and
//! the rules shared by its parts.
//!
//! A reservation is a range of a device's simulated VMM address space (never a host address): a
//! `PROT_NONE` range of its own, sized at `cuInit` ([`space_bytes`], or the `vmm_space` key) and made
//! at the device's first reservation, much larger than the device's memory (programs reserve
//! generously, as the GPU's address space allows), beside the range `cuMemAlloc` carves from. It has a private `PROT_NONE` host view of the same length,
//! device address `base + k` standing at view byte `k`. Physical memory is a
//! memory file, charged to its device's capacity at creation. Mapping it maps the file into the
//! view at the mapping's place, so adjacent mappings backed by different physical allocations
//! (in one reservation or in adjacent ones) are adjacent host bytes: a copy or memset spanning
//! them moves exactly the bytes it would on a GPU.
//! Each mapping is also an allocation of kind `Vmm` (the copy engine, pointer queries and
//! `cuMemGetAddressRange` find it like any device memory); the access each device has to it lives
//! here, and copies and memsets check it at the call, as observed on an H100 (§17 of the driver
//! reference).
//!
//! Physical memory dies when its last reference is released and its last mapping unmapped.

mod access;
mod mapping;
mod pending;
mod physical;
mod pointer;
mod reserve;
mod shareable;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::sys::CUresult;

pub(crate) use access::{check_span, get_access, set_access};
pub(crate) use mapping::{map, unmap};
pub(crate) use pending::reaches_unmapped;
pub(crate) use physical::{create, granularity, properties, release, retain};
pub(crate) use pointer::{address_range_found, attribute as pointer_attribute, unmapped_attribute};
pub(crate) use reserve::{address_free, address_reserve};
pub(crate) use shareable::{export_fd, import_fd};

use crate::abi::{AllocationProp, LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA, LOC_HOST_NUMA_CURRENT};
use crate::address_space::AddressSpace;
use crate::api::Fail;
use crate::memory::Backing;
use crate::report::{LiveMapping, LivePhysical, LiveReservation};
use crate::state::State;

/// The minimum and recommended granularity of pinned device memory, as observed on an H100.
pub(crate) const GRANULARITY: u64 = 2 << 20;

/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
const ATTR_VMM: u32 = crate::attributes::VMM;

/// The most address space one device's reservations get: 16 TiB.
const MAX_SPACE: u64 = 16 << 40;

/// Host addresses all VMM spaces may take together: 96 of x86-64's 128 TiB of user address space,
/// the rest left to everything else in the process (`cuMemAlloc`'s ranges, the heap, libraries).
const SPACE_BUDGET: u64 = 96 << 40;

/// The smallest space the simulator falls back to where the kernel refuses the planned one.
const MIN_SPACE: u64 = 64 << 30;

/// The address space each of `vmm_devices` devices gets for its reservations, decided at `cuInit`
/// for all of them at once: 16 TiB, or an equal share of the budget where that many devices would
/// pass it (each space costs twice its size in host addresses: the range and its host view).
///
/// A GPU process reserves from the host's whole user address space (47 bits, 128 TiB on x86-64,
/// shared by its devices), so programs that reserve generously, such as PyTorch's expandable
/// segments (the device's memory per stream and kind) or cumem-vmm's `GrowableBuffer` (twice the
/// device's memory), meet `OUT_OF_MEMORY` there only beyond tens of terabytes of reservations (an
/// inference from the address-space size, not a measurement); 1 TiB here refused them after a few
/// dozen reservations.
pub(crate) fn space_bytes(vmm_devices: usize) -> u64 {
    let share = SPACE_BUDGET / 2 / (vmm_devices.max(1) as u64);
    (share.min(MAX_SPACE) / GRANULARITY * GRANULARITY).max(GRANULARITY)
}

/// `CU_MEM_ACCESS_FLAGS_PROT_READ`.
pub(crate) const PROT_READ: u64 = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(crate) const PROT_READWRITE: u64 = 3;

/// Tag of physical allocation handles (process-local values, never reused).
const HANDLE_TAG: u64 = 0x0000_3d3d_0000_0000;

/// A `cuMemAddressReserve` range.
pub(crate) struct Reservation {
    pub(crate) size: u64,
    /// The device whose address space it was carved from.
    pub(crate) device: usize,
}

/// One device's VMM address space and its host view (`PROT_NONE` where nothing is mapped).
pub(crate) struct Space {
    pub(crate) va: AddressSpace,
    /// First device address of the space.
    pub(crate) base: u64,
    pub(crate) host: Arc<Backing>,
}

impl Space {
    /// A space of `len` bytes, or less (a quarter at a time, down to 64 GiB or `len` if smaller)
    /// where the kernel refuses that much address space (a `ulimit -v`, a host with fewer
    /// address bits): it costs twice its size in host addresses, the range and its host view.
    fn new(len: u64) -> Option<Self> {
        let mut len = len;
        loop {
            let made = AddressSpace::reserve(len).and_then(|va| {
                let host = Backing::reserved(usize::try_from(len).ok()?)?;
                Some(Space { base: va.range().0, va, host: Arc::new(host) })
            });
            if made.is_some() || len <= MIN_SPACE {
                return made;
            }
            len = (len / 4 / GRANULARITY * GRANULARITY).max(MIN_SPACE);
        }
    }
}

/// A `cuMemCreate` allocation.
pub(crate) struct Physical {
    pub(crate) size: u64,
    pub(crate) device: usize,
    /// The creation properties (`cuMemGetAllocationPropertiesFromHandle`).
    pub(crate) prop: AllocationProp,
    /// References not yet released; 0 once released while still mapped.
    pub(crate) refs: u32,
    pub(crate) mappings: u32,
    /// The memory file holding its bytes (and, after them, the creation properties: see
    /// `shareable`).
    pub(crate) file: OwnedFd,
    /// Charged to its device's capacity (false for an import: the exporter's device paid).
    pub(crate) charged: bool,
}

/// A `cuMemMap` binding.
pub(crate) struct Mapping {
    pub(crate) size: u64,
    pub(crate) handle: u64,
    pub(crate) offset: u64,
    /// Base of the reservation it lies in.
    pub(crate) reservation: u64,
    /// Access flags by device ordinal (absent: `PROT_NONE`).
    pub(crate) access: BTreeMap<usize, u64>,
}

/// Everything VMM behind the state lock.
pub(crate) struct Vmm {
    /// Keyed by base address.
    pub(crate) reservations: BTreeMap<u64, Reservation>,
    /// Keyed by handle.
    pub(crate) physical: BTreeMap<u64, Physical>,
    /// Keyed by base address.
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    /// VMM address spaces by device ordinal.
    pub(crate) spaces: BTreeMap<usize, Space>,
    /// The ranges, as `(address, length)`, that `cuMemUnmap` calls in progress are unmapping (waiting for the engine's batch in
    /// progress over them): work the engine takes meanwhile that touches one moves no bytes
    /// (`pending::reaches_unmapped`), so that the unmap waits for one batch at most.
    pub(crate) unmapping: Vec<(u64, u64)>,
    /// The size of each device's space, planned at `cuInit`; 0 once the kernel refused even the
    /// smallest (remembered: trying again would repeat the failing mappings, under the state lock,
    /// at every `cuMemAddressReserve`).
    planned: BTreeMap<usize, u64>,
    next_handle: u64,
}

impl Vmm {
    /// No VMM state.
    pub(crate) const fn new() -> Self {
        Self {
            reservations: BTreeMap::new(),
            physical: BTreeMap::new(),
            mappings: BTreeMap::new(),
            spaces: BTreeMap::new(),
            unmapping: Vec::new(),
            planned: BTreeMap::new(),
            next_handle: 0,
        }
    }

    /// A fresh, never reused physical allocation handle.
    fn new_handle(&mut self) -> u64 {
        self.next_handle += 1;
        HANDLE_TAG + (self.next_handle << 4)
    }

    /// Whether `addr` lies in a VMM address space (reserved or not).
    pub(crate) fn in_space(&self, addr: u64) -> bool {
        self.spaces.values().any(|s| s.va.contains(addr))
    }

    /// Records the size of device `d`'s space (at `cuInit`).
    pub(crate) fn plan(&mut self, d: usize, bytes: u64) {
        self.planned.insert(d, bytes);
    }

    /// Device `d`'s VMM address space, made on first use; `None` if the kernel refused it.
    pub(crate) fn space(&mut self, d: usize) -> Option<&mut Space> {
        match self.spaces.entry(d) {
            std::collections::btree_map::Entry::Occupied(e) => Some(e.into_mut()),
            std::collections::btree_map::Entry::Vacant(e) => {
                let planned = self.planned.get(&d).copied().unwrap_or(0);
                if planned == 0 {
                    return None;
                }
                let Some(space) = Space::new(planned) else {
                    self.planned.insert(d, 0);
                    return None;
                };
                Some(e.insert(space))
            }
        }
    }

    /// The reservation containing `addr`, as `(base, reservation)`.
    pub(crate) fn reservation_of(&self, addr: u64) -> Option<(u64, &Reservation)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(b, r)| addr - **b < r.size)
            .map(|(b, r)| (*b, r))
    }

    /// The mapping containing `addr`, as `(base, mapping)`.
    pub(crate) fn mapping_of(&self, addr: u64) -> Option<(u64, &Mapping)> {
        self.mappings.range(..=addr).next_back().filter(|(b, m)| addr - **b < m.size).map(|(b, m)| (*b, m))
    }

    /// The live reservations, for the live report.
    pub(crate) fn live_reservations(&self) -> Vec<LiveReservation> {
        self.reservations.iter().map(|(&ptr, r)| LiveReservation { ptr, bytes: r.size }).collect()
    }

    /// The live physical allocations, for the live report.
    pub(crate) fn live_physical(&self) -> Vec<LivePhysical> {
        self.physical
            .iter()
            .map(|(&handle, p)| LivePhysical {
                handle,
                bytes: p.size,
                device: p.device as i32,
                references: p.refs,
                mappings: p.mappings,
            })
            .collect()
    }

    /// The live mappings, for the live report.
    pub(crate) fn live_mappings(&self) -> Vec<LiveMapping> {
        self.mappings
            .iter()
            .map(|(&ptr, m)| LiveMapping { ptr, bytes: m.size, handle: m.handle, offset: m.offset })
            .collect()
    }
}

/// `INVALID_VALUE` with a message (every VMM misuse without a more specific code).
pub(crate) fn invalid(message: impl Into<String>) -> Fail {
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, message)
}

/// Refuses VMM on a device configured without it (`vmm=0`): the driver answers `NOT_SUPPORTED`
/// for VMM calls on a device whose VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0 (reference §9). A
/// quiet answer, like the other capability refusals: probing is not misuse.
pub(crate) fn require_vmm(st: &State, device: usize) -> Result<(), Fail> {
    if st.devices[device].attr(ATTR_VMM) == Some(1) {
        Ok(())
    } else {
        Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED))
    }
}

/// The device a `CUmemAllocationProp` describes, checked as `cuMemCreate` and
/// `cuMemGetAllocationGranularity` check it: type PINNED, location a device that exists (else
/// `INVALID_DEVICE`); host locations are refused (`INVALID_VALUE`; HOST_NUMA would need NUMA
/// host memory, which the simulated machine does not have).
pub(crate) fn prop_device(st: &State, prop: &AllocationProp) -> Result<usize, Fail> {
    const PINNED: u32 = 1;
    if prop.alloc_type != PINNED {
        return Err(invalid(format!(
            "CUmemAllocationProp.type {} is not CU_MEM_ALLOCATION_TYPE_PINNED",
            prop.alloc_type
        )));
    }
    match prop.location.kind {
        LOC_DEVICE => st.ordinal(prop.location.id),
        LOC_HOST | LOC_HOST_NUMA | LOC_HOST_NUMA_CURRENT => Err(invalid(format!(
            "CUmemAllocationProp.location type {} (host memory) is not supported here",
            prop.location.kind
        ))),
        other => Err(invalid(format!("CUmemAllocationProp.location type {other} is not a location"))),
    }
}
