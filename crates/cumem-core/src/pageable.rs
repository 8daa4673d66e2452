//! Blocking copies that hand the driver a plain host slice (the pageable path).
//!
//! A plain `&[T]` or `&mut [T]` may be managed memory (a borrow of a `UnifiedBuffer`). The driver
//! looks such a pointer up and treats it as device memory: the copy then runs as device work on
//! the legacy stream, which is neither ordered through the buffer's stream order nor, for a
//! device↔device copy, finished when the call returns (`driver-api.md` §6.4). On a device without
//! concurrent managed access, the host even faults on the memory while that work is in flight,
//! which another thread reading the same shared slice would do. [`blocking_host_copy`] makes such
//! copies sound: it asks the driver once whether the host side is managed and, if so, refuses the
//! copy where the device cannot share the memory with the host, or else waits for the copy before
//! returning.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{blocking_host_copy, Device};
//! let ctx = Device::get(0)?.context()?;
//! let data = vec![1u8; 16];
//! // Pageable memory: the closure runs once, as is.
//! let n = blocking_host_copy(&ctx, data.as_ptr().cast(), || Ok(data.len()))?;
//! assert_eq!(n, 16);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::ffi::c_void;

use crate::{Context, Device, Error, Feature, Result, Stream, ffi};

/// Runs `copy`, a blocking copy in `ctx` (on its legacy stream) whose host side is the plain
/// slice at `host`, so that it is sound when that slice is managed memory.
///
/// - Not managed (the usual case, one pointer-attribute query): runs `copy` and returns its answer.
/// - The driver cannot say (the query fails other than with `INVALID_VALUE`, its answer for memory
///   it does not know): that error, before `copy` runs.
/// - Managed, and the memory's device or `ctx`'s device lacks concurrent managed access:
///   `NotSupported { feature: ConcurrentManagedAccess, device }` (naming the first of those that
///   lacks it) before `copy` runs, since device work on the memory would keep the host out of it
///   while other borrows of the slice may read it. Copy through the buffer's device view instead.
/// - Managed otherwise: runs `copy`, then synchronises `ctx`'s legacy stream, so that the copy has
///   completed when this returns, as a blocking copy of a host slice promises.
pub fn blocking_host_copy<R>(
    ctx: &Context,
    host: *const c_void,
    copy: impl FnOnce() -> Result<R>,
) -> Result<R> {
    ctx.bind()?;
    if !ffi::pointer_is_managed(host as usize as u64)? {
        return copy();
    }
    let memory_device = ffi::pointer_device_ordinal(host as usize as u64)?;
    for ordinal in [memory_device, ctx.device().ordinal() as i32] {
        let device = Device::get(usize::try_from(ordinal).unwrap_or(usize::MAX))?;
        if !device.capabilities()?.concurrent_managed_access {
            return Err(Error::NotSupported {
                feature: Feature::ConcurrentManagedAccess,
                device: Some(ordinal),
            });
        }
    }
    let out = copy()?;
    Stream::legacy(ctx).synchronize()?;
    Ok(out)
}
