//! Fault injection. One test function: rules that match any thread would disturb tests running
//! in parallel, so this binary runs them in sequence.

mod common;

use common::*;
use cudarc::driver::sys::{self as cu, CUresult};
use cumem_sim::control::FaultRule;

fn try_alloc() -> (CUresult, u64) {
    let mut p = 0x5151u64;
    // SAFETY: valid out-pointer.
    let r = unsafe { cu::cuMemAlloc_v2(&mut p, 1024) };
    (r, p)
}

#[test]
fn injected_faults_fail_the_chosen_calls_without_side_effects() {
    let ctl = bind(0);
    let before = ctl.violations().len();

    // The 3rd subsequent cuMemAlloc_v2 on this thread fails once with OUT_OF_MEMORY.
    let id = ctl.inject_fault(FaultRule {
        function: "cuMemAlloc_v2".into(),
        nth: 3,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 1,
        this_thread_only: true,
    });
    let a = try_alloc();
    let b = try_alloc();
    let c = try_alloc();
    let d = try_alloc();
    assert_eq!(
        (a.0, b.0, c.0, d.0),
        (
            CUresult::CUDA_SUCCESS,
            CUresult::CUDA_SUCCESS,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_SUCCESS
        )
    );
    assert_eq!(c.1, 0x5151, "a faulted call must not write its out-parameter");
    assert_eq!(ctl.live_report().allocations.iter().filter(|x| [a.1, b.1, d.1].contains(&x.ptr)).count(), 3);
    for p in [a.1, b.1, d.1] {
        dfree(p);
    }
    ctl.remove_fault(id);

    // A thread-scoped rule does not touch other threads' calls.
    let id = ctl.inject_fault(FaultRule {
        function: "cuMemAlloc_v2".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 0,
        this_thread_only: true,
    });
    std::thread::spawn(|| {
        bind(0);
        for _ in 0..3 {
            let (r, p) = try_alloc();
            assert_eq!(r, CUresult::CUDA_SUCCESS);
            dfree(p);
        }
    })
    .join()
    .unwrap();
    for _ in 0..3 {
        assert_eq!(try_alloc().0, CUresult::CUDA_ERROR_OUT_OF_MEMORY, "times = 0 keeps failing");
    }
    ctl.remove_fault(id);
    let (r, p) = try_alloc();
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    dfree(p);

    // An any-thread rule fails the first call on whichever thread makes it.
    ctl.inject_fault(FaultRule::nth_call("cuStreamCreate", 1, CUresult::CUDA_ERROR_UNKNOWN));
    std::thread::spawn(|| {
        bind(0);
        let mut s: cu::CUstream = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: valid out-pointer.
            unsafe { cu::cuStreamCreate(&mut s, 0) },
            CUresult::CUDA_ERROR_UNKNOWN
        );
        assert!(s.is_null());
    })
    .join()
    .unwrap();
    let s = stream(0);
    destroy(s);

    // Faults apply to any exported function, including ones that need no context.
    ctl.inject_fault(FaultRule::nth_call("cuDeviceGetCount", 2, CUresult::CUDA_ERROR_NOT_INITIALIZED));
    let mut n = -1;
    // SAFETY: valid out-pointer.
    unsafe {
        ok(cu::cuDeviceGetCount(&mut n));
        n = -1;
        assert_eq!(cu::cuDeviceGetCount(&mut n), CUresult::CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(n, -1);
        ok(cu::cuDeviceGetCount(&mut n));
    }
    ctl.clear_faults();

    // Injected failures are not misuse: no violations were recorded by any of this.
    assert_eq!(ctl.violations().len(), before);
    ctl.clear_violations();
    assert!(ctl.violations().is_empty());
}
