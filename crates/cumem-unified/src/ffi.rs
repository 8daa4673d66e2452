//! Every driver call cumem-unified makes, each a thin checked wrapper around one `unsafe` FFI call.
//!
//! A driver without one of the managed-memory entry points gives `NotSupported { feature:
//! Symbol(name) }` (`cumem_sys::api` answers a missing symbol, which `check` maps). The CUDA 12.2
//! location-based forms (`cuMemAdvise_v2`, `cuMemPrefetchAsync_v2`) are used when the driver
//! exports them and reports at least 12.2; the device-ordinal forms otherwise. Callers bind the
//! context first.

use std::ffi::c_void;
use std::sync::OnceLock;

use cumem_sys::sys::{
    CUdevice, CUdeviceptr, CUmem_advise, CUmem_range_attribute, CUmemLocation, CUmemLocationType, CUstream,
};
use cumem_sys::{ErrorContext as Ctx, Result, api, check, probe};

/// `CU_DEVICE_CPU`: the host, in the device-ordinal forms of the hint calls.
pub(crate) const DEVICE_CPU: CUdevice = -1;

/// `CU_DEVICE_INVALID`: "no location" in range-attribute answers.
pub(crate) const DEVICE_INVALID: i32 = -2;

/// The first CUDA version with the location-based hint entry points.
const V2_DRIVER: i32 = 12020;

/// Where a hint or prefetch points: a device ordinal, or the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Host,
    Device(CUdevice),
}

impl Target {
    fn ordinal(self) -> CUdevice {
        match self {
            Target::Host => DEVICE_CPU,
            Target::Device(d) => d,
        }
    }

    fn location(self) -> CUmemLocation {
        match self {
            Target::Host => CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
            Target::Device(d) => {
                CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: d }
            }
        }
    }
}

/// Whether to use the `_v2` form of an entry point: exported, and a driver of at least 12.2.
fn use_v2(cache: &'static OnceLock<bool>, v2: &str) -> bool {
    *cache.get_or_init(|| probe::has_symbol(v2) && probe::driver_version().is_ok_and(|v| v >= V2_DRIVER))
}

pub(crate) fn mem_alloc_managed(bytes: usize, flags: u32, device: i32) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-pointer.
    let code = unsafe { api::cuMemAllocManaged(&mut ptr, bytes, flags) };
    check(code, Ctx::op("cuMemAllocManaged").bytes(bytes).device(device))?;
    Ok(ptr)
}

/// # Safety
/// 1. `ptr` came from `cuMemAllocManaged` in the current context and is freed once.
/// 2. No device work and no Rust reference still uses the memory.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    check(unsafe { api::cuMemFree_v2(ptr) }, Ctx::op("cuMemFree_v2"))
}

/// Queues attaching the whole managed allocation at `ptr` (`CU_MEM_ATTACH_*` in `flags`).
pub(crate) fn stream_attach_mem_async(stream: CUstream, ptr: CUdeviceptr, flags: u32) -> Result<()> {
    // SAFETY: `stream` is a live handle; the driver only changes the visibility of the allocation.
    check(unsafe { api::cuStreamAttachMemAsync(stream, ptr, 0, flags) }, Ctx::op("cuStreamAttachMemAsync"))
}

/// Sets or unsets one hint on `[ptr, ptr + bytes)` of managed memory.
pub(crate) fn mem_advise(ptr: CUdeviceptr, bytes: usize, advice: CUmem_advise, target: Target) -> Result<()> {
    static V2: OnceLock<bool> = OnceLock::new();
    if use_v2(&V2, "cuMemAdvise_v2") {
        // SAFETY: the driver only records the hint for the range (it validates the range itself).
        let code = unsafe { api::cuMemAdvise_v2(ptr, bytes, advice, target.location()) };
        return check(code, Ctx::op("cuMemAdvise_v2").bytes(bytes));
    }
    // SAFETY: as above.
    check(
        unsafe { api::cuMemAdvise(ptr, bytes, advice, target.ordinal()) },
        Ctx::op("cuMemAdvise").bytes(bytes),
    )
}

/// Queues migrating `[ptr, ptr + bytes)` of managed memory to `target` on `stream`.
pub(crate) fn mem_prefetch_async(
    ptr: CUdeviceptr,
    bytes: usize,
    target: Target,
    stream: CUstream,
) -> Result<()> {
    static V2: OnceLock<bool> = OnceLock::new();
    if use_v2(&V2, "cuMemPrefetchAsync_v2") {
        // SAFETY: `stream` is a live handle; prefetching moves pages but never changes their contents.
        let code = unsafe { api::cuMemPrefetchAsync_v2(ptr, bytes, target.location(), 0, stream) };
        return check(code, Ctx::op("cuMemPrefetchAsync_v2").bytes(bytes));
    }
    // SAFETY: as above.
    let code = unsafe { api::cuMemPrefetchAsync(ptr, bytes, target.ordinal(), stream) };
    check(code, Ctx::op("cuMemPrefetchAsync").bytes(bytes))
}

/// Reads one range attribute into `out` (4 bytes per value).
pub(crate) fn mem_range_get_attribute(
    out: &mut [i32],
    attribute: CUmem_range_attribute,
    ptr: CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    // SAFETY: `out` is valid for `size_of_val(out)` bytes of writes, which is what the driver is
    // told it may write; the range is only looked up.
    let code = unsafe {
        api::cuMemRangeGetAttribute(
            out.as_mut_ptr().cast::<c_void>(),
            size_of_val(out),
            attribute,
            ptr,
            bytes,
        )
    };
    check(code, Ctx::op("cuMemRangeGetAttribute"))
}
