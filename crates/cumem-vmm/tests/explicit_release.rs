//! `PhysicalMemory::release` and `VirtualRange::free`: the drop's release and free made at once,
//! their failure returned rather than logged, and never tried a second time by the drop that
//! follows (counted on the simulator, whose fault injection fails them). A range with a live
//! mapping is refused before the driver is called.

mod common;

use common::*;
use cumem_core::Error;
use cumem_core::sys::{CUresult, cuMemAddressFree, cuMemRelease, cuMemUnmap};
use cumem_sys::sim_control::FaultRule;
use cumem_vmm::{PhysicalMemory, VirtualRange};

/// The simulator, or `None` (the skip said why) on a real driver: failures are injected.
fn sim() -> Option<cumem_sim::control::Control> {
    let ctl = cumem_sys::testing::sim_control();
    if ctl.is_none() {
        cumem_sys::testing::skip("injects driver faults: simulator only");
    }
    ctl
}

/// The next call of `function` on this thread fails with `CUDA_ERROR_UNKNOWN`.
fn fails_once_here(function: &str) -> FaultRule {
    FaultRule { this_thread_only: true, ..FaultRule::nth_call(function, 1, CUresult::CUDA_ERROR_UNKNOWN) }
}

#[test]
fn a_release_drops_the_reference_once_and_returns_a_failure_the_drop_does_not_retry() {
    let Some(device) = vmm_device() else { return };
    let Some(ctl) = sim() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let references =
        |handle| ctl.live_report().physical.iter().find(|p| p.handle == handle).map(|p| p.references);

    let memory = PhysicalMemory::new(&ctx, g).unwrap();
    let handle = memory.raw();
    let before = calls("cuMemRelease").unwrap();
    memory.release().unwrap();
    assert_eq!(calls("cuMemRelease").unwrap() - before, 1, "one release, none by the drop");
    assert_eq!(references(handle), None, "freed");

    let memory = PhysicalMemory::new(&ctx, g).unwrap();
    let handle = memory.raw();
    let rule = ctl.inject_fault(fails_once_here("cuMemRelease"));
    let before = calls("cuMemRelease").unwrap();
    let e = memory.release().unwrap_err();
    ctl.remove_fault(rule);
    assert_eq!(e.raw_code(), Some(CUresult::CUDA_ERROR_UNKNOWN as i32), "{e:?}");
    assert_eq!(calls("cuMemRelease").unwrap() - before, 1, "the drop did not try again");
    assert_eq!(references(handle), Some(1), "the reference that failed to go is leaked");
    // SAFETY: the leaked reference of memory nothing maps, released once, here.
    assert_eq!(unsafe { cuMemRelease(handle) }, CUresult::CUDA_SUCCESS);
    assert_eq!(references(handle), None);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
fn a_free_frees_the_range_once_and_returns_a_failure_the_drop_does_not_retry() {
    let Some(device) = vmm_device() else { return };
    let Some(ctl) = sim() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);

    let range = VirtualRange::reserve(&ctx, 2 * g).unwrap();
    let base = range.base();
    let before = calls("cuMemAddressFree").unwrap();
    range.free().unwrap();
    assert_eq!(calls("cuMemAddressFree").unwrap() - before, 1, "one free, none by the drop");
    assert_eq!(sim_reserved(base), Some(false));

    let range = VirtualRange::reserve(&ctx, 2 * g).unwrap();
    let base = range.base();
    let rule = ctl.inject_fault(fails_once_here("cuMemAddressFree"));
    let before = calls("cuMemAddressFree").unwrap();
    let e = range.free().unwrap_err();
    ctl.remove_fault(rule);
    assert_eq!(e.raw_code(), Some(CUresult::CUDA_ERROR_UNKNOWN as i32), "{e:?}");
    assert_eq!(calls("cuMemAddressFree").unwrap() - before, 1, "the drop did not try again");
    assert_eq!(sim_reserved(base), Some(true), "the reservation that failed to go is leaked");
    // SAFETY: the leaked reservation, nothing mapped in it, freed once, here.
    assert_eq!(unsafe { cuMemAddressFree(base, 2 * g) }, CUresult::CUDA_SUCCESS);
    assert_eq!(sim_reserved(base), Some(false));
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

/// A mapping that was leaked (`mem::forget`) is still in the driver: freeing the range is refused
/// with `InvalidValue` naming `VirtualRange::free` before any driver call, and the range is leaked
/// (its drop frees nothing either).
#[test]
fn freeing_a_range_with_a_leaked_mapping_is_refused_before_the_driver_is_called() {
    let Some(device) = vmm_device() else { return };
    let Some(_ctl) = sim() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let range = VirtualRange::reserve(&ctx, 2 * g).unwrap();
    let base = range.base();
    let memory = PhysicalMemory::new(&ctx, g).unwrap();
    std::mem::forget(range.map(0, &memory).unwrap());
    let e = without_any_call(&[], || range.free()).unwrap_err();
    assert!(matches!(&e, Error::InvalidValue { ctx } if ctx.op.contains("VirtualRange::free")), "{e:?}");
    assert_eq!(sim_reserved(base), Some(true), "leaked, not freed");
    // SAFETY: the leaked mapping of `memory` (all of it, at the range's base), which nothing uses,
    // unmapped once; then the leaked reservation, nothing mapped in it any more, freed once.
    unsafe {
        assert_eq!(cuMemUnmap(base, g), CUresult::CUDA_SUCCESS);
        assert_eq!(cuMemAddressFree(base, 2 * g), CUresult::CUDA_SUCCESS);
    }
    drop(memory);
    assert_eq!(sim_reserved(base), Some(false));
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}
