//! Mapped and registered host memory, pinned flag combinations, and the devices that lack them.
//!
//! Round trips through asynchronous copies live in cumem-copy's `host_kinds` tests; these cover what
//! core alone does: allocation, device addresses, registration and its errors, host access, and
//! `NotSupported` before any driver call.

use cumem_core::sys::{self, CUresult};
use cumem_core::{
    Context, Device, DeviceBuffer, Error, Feature, HostRegistered, MappedBuffer, PinnedBuffer, PinnedFlags,
    RegisterFlags, Stream, blocking_host_copy,
};
use cumem_sys::testing;

/// Device 1 can neither map nor register host memory (nor allocate managed memory).
const SIM: &str = "devices=2,dev1.managed_memory=0,dev1.can_map_host_memory=0,dev1.host_register_supported=0";

fn ctx(ordinal: usize) -> Option<Context> {
    testing::init_with(SIM);
    let device = Device::get(ordinal).ok()?;
    Some(device.context().unwrap())
}

/// The device without host mapping or registration: the simulator's device 1, or any real device
/// that lacks them.
fn limited() -> Option<Context> {
    testing::init_with(SIM);
    let found = Device::all().unwrap().into_iter().find_map(|d| {
        let caps = d.capabilities().unwrap();
        (!caps.host_mapping && !caps.host_register).then(|| d.context().unwrap())
    });
    if found.is_none() {
        testing::skip("needs a device without host mapping and registration (the simulator's device 1)");
    }
    found
}

#[test]
fn mapped_memory_is_shared_between_host_and_device() {
    let ctx = ctx(0).unwrap();
    let data: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut mapped = MappedBuffer::from_slice(&ctx, &data).unwrap();
    assert!(mapped.flags().device_mapped);
    assert_ne!(mapped.device_ptr(), 0);
    // The device sees the host's bytes through the device address, bitwise.
    assert_eq!(mapped.as_device_slice().to_vec().unwrap(), data);
    // And host writes are what the device reads next.
    let stream = Stream::new(&ctx).unwrap();
    let dev = DeviceBuffer::from_slice(&stream, &[9u32; 4096]).unwrap();
    mapped.as_mut_slice().unwrap().copy_from_slice(&dev.to_vec().unwrap());
    assert_eq!(mapped.as_device_slice().to_vec().unwrap(), vec![9; 4096]);
    // The device address is the one the driver reports for the host pointer.
    let mut dptr = 0;
    ctx.bind().unwrap();
    // SAFETY: valid out-pointer; the host pointer is a live pinned allocation.
    let code = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, mapped.as_ptr() as *mut _, 0) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    assert_eq!(dptr, mapped.device_ptr());
    if let Some(ctl) = testing::sim_control() {
        // By id: another test's pinned allocation may take the freed address at once.
        let id = ctl.live_report().id_of(mapped.as_ptr() as u64).expect("live");
        drop(mapped);
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "leaked instead of freed:\n{live}");
    }
}

#[test]
fn mapped_zero_length_and_overflow() {
    let ctx = ctx(0).unwrap();
    let empty = MappedBuffer::<u64>::zeroed(&ctx, 0).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.device_ptr(), 0);
    assert!(empty.as_slice().unwrap().is_empty());
    assert!(matches!(MappedBuffer::<u64>::zeroed(&ctx, usize::MAX / 2), Err(Error::SizeOverflow { .. })));
}

#[test]
fn registration_pins_a_slice_for_its_scope() {
    let ctx = ctx(0).unwrap();
    let mut data: Vec<u16> = (0..3000).collect();
    let base = data.as_ptr() as u64;
    let total = HostRegistered::scope(&ctx, &mut data, |reg| {
        assert_eq!((reg.len(), reg.bytes()), (3000, 6000));
        if let Some(ctl) = testing::sim_control() {
            assert!(ctl.live_report().contains_registration(base), "{}", ctl.live_report());
        }
        // The driver reports the range as page-locked host memory.
        let mut flags = 0;
        reg.context().bind()?;
        // SAFETY: valid out-pointer; the pointer is inside the live registration.
        let code = unsafe { sys::cuMemHostGetFlags(&mut flags, reg.as_ptr() as *mut _) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
        reg.as_mut_slice()?[0] = 7;
        Ok(reg.as_slice()?.iter().map(|&v| u64::from(v)).sum::<u64>())
    })
    .unwrap();
    assert_eq!(total, 7 + (1..3000u64).sum::<u64>());
    assert_eq!(data[0], 7);
    if let Some(ctl) = testing::sim_control() {
        assert!(!ctl.live_report().contains_registration(base), "unregistered at the end of the scope");
    }
    // Registering again after the scope works: the first registration is gone.
    HostRegistered::scope_with_flags(
        &ctx,
        &mut data,
        RegisterFlags { portable: true, device_mapped: true },
        |reg| {
            assert!(reg.flags().portable && reg.flags().device_mapped);
            Ok(())
        },
    )
    .unwrap();
    // An empty slice registers nothing and is fine.
    HostRegistered::<u8>::scope(&ctx, &mut [], |reg| {
        assert!(reg.is_empty());
        Ok(())
    })
    .unwrap();
}

#[test]
fn overlapping_registrations_are_errors() {
    let ctx = ctx(0).unwrap();
    let mut data = vec![0u8; 1 << 16];
    ctx.bind().unwrap();
    // Someone else (raw driver code) registered the middle of the buffer.
    let middle = data[4096..8192].as_mut_ptr().cast();
    // SAFETY: the range is live host memory, unregistered below before `data` is touched again.
    let code = unsafe { sys::cuMemHostRegister_v2(middle, 4096, 0) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    let err = HostRegistered::scope(&ctx, &mut data, |_| Ok(())).unwrap_err();
    assert!(matches!(err, Error::HostMemoryAlreadyRegistered { .. }), "{err}");
    let err = HostRegistered::scope(&ctx, &mut data[6000..7000], |_| Ok(())).unwrap_err();
    assert!(matches!(err, Error::HostMemoryAlreadyRegistered { .. }), "{err}");
    // SAFETY: `middle` is the base registered above.
    assert_eq!(unsafe { sys::cuMemHostUnregister(middle) }, CUresult::CUDA_SUCCESS);
    HostRegistered::scope(&ctx, &mut data, |_| Ok(())).unwrap();
}

#[test]
fn registering_cuda_memory_is_refused() {
    let ctx = ctx(0).unwrap();
    let pinned = PinnedBuffer::<u8>::zeroed(&ctx, 4096).unwrap();
    // SAFETY: test only: a mutable slice over pinned memory that nothing else touches during the
    // registration attempt (the buffer is not used until the slice is gone).
    let alias = unsafe { std::slice::from_raw_parts_mut(pinned.as_ptr().cast_mut(), 4096) };
    let err = HostRegistered::scope(&ctx, alias, |_| Ok(())).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { .. }), "{err}");
}

#[test]
fn a_plain_slice_is_copied_only_once_the_driver_says_it_is_not_managed() {
    let ctx = ctx(0).unwrap();
    let data = [1u8; 16];
    let mut runs = 0;
    // Pageable memory the driver does not know: its INVALID_VALUE means "not managed".
    blocking_host_copy(&ctx, data.as_ptr().cast(), || {
        runs += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(runs, 1);
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    // Any other failure says nothing about the memory, which may be managed: no copy.
    let rule = ctl.inject_fault(cumem_sys::sim_control::FaultRule {
        function: "cuPointerGetAttribute".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_DEINITIALIZED,
        times: 1,
        this_thread_only: true,
    });
    let err = blocking_host_copy(&ctx, data.as_ptr().cast(), || {
        runs += 1;
        Ok(())
    })
    .unwrap_err();
    ctl.remove_fault(rule);
    assert!(matches!(err, Error::Deinitialized { .. }), "{err}");
    assert_eq!(runs, 1, "copied although the driver could not say whether the slice is managed");
}

#[test]
fn pinned_flag_combinations_hold_their_values() {
    let ctx = ctx(0).unwrap();
    for bits in 0..8u32 {
        let flags = PinnedFlags {
            portable: bits & 1 != 0,
            device_mapped: bits & 2 != 0,
            write_combined: bits & 4 != 0,
        };
        let data: Vec<u8> = (0..=255).collect();
        let mut buf = PinnedBuffer::from_slice_with_flags(&ctx, &data, flags).unwrap();
        assert_eq!(buf.flags().bits(), bits);
        assert_eq!(buf.as_slice().unwrap(), &data[..]);
        buf.as_mut_slice().unwrap().reverse();
        assert_eq!(buf.to_vec().unwrap()[0], 255);
    }
}

#[test]
fn devices_without_the_capability_are_not_supported_before_any_driver_call() {
    let Some(ctx) = limited() else { return };
    let device = Some(ctx.device().ordinal() as i32);
    let ctl = testing::sim_control();
    let rule = ctl.as_ref().map(|ctl| {
        // Any call of these would now fail with UNKNOWN: the errors below must come first.
        let fail = |f: &str| {
            ctl.inject_fault(cumem_sys::sim_control::FaultRule {
                function: f.into(),
                nth: 1,
                code: CUresult::CUDA_ERROR_UNKNOWN,
                times: 0,
                this_thread_only: true,
            })
        };
        [fail("cuMemHostAlloc"), fail("cuMemHostRegister_v2"), fail("cuMemHostGetDevicePointer_v2")]
    });
    let err = MappedBuffer::<u32>::zeroed(&ctx, 16).unwrap_err();
    assert!(
        matches!(err, Error::NotSupported { feature: Feature::HostMapping, device: d } if d == device),
        "{err}"
    );
    let err = PinnedBuffer::<u32>::zeroed_with_flags(
        &ctx,
        16,
        PinnedFlags { device_mapped: true, ..Default::default() },
    )
    .unwrap_err();
    assert!(matches!(err, Error::NotSupported { feature: Feature::HostMapping, .. }), "{err}");
    let mut data = vec![0u32; 16];
    let err = HostRegistered::scope(&ctx, &mut data, |_| Ok(())).unwrap_err();
    assert!(
        matches!(err, Error::NotSupported { feature: Feature::HostRegister, device: d } if d == device),
        "{err}"
    );
    if let (Some(ctl), Some(rules)) = (ctl, rule) {
        rules.into_iter().for_each(|r| ctl.remove_fault(r));
    }
    // Plain pinned memory still works there.
    let plain = PinnedBuffer::from_slice(&ctx, &[1u8, 2]).unwrap();
    assert_eq!(plain.as_slice().unwrap(), &[1, 2]);
}

/// A portable registration on device 0 read by a stream of device 1 (held back by a gate) and by
/// one of device 0; every stream synchronisation on this thread fails, and so does the
/// unregistration (a driver whose `cuMemHostUnregister` does not wait, as the docs allow). The
/// slice must not come back while device 1 still reads it: the drop's fallback synchronises the
/// context of every stream it could not wait for, not only the registration's own.
#[test]
#[serial_test::serial] // holds a gate and injects faults
fn a_failed_wait_does_not_return_a_registered_slice_another_device_still_reads() {
    use cumem_core::HostMemory;
    use std::time::Duration;
    const N: usize = 4096;
    const A: u32 = 0xAAAA_AAAA;
    const B: u32 = 0xBBBB_BBBB;
    let Some(ctx0) = ctx(0) else { return };
    if !testing::needs_devices(2) {
        return;
    }
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let ctx1 = Device::get(1).unwrap().context().unwrap();
    let (s0, s1) = (Stream::non_blocking(&ctx0).unwrap(), Stream::non_blocking(&ctx1).unwrap());
    let (seen0, seen1) =
        (DeviceBuffer::<u32>::zeroed(&s0, N).unwrap(), DeviceBuffer::<u32>::zeroed(&s1, N).unwrap());
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
    /// Queues a copy of the registered values into `dst` on `stream`.
    fn read_into(reg: &HostRegistered<'_, u32>, dst: &DeviceBuffer<u32>, stream: &Stream) {
        // SAFETY: the copy reads `len` values from the pointer it is given on `stream` only, and
        // writes `dst`, a live device buffer of as many values that nothing else uses.
        let queued = unsafe {
            reg.device_read(stream, |src, len| {
                stream.context().bind()?;
                let code = sys::cuMemcpyHtoDAsync_v2(dst.device_ptr(), src.cast(), len * 4, stream.raw());
                assert_eq!(code, CUresult::CUDA_SUCCESS);
                Ok(())
            })
        };
        queued.unwrap();
    }
    let mut data = vec![A; N];
    let ptr = data.as_mut_ptr();
    ctx1.bind().unwrap();
    // SAFETY: `s1` is alive and its context current.
    let gate = unsafe { testing::hold(s1.raw()) };
    let fail = |function: &str, times| {
        ctl.inject_fault(cumem_sys::sim_control::FaultRule {
            function: function.into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_UNKNOWN,
            times,
            this_thread_only: true,
        })
    };
    let opener = gate.release_after(Duration::from_millis(200));
    let flags = RegisterFlags { portable: true, device_mapped: false };
    let result = HostRegistered::scope_with_flags(&ctx0, &mut data, flags, |reg| {
        // Device 1's read is tracked first, so the waits take device 0's stream first.
        read_into(reg, &seen1, &s1);
        read_into(reg, &seen0, &s0);
        let rules = [fail("cuStreamSynchronize", 0), fail("cuMemHostUnregister", 1)];
        Ok(rules)
    });
    ctl.clear_faults();
    assert!(result.is_err(), "every wait for a stream failed");
    // The borrow is back: the program may write the slice at once.
    data.fill(B);
    opener.join().unwrap();
    s1.synchronize().unwrap();
    s0.synchronize().unwrap();
    let read = seen1.to_vec().unwrap();
    let late = read.iter().filter(|&&v| v != A).count();
    assert_eq!(late, 0, "device 1 read {late} of {N} values after the slice was handed back");
    assert_eq!(seen0.to_vec().unwrap(), vec![A; N]);
    // The injected failure left the range registered in the simulator.
    ctx0.bind().unwrap();
    // SAFETY: `ptr` is the base of the range registered above, still registered, and `data`
    // outlives the call.
    let code = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    drop(data);
    assert!(ctl.violations_on_this_thread().is_empty(), "{:?}", ctl.violations_on_this_thread());
}
