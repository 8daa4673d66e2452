//! Blocking copies between pageable host slices and device memory.
//!
//! These run on the legacy default stream, after all work already queued on the device memory
//! (whatever stream it was queued on), and return when the host side is done: a host source may be
//! reused and a host destination read at once. A host slice that is managed memory (borrowed from
//! a `UnifiedBuffer`) is waited for completely, or refused with `NotSupported { feature:
//! ConcurrentManagedAccess }` on a device without concurrent managed access (see
//! [`cumem_core::blocking_host_copy`]). Host→device needs `T: NoUninit` (every byte of the
//! source is initialised); device→host needs `T: AnyBitPattern` (any bytes make a valid `T`).
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{DeviceBuffer, Device, Stream};
//! use cumem_copy::{copy_d2d, copy_d2h, copy_h2d};
//! let stream = Stream::new(&Device::get(0)?.context()?)?;
//! let mut a = DeviceBuffer::<u64>::zeroed(&stream, 4)?;
//! let mut b = DeviceBuffer::<u64>::zeroed(&stream, 4)?;
//! copy_h2d(&[1, 2, 3, 4], &mut a)?;
//! copy_d2d(&a, &mut b)?;
//! let mut out = [0u64; 4];
//! copy_d2h(&b, &mut out)?;
//! assert_eq!(out, [1, 2, 3, 4]);
//! assert!(copy_h2d(&[1, 2, 3], &mut a).is_err()); // length mismatch
//! # Ok::<(), cumem_core::Error>(())
//! ```

use bytemuck::{AnyBitPattern, NoUninit};
use cumem_core::{AsDeviceSlice, AsDeviceSliceMut, Result, Stream, blocking_host_copy};

use crate::profile::{self, CopyKind};
use crate::{ffi, validate};

/// Copies `src` into device memory `dst` (same length), on the legacy stream after all work
/// queued on `dst`. `src` may be reused on return.
///
/// # Errors
/// `LengthMismatch` when the lengths differ (an empty copy is then `Ok`). A `src` that is managed
/// memory (borrowed from a `UnifiedBuffer`) is waited for completely, or refused with
/// `NotSupported { feature: ConcurrentManagedAccess, .. }` on a device without concurrent
/// managed access (see [`cumem_core::blocking_host_copy`]). The driver's errors come as their
/// variants.
pub fn copy_h2d<T: NoUninit>(src: &[T], dst: &mut impl AsDeviceSliceMut<T>) -> Result<()> {
    let dst = dst.as_device_slice_mut();
    validate::same_len(dst.len(), src.len())?;
    if dst.bytes() == 0 {
        return Ok(());
    }
    let ctx = dst.context().clone();
    let legacy = Stream::legacy(&ctx);
    // Traced before `on` binds the context: a subscriber's code (which may bind another one)
    // runs on entering the span, not between the bind and the driver call on the legacy stream.
    let mut trace = profile::begin(&legacy, CopyKind::HostToDevice, dst.bytes());
    let mut dst = dst;
    let on = dst.on(&legacy)?;
    blocking_host_copy(&ctx, src.as_ptr().cast(), || {
        // SAFETY: `src` is initialised (NoUninit) and valid for `bytes` bytes; `dst` is device
        // memory of exactly that size, exclusively borrowed, ordered on the legacy stream.
        trace.around(&legacy, || unsafe { ffi::htod(on.device_ptr(), src.as_ptr().cast(), on.bytes()) })
    })
}

/// Copies device memory `src` into `dst` (same length), on the legacy stream after all work
/// queued on `src`; `dst` holds the values on return.
///
/// # Errors
/// As [`copy_h2d`], for a managed `dst`.
pub fn copy_d2h<T: AnyBitPattern>(src: &impl AsDeviceSlice<T>, dst: &mut [T]) -> Result<()> {
    let src = src.as_device_slice();
    validate::same_len(dst.len(), src.len())?;
    if src.bytes() == 0 {
        return Ok(());
    }
    let ctx = src.context();
    let legacy = Stream::legacy(ctx);
    // Traced before `on` binds the context (see `copy_h2d`).
    let mut trace = profile::begin(&legacy, CopyKind::DeviceToHost, src.bytes());
    let on = src.on(&legacy)?;
    blocking_host_copy(ctx, dst.as_ptr().cast(), || {
        // SAFETY: `dst` is valid for `bytes` bytes of writes and any bytes are a valid T; the copy
        // is complete when `blocking_host_copy` returns; `src` is device memory of that size,
        // ordered on the legacy stream.
        trace.around(&legacy, || unsafe { ffi::dtoh(dst.as_mut_ptr().cast(), on.device_ptr(), on.bytes()) })
    })
}

/// Copies device memory `src` into device memory `dst` of the same device, on the legacy stream.
/// Returns without waiting for the copy: later work on either buffer is ordered after it.
///
/// # Errors
/// `LengthMismatch` when the lengths differ; `WrongDevice` when the two are on different devices
/// (both checked even for an empty copy, which is then `Ok`). The driver's errors come as their
/// variants.
pub fn copy_d2d<T>(src: &impl AsDeviceSlice<T>, dst: &mut impl AsDeviceSliceMut<T>) -> Result<()> {
    let (src, dst) = (src.as_device_slice(), dst.as_device_slice_mut());
    validate::same_len(dst.len(), src.len())?;
    validate::same_device(dst.context(), src.context())?;
    if dst.bytes() == 0 {
        return Ok(());
    }
    let ctx = dst.context().clone();
    let legacy = Stream::legacy(&ctx);
    // Traced before the views bind the context (see `copy_h2d`).
    let mut trace = profile::begin(&legacy, CopyKind::DeviceToDevice, dst.bytes());
    let from = src.on(&legacy)?;
    let mut dst = dst;
    let to = dst.on(&legacy)?;
    ctx.bind()?;
    // SAFETY: both ranges are device memory of `bytes` bytes on the same device, ordered on the
    // legacy stream; `dst` is exclusively borrowed, so it does not overlap `src`.
    trace.around(&legacy, || unsafe { ffi::dtod(to.device_ptr(), from.device_ptr(), to.bytes()) })
}
