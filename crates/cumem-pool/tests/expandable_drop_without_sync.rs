//! A caching pool with expandable segments dropped while its synchronisation fails leaks its
//! mapped chunks rather than unmapping them under work still queued on them: the queued copy still
//! reads its data, and the simulator sees no access to unmapped memory. The leak is the point, so
//! this binary turns the simulator's exit leak check off after checking the leak is there.

use std::sync::Arc;

use cumem_copy::StreamCopy;
use cumem_core::sys::CUresult;
use cumem_core::{Device, DeviceBuffer, PinnedBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::sim_control::FaultRule;
use cumem_sys::testing;
use serial_test::serial;

mod gate;

#[test]
#[serial]
fn a_failed_synchronize_at_drop_leaks_the_mapped_chunks_under_queued_work() {
    testing::init_with("latency_us=500");
    // Injecting the failure needs the simulator.
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects driver faults: simulator only");
    };
    let ctx = Device::get(0).unwrap().context().unwrap();
    if !ctx.device().capabilities().unwrap().virtual_memory {
        return;
    }
    let config = PoolConfig { expandable_segments: true, ..PoolConfig::default() };
    let pool = Arc::new(CachingResource::with_driver(&ctx, config));
    assert!(pool.pool().expandable().is_some());
    let stream = Stream::non_blocking(&ctx).unwrap();
    let n = 3 << 18; // 3 MiB of u32: a large block, in mapped chunks
    let mut buf = DeviceBuffer::<u32>::new_in(&pool, &stream, n).unwrap();
    stream.fill(&mut buf, 0x5A5A_A5A5).unwrap();
    stream.synchronize().unwrap();
    let (base, end) = (buf.device_ptr(), buf.device_ptr() + buf.bytes() as u64);
    let mut seen = PinnedBuffer::<u32>::zeroed(&ctx, n).unwrap();
    let gate = gate::hold(&stream);
    stream.copy_d2h(&buf, &mut seen).unwrap(); // queued behind the gate
    drop(buf);
    // Every synchronisation on this thread fails while the pool is dropped (a stream's tail
    // waits on an event it records; a stream itself is synchronised).
    let rules = ["cuStreamSynchronize", "cuEventSynchronize"].map(|function| {
        ctl.inject_fault(FaultRule {
            function: function.into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_UNKNOWN,
            times: 0,
            this_thread_only: true,
        })
    });
    drop(pool);
    rules.into_iter().for_each(|rule| ctl.remove_fault(rule));
    gate.release();
    stream.synchronize().unwrap();
    assert!(seen.to_vec().unwrap().iter().all(|&v| v == 0x5A5A_A5A5), "the copy read unmapped memory");
    assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    let report = ctl.live_report();
    let mapped = |p: u64| report.mappings.iter().any(|m| m.ptr <= p && p < m.ptr + m.bytes);
    assert!(mapped(base) && mapped(end - 1), "the chunks under the copy were unmapped: {report}");
    drop((seen, stream));
    // The leaked chunks are the expected outcome; everything else was freed.
    ctl.configure("leak_check=0").unwrap();
}
