//! cumem's entry points ([`cumem_sys::api`]) read a driver's code as the C `int` it is, so a
//! driver newer than cudarc's bindings (CUDA 12.8) may return a code they do not know without
//! undefined behaviour: the call is an error, `CUDA_ERROR_UNKNOWN` to the bindings, that keeps the
//! driver's number (`raw`) and shows it. An entry point the driver lacks
//! is `NotSupported` naming it, not a panic. Shown with a stand-in driver whose calls return 36
//! (`CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER` of CUDA 13) and which lacks `cuMemAlloc_v2`, chosen as
//! the real driver in a child process (the driver is chosen once per process, and the library path
//! is read at process start).

use cumem_sys::driver::{self, DriverChoice};
use cumem_sys::testing::stand_in;
use cumem_sys::{Error, ErrorContext, Feature, api, check, sys, testing};

/// Set in the child process.
const CHILD_ENV: &str = "CUMEM_TEST_NEWER_DRIVER_CODES";

/// The stand-in: initialises, has one device, and answers 36 to the calls below; it has no
/// `cuMemAlloc_v2`.
const NEWER_DRIVER: &str = r#"
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 { 0 }
#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut i32) -> i32 { unsafe { *count = 1 }; 0 }
#[no_mangle]
pub extern "C" fn cuDriverGetVersion(version: *mut i32) -> i32 { unsafe { *version = 13000 }; 0 }
#[no_mangle]
pub extern "C" fn cuMemGetInfo_v2(_free: *mut usize, _total: *mut usize) -> i32 { 36 }
#[no_mangle]
pub extern "C" fn cuStreamQuery(_stream: *mut u8) -> i32 { 36 }
"#;

#[test]
fn codes_newer_than_the_bindings_are_errors_and_missing_entry_points_are_not_supported() {
    stand_in::run_child_with_driver("newer-driver-codes", NEWER_DRIVER, "child", CHILD_ENV);
    testing::init();
}

#[test]
fn child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    driver::select(DriverChoice::Real).expect("the stand-in initialises");
    let mut version = 0;
    // SAFETY: a driver is loaded; `version` is a valid out-pointer.
    let code = unsafe { api::cuDriverGetVersion(&mut version) };
    assert_eq!((code, version), (api::Code::SUCCESS, 13000));

    let (mut free, mut total) = (0, 0);
    // SAFETY: a driver is loaded; both are valid out-pointers.
    let code = unsafe { api::cuMemGetInfo_v2(&mut free, &mut total) };
    assert_eq!(code, api::Code(36));
    assert_eq!(code.known(), None, "36 is not a code of the 12.8 bindings");
    let err = check(code, ErrorContext::op("cuMemGetInfo_v2")).unwrap_err();
    assert!(
        matches!(&err, Error::Cuda { code: sys::CUresult::CUDA_ERROR_UNKNOWN, raw: 36, ctx } if ctx.op == "cuMemGetInfo_v2"),
        "{err:?}"
    );
    assert_eq!(err.raw_code(), Some(36));
    assert_eq!(err.to_string(), "CUDA error 36 (unknown to these bindings) in cuMemGetInfo_v2");

    // A call that is answered often (`NOT_READY` while work is pending) gets 36 just the same.
    // SAFETY: the stand-in reads nothing through the handle.
    let code = unsafe { api::cuStreamQuery(std::ptr::null_mut()) };
    assert_eq!(code, api::Code(36));

    let mut ptr = 0;
    // SAFETY: a driver is loaded; `ptr` is a valid out-pointer (the stand-in has no such call).
    let code = unsafe { api::cuMemAlloc_v2(&mut ptr, 256) };
    assert_eq!(code, api::Code::MISSING_ENTRY_POINT);
    let err = check(code, ErrorContext::op("cuMemAlloc_v2")).unwrap_err();
    assert!(matches!(err, Error::NotSupported { feature: Feature::Symbol("cuMemAlloc_v2"), .. }), "{err:?}");
}
