//! A door guard (`view.on(&stream)`) that is forgotten instead of dropped still orders the buffer's
//! free after the work queued through it: the caching pool must not hand the memory to a new buffer
//! while that work is pending. `mem::forget` is safe code, so this is a soundness property.

mod gate;

use std::sync::Arc;
use std::time::Duration;

use cumem_core::sys::{self, CUresult};
use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_pool::{CachingResource, PoolConfig};
use cumem_sys::testing;
use serial_test::serial;

#[test]
#[serial] // holds a gate
fn a_forgotten_guard_still_orders_the_free_after_its_work() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed_in(&pool, &a, 1024).unwrap();
    a.synchronize().unwrap();
    let gate = gate::hold(&b);
    let old = {
        let on = buf.on_mut(&b).unwrap();
        ctx.bind().unwrap();
        // SAFETY: the guard's range (1024 u32s), queued on the guard's stream while it is alive
        // (forgotten below, it is never dropped).
        let code = unsafe { sys::cuMemsetD32Async(on.device_ptr(), 5, on.len(), on.stream().raw()) };
        assert_eq!(code, CUresult::CUDA_SUCCESS);
        let ptr = on.device_ptr();
        std::mem::forget(on);
        ptr
    };
    // Opened from another thread: the free below makes `a` wait for `b`, and the blocking upload
    // on `a` then waits for the gate.
    let opener = gate.release_after(Duration::from_millis(300));
    drop(buf); // the memset on `b` is still held back
    let fresh = DeviceBuffer::from_slice_in(&pool, &a, &[7u32; 1024]).unwrap();
    let reused = fresh.device_ptr() == old;
    b.synchronize().unwrap(); // the memset has run: before the upload, or (the bug) after it
    opener.join().unwrap();
    let data = fresh.to_vec().unwrap();
    assert!(
        data.iter().all(|&v| v == 7),
        "a new buffer (reused block: {reused}) was overwritten by work queued through a forgotten guard"
    );
    drop(fresh);
    pool.trim().unwrap();
    if let Some(ctl) = testing::sim_control() {
        assert!(ctl.violations().is_empty(), "{:?}", ctl.violations());
    }
}
