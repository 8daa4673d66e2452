//! `DeviceBuffer<T>` and its views: allocation, round trips, views, casts, errors, and freeing.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::sys::CUresult;
use cumem_core::{
    AllocLayout, Allocation, AsDeviceSlice, AsDeviceSliceMut, Context, Device, DeviceBuffer, DeviceResource,
    DriverResource, Error, HostAccess, Stream, StreamOrder,
};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;

fn stream() -> Stream {
    testing::init();
    Stream::new(&Device::get(0).unwrap().context().unwrap()).unwrap()
}

#[test]
fn from_slice_round_trips_bitwise() {
    let s = stream();
    let data: Vec<f64> =
        (0..10_000).map(|i| f64::from_bits(0x3ff0_0000_0000_0000 ^ (i as u64 * 0x9e37_79b9))).collect();
    let buf = DeviceBuffer::from_slice(&s, &data).unwrap();
    assert_eq!((buf.len(), buf.bytes(), buf.is_empty()), (10_000, 80_000, false));
    let back = buf.to_vec().unwrap();
    assert!(back.iter().zip(&data).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(buf.context(), s.context());
    assert!(format!("{buf:?}").contains("len: 10000"));
}

#[test]
fn zeroed_is_zero_and_new_has_the_requested_length() {
    let s = stream();
    let z = DeviceBuffer::<u32>::zeroed(&s, 4099).unwrap();
    assert_eq!(z.to_vec().unwrap(), vec![0; 4099]);
    let n = DeviceBuffer::<u16>::new(&s, 77).unwrap();
    assert_eq!(n.to_vec().unwrap().len(), 77);
    assert_ne!(n.device_ptr(), 0);
    assert_eq!(n.device_ptr() % 256, 0, "cuMemAlloc memory is at least 256-byte aligned");
}

#[test]
fn device_pointers_are_not_host_memory() {
    let s = stream();
    let buf = DeviceBuffer::<u8>::zeroed(&s, 4096).unwrap();
    if testing::sim_control().is_some() {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let p = buf.device_ptr();
        let readable = maps.lines().any(|l| {
            let mut it = l.split_whitespace();
            let range = it.next().unwrap();
            let perms = it.next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
            a <= p && p < b && perms.starts_with('r')
        });
        assert!(!readable, "device pointer {p:#x} is a readable host address");
    }
}

#[test]
fn empty_buffers_allocate_nothing() {
    let s = stream();
    let e = DeviceBuffer::<u64>::from_slice(&s, &[]).unwrap();
    assert!(e.is_empty());
    assert_eq!((e.len(), e.bytes(), e.device_ptr()), (0, 0, 0));
    assert_eq!(e.to_vec().unwrap(), Vec::<u64>::new());
    let z = DeviceBuffer::<u64>::zeroed(&s, 0).unwrap();
    assert_eq!(z.chunks(3).unwrap().count(), 0);
}

#[test]
fn sizes_that_overflow_are_errors() {
    let s = stream();
    assert!(matches!(
        DeviceBuffer::<u64>::zeroed(&s, usize::MAX / 4),
        Err(Error::SizeOverflow { elem_size: 8, .. })
    ));
    assert!(matches!(AllocLayout::new(0, 8), Err(Error::ZeroSize { .. })));
    assert!(matches!(AllocLayout::new(8, 3), Err(Error::InvalidValue { .. })));
    assert!(matches!(AllocLayout::new(8, 0), Err(Error::ZeroSize { what: "alignment" })));
    assert_eq!(AllocLayout::array::<u32>(3).unwrap(), AllocLayout { bytes: 12, align: 4 });
}

#[test]
fn more_than_the_device_has_is_out_of_memory() {
    let s = stream();
    let total = s.context().device().total_memory().unwrap();
    let err = DeviceBuffer::<u8>::zeroed(&s, total + 1).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { ctx, .. } if ctx.bytes == Some(total + 1)), "{err}");
}

#[test]
fn an_injected_allocation_failure_surfaces_as_out_of_memory_and_leaks_nothing() {
    let s = stream();
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let rule = ctl.inject_fault(FaultRule {
        function: "cuMemAlloc_v2".into(),
        nth: 2,
        code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        times: 1,
        this_thread_only: true,
    });
    let first = DeviceBuffer::<u32>::zeroed(&s, 1000).unwrap();
    let err = DeviceBuffer::<u32>::zeroed(&s, 1000).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { ctx, .. } if ctx.op == "cuMemAlloc_v2" && ctx.bytes == Some(4000))
    );
    let third = DeviceBuffer::<u32>::zeroed(&s, 1000).unwrap();
    ctl.remove_fault(rule);
    let before = ctl.live_report();
    let [p1, p3] = [first.device_ptr(), third.device_ptr()].map(|p| before.id_of(p).expect("live"));
    drop((first, third));
    let report = ctl.live_report();
    assert!(!report.contains_allocation(p1) && !report.contains_allocation(p3), "{report}");
}

#[test]
fn dropping_on_a_thread_that_never_touched_cuda_frees_the_memory() {
    let s = stream();
    let buf = DeviceBuffer::from_slice(&s, &[1u8; 4096]).unwrap();
    // By id: once freed, its address may be another test's allocation.
    let id = testing::sim_control().map(|ctl| ctl.live_report().id_of(buf.device_ptr()).expect("live"));
    std::thread::spawn(move || drop(buf)).join().unwrap();
    if let (Some(ctl), Some(id)) = (testing::sim_control(), id) {
        let live = ctl.live_report();
        assert!(!live.contains_allocation(id), "the buffer was not freed:\n{live}");
        assert!(ctl.violations_on_this_thread().is_empty());
    }
}

#[test]
fn views_slice_split_and_chunk_like_std_slices() {
    let s = stream();
    let data: Vec<u16> = (0..100).collect();
    let mut buf = DeviceBuffer::from_slice(&s, &data).unwrap();
    assert_eq!(buf.slice(10..20).unwrap().to_vec().unwrap(), data[10..20]);
    assert_eq!(buf.slice(..).unwrap().len(), 100);
    assert_eq!(buf.slice(95..).unwrap().slice(1..=2).unwrap().to_vec().unwrap(), [96, 97]);
    let (a, b) = buf.split_at(30).unwrap();
    assert_eq!((a.len(), b.len()), (30, 70));
    assert_eq!(b.device_ptr(), a.device_ptr() + 60);
    assert_eq!(b.split_at(70).unwrap().1.len(), 0);
    let chunks: Vec<Vec<u16>> = buf.chunks(40).unwrap().map(|c| c.to_vec().unwrap()).collect();
    assert_eq!(chunks, vec![data[..40].to_vec(), data[40..80].to_vec(), data[80..].to_vec()]);
    assert_eq!(buf.chunks(40).unwrap().len(), 3);
    {
        let mut whole = buf.as_mut_slice();
        assert_eq!(whole.len(), 100);
        let (mut left, right) = whole.split_at_mut(50).unwrap();
        assert_eq!((left.len(), right.len()), (50, 50));
        assert_eq!(left.slice_mut(5..10).unwrap().len(), 5);
        assert_eq!(left.chunks_mut(16).unwrap().map(|c| c.len()).collect::<Vec<_>>(), [16, 16, 16, 2]);
        assert_eq!(left.reborrow().as_slice().to_vec().unwrap(), data[..50]);
    }
    assert_eq!(buf.slice_mut(1..3).unwrap().to_vec().unwrap(), [1, 2]);
    let (x, y) = buf.split_at_mut(99).unwrap();
    assert_eq!((x.len(), y.to_vec().unwrap()), (99, vec![99]));
    assert_eq!(buf.chunks_mut(50).unwrap().count(), 2);
    assert_eq!(buf.as_device_slice().len(), buf.as_device_slice_mut().len());
}

#[test]
fn views_out_of_range_are_errors_not_panics() {
    let s = stream();
    let mut buf = DeviceBuffer::<u8>::zeroed(&s, 10).unwrap();
    assert!(matches!(buf.slice(5..11), Err(Error::OutOfRange { start: 5, end: 11, len: 10 })));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = buf.slice(7..3);
    assert!(matches!(backwards, Err(Error::OutOfRange { .. })));
    assert!(matches!(buf.split_at(11), Err(Error::OutOfRange { .. })));
    assert!(matches!(buf.split_at_mut(11), Err(Error::OutOfRange { .. })));
    assert!(matches!(buf.slice_mut(..=10), Err(Error::OutOfRange { .. })));
    assert!(matches!(buf.chunks(0), Err(Error::ZeroSize { .. })));
    assert!(matches!(buf.chunks_mut(0), Err(Error::ZeroSize { .. })));
    let view = buf.slice(2..4).unwrap();
    assert!(matches!(view.slice(0..3), Err(Error::OutOfRange { len: 2, .. })));
}

#[test]
fn cast_reinterprets_bytes_and_checks_sizes() {
    let s = stream();
    let words = DeviceBuffer::from_slice(&s, &[0x0403_0201u32, 0x0807_0605]).unwrap();
    let bytes = words.cast::<u8>().unwrap();
    assert_eq!(bytes.to_vec().unwrap(), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(bytes.slice(4..).unwrap().cast::<u32>().unwrap().to_vec().unwrap(), [0x0807_0605]);
    assert!(matches!(
        bytes.slice(1..5).unwrap().cast::<u32>(),
        Err(Error::Misaligned { what: "device address", .. })
    ));
    let odd = DeviceBuffer::from_slice(&s, &[1u8, 2, 3]).unwrap();
    assert!(matches!(odd.cast::<u16>(), Err(Error::Misaligned { what: "byte length", .. })));
}

/// A resource adaptor that counts, to observe what buffers do with their resource.
#[derive(Debug)]
struct Counting {
    inner: DriverResource,
    live: AtomicUsize,
    freed_on_legacy: AtomicUsize,
}

// SAFETY: forwards to the driver resource, which upholds the contract.
unsafe impl DeviceResource for Counting {
    fn context(&self) -> &Context {
        self.inner.context()
    }
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<Allocation> {
        let p = self.inner.allocate(layout, stream)?;
        self.live.fetch_add(1, Ordering::SeqCst);
        Ok(p)
    }
    unsafe fn deallocate(&self, alloc: Allocation, layout: AllocLayout, stream: &Stream) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        if stream.is_legacy() {
            self.freed_on_legacy.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged from our caller.
        unsafe { self.inner.deallocate(alloc, layout, stream) }
    }
}

#[test]
fn buffers_return_memory_to_their_resource_on_the_last_stream() {
    let s = stream();
    let counting = Arc::new(Counting {
        inner: DriverResource::new(s.context()),
        live: AtomicUsize::new(0),
        freed_on_legacy: AtomicUsize::new(0),
    });
    let resource = counting.clone();
    let a = DeviceBuffer::<u8>::zeroed_in(&resource, &s, 100).unwrap();
    let b = DeviceBuffer::<u8>::new_in(&resource, &s, 100).unwrap();
    let c = DeviceBuffer::from_slice_in(&resource, &s, &[9u8; 100]).unwrap();
    assert_eq!(counting.live.load(Ordering::SeqCst), 3);
    assert!(std::ptr::addr_eq(Arc::as_ptr(a.resource()), Arc::as_ptr(&resource)));
    assert_eq!(a.order().last().unwrap(), s);
    assert!(c.order().last().unwrap().is_legacy(), "the upload ran on the legacy stream");
    drop((a, b));
    assert_eq!(counting.freed_on_legacy.load(Ordering::SeqCst), 0);
    drop(c);
    assert_eq!(counting.live.load(Ordering::SeqCst), 0);
    assert_eq!(counting.freed_on_legacy.load(Ordering::SeqCst), 1);
}

#[test]
fn larger_alignments_are_honoured_by_the_driver_resource() {
    let s = stream();
    let r = DriverResource::new(s.context());
    for align in [512usize, 4096, 65536] {
        let layout = AllocLayout::new(1000, align).unwrap();
        let p = r.allocate(layout, &s).unwrap();
        assert_eq!(p.ptr % align as u64, 0);
        // SAFETY: allocated just above with this layout, unused.
        unsafe { r.deallocate(p, layout, &s) };
    }
    assert!(matches!(r.allocate(AllocLayout { bytes: 0, align: 8 }, &s), Err(Error::ZeroSize { .. })));
}

#[test]
fn a_resource_of_another_device_is_refused() {
    let s = stream();
    if !testing::needs_devices(2) {
        return;
    }
    let other = Arc::new(DriverResource::new(&Device::get(1).unwrap().context().unwrap()));
    assert!(matches!(
        DeviceBuffer::<u8>::zeroed_in(&other, &s, 8),
        Err(Error::WrongDevice { expected: 1, actual: 0 })
    ));
}

#[test]
fn an_empty_buffer_with_a_resource_of_another_device_is_refused_too() {
    let s = stream();
    if !testing::needs_devices(2) {
        return;
    }
    let other = Arc::new(DriverResource::new(&Device::get(1).unwrap().context().unwrap()));
    assert!(matches!(
        DeviceBuffer::<u8>::new_in(&other, &s, 0),
        Err(Error::WrongDevice { expected: 1, actual: 0 })
    ));
    let here = Arc::new(DriverResource::new(s.context()));
    let there = Stream::new(&Device::get(1).unwrap().context().unwrap()).unwrap();
    assert!(matches!(
        DeviceBuffer::<u32>::zeroed_in(&here, &there, 0),
        Err(Error::WrongDevice { expected: 0, actual: 1 })
    ));
}

#[test]
fn a_later_use_is_ordered_after_earlier_ones_and_covers_them() {
    let s = stream();
    let t = Stream::non_blocking(s.context()).unwrap();
    let order = StreamOrder::new(&s);
    assert_eq!((order.last().unwrap(), order.users().unwrap()), (s.clone(), 1));
    drop(order.use_on(&t).unwrap());
    assert_eq!(
        (order.last().unwrap(), order.users().unwrap()),
        (t.clone(), 1),
        "t waited for s, so t alone stands for both"
    );
    drop(order.use_on(&t).unwrap());
    assert_eq!(order.users().unwrap(), 1);
}

#[test]
fn the_stream_of_a_ticket_not_dropped_counts_as_a_user() {
    let s = stream();
    let c = Stream::non_blocking(s.context()).unwrap();
    let order = StreamOrder::new(&s);
    let held = order.use_on(&c).unwrap();
    assert_eq!(order.users().unwrap(), 2, "c may be queueing work on the memory");
    drop(held);
    assert_eq!(order.users().unwrap(), 1, "c waited for s, so c alone stands for both");
    // A forgotten ticket is never recorded: its stream stays a user (counted once, however many).
    std::mem::forget(order.use_on(&s).unwrap());
    std::mem::forget(order.use_on(&s).unwrap());
    std::mem::forget(order.use_on(&c).unwrap());
    assert_eq!(order.users().unwrap(), 2);
    order.synchronize().unwrap();
}

#[test]
fn uses_in_flight_on_two_streams_at_once_are_both_tracked() {
    let s = stream();
    let (a, b) = (Stream::non_blocking(s.context()).unwrap(), Stream::non_blocking(s.context()).unwrap());
    let order = StreamOrder::new(&s);
    // Two threads using disjoint halves: both are ordered before either has queued its work.
    let on_a = order.use_on(&a).unwrap();
    let on_b = order.use_on(&b).unwrap();
    drop(on_a);
    drop(on_b);
    assert_eq!(order.users().unwrap(), 2, "b was not ordered after a's work, so both must be waited for");
    let joined = order.join().unwrap();
    assert_eq!(joined, b);
    assert_eq!(order.users().unwrap(), 1);
    order.synchronize().unwrap();
}

#[test]
fn a_ticket_dropped_inside_queue_on_of_its_order_is_recorded_when_the_closure_returns() {
    let s = stream();
    let (a, b) = (Stream::non_blocking(s.context()).unwrap(), Stream::non_blocking(s.context()).unwrap());
    // An exclusive tracker's host read refuses while a ticket is in flight, which shows the count.
    let access = HostAccess::with_exclusive_order(&s);
    let order = access.order().unwrap();
    let ticket = order.use_on(&b).unwrap();
    let inside = order.queue_on(&a, move || {
        drop(ticket); // the order is locked by this very thread: must neither hang nor be lost
        Ok(order.users())
    });
    assert!(matches!(inside, Ok(Err(Error::NotPermitted { .. }))), "{inside:?}");
    // Neither a nor b waited for the other's work, so both are users; a returned last.
    assert_eq!((order.last().unwrap(), order.users().unwrap()), (a, 2));
    access.wait_writes().expect("the ticket is no longer in flight");
}
