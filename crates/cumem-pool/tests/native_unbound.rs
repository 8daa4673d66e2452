//! `NativePoolResource` calls the pool on a created stream without making its context current
//! first (the stream and the pool name everything the call acts on), and binds and calls again
//! only when the first try failed with a context check's error while another context, or none,
//! was current: any other failure, and a failure with the right context current, stands, exactly
//! as it would have with the bind first.

use cumem_core::sys::CUresult;
use cumem_core::{AllocLayout, Device, DeviceResource, Error, Stream};
use cumem_pool::{MemPool, MemPoolOptions, NativePoolResource};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;

fn ctx() -> cumem_core::Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

/// The calling thread's current context handle (NULL when none).
fn current() -> cumem_core::sys::CUcontext {
    let mut c = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cumem_core::sys::cuCtxGetCurrent(&mut c) }, CUresult::CUDA_SUCCESS);
    c
}

fn layout() -> AllocLayout {
    AllocLayout::new(4096, 1).unwrap()
}

#[test]
fn a_thread_with_no_current_context_allocates_and_frees_without_binding() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("counts driver calls: simulator only");
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(current().is_null(), "a new thread starts with no current context");
            let a = pool.allocate(layout(), &stream).unwrap();
            assert!(ctl.live_report().contains_ptr(a.ptr));
            // SAFETY: `a` came from `pool` with this layout and nothing uses it.
            unsafe { pool.deallocate(a, layout(), &stream) };
            assert_eq!(ctl.calls_on_this_thread("cuMemAllocFromPoolAsync"), 1);
            assert_eq!(ctl.calls_on_this_thread("cuMemFreeAsync"), 1);
            assert_eq!(ctl.calls_on_this_thread("cuCtxSetCurrent"), 0, "nothing was bound");
            assert!(current().is_null());
            assert!(ctl.violations_on_this_thread().is_empty());
        });
    });
    stream.synchronize().unwrap();
}

#[test]
fn a_failure_with_the_context_current_is_not_tried_again() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    ctx.bind().unwrap();
    let before = ctl.calls_on_this_thread("cuMemAllocFromPoolAsync");
    let rule = ctl.inject_fault(FaultRule {
        function: "cuMemAllocFromPoolAsync".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 1,
        this_thread_only: true,
    });
    let err = pool.allocate(layout(), &stream).unwrap_err();
    ctl.remove_fault(rule);
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(ctl.calls_on_this_thread("cuMemAllocFromPoolAsync") - before, 1, "tried once");
}

#[test]
fn a_failure_with_no_context_current_is_tried_again_bound() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(current().is_null());
            // What a driver that wanted the stream's context current would answer.
            let rule = ctl.inject_fault(FaultRule {
                function: "cuMemAllocFromPoolAsync".into(),
                nth: 1,
                code: CUresult::CUDA_ERROR_INVALID_CONTEXT,
                times: 1,
                this_thread_only: true,
            });
            let a = pool.allocate(layout(), &stream).unwrap();
            ctl.remove_fault(rule);
            assert_eq!(ctl.calls_on_this_thread("cuMemAllocFromPoolAsync"), 2, "tried again");
            assert_eq!(current(), ctx.raw(), "bound for the second try");
            // SAFETY: `a` came from `pool` with this layout and nothing uses it.
            unsafe { pool.deallocate(a, layout(), &stream) };
        });
    });
    stream.synchronize().unwrap();
}

#[test]
fn a_free_failing_with_an_error_no_context_check_gives_is_not_tried_again() {
    // `cuMemFreeAsync` may answer an error of earlier asynchronous work (`\notefnerr`) without
    // saying whether it freed the block; freeing it again could free a block the pool has handed
    // out since. Only a context check's answer (which precedes all work) is tried again bound.
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    let a = std::thread::scope(|s| {
        s.spawn(|| {
            assert!(current().is_null());
            let a = pool.allocate(layout(), &stream).unwrap();
            // By id: once freed, its address may be another test's allocation.
            let id = ctl.live_report().id_of(a.ptr).expect("live");
            let rule = ctl.inject_fault(FaultRule {
                function: "cuMemFreeAsync".into(),
                nth: 1,
                code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
                times: 1,
                this_thread_only: true,
            });
            // SAFETY: `a` came from `pool` with this layout and nothing uses it; the free fails
            // (injected), so it is freed once more below.
            unsafe { pool.deallocate(a, layout(), &stream) };
            ctl.remove_fault(rule);
            assert_eq!(ctl.calls_on_this_thread("cuMemFreeAsync"), 1, "not tried again");
            assert!(current().is_null(), "nothing was bound");
            (a, id)
        })
        .join()
        .unwrap()
    });
    stream.synchronize().unwrap();
    let (a, id) = a;
    let live = ctl.live_report();
    assert!(live.contains_allocation(id), "the failed free left the block allocated:\n{live}");
    // SAFETY: the failed free above freed nothing (the fault was injected before any work).
    unsafe { pool.deallocate(a, layout(), &stream) };
    stream.synchronize().unwrap();
    let live = ctl.live_report();
    assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
}

#[test]
fn an_invalid_handle_answer_with_no_context_current_is_tried_again_bound() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let stream = Stream::non_blocking(&ctx).unwrap();
    let pool = NativePoolResource::new(MemPool::create(&ctx, MemPoolOptions::default()).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            let a = pool.allocate(layout(), &stream).unwrap();
            let id = ctl.live_report().id_of(a.ptr).expect("live");
            // What a driver resolving the stream through the current context might answer.
            let rule = ctl.inject_fault(FaultRule {
                function: "cuMemFreeAsync".into(),
                nth: 1,
                code: CUresult::CUDA_ERROR_INVALID_HANDLE,
                times: 1,
                this_thread_only: true,
            });
            // SAFETY: `a` came from `pool` with this layout and nothing uses it.
            unsafe { pool.deallocate(a, layout(), &stream) };
            ctl.remove_fault(rule);
            assert_eq!(ctl.calls_on_this_thread("cuMemFreeAsync"), 2, "tried again");
            assert_eq!(current(), ctx.raw(), "bound for the second try");
            stream.synchronize().unwrap();
            let live = ctl.live_report();
            assert!(!live.contains_allocation(id), "freed by the second try:\n{live}");
        });
    });
}
