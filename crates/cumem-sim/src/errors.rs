//! Names and descriptions of every `CUresult` the bindings define.
//!
//! `cuGetErrorName`/`cuGetErrorString` hand out pointers to these static C strings, and the
//! violation log uses the names; an integer that is not a defined code maps to nothing, which the
//! driver reports as `CUDA_ERROR_INVALID_VALUE`.

use std::ffi::CStr;

use cudarc::driver::sys::CUresult;

macro_rules! codes {
    ($($name:ident => $desc:literal,)*) => {
        /// `(code, name, description)` for every defined result code.
        pub(crate) const CODES: &[(CUresult, &CStr, &CStr)] = &[
            $((CUresult::$name, {
                // Built by concatenation so the name is exactly the enumerator's identifier.
                match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                    Ok(s) => s,
                    Err(_) => panic!("enumerator names contain no NUL"),
                }
            }, $desc),)*
        ];
    };
}

codes! {
    CUDA_SUCCESS => c"no error",
    CUDA_ERROR_INVALID_VALUE => c"invalid argument",
    CUDA_ERROR_OUT_OF_MEMORY => c"out of memory",
    CUDA_ERROR_NOT_INITIALIZED => c"initialization error",
    CUDA_ERROR_DEINITIALIZED => c"driver shutting down",
    CUDA_ERROR_PROFILER_DISABLED => c"profiler disabled while using external profiling tool",
    CUDA_ERROR_PROFILER_NOT_INITIALIZED => c"profiler not initialized: call cudaProfilerInitialize()",
    CUDA_ERROR_PROFILER_ALREADY_STARTED => c"profiler already started",
    CUDA_ERROR_PROFILER_ALREADY_STOPPED => c"profiler already stopped",
    CUDA_ERROR_STUB_LIBRARY => c"CUDA driver is a stub library",
    CUDA_ERROR_DEVICE_UNAVAILABLE => c"CUDA-capable device(s) is/are busy or unavailable",
    CUDA_ERROR_NO_DEVICE => c"no CUDA-capable device is detected",
    CUDA_ERROR_INVALID_DEVICE => c"invalid device ordinal",
    CUDA_ERROR_DEVICE_NOT_LICENSED => c"device doesn't have valid Grid license",
    CUDA_ERROR_INVALID_IMAGE => c"device kernel image is invalid",
    CUDA_ERROR_INVALID_CONTEXT => c"invalid device context",
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT => c"context already current",
    CUDA_ERROR_MAP_FAILED => c"mapping of buffer object failed",
    CUDA_ERROR_UNMAP_FAILED => c"unmapping of buffer object failed",
    CUDA_ERROR_ARRAY_IS_MAPPED => c"array is mapped",
    CUDA_ERROR_ALREADY_MAPPED => c"resource already mapped",
    CUDA_ERROR_NO_BINARY_FOR_GPU => c"no kernel image is available for execution on the device",
    CUDA_ERROR_ALREADY_ACQUIRED => c"resource already acquired",
    CUDA_ERROR_NOT_MAPPED => c"resource not mapped",
    CUDA_ERROR_NOT_MAPPED_AS_ARRAY => c"resource not mapped as array",
    CUDA_ERROR_NOT_MAPPED_AS_POINTER => c"resource not mapped as pointer",
    CUDA_ERROR_ECC_UNCORRECTABLE => c"uncorrectable ECC error encountered",
    CUDA_ERROR_UNSUPPORTED_LIMIT => c"limit is not supported on this architecture",
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE => c"exclusive-thread device already in use by a different thread",
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => c"peer access is not supported between these two devices",
    CUDA_ERROR_INVALID_PTX => c"a PTX JIT compilation failed",
    CUDA_ERROR_INVALID_GRAPHICS_CONTEXT => c"invalid OpenGL or DirectX context",
    CUDA_ERROR_NVLINK_UNCORRECTABLE => c"uncorrectable NVLink error detected during the execution",
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND => c"PTX JIT compiler library not found",
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION => c"the provided PTX was compiled with an unsupported toolchain.",
    CUDA_ERROR_JIT_COMPILATION_DISABLED => c"PTX JIT compilation was disabled",
    CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY => c"the provided execution affinity is not supported",
    CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC => c"the provided PTX contains unsupported call to cudaDeviceSynchronize",
    CUDA_ERROR_CONTAINED => c"an exception occurred on the device that is now contained by the GPU's error containment capability",
    CUDA_ERROR_INVALID_SOURCE => c"device kernel image is invalid",
    CUDA_ERROR_FILE_NOT_FOUND => c"file not found",
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND => c"shared object symbol not found",
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED => c"shared object initialization failed",
    CUDA_ERROR_OPERATING_SYSTEM => c"OS call failed or operation not supported on this OS",
    CUDA_ERROR_INVALID_HANDLE => c"invalid resource handle",
    CUDA_ERROR_ILLEGAL_STATE => c"the operation cannot be performed in the present state",
    CUDA_ERROR_LOSSY_QUERY => c"attempted introspection would be semantically lossy",
    CUDA_ERROR_NOT_FOUND => c"named symbol not found",
    CUDA_ERROR_NOT_READY => c"device not ready",
    CUDA_ERROR_ILLEGAL_ADDRESS => c"an illegal memory access was encountered",
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES => c"too many resources requested for launch",
    CUDA_ERROR_LAUNCH_TIMEOUT => c"the launch timed out and was terminated",
    CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING => c"launch uses incompatible texturing mode",
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => c"peer access is already enabled",
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => c"peer access has not been enabled",
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE => c"cannot set while device is active in this process",
    CUDA_ERROR_CONTEXT_IS_DESTROYED => c"context is destroyed",
    CUDA_ERROR_ASSERT => c"device-side assert triggered",
    CUDA_ERROR_TOO_MANY_PEERS => c"peer mapping resources exhausted",
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => c"part or all of the requested memory range is already mapped",
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => c"pointer does not correspond to a registered memory region",
    CUDA_ERROR_HARDWARE_STACK_ERROR => c"hardware stack error",
    CUDA_ERROR_ILLEGAL_INSTRUCTION => c"an illegal instruction was encountered",
    CUDA_ERROR_MISALIGNED_ADDRESS => c"misaligned address",
    CUDA_ERROR_INVALID_ADDRESS_SPACE => c"operation not supported on global/shared address space",
    CUDA_ERROR_INVALID_PC => c"invalid program counter",
    CUDA_ERROR_LAUNCH_FAILED => c"unspecified launch failure",
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE => c"too many blocks in cooperative launch",
    CUDA_ERROR_TENSOR_MEMORY_LEAK => c"tensor memory not completely freed",
    CUDA_ERROR_NOT_PERMITTED => c"operation not permitted",
    CUDA_ERROR_NOT_SUPPORTED => c"operation not supported",
    CUDA_ERROR_SYSTEM_NOT_READY => c"system not yet initialized",
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => c"system has unsupported display driver / cuda driver combination",
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => c"forward compatibility was attempted on non supported HW",
    CUDA_ERROR_MPS_CONNECTION_FAILED => c"MPS client failed to connect to the MPS control daemon or the MPS server",
    CUDA_ERROR_MPS_RPC_FAILURE => c"the remote procedural call between the MPS server and the MPS client failed",
    CUDA_ERROR_MPS_SERVER_NOT_READY => c"MPS server is not ready to accept new MPS client requests",
    CUDA_ERROR_MPS_MAX_CLIENTS_REACHED => c"the hardware resources required to create MPS client have been exhausted",
    CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED => c"the hardware resources required to support device connections have been exhausted",
    CUDA_ERROR_MPS_CLIENT_TERMINATED => c"the MPS client has been terminated by the server",
    CUDA_ERROR_CDP_NOT_SUPPORTED => c"is using CUDA Dynamic Parallelism, but the current configuration does not support it",
    CUDA_ERROR_CDP_VERSION_MISMATCH => c"unsupported interaction between different versions of CUDA Dynamic Parallelism",
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => c"operation not permitted when stream is capturing",
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => c"operation failed due to a previous error during capture",
    CUDA_ERROR_STREAM_CAPTURE_MERGE => c"operation would result in a merge of separate capture sequences",
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => c"capture was not ended in the same stream as it began",
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED => c"capturing stream has unjoined work",
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION => c"dependency created on uncaptured work in another stream",
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => c"operation would make the legacy stream depend on a capturing blocking stream",
    CUDA_ERROR_CAPTURED_EVENT => c"operation not permitted on an event last recorded in a capturing stream",
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => c"attempt to terminate a thread-local capture sequence from another thread",
    CUDA_ERROR_TIMEOUT => c"wait operation timed out",
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => c"the graph update was not performed because it included changes which violated constraints specific to instantiated graph update",
    CUDA_ERROR_EXTERNAL_DEVICE => c"an async error has occured in external entity outside of CUDA",
    CUDA_ERROR_INVALID_CLUSTER_SIZE => c"a kernel launch error has occurred due to cluster misconfiguration",
    CUDA_ERROR_FUNCTION_NOT_LOADED => c"the function handle is not loaded when calling an API that requires a loaded function",
    CUDA_ERROR_INVALID_RESOURCE_TYPE => c"one or more resources passed in are not valid resource types for the operation",
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION => c"one or more resources are insufficient or non-applicable for the operation",
    CUDA_ERROR_KEY_ROTATION => c"an error occurred during the key rotation sequence",
    CUDA_ERROR_UNKNOWN => c"unknown error",
}

/// The defined result code with this integer value, if there is one.
pub(crate) fn from_u32(code: u32) -> Option<CUresult> {
    CODES.iter().find(|(c, _, _)| *c as u32 == code).map(|(c, _, _)| *c)
}

/// The enumerator name of `code` (e.g. `CUDA_ERROR_INVALID_VALUE`).
pub(crate) fn name(code: CUresult) -> &'static CStr {
    CODES.iter().find(|(c, _, _)| *c == code).map_or(c"CUDA_ERROR_UNKNOWN", |(_, n, _)| n)
}

/// The enumerator name of `code` as a Rust string.
pub(crate) fn name_str(code: CUresult) -> &'static str {
    name(code).to_str().unwrap_or("CUDA_ERROR_UNKNOWN")
}

/// The driver's human description of `code`, looked up by integer value.
pub(crate) fn lookup(code: u32) -> Option<(&'static CStr, &'static CStr)> {
    CODES.iter().find(|(c, _, _)| *c as u32 == code).map(|(_, n, d)| (*n, *d))
}
