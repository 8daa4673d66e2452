//! The one error type of cumem: every CUDA error by name, with the operation that failed.
//!
//! Driver codes that a memory library meets map to their own variant (`OutOfMemory`,
//! `InvalidValue`, …); every other code is kept exactly in [`Error::Cuda`] (its number too, where
//! cudarc's bindings have no name for it). cumem's own failures
//! (bad input, missing driver, missing capability) have variants of their own, so callers match on
//! what went wrong rather than parse messages.

use std::fmt;

use crate::api::Code;
use crate::sys::CUresult;

/// Shorthand for `Result<T, cumem_sys::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where an error happened: the operation, and when known the bytes and device involved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorContext {
    /// The driver call or cumem operation, e.g. `"cuMemAlloc_v2"`.
    pub op: &'static str,
    /// Bytes the operation was asked to allocate or move.
    pub bytes: Option<usize>,
    /// Device ordinal the operation ran on.
    pub device: Option<i32>,
}

impl ErrorContext {
    /// A context naming only the operation.
    pub const fn op(op: &'static str) -> Self {
        Self { op, bytes: None, device: None }
    }

    /// Adds the byte count.
    pub const fn bytes(mut self, bytes: usize) -> Self {
        self.bytes = Some(bytes);
        self
    }

    /// Adds the device ordinal.
    pub const fn device(mut self, device: i32) -> Self {
        self.device = Some(device);
        self
    }
}

impl fmt::Display for ErrorContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.op.is_empty() {
            return Ok(());
        }
        write!(f, " in {}", self.op)?;
        match (self.bytes, self.device) {
            (Some(b), Some(d)) => write!(f, " ({b} bytes, device {d})"),
            (Some(b), None) => write!(f, " ({b} bytes)"),
            (None, Some(d)) => write!(f, " (device {d})"),
            (None, None) => Ok(()),
        }
    }
}

/// What a pool held when it ran out of memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryReport {
    /// The request that failed.
    pub requested: u64,
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes the pool holds from its upstream.
    pub reserved: u64,
    /// Reserved bytes not in use (cached for reuse).
    pub cached: u64,
    /// The largest cached free block.
    pub largest_free_block: u64,
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "; the pool could not find {} bytes: {} allocated, {} reserved, {} cached (largest free block {})",
            self.requested, self.allocated, self.reserved, self.cached, self.largest_free_block
        )
    }
}

/// A capability or entry point that a device or driver may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Feature {
    /// `cuMemAllocManaged` (device attribute MANAGED_MEMORY).
    ManagedMemory,
    /// GPU page faulting on managed memory (CONCURRENT_MANAGED_ACCESS).
    ConcurrentManagedAccess,
    /// Stream-ordered allocation and memory pools (MEMORY_POOLS_SUPPORTED).
    MemoryPools,
    /// The virtual memory management API (VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED).
    VirtualMemory,
    /// Mapping page-locked host memory into the device address space (CAN_MAP_HOST_MEMORY).
    HostMapping,
    /// Page-locking existing host memory (HOST_REGISTER_SUPPORTED).
    HostRegister,
    /// Direct access between two devices.
    PeerAccess,
    /// A driver entry point that the loaded driver does not export.
    Symbol(&'static str),
    /// The driver itself answered `CUDA_ERROR_NOT_SUPPORTED` to this operation.
    Driver(&'static str),
    /// An allocation alignment (in bytes) above the largest one cumem serves.
    Alignment(usize),
    /// Exporting memory as a shareable handle of this type (device attributes
    /// `HANDLE_TYPE_*_SUPPORTED`).
    ShareableHandle(&'static str),
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Feature::ManagedMemory => f.write_str("managed memory"),
            Feature::ConcurrentManagedAccess => f.write_str("concurrent managed access"),
            Feature::MemoryPools => f.write_str("memory pools"),
            Feature::VirtualMemory => f.write_str("virtual memory management"),
            Feature::HostMapping => f.write_str("host memory mapping"),
            Feature::HostRegister => f.write_str("host memory registration"),
            Feature::PeerAccess => f.write_str("peer access"),
            Feature::Symbol(name) => write!(f, "driver entry point {name}"),
            Feature::Driver(op) => write!(f, "{op} (refused by the driver)"),
            Feature::Alignment(align) => write!(f, "an alignment of {align} bytes"),
            Feature::ShareableHandle(name) => write!(f, "exporting memory as {name}"),
        }
    }
}

/// Everything that can go wrong in cumem.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `CUDA_ERROR_INVALID_VALUE`: an argument the driver rejected.
    #[error("invalid value{ctx}")]
    InvalidValue {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_OUT_OF_MEMORY`, or a cumem pool that could not satisfy a request (with its report).
    #[error("out of memory{ctx}{}", report.map(|r| r.to_string()).unwrap_or_default())]
    OutOfMemory {
        /// Where it happened.
        ctx: ErrorContext,
        /// What the pool held when it gave up, when a pool raised the error.
        report: Option<MemoryReport>,
    },
    /// `CUDA_ERROR_NOT_INITIALIZED`: a call before `cuInit`.
    #[error("driver not initialized{ctx}")]
    NotInitialized {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down.
    #[error("driver deinitialized{ctx}")]
    Deinitialized {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_NO_DEVICE`: the driver sees no device.
    #[error("no CUDA device{ctx}")]
    NoDevice {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_INVALID_DEVICE`: a device ordinal out of range, or the wrong device.
    #[error("invalid device{ctx}")]
    InvalidDevice {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_INVALID_CONTEXT`: no current context, or a bad one.
    #[error("invalid context{ctx}")]
    InvalidContext {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
    #[error("context is destroyed{ctx}")]
    ContextIsDestroyed {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_INVALID_HANDLE`: a bad stream, event or other handle.
    #[error("invalid handle{ctx}")]
    InvalidHandle {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_NOT_FOUND`.
    #[error("not found{ctx}")]
    NotFound {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_NOT_READY` where readiness was required.
    #[error("not ready{ctx}")]
    NotReady {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: a device fault (sticky: the context is unusable).
    #[error("illegal address{ctx}")]
    IllegalAddress {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_ALREADY_MAPPED`.
    #[error("already mapped{ctx}")]
    AlreadyMapped {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_NOT_MAPPED`.
    #[error("not mapped{ctx}")]
    NotMapped {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
    #[error("peer access unsupported{ctx}")]
    PeerAccessUnsupported {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
    #[error("peer access already enabled{ctx}")]
    PeerAccessAlreadyEnabled {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`.
    #[error("peer access not enabled{ctx}")]
    PeerAccessNotEnabled {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`: the range overlaps a registered one.
    #[error("host memory already registered{ctx}")]
    HostMemoryAlreadyRegistered {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
    #[error("host memory not registered{ctx}")]
    HostMemoryNotRegistered {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// `CUDA_ERROR_NOT_PERMITTED`.
    #[error("not permitted{ctx}")]
    NotPermitted {
        /// Where it happened.
        ctx: ErrorContext,
    },
    /// Any other driver code, kept exactly: `raw` is the number the driver returned, `code` its
    /// name in cudarc's bindings (CUDA 12.8). A code newer than the bindings, as a newer driver
    /// may return, has no name there: `code` is then `CUDA_ERROR_UNKNOWN`, and `raw` still the
    /// driver's number (shown as "CUDA error 36 (unknown to these bindings)").
    #[error("CUDA error {}{ctx}", code_text(*code, *raw))]
    Cuda {
        /// The driver's code as the bindings name it (`CUDA_ERROR_UNKNOWN` for one they lack).
        code: CUresult,
        /// The driver's code as it returned it.
        raw: i32,
        /// Where it happened.
        ctx: ErrorContext,
    },

    /// No CUDA driver library could be loaded.
    #[error("no CUDA driver found (looked for {searched})")]
    DriverNotFound {
        /// The library names or paths that were tried.
        searched: String,
    },
    /// The driver was already chosen differently, or the chosen library does not act as one.
    #[error("driver selection failed: {reason}")]
    DriverSelection {
        /// Why.
        reason: String,
    },
    /// The device or driver lacks a capability (checked before any driver call where possible).
    #[error("{feature} is not supported{}", device.map(|d| format!(" on device {d}")).unwrap_or_default())]
    NotSupported {
        /// What is missing.
        feature: Feature,
        /// The device that lacks it, when it is a device capability.
        device: Option<i32>,
    },
    /// `count * size_of::<T>()` (or another size computation) overflowed.
    #[error("size overflow: {count} elements of {elem_size} bytes")]
    SizeOverflow {
        /// Element count requested.
        count: usize,
        /// Size of one element in bytes.
        elem_size: usize,
    },
    /// A range outside a buffer.
    #[error("range {start}..{end} out of range for length {len}")]
    OutOfRange {
        /// Start of the requested range.
        start: usize,
        /// End (exclusive) of the requested range.
        end: usize,
        /// Length of the buffer.
        len: usize,
    },
    /// Source and destination lengths differ.
    #[error("length mismatch: destination has {expected} elements, source has {actual}")]
    LengthMismatch {
        /// Length required.
        expected: usize,
        /// Length given.
        actual: usize,
    },
    /// A size of zero where zero is meaningless (a chunk size, an alignment, a raw allocation).
    #[error("zero {what}")]
    ZeroSize {
        /// What was zero.
        what: &'static str,
    },
    /// An address, size or alignment that is not a multiple of what is required.
    #[error("misaligned {what}: {value:#x} is not a multiple of {align}")]
    Misaligned {
        /// What was misaligned.
        what: &'static str,
        /// The offending value.
        value: u64,
        /// The required alignment.
        align: u64,
    },
    /// A fixed limit of cumem's (such as the number of streams a pool serves) was reached.
    #[error("limit reached: at most {limit} {what}")]
    LimitExceeded {
        /// What is limited.
        what: &'static str,
        /// The limit.
        limit: usize,
    },
    /// Memory or a stream of one device used with another.
    #[error("wrong device: expected device {expected}, got device {actual}")]
    WrongDevice {
        /// The device required.
        expected: i32,
        /// The device given.
        actual: i32,
    },
}

impl Error {
    /// Maps a driver code to its error; `None` for `CUDA_SUCCESS`.
    pub fn from_code(code: CUresult, ctx: ErrorContext) -> Option<Self> {
        use CUresult as C;
        Some(match code {
            C::CUDA_SUCCESS => return None,
            C::CUDA_ERROR_INVALID_VALUE => Error::InvalidValue { ctx },
            C::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { ctx, report: None },
            C::CUDA_ERROR_NOT_INITIALIZED => Error::NotInitialized { ctx },
            C::CUDA_ERROR_DEINITIALIZED => Error::Deinitialized { ctx },
            C::CUDA_ERROR_NO_DEVICE => Error::NoDevice { ctx },
            C::CUDA_ERROR_INVALID_DEVICE => Error::InvalidDevice { ctx },
            C::CUDA_ERROR_INVALID_CONTEXT => Error::InvalidContext { ctx },
            C::CUDA_ERROR_CONTEXT_IS_DESTROYED => Error::ContextIsDestroyed { ctx },
            C::CUDA_ERROR_INVALID_HANDLE => Error::InvalidHandle { ctx },
            C::CUDA_ERROR_NOT_FOUND => Error::NotFound { ctx },
            C::CUDA_ERROR_NOT_READY => Error::NotReady { ctx },
            C::CUDA_ERROR_ILLEGAL_ADDRESS => Error::IllegalAddress { ctx },
            C::CUDA_ERROR_ALREADY_MAPPED => Error::AlreadyMapped { ctx },
            C::CUDA_ERROR_NOT_MAPPED => Error::NotMapped { ctx },
            C::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Error::PeerAccessUnsupported { ctx },
            C::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Error::PeerAccessAlreadyEnabled { ctx },
            C::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => Error::PeerAccessNotEnabled { ctx },
            C::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => Error::HostMemoryAlreadyRegistered { ctx },
            C::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => Error::HostMemoryNotRegistered { ctx },
            C::CUDA_ERROR_NOT_PERMITTED => Error::NotPermitted { ctx },
            C::CUDA_ERROR_NOT_SUPPORTED => {
                Error::NotSupported { feature: Feature::Driver(ctx.op), device: ctx.device }
            }
            other => Error::Cuda { code: other, raw: other as i32, ctx },
        })
    }

    /// The driver code this error stands for: as [`Error::code`], but for [`Error::Cuda`] the
    /// driver's own number even where the bindings have no name for it. (An error cumem raised
    /// itself without asking the driver, such as `PeerAccessUnsupported` for one device, names the
    /// code the driver answers in that case.)
    pub fn raw_code(&self) -> Option<i32> {
        match self {
            Error::Cuda { raw, .. } => Some(*raw),
            other => other.code().map(|c| c as i32),
        }
    }

    /// The driver code this error stands for: the code the driver returned, or, for a refusal of
    /// cumem's own that carries a driver-named variant, the code that variant names (for example
    /// `InvalidValue` for an argument cumem checks before calling the driver, a 2D/3D copy with
    /// no device side among them, `NotReady` for a staging ring whose failed copy may still use
    /// its chunks, `OutOfMemory` for an allocation that returned no memory). So `Some`
    /// does not prove that the driver returned the code.
    /// `None` for cumem's own variants (`DriverNotFound`, `SizeOverflow`, `OutOfRange`, …) and for
    /// `NotSupported` of anything but a driver refusal.
    pub fn code(&self) -> Option<CUresult> {
        use CUresult as C;
        Some(match self {
            Error::InvalidValue { .. } => C::CUDA_ERROR_INVALID_VALUE,
            Error::OutOfMemory { .. } => C::CUDA_ERROR_OUT_OF_MEMORY,
            Error::NotInitialized { .. } => C::CUDA_ERROR_NOT_INITIALIZED,
            Error::Deinitialized { .. } => C::CUDA_ERROR_DEINITIALIZED,
            Error::NoDevice { .. } => C::CUDA_ERROR_NO_DEVICE,
            Error::InvalidDevice { .. } => C::CUDA_ERROR_INVALID_DEVICE,
            Error::InvalidContext { .. } => C::CUDA_ERROR_INVALID_CONTEXT,
            Error::ContextIsDestroyed { .. } => C::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            Error::InvalidHandle { .. } => C::CUDA_ERROR_INVALID_HANDLE,
            Error::NotFound { .. } => C::CUDA_ERROR_NOT_FOUND,
            Error::NotReady { .. } => C::CUDA_ERROR_NOT_READY,
            Error::IllegalAddress { .. } => C::CUDA_ERROR_ILLEGAL_ADDRESS,
            Error::AlreadyMapped { .. } => C::CUDA_ERROR_ALREADY_MAPPED,
            Error::NotMapped { .. } => C::CUDA_ERROR_NOT_MAPPED,
            Error::PeerAccessUnsupported { .. } => C::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            Error::PeerAccessAlreadyEnabled { .. } => C::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            Error::PeerAccessNotEnabled { .. } => C::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
            Error::HostMemoryAlreadyRegistered { .. } => C::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            Error::HostMemoryNotRegistered { .. } => C::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
            Error::NotPermitted { .. } => C::CUDA_ERROR_NOT_PERMITTED,
            Error::NotSupported { feature: Feature::Driver(_), .. } => C::CUDA_ERROR_NOT_SUPPORTED,
            Error::Cuda { code, .. } => *code,
            _ => return None,
        })
    }
}

/// Turns a driver return code into a `Result`, attaching where it happened.
///
/// `CUDA_SUCCESS` is `Ok(())`; everything else is the matching [`Error`]. Takes the [`Code`] of
/// cumem's own entry points ([`crate::api`]) or a `CUresult` of cudarc's bindings. A code that
/// `CUresult` (cudarc's CUDA 12.8 enum) has no variant for, as a newer driver may return, is
/// [`Error::Cuda`] with `code: CUDA_ERROR_UNKNOWN` and the driver's number in `raw`;
/// [`Code::MISSING_ENTRY_POINT`] is `NotSupported { feature: Symbol(op) }`.
#[inline]
pub fn check(code: impl Into<Code>, ctx: ErrorContext) -> Result<()> {
    let code = code.into();
    // Success answered inline: every driver call of a hot path goes through here.
    if code.is_success() {
        return Ok(());
    }
    Err(Error::from_raw(code, ctx))
}

impl Error {
    /// The error for a failed `code` (cold: only failures get here).
    #[cold]
    fn from_raw(code: Code, ctx: ErrorContext) -> Error {
        if code == Code::MISSING_ENTRY_POINT {
            // The operation's name, less what some callers add after it: `cuPointerGetAttribute(IS_MANAGED)`.
            let symbol = ctx.op.split(['(', ' ']).next().unwrap_or(ctx.op);
            return Error::NotSupported { feature: Feature::Symbol(symbol), device: ctx.device };
        }
        let unknown = Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, raw: code.0, ctx };
        match code.known() {
            // `None` only for success, which `check` answered; kept total all the same.
            Some(known) => Error::from_code(known, ctx).unwrap_or(unknown),
            None => unknown,
        }
    }
}

/// How [`Error::Cuda`] shows its code: the bindings' name, or the driver's number where they
/// have none.
fn code_text(code: CUresult, raw: i32) -> String {
    if code as i32 == raw { format!("{code:?}") } else { format!("{raw} (unknown to these bindings)") }
}

/// The `CUresult` whose value is `raw`, if cudarc's enum has one.
pub(crate) fn code_from_raw(raw: i32) -> Option<CUresult> {
    KNOWN_CODES.iter().copied().find(|&c| c as i32 == raw)
}

use CUresult as C;
/// Every variant of cudarc's `CUresult` for the `cuda-12080` bindings, copied from them. A variant
/// missing here reads as `CUDA_ERROR_UNKNOWN`, never as an invalid value.
#[rustfmt::skip]
const KNOWN_CODES: [CUresult; 100] = [
    C::CUDA_SUCCESS, C::CUDA_ERROR_INVALID_VALUE, C::CUDA_ERROR_OUT_OF_MEMORY, C::CUDA_ERROR_NOT_INITIALIZED,
    C::CUDA_ERROR_DEINITIALIZED, C::CUDA_ERROR_PROFILER_DISABLED, C::CUDA_ERROR_PROFILER_NOT_INITIALIZED,
    C::CUDA_ERROR_PROFILER_ALREADY_STARTED, C::CUDA_ERROR_PROFILER_ALREADY_STOPPED,
    C::CUDA_ERROR_STUB_LIBRARY, C::CUDA_ERROR_DEVICE_UNAVAILABLE, C::CUDA_ERROR_NO_DEVICE,
    C::CUDA_ERROR_INVALID_DEVICE, C::CUDA_ERROR_DEVICE_NOT_LICENSED, C::CUDA_ERROR_INVALID_IMAGE,
    C::CUDA_ERROR_INVALID_CONTEXT, C::CUDA_ERROR_CONTEXT_ALREADY_CURRENT, C::CUDA_ERROR_MAP_FAILED,
    C::CUDA_ERROR_UNMAP_FAILED, C::CUDA_ERROR_ARRAY_IS_MAPPED, C::CUDA_ERROR_ALREADY_MAPPED,
    C::CUDA_ERROR_NO_BINARY_FOR_GPU, C::CUDA_ERROR_ALREADY_ACQUIRED, C::CUDA_ERROR_NOT_MAPPED,
    C::CUDA_ERROR_NOT_MAPPED_AS_ARRAY, C::CUDA_ERROR_NOT_MAPPED_AS_POINTER, C::CUDA_ERROR_ECC_UNCORRECTABLE,
    C::CUDA_ERROR_UNSUPPORTED_LIMIT, C::CUDA_ERROR_CONTEXT_ALREADY_IN_USE,
    C::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, C::CUDA_ERROR_INVALID_PTX, C::CUDA_ERROR_INVALID_GRAPHICS_CONTEXT,
    C::CUDA_ERROR_NVLINK_UNCORRECTABLE, C::CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
    C::CUDA_ERROR_UNSUPPORTED_PTX_VERSION, C::CUDA_ERROR_JIT_COMPILATION_DISABLED,
    C::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, C::CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC, C::CUDA_ERROR_CONTAINED,
    C::CUDA_ERROR_INVALID_SOURCE, C::CUDA_ERROR_FILE_NOT_FOUND, C::CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
    C::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, C::CUDA_ERROR_OPERATING_SYSTEM, C::CUDA_ERROR_INVALID_HANDLE,
    C::CUDA_ERROR_ILLEGAL_STATE, C::CUDA_ERROR_LOSSY_QUERY, C::CUDA_ERROR_NOT_FOUND, C::CUDA_ERROR_NOT_READY,
    C::CUDA_ERROR_ILLEGAL_ADDRESS, C::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, C::CUDA_ERROR_LAUNCH_TIMEOUT,
    C::CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, C::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    C::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, C::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
    C::CUDA_ERROR_CONTEXT_IS_DESTROYED, C::CUDA_ERROR_ASSERT, C::CUDA_ERROR_TOO_MANY_PEERS,
    C::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, C::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    C::CUDA_ERROR_HARDWARE_STACK_ERROR, C::CUDA_ERROR_ILLEGAL_INSTRUCTION, C::CUDA_ERROR_MISALIGNED_ADDRESS,
    C::CUDA_ERROR_INVALID_ADDRESS_SPACE, C::CUDA_ERROR_INVALID_PC, C::CUDA_ERROR_LAUNCH_FAILED,
    C::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, C::CUDA_ERROR_TENSOR_MEMORY_LEAK, C::CUDA_ERROR_NOT_PERMITTED,
    C::CUDA_ERROR_NOT_SUPPORTED, C::CUDA_ERROR_SYSTEM_NOT_READY, C::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    C::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, C::CUDA_ERROR_MPS_CONNECTION_FAILED,
    C::CUDA_ERROR_MPS_RPC_FAILURE, C::CUDA_ERROR_MPS_SERVER_NOT_READY, C::CUDA_ERROR_MPS_MAX_CLIENTS_REACHED,
    C::CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED, C::CUDA_ERROR_MPS_CLIENT_TERMINATED,
    C::CUDA_ERROR_CDP_NOT_SUPPORTED, C::CUDA_ERROR_CDP_VERSION_MISMATCH,
    C::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, C::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    C::CUDA_ERROR_STREAM_CAPTURE_MERGE, C::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
    C::CUDA_ERROR_STREAM_CAPTURE_UNJOINED, C::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
    C::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, C::CUDA_ERROR_CAPTURED_EVENT,
    C::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, C::CUDA_ERROR_TIMEOUT, C::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
    C::CUDA_ERROR_EXTERNAL_DEVICE, C::CUDA_ERROR_INVALID_CLUSTER_SIZE, C::CUDA_ERROR_FUNCTION_NOT_LOADED,
    C::CUDA_ERROR_INVALID_RESOURCE_TYPE, C::CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION,
    C::CUDA_ERROR_KEY_ROTATION, C::CUDA_ERROR_UNKNOWN,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_codes_outside_the_bindings_read_as_unknown() {
        // Codes of CUDA 13 drivers that the 12.8 enum lacks, and codes no driver returns.
        for raw in [36, 47, 227, 917, 918, 919, -2, i32::MIN, i32::MAX] {
            let err = check(Code(raw), ErrorContext::op("cuInit")).unwrap_err();
            assert!(
                matches!(err, Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, raw: r, .. } if r == raw),
                "{raw}: {err:?}"
            );
            assert_eq!(err.raw_code(), Some(raw));
            assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
            assert_eq!(err.to_string(), format!("CUDA error {raw} (unknown to these bindings) in cuInit"));
        }
        // The driver's own CUDA_ERROR_UNKNOWN is named.
        let err = check(Code(999), ErrorContext::op("cuInit")).unwrap_err();
        assert!(matches!(err, Error::Cuda { code: CUresult::CUDA_ERROR_UNKNOWN, raw: 999, .. }), "{err:?}");
        assert_eq!(err.to_string(), "CUDA error CUDA_ERROR_UNKNOWN in cuInit");
        assert!(check(Code(0), ErrorContext::op("cuInit")).is_ok());
        assert!(matches!(check(Code(100), ErrorContext::op("cuInit")), Err(Error::NoDevice { .. })));
        // cumem's own answer for an entry point the driver lacks (no driver code is negative).
        let err = check(Code::MISSING_ENTRY_POINT, ErrorContext::op("cuMemAdvise_v2 (prefetch)").device(1))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotSupported { feature: Feature::Symbol("cuMemAdvise_v2"), device: Some(1) }
            ),
            "{err:?}"
        );
        for code in KNOWN_CODES {
            assert_eq!(code_from_raw(code as i32), Some(code));
        }
    }

    #[test]
    fn every_code_round_trips_through_the_error() {
        let codes = [
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_NOT_INITIALIZED,
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            CUresult::CUDA_ERROR_UNKNOWN,
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
        ];
        for code in codes {
            let err = Error::from_code(code, ErrorContext::op("x")).expect("an error code");
            assert_eq!(err.code(), Some(code), "{err}");
        }
        assert!(Error::from_code(CUresult::CUDA_SUCCESS, ErrorContext::op("x")).is_none());
    }

    #[test]
    fn named_codes_map_to_named_variants() {
        let ctx = ErrorContext::op("cuMemAlloc_v2").bytes(64).device(1);
        let err = check(CUresult::CUDA_ERROR_OUT_OF_MEMORY, ctx).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { ctx: c, report: None } if c.bytes == Some(64) && c.device == Some(1))
        );
        assert_eq!(err.to_string(), "out of memory in cuMemAlloc_v2 (64 bytes, device 1)");
        let err =
            check(CUresult::CUDA_ERROR_NOT_SUPPORTED, ErrorContext::op("cuMemAllocManaged")).unwrap_err();
        assert!(matches!(err, Error::NotSupported { feature: Feature::Driver("cuMemAllocManaged"), .. }));
        let err = check(CUresult::CUDA_ERROR_LAUNCH_FAILED, ErrorContext::op("k")).unwrap_err();
        assert!(matches!(err, Error::Cuda { code: CUresult::CUDA_ERROR_LAUNCH_FAILED, raw: 719, .. }));
        assert_eq!(err.to_string(), "CUDA error CUDA_ERROR_LAUNCH_FAILED in k");
    }

    #[test]
    fn own_variants_have_no_driver_code() {
        let err = Error::SizeOverflow { count: usize::MAX, elem_size: 8 };
        assert_eq!(err.code(), None);
        assert!(err.to_string().contains("overflow"));
    }
}
