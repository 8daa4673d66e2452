//! `cuGetProcAddress_v2` works before `cuInit` (the CUDA runtime finds `cuInit` through it), and
//! the plain names need `cuInit` like every other call. A separate binary: nothing else in this
//! process calls `cuInit` first.

mod common;

use std::ffi::{c_char, c_int, c_uint, c_void};

use common::{load, raw};
use cudarc::driver::sys::CUresult;

type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut u32) -> CUresult;
type Init = unsafe extern "C" fn(c_uint) -> CUresult;
type MemGetInfoV1 = unsafe extern "C" fn(*mut c_uint, *mut c_uint) -> CUresult;

#[test]
fn cu_init_is_found_through_get_proc_address_before_cu_init() {
    let ctl = load();
    ctl.configure("leak_check=1,devices=1").unwrap();
    // SAFETY: the exported prototypes.
    let (get, info): (GetProc, MemGetInfoV1) = unsafe { (raw("cuGetProcAddress_v2"), raw("cuMemGetInfo")) };
    let (mut free, mut total) = (7, 7);
    // SAFETY: valid out-pointers, which must stay untouched.
    assert_eq!(unsafe { info(&mut free, &mut total) }, CUresult::CUDA_ERROR_NOT_INITIALIZED);
    assert_eq!((free, total), (7, 7));
    let mut f: *mut c_void = std::ptr::null_mut();
    let mut status = 9;
    // SAFETY: valid pointers and a NUL-terminated name.
    let r = unsafe { get(c"cuInit".as_ptr(), &mut f, 12080, 0, &mut status) };
    assert_eq!((r, status), (CUresult::CUDA_SUCCESS, 0));
    assert!(!f.is_null());
    // SAFETY: the address of cuInit, whose prototype is `Init`.
    let init: Init = unsafe { std::mem::transmute::<*mut c_void, Init>(f) };
    // SAFETY: plain call.
    assert_eq!(unsafe { init(0) }, CUresult::CUDA_SUCCESS);
    // SAFETY: valid out-pointers.
    let after = unsafe { info(&mut free, &mut total) };
    assert_eq!(after, CUresult::CUDA_ERROR_INVALID_CONTEXT, "needs a context now");
}
