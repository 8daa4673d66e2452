//! Driver selection and probing as a program sees them.

use cumem_sys::driver::{self, DriverChoice, DriverKind};
use cumem_sys::{Error, ErrorContext, Feature, probe, sys, testing};

#[test]
fn the_chosen_driver_stays_chosen() {
    let kind = testing::init();
    assert_eq!(driver::init().unwrap(), kind);
    assert_eq!(driver::current(), Some(kind));
    assert_eq!(driver::select(DriverChoice::Auto).unwrap(), kind, "auto accepts whatever is in use");
    let other = match kind {
        DriverKind::Simulator => DriverChoice::Real,
        DriverKind::Real => DriverChoice::Simulator,
    };
    assert!(matches!(driver::select(other), Err(Error::DriverSelection { .. })));
    assert!(driver::description().unwrap().contains(match kind {
        DriverKind::Simulator => "cumem-sim",
        DriverKind::Real => "CUDA driver",
    }));
}

#[test]
fn optional_symbols_are_probed_not_panicked_on() {
    testing::init();
    assert!(probe::has_symbol("cuMemAlloc_v2"));
    assert!(probe::require("cuMemAlloc_v2").is_ok());
    assert!(!probe::has_symbol("cuThisEntryPointDoesNotExist"));
    assert!(matches!(
        probe::require("cuThisEntryPointDoesNotExist"),
        Err(Error::NotSupported { feature: Feature::Symbol("cuThisEntryPointDoesNotExist"), device: None })
    ));
    assert!(probe::driver_version().unwrap() >= 12000);
}

#[test]
fn driver_codes_come_back_as_named_errors() {
    testing::init();
    let mut dev = 0;
    // SAFETY: `dev` is a valid out-pointer; an out-of-range ordinal is an error, not UB.
    let code = unsafe { sys::cuDeviceGet(&mut dev, 1 << 20) };
    let err = cumem_sys::check(code, ErrorContext::op("cuDeviceGet")).unwrap_err();
    assert!(matches!(err, Error::InvalidDevice { ctx } if ctx.op == "cuDeviceGet"));
    assert_eq!(err.code(), Some(sys::CUresult::CUDA_ERROR_INVALID_DEVICE));
}

#[test]
fn the_simulator_control_interface_is_reachable_on_the_simulator() {
    if testing::init() != DriverKind::Simulator {
        return;
    }
    let ctl = testing::sim_control().expect("the simulator is loaded");
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer; device 0 exists on the simulator.
    let code = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, 0) };
    cumem_sys::check(code, ErrorContext::op("cuDevicePrimaryCtxRetain")).unwrap();
    let listed = ctl.live_report().contexts.into_iter().find(|c| c.handle == ctx as u64);
    // The only context of this binary: no other test here retains one.
    // SAFETY: releases the retain just taken.
    let code = unsafe { sys::cuDevicePrimaryCtxRelease_v2(0) };
    cumem_sys::check(code, ErrorContext::op("cuDevicePrimaryCtxRelease_v2")).unwrap();
    let listed = listed.expect("the retained primary context is in the live report");
    assert_eq!((listed.device, listed.retain_count, listed.primary), (0, 1, true));
    assert!(
        ctl.live_report().contexts.iter().all(|c| c.handle != ctx as u64),
        "a released primary context is still listed as live"
    );
}

#[test]
fn cudarc_calls_the_library_that_was_selected() {
    let kind = testing::init();
    // SAFETY: a driver is selected, so cudarc has its library; only a symbol's presence is read.
    let marked = unsafe { sys::culib().get::<*const ()>(b"cumemSimVersion").is_ok() };
    assert_eq!(marked, kind == DriverKind::Simulator, "cudarc calls a library other than {kind:?}");
}
