//! `GrowableBuffer` growth that fails part-way: the driver refuses the third `cuMemCreate`,
//! `cuMemMap` or `cuMemSetAccess` of a `resize` (once of a `reserve`, once with a peer in
//! `accessible_from`). What `reserve` documents (the chunks mapped before the failure stay mapped,
//! and counted) and what a caller relies on besides: `len` is unchanged, a chunk whose access could
//! not be set is unmapped again (by the mapping's drop), the values written before are untouched,
//! and a later growth maps the rest. Checked against the simulator's live report (exactly the
//! surviving mappings and physical allocations, each mapped once and released, so that nothing
//! leaks and nothing is mapped without access) and its violation log. Simulator only: the failures
//! are injected.

mod common;

use common::*;
use cumem_core::sys::{self, CUresult};
use cumem_core::{Context, Device, Error, Stream};
use cumem_sim::FaultRule;
use cumem_vmm::{GrowableBuffer, GrowableConfig};
use serial_test::serial;

/// The call of the faulted entry point, counted from the start of the growth, that fails.
const K: usize = 3;

/// Chunks mapped before the failing growth.
const BEFORE: usize = 2;

/// Chunks the failing growth asks for: more than it gets to map.
const WANTED: usize = 8;

/// Chunks the reservation holds.
const RESERVED: usize = 16;

/// Which call grows the buffer.
#[derive(Clone, Copy, Debug)]
enum Growth {
    Resize,
    Reserve,
}

/// The access flags the driver reports for `device` at `ptr` (`cuMemGetAccess`), or its error.
fn access_at(ptr: sys::CUdeviceptr, device: Device) -> Result<u64, CUresult> {
    let location =
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device.raw() };
    let mut flags = 0u64;
    // SAFETY: `flags` is a valid out-pointer and `location` an initialised value that outlives the call.
    let code = unsafe { sys::cuMemGetAccess(&mut flags, &location, ptr) };
    if code == CUresult::CUDA_SUCCESS { Ok(flags) } else { Err(code) }
}

/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const READ_WRITE: u64 = 3;

/// Copies `len` words at `ptr` to the host with `ctx` current, so that its device is the one
/// reading (the simulator checks that device's access).
fn read_as(ctx: &Context, ptr: sys::CUdeviceptr, len: usize) -> Result<Vec<u32>, CUresult> {
    ctx.bind().unwrap();
    let mut out = vec![0u32; len];
    // SAFETY: `out` has room for `len` words; the device range is the caller's, with no work pending.
    let code = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, len * 4) };
    if code != CUresult::CUDA_SUCCESS {
        return Err(code);
    }
    Ok(out)
}

/// The simulator holds, of VMM resources, exactly the reservation of `buf` and `chunks` mappings
/// of one granule each at its start, each of its own physical allocation that nothing but that
/// mapping keeps (`cuMemRelease`d, mapped once); every chunk gives each device of `buf.access()`
/// read-write access. (Nothing is mapped past the last chunk: the mappings are compared whole. The
/// driver is not asked about an unmapped address, which the simulator logs as misuse.)
#[track_caller]
fn assert_exactly_mapped(buf: &GrowableBuffer<u32>, chunks: usize, g: usize, when: &str) {
    let ctl = cumem_sys::testing::sim_control().unwrap();
    let report = ctl.live_report();
    let base = buf.device_ptr();
    let reservations: Vec<(u64, u64)> = report.reservations.iter().map(|r| (r.ptr, r.bytes)).collect();
    assert_eq!(reservations, [(base, (RESERVED * g) as u64)], "{when}: reservations\n{report}");
    let mut mappings: Vec<(u64, u64, u64)> =
        report.mappings.iter().map(|m| (m.ptr, m.bytes, m.offset)).collect();
    mappings.sort_unstable();
    let want: Vec<(u64, u64, u64)> = (0..chunks).map(|i| (base + (i * g) as u64, g as u64, 0)).collect();
    assert_eq!(mappings, want, "{when}: the mappings are not the surviving chunks\n{report}");
    // One physical allocation per mapping, the one it maps: a handle that no mapping holds is one
    // `cuMemCreate` leaked, a reference left one `cuMemRelease` missing.
    let mut mapped_handles: Vec<u64> = report.mappings.iter().map(|m| m.handle).collect();
    let mut physical: Vec<(u64, u64, i32, u32, u32)> =
        report.physical.iter().map(|p| (p.handle, p.bytes, p.device, p.references, p.mappings)).collect();
    mapped_handles.sort_unstable();
    physical.sort_unstable();
    let owner = buf.context().device().raw();
    let want: Vec<(u64, u64, i32, u32, u32)> =
        mapped_handles.iter().map(|&h| (h, g as u64, owner, 0, 1)).collect();
    assert_eq!(physical, want, "{when}: physical allocations other than the chunks'\n{report}");
    for i in 0..chunks {
        for &(device, _) in buf.access() {
            let at = base + (i * g) as u64;
            assert_eq!(
                access_at(at, device),
                Ok(READ_WRITE),
                "{when}: chunk {i} is not read-write for device {}",
                device.ordinal()
            );
        }
    }
}

/// Grows a buffer of [`BEFORE`] chunks holding data towards [`WANTED`] chunks while the driver
/// refuses the [`K`]th call of `function` on this thread, and checks what the buffer and the
/// simulator hold afterwards, then that the next growth succeeds and the buffer works; with
/// `peer`, every chunk is also the peer's, and the peer reads all of them at the end.
fn fail_growth_at_the_kth(function: &str, growth: Growth, peer: Option<Device>) {
    let Some(device) = vmm_device() else { return };
    let Some(ctl) = cumem_sys::testing::sim_control() else {
        return cumem_sys::testing::skip("injects driver faults: simulator only");
    };
    let before = ctl.live_report();
    assert!(
        before.reservations.is_empty() && before.physical.is_empty() && before.mappings.is_empty(),
        "left by an earlier test: {before}"
    );
    let ctx = device.context().unwrap();
    let g = granule(device);
    let per_chunk = g / size_of::<u32>();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(RESERVED * g);
    if let Some(peer) = peer {
        config = config.accessible_from(&[peer]);
    }
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config).unwrap();
    let base = buf.device_ptr();
    // Across the boundary of the two chunks, and ending inside the second: the failed growth
    // starts from a partly filled chunk.
    let data = pattern((BEFORE - 1) * per_chunk + per_chunk / 2 + 7, 0x5EED);
    buf.extend_from_slice(&data).unwrap();
    assert_eq!(buf.mapped_bytes(), BEFORE * g);
    assert_exactly_mapped(&buf, BEFORE, g, "before the growth");

    let calls_before = calls(function).unwrap();
    let fault = ctl.inject_fault(FaultRule {
        function: function.into(),
        nth: K as u64,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 1,
        this_thread_only: true,
    });
    let wanted = WANTED * per_chunk;
    let result = match growth {
        Growth::Resize => buf.resize(wanted, 0xFEED_F00D),
        Growth::Reserve => buf.reserve(wanted - data.len()),
    };
    ctl.remove_fault(fault);
    let e = result.unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { report: None, .. }), "{growth:?}, {function}: {e}");
    assert_eq!(
        calls(function).unwrap() - calls_before,
        K as u64,
        "{growth:?}: {function} was not called exactly up to the failing call"
    );

    // The K - 1 chunks mapped before the failing call stay, and are counted.
    let survived = BEFORE + K - 1;
    let when = format!("after the {growth:?} failed at {function} #{K}");
    assert_eq!(buf.device_ptr(), base, "{when}: the buffer moved");
    assert_eq!(buf.len(), data.len(), "{when}: a failed growth changed the length");
    assert_eq!(buf.mapped_bytes(), survived * g, "{when}: mapped bytes");
    assert_eq!(buf.capacity(), survived * per_chunk, "{when}: capacity");
    assert_exactly_mapped(&buf, survived, g, &when);
    assert!(buf.to_vec().unwrap() == data, "{when}: the values written before changed");
    let misuse = misuse_here();
    assert!(misuse.is_empty(), "{when}: {misuse:?}");

    // The same growth again, without the fault: it maps the rest, the failed chunk's place too.
    buf.resize(wanted, 0xFEED_F00D).unwrap();
    assert_eq!((buf.len(), buf.mapped_bytes()), (wanted, WANTED * g));
    assert_exactly_mapped(&buf, WANTED, g, "after the growth that succeeded");
    let v = buf.to_vec().unwrap();
    assert!(v[..data.len()] == data[..], "the values written before the failure changed");
    assert!(v[data.len()..].iter().all(|&x| x == 0xFEED_F00D), "a filled value differs");
    // A round trip over every chunk.
    let fresh = pattern(wanted, 0xF00D);
    buf.clear();
    buf.extend_from_slice(&fresh).unwrap();
    assert!(buf.to_vec().unwrap() == fresh, "a round trip through every chunk differs");
    if let Some(peer) = peer {
        let seen = read_as(&peer.context().unwrap(), base, wanted).expect("the peer cannot read a chunk");
        assert!(seen == fresh, "the peer reads other bytes than were written");
    }
    let misuse = misuse_here();
    assert!(misuse.is_empty(), "{misuse:?}");
    drop(buf);
    let report = ctl.live_report();
    assert!(
        report.reservations.is_empty() && report.physical.is_empty() && report.mappings.is_empty(),
        "left by the buffer's drop: {report}"
    );
}

#[test]
#[serial] // injects faults and reads the whole live report, which parallel tests would change
fn a_resize_whose_third_cu_mem_create_fails_keeps_the_two_chunks_before() {
    fail_growth_at_the_kth("cuMemCreate", Growth::Resize, None);
}

#[test]
#[serial] // as above
fn a_resize_whose_third_cu_mem_map_fails_keeps_the_two_chunks_before_and_releases_the_third() {
    fail_growth_at_the_kth("cuMemMap", Growth::Resize, None);
}

#[test]
#[serial] // as above
fn a_resize_whose_third_cu_mem_set_access_fails_unmaps_the_third_chunk() {
    fail_growth_at_the_kth("cuMemSetAccess", Growth::Resize, None);
}

#[test]
#[serial] // as above
fn a_reserve_whose_third_cu_mem_map_fails_keeps_the_two_chunks_before() {
    fail_growth_at_the_kth("cuMemMap", Growth::Reserve, None);
}

#[test]
#[serial] // as above
fn a_resize_for_a_peer_whose_third_cu_mem_set_access_fails_leaves_no_chunk_without_the_peers_access() {
    let Some(device) = vmm_device() else { return };
    let Some(peer) = peer_of(device) else { return };
    fail_growth_at_the_kth("cuMemSetAccess", Growth::Resize, Some(peer));
}
