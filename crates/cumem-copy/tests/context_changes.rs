//! cumem asks the driver which context is current before every call and caches nothing, so user
//! code that changes the thread's current context behind its back (raw `cuCtxSetCurrent`,
//! `cuCtxPushCurrent`, or nothing current at all) cannot make a queued copy run in the wrong
//! context or lose its ordering: a copy on one stream still waits for work held back on another.
//! Nor can a tracing subscriber that changes it when a copy enters its span: the span is entered
//! before the copy binds its context.
//!
//! The gated test is `#[serial]` and the others `#[parallel]`: see `common` for why.

mod common;

use std::time::Duration;

use cumem_copy::{Copy2D, Pitched, PitchedBuffer, StreamCopy, copy_2d, copy_d2h, copy_h2d};
use cumem_core::sys::{self, CUcontext, CUresult};
use cumem_core::{Context, Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_sys::testing;
use serial_test::{parallel, serial};

fn ctx() -> Context {
    testing::init();
    Device::get(0).unwrap().context().unwrap()
}

fn current() -> CUcontext {
    let mut c = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { sys::cuCtxGetCurrent(&mut c) }, CUresult::CUDA_SUCCESS);
    c
}

fn set_current(c: CUcontext) {
    // SAFETY: `c` is NULL or a live context handle.
    assert_eq!(unsafe { sys::cuCtxSetCurrent(c) }, CUresult::CUDA_SUCCESS);
}

/// Another context than `ctx` to make current behind cumem's back: device 1's primary context
/// when there is a second device, else none at all.
fn another(ctx: &Context) -> (Option<Context>, CUcontext) {
    match Device::get(1).and_then(|d| d.context()) {
        Ok(other) if other != *ctx => {
            let raw = other.raw();
            (Some(other), raw)
        }
        _ => (None, std::ptr::null_mut()),
    }
}

#[test]
#[serial] // holds a gate
fn copies_stay_ordered_when_user_code_changes_the_current_context_between_them() {
    let ctx = ctx();
    let (_keep, other) = another(&ctx);
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&b, 512).unwrap();
    b.synchronize().unwrap();
    let mut first = PinnedBuffer::<u32>::zeroed(&ctx, 512).unwrap();
    let mut second = PinnedBuffer::<u32>::zeroed(&ctx, 512).unwrap();
    let gate = common::hold(&a);
    a.fill(&mut buf, 9u32).unwrap(); // held back
    set_current(std::ptr::null_mut());
    b.copy_d2h(&buf, &mut first).unwrap(); // on b: must bind its context and wait for a
    assert_eq!(current(), ctx.raw(), "the copy did not make its own context current");
    set_current(other);
    b.copy_d2h(&buf, &mut second).unwrap();
    assert_eq!(current(), ctx.raw());
    let opener = gate.release_after(Duration::from_millis(100));
    let seen = (first.as_slice().unwrap().to_vec(), second.as_slice().unwrap().to_vec());
    opener.join().unwrap();
    assert!(seen.0.iter().all(|&v| v == 9), "the copy after a NULL context ran before the fill on a");
    assert!(seen.1.iter().all(|&v| v == 9), "the copy after another context ran before the fill on a");
}

#[test]
#[parallel]
fn every_kind_of_queued_call_works_after_the_context_was_popped_or_pushed() {
    let ctx = ctx();
    let (_keep, other) = another(&ctx);
    // As an address: a raw handle cannot cross into the thread below.
    let other = other as usize;
    let stream = Stream::non_blocking(&ctx).unwrap();
    let src = PinnedBuffer::from_slice(&ctx, &[4u16; 300]).unwrap();
    let mut dev = DeviceBuffer::<u16>::zeroed(&stream, 300).unwrap();
    let mut back = PinnedBuffer::<u16>::zeroed(&ctx, 300).unwrap();
    // A thread of its own: what it leaves current concerns nobody else.
    std::thread::scope(|s| {
        s.spawn(|| {
            set_current(std::ptr::null_mut());
            stream.copy_h2d(&src, &mut dev).unwrap();
            if other != 0 {
                // SAFETY: a live context handle (`_keep` retains it); popped again below.
                let code = unsafe { sys::cuCtxPushCurrent_v2(other as CUcontext) };
                assert_eq!(code, CUresult::CUDA_SUCCESS);
            }
            stream.memset_d16(&mut dev.slice_mut(100..200).unwrap(), 7).unwrap();
            set_current(std::ptr::null_mut());
            stream.copy_d2h(&dev, &mut back).unwrap();
            assert_eq!(current(), ctx.raw());
        });
    });
    let expected: Vec<u16> = (0..300).map(|i| if (100..200).contains(&i) { 7 } else { 4 }).collect();
    assert_eq!(back.as_slice().unwrap(), &expected[..]);
}

/// When [`OnSpanEdge`] runs its function.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Edge {
    Enter,
    Exit,
}

/// A subscriber that runs its function whenever a span is entered, or whenever one is left.
struct OnSpanEdge<F>(Edge, F);

impl<F: Fn() + Send + Sync + 'static> tracing::Subscriber for OnSpanEdge<F> {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {
        if self.0 == Edge::Enter {
            (self.1)()
        }
    }
    fn exit(&self, _: &tracing::span::Id) {
        if self.0 == Edge::Exit {
            (self.1)()
        }
    }
}

/// Blocking copies run on the legacy stream of whatever context is current at the driver call,
/// so they enter their `copy` span, where a subscriber's code runs, before binding their own: a
/// subscriber that makes device 1's context (or none) current there cannot make a copy run on
/// another context's legacy stream, unordered after the fill held back on the buffer's stream
/// (or fail for want of a context). Nor can it send the memset of a new pitched buffer elsewhere.
#[test]
#[serial] // holds a gate
fn a_subscriber_that_changes_the_current_context_on_entering_a_copy_changes_no_copy() {
    let ctx = ctx();
    let (_keep, other) = another(&ctx);
    // As an address: a raw handle cannot live in a subscriber, which must be `Send + Sync`.
    let other = other as usize;
    let a = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&a, 512).unwrap();
    a.synchronize().unwrap();
    let mut out = vec![0u32; 512];
    let gate = common::hold(&a);
    a.fill(&mut buf, 9u32).unwrap(); // held back
    // The blocking copies below wait for the fill, so the gate opens on its own.
    let opener = gate.release_after(Duration::from_millis(100));
    let subscriber = OnSpanEdge(Edge::Enter, move || set_current(other as CUcontext));
    let (h2d, two_d, d2h, img) = cumem_sys::testing::with_subscriber(subscriber, || {
        let h2d = copy_h2d(&[5u32; 512], &mut buf);
        let sixes = [6u32; 256];
        let two_d = copy_2d(
            &Pitched::new(&sixes[..], 16),
            &mut Pitched::new(buf.as_mut_slice(), 16),
            Copy2D::new(16, 16),
        );
        let d2h = copy_d2h(&buf, &mut out);
        let img = PitchedBuffer::<u32>::zeroed(&a, 8, 4);
        (h2d, two_d, d2h, img)
    });
    opener.join().unwrap();
    h2d.unwrap();
    two_d.unwrap();
    d2h.unwrap();
    let expected: Vec<u32> = (0..512).map(|i| if i < 256 { 6 } else { 5 }).collect();
    assert_eq!(out, expected, "a blocking copy ran before the held fill, or in another context");
    assert_eq!(buf.to_vec().unwrap(), expected);
    assert_eq!(img.unwrap().to_vec().unwrap(), vec![0u32; 8 * 4]);
}

/// A staged copy leaves each chunk's span before it allocates the next chunk's page-locked memory
/// (which belongs to the context current at `cuMemHostAlloc`): a subscriber that leaves no context
/// current there cannot make that allocation fail, or land in another context.
#[test]
#[parallel]
fn a_subscriber_that_unbinds_the_context_on_leaving_a_chunk_changes_no_staged_copy() {
    let ctx = ctx();
    let stream = Stream::non_blocking(&ctx).unwrap();
    let src: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, src.len()).unwrap();
    let mut back = vec![0u32; src.len()];
    // 1,000 words in 1 KiB chunks: four pieces each way, through two chunks made on first use.
    let config = cumem_copy::StagingConfig { chunk_bytes: 1024, chunks: 2 };
    let subscriber = OnSpanEdge(Edge::Exit, || set_current(std::ptr::null_mut()));
    let (up, down) = cumem_sys::testing::with_subscriber(subscriber, || {
        let mut up_ring = cumem_copy::StagingRing::with_config(&ctx, config).unwrap();
        let up = up_ring.copy_h2d(&stream, &src, &mut dev);
        let mut down_ring = cumem_copy::StagingRing::with_config(&ctx, config).unwrap();
        let down = down_ring.copy_d2h(&stream, &dev, &mut back);
        (up, down)
    });
    up.unwrap();
    down.unwrap();
    assert_eq!(back, src);
    assert_eq!(dev.to_vec().unwrap(), src);
}
