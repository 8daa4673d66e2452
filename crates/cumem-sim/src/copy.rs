//! Copies and memsets: pointer classification, bounds checks, and the rules that decide whether a
//! call returns before or after its bytes move.
//!
//! Every address is checked against the allocation that contains it before anything is queued,
//! so a bad call writes nothing. Host-side rules (driver "API synchronization behavior"):
//! synchronous calls touching host memory return once complete; device-to-device copies and
//! device memsets are queued on the legacy stream and return at once; asynchronous calls on pinned
//! or device memory run later on the stream; an asynchronous copy *from* pageable memory stages
//! the bytes before returning, and one *into* pageable memory waits for its completion; an
//! asynchronous copy between two host memories (pinned, mapped, registered or pageable, whichever
//! address names them) waits for the stream's earlier work and its own completion, as observed on
//! an H100 (`async_waits`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{CUresult, CUstream};
use parking_lot::MutexGuard;

use crate::api::Fail;
use crate::memory::{AllocKind, Allocation};
use crate::state::{SIM, State};
use crate::stream::{enqueue, wait_for};

/// One end of a copy or the target of a memset.
pub(crate) enum Endpoint {
    /// Inside a device or pinned allocation, at this offset; for managed memory of a device without
    /// concurrent managed access, once the call has passed its checks ([`admit`]), one endpoint per
    /// allocation holds the device use that keeps the host out until the operation is dropped (see
    /// [`crate::managed::HostView`]): held only for its drop, which lets the host back in.
    Mem(Arc<Allocation>, usize, Option<crate::managed::DeviceUse>),
    /// Ordinary (pageable) host memory at this address.
    Pageable(usize),
}

impl Endpoint {
    fn ptr(&self) -> *mut u8 {
        match self {
            Endpoint::Mem(a, off, _) => a.host_ptr(*off),
            Endpoint::Pageable(p) => *p as *mut u8,
        }
    }

    /// Device memory that a synchronous call may return before touching: device-only memory
    /// without SYNC_MEMOPS (`cuPointerSetAttribute`), which makes synchronous operations on the
    /// allocation complete before they return.
    fn is_device(&self) -> bool {
        matches!(self, Endpoint::Mem(a, ..) if a.kind.device_only() && !crate::sync_memops::is_set(a.buffer_id))
    }

    fn is_pageable(&self) -> bool {
        matches!(self, Endpoint::Pageable(_))
    }

    /// Host memory: pageable, or page-locked (pinned, mapped, registered) whichever address names
    /// it. Managed memory is not: it migrates, and no copy of it was observed.
    fn is_host(&self) -> bool {
        match self {
            Endpoint::Pageable(_) => true,
            Endpoint::Mem(a, ..) => a.kind.pinned(),
        }
    }
}

/// Whether an asynchronous copy returns only when complete: one into pageable memory (driver
/// documentation), and one whose source and destination are both host memory. The latter was
/// observed on an H100, 2026-11-23: with the stream held by a blocking host function,
/// `cuMemcpyHtoDAsync` pinned → mapped (its device pointer), pageable → mapped and pinned → pinned
/// (a pinned address as the "device" end), `cuMemcpyDtoHAsync` mapped → pinned, `cuMemcpyDtoDAsync`
/// mapped → mapped and `cuMemcpyAsync` pinned → mapped all blocked in the call until the host
/// function returned, then returned with the bytes copied; with one end in device memory the same
/// calls, and memsets of mapped memory, returned at once. Which thread moves the bytes on a GPU
/// was not observed (the calling thread, presumably); here the copy is queued and waited for: the
/// call returns after the same work, with the same bytes, but work another thread queues on the
/// same stream meanwhile runs after the copy here, where on a GPU it might run first. The 2D/3D,
/// peer, per-thread, batch and legacy-stream forms, and registered memory, follow the same rule
/// unobserved (they share this path). The wait
/// does not hold the device (`crate::hold`): nothing observed says it does, and it waits for one
/// stream's work, not the device's, like the synchronous copies.
fn async_waits<'a>(
    dst: impl IntoIterator<Item = &'a Endpoint>,
    src: impl IntoIterator<Item = &'a Endpoint>,
) -> bool {
    let dst: Vec<&Endpoint> = dst.into_iter().collect();
    dst.iter().any(|e| e.is_pageable())
        || (dst.iter().all(|e| e.is_host()) && src.into_iter().all(Endpoint::is_host))
}

/// Where a copy reads from.
pub(crate) enum Source {
    /// Read when the operation runs.
    At(Endpoint),
    /// Bytes already copied out of pageable memory when the call was made.
    Staged(Vec<u8>),
}

/// Where one row of a 2D/3D copy reads from.
pub(crate) enum RowSource {
    /// Read when the operation runs.
    At(Endpoint),
    /// Staged at the call, at this offset of the operation's staging buffer.
    Staged(usize),
}

/// Work queued on a stream.
pub(crate) enum Work {
    /// Copy `len` bytes.
    Copy { dst: Endpoint, src: Source, len: usize },
    /// Store `count` elements of `width` bytes (1, 2 or 4) holding `value`.
    Fill { dst: Endpoint, value: u32, width: usize, count: usize },
    /// A 2D/3D copy: `len` bytes per row.
    Rows { rows: Vec<(Endpoint, RowSource)>, staged: Vec<u8>, len: usize },
    /// A 2D memset: `count` elements of `width` bytes per row.
    FillRows { rows: Vec<Endpoint>, value: u32, width: usize, count: usize },
    /// Completes an event recording.
    Marker {
        event: u64,
        /// For an interprocess event: its shared counters and this recording's number, published
        /// when the marker runs even if the event was destroyed meanwhile.
        shared: Option<(std::sync::Arc<crate::ipc::event::SharedEvent>, u64)>,
    },
    /// Only orders (stream waits, allocator waits).
    Nop,
    /// `cuMemFreeAsync`: when reached in stream order, the allocation's free takes effect.
    Free { alloc: Arc<Allocation> },
    /// Records the last prefetch location of pages `first..=last` of a managed allocation.
    Prefetch { base: u64, buffer_id: u64, first: u64, last: u64, loc: crate::managed::Loc },
    /// `cuStreamAttachMemAsync`: when reached in stream order, the managed allocation at `base`
    /// (if it is still the one numbered `buffer_id`) takes the attachment `flags` to the stream
    /// the operation runs on.
    Attach { base: u64, buffer_id: u64, flags: u32 },
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

/// Resolves one endpoint of an operation queued on a stream of device `dev`: VMM mappings are
/// checked against `dev`'s access, since the device that runs the work is the stream's, not the
/// calling thread's current context's.
fn resolve(st: &State, dev: usize, addr: u64, len: usize, role: Role, what: &str) -> Result<Endpoint, Fail> {
    if addr == 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("NULL {what} pointer with {len} bytes"),
        ));
    }
    if let Some(a) = st.find_alloc(addr) {
        if role == Role::Host && a.kind.device_only() {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("{what} {addr:#x} is a device pointer where host memory is required"),
            ));
        }
        if a.kind == AllocKind::Vmm {
            // Adjacent mappings of one reservation are one range (observed): the host view is
            // contiguous across them, so the endpoint may run past this mapping's end.
            crate::vmm::check_span(st, dev, addr, len as u64, false)?;
        } else if !a.contains_range(addr, len as u64) {
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
        // The device use of managed memory is taken once the whole call has passed ([`admit`]).
        return Ok(Endpoint::Mem(Arc::clone(a), (addr - a.base) as usize, None));
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

/// Refuses writes into memory registered with `CU_MEMHOSTREGISTER_READ_ONLY`, and into VMM
/// mappings device `dev` (the device of the stream the write is queued on) may only read.
fn writable(st: &State, dev: usize, e: &Endpoint, addr: u64, len: usize) -> Result<(), Fail> {
    match e {
        Endpoint::Mem(a, ..) if a.kind == AllocKind::Vmm => {
            crate::vmm::check_span(st, dev, addr, len as u64, true)
        }
        Endpoint::Mem(a, ..)
            if a.kind == AllocKind::Registered && a.host_flags & crate::memory::REGISTER_READ_ONLY != 0 =>
        {
            Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("destination {addr:#x} is registered read-only (CU_MEMHOSTREGISTER_READ_ONLY)"),
            ))
        }
        _ => Ok(()),
    }
}

/// The last step of a copy or memset that passed every check, just before its work is queued on
/// stream `sid`: gives the work the device use of each managed allocation it touches (the host's
/// view of such memory is `PROT_NONE` until the work is done or dropped:
/// [`crate::managed::DeviceUse`]), and checks, once for the call, the attachments of those it
/// accesses from the device (`ends`: each endpoint, with whether it is a device side: a `DtoX`/`XtoD`
/// end, a memset's destination; see [`crate::managed::check_device_side`]). Last, so that a
/// refused call neither keeps the host out nor is logged as device work.
fn admit<'a>(st: &State, sid: u64, ends: impl IntoIterator<Item = (&'a mut Endpoint, bool)>) {
    let mut touched: Vec<Arc<Allocation>> = Vec::new();
    let mut device_side: Vec<Arc<Allocation>> = Vec::new();
    for (e, on_device) in ends {
        let Endpoint::Mem(a, _, device_use) = e else { continue };
        if a.kind != AllocKind::Managed {
            continue;
        }
        // One use per allocation: the endpoint that takes it lives as long as the work.
        if !touched.iter().any(|t| Arc::ptr_eq(t, a)) {
            *device_use = crate::managed::device_use(st, a);
            touched.push(Arc::clone(a));
        }
        if on_device && !device_side.iter().any(|t| Arc::ptr_eq(t, a)) {
            device_side.push(Arc::clone(a));
        }
    }
    crate::managed::check_device_side(st, sid, &device_side);
}

/// Which stream a call targets: the legacy stream of the current context for synchronous calls.
/// Copies and memsets queue work, so they wait while another thread holds the device in an
/// implicit synchronisation (see `crate::hold`; observed for the asynchronous forms, and the
/// synchronous forms queue their work the same way).
fn target_stream(g: &mut MutexGuard<'_, State>, stream: Option<CUstream>) -> Result<u64, Fail> {
    let (ctx, dev) = crate::hold::current_gated(g)?;
    match stream {
        None => Ok(g.legacy_stream(ctx, dev)),
        Some(h) => crate::hold::resolve_gated(g, h),
    }
}

/// [`target_stream`] and the call's own checks (`check`, given the stream) for a call that queues
/// a work item (`queues`: false for an empty one, which queues nothing). The checks come first,
/// so an invalid call fails at once even on a full stream (observed); a valid one then waits for
/// room as a GPU's full queue makes the call wait (see [`crate::hold::QUEUE_DEPTH`]), and
/// everything is looked up and checked again after a wait. Before that, it waits while another
/// thread's host function launch waits for room in the stream's context (observed). The lock
/// stays held from the last look until the caller queues its work, so the room is still there
/// then.
fn queue_checked<T>(
    g: &mut MutexGuard<'_, State>,
    stream: Option<CUstream>,
    queues: bool,
    mut check: impl FnMut(&State, u64) -> Result<T, Fail>,
) -> Result<(u64, T), Fail> {
    loop {
        let sid = target_stream(g, stream)?;
        if queues && crate::hold::gate_full(g, sid, crate::hold::Gated::Work) {
            continue;
        }
        let checked = check(g, sid)?;
        if !queues || !crate::hold::wait_room(g, sid, crate::hold::Full::Work) {
            return Ok((sid, checked));
        }
    }
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
    let Some((sid, mut d, mut s)) =
        resolve_copy(&mut g, (dst, dst_role), (src, src_role), len, stream, true)?
    else {
        return Ok(());
    };
    admit(&g, sid, [(&mut d, dst_role == Role::Device), (&mut s, src_role == Role::Device)]);
    let wait = match stream {
        None => !(d.is_device() && s.is_device()),
        Some(_) => async_waits([&d], [&s]),
    };
    let source = if !wait && s.is_pageable() {
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

/// What every 1D copy checks at the call: the stream (the legacy one for `None`), then the
/// destination (writable) and the source, each inside one allocation or pageable memory as its
/// role allows. `None` for an empty copy, which checks only the stream. With `queue`, a copy that
/// is not empty then waits for room on its stream ([`queue_checked`]).
fn resolve_copy(
    g: &mut MutexGuard<'_, State>,
    (dst, dst_role): (u64, Role),
    (src, src_role): (u64, Role),
    len: usize,
    stream: Option<CUstream>,
    queue: bool,
) -> Result<Option<(u64, Endpoint, Endpoint)>, Fail> {
    let (sid, ends) = queue_checked(g, stream, queue && len != 0, |st, sid| {
        if len == 0 {
            return Ok(None);
        }
        let dev = st.streams[&sid].device;
        let d = resolve(st, dev, dst, len, dst_role, "destination")?;
        writable(st, dev, &d, dst, len)?;
        let s = resolve(st, dev, src, len, src_role, "source")?;
        Ok(Some((d, s)))
    })?;
    Ok(ends.map(|(d, s)| (sid, d, s)))
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
    let (sid, d) = queue_checked(&mut g, stream, count != 0, |st, sid| {
        if count == 0 {
            return Ok(None);
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
        let dev = st.streams[&sid].device;
        let d = resolve(st, dev, dst, bytes, Role::Device, "destination")?;
        writable(st, dev, &d, dst, bytes)?;
        Ok(Some(d))
    })?;
    let Some(mut d) = d else {
        return Ok(());
    };
    admit(&g, sid, [(&mut d, true)]);
    let wait = stream.is_none() && !d.is_device();
    let seq = enqueue(&mut g, sid, Work::Fill { dst: d, value, width, count }, Vec::new());
    if wait {
        wait_for(&mut g, &[(sid, seq)]);
    }
    Ok(())
}

impl Work {
    /// The device-side byte ranges `(address, length)` the operation reads or writes (host memory
    /// included; pageable host memory and staged bytes are not device addresses, so left out).
    pub(crate) fn spans(&self) -> Vec<(u64, u64)> {
        fn add(out: &mut Vec<(u64, u64)>, e: &Endpoint, len: usize) {
            if let Endpoint::Mem(a, off, _) = e {
                out.push((a.base + *off as u64, len as u64));
            }
        }
        let mut out = Vec::new();
        match self {
            Work::Copy { dst, src, len } => {
                add(&mut out, dst, *len);
                if let Source::At(e) = src {
                    add(&mut out, e, *len);
                }
            }
            Work::Fill { dst, width, count, .. } => add(&mut out, dst, width * count),
            Work::Rows { rows, len, .. } => {
                for (d, s) in rows {
                    add(&mut out, d, *len);
                    if let RowSource::At(e) = s {
                        add(&mut out, e, *len);
                    }
                }
            }
            Work::FillRows { rows, width, count, .. } => {
                for d in rows {
                    add(&mut out, d, width * count);
                }
            }
            Work::Marker { .. }
            | Work::Nop
            | Work::Free { .. }
            | Work::Prefetch { .. }
            | Work::Attach { .. }
            | Work::HostFn { .. } => {}
        }
        out
    }

    /// The distinct allocations whose bytes the operation reads or writes.
    pub(crate) fn touched(&self) -> Vec<&Arc<Allocation>> {
        fn add<'a>(out: &mut Vec<&'a Arc<Allocation>>, e: &'a Endpoint) {
            if let Endpoint::Mem(a, ..) = e
                && !out.iter().any(|b| Arc::ptr_eq(a, b))
            {
                out.push(a);
            }
        }
        let mut out: Vec<&Arc<Allocation>> = Vec::new();
        match self {
            Work::Copy { dst, src, .. } => {
                add(&mut out, dst);
                if let Source::At(e) = src {
                    add(&mut out, e);
                }
            }
            Work::Fill { dst, .. } => add(&mut out, dst),
            Work::Rows { rows, .. } => {
                for (d, s) in rows {
                    add(&mut out, d);
                    if let RowSource::At(e) = s {
                        add(&mut out, e);
                    }
                }
            }
            Work::FillRows { rows, .. } => {
                for d in rows {
                    add(&mut out, d);
                }
            }
            Work::Marker { .. }
            | Work::Nop
            | Work::Free { .. }
            | Work::Prefetch { .. }
            | Work::Attach { .. }
            | Work::HostFn { .. } => {}
        }
        out
    }
}

/// Stores `count` elements of `width` bytes holding `value` at `dst`.
fn fill(dst: &Endpoint, value: u32, width: usize, count: usize) {
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

/// Moves the bytes of one copy or memset (engine thread, state lock released).
pub(crate) fn execute(work: &Work) {
    match work {
        Work::Copy { dst, src, len } => {
            let d = dst.ptr();
            let s: *const u8 = match src {
                Source::At(e) => e.ptr(),
                Source::Staged(v) => v.as_ptr(),
            };
            // SAFETY: both ranges were bounds-checked against live allocations (whose backing the
            // `Arc`s keep mapped) or are pageable host ranges the caller vouched for and is still
            // blocked on; `copy` tolerates overlap (device-to-device within one allocation, or
            // between pool allocations that share their chunk's mapping).
            unsafe { std::ptr::copy(s, d, *len) };
        }
        Work::Fill { dst, value, width, count } => fill(dst, *value, *width, *count),
        Work::Rows { rows, staged, len } => {
            for (d, s) in rows {
                let sp: *const u8 = match s {
                    RowSource::At(e) => e.ptr(),
                    RowSource::Staged(off) => staged[*off..].as_ptr(),
                };
                // SAFETY: every row was bounds-checked as for a 1-D copy when the copy was queued.
                unsafe { std::ptr::copy(sp, d.ptr(), *len) };
            }
        }
        Work::FillRows { rows, value, width, count } => {
            for dst in rows {
                fill(dst, *value, *width, *count);
            }
        }
        Work::Marker { .. }
        | Work::Nop
        | Work::Free { .. }
        | Work::HostFn { .. }
        | Work::Prefetch { .. }
        | Work::Attach { .. } => {}
    }
}

/// One side of a 2D/3D copy, decoded from `CUDA_MEMCPY2D` / `CUDA_MEMCPY3D`.
pub(crate) struct Side {
    pub(crate) mem_type: u32,
    pub(crate) host: u64,
    pub(crate) device: u64,
    pub(crate) array: u64,
    pub(crate) x: usize,
    pub(crate) y: usize,
    pub(crate) z: usize,
    pub(crate) lod: usize,
    pub(crate) pitch: usize,
    /// Rows per slice (3D only; 0 for 2D).
    pub(crate) height: usize,
}

/// A decoded 2D (depth 1) or 3D copy.
pub(crate) struct Copy3D {
    pub(crate) src: Side,
    pub(crate) dst: Side,
    pub(crate) width: usize,
    pub(crate) height: usize,
    pub(crate) depth: usize,
    /// `reserved0`/`reserved1` of `CUDA_MEMCPY3D` are non-NULL.
    pub(crate) reserved_set: bool,
    pub(crate) three_d: bool,
}

const HOST: u32 = 1;
const DEVICE: u32 = 2;
const ARRAY: u32 = 3;
const UNIFIED: u32 = 4;

fn bad(m: String) -> Fail {
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m)
}

/// The side's base address for its memory type and the role its rows resolve with.
fn side_base(s: &Side) -> (u64, Role) {
    match s.mem_type {
        HOST => (s.host, Role::Host),
        DEVICE => (s.device, Role::Device),
        UNIFIED => (s.device, Role::Unified),
        _ => unreachable!("memory types are validated first"),
    }
}

/// Address of row `y` of slice `z` of one side.
fn row_addr(s: &Side, base: u64, z: usize, y: usize, what: &str) -> Result<u64, Fail> {
    ((s.z as u64).checked_add(z as u64))
        .and_then(|v| v.checked_mul(s.height as u64))
        .and_then(|v| v.checked_add(s.y as u64))
        .and_then(|v| v.checked_add(y as u64))
        .and_then(|v| v.checked_mul(s.pitch as u64))
        .and_then(|v| v.checked_add(s.x as u64))
        .and_then(|v| v.checked_add(base))
        .ok_or_else(|| bad(format!("{what} address computation overflows")))
}

/// The checks of one side that need no per-row work: pitch and slice height, and the first and
/// last rows resolved (rows lie at increasing addresses, so a side whose last row overruns fails
/// here). Done for both sides before either side's rows are built, so an absurd extent is refused
/// before anything proportional to its row count is allocated.
fn side_checks(st: &State, dev: usize, c: &Copy3D, s: &Side, what: &str, max_pitch: u64) -> Result<(), Fail> {
    if c.height > 1 || c.depth > 1 {
        let need = c.width.checked_add(s.x).ok_or_else(|| bad(format!("{what}: x + width overflows")))?;
        if s.pitch < need {
            return Err(bad(format!(
                "{what}Pitch {} < WidthInBytes {} + {what}XInBytes {}",
                s.pitch, c.width, s.x
            )));
        }
    }
    // Only for more than one row: an H100 (driver 580.159.04, 2026-11-24) accepted one-row
    // device-to-device cuMemcpy2D and cuMemcpy2DAsync with both pitches MAX_PITCH + 512, as it
    // ignores a one-row pitch for the rule that a pitch must hold a row. Multi-row copies with a
    // pitch above it were not tried: refused, as the documentation says (driver-api.md §6.3).
    if (c.height > 1 || c.depth > 1) && s.pitch as u64 > max_pitch {
        return Err(bad(format!("{what}Pitch {} exceeds MAX_PITCH {max_pitch}", s.pitch)));
    }
    if c.three_d && c.depth > 1 && s.height < c.height.saturating_add(s.y) {
        return Err(bad(format!("{what}Height {} < Height {} + {what}Y {}", s.height, c.height, s.y)));
    }
    let (base, role) = side_base(s);
    let (z, y) = (c.depth - 1, c.height - 1);
    resolve(st, dev, row_addr(s, base, 0, 0, what)?, c.width, role, &format!("{what} first row"))?;
    let last = row_addr(s, base, z, y, what)?;
    resolve(st, dev, last, c.width, role, &format!("{what} last row (z {z}, y {y})"))?;
    Ok(())
}

/// The rows of one side (checked first by [`side_checks`]), each resolved against the
/// allocation containing it.
fn side_rows(st: &State, dev: usize, c: &Copy3D, s: &Side, what: &str) -> Result<Vec<(u64, Endpoint)>, Fail> {
    let (base, role) = side_base(s);
    // Grown as rows resolve (not sized up front): a middle row outside any allocation stops it.
    let mut rows = Vec::new();
    let mut last: Option<Arc<Allocation>> = None;
    for z in 0..c.depth {
        for y in 0..c.height {
            let row = row_addr(s, base, z, y, what)?;
            let e = match &last {
                // A row inside the allocation of the row before: resolved already.
                Some(a) if a.contains_range(row, c.width as u64) => {
                    Endpoint::Mem(Arc::clone(a), (row - a.base) as usize, None)
                }
                _ => resolve(st, dev, row, c.width, role, &format!("{what} row (z {z}, y {y})"))?,
            };
            if let Endpoint::Mem(a, ..) = &e {
                last = Some(Arc::clone(a));
            }
            rows.push((row, e));
        }
    }
    Ok(rows)
}

/// A 2D or 3D copy (`stream == None`: synchronous API). Validation per the driver: memory types
/// HOST/DEVICE/UNIFIED (ARRAY: no CUDA array can exist in the simulator → `INVALID_VALUE`), LOD and
/// reserved fields 0, pitches holding `x + width` when more than one row is copied, slice heights
/// holding `y + height` when more than one slice is copied; a zero extent succeeds untouched;
/// every row of both sides is checked against its allocation before anything is queued.
///
/// # Safety
/// 1. Host (non-CUDA) rows are valid for reading (source) or writing (destination), as the C API
///    requires of its caller; a pageable destination stays valid until the call returns.
pub(crate) unsafe fn memcpy_3d(c: Copy3D, stream: Option<CUstream>) -> Result<(), Fail> {
    let mut g = SIM.st.lock();
    let queues = c.width != 0 && c.height != 0 && c.depth != 0;
    let (sid, rows) = queue_checked(&mut g, stream, queues, |st, sid| {
        for (s, what) in [(&c.src, "src"), (&c.dst, "dst")] {
            match s.mem_type {
                HOST | DEVICE | UNIFIED => {}
                ARRAY => {
                    return Err(bad(format!(
                        "{what}MemoryType CU_MEMORYTYPE_ARRAY: CUDA arrays are not modelled, so {:#x} is not an array",
                        s.array
                    )));
                }
                t => return Err(bad(format!("{what}MemoryType {t} is not a CUmemorytype"))),
            }
            if s.lod != 0 {
                return Err(bad(format!("{what}LOD {} must be 0", s.lod)));
            }
        }
        if c.reserved_set {
            return Err(bad("reserved0/reserved1 must be NULL".into()));
        }
        if !queues {
            return Ok(None);
        }
        let dev = st.streams[&sid].device;
        let max_pitch = st.devices[dev].attr(11).unwrap_or(i32::MAX) as u64;
        side_checks(st, dev, &c, &c.src, "src", max_pitch)?;
        side_checks(st, dev, &c, &c.dst, "dst", max_pitch)?;
        let src = side_rows(st, dev, &c, &c.src, "src")?;
        let dst = side_rows(st, dev, &c, &c.dst, "dst")?;
        for (addr, e) in &dst {
            writable(st, dev, e, *addr, c.width)?;
        }
        Ok(Some((src, dst)))
    })?;
    let Some((mut src, mut dst)) = rows else {
        return Ok(());
    };
    let on_device = |s: &Side| side_base(s).1 == Role::Device;
    let (dst_on_device, src_on_device) = (on_device(&c.dst), on_device(&c.src));
    let ends = dst.iter_mut().map(|(_, e)| (e, dst_on_device));
    admit(&g, sid, ends.chain(src.iter_mut().map(|(_, e)| (e, src_on_device))));
    let all_device = src.iter().chain(&dst).all(|(_, e)| e.is_device());
    let wait = match stream {
        None => !all_device,
        Some(_) => async_waits(dst.iter().map(|(_, e)| e), src.iter().map(|(_, e)| e)),
    };
    let stage = !wait;
    let mut staged = Vec::new();
    let rows = dst
        .into_iter()
        .zip(src)
        .map(|((_, d), (_, s))| {
            let s = if stage && s.is_pageable() {
                let off = staged.len();
                // SAFETY: the caller guarantees pageable source rows are readable; they are
                // staged now so the program may reuse them once the call returns.
                staged.extend_from_slice(unsafe { std::slice::from_raw_parts(s.ptr(), c.width) });
                RowSource::Staged(off)
            } else {
                RowSource::At(s)
            };
            (d, s)
        })
        .collect();
    let seq = enqueue(&mut g, sid, Work::Rows { rows, staged, len: c.width }, Vec::new());
    if wait {
        wait_for(&mut g, &[(sid, seq)]);
    }
    Ok(())
}

/// A 2D memset of `height` rows of `count` elements of `width` bytes, `pitch` bytes apart
/// (`stream == None`: synchronous API).
pub(crate) fn memset_2d(
    dst: u64,
    pitch: usize,
    value: u32,
    width: usize,
    count: usize,
    height: usize,
    stream: Option<CUstream>,
) -> Result<(), Fail> {
    let mut g = SIM.st.lock();
    let (sid, rows) = queue_checked(&mut g, stream, count != 0 && height != 0, |st, sid| {
        if count == 0 || height == 0 {
            return Ok(None);
        }
        if !dst.is_multiple_of(width as u64) {
            return Err(bad(format!("destination {dst:#x} is not {width}-byte aligned")));
        }
        let row_bytes = count
            .checked_mul(width)
            .ok_or_else(|| bad(format!("{count} elements of {width} bytes overflow")))?;
        if height > 1 && (pitch < row_bytes || !pitch.is_multiple_of(width)) {
            return Err(bad(format!(
                "dstPitch {pitch} must hold a row of {row_bytes} bytes and be a multiple of {width}"
            )));
        }
        let dev = st.streams[&sid].device;
        // The last row first: rows lie at increasing addresses, so an absurd height is refused
        // here, before anything proportional to it is allocated.
        let last = ((height - 1) as u64)
            .checked_mul(pitch as u64)
            .and_then(|o| o.checked_add(dst))
            .ok_or_else(|| bad("row address overflows".into()))?;
        let e = resolve(st, dev, last, row_bytes, Role::Device, &format!("destination row {}", height - 1))?;
        writable(st, dev, &e, last, row_bytes)?;
        drop(e);
        let mut rows = Vec::new();
        for y in 0..height {
            let row = (y as u64)
                .checked_mul(pitch as u64)
                .and_then(|o| o.checked_add(dst))
                .ok_or_else(|| bad("row address overflows".into()))?;
            let e = resolve(st, dev, row, row_bytes, Role::Device, &format!("destination row {y}"))?;
            writable(st, dev, &e, row, row_bytes)?;
            rows.push(e);
        }
        Ok(Some(rows))
    })?;
    let Some(mut rows) = rows else {
        return Ok(());
    };
    admit(&g, sid, rows.iter_mut().map(|e| (e, true)));
    let wait = stream.is_none() && !rows.iter().all(Endpoint::is_device);
    let seq = enqueue(&mut g, sid, Work::FillRows { rows, value, width, count }, Vec::new());
    if wait {
        wait_for(&mut g, &[(sid, seq)]);
    }
    Ok(())
}

/// The checks [`memcpy`] makes of an asynchronous `cuMemcpyAsync(dst, src, len, stream)`
/// ([`resolve_copy`]), made without queuing anything (`cuMemcpyBatchAsync` validates every copy before it queues any).
/// With `stage`, also the source's bytes when the host can read the source now: pageable memory,
/// page-locked memory, or managed memory, read through the engine's mapping (the program's may
/// be `PROT_NONE` while device work uses it); `None` for device memory, which the copy reads in
/// stream order.
///
/// # Safety
/// 1. With `stage`, a pageable (non-CUDA) source is valid for `len` bytes of reading, as the C
///    API requires of its caller.
pub(crate) unsafe fn check_async_copy(
    dst: u64,
    src: u64,
    len: usize,
    stream: CUstream,
    stage: bool,
) -> Result<Option<Vec<u8>>, Fail> {
    let mut g = SIM.st.lock();
    let unified = |addr| (addr, Role::Unified);
    let Some((_, _, s)) = resolve_copy(&mut g, unified(dst), unified(src), len, Some(stream), false)? else {
        return Ok(None);
    };
    let host_readable = match &s {
        Endpoint::Pageable(_) => true,
        Endpoint::Mem(a, ..) => !a.kind.device_only(),
    };
    if !(stage && host_readable) {
        return Ok(None);
    }
    // SAFETY: `resolve` found the source inside a live host-visible allocation (whose mapping
    // the held state keeps alive) or, outside every CUDA range, in pageable memory the caller
    // guarantees readable.
    Ok(Some(unsafe { std::slice::from_raw_parts(s.ptr(), len) }.to_vec()))
}
