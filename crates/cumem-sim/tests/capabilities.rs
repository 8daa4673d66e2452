//! Capability truth: every device attribute the simulator reports as supported has every entry
//! point behind it exported by the library, so a program that checks the attribute before
//! taking its fallback never fails at symbol lookup instead.

mod common;
mod symbols;

use std::ffi::c_int;

use common::*;
use cudarc::driver::sys as cu;
use symbols::exported;

/// `(attribute number, name, entry points a program uses the capability through)`: the
/// capabilities that have dedicated driver calls. Attributes without any (compute capability,
/// cache sizes, kernel properties such as CONCURRENT_KERNELS) are not listed.
const BEHIND: &[(u32, &str, &[&str])] = &[
    (19, "CAN_MAP_HOST_MEMORY", &["cuMemHostAlloc", "cuMemHostGetDevicePointer_v2", "cuMemHostGetFlags"]),
    (
        41,
        "UNIFIED_ADDRESSING",
        &[
            "cuPointerGetAttribute",
            "cuPointerGetAttributes",
            "cuMemGetAddressRange_v2",
            "cuMemcpy",
            "cuMemcpyAsync",
        ],
    ),
    (
        78,
        "STREAM_PRIORITIES_SUPPORTED",
        &["cuStreamCreateWithPriority", "cuCtxGetStreamPriorityRange", "cuStreamGetPriority"],
    ),
    (44, "CAN_TEX2D_GATHER", &["cuTexObjectCreate", "cuTexObjectDestroy"]),
    (83, "MANAGED_MEMORY", &["cuMemAllocManaged", "cuStreamAttachMemAsync"]),
    (
        89,
        "CONCURRENT_MANAGED_ACCESS",
        &[
            "cuMemAdvise",
            "cuMemAdvise_v2",
            "cuMemPrefetchAsync",
            "cuMemPrefetchAsync_v2",
            "cuMemRangeGetAttribute",
            "cuMemRangeGetAttributes",
        ],
    ),
    (92, "CAN_USE_STREAM_MEM_OPS_V1", &["cuStreamWriteValue32", "cuStreamWaitValue32", "cuStreamBatchMemOp"]),
    (93, "CAN_USE_64_BIT_STREAM_MEM_OPS_V1", &["cuStreamWriteValue64", "cuStreamWaitValue64"]),
    (94, "CAN_USE_STREAM_WAIT_VALUE_NOR_V1", &["cuStreamWaitValue32"]),
    (95, "COOPERATIVE_LAUNCH", &["cuLaunchCooperativeKernel"]),
    (96, "COOPERATIVE_MULTI_DEVICE_LAUNCH", &["cuLaunchCooperativeKernelMultiDevice"]),
    (98, "CAN_FLUSH_REMOTE_WRITES", &["cuFlushGPUDirectRDMAWrites"]),
    (99, "HOST_REGISTER_SUPPORTED", &["cuMemHostRegister_v2", "cuMemHostUnregister"]),
    (
        102,
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
        &[
            "cuMemAddressReserve",
            "cuMemAddressFree",
            "cuMemCreate",
            "cuMemRelease",
            "cuMemMap",
            "cuMemUnmap",
            "cuMemSetAccess",
            "cuMemGetAccess",
            "cuMemGetAllocationGranularity",
            "cuMemGetAllocationPropertiesFromHandle",
            "cuMemRetainAllocationHandle",
        ],
    ),
    (
        103,
        "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        &["cuMemCreate", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"],
    ),
    (
        104,
        "HANDLE_TYPE_WIN32_HANDLE_SUPPORTED",
        &["cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"],
    ),
    (
        105,
        "HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED",
        &["cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"],
    ),
    (107, "GENERIC_COMPRESSION_SUPPORTED", &["cuMemCreate", "cuMemMap"]),
    (108, "MAX_PERSISTING_L2_CACHE_SIZE", &["cuCtxSetLimit", "cuCtxGetLimit"]),
    (109, "MAX_ACCESS_POLICY_WINDOW_SIZE", &["cuStreamSetAttribute", "cuStreamGetAttribute"]),
    (110, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", &["cuMemCreate", "cuMemMap"]),
    (112, "SPARSE_CUDA_ARRAY_SUPPORTED", &["cuArrayCreate_v2", "cuMemMapArrayAsync"]),
    (113, "READ_ONLY_HOST_REGISTER_SUPPORTED", &["cuMemHostRegister_v2"]),
    (
        114,
        "TIMELINE_SEMAPHORE_INTEROP_SUPPORTED",
        &["cuImportExternalSemaphore", "cuSignalExternalSemaphoresAsync", "cuWaitExternalSemaphoresAsync"],
    ),
    (
        115,
        "MEMORY_POOLS_SUPPORTED",
        &[
            "cuMemAllocAsync",
            "cuMemFreeAsync",
            "cuMemAllocFromPoolAsync",
            "cuMemPoolCreate",
            "cuMemPoolDestroy",
            "cuMemPoolTrimTo",
            "cuMemPoolSetAttribute",
            "cuMemPoolGetAttribute",
            "cuMemPoolSetAccess",
            "cuMemPoolGetAccess",
            "cuDeviceGetDefaultMemPool",
            "cuDeviceGetMemPool",
            "cuDeviceSetMemPool",
        ],
    ),
    (116, "GPU_DIRECT_RDMA_SUPPORTED", &["cuFlushGPUDirectRDMAWrites"]),
    (117, "GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS", &["cuFlushGPUDirectRDMAWrites"]),
    (
        119,
        "MEMPOOL_SUPPORTED_HANDLE_TYPES",
        &[
            "cuMemPoolExportToShareableHandle",
            "cuMemPoolImportFromShareableHandle",
            "cuMemPoolExportPointer",
            "cuMemPoolImportPointer",
        ],
    ),
    (120, "CLUSTER_LAUNCH", &["cuLaunchKernelEx", "cuOccupancyMaxActiveClusters"]),
    (121, "DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED", &["cuArrayCreate_v2", "cuMemMapArrayAsync"]),
    (122, "CAN_USE_64_BIT_STREAM_MEM_OPS", &["cuStreamWriteValue64_v2", "cuStreamWaitValue64_v2"]),
    (123, "CAN_USE_STREAM_WAIT_VALUE_NOR", &["cuStreamWaitValue32_v2"]),
    (124, "DMA_BUF_SUPPORTED", &["cuMemGetHandleForAddressRange"]),
    (125, "IPC_EVENT_SUPPORTED", &["cuIpcGetEventHandle", "cuIpcOpenEventHandle"]),
    (126, "MEM_SYNC_DOMAIN_COUNT", &["cuLaunchKernelEx", "cuStreamSetAttribute"]),
    (127, "TENSOR_MAP_ACCESS_SUPPORTED", &["cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col"]),
    (
        128,
        "HANDLE_TYPE_FABRIC_SUPPORTED",
        &["cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"],
    ),
    (129, "UNIFIED_FUNCTION_POINTERS", &["cuModuleLoadData", "cuLaunchKernel"]),
    (132, "MULTICAST_SUPPORTED", &["cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem"]),
];

fn attribute(attr: u32, dev: c_int) -> c_int {
    // SAFETY: the exported function with integer attribute numbers.
    let get: unsafe extern "C" fn(*mut c_int, u32, c_int) -> cu::CUresult =
        unsafe { raw("cuDeviceGetAttribute") };
    let mut v = -7;
    // SAFETY: valid out-pointer.
    ok(unsafe { get(&mut v, attr, dev) });
    v
}

#[test]
fn every_supported_capability_has_its_entry_points() {
    setup();
    let mut count = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { cu::cuDeviceGetCount(&mut count) });
    let mut lies = Vec::new();
    let mut supported = 0;
    for dev in 0..count {
        for &(attr, name, entry_points) in BEHIND {
            if attribute(attr, dev) == 0 {
                continue;
            }
            supported += 1;
            for ep in entry_points.iter().filter(|ep| !exported(ep)) {
                lies.push(format!("device {dev}: {name} is supported but {ep} is not exported"));
            }
        }
    }
    assert!(lies.is_empty(), "{lies:#?}");
    assert!(supported > 0, "the test checked nothing");
}

#[test]
fn the_checked_entry_points_exist_where_they_are_claimed() {
    // The check above must be able to fail: a capability reported with all its calls present.
    setup();
    assert_eq!(attribute(115, 0), 1);
    assert!(exported("cuMemPoolCreate") && exported("cuMemAllocAsync"));
    // And one the simulator cannot back is reported as absent, with its calls absent.
    assert_eq!(attribute(102, 0), 1, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED with its calls");
    assert!(exported("cuMemCreate") && exported("cuMemMap"));
    assert_eq!(attribute(103, 0), 1, "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED with its calls");
    assert!(exported("cuMemExportToShareableHandle") && exported("cuMemImportFromShareableHandle"));
    assert_eq!(attribute(125, 0), 1, "IPC_EVENT_SUPPORTED with its calls");
    assert!(exported("cuIpcGetEventHandle") && exported("cuIpcOpenEventHandle"));
    assert_eq!(attribute(119, 0), 1, "MEMPOOL_SUPPORTED_HANDLE_TYPES (POSIX_FD) with pool export calls");
    assert!(exported("cuMemPoolExportToShareableHandle") && exported("cuMemPoolImportPointer"));
    assert_eq!(attribute(121, 0), 0, "DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED without array calls");
    assert!(!exported("cuArrayCreate_v2"));
}
