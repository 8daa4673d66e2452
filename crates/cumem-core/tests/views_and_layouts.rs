//! The remaining public surface of buffers and views: raw construction, view accessors,
//! consuming view splits and capability queries.

use std::sync::Arc;

use cumem_core::{
    Capabilities, Device, DeviceBuffer, DeviceSlice, DeviceSliceMut, DriverResource, Error, Stream,
};
use cumem_sys::testing;

fn stream() -> Stream {
    testing::init();
    Stream::new(&Device::get(0).unwrap().context().unwrap()).unwrap()
}

#[test]
fn uninit_buffers_become_valid_once_written() {
    let s = stream();
    let r = Arc::new(DriverResource::new(s.context()));
    // SAFETY: every element is written below before the contents are read.
    let mut buf = unsafe { DeviceBuffer::<u32>::uninit_in(&r, &s, 64) }.unwrap();
    let filled = DeviceBuffer::from_slice(&s, &[0x5555_5555u32; 64]).unwrap();
    {
        let legacy = s.context().default_stream();
        let _src = filled.order().use_on(&legacy).unwrap();
        let _dst = buf.order().use_on(&legacy).unwrap();
        s.context().bind().unwrap();
        // SAFETY: both are live 256-byte device allocations; the copy runs on the legacy stream,
        // which both buffers are ordered on while the tickets are held.
        let code = unsafe { cumem_core::sys::cuMemcpyDtoD_v2(buf.device_ptr(), filled.device_ptr(), 256) };
        assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
    }
    assert_eq!(buf.to_vec().unwrap(), vec![0x5555_5555; 64]);
    assert_eq!(buf.as_mut_slice().len(), 64);
}

#[test]
fn views_stay_send_sync_and_covariant_in_their_lifetime() {
    // Public API: an exclusive view (whichever way it reaches its order) may be sent to and
    // shared with scoped threads, and passed where a shorter-lived view is expected.
    fn send_sync<V: Send + Sync>() {}
    send_sync::<DeviceSlice<'static, u32>>();
    send_sync::<DeviceSliceMut<'static, u32>>();
    fn shorten<'long: 'short, 'short>(view: DeviceSliceMut<'long, u32>) -> DeviceSliceMut<'short, u32> {
        view
    }
    let s = stream();
    let mut buf = DeviceBuffer::<u32>::from_slice(&s, &[1, 2, 3, 4]).unwrap();
    let view = shorten(buf.as_mut_slice());
    assert_eq!(view.to_vec().unwrap(), [1, 2, 3, 4]);
}

#[test]
fn view_accessors_describe_the_viewed_memory() {
    let s = stream();
    let mut buf = DeviceBuffer::from_slice(&s, &(0..64u32).collect::<Vec<_>>()).unwrap();
    let base = buf.device_ptr();
    let v = buf.slice(8..24).unwrap();
    assert_eq!((v.len(), v.bytes(), v.is_empty()), (16, 64, false));
    assert_eq!(v.device_ptr(), base + 32);
    assert_eq!(v.context(), s.context());
    assert_eq!(v.order().last().unwrap(), buf.order().last().unwrap());
    assert_eq!(v.cast::<u8>().unwrap().len(), 64);
    assert_eq!(v.chunks(5).unwrap().map(|c| c.len()).sum::<usize>(), 16);
    assert!(format!("{v:?}").contains("len: 16"));
    let m = buf.as_mut_slice();
    assert_eq!((m.bytes(), m.device_ptr(), m.is_empty()), (256, base, false));
    assert_eq!(m.context(), s.context());
    assert_eq!(m.slice(1..2).unwrap().to_vec().unwrap(), [1]);
    assert_eq!(m.split_at(10).unwrap().1.len(), 54);
    assert_eq!(m.chunks(32).unwrap().len(), 2);
    assert!(format!("{m:?}").contains("DeviceSliceMut"));
    let (a, b) = m.into_split_at_mut(16).unwrap();
    assert_eq!((a.len(), b.len()), (16, 48));
    let tail = b.into_slice_mut(40..).unwrap();
    assert_eq!(tail.to_vec().unwrap(), (56..64).collect::<Vec<u32>>());
    let mut chunks = buf.as_mut_slice().into_chunks_mut(60).unwrap();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks.next().unwrap().len(), 60);
    assert_eq!(chunks.next().unwrap().to_vec().unwrap(), [60, 61, 62, 63]);
    assert!(chunks.next().is_none());
    assert!(matches!(buf.as_mut_slice().into_chunks_mut(0), Err(Error::ZeroSize { .. })));
    assert!(matches!(buf.as_mut_slice().into_split_at_mut(65), Err(Error::OutOfRange { .. })));
}

#[test]
fn capabilities_can_be_queried_directly() {
    testing::init();
    let d = Device::get(0).unwrap();
    assert_eq!(Capabilities::query(d).unwrap(), d.capabilities().unwrap());
}

/// The doors make the stream's context current: on a thread that never bound one, a raw memset
/// queued through `queue_on` (or a guard from `on`) runs, and its bytes round-trip.
#[test]
fn raw_work_through_a_door_runs_on_a_fresh_thread() {
    let s = stream();
    let mut buf = DeviceBuffer::<u8>::zeroed(&s, 256).unwrap();
    let worker = s.clone();
    let last = s.clone();
    let buf = std::thread::spawn(move || {
        // Used on `worker` already: the door waits for nothing, so nothing else binds a context.
        let code = buf
            .as_mut_slice()
            .queue_on(&worker, |ptr| {
                // SAFETY: `ptr` is the buffer's 256 bytes, ordered on `worker`.
                Ok(unsafe { cumem_core::sys::cuMemsetD8Async(ptr, 0xAB, 256, worker.raw()) })
            })
            .unwrap();
        assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
        buf
    })
    .join()
    .unwrap();
    assert_eq!(buf.to_vec().unwrap(), [0xAB; 256]);
    let buf = std::thread::spawn(move || {
        let mut buf = buf;
        {
            let mut view = buf.as_mut_slice();
            let on = view.on(&s).unwrap();
            // SAFETY: the guard's 256 bytes, ordered on its stream.
            let code =
                unsafe { cumem_core::sys::cuMemsetD8Async(on.device_ptr(), 0xCD, 256, on.stream().raw()) };
            assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
        }
        buf
    })
    .join()
    .unwrap();
    assert_eq!(buf.to_vec().unwrap(), [0xCD; 256]);
    // The halves of a split share the order through its lock (`StreamOrder::queue_on`).
    let worker = last;
    let buf = std::thread::spawn(move || {
        let mut buf = buf;
        {
            let mut whole = buf.as_mut_slice();
            let (mut low, _) = whole.split_at_mut(128).unwrap();
            let code = low
                .queue_on(&worker, |ptr| {
                    // SAFETY: `ptr` is the low half's 128 bytes, ordered on `worker`.
                    Ok(unsafe { cumem_core::sys::cuMemsetD8Async(ptr, 0xEF, 128, worker.raw()) })
                })
                .unwrap();
            assert_eq!(code, cumem_core::sys::CUresult::CUDA_SUCCESS);
        }
        buf
    })
    .join()
    .unwrap();
    let bytes = buf.to_vec().unwrap();
    assert!(bytes[..128].iter().all(|&b| b == 0xEF) && bytes[128..].iter().all(|&b| b == 0xCD));
}
