//! The live-resource report: what the simulator currently holds on behalf of the program.
//!
//! The loaded simulator serialises it as JSON (`cumemSimLiveReport`); the control client
//! deserialises it into these types. Pools, mappings and registrations are part of the schema but
//! stay empty until the simulator models them.

use serde::{Deserialize, Serialize};

/// A live allocation (device memory, pinned host memory, …).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveAllocation {
    /// `device` (cuMemAlloc) or `pinned_host` (cuMemAllocHost / cuMemHostAlloc).
    pub kind: String,
    /// The allocation's base address (device/UVA address).
    pub ptr: u64,
    /// Requested size in bytes.
    pub bytes: u64,
    /// Owning device ordinal.
    pub device: i32,
    /// Owning context handle.
    pub context: u64,
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

/// An active (retained) primary context. Retained contexts are not leaks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveContext {
    /// Device ordinal.
    pub device: i32,
    /// Current retain count.
    pub retain_count: u32,
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
    /// Memory pools (not modelled in v1; always empty).
    pub pools: Vec<serde_json::Value>,
    /// VMM mappings (not modelled in v1; always empty).
    pub mappings: Vec<serde_json::Value>,
    /// Host registrations (not modelled in v1; always empty).
    pub registrations: Vec<serde_json::Value>,
    /// Retained primary contexts.
    pub contexts: Vec<LiveContext>,
}

impl LiveReport {
    /// No live allocation, stream, event, pool, mapping or registration (contexts do not count).
    pub fn is_clean(&self) -> bool {
        self.allocations.is_empty()
            && self.streams.is_empty()
            && self.events.is_empty()
            && self.pools.is_empty()
            && self.mappings.is_empty()
            && self.registrations.is_empty()
    }

    /// Whether a live allocation starts at `ptr`.
    pub fn contains_ptr(&self, ptr: u64) -> bool {
        self.allocations.iter().any(|a| a.ptr == ptr)
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
            "{} allocation(s), {} stream(s), {} event(s), {} pool(s), {} mapping(s), {} registration(s)",
            self.allocations.len(),
            self.streams.len(),
            self.events.len(),
            self.pools.len(),
            self.mappings.len(),
            self.registrations.len()
        )?;
        for a in &self.allocations {
            writeln!(
                f,
                "  {} {:#x} ({} bytes) on device {} (context {:#x})",
                a.kind, a.ptr, a.bytes, a.device, a.context
            )?;
        }
        for s in &self.streams {
            writeln!(f, "  stream {:#x} on device {} ({} pending op(s))", s.handle, s.device, s.pending_ops)?;
        }
        for e in &self.events {
            writeln!(f, "  event {:#x} on device {}", e.handle, e.device)?;
        }
        for other in self.pools.iter().chain(&self.mappings).chain(&self.registrations) {
            writeln!(f, "  {other}")?;
        }
        for c in &self.contexts {
            writeln!(f, "  primary context of device {} (retain count {})", c.device, c.retain_count)?;
        }
        Ok(())
    }
}
