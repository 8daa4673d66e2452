//! Copies and memsets: pointer classification, bounds checks, and the rules that decide whether a
//! call returns before or after its bytes move.
//!
//! Every address is checked against the allocation that contains it before anything is queued,
//! so a bad call writes nothing. Host-side rules (driver "API synchronization behavior"):
//! synchronous calls touching host memory return once complete; device-to-device copies and
//! device memsets are queued on the legacy stream and return at once; asynchronous calls on pinned
//! or device memory run later on the stream; an asynchronous copy *from* pageable memory stages
//! the bytes before returning, and one *into* pageable memory waits for its completion.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{CUresult, CUstream};

use crate::api::Fail;
use crate::context;
use crate::memory::{AllocKind, Allocation};
use crate::state::{SIM, State};
use crate::stream::{self, enqueue, wait_for};

/// One end of a copy or the target of a memset.
pub(crate) enum Endpoint {
    /// Inside a device or pinned allocation, at this offset.
    Mem(Arc<Allocation>, usize),
    /// Ordinary (pageable) host memory at this address.
    Pageable(usize),
}

impl Endpoint {
    fn ptr(&self) -> *mut u8 {
        match self {
            Endpoint::Mem(a, off) => a.host_ptr(*off),
            Endpoint::Pageable(p) => *p as *mut u8,
        }
    }

    fn is_device(&self) -> bool {
        matches!(self, Endpoint::Mem(a, _) if a.kind == AllocKind::Device)
    }

    fn is_pageable(&self) -> bool {
        matches!(self, Endpoint::Pageable(_))
    }
}

/// Where a copy reads from.
pub(crate) enum Source {
    /// Read when the operation runs.
    At(Endpoint),
    /// Bytes already copied out of pageable memory when the call was made.
    Staged(Vec<u8>),
}

/// Work queued on a stream.
pub(crate) enum Work {
    /// Copy `len` bytes.
    Copy { dst: Endpoint, src: Source, len: usize },
    /// Store `count` elements of `width` bytes (1, 2 or 4) holding `value`.
    Fill { dst: Endpoint, value: u32, width: usize, count: usize },
    /// Completes an event recording.
    Marker { event: u64 },
    /// Only orders (stream waits).
    Nop,
    /// `cuLaunchHostFunc`.
    HostFn { f: unsafe extern "C" fn(*mut c_void), data: usize },
}

/// How an API names a pointer.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Must be device-accessible memory (device allocation or pinned host memory).
    Device,
    /// Host memory (pinned or pageable).
    Host,
    /// Any (UVA, `cuMemcpy`).
    Unified,
}

fn resolve(st: &State, addr: u64, len: usize, role: Role, what: &str) -> Result<Endpoint, Fail> {
    if addr == 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("NULL {what} pointer with {len} bytes"),
        ));
    }
    if let Some(a) = st.find_alloc(addr) {
        if role == Role::Host && a.kind == AllocKind::Device {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{what} {addr:#x} is a device pointer where host memory is required"),
            ));
        }
        if !a.contains_range(addr, len as u64) {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "{what} range [{addr:#x}, +{len}) overruns its allocation [{:#x}, +{}) by {} byte(s)",
                    a.base,
                    a.bytes,
                    (addr - a.base + len as u64).saturating_sub(a.bytes)
                ),
            ));
        }
        return Ok(Endpoint::Mem(Arc::clone(a), (addr - a.base) as usize));
    }
    if st.in_device_space(addr) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{what} {addr:#x} is not inside a live allocation (freed or never allocated)"),
        ));
    }
    if role == Role::Device {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{what} {addr:#x} is neither device memory nor pinned host memory"),
        ));
    }
    Ok(Endpoint::Pageable(addr as usize))
}

/// Which stream a call targets: the legacy stream of the current context for synchronous calls.
fn target_stream(st: &mut State, stream: Option<CUstream>) -> Result<u64, Fail> {
    let dev = context::require(st)?;
    match stream {
        None => Ok(crate::state::legacy_id(dev)),
        Some(h) => stream_id(st, h),
    }
}

/// Resolves a `CUstream` argument (NULL/legacy/per-thread need a current context).
pub(crate) fn stream_id(st: &mut State, h: CUstream) -> Result<u64, Fail> {
    crate::exports::stream::resolve(st, h)
}

/// A 1-D copy of `len` bytes. `stream == None` = synchronous API.
///
/// # Safety
/// 1. Host (non-CUDA) addresses must be valid for `len` bytes of reads (source) or writes
///    (destination), as the C API requires of its caller.
pub(crate) unsafe fn memcpy(
    dst: u64,
    dst_role: Role,
    src: u64,
    src_role: Role,
    len: usize,
    stream: Option<CUstream>,
) -> Result<(), Fail> {
    let mut g = SIM.st.lock();
    let sid = target_stream(&mut g, stream)?;
    if len == 0 {
        return Ok(());
    }
    let d = resolve(&g, dst, len, dst_role, "destination")?;
    let s = resolve(&g, src, len, src_role, "source")?;
    let wait = match stream {
        None => !(d.is_device() && s.is_device()),
        Some(_) => d.is_pageable(),
    };
    let source = if stream.is_some() && s.is_pageable() && !d.is_pageable() {
        // SAFETY: the caller guarantees the pageable source is readable for `len` bytes; it is
        // staged now so the program may reuse it as soon as the call returns.
        Source::Staged(unsafe { std::slice::from_raw_parts(s.ptr(), len) }.to_vec())
    } else {
        Source::At(s)
    };
    let seq = enqueue(&mut g, sid, Work::Copy { dst: d, src: source, len }, Vec::new());
    if wait {
        wait_for(&mut g, &[(sid, seq)]);
    }
    Ok(())
}

/// A memset of `count` elements of `width` bytes. `stream == None` = synchronous API.
pub(crate) fn memset(
    dst: u64,
    value: u32,
    width: usize,
    count: usize,
    stream: Option<CUstream>,
) -> Result<(), Fail> {
    let mut g = SIM.st.lock();
    let sid = target_stream(&mut g, stream)?;
    if count == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(width as u64) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("destination {dst:#x} is not {width}-byte aligned"),
        ));
    }
    let bytes = count.checked_mul(width).ok_or_else(|| {
        Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{count} elements of {width} bytes overflow"),
        )
    })?;
    let d = resolve(&g, dst, bytes, Role::Device, "destination")?;
    let wait = stream.is_none() && !d.is_device();
    let seq = enqueue(&mut g, sid, Work::Fill { dst: d, value, width, count }, Vec::new());
    if wait {
        wait_for(&mut g, &[(sid, seq)]);
    }
    Ok(())
}

/// Moves the bytes of one copy or memset (engine thread, state lock released).
pub(crate) fn execute(work: Work) {
    match work {
        Work::Copy { dst, src, len } => {
            let d = dst.ptr();
            let s: *const u8 = match &src {
                Source::At(e) => e.ptr(),
                Source::Staged(v) => v.as_ptr(),
            };
            // SAFETY: both ranges were bounds-checked against live allocations (whose backing the
            // `Arc`s keep mapped) or are pageable host ranges the caller vouched for and is still
            // blocked on; `copy` tolerates overlap (device-to-device within one allocation).
            unsafe { std::ptr::copy(s, d, len) };
        }
        Work::Fill { dst, value, width, count } => {
            let d = dst.ptr();
            let total = count * width;
            let pattern = value.to_le_bytes();
            // SAFETY: `[d, d + total)` was bounds-checked when the memset was queued (and is kept
            // mapped by the `Arc`); the first element is written bytewise, then the filled prefix
            // is doubled with non-overlapping copies inside that range.
            unsafe {
                for (i, b) in pattern.iter().take(width).enumerate() {
                    d.add(i).write(*b);
                }
                let mut filled = width;
                while filled < total {
                    let n = filled.min(total - filled);
                    std::ptr::copy_nonoverlapping(d, d.add(filled), n);
                    filled += n;
                }
            }
        }
        Work::Marker { .. } | Work::Nop | Work::HostFn { .. } => {}
    }
}

/// Blocks until every stream of `device` has drained what is queued now.
pub(crate) fn sync_device(g: &mut parking_lot::MutexGuard<'_, State>, device: usize) {
    let targets = stream::all_targets(g, device);
    wait_for(g, &targets);
}
