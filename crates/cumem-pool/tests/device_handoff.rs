//! Cross-stream reuse on the device: a block freed on stream A must not be handed to stream B
//! before A's pending work on it completes. The simulator's streams really run later, and a host
//! function holds stream A back, so handing the block over without an event dependency shows up as
//! corrupted data. The second test proves the first can fail: the same hand-off through a pool whose
//! ordering does nothing corrupts the data.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cumem_copy::StreamCopy;
use cumem_core::sys::{self, CUdeviceptr};
use cumem_core::{AllocLayout, Context, Device, DeviceBuffer, DeviceResource, PinnedBuffer, Result, Stream};
use cumem_pool::{
    Block, CachingPool, CachingResource, DeviceUpstream, Ordering, PoolConfig, StreamKey, UpstreamError,
};
use cumem_sys::testing;
use parking_lot::{Condvar, Mutex};

const N: usize = 4096;

fn ctx() -> Context {
    testing::init_with("latency_us=500");
    Device::get(0).unwrap().context().unwrap()
}

/// Blocks a stream at the point it is queued until released.
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    // SAFETY: `user` is the `Arc<Gate>` leaked by `hold`, alive until `release` reclaims it after the
    // stream has passed the gate.
    let gate = unsafe { &*user.cast::<Gate>() };
    let mut open = gate.open.lock();
    while !*open {
        gate.cv.wait(&mut open);
    }
}

fn hold(stream: &Stream) -> Arc<Gate> {
    let gate = Arc::new(Gate { open: Mutex::new(false), cv: Condvar::new() });
    let user = Arc::into_raw(gate.clone()) as *mut c_void;
    stream.context().bind().unwrap();
    // SAFETY: the callback only waits on the gate, which stays alive (one leaked count) until released.
    let code = unsafe { sys::cuLaunchHostFunc(stream.raw(), Some(wait_at_gate), user) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    gate
}

fn release(gate: Arc<Gate>, stream: &Stream) {
    *gate.open.lock() = true;
    gate.cv.notify_all();
    stream.synchronize().unwrap();
    // SAFETY: the count leaked by `hold`; the callback has returned (the stream is synchronised).
    drop(unsafe { Arc::from_raw(Arc::as_ptr(&gate)) });
}

/// Runs the hand-off through `resource` and returns what stream A read from the block.
fn hand_off(ctx: &Context, resource: Arc<dyn DeviceResource>) -> Vec<u32> {
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
    std::thread::sleep(Duration::from_millis(50)); // time for B to run, if nothing holds it back

    release(gate, &a);
    b.synchronize().unwrap();
    let out = seen.to_vec().unwrap();
    drop(y);
    out
}

#[test]
fn a_block_freed_on_one_stream_reaches_another_only_after_the_first_streams_work() {
    let ctx = ctx();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let seen = hand_off(&ctx, pool.clone());
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
    fn allocate(&self, layout: AllocLayout, stream: &Stream) -> cumem_core::Result<CUdeviceptr> {
        let block = self.pool.allocate(layout.bytes, layout.align, StreamKey::of(stream)).unwrap();
        let addr = block.addr();
        self.live.lock().insert(addr, block);
        Ok(addr)
    }
    unsafe fn deallocate(&self, ptr: CUdeviceptr, _layout: AllocLayout, stream: &Stream) {
        let block = self.live.lock().remove(&ptr).unwrap();
        self.pool.deallocate(block, StreamKey::of(stream)).unwrap();
    }
}

#[test]
fn without_the_event_dependency_the_same_hand_off_corrupts_data() {
    let ctx = ctx();
    let upstream = DeviceUpstream::new(Arc::new(cumem_core::DriverResource::new(&ctx)));
    let pool = Arc::new(Unordered {
        ctx: ctx.clone(),
        pool: CachingPool::new(upstream, NoWait(ctx.clone()), PoolConfig::default()),
        live: Mutex::new(HashMap::new()),
    });
    let seen = hand_off(&ctx, pool.clone());
    assert!(
        seen.iter().any(|&v| v != 0xAAAA_AAAA),
        "the hand-off stayed correct without the dependency: the simulator did not expose the race"
    );
    pool.pool.trim().unwrap();
}
