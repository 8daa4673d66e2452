//! `cuPointerSetAttribute`: the one settable pointer attribute, SYNC_MEMOPS.

use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::{CUdeviceptr, CUresult};

use crate::api::{self, Fail, Init};
use crate::exports::memory::cuPointerGetAttribute;
use crate::sync_memops;

/// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`.
const ATTR_SYNC_MEMOPS: u32 = 6;
/// `CU_POINTER_ATTRIBUTE_BUFFER_ID`.
const ATTR_BUFFER_ID: u32 = 7;

/// `CUresult cuPointerSetAttribute(const void *value, CUpointer_attribute attribute, CUdeviceptr
/// ptr)`: only SYNC_MEMOPS (an `unsigned int`, 0 or 1) on memory CUDA allocated, mapped or
/// registered; it then reads back through `cuPointerGetAttribute(SYNC_MEMOPS)` for every address
/// of that allocation, and synchronous copies and memsets touching the allocation return only once
/// complete (device-to-device ones otherwise return at once). Other attributes, other values,
/// NULL `value` or unknown pointers → `INVALID_VALUE`.
///
/// # Safety
/// 1. `value` is NULL or valid for reading an `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerSetAttribute(
    value: *const c_void,
    attribute: u32,
    ptr: CUdeviceptr,
) -> CUresult {
    api::call("cuPointerSetAttribute", Init::Required, || {
        if attribute != ATTR_SYNC_MEMOPS {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("pointer attribute {attribute} is not settable (only SYNC_MEMOPS is)"),
            ));
        }
        api::non_null(value, "value")?;
        // SAFETY: non-NULL and readable as an unsigned int (caller contract).
        let on = match unsafe { value.cast::<c_uint>().read_unaligned() } {
            0 => false,
            1 => true,
            v => {
                return Err(Fail::misuse(
                    CUresult::CUDA_ERROR_INVALID_VALUE,
                    format!("SYNC_MEMOPS value {v}"),
                ));
            }
        };
        let mut id = 0u64;
        // SAFETY: BUFFER_ID is 8 bytes, written into a local.
        let found = unsafe { cuPointerGetAttribute((&raw mut id).cast(), ATTR_BUFFER_ID, ptr) };
        if found != CUresult::CUDA_SUCCESS {
            return Err(Fail::misuse(
                found,
                format!("{ptr:#x} is not memory CUDA allocated, mapped or registered"),
            ));
        }
        if id == 0 {
            // A reserved address with nothing mapped answers BUFFER_ID 0: there is no memory whose
            // synchronous operations the attribute could change (what a driver answers is not on
            // record; refusing beats accepting a setting that reads back as nothing).
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{ptr:#x} is reserved but nothing is mapped there"),
            ));
        }
        // Marked only while the allocation is known live, under the state lock its frees take
        // to forget the mark: a free between the lookup above and here would otherwise leave a
        // dead id marked for good. A free that won the race is taken to have come after this
        // call (either order is one the program allowed), so there is nothing to mark.
        let st = crate::state::SIM.st.lock();
        if st.find_alloc(ptr).is_some_and(|a| a.buffer_id == id) {
            sync_memops::set(id, on);
        }
        drop(st);
        Ok(())
    })
}
