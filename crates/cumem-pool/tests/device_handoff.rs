//! Cross-stream reuse on the device: a block freed on stream A must not be handed to stream B
//! before A's pending work on it completes. The simulator's streams really run later, and a host
//! function holds stream A back, so handing the block over without an event dependency shows up as
//! corrupted data. The second test proves the first can fail: the same hand-off through a pool whose
//! ordering does nothing corrupts the data. Both hold a gate, so both are `#[serial]`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::{
    AllocLayout, Allocation, Context, Device, DeviceBuffer, DeviceResource, PinnedBuffer, Result, Stream,
};
use cumem_pool::{
    Block, CachingPool, CachingResource, DeviceUpstream, Ordering, PoolConfig, StreamKey, UpstreamError,
};
use cumem_sys::testing;
use cumem_sys::testing::Gate;
use parking_lot::Mutex;
use serial_test::serial;

const N: usize = 4096;

fn ctx() -> Context {
    testing::init_with("latency_us=500");
    Device::get(0).unwrap().context().unwrap()
}

/// Holds `stream` here until the gate is released; the calling test must be `#[serial]`
/// (checked): see [`Gate`] for why.
fn hold(stream: &Stream) -> Gate {
    assert!(
        serial_test::is_locked_serially(None),
        "a test that holds a stream must be #[serial] (see cumem_sys::testing::Gate)"
    );
    stream.context().bind().unwrap();
    // SAFETY: `stream` is alive (borrowed), and its context was just made current.
    unsafe { testing::hold(stream.raw()) }
}

/// How the hand-off lets stream B run before stream A's gate opens.
#[derive(Clone, Copy)]
enum LetBRun {
    /// Sleep 50 ms: B runs meanwhile unless something holds it back (a correct pool makes it
    /// wait for A, so waiting for B here would never end).
    Briefly,
    /// Synchronise B: for a pool known to give B no dependency on A, which then surely writes
    /// before A reads, however slowly a loaded machine runs B.
    ToTheEnd,
}

/// Runs the hand-off through `resource` and returns what stream A read from the block.
fn hand_off(ctx: &Context, resource: Arc<dyn DeviceResource>, let_b_run: LetBRun) -> Vec<u32> {
    let (a, b) = (Stream::non_blocking(ctx).unwrap(), Stream::non_blocking(ctx).unwrap());
    let mut x = DeviceBuffer::<u32>::zeroed_in(&resource, &a, N).unwrap();
    a.fill(&mut x, 0xAAAA_AAAA).unwrap();
    let mut seen = PinnedBuffer::<u32>::zeroed(ctx, N).unwrap();
    let gate = hold(&a);
    a.copy_d2h(&x, &mut seen).unwrap(); // pending on A, behind the gate
    let x_ptr = x.device_ptr();
    drop(x); // freed on A while A's read of it is still pending

    let mut y = DeviceBuffer::<u32>::zeroed_in(&resource, &b, N).unwrap();
    assert_eq!(y.device_ptr(), x_ptr, "B did not get A's block: the test would prove nothing");
    b.fill(&mut y, 0xBBBB_BBBB).unwrap();
    match let_b_run {
        LetBRun::Briefly => std::thread::sleep(Duration::from_millis(50)),
        LetBRun::ToTheEnd => b.synchronize().unwrap(),
    }

    gate.release();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    let out = seen.to_vec().unwrap();
    drop(y);
    out
}

#[test]
#[serial] // holds a gate
fn a_block_freed_on_one_stream_reaches_another_only_after_the_first_streams_work() {
    let ctx = ctx();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let seen = hand_off(&ctx, pool.clone(), LetBRun::Briefly);
    assert!(seen.iter().all(|&v| v == 0xAAAA_AAAA), "A read {:#x} instead of its own data", seen[0]);
    pool.trim().unwrap();
}

/// The caching pool with the cross-stream event dependency removed.
struct NoWait(Context);

impl Ordering for NoWait {
    type Stream = StreamKey;
    fn wait(&self, _waiter: StreamKey, _on: StreamKey) -> Result<(), UpstreamError> {
        Ok(()) // the bug under test: no event, no stream wait
    }
    fn synchronize(&self) -> Result<(), UpstreamError> {
        self.0.synchronize().map_err(|_| UpstreamError::Other(-1))
    }
}

struct Unordered {
    ctx: Context,
    pool: CachingPool<DeviceUpstream, NoWait>,
    live: Mutex<HashMap<u64, Block>>,
}

impl std::fmt::Debug for Unordered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Unordered")
    }
}

// SAFETY: NOT sound across streams (that is the point of this test double); the memory itself is
// valid, non-overlapping pool memory.
unsafe impl DeviceResource for Unordered {
    fn context(&self) -> &Context {
        &self.ctx
    }
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<Allocation> {
        let block = self.pool.allocate(layout.bytes, layout.align, StreamKey::of(stream)).unwrap();
        let addr = block.addr();
        self.live.lock().insert(addr, block);
        Ok(Allocation::from_ptr(addr))
    }
    unsafe fn deallocate(&self, allocation: Allocation, _layout: AllocLayout, stream: &Stream) {
        let block = self.live.lock().remove(&allocation.ptr).unwrap();
        // SAFETY: NOT kept, on purpose: `NoWait` orders nothing after `stream` (item 2); the
        // corruption that follows, on the simulator, is what the test checks.
        unsafe { self.pool.deallocate(block, StreamKey::of(stream)) }.unwrap();
    }
}

#[test]
#[serial] // holds a gate
fn without_the_event_dependency_the_same_hand_off_corrupts_data() {
    let ctx = ctx();
    let upstream = DeviceUpstream::new(Arc::new(cumem_core::DriverResource::new(&ctx)));
    let pool = Arc::new(Unordered {
        ctx: ctx.clone(),
        pool: CachingPool::new(upstream, NoWait(ctx.clone()), PoolConfig::default()),
        live: Mutex::new(HashMap::new()),
    });
    // B is waited for while A is held: a 50 ms sleep was not always long enough for the simulator
    // to run B on a loaded machine, and then nothing was corrupted.
    let seen = hand_off(&ctx, pool.clone(), LetBRun::ToTheEnd);
    assert!(
        seen.iter().any(|&v| v != 0xAAAA_AAAA),
        "the hand-off stayed correct without the dependency: the simulator did not expose the race"
    );
    pool.pool.trim().unwrap();
}
