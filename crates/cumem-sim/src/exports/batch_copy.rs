//! `cuMemcpyBatchAsync` (CUDA 12.8): a batch of pointer-to-pointer copies queued on one stream,
//! each with attributes that say when its source may be read.
//!
//! The batch is validated before anything is queued: the arrays, the stream (not the legacy
//! one), the attribute ranges (`attrsIdxs[0] == 0`, strictly increasing, below `count`), each
//! attribute (`srcAccessOrder` STREAM, DURING_API_CALL or ANY; `flags` 0 or
//! PREFER_OVERLAP_WITH_COMPUTE) and every copy, checked as `cuMemcpyAsync` checks it (bounds
//! against the allocation or VMM mappings containing each side, access to them, a writable
//! destination, freed memory). Failures return `INVALID_VALUE` (or the code `cuMemcpyAsync`
//! would return) with `*failIdx` the index of the copy at fault, or `SIZE_MAX` when no single
//! copy is. The copies are then queued in index order (the driver promises no order inside a
//! batch, so a program cannot tell). A source read DURING_API_CALL from memory the host can read
//! (pageable, page-locked or managed) is read during validation, before the call returns (managed
//! memory through the simulator's own mapping, so queued device work that keeps the program's
//! view inaccessible does not matter); a device source is read in stream order, as are the
//! sources of the other orders (pinned memory when the copy runs, pageable memory at the call).
//!
//! Late failures: the state is not held from validation to queuing, so a copy can still fail
//! while queued, after the earlier copies of the batch were queued, when another thread frees
//! its memory, unmaps or changes access to a VMM range it names, or destroys the stream
//! meanwhile (a race the program is at fault for); `*failIdx` names it.

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};

use crate::abi::MemLocation;
use crate::api::{self, ApiResult, Fail, Init};
use crate::copy::check_async_copy;
use crate::exports::copy::cuMemcpyAsync;
use crate::exports::legacy_names::forward;

/// `CUmemcpyAttributes` (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemcpyAttributes {
    /// `CUmemcpySrcAccessOrder`: INVALID 0, STREAM 1, DURING_API_CALL 2, ANY 3.
    pub src_access_order: u32,
    /// Where the source is expected to be (a hint for managed and pageable memory).
    pub src_loc_hint: MemLocation,
    /// Where the destination is expected to be (a hint).
    pub dst_loc_hint: MemLocation,
    /// `CUmemcpyFlags`: DEFAULT 0, PREFER_OVERLAP_WITH_COMPUTE 1.
    pub flags: u32,
}

const _: () = {
    assert!(size_of::<MemcpyAttributes>() == 24);
    assert!(size_of::<MemcpyAttributes>() == size_of::<cudarc::driver::sys::CUmemcpyAttributes>());
};

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`.
const ORDER_STREAM: u32 = 1;
/// `CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`.
const ORDER_DURING_API_CALL: u32 = 2;
/// `CU_MEMCPY_SRC_ACCESS_ORDER_ANY`.
const ORDER_ANY: u32 = 3;
/// All defined `CUmemcpyFlags`.
const COPY_FLAGS: u32 = 1;
/// `CU_STREAM_LEGACY`.
const STREAM_LEGACY: usize = 0x1;
/// A failure and the index it is reported at (`usize::MAX`: not one copy's fault).
struct BatchFail {
    fail: Fail,
    index: usize,
}

fn bad(index: usize, message: impl Into<String>) -> BatchFail {
    BatchFail { fail: Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, message), index }
}

/// One validated copy.
struct Copy {
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    /// A DURING_API_CALL source the host could read, read at validation.
    staged: Option<Vec<u8>>,
}

/// Validates the whole batch, each copy as `cuMemcpyAsync` would, and reads the DURING_API_CALL
/// sources the host can read.
///
/// # Safety
/// 1. Non-NULL arrays are valid for reading `count` (`num_attrs`) entries.
/// 2. Pageable host sources are valid for their copy's bytes.
#[allow(clippy::too_many_arguments)]
unsafe fn validate(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    h_stream: CUstream,
) -> Result<Vec<Copy>, BatchFail> {
    let none = usize::MAX;
    if count == 0 {
        return Err(bad(none, "count is 0"));
    }
    if dsts.is_null() || srcs.is_null() || sizes.is_null() || attrs.is_null() || attrs_idxs.is_null() {
        return Err(bad(none, "NULL dsts, srcs, sizes, attrs or attrsIdxs"));
    }
    if h_stream.is_null() || h_stream as usize == STREAM_LEGACY {
        return Err(bad(none, "the legacy NULL stream cannot take a batch"));
    }
    if num_attrs == 0 || num_attrs > count {
        return Err(bad(none, format!("numAttrs {num_attrs} must be 1..={count}")));
    }
    // SAFETY: non-NULL and readable for the given lengths (caller contract).
    let (dsts, srcs, sizes, attrs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(dsts, count),
            std::slice::from_raw_parts(srcs, count),
            std::slice::from_raw_parts(sizes, count),
            std::slice::from_raw_parts(attrs, num_attrs),
            std::slice::from_raw_parts(attrs_idxs, num_attrs),
        )
    };
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[0] >= w[1]) || idxs[num_attrs - 1] >= count {
        return Err(bad(none, "attrsIdxs must start at 0, increase strictly and stay below count"));
    }
    let mut copies = Vec::with_capacity(count);
    for (k, a) in attrs.iter().enumerate() {
        let first = idxs[k];
        let end = idxs.get(k + 1).copied().unwrap_or(count);
        if !matches!(a.src_access_order, ORDER_STREAM | ORDER_DURING_API_CALL | ORDER_ANY) {
            return Err(bad(first, format!("attrs[{k}].srcAccessOrder {} is not valid", a.src_access_order)));
        }
        if a.flags & !COPY_FLAGS != 0 {
            return Err(bad(first, format!("attrs[{k}].flags {:#x} has undefined bits", a.flags)));
        }
        for i in first..end {
            let (dst, src, len) = (dsts[i], srcs[i], sizes[i]);
            let mut staged = None;
            if len > 0 {
                if dst == 0 || src == 0 {
                    return Err(bad(i, format!("copy {i}: NULL pointer")));
                }
                let stage = a.src_access_order == ORDER_DURING_API_CALL;
                // SAFETY: forwarded caller contract (2).
                staged = unsafe { check_async_copy(dst, src, len, h_stream, stage) }
                    .map_err(|fail| BatchFail { fail, index: i })?;
            }
            copies.push(Copy { dst, src, len, staged });
        }
    }
    Ok(copies)
}

/// Queues the validated copies on `h_stream`.
///
/// # Safety
/// 1. Host memory named by the copies is valid for the copy's bytes as `cuMemcpyAsync` requires.
unsafe fn enqueue(copies: &[Copy], h_stream: CUstream) -> Result<(), BatchFail> {
    for (i, c) in copies.iter().enumerate() {
        if c.len == 0 {
            continue;
        }
        let code = if let Some(staged) = &c.staged {
            // SAFETY: the staged bytes are pageable memory, which an async copy reads before it
            // returns, so dropping them afterwards is fine.
            unsafe { cuMemcpyAsync(c.dst, staged.as_ptr() as CUdeviceptr, c.len, h_stream) }
        } else {
            // SAFETY: forwarded caller contract.
            unsafe { cuMemcpyAsync(c.dst, c.src, c.len, h_stream) }
        };
        forward(code).map_err(|fail| BatchFail { fail, index: i })?;
    }
    Ok(())
}

/// Runs a batch and reports the failure index.
///
/// # Safety
/// 1. As [`cuMemcpyBatchAsync`].
#[allow(clippy::too_many_arguments)]
unsafe fn batch(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h_stream: CUstream,
) -> ApiResult {
    // SAFETY: forwarded caller contract.
    let result = unsafe { validate(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, h_stream) }
        // SAFETY: forwarded caller contract.
        .and_then(|copies| unsafe { enqueue(&copies, h_stream) });
    result.map_err(|BatchFail { fail, index }| {
        if !fail_idx.is_null() {
            // SAFETY: non-NULL and writable (caller contract).
            unsafe { fail_idx.write(index) };
        }
        fail
    })
}

/// `CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t
/// count, CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
/// CUstream hStream)` (CUDA 12.8). See the module documentation.
///
/// # Safety
/// 1. Non-NULL arrays are valid for reading `count` (`dsts`, `srcs`, `sizes`) or `num_attrs`
///    (`attrs`, `attrs_idxs`) entries; `fail_idx` is NULL or valid for writing a `size_t`.
/// 2. Host memory the copies name is valid for their bytes as `cuMemcpyAsync` requires.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h_stream: CUstream,
) -> CUresult {
    api::call("cuMemcpyBatchAsync", Init::Required, || {
        // SAFETY: forwarded caller contract.
        unsafe { batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, h_stream) }
    })
}

/// `cuMemcpyBatchAsync` with NULL `hStream` meaning the calling thread's per-thread stream.
///
/// # Safety
/// 1. As [`cuMemcpyBatchAsync`].
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuMemcpyBatchAsync_ptsz(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h_stream: CUstream,
) -> CUresult {
    let h_stream = crate::exports::per_thread::per_thread(h_stream);
    api::call("cuMemcpyBatchAsync_ptsz", Init::Required, || {
        // SAFETY: forwarded caller contract.
        unsafe { batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, h_stream) }
    })
}
