//! `GrowableBuffer` (issue 10, item 2): growth in place from nothing to 64 chunks with data
//! written at each step, chunks returned to the device by `shrink_to_fit`, fills, stream-ordered
//! appends, and growth past the reservation refused.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use bytemuck::Zeroable;
use common::*;
use cumem_copy::{Copy2D, Pitched, StreamCopy};
use cumem_core::sys::CUresult;
use cumem_core::{Context, DeviceBuffer, Error, PinnedBuffer, Stream};
use cumem_sim::FaultRule;
use cumem_vmm::{GrowableBuffer, GrowableConfig};
use serial_test::{parallel, serial};

/// Records, per thread, the largest single allocation, so that a test can bound what a call holds
/// on the host.
struct LargestAllocation;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(bytes: usize) {
    // `try_with`: the allocator also serves a thread's teardown, after its locals are gone.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(bytes)));
}

// SAFETY: every call goes to the system allocator unchanged; the bookkeeping reads a size and sets
// a thread-local `Cell` of a const initialiser, which allocates nothing.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// The largest single allocation `body` made on this thread.
fn largest_allocation_in(body: impl FnOnce()) -> usize {
    LARGEST.with(|l| l.set(0));
    body();
    LARGEST.with(Cell::get)
}

/// What a fill may hold on the host, however many values it sets.
const HOST_BOUND: usize = 64 << 10;

/// Twelve bytes whose 1-, 2- and 4-byte words all differ: no single memset writes it.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Triple {
    a: u32,
    b: f32,
    c: u32,
}

const TRIPLE: Triple = Triple { a: 0x0102_0304, b: -1.5, c: 0xA5A5_0F0F };

/// Twenty-four different words: more runs than the memsets that may write one value.
fn words24(seed: u32) -> [u32; 24] {
    std::array::from_fn(|i| (i as u32 + seed).wrapping_mul(0x9E37_79B9))
}

/// 4 KiB of different words.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Page([u32; 1024]);

/// 64 KiB of different words, aligned to 64 KiB: more than page-locked memory, which is aligned
/// to a page, is aligned to.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(65536))]
struct Aligned64K([u32; 16384]);

/// Live page-locked allocations of `bytes` bytes (`None` on a real driver).
fn pinned_allocations_of(bytes: usize) -> Option<usize> {
    let report = cumem_sys::testing::sim_control()?.live_report();
    Some(report.allocations.iter().filter(|a| a.kind == "pinned_host" && a.bytes == bytes as u64).count())
}

/// A context on a device with VMM support, its granularity and a non-blocking stream (`None`
/// where no device has VMM support).
#[track_caller]
fn vmm_setup() -> Option<(Context, usize, Stream)> {
    let device = vmm_device()?;
    let ctx = device.context().unwrap();
    let g = granule(device);
    let stream = Stream::non_blocking(&ctx).unwrap();
    Some((ctx, g, stream))
}

/// No misuse of the driver reported on this thread.
#[track_caller]
fn assert_no_misuse() {
    assert!(misuse_here().is_empty(), "{:?}", misuse_here());
}

/// `v` holds `n` values, each bitwise `value`; `what` is the message should one differ.
#[track_caller]
fn assert_filled<T: bytemuck::Pod>(v: &[T], n: usize, value: &T, what: &str) {
    assert_eq!(v.len(), n);
    let want = bytemuck::bytes_of(value);
    assert!(v.iter().all(|x| bytemuck::bytes_of(x) == want), "{what}");
}

/// Drops `buf` inside a `queue_on` closure on `stream`, where no lock may be taken.
#[track_caller]
fn drop_inside_a_closure<T>(stream: &Stream, buf: GrowableBuffer<T>) {
    let other = DeviceBuffer::<u32>::zeroed(stream, 64).unwrap();
    other
        .as_slice()
        .queue_on(stream, |_| {
            drop(buf);
            Ok(())
        })
        .unwrap();
}

/// One chunk per granule, so that 64 steps map 64 chunks.
fn config(g: usize) -> GrowableConfig {
    GrowableConfig::default().chunk_bytes(g).reserve_bytes(80 * g)
}

#[test]
#[parallel]
fn grows_from_nothing_to_64_chunks_without_moving() {
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let per_chunk = g / 4;
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config(g)).unwrap();
    let base = buf.device_ptr();
    assert_eq!((buf.len(), buf.capacity(), buf.mapped_bytes()), (0, 0, 0));
    assert_eq!(sim_mapped_bytes(base, buf.range().size()).unwrap_or(0), 0);
    let mut expected = Vec::new();
    for step in 0..64u32 {
        let data = pattern(per_chunk, step);
        if step % 2 == 0 {
            buf.extend_from_slice(&data).unwrap();
        } else {
            let host = PinnedBuffer::from_slice(&ctx, &data).unwrap();
            buf.extend_from_host(&stream, &host).unwrap();
        }
        expected.extend_from_slice(&data);
        assert_eq!(buf.device_ptr(), base, "step {step}: the buffer moved");
        assert_eq!(buf.len(), expected.len());
        assert_eq!(buf.mapped_bytes(), (step as usize + 1) * g);
        assert_eq!(buf.capacity(), buf.len());
        if let Some(mapped) = sim_mapped_bytes(base, buf.range().size()) {
            assert_eq!(
                mapped,
                (buf.capacity() * size_of::<u32>()) as u64,
                "step {step}: the simulator's mapped bytes are not the buffer's capacity"
            );
        }
        assert!(buf.to_vec().unwrap() == expected, "step {step}: earlier data changed");
    }
    assert_no_misuse();
}

/// Asserts, on the simulator, that the device's free memory rose by exactly `expected` bytes from
/// `before` to `after` (`what` freed them). On a GPU another process may allocate or free between
/// the two reads, so neither the size of the change nor its sign is guaranteed, and nothing is
/// checked (the buffer's own mapped bytes still are).
fn assert_free_memory_rose(before: usize, after: usize, expected: usize, what: &str) {
    if cumem_sys::testing::sim_control().is_none() {
        return;
    }
    let rise = after.checked_sub(before).unwrap_or_else(|| {
        panic!("{what}: free memory fell by {} bytes instead of rising by {expected}", before - after)
    });
    assert_eq!(rise, expected, "{what}: free memory must rise by exactly the bytes unmapped");
}

#[test]
#[serial] // reads the device's free memory, which other tests' allocations would move
fn shrink_to_fit_returns_whole_chunks_to_the_device() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    let mut buf = GrowableBuffer::<u8>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize(10 * g, 3).unwrap();
    assert_eq!(buf.mapped_bytes(), 10 * g);
    buf.truncate(3 * g + 1); // needs 4 chunks
    assert_eq!(buf.mapped_bytes(), 10 * g, "truncate keeps the memory");
    let before = ctx.mem_info().unwrap().free;
    buf.shrink_to_fit().unwrap();
    let after = ctx.mem_info().unwrap().free;
    assert_eq!(buf.mapped_bytes(), 4 * g);
    assert_free_memory_rose(before, after, 6 * g, "the six chunks unmapped");
    if let Some(mapped) = sim_mapped_bytes(buf.device_ptr(), buf.range().size()) {
        assert_eq!(mapped, 4 * g as u64);
    }
    assert!(buf.to_vec().unwrap().iter().all(|&v| v == 3));
    buf.clear();
    buf.shrink_to_fit().unwrap();
    assert_free_memory_rose(after, ctx.mem_info().unwrap().free, 4 * g, "the last four chunks unmapped");
    assert_eq!(buf.mapped_bytes(), 0);
    // And it grows again at the same address.
    let base = buf.device_ptr();
    buf.extend_from_slice(&[9u8; 5]).unwrap();
    assert_eq!((buf.device_ptr(), buf.to_vec().unwrap()), (base, vec![9; 5]));
}

#[test]
#[parallel]
fn a_failed_unmap_is_reported_and_its_chunk_stays_mapped() {
    let Some(device) = vmm_device() else { return };
    let Some(ctl) = cumem_sys::testing::sim_control() else {
        return cumem_sys::testing::skip("injects driver faults: simulator only");
    };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u8>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize(6 * g, 5).unwrap();
    buf.truncate(2 * g);
    // The last chunk unmaps; the driver refuses the next one.
    let fault = ctl.inject_fault(FaultRule {
        function: "cuMemUnmap".into(),
        nth: 2,
        code: CUresult::CUDA_ERROR_INVALID_VALUE,
        times: 1,
        this_thread_only: true,
    });
    let e = buf.shrink_to_fit().unwrap_err();
    ctl.remove_fault(fault);
    assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    assert_eq!(buf.mapped_bytes(), 5 * g, "only the chunk that was unmapped is gone");
    assert_eq!(sim_mapped_bytes(buf.device_ptr(), buf.range().size()), Some(5 * g as u64));
    // Nothing was lost: the refused chunk is unmapped by the next try.
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.mapped_bytes(), 2 * g);
    assert_eq!(sim_mapped_bytes(buf.device_ptr(), buf.range().size()), Some(2 * g as u64));
    assert!(buf.to_vec().unwrap().iter().all(|&v| v == 5));
}

#[test]
#[serial] // holds a gate
fn shrink_to_fit_waits_for_work_on_the_chunks_it_unmaps() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    let other = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config(g)).unwrap();
    let data = pattern(g / 2, 7); // two chunks
    buf.extend_from_slice(&data).unwrap();
    let mut copy = DeviceBuffer::<u32>::zeroed(&other, g / 4).unwrap();
    let gate = hold(&other);
    other.copy_d2d(&buf.slice(g / 4..).unwrap(), &mut copy).unwrap(); // reads the second chunk, later
    buf.truncate(1);
    let opener = gate.release_after(Duration::from_millis(50));
    buf.shrink_to_fit().unwrap(); // must wait for the copy before unmapping its source
    opener.join().unwrap();
    assert_eq!(buf.mapped_bytes(), g);
    assert_eq!(copy.to_vec().unwrap(), data[g / 4..]);
    assert_no_misuse();
}

#[test]
#[serial] // holds a gate
fn extend_from_host_is_queued_on_its_stream_after_the_buffers_earlier_work() {
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let n = g / 4; // one chunk of u32
    let stream = Stream::non_blocking(&ctx).unwrap();
    let earlier = Stream::non_blocking(&ctx).unwrap();
    let copier = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize(2 * n, 1).unwrap();
    let host = PinnedBuffer::from_slice(&ctx, &pattern(n, 5)).unwrap();
    // The gate opens from here once the copy is seen queued, or from a watchdog should
    // `extend_from_host` wait for its copy (which then cannot be seen queued).
    let gate = std::sync::Arc::new(std::sync::Mutex::new(Some(hold(&earlier))));
    let (seen, watch) = std::sync::mpsc::channel::<()>();
    let watchdog = {
        let gate = std::sync::Arc::clone(&gate);
        std::thread::spawn(move || {
            let _ = watch.recv_timeout(Duration::from_secs(10));
            drop(gate.lock().unwrap().take());
        })
    };
    // Earlier work on the values that `truncate` then gives up, held behind the gate: the appended
    // values go to the same addresses, so they must land after it.
    earlier.fill(&mut buf.slice_mut(n..).unwrap(), 0xDEAD_BEEFu32).unwrap();
    buf.truncate(n);
    buf.extend_from_host(&copier, &host).unwrap();
    assert!(!copier.query().unwrap(), "extend_from_host returned after its copy instead of queueing it");
    drop(gate.lock().unwrap().take());
    seen.send(()).unwrap();
    let mut expected = vec![1; n];
    expected.extend(pattern(n, 5));
    assert!(buf.to_vec().unwrap() == expected, "the copy did not wait for the earlier fill");
    assert_eq!(buf.mapped_bytes(), 2 * g, "the append reused the mapped chunk");
    drop(buf);
    watchdog.join().unwrap();
    assert_no_misuse();
}

#[test]
#[parallel]
fn resize_fills_new_values_of_every_width() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };

    let mut bytes = GrowableBuffer::<u8>::with_config(&stream, 0, config(g)).unwrap();
    bytes.resize(3, 0xEE).unwrap();
    bytes.resize(g + 5, 0x11).unwrap();
    let v = bytes.to_vec().unwrap();
    assert_eq!(v[..4], [0xEE, 0xEE, 0xEE, 0x11]);
    assert!(v[3..].iter().all(|&b| b == 0x11));

    let mut halves = GrowableBuffer::<u16>::with_config(&stream, 0, config(g)).unwrap();
    halves.resize(7, 0xBEEF).unwrap();
    assert_eq!(halves.to_vec().unwrap(), vec![0xBEEF; 7]);

    let mut words = GrowableBuffer::<u64>::with_config(&stream, 0, config(g)).unwrap();
    words.resize(5, 0x0102_0304_0102_0304).unwrap(); // repeats every 4 bytes: one 32-bit memset
    words.resize(g / 4, 0x1122_3344_5566_7788).unwrap(); // no repetition: copied from the host
    words.resize_zeroed(g / 4 + 3).unwrap();
    let v = words.to_vec().unwrap();
    assert_eq!(v.len(), g / 4 + 3);
    assert!(v[..5].iter().all(|&x| x == 0x0102_0304_0102_0304));
    assert!(v[5..g / 4].iter().all(|&x| x == 0x1122_3344_5566_7788));
    assert_eq!(v[g / 4..], [0, 0, 0]);
    assert_eq!(words.mapped_bytes(), 3 * g, "(g/4 + 3) u64 need three chunks");

    let mut triples = GrowableBuffer::<[u8; 3]>::with_config(&stream, 0, config(g)).unwrap();
    triples.resize(1000, [1, 2, 3]).unwrap();
    assert_eq!(triples.to_vec().unwrap(), vec![[1, 2, 3]; 1000]);
    triples.resize(10, [0; 3]).unwrap();
    assert_eq!(triples.len(), 10);
}

#[test]
#[parallel]
fn resize_with_a_value_no_memset_writes_holds_no_tail_on_the_host() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };

    let third = -1.0f64 / 3.0;
    let mut floats = GrowableBuffer::<f64>::with_config(&stream, 0, config(g)).unwrap();
    floats.resize(3, 2.5).unwrap();
    let n = 5 * g / 8 + 3; // odd, over six chunks
    floats.reserve(n - 3).unwrap(); // maps now, so that only the fill is measured
    let largest = largest_allocation_in(|| floats.resize(n, third).unwrap());
    assert!(largest <= HOST_BOUND, "the fill of {} bytes allocated {largest} bytes on the host", n * 8);
    let bits: Vec<u64> = floats.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits.len(), n);
    assert!(bits[..3].iter().all(|&b| b == 2.5f64.to_bits()));
    assert!(bits[3..].iter().all(|&b| b == third.to_bits()), "a filled value is not bitwise -1/3");

    let mut triples = GrowableBuffer::<Triple>::with_config(&stream, 0, config(g)).unwrap();
    triples.extend_from_slice(&[Triple::zeroed(); 1]).unwrap();
    let n = 3 * g / size_of::<Triple>() + 7; // odd, over four chunks
    triples.reserve(n - 1).unwrap();
    let largest = largest_allocation_in(|| triples.resize(n, TRIPLE).unwrap());
    assert!(largest <= HOST_BOUND, "the fill of {} bytes allocated {largest} bytes on the host", n * 12);
    let v = triples.to_vec().unwrap();
    assert_eq!(v.len(), n);
    assert_eq!(v[0], Triple::zeroed());
    let want = bytemuck::bytes_of(&TRIPLE);
    assert!(v[1..].iter().all(|t| bytemuck::bytes_of(t) == want), "a filled value is not bitwise TRIPLE");
    assert_no_misuse();
}

#[test]
#[parallel]
fn resize_with_a_value_of_many_different_words_copies_one_value_and_doubles_it() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };
    // 24 different words: too many memsets for one value, so it is copied from staging memory.
    let value: [u32; 24] = std::array::from_fn(|i| (i as u32 + 1).wrapping_mul(0x9E37_79B9));
    let mut buf = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
    let n = 2 * g / size_of::<[u32; 24]>() + 5; // odd, over three chunks
    buf.reserve(n).unwrap();
    let largest = largest_allocation_in(|| buf.resize(n, value).unwrap());
    assert!(largest <= HOST_BOUND, "the fill of {} bytes allocated {largest} bytes on the host", n * 96);
    let v = buf.to_vec().unwrap();
    assert_eq!(v.len(), n);
    assert!(v.iter().all(|x| *x == value), "a filled value differs");
    buf.resize(n + 1, value).unwrap(); // a single value: the copy alone
    assert_eq!(buf.slice(n - 1..).unwrap().to_vec().unwrap(), [value; 2]);
    assert_no_misuse();
}

#[test]
#[serial] // holds a gate
fn resize_with_a_value_no_memset_writes_is_queued_on_the_buffers_stream() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    let earlier = Stream::non_blocking(&ctx).unwrap();
    let n = g / 8; // one chunk of f64
    let mut buf = GrowableBuffer::<f64>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize_zeroed(n).unwrap();
    buf.reserve(2 * n).unwrap();
    let gate = hold(&earlier);
    // Earlier work on the buffer, held behind the gate: the fill is ordered after it, and must be
    // queued behind it rather than waited for.
    earlier.memset_d8(&mut buf.slice_mut(..).unwrap(), 0x40).unwrap();
    let ((), gate) = returns_while_held(gate, "resize with a value no memset writes", || {
        buf.resize(3 * n - 1, 0.1).unwrap()
    });
    assert!(
        !stream.query().unwrap(),
        "resize waited for its fill instead of queueing it on the buffer's stream"
    );
    gate.release();
    let bits: Vec<u64> = buf.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    assert!(bits[..n].iter().all(|&b| b == 0x4040_4040_4040_4040), "the earlier memset was lost");
    assert!(bits[n..].iter().all(|&b| b == 0.1f64.to_bits()), "a filled value is not bitwise 0.1");
    assert_no_misuse();
}

#[test]
#[serial] // holds a gate
fn resize_with_a_value_of_many_different_words_does_not_wait_for_other_blocking_streams() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    // Ordered with the legacy stream, and nothing to do with the buffers: held throughout.
    let unrelated = Stream::new(&ctx).unwrap();
    let words = words24(1);
    let page = Page(std::array::from_fn(|i| (i as u32).wrapping_mul(0x0101_0011) ^ 0x5A5A_0000));
    let mut small = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
    let mut large = GrowableBuffer::<Page>::with_config(&stream, 0, config(g)).unwrap();
    let (n_small, n_large) = (g / 96 + 3, 2 * g / 4096 + 1); // past a chunk's end, odd
    // Mapped before the gate, so that the staging memory's `cuMemHostAlloc` is the only driver
    // call in the held window that a held stream might hold up.
    small.reserve(n_small).unwrap();
    large.reserve(n_large).unwrap();
    let gate = hold(&unrelated);
    let what = "the first fills of values of 24 and 1024 different words (their cuMemHostAlloc) \
                while an unrelated blocking stream was held";
    let ((), gate) = returns_while_held(gate, what, || {
        small.resize(n_small, words).unwrap();
        large.resize(n_large, page).unwrap();
    });
    gate.release();
    stream.synchronize().unwrap();
    let v = small.to_vec().unwrap();
    assert_filled(&v, n_small, &words, "a filled [u32; 24] is not bitwise the value");
    let v = large.to_vec().unwrap();
    assert_filled(&v, n_large, &page, "a filled 4 KiB value is not bitwise the value");
    assert_no_misuse();
}

#[test]
#[serial] // holds a gate
fn a_new_value_of_many_words_waits_for_the_copies_of_the_last_one() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };
    let (a, b) = (words24(1), words24(100));
    let mut buf = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
    let n = g / 96 + 1;
    buf.reserve(3 * n).unwrap();
    // The first fill allocates the staging memory (`cuMemHostAlloc`): before the gate, since
    // whether that call waits for a held stream on a GPU is unmeasured (see docs/vmm.md).
    buf.resize(n, a).unwrap();
    let gate = hold(&stream);
    // The same value is staged already: nothing to rewrite, nothing to wait for. The buffer's own
    // stream is held: the copies that read the staged value have not run.
    let ((), gate) = returns_while_held(gate, "a fill of the staged value", || buf.resize(2 * n, a).unwrap());
    // Another value rewrites the staging memory, which must wait for the copies queued above
    // (they would read the new value): opened from another thread while it waits.
    let opener = gate.release_after(Duration::from_millis(50));
    buf.resize(3 * n, b).unwrap();
    opener.join().unwrap();
    let v = buf.to_vec().unwrap();
    assert_eq!(v.len(), 3 * n);
    assert!(v[..2 * n].iter().all(|x| *x == a), "a value was overwritten before its copies ran");
    assert!(v[2 * n..].iter().all(|x| *x == b), "a filled value differs");
    assert_no_misuse();
}

/// Addresses of the live page-locked allocations of `bytes` bytes (empty on a real driver).
fn pinned_addresses_of(bytes: usize) -> Vec<u64> {
    let Some(ctl) = cumem_sys::testing::sim_control() else { return Vec::new() };
    let report = ctl.live_report();
    report
        .allocations
        .iter()
        .filter(|a| a.kind == "pinned_host" && a.bytes == bytes as u64)
        .map(|a| a.ptr)
        .collect()
}

#[test]
#[parallel]
fn a_value_aligned_past_a_page_is_staged_and_filled() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    let size = size_of::<Aligned64K>();
    // Page-locked memory is aligned to a page, and to 64 KiB only by chance (adjacent blocks of
    // 64 KiB alike): buffers until one's staging memory is not aligned for the type, each after
    // a page of page-locked memory kept live, which moves the next block by a page.
    let (mut kept, mut spacers, mut misaligned) = (Vec::new(), Vec::new(), false);
    for seed in 0..16u32 {
        spacers.push(PinnedBuffer::<u8>::zeroed(&ctx, 4096).unwrap());
        let before = pinned_addresses_of(size);
        let value = Aligned64K(std::array::from_fn(|i| (i as u32 + seed).wrapping_mul(0x9E37_79B9) ^ seed));
        let mut buf = GrowableBuffer::<Aligned64K>::with_config(&stream, 0, config(g)).unwrap();
        let n = 2 * g / size + 3; // odd, over three chunks
        buf.resize(n, value).unwrap();
        buf.resize(n + 1, value).unwrap(); // the staged value again: the copy alone
        let v = buf.to_vec().unwrap();
        assert_filled(&v, n + 1, &value, "a filled value is not bitwise the value");
        let staged = pinned_addresses_of(size).into_iter().filter(|p| !before.contains(p));
        misaligned |= staged.into_iter().any(|p| p % size as u64 != 0);
        kept.push(buf);
        if misaligned {
            break;
        }
    }
    if cumem_sys::testing::sim_control().is_some() {
        assert!(misaligned, "no staging memory was misaligned for the type: the test proved nothing");
    }
    assert_no_misuse();
}

#[test]
#[serial] // holds a gate, and injects a fault that a parallel test's copy could meet
fn a_failed_staged_copy_keeps_the_earlier_copies_tracked() {
    let Some(device) = vmm_device() else { return };
    let Some(ctl) = cumem_sys::testing::sim_control() else {
        return cumem_sys::testing::skip("injects driver faults: simulator only");
    };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let (a, b) = (words24(3), words24(300));
    let mut buf = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
    let n = g / 96 + 1;
    buf.reserve(3 * n).unwrap();
    let gate = hold(&stream);
    // Queued behind the gate: its copy from the staging memory has not run.
    let ((), gate) = returns_while_held(gate, "a first fill", || buf.resize(n, a).unwrap());
    // The next fill of the staged value fails at its copy, its first device work.
    let (e, gate) = returns_while_held(gate, "a fill whose copy fails", || {
        let fault = ctl.inject_fault(FaultRule {
            function: "cuMemcpyHtoDAsync_v2".into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_INVALID_VALUE,
            times: 1,
            this_thread_only: true,
        });
        let e = buf.resize(2 * n, a).unwrap_err();
        ctl.remove_fault(fault);
        e
    });
    assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    assert_eq!(buf.len(), n, "a failed fill adds no values");
    // Another value rewrites the staging memory: the error must not have made it forget the
    // first fill's copy, still held, which would then read the new value.
    let opener = gate.release_after(Duration::from_millis(50));
    buf.resize(2 * n, b).unwrap();
    opener.join().unwrap();
    let v = buf.to_vec().unwrap();
    assert_eq!(v.len(), 2 * n);
    assert!(v[..n].iter().all(|x| *x == a), "the first fill's copy read the value staged after it");
    assert!(v[n..].iter().all(|x| *x == b), "a filled value differs");
    let bad = misuse_here();
    assert!(bad.is_empty(), "{bad:?}");
}

#[test]
#[serial] // counts the live page-locked allocations, which parallel tests would change
fn a_buffer_dropped_inside_a_closure_frees_its_staging_memory() {
    within_watchdog("a GrowableBuffer with a staged value dropped inside a closure", || {
        let Some((_ctx, g, stream)) = vmm_setup() else { return };
        let before = pinned_allocations_of(96);
        let mut buf = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
        buf.resize(g / 96 + 1, words24(7)).unwrap();
        assert_eq!(pinned_allocations_of(96), before.map(|n| n + 1), "no staging memory for the value");
        let (base, size) = (buf.device_ptr(), buf.range().size());
        // The staging memory's drop, like the buffer's, waits without a lock, which a closure refuses.
        drop_inside_a_closure(&stream, buf);
        assert_eq!(pinned_allocations_of(96), before, "the staging memory leaked");
        assert_eq!(sim_mapped_bytes(base, size).unwrap_or(0), 0, "leaked instead of unmapped");
        assert_no_misuse();
    });
}

#[test]
#[parallel]
fn fills_inside_a_queue_on_closure_are_refused_and_keep_the_length() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };
    let value = words24(3);
    let mut buf = GrowableBuffer::<[u32; 24]>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize(1, value).unwrap(); // staged
    let n = g / 96 + 2; // past the first chunk
    let other = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    other
        .as_slice()
        .queue_on(&stream, |_| {
            // Even of the value staged, which is not rewritten.
            let refused = buf.resize(n, value);
            assert!(matches!(refused, Err(Error::NotPermitted { .. })), "{refused:?}");
            let refused = buf.resize_zeroed(n);
            assert!(matches!(refused, Err(Error::NotPermitted { .. })), "{refused:?}");
            assert_eq!(buf.len(), 1, "a refused fill changed the length");
            assert!(buf.capacity() >= n, "the chunks mapped to grow were not kept");
            Ok(())
        })
        .unwrap();
    buf.resize_zeroed(n).unwrap();
    let v = buf.to_vec().unwrap();
    assert_eq!(v.len(), n);
    assert_eq!(v[0], value, "the first value changed");
    assert!(v[1..].iter().all(|x| *x == [0; 24]), "a zeroed value is not zero");
    assert_no_misuse();
}

#[test]
#[parallel]
fn views_work_with_the_copies_and_memsets_of_cumem_copy() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    let other = Stream::non_blocking(&ctx).unwrap();
    let n = g / 4 + 100; // spans two chunks
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, n, config(g)).unwrap();
    buf.resize_zeroed(n).unwrap();
    other.fill(&mut buf.slice_mut(10..n - 10).unwrap(), 0x7777_7777u32).unwrap();
    other.memset_d8(&mut buf.slice_mut(..10).unwrap(), 0x01).unwrap();
    let v = buf.to_vec().unwrap();
    assert_eq!(v[..10], [0x0101_0101; 10]);
    assert!(v[10..n - 10].iter().all(|&x| x == 0x7777_7777));
    assert_eq!(v[n - 10..], [0; 10]);
    let src = DeviceBuffer::from_slice(&stream, &pattern(n, 3)).unwrap();
    cumem_copy::copy_d2d(&src, &mut buf).unwrap();
    let mut out = PinnedBuffer::<u32>::zeroed(&ctx, n).unwrap();
    other.copy_d2h(&buf, &mut out).unwrap();
    assert_eq!(out.as_slice().unwrap(), &pattern(n, 3)[..]);
}

#[test]
#[parallel]
fn growing_past_the_reservation_is_an_error_that_maps_nothing() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };
    let small = GrowableConfig::default().chunk_bytes(g).reserve_bytes(2 * g);
    let mut buf = GrowableBuffer::<u8>::with_config(&stream, 0, small.clone()).unwrap();
    assert_eq!(buf.max_capacity(), 2 * g);
    buf.resize(g, 1).unwrap();
    let e = buf.reserve(g + 1).unwrap_err();
    assert!(matches!(e, Error::LimitExceeded { limit, .. } if limit == 2 * g), "{e}");
    assert!(e.to_string().contains("reservation"), "{e}");
    let e = buf.resize(3 * g, 0).unwrap_err();
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    assert_eq!((buf.len(), buf.mapped_bytes()), (g, g), "a refused growth changes nothing");
    let e = GrowableBuffer::<u8>::with_config(&stream, 2 * g + 1, small).unwrap_err();
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    buf.resize(2 * g, 2).unwrap(); // exactly full is fine
    assert_eq!(buf.capacity(), buf.max_capacity());
}

#[test]
#[parallel]
fn bad_configurations_are_refused_before_the_driver() {
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let g = granule(device);
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u8>::with_config(&stream, 0, config(g)).unwrap();
    let other_ctx =
        cumem_core::Device::all().unwrap().into_iter().find(|d| *d != device).map(|d| d.context().unwrap());
    let other = other_ctx.as_ref().map(|c| Stream::non_blocking(c).unwrap());
    let host = PinnedBuffer::from_slice(&ctx, &[1u8; 4]).unwrap();
    without_any_call(&[], || {
        let e = GrowableBuffer::<u8>::with_config(&stream, 0, GrowableConfig::default().chunk_bytes(g / 2))
            .unwrap_err();
        assert!(matches!(e, Error::Misaligned { what: "chunk size", .. }), "{e}");
        let e = GrowableBuffer::<u8>::with_config(&stream, 0, GrowableConfig::default().chunk_bytes(0))
            .unwrap_err();
        assert!(matches!(e, Error::ZeroSize { .. }), "{e}");
        let e = GrowableBuffer::<u8>::with_config(&stream, 0, GrowableConfig::default().reserve_bytes(0))
            .unwrap_err();
        assert!(matches!(e, Error::ZeroSize { what: "reservation size" }), "{e}");
        let e = GrowableBuffer::<()>::new(&stream).unwrap_err();
        assert!(matches!(e, Error::ZeroSize { what: "element size" }), "{e}");
        if let Some(other) = &other {
            let e = buf.extend_from_host(other, &host).unwrap_err();
            assert!(matches!(e, Error::WrongDevice { .. }), "{e}");
        }
    });
    assert_eq!(buf.len(), 0);
}

/// Aligned to 32 granules of 2 MiB: a base aligned to the granularity alone would misplace it.
#[repr(C, align(67108864))]
struct Overaligned(#[allow(dead_code)] u8);

#[test]
#[parallel]
fn a_type_aligned_past_the_granularity_gets_a_base_aligned_for_it() {
    let Some((_ctx, g, stream)) = vmm_setup() else { return };
    let align = align_of::<Overaligned>();
    assert!(align > g);
    let config = GrowableConfig::default().chunk_bytes(g).reserve_bytes(2 * align);
    // Several, so that no base passes by being aligned by chance.
    let bufs: Vec<_> = (0..4)
        .map(|_| GrowableBuffer::<Overaligned>::with_config(&stream, 0, config.clone()).unwrap())
        .collect();
    for buf in &bufs {
        assert_eq!(buf.device_ptr() % align as u64, 0, "{buf:?} is not aligned for its values");
        assert_eq!(buf.as_slice().device_ptr(), buf.device_ptr());
        assert_eq!(buf.max_capacity(), 2);
    }
    // An ordinary type keeps the driver's placement: aligned to the granularity.
    let plain = GrowableBuffer::<u64>::with_config(&stream, 0, config).unwrap();
    assert_eq!(plain.device_ptr() % g as u64, 0);
}

#[test]
#[parallel]
fn the_default_reservation_is_a_multiple_of_the_device_memory() {
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let buf = GrowableBuffer::<u32>::new(&stream).unwrap();
    let total = device.total_memory().unwrap();
    // Generous: room for more than the device could ever back (PyTorch's expandable segments
    // reserve 1.125 times the device's memory), whatever the constant says.
    assert!(buf.range().size() >= 2 * total, "{} reserved on a device of {total}", buf.range().size());
    assert_eq!(buf.range().size(), GrowableConfig::DEFAULT_RESERVE_MULTIPLE * total);
    assert_eq!(buf.mapped_bytes(), 0);
    assert_eq!(buf.chunk_bytes(), cumem_vmm::Granularity::of(device).unwrap().recommended);
}

#[test]
#[parallel]
fn buffers_and_mappings_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GrowableBuffer<u32>>();
    send_sync::<cumem_vmm::SharedMapping>();
    send_sync::<cumem_vmm::Mapping<'static>>();
    let Some(device) = vmm_device() else { return };
    let ctx = device.context().unwrap();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let mut buf = GrowableBuffer::<u32>::with_capacity(&stream, 10).unwrap();
    buf.extend_from_slice(&[4, 5, 6]).unwrap();
    // Dropped on a thread that never bound the context: the buffer binds it to unmap.
    std::thread::spawn(move || {
        assert_eq!(buf.to_vec().unwrap(), [4, 5, 6]);
        drop(buf);
    })
    .join()
    .unwrap();
}

#[test]
#[parallel]
fn a_2d_copy_crosses_the_boundary_between_chunks() {
    let Some((ctx, g, stream)) = vmm_setup() else { return };
    // Rows of 1000 values, 1024 apart, placed so that one row straddles the first chunk's end.
    let (pitch, width, height) = (1024, 1000, 8);
    let start = g / 4 - 4 * pitch - 500;
    let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config(g)).unwrap();
    buf.resize_zeroed(start + height * pitch).unwrap();
    assert_eq!(buf.mapped_bytes(), 2 * g);
    let src = pattern(width * height, 9);
    let host = PinnedBuffer::from_slice(&ctx, &src).unwrap();
    {
        let mut region = Pitched::new(buf.slice_mut(start..).unwrap(), pitch);
        stream.copy_2d(&Pitched::new(&host, width), &mut region, Copy2D::new(width, height)).unwrap();
    }
    let v = buf.to_vec().unwrap();
    for row in 0..height {
        let at = start + row * pitch;
        assert_eq!(v[at..at + width], src[row * width..(row + 1) * width], "row {row}");
        assert!(v[at + width..at + pitch].iter().all(|&x| x == 0), "row {row}: the padding was written");
    }
}

#[test]
#[parallel]
fn a_buffer_dropped_inside_a_closure_returns_its_memory() {
    within_watchdog("a GrowableBuffer dropped inside a closure", || {
        let Some((_ctx, g, stream)) = vmm_setup() else { return };
        let mut buf = GrowableBuffer::<u32>::with_config(&stream, 0, config(g)).unwrap();
        buf.extend_from_slice(&pattern(g / 4, 1)).unwrap();
        let (base, size) = (buf.device_ptr(), buf.range().size());
        // The drop has exclusive access to its order, so it needs no lock, which a closure refuses.
        drop_inside_a_closure(&stream, buf);
        assert_eq!(sim_mapped_bytes(base, size).unwrap_or(0), 0, "leaked instead of unmapped");
        assert_ne!(sim_reserved(base), Some(true), "the reservation leaked");
        assert_no_misuse();
    });
}
