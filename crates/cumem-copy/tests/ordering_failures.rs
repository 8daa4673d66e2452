//! Ordering under concurrency and failure: two threads using disjoint halves of one buffer on two
//! streams are both waited for, and a copy whose ordering marker cannot be recorded is refused
//! before anything is queued.
//!
//! The gated tests are `#[serial]` and the others `#[parallel]`: see `common` for why.

mod common;

use std::sync::Barrier;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys::CUresult;
use cumem_core::{Device, DeviceBuffer, MappedBuffer, PinnedBuffer, Stream};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use serial_test::{parallel, serial};

fn ctx() -> cumem_core::Context {
    testing::init_with("latency_us=20000");
    Device::get(0).unwrap().context().unwrap()
}

#[test]
#[serial] // holds a gate
fn host_access_waits_for_both_halves_written_on_two_threads() {
    let ctx = ctx();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut mapped = MappedBuffer::<u32>::zeroed(&ctx, 2048).unwrap();
    let gate = common::hold(&a);
    let barrier = Barrier::new(2);
    {
        let mut view = mapped.as_device_slice_mut();
        let (left, right) = view.split_at_mut(1024).unwrap();
        std::thread::scope(|scope| {
            let (a, b) = (&a, &b);
            // Both threads are ordered before either has queued its fill.
            let barrier = &barrier;
            scope.spawn(move || {
                let mut left = left;
                barrier.wait();
                a.fill(&mut left, 1u32).unwrap();
            });
            scope.spawn(move || {
                let mut right = right;
                barrier.wait();
                b.fill(&mut right, 2u32).unwrap();
            });
        });
    }
    let opener = gate.release_after(Duration::from_millis(100));
    let seen = mapped.as_slice().unwrap().to_vec(); // must wait for a, held back by the gate
    opener.join().unwrap();
    assert!(seen[..1024].iter().all(|&v| v == 1), "host access returned before stream a's fill ran");
    assert!(seen[1024..].iter().all(|&v| v == 2));
}

#[test]
#[parallel]
fn a_copy_whose_ordering_marker_cannot_be_recorded_is_refused_before_anything_is_queued() {
    let ctx = ctx();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let s = Stream::non_blocking(&ctx).unwrap();
    let dev = DeviceBuffer::from_slice(&s, &[7u32; 4096]).unwrap();
    let mut host = PinnedBuffer::<u32>::zeroed(&ctx, 4096).unwrap();
    // The upload ran on the legacy stream: the download on `s` must first wait for it, through a
    // marker recorded on the legacy stream. When that record fails, nothing may be queued (the
    // download would race the upload) and the error must say so.
    let rule = ctl.inject_fault(FaultRule {
        function: "cuEventRecord".into(),
        nth: 1,
        code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
        times: 1,
        this_thread_only: true,
    });
    let queued = s.copy_d2h(&dev, &mut host);
    ctl.remove_fault(rule);
    assert!(
        matches!(queued, Err(cumem_core::Error::Cuda { code: CUresult::CUDA_ERROR_LAUNCH_FAILED, .. })),
        "{queued:?}"
    );
    assert_eq!(host.as_slice().unwrap(), &[0; 4096][..], "a copy was queued without its ordering");
    // Nothing was lost: the same copy queued again is ordered and lands.
    s.copy_d2h(&dev, &mut host).unwrap();
    assert_eq!(host.as_slice().unwrap(), &[7; 4096][..]);
}

#[test]
#[serial] // holds a gate
fn a_host_wait_during_a_live_shared_view_does_not_forget_reads_queued_after_it() {
    let ctx = ctx();
    let s = Stream::non_blocking(&ctx).unwrap();
    let mut mapped = MappedBuffer::<u32>::from_slice(&ctx, &[1; 1024]).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&s, 1024).unwrap();
    let gate = common::hold(&s);
    {
        let view = mapped.as_device_slice();
        mapped.wait_idle().unwrap(); // a host wait while the shared view is alive
        s.copy_d2d(&view, &mut dev).unwrap(); // queued behind the gate: reads the 1s later
    }
    let opener = gate.release_after(Duration::from_millis(100));
    mapped.as_mut_slice().unwrap().fill(2); // must wait for the queued read first
    opener.join().unwrap();
    assert_eq!(
        dev.to_vec().unwrap(),
        vec![1; 1024],
        "the host overwrote the buffer before the device read it"
    );
}
