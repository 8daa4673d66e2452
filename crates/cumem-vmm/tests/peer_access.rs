//! VMM memory accessible from peer devices (issue 11, item 1): a `GrowableBuffer` made accessible
//! from a peer gives it access to every chunk, those mapped by later growth included, and a device
//! that cannot reach the buffer's is refused before anything is reserved; `Mapping::set_access`
//! with several devices sets each one's access; a peer's own stream works on the buffer through
//! `on_peer` / `on_peer_mut`, and shrinking or dropping waits for that work. Four simulated devices with pairs 0-1 and 2-3
//! linked; on a real machine each test skips, saying so, without the devices it needs.

mod common;

use std::time::Duration;

use common::{granule, hold, misuse_here, pattern, without_any_call, without_calls};
use cumem_core::sys::{self, CUresult};
use cumem_core::{Context, Device, Error, Feature, Stream};
use cumem_sys::testing;
use cumem_vmm::{Access, GrowableBuffer, GrowableConfig, PhysicalMemory, VirtualRange};
use serial_test::{parallel, serial};

const SIM: &str = "devices=4,peer=0-1,2-3";

/// Devices `owner`, `peer` (which can access `owner`'s memory) and `stranger` (which cannot), all
/// with VMM; `None`, saying so, when the machine has no such three.
fn trio() -> Option<(Device, Device, Device)> {
    testing::init_with(SIM);
    let vmm: Vec<Device> =
        Device::all().unwrap().into_iter().filter(|d| d.capabilities().unwrap().virtual_memory).collect();
    for &owner in &vmm {
        let peer = vmm.iter().copied().find(|&d| d != owner && can(d, owner));
        let stranger = vmm.iter().copied().find(|&d| d != owner && !can(d, owner));
        if let (Some(peer), Some(stranger)) = (peer, stranger) {
            return Some((owner, peer, stranger));
        }
    }
    cumem_sys::testing::skip("needs a device with a VMM peer and a VMM device that cannot reach it");
    None
}

/// Whether `d` can access `owner`'s memory (`cuDeviceCanAccessPeer`).
fn can(d: Device, owner: Device) -> bool {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer; both ordinals name existing devices.
    let code = unsafe { sys::cuDeviceCanAccessPeer(&mut v, d.raw(), owner.raw()) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    v != 0
}

/// Copies `len` words at `ptr` to the host with `ctx` current, so that its device is the one
/// reading (the simulator checks that device's access, as a GPU's page tables would).
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

/// Writes `data` at `ptr` with `ctx` current, and waits until the bytes have landed (a pageable
/// copy may return before, §6).
fn write_as(ctx: &Context, ptr: sys::CUdeviceptr, data: &[u32]) {
    ctx.bind().unwrap();
    // SAFETY: `data` is readable for its length; the device range is the caller's.
    let code = unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len() * 4) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
    // SAFETY: plain FFI call on the current context.
    assert_eq!(unsafe { sys::cuCtxSynchronize() }, CUresult::CUDA_SUCCESS);
}

#[test]
#[parallel]
fn a_peer_reads_and_writes_every_chunk_including_those_mapped_by_growth() {
    let Some((owner, peer, _)) = trio() else { return };
    let (ctx, peer_ctx) = (owner.context().unwrap(), peer.context().unwrap());
    let g = granule(owner);
    let per_chunk = g / 4;
    let stream = Stream::non_blocking(&ctx).unwrap();
    let config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(16 * g).accessible_from(&[peer]);
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, per_chunk, config).unwrap();
    assert_eq!(buf.access(), [(owner, Access::ReadWrite), (peer, Access::ReadWrite)]);
    let mut expected = pattern(per_chunk, 1);
    buf.extend_from_slice(&expected).unwrap();
    assert_eq!(buf.mapped_bytes(), g);

    // Growth maps three more chunks after the access was chosen.
    buf.resize(4 * per_chunk, 0xC0DE_0001).unwrap();
    expected.resize(4 * per_chunk, 0xC0DE_0001);
    buf.order().synchronize().unwrap();
    assert_eq!(buf.mapped_bytes(), 4 * g);
    let seen = read_as(&peer_ctx, buf.device_ptr(), buf.len()).expect("the peer cannot read a chunk");
    assert!(seen == expected, "the peer reads other bytes than were written");

    // The peer writes into the newest chunk; the owner reads it through the buffer.
    let news = pattern(per_chunk, 2);
    write_as(&peer_ctx, buf.device_ptr() + 3 * g as u64, &news);
    expected[3 * per_chunk..].copy_from_slice(&news);
    assert!(buf.to_vec().unwrap() == expected, "the owner does not see the peer's write");

    // Growing again, from the host this time: the newest end is the peer's too.
    let more = pattern(2 * per_chunk, 3);
    buf.extend_from_slice(&more).unwrap();
    expected.extend_from_slice(&more);
    let tail = buf.device_ptr() + 4 * g as u64;
    let seen = read_as(&peer_ctx, tail, 2 * per_chunk).expect("the peer cannot read the new end");
    assert!(seen == more);
    // Chunks given back and mapped again get the access again.
    buf.truncate(per_chunk);
    buf.shrink_to_fit().unwrap();
    buf.resize(2 * per_chunk, 7).unwrap();
    buf.order().synchronize().unwrap();
    assert_eq!(read_as(&peer_ctx, buf.device_ptr() + g as u64, per_chunk).unwrap(), vec![7; per_chunk]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());

    let (base, size) = (buf.device_ptr(), buf.range().size());
    drop(buf);
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(!report.mappings.iter().any(|m| m.ptr >= base && m.ptr < base + size as u64));
        assert!(!report.reservations.iter().any(|r| r.ptr == base));
    }
}

#[test]
#[parallel]
fn without_the_peer_a_new_chunk_is_refused_to_it() {
    // What the access on growth prevents: the same buffer without `accessible_from` faults the
    // peer (INVALID_VALUE at the call on the simulator, as a memset on an inaccessible mapping on
    // an H100, §17; a host copy with the peer current is not known to fail on a GPU).
    let Some((owner, peer, _)) = trio() else { return };
    let (ctx, peer_ctx) = (owner.context().unwrap(), peer.context().unwrap());
    let g = granule(owner);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(2 * g);
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config).unwrap();
    buf.extend_from_slice(&pattern(g / 4, 4)).unwrap();
    assert_eq!(buf.access(), [(owner, Access::ReadWrite)]);
    // Only the simulator checks the access of the current context's device on a copy: a GPU's
    // copy engine may well read the owner's memory for a host copy without the peer's access.
    if testing::sim_control().is_some() {
        assert_eq!(read_as(&peer_ctx, buf.device_ptr(), 1), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    }
}

#[test]
#[parallel]
fn a_device_that_cannot_reach_the_buffer_is_refused_before_anything_is_reserved() {
    let Some((owner, peer, stranger)) = trio() else { return };
    let stream = Stream::non_blocking(&owner.context().unwrap()).unwrap();
    let g = granule(owner);
    // Asking the driver whether each device reaches the owner is the one call.
    without_any_call(&["cuDeviceCanAccessPeer"], || {
        for devices in [vec![stranger], vec![peer, stranger]] {
            let config = GrowableConfig::default().chunk_bytes(g).accessible_from(&devices);
            let e = GrowableBuffer::<u8>::with_config(&stream, g, config).unwrap_err();
            assert!(
                matches!(e, Error::NotSupported { feature: Feature::PeerAccess, device: Some(d) } if d == stranger.raw()),
                "{devices:?}: {e}"
            );
        }
    });
    // Repeats and the buffer's own device are no error, and count once.
    let config =
        GrowableConfig::default().chunk_bytes(g).reserve_bytes(g).accessible_from(&[peer, owner, peer]);
    let buf = GrowableBuffer::<u8>::with_config(&stream, g, config).unwrap();
    assert_eq!(buf.access(), [(owner, Access::ReadWrite), (peer, Access::ReadWrite)]);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[parallel]
fn a_stranger_pair_of_its_own_shares_within_the_pair() {
    // The stranger is refused for want of a link to the owner, not for want of links at all.
    let Some((_, _, stranger)) = trio() else { return };
    let Some(partner) = Device::all()
        .unwrap()
        .into_iter()
        .find(|&d| d != stranger && can(d, stranger) && d.capabilities().unwrap().virtual_memory)
    else {
        cumem_sys::testing::skip(format_args!("device {} has no VMM peer", stranger.ordinal()));
        return;
    };
    let ctx = stranger.context().unwrap();
    let g = granule(stranger);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(4 * g).accessible_from(&[partner]);
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config).unwrap();
    let data = pattern(g / 2, 5); // two chunks, mapped by growth
    buf.extend_from_slice(&data).unwrap();
    assert_eq!(read_as(&partner.context().unwrap(), buf.device_ptr(), data.len()).unwrap(), data);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

#[test]
#[parallel]
fn set_access_sets_each_listed_device_and_refuses_a_stranger_before_the_driver() {
    let Some((owner, peer, stranger)) = trio() else { return };
    let ctx = owner.context().unwrap();
    let g = granule(owner);
    let range = VirtualRange::reserve(&ctx, g).unwrap();
    let mut mapping = range.map(0, &PhysicalMemory::new(&ctx, g).unwrap()).unwrap();
    mapping.set_access(&[(owner, Access::ReadWrite), (peer, Access::ReadWrite)]).unwrap();
    assert_eq!(
        (mapping.access(owner).unwrap(), mapping.access(peer).unwrap()),
        (Access::ReadWrite, Access::ReadWrite)
    );
    let data = pattern(g / 4, 6);
    write_as(&peer.context().unwrap(), mapping.device_ptr(), &data);
    assert_eq!(mapping.as_slice::<u32>().unwrap().to_vec().unwrap(), data);

    // Lowering one device leaves the others as they were.
    mapping.set_access(&[(peer, Access::Read)]).unwrap();
    assert_eq!(
        (mapping.access(owner).unwrap(), mapping.access(peer).unwrap()),
        (Access::ReadWrite, Access::Read)
    );
    assert_eq!(read_as(&peer.context().unwrap(), mapping.device_ptr(), g / 4).unwrap(), data);

    // A list with a device that cannot reach the memory changes nobody's access.
    without_any_call(&["cuDeviceCanAccessPeer"], || {
        let e = mapping.set_access(&[(peer, Access::ReadWrite), (stranger, Access::Read)]).unwrap_err();
        assert!(
            matches!(e, Error::NotSupported { feature: Feature::PeerAccess, device: Some(d) } if d == stranger.raw()),
            "{e}"
        );
    });
    assert_eq!(mapping.access(peer).unwrap(), Access::Read);
    assert_eq!(mapping.access(stranger).unwrap(), Access::None);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

/// Queues a memset of `len` words at `ptr` to `value` on `stream`, with `ctx` (the stream's)
/// current.
fn memset_on(ctx: &Context, stream: &Stream, ptr: sys::CUdeviceptr, value: u32, len: usize) {
    ctx.bind().unwrap();
    // SAFETY: the range is a guard's, of `len` words, and the memset is queued on its stream.
    let code = unsafe { sys::cuMemsetD32Async(ptr, value, len, stream.raw()) };
    assert_eq!(code, CUresult::CUDA_SUCCESS);
}

#[test]
#[serial] // holds a gate
fn a_peer_stream_goes_through_on_peer_and_shrink_and_drop_wait_for_it() {
    let Some((owner, peer, stranger)) = trio() else { return };
    let (ctx, peer_ctx) = (owner.context().unwrap(), peer.context().unwrap());
    let g = granule(owner);
    let per_chunk = g / 4;
    let stream = Stream::non_blocking(&ctx).unwrap();
    let peer_stream = Stream::non_blocking(&peer_ctx).unwrap();
    let stranger_stream = Stream::non_blocking(&stranger.context().unwrap()).unwrap();
    let config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(4 * g).accessible_from(&[peer]);
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config).unwrap();
    buf.extend_from_slice(&pattern(2 * per_chunk, 8)).unwrap();

    // `on` keeps to the buffer's device; `on_peer` takes a listed peer's stream and no other.
    let e = buf.on(&peer_stream).unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "{e}");
    without_calls(&["cuStreamWaitEvent", "cuEventRecord"], || {
        let e = buf.on_peer(&stranger_stream).unwrap_err();
        assert!(matches!(e, Error::NotPermitted { .. }), "{e}");
        let e = buf.on_peer_mut(&stranger_stream).unwrap_err();
        assert!(matches!(e, Error::NotPermitted { .. }), "{e}");
    });

    // The peer writes both chunks on its held stream; shrinking unmaps the second only after.
    let base = buf.device_ptr();
    let gate = hold(&peer_stream);
    {
        let on = buf.on_peer_mut(&peer_stream).unwrap();
        assert_eq!((on.device_ptr(), on.len()), (base, 2 * per_chunk));
        memset_on(&peer_ctx, on.stream(), on.device_ptr(), 0xBEEF_0001, on.len());
    }
    buf.truncate(per_chunk);
    let opener = gate.release_after(Duration::from_millis(50));
    buf.shrink_to_fit().unwrap(); // unmapping under the peer's queued memset is logged as misuse
    opener.join().unwrap();
    assert_eq!(buf.mapped_bytes(), g);
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    // The owner's read is ordered after the peer's write, which landed whole.
    assert_eq!(buf.to_vec().unwrap(), vec![0xBEEF_0001; per_chunk]);

    // A read on the peer, then the drop: it waits for the peer's stream too.
    let size = buf.range().size();
    let mut copy = cumem_core::DeviceBuffer::<u32>::zeroed(&peer_stream, per_chunk).unwrap();
    let gate = hold(&peer_stream);
    {
        let on = buf.on_peer(&peer_stream).unwrap();
        let mut dst = copy.as_mut_slice();
        let dst = dst.on(&peer_stream).unwrap();
        peer_ctx.bind().unwrap();
        // SAFETY: both ranges are guards' of `per_chunk` words, the copy is queued on their stream.
        let code = unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), on.device_ptr(), on.bytes(), peer_stream.raw())
        };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
    }
    let opener = gate.release_after(Duration::from_millis(50));
    drop(buf); // unmaps every chunk: must wait for the copy still queued behind the gate
    opener.join().unwrap();
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
    assert_eq!(copy.to_vec().unwrap(), vec![0xBEEF_0001; per_chunk]);
    if let Some(ctl) = testing::sim_control() {
        let report = ctl.live_report();
        assert!(!report.mappings.iter().any(|m| m.ptr >= base && m.ptr < base + size as u64));
    }
}
