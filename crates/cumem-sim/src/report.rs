//! The live-resource report: what the simulator currently holds on behalf of the program.
//!
//! The loaded simulator serialises it as JSON (`cumemSimLiveReport`); the control client
//! deserialises it into these types.

use serde::{Deserialize, Serialize};

/// A live allocation (device memory, pinned host memory, …).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveAllocation {
    /// `device` (cuMemAlloc), `pitched` (cuMemAllocPitch), `pool` (cuMemAllocAsync /
    /// cuMemAllocFromPoolAsync), `managed` (cuMemAllocManaged), `pinned_host`
    /// (cuMemAllocHost / cuMemHostAlloc), `ipc_import` (cuIpcOpenMemHandle) or `pool_import`
    /// (cuMemPoolImportPointer).
    pub kind: String,
    /// The simulator's number for this allocation (what `CU_POINTER_ATTRIBUTE_BUFFER_ID`
    /// reports), unique among all allocations of every kind the process ever made. Addresses are
    /// not: a freed allocation's address is soon handed out again (managed and pinned host memory
    /// come from the host's allocator), so "this allocation was freed" is a question about its
    /// id, not its address. `0` in reports written before ids were listed, for which
    /// [`LiveReport::id_of`] answers `None`.
    #[serde(default)]
    pub id: u64,
    /// The allocation's base address (device/UVA address).
    pub ptr: u64,
    /// Requested size in bytes.
    pub bytes: u64,
    /// Owning device ordinal.
    pub device: i32,
    /// Owning context handle.
    pub context: u64,
    /// The pool of a `pool` allocation (for `pool_import`: the imported pool it came through).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<u64>,
    /// The `CU_MEM_ATTACH_*` flags in effect for a `managed` allocation: a
    /// `cuStreamAttachMemAsync` counts once it has run in its stream's order, not when called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attach: Option<u32>,
    /// The stream of the attachment in effect for a managed allocation (its internal id; equal
    /// to the `CUstream` handle for user streams); `None` before any attachment has taken effect
    /// and once that stream is destroyed and its work has drained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attach_stream: Option<u64>,
}

/// A memory pool. User-created pools are leaks until destroyed; default pools are listed (with
/// `default: true`) but never count as leaks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivePool {
    /// The `CUmemoryPool` handle value.
    pub handle: u64,
    /// Owning device ordinal.
    pub device: i32,
    /// Reserved (backing) bytes: RESERVED_MEM_CURRENT.
    pub reserved: u64,
    /// Bytes in live allocations (rounded to 512): USED_MEM_CURRENT.
    pub used: u64,
    /// The device's default pool.
    pub default: bool,
    /// Imported from another process (`cuMemPoolImportFromShareableHandle`): a leak until
    /// destroyed, like a created pool.
    #[serde(default)]
    pub imported: bool,
}

/// A live host registration (`cuMemHostRegister`); a leak until unregistered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveRegistration {
    /// The registered host address (as passed to `cuMemHostRegister`).
    pub ptr: u64,
    /// Registered length in bytes.
    pub bytes: u64,
    /// The `CU_MEMHOSTREGISTER_*` flags it was registered with.
    pub flags: u32,
    /// Device ordinal of the context that registered it.
    pub device: i32,
    /// That context's handle.
    pub context: u64,
}

/// A live VMM reservation (`cuMemAddressReserve`); a leak until `cuMemAddressFree`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveReservation {
    /// First reserved device address.
    pub ptr: u64,
    /// Reserved bytes.
    pub bytes: u64,
}

/// Live VMM physical memory (`cuMemCreate`): a leak while it holds a reference or a mapping.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivePhysical {
    /// The `CUmemGenericAllocationHandle` value.
    pub handle: u64,
    /// Size in bytes (charged to the device's capacity).
    pub bytes: u64,
    /// Owning device ordinal.
    pub device: i32,
    /// References not yet released (`cuMemCreate`, each `cuMemRetainAllocationHandle`).
    pub references: u32,
    /// Live mappings of it.
    pub mappings: u32,
}

/// A live VMM mapping (`cuMemMap`); a leak until `cuMemUnmap`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveMapping {
    /// First mapped device address.
    pub ptr: u64,
    /// Mapped bytes.
    pub bytes: u64,
    /// The physical allocation's handle.
    pub handle: u64,
    /// Offset into the physical allocation.
    pub offset: u64,
}

/// Enabled peer access (`cuCtxEnablePeerAccess`): `context` may reach `peer_context`'s memory.
/// Listed, but not a leak for [`LiveReport::is_clean`]: enabled access is state of the two
/// contexts, which the driver drops with either of them, and a program (or cumem, for a pair it
/// adopted from outside, see `cumem-peer`) may leave it enabled for good. A test that expects
/// every pair it enabled to be disabled again checks this list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivePeerAccess {
    /// The accessing context's handle (current when access was enabled).
    pub context: u64,
    /// Its device ordinal.
    pub device: i32,
    /// The peer context's handle.
    pub peer_context: u64,
    /// The peer context's device ordinal.
    pub peer_device: i32,
}

/// A live (created, not destroyed) stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveStream {
    /// The `CUstream` handle value.
    pub handle: u64,
    /// Device ordinal of the stream's context.
    pub device: i32,
    /// Operations enqueued but not yet completed.
    pub pending_ops: u64,
}

/// A live (created, not destroyed) event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveEvent {
    /// The `CUevent` handle value.
    pub handle: u64,
    /// Device ordinal of the event's context.
    pub device: i32,
}

/// A context: an active (retained) primary context, which is not a leak, or a context made by
/// `cuCtxCreate` and not destroyed yet, which is. A destroyed context is not listed, and neither
/// is anything it owned: destroying a context frees its allocations, streams and events, as the
/// driver does, so they are no longer live (and not leaks).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveContext {
    /// Device ordinal.
    pub device: i32,
    /// Current retain count (1 for a created context).
    pub retain_count: u32,
    /// The `CUcontext` handle value.
    #[serde(default)]
    pub handle: u64,
    /// A device's primary context (`false`: made by `cuCtxCreate`).
    #[serde(default = "primary_by_default")]
    pub primary: bool,
}

/// Reports written before created contexts existed list primary contexts only.
fn primary_by_default() -> bool {
    true
}

/// Everything the simulator holds for the program right now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveReport {
    /// Live allocations.
    pub allocations: Vec<LiveAllocation>,
    /// Live streams.
    pub streams: Vec<LiveStream>,
    /// Live events.
    pub events: Vec<LiveEvent>,
    /// Memory pools (default pools included, flagged).
    pub pools: Vec<LivePool>,
    /// VMM mappings.
    pub mappings: Vec<LiveMapping>,
    /// VMM reservations.
    #[serde(default)]
    pub reservations: Vec<LiveReservation>,
    /// VMM physical allocations.
    #[serde(default)]
    pub physical: Vec<LivePhysical>,
    /// Host registrations.
    pub registrations: Vec<LiveRegistration>,
    /// Retained primary contexts (with their retain counts) and live created contexts.
    pub contexts: Vec<LiveContext>,
    /// Enabled peer-access pairs (not leaks: see [`LivePeerAccess`]).
    #[serde(default)]
    pub peer_access: Vec<LivePeerAccess>,
}

impl LiveReport {
    /// No live allocation, stream, event, user-created pool, VMM reservation, physical allocation
    /// or mapping, registration or created context (primary contexts and default pools do not
    /// count).
    pub fn is_clean(&self) -> bool {
        self.created_contexts().next().is_none()
            && self.allocations.is_empty()
            && self.streams.is_empty()
            && self.events.is_empty()
            && self.user_pools().next().is_none()
            && self.mappings.is_empty()
            && self.reservations.is_empty()
            && self.physical.is_empty()
            && self.registrations.is_empty()
    }

    /// The contexts made by `cuCtxCreate` and not destroyed yet.
    pub fn created_contexts(&self) -> impl Iterator<Item = &LiveContext> {
        self.contexts.iter().filter(|c| !c.primary)
    }

    /// The user-created (non-default) pools.
    pub fn user_pools(&self) -> impl Iterator<Item = &LivePool> {
        self.pools.iter().filter(|p| !p.default)
    }

    /// Whether a live pool has this handle value.
    pub fn contains_pool(&self, handle: u64) -> bool {
        self.pools.iter().any(|p| p.handle == handle)
    }

    /// Whether a live registration starts at `ptr`.
    pub fn contains_registration(&self, ptr: u64) -> bool {
        self.registrations.iter().any(|r| r.ptr == ptr)
    }

    /// Whether a live allocation starts at `ptr`.
    ///
    /// Any allocation: after a free, another (from another thread, or a later call) may start at
    /// the same address, so to check that one allocation was freed take its id while it is live
    /// ([`allocation_at`](Self::allocation_at)) and ask
    /// [`contains_allocation`](Self::contains_allocation).
    pub fn contains_ptr(&self, ptr: u64) -> bool {
        self.allocations.iter().any(|a| a.ptr == ptr)
    }

    /// The live allocation that starts at `ptr`, if any; its [`id`](LiveAllocation::id)
    /// identifies it after its address has been reused.
    pub fn allocation_at(&self, ptr: u64) -> Option<&LiveAllocation> {
        self.allocations.iter().find(|a| a.ptr == ptr)
    }

    /// The live allocation whose bytes include `ptr` (for an address inside an allocation, such
    /// as an aligned pointer into a larger block), if any.
    pub fn allocation_containing(&self, ptr: u64) -> Option<&LiveAllocation> {
        self.allocations.iter().find(|a| a.ptr <= ptr && ptr - a.ptr < a.bytes.max(1))
    }

    /// The id of the live allocation that starts at `ptr`, if any (see
    /// [`allocation_at`](Self::allocation_at)). `None` too when the allocation has no id (`0`, a
    /// report written before ids were listed): [`contains_allocation`](Self::contains_allocation)
    /// is `false` for `0`, so a "freed" check by that id would pass whether or not it was freed.
    pub fn id_of(&self, ptr: u64) -> Option<u64> {
        self.allocation_at(ptr).map(|a| a.id).filter(|&id| id != 0)
    }

    /// Whether the allocation numbered `id` (a [`LiveAllocation::id`] from an earlier report) is
    /// still live. Unlike [`contains_ptr`](Self::contains_ptr) this stays `false` once it is
    /// freed, whatever is allocated at its address afterwards.
    pub fn contains_allocation(&self, id: u64) -> bool {
        id != 0 && self.allocations.iter().any(|a| a.id == id)
    }

    /// Whether a live stream has this handle value.
    pub fn contains_stream(&self, handle: u64) -> bool {
        self.streams.iter().any(|s| s.handle == handle)
    }

    /// Whether a live event has this handle value.
    pub fn contains_event(&self, handle: u64) -> bool {
        self.events.iter().any(|e| e.handle == handle)
    }
}

impl std::fmt::Display for LiveReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} allocation(s), {} stream(s), {} event(s), {} user pool(s), {} reservation(s), \
             {} physical allocation(s), {} mapping(s), {} registration(s), {} created context(s)",
            self.allocations.len(),
            self.streams.len(),
            self.events.len(),
            self.user_pools().count(),
            self.reservations.len(),
            self.physical.len(),
            self.mappings.len(),
            self.registrations.len(),
            self.created_contexts().count()
        )?;
        for a in &self.allocations {
            write!(
                f,
                "  {} #{} {:#x} ({} bytes) on device {} (context {:#x})",
                a.kind, a.id, a.ptr, a.bytes, a.device, a.context
            )?;
            match a.pool {
                Some(p) => writeln!(f, " from pool {p:#x}")?,
                None => writeln!(f)?,
            }
        }
        for s in &self.streams {
            writeln!(f, "  stream {:#x} on device {} ({} pending op(s))", s.handle, s.device, s.pending_ops)?;
        }
        for e in &self.events {
            writeln!(f, "  event {:#x} on device {}", e.handle, e.device)?;
        }
        for p in self.user_pools() {
            writeln!(
                f,
                "  pool {:#x} on device {} ({} bytes reserved, {} used){}",
                p.handle,
                p.device,
                p.reserved,
                p.used,
                if p.imported { ", imported from another process" } else { "" }
            )?;
        }
        for r in &self.registrations {
            writeln!(
                f,
                "  registration {:#x} ({} bytes, flags {:#x}) on device {}",
                r.ptr, r.bytes, r.flags, r.device
            )?;
        }
        for r in &self.reservations {
            writeln!(f, "  reservation {:#x} ({} bytes)", r.ptr, r.bytes)?;
        }
        for p in &self.physical {
            writeln!(
                f,
                "  physical allocation {:#x} ({} bytes) on device {} ({} reference(s), {} mapping(s))",
                p.handle, p.bytes, p.device, p.references, p.mappings
            )?;
        }
        for m in &self.mappings {
            writeln!(
                f,
                "  mapping {:#x} ({} bytes) of handle {:#x} at offset {}",
                m.ptr, m.bytes, m.handle, m.offset
            )?;
        }
        for p in &self.peer_access {
            writeln!(
                f,
                "  peer access enabled from context {:#x} (device {}) to context {:#x} (device {})",
                p.context, p.device, p.peer_context, p.peer_device
            )?;
        }
        for c in &self.contexts {
            if c.primary {
                writeln!(f, "  primary context of device {} (retain count {})", c.device, c.retain_count)?;
            } else {
                writeln!(f, "  created context {:#x} of device {} (not destroyed)", c.handle, c.device)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report written before allocations carried ids still parses; its allocations are found by
    /// address, and no id names them.
    #[test]
    fn a_report_without_ids_parses_and_names_no_allocation_by_id() {
        let json = r#"{"allocations":[{"kind":"managed","ptr":4096,"bytes":64,"device":0,"context":1}],
            "streams":[],"events":[],"pools":[],"mappings":[],"registrations":[],"contexts":[]}"#;
        let r: LiveReport = serde_json::from_str(json).unwrap();
        assert_eq!(r.allocation_at(4096).map(|a| a.id), Some(0));
        // No id to check "freed" by: `contains_allocation(0)` would say freed while it is live.
        assert_eq!(r.id_of(4096), None);
        assert!(r.contains_ptr(4096) && !r.contains_allocation(0));
        assert_eq!(r.allocation_containing(4096 + 63).map(|a| a.ptr), Some(4096));
        assert!(r.allocation_containing(4096 + 64).is_none());
    }
}
