//! `PinnedBuffer<T>`: page-locked host memory, its flags and host access.
//!
//! `flags_reach_the_driver` reads the flags back with `cuMemHostGetFlags`, which on a real driver
//! reports the flags of the driver's underlying pinned chunk: measured on an H100 (driver
//! 580.159.04), allocations below 2 MiB share chunks, so with another small pinned allocation live
//! (in this thread or another) the flags read back can be that allocation's (8 threads × 2,000
//! allocations of 64 B: 22 % read back another's flags; of 1 MiB: 0.5 %; of 2 MiB: none; one thread
//! allocating and freeing in turn: none). The test therefore allocates 2 MiB per buffer and runs
//! `#[serial]`; the other tests are `#[parallel]`.

use cumem_core::{Device, Error, PinnedBuffer, PinnedFlags, sys};
use cumem_sys::testing;
use serial_test::{parallel, serial};

fn ctx() -> cumem_core::Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

fn driver_flags<T>(buf: &PinnedBuffer<T>) -> u32 {
    let mut flags = 0;
    buf.context().bind().unwrap();
    // SAFETY: `flags` is a valid out-pointer and the pointer is a live pinned allocation.
    let code = unsafe { sys::cuMemHostGetFlags(&mut flags, buf.as_ptr() as *mut _) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    flags
}

#[test]
#[parallel]
fn zeroed_and_from_slice_hold_their_values() {
    let ctx = ctx();
    let z = PinnedBuffer::<u64>::zeroed(&ctx, 1000).unwrap();
    assert_eq!(z.as_slice().unwrap(), &[0; 1000][..]);
    assert_eq!((z.len(), z.bytes(), z.is_empty()), (1000, 8000, false));
    let data: Vec<i16> = (-500..500).collect();
    let mut p = PinnedBuffer::from_slice(&ctx, &data).unwrap();
    assert_eq!(p.to_vec().unwrap(), data);
    p.as_mut_slice().unwrap()[0] = 42;
    assert_eq!(p.as_slice().unwrap()[0], 42);
    p.wait_idle().unwrap();
    assert_eq!(p.context(), &ctx);
    assert!(format!("{p:?}").contains("PinnedBuffer"));
}

#[test]
#[serial] // no other test allocates pinned memory meanwhile (see the module docs)
fn flags_reach_the_driver() {
    const CHUNK: usize = 2 << 20; // a pinned chunk of its own on a real driver (module docs)
    let ctx = ctx();
    let all = PinnedFlags { portable: true, device_mapped: true, write_combined: true };
    for flags in [
        PinnedFlags::default(),
        PinnedFlags { portable: true, ..Default::default() },
        PinnedFlags { write_combined: true, ..Default::default() },
        PinnedFlags { device_mapped: true, ..Default::default() },
        all,
    ] {
        let buf = PinnedBuffer::<u8>::zeroed_with_flags(&ctx, CHUNK, flags).unwrap();
        assert_eq!(buf.flags(), flags);
        let got = driver_flags(&buf);
        // With unified addressing every pinned allocation is reported device-mapped.
        assert_eq!(
            got & !sys::CU_MEMHOSTALLOC_DEVICEMAP,
            flags.bits() & !sys::CU_MEMHOSTALLOC_DEVICEMAP,
            "{flags:?}"
        );
        let copy = PinnedBuffer::from_slice_with_flags(&ctx, &[1u8, 2, 3], flags).unwrap();
        assert_eq!(copy.as_slice().unwrap(), &[1, 2, 3]);
    }
    assert_eq!(all.bits(), 7);
}

#[test]
#[parallel]
fn empty_pinned_buffers_allocate_nothing() {
    let ctx = ctx();
    let mut e = PinnedBuffer::<u32>::zeroed(&ctx, 0).unwrap();
    assert!(e.is_empty());
    assert!(e.as_mut_slice().unwrap().is_empty());
}

#[test]
#[parallel]
fn oversized_pinned_requests_are_errors() {
    let ctx = ctx();
    assert!(matches!(PinnedBuffer::<u64>::zeroed(&ctx, usize::MAX / 2), Err(Error::SizeOverflow { .. })));
}
