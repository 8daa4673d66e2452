//! Queued copies and memsets allocate nothing on the heap once warmed up, on one stream and
//! alternating between two: a counting global allocator sees every allocation the cumem crates
//! make on the calling thread (the simulated driver is a separate library with its own allocator);
//! so do they while a profiler observes some other stream.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use cumem_copy::{Profiler, StreamCopy};
use cumem_core::{Device, DeviceBuffer, PinnedBuffer, Result, Stream};
use cumem_sys::testing;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; it only counts them.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: the counter may already be gone while the thread exits.
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_during(f: impl FnOnce() -> Result<()>) -> usize {
    let before = ALLOCATIONS.with(Cell::get);
    f().unwrap();
    ALLOCATIONS.with(Cell::get) - before
}

#[test]
fn queued_copies_and_memsets_allocate_nothing_once_warm() {
    testing::init();
    // The counter sees what this thread allocates (else the zeros below would prove nothing).
    let probe = allocations_during(|| {
        drop(std::hint::black_box(vec![1u8; 8]));
        Ok(())
    });
    assert_eq!(probe, 1);
    let ctx = Device::get(0).unwrap().context().unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let src = PinnedBuffer::from_slice(&ctx, &[3u32; 64]).unwrap();
    let mut back = PinnedBuffer::<u32>::zeroed(&ctx, 64).unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(&a, 64).unwrap();
    let mut y = DeviceBuffer::<u32>::zeroed(&a, 64).unwrap();
    let round =
        |s: &Stream, x: &mut DeviceBuffer<u32>, y: &mut DeviceBuffer<u32>, back: &mut PinnedBuffer<u32>| {
            s.copy_h2d(&src, x)?;
            s.memset_d32(y, 7)?;
            s.copy_d2d(x, y)?;
            s.copy_d2h(y, back)
        };
    // Warm-up: every list reaches the size the loops below need, every marker event exists.
    for s in [&a, &b, &a] {
        round(s, &mut x, &mut y, &mut back).unwrap();
    }
    let one_stream = allocations_during(|| (0..100).try_for_each(|_| round(&a, &mut x, &mut y, &mut back)));
    assert_eq!(one_stream, 0, "queued calls on one stream allocated");
    let two_streams = allocations_during(|| {
        (0..100).try_for_each(|i| round(if i % 2 == 0 { &b } else { &a }, &mut x, &mut y, &mut back))
    });
    assert_eq!(two_streams, 0, "queued calls alternating between two streams allocated");
    assert_eq!(back.as_slice().unwrap(), &[3; 64][..]);
    // A profiler attached to a third stream: copies on the others are checked against it, and
    // still allocate nothing (the first one refreshes this thread's view of the observers).
    let c = Stream::non_blocking(&ctx).unwrap();
    let profiler = Profiler::new();
    let observing = profiler.observe(&c);
    round(&a, &mut x, &mut y, &mut back).unwrap();
    let watched_elsewhere =
        allocations_during(|| (0..100).try_for_each(|_| round(&a, &mut x, &mut y, &mut back)));
    assert_eq!(watched_elsewhere, 0, "queued calls allocated while a profiler observed another stream");
    drop(observing);
    assert_eq!(profiler.report().unwrap().rows().count(), 0, "copies on unobserved streams were counted");
}
