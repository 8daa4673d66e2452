//! Managed memory: attachment, advice, prefetch and range attributes (`cuMemAllocManaged` itself
//! is with the other allocation calls). Hints never change data; they are recorded per page and
//! read back by `cuMemRangeGetAttribute(s)`.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUresult, CUstream};

use crate::abi::MemLocation;
use crate::api::{self, ApiResult, Fail, Init};
use crate::hints;
use crate::managed::{DEVICE_CPU, DEVICE_INVALID, Loc, PageHints, common, v1_of, v2_of};

/// `CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice
/// device)`: records advice for the (page-rounded) range, which must lie inside one managed
/// allocation (`INVALID_VALUE` otherwise, or for count 0 / unknown advice). `device` is an
/// ordinal or `CU_DEVICE_CPU` (-1); a bad ordinal, or a GPU without CONCURRENT_MANAGED_ACCESS for
/// SET_PREFERRED_LOCATION / (UN)SET_ACCESSED_BY, gives `INVALID_DEVICE`. READ_MOSTLY and
/// UNSET_PREFERRED_LOCATION ignore `device`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAdvise(dev_ptr: CUdeviceptr, count: usize, advice: u32, device: CUdevice) -> CUresult {
    api::call("cuMemAdvise", Init::Required, || {
        hints::advise(dev_ptr, count, advice, hints::v1_location(device))
    })
}

/// `CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation
/// location)`: as `cuMemAdvise` with a location: DEVICE (ordinal), HOST (id ignored), HOST_NUMA
/// (node 0 only) or HOST_NUMA_CURRENT for preferred locations; DEVICE or HOST for ACCESSED_BY.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAdvise_v2(
    dev_ptr: CUdeviceptr,
    count: usize,
    advice: u32,
    location: MemLocation,
) -> CUresult {
    api::call("cuMemAdvise_v2", Init::Required, || hints::advise(dev_ptr, count, advice, location))
}

/// `CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream
/// hStream)`: a stream operation that, when it runs, records `dstDevice` (an ordinal or
/// `CU_DEVICE_CPU`) as the range's LAST_PREFETCH_LOCATION. Managed memory only, range inside the
/// allocation (`INVALID_VALUE`); a bad ordinal, or a destination or stream device without
/// CONCURRENT_MANAGED_ACCESS, gives `INVALID_DEVICE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPrefetchAsync(
    dev_ptr: CUdeviceptr,
    count: usize,
    dst_device: CUdevice,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemPrefetchAsync", Init::Required, || {
        hints::prefetch(dev_ptr, count, hints::v1_location(dst_device), 0, h_stream)
    })
}

/// `CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
/// unsigned flags, CUstream hStream)`: as `cuMemPrefetchAsync` with a location; `flags` must be
/// 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPrefetchAsync_v2(
    dev_ptr: CUdeviceptr,
    count: usize,
    location: MemLocation,
    flags: c_uint,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemPrefetchAsync_v2", Init::Required, || {
        hints::prefetch(dev_ptr, count, location, flags, h_stream)
    })
}

/// Writes one range attribute into `data` (`size` bytes), after validating the size.
///
/// # Safety
/// 1. `data` is non-NULL and valid for writing `size` bytes.
unsafe fn write_range_attribute(
    pages: &[PageHints],
    attribute: u32,
    data: *mut c_void,
    size: usize,
) -> ApiResult {
    let v2 = |f: fn(&PageHints) -> Option<Loc>| v2_of(common(pages, f));
    let value: i32 = match attribute {
        1 => i32::from(pages.iter().all(|p| p.read_mostly)),
        2 => common(pages, |p| p.preferred).map_or(DEVICE_INVALID, v1_of),
        4 => common(pages, |p| p.last_prefetch).map_or(DEVICE_INVALID, v1_of),
        5 => v2(|p| p.preferred).0 as i32,
        6 => v2(|p| p.preferred).1,
        7 => v2(|p| p.last_prefetch).0 as i32,
        8 => v2(|p| p.last_prefetch).1,
        _ => {
            // 3: ACCESSED_BY, a list of ids padded with CU_DEVICE_INVALID.
            let devs = pages.iter().fold(u64::MAX, |acc, p| acc & p.accessed_by);
            let cpu = pages.iter().all(|p| p.accessed_by_cpu);
            let ids = (0..64).filter(|d| devs & (1 << d) != 0).chain(cpu.then_some(DEVICE_CPU));
            let n = size / 4;
            let mut out = vec![DEVICE_INVALID; n];
            for (slot, id) in out.iter_mut().zip(ids) {
                *slot = id;
            }
            // SAFETY: `data` holds `size >= 4 * n` bytes (this function's contract).
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr().cast::<u8>(), data.cast::<u8>(), n * 4) };
            return Ok(());
        }
    };
    // SAFETY: `size == 4` was checked by the caller.
    unsafe { data.cast::<i32>().write_unaligned(value) };
    Ok(())
}

/// `INVALID_VALUE` unless `size` suits `attribute` (4 bytes; ACCESSED_BY a non-zero multiple of
/// 4) and the attribute is known.
fn check_range_attribute(attribute: u32, size: usize) -> ApiResult {
    let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
    match attribute {
        3 if size == 0 || !size.is_multiple_of(4) => {
            bad(format!("ACCESSED_BY needs a non-zero multiple of 4 bytes, not {size}"))
        }
        3 => Ok(()),
        1 | 2 | 4..=8 if size != 4 => bad(format!("range attribute {attribute} needs 4 bytes, not {size}")),
        1 | 2 | 4..=8 => Ok(()),
        _ => bad(format!("unknown range attribute {attribute}")),
    }
}

/// `CUresult cuMemRangeGetAttribute(void *data, size_t dataSize, CUmem_range_attribute attribute,
/// CUdeviceptr devPtr, size_t count)`: READ_MOSTLY is 1 iff every page has it; PREFERRED_LOCATION
/// and LAST_PREFETCH_LOCATION are the common value of all pages (`CU_DEVICE_CPU` for the host)
/// or `CU_DEVICE_INVALID` (-2) when mixed or unset; ACCESSED_BY lists the ids advised on every page,
/// padded with -2; the `_TYPE`/`_ID` forms give the `CUmemLocationType` (INVALID when mixed or
/// unset, with id -2) and id. Managed memory only; sizes per attribute (see above).
///
/// # Safety
/// 1. `data` is NULL or valid for writing `data_size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRangeGetAttribute(
    data: *mut c_void,
    data_size: usize,
    attribute: u32,
    dev_ptr: CUdeviceptr,
    count: usize,
) -> CUresult {
    api::call("cuMemRangeGetAttribute", Init::Required, || {
        api::non_null(data, "data")?;
        check_range_attribute(attribute, data_size)?;
        let pages = hints::pages(dev_ptr, count)?;
        // SAFETY: non-NULL and valid for `data_size` bytes (caller contract), size checked.
        unsafe { write_range_attribute(&pages, attribute, data, data_size) }
    })
}

/// `CUresult cuMemRangeGetAttributes(void **data, size_t *dataSizes, CUmem_range_attribute
/// *attributes, size_t numAttributes, CUdeviceptr devPtr, size_t count)`: the batch form; every
/// entry is validated before anything is written.
///
/// # Safety
/// 1. `data`, `data_sizes` and `attributes` are NULL or valid for reading `num` entries; each
///    `data[i]` is NULL or valid for writing `data_sizes[i]` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRangeGetAttributes(
    data: *mut *mut c_void,
    data_sizes: *mut usize,
    attributes: *mut u32,
    num: usize,
    dev_ptr: CUdeviceptr,
    count: usize,
) -> CUresult {
    api::call("cuMemRangeGetAttributes", Init::Required, || {
        if num == 0 {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, "numAttributes is 0"));
        }
        api::non_null(data, "data")?;
        api::non_null(data_sizes, "dataSizes")?;
        api::non_null(attributes, "attributes")?;
        // SAFETY: non-NULL and valid for `num` entries (caller contract).
        let (outs, sizes, attrs) = unsafe {
            (
                std::slice::from_raw_parts(data, num),
                std::slice::from_raw_parts(data_sizes, num),
                std::slice::from_raw_parts(attributes, num),
            )
        };
        for ((&out, &size), &attr) in outs.iter().zip(sizes).zip(attrs) {
            api::non_null(out, "data[i]")?;
            check_range_attribute(attr, size)?;
        }
        let pages = hints::pages(dev_ptr, count)?;
        for ((&out, &size), &attr) in outs.iter().zip(sizes).zip(attrs) {
            // SAFETY: non-NULL and valid for `size` bytes (caller contract), size checked.
            unsafe { write_range_attribute(&pages, attr, out, size)? };
        }
        Ok(())
    })
}

/// `CUresult cuStreamAttachMemAsync(CUstream hStream, CUdeviceptr dptr, size_t length, unsigned
/// flags)`: queues the attachment (GLOBAL, HOST or SINGLE, exactly one) on the stream; it takes
/// effect, and shows in the live report with that stream, once the stream's earlier work has
/// completed. The arguments are checked at the call: `dptr` must be the base of a managed
/// allocation and `length` 0 or its size; SINGLE on the NULL/legacy stream gives `INVALID_VALUE`.
/// A SINGLE attachment reverts to the allocation's flags once its stream is destroyed and has
/// drained. Of the access restrictions the attachment implies, one is checked: on a device without
/// concurrent managed access, a memset, or the device side of a copy (not a host side, not a
/// `cuMemcpy` end, which the driver then reads from the host), queued on memory attached to the
/// host (with no attachment of it still queued, so the one in effect at execution is known at the
/// call) is recorded in the violation log (the driver is documented to return an error, whose code
/// is not on record; the call keeps its result).
/// Use of memory attached to a single stream from another stream is not checked.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamAttachMemAsync(
    h_stream: CUstream,
    dptr: CUdeviceptr,
    length: usize,
    flags: c_uint,
) -> CUresult {
    api::call("cuStreamAttachMemAsync", Init::Required, || hints::attach(h_stream, dptr, length, flags))
}
