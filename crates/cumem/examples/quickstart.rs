//! The README's example: upload, fill a view, download, on the real driver or the simulator.
//!
//! `cargo run -p cumem --example quickstart` (add `--features sim`, on by default in this
//! workspace's dev-dependencies, to fall back to the simulator where there is no GPU).

use cumem::prelude::*;

fn main() -> Result<()> {
    let kind = cumem::driver::init()?; // real driver, or the simulator (CUMEM_DRIVER)
    println!("quickstart on {kind}");
    let ctx = Device::get(0)?.context()?;
    let stream = Stream::non_blocking(&ctx)?;

    let host = PinnedBuffer::from_slice(&ctx, &[1.0f32; 4096])?; // page-locked host memory
    let mut dev = DeviceBuffer::<f32>::zeroed(&stream, 4096)?; // device memory, like Vec<f32>
    stream.copy_h2d(&host, &mut dev)?; // queued: `host` is now read-locked
    stream.fill(&mut dev.slice_mut(2048..)?, 2.0f32)?; // views behave like &mut [T]

    let mut back = PinnedBuffer::<f32>::zeroed(&ctx, 4096)?;
    stream.copy_d2h(&dev, &mut back)?; // queued
    let values = back.as_slice()?; // waits for the copy's stream
    assert_eq!((values[0], values[4095]), (1.0, 2.0));
    println!("round trip ok: {} values, first {}, last {}", values.len(), values[0], values[4095]);
    Ok(()) // everything frees itself
}
