//! Errors of the caching pool and of the resources it draws from.
//!
//! Every failure of [`CachingPool`](crate::CachingPool) is a [`PoolError`]; bad input (zero size, an
//! alignment that is not a power of two, a size whose rounding overflows) is reported before any
//! bookkeeping changes. An out-of-memory error carries a report a user can read:
//!
//! ```
//! use cumem_pool::PoolError;
//!
//! let e = PoolError::OutOfMemory {
//!     requested: 3 << 20,
//!     allocated: 1 << 30,
//!     reserved: 1 << 30,
//!     free_cached: 0,
//!     largest_free_block: 0,
//! };
//! assert_eq!(
//!     e.to_string(),
//!     "out of memory: requested 3.00 MiB; 1.00 GiB allocated, 1.00 GiB reserved, \
//!      0 B cached (largest free block 0 B)"
//! );
//! ```

use std::fmt;

use crate::Block;

/// Failure reported by an [`Upstream`](crate::Upstream) or an [`Ordering`](crate::Ordering).
///
/// The device implementations ([`DeviceUpstream`](crate::DeviceUpstream),
/// [`StreamOrdering`](crate::StreamOrdering)) report the driver's own error inside
/// [`Driver`](Self::Driver), so it reaches the caller unchanged; the host models use the other
/// variants. Two driver errors are equal when they read the same.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// The upstream resource has no memory left for the request.
    #[error("upstream out of memory")]
    OutOfMemory,
    /// Any other failure, with the resource's own code (e.g. a `CUresult`).
    #[error("upstream error (code {0})")]
    Other(i32),
    /// A failure of the CUDA driver, as cumem reported it.
    #[error("{0}")]
    Driver(#[source] cumem_core::Error),
}

impl UpstreamError {
    /// Whether this is exhaustion ([`OutOfMemory`](Self::OutOfMemory), or the driver's
    /// out-of-memory error), which the pool answers with its out-of-memory ladder.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            UpstreamError::OutOfMemory | UpstreamError::Driver(cumem_core::Error::OutOfMemory { .. })
        )
    }

    /// The driver's error inside, if this is one.
    pub fn driver_error(&self) -> Option<&cumem_core::Error> {
        match self {
            UpstreamError::Driver(e) => Some(e),
            _ => None,
        }
    }
}

impl From<cumem_core::Error> for UpstreamError {
    fn from(e: cumem_core::Error) -> Self {
        UpstreamError::Driver(e)
    }
}

impl PartialEq for UpstreamError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (UpstreamError::OutOfMemory, UpstreamError::OutOfMemory) => true,
            (UpstreamError::Other(a), UpstreamError::Other(b)) => a == b,
            // `cumem_core::Error` has no `PartialEq` (it carries context); the same code and the
            // same message is the same error for every purpose a comparison serves.
            (UpstreamError::Driver(a), UpstreamError::Driver(b)) => {
                a.code() == b.code() && a.to_string() == b.to_string()
            }
            _ => false,
        }
    }
}

impl Eq for UpstreamError {}

/// Failure of a [`CachingPool`](crate::CachingPool) operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// A zero-byte allocation was requested.
    #[error("zero-size allocation requested")]
    ZeroSize,
    /// Rounding the request to its size class (plus alignment padding) overflows.
    #[error("allocation of {requested} bytes overflows when rounded to its size class")]
    SizeOverflow {
        /// The requested size in bytes.
        requested: usize,
    },
    /// The alignment is zero or not a power of two.
    #[error("alignment {align} is not a power of two")]
    InvalidAlignment {
        /// The requested alignment.
        align: usize,
    },
    /// The alignment is a power of two larger than the pool supports.
    #[error("alignment {align} exceeds the maximum supported alignment {max}")]
    AlignmentTooLarge {
        /// The requested alignment.
        align: usize,
        /// The largest supported alignment ([`MAX_ALIGN`](crate::MAX_ALIGN)).
        max: usize,
    },
    /// The upstream is out of memory even after the pool released its cache and synchronised.
    ///
    /// The report's figures are read after the ladder let go of the pool's locks, one at a time:
    /// under concurrent use they describe nearby moments, not one, and need not add up.
    #[error(
        "out of memory: requested {}; {} allocated, {} reserved, {} cached (largest free block {})",
        Bytes(*requested as u64), Bytes(*allocated), Bytes(*reserved), Bytes(*free_cached),
        Bytes(*largest_free_block)
    )]
    OutOfMemory {
        /// Bytes requested by the failing call.
        requested: usize,
        /// Bytes currently handed out to users (size-class rounded).
        allocated: u64,
        /// Bytes currently held from the upstream.
        reserved: u64,
        /// Reserved bytes not handed out (cached in the pool).
        free_cached: u64,
        /// The largest contiguous cached block.
        largest_free_block: u64,
    },
    /// [Expandable segments](crate::expandable): no segment of the stream has room for the block
    /// and the upstream refused another reservation of address space (the driver's
    /// `cuMemAddressReserve` ran out of virtual addresses), even after the out-of-memory ladder
    /// released every reservation it could. Physical memory may well be left: reserving less per
    /// segment ([`PoolConfig::expandable_reservation_bytes`](crate::PoolConfig::expandable_reservation_bytes))
    /// leaves room for more reservations.
    #[error(
        "out of address space: requested {}; no expandable segment has room and a new reservation of {} \
         was refused ({segments} segments reserve {} of address space, {} mapped); set \
         PoolConfig::expandable_reservation_bytes to reserve less per segment",
        Bytes(*requested as u64), Bytes(*reservation_bytes), Bytes(*reserved_address_space), Bytes(*mapped)
    )]
    AddressSpaceExhausted {
        /// Bytes requested by the failing call.
        requested: usize,
        /// Bytes of address space the refused reservation asked for.
        reservation_bytes: u64,
        /// Expandable segments (reservations) the pool holds.
        segments: u64,
        /// Bytes of address space they reserve in all.
        reserved_address_space: u64,
        /// Bytes mapped in them.
        mapped: u64,
    },
    /// The upstream failed for a reason other than running out of memory.
    #[error("upstream allocation failed: {0}")]
    Upstream(#[source] UpstreamError),
    /// Establishing stream order (event record/wait or synchronise) failed.
    #[error("stream ordering operation failed: {0}")]
    Ordering(#[source] UpstreamError),
    /// [`CachingPool::allocate`](crate::CachingPool::allocate) was asked for memory on the
    /// ordering's [retired name](crate::Ordering::retired_stream), which names no stream: memory
    /// cached under it may still be in use by work of retired streams, which only a wait on that
    /// name orders a stream after.
    #[error("allocation on the retired streams' name, which names no stream")]
    RetiredStream,
    /// The upstream returned an address that is not aligned to [`SEGMENT_ALIGN`](crate::SEGMENT_ALIGN).
    #[error("upstream returned misaligned segment address {addr:#x}")]
    MisalignedSegment {
        /// The address returned by the upstream (already given back to it).
        addr: u64,
    },
}

/// A block given to [`CachingPool::deallocate`](crate::CachingPool::deallocate) of a pool that did not
/// allocate it. The block is handed back untouched so it can be returned to its own pool.
#[derive(Debug, thiserror::Error)]
#[error("block at {:#x} does not belong to this pool", .0.addr())]
pub struct ForeignBlock(pub Block);

/// Formats a byte count with a binary unit (`1.50 MiB`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut v = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        write!(f, "{v:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_format() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.50 KiB");
        assert_eq!(Bytes(5 << 30).to_string(), "5.00 GiB");
    }
}
