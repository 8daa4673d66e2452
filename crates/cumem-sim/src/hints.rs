//! Managed-memory hints: advice, prefetches and stream attachment, recorded per page (see
//! `managed.rs` for the state) and read back by `cuMemRangeGetAttribute(s)`. Hints never change
//! data or access. Prefetches and attachments are stream operations: recorded when they run.

use cudarc::driver::sys::{CUdevice, CUresult, CUstream};

use crate::abi::{LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA, LOC_HOST_NUMA_CURRENT, MemLocation};
use crate::api::{ApiResult, Fail};
use crate::copy::Work;
use crate::managed::{DEVICE_CPU, Loc, PAGE, PageHints};
use crate::memory::AllocKind;
use crate::state::{SIM, State};
use crate::stream::enqueue;

/// `CU_MEM_ATTACH_SINGLE`.
const ATTACH_SINGLE: u32 = 4;
/// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
const ATTR_CONCURRENT_MANAGED_ACCESS: u32 = 89;

/// The managed allocation `[ptr, ptr + count)` lies in, as `(base, first page, last page)`.
pub(crate) fn managed_range(st: &State, ptr: u64, count: usize) -> Result<(u64, u64, u64), Fail> {
    let bad = |m: String| Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m);
    if count == 0 {
        return Err(bad("count is 0".into()));
    }
    let a = st.find_alloc(ptr).ok_or_else(|| bad(format!("{ptr:#x} is not CUDA memory")))?;
    if a.kind != AllocKind::Managed {
        return Err(bad(format!("{ptr:#x} is {} memory, not managed memory", a.kind.report_name())));
    }
    if !a.contains_range(ptr, count as u64) {
        return Err(bad(format!(
            "range [{ptr:#x}, +{count}) runs past the managed allocation [{:#x}, +{})",
            a.base, a.bytes
        )));
    }
    let off = ptr - a.base;
    Ok((a.base, off / PAGE, (off + count as u64 - 1) / PAGE))
}

/// Whether device `d` exists and has CONCURRENT_MANAGED_ACCESS; `INVALID_DEVICE` otherwise.
fn concurrent_device(st: &State, id: i32, what: &str) -> Result<usize, Fail> {
    let d = usize::try_from(id).ok().filter(|&d| d < st.devices.len()).ok_or_else(|| {
        Fail::misuse(CUresult::CUDA_ERROR_INVALID_DEVICE, format!("{what}: device {id} does not exist"))
    })?;
    if st.devices[d].attr(ATTR_CONCURRENT_MANAGED_ACCESS) != Some(1) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            format!("{what}: device {d} has no CONCURRENT_MANAGED_ACCESS"),
        ));
    }
    Ok(d)
}

/// Validates a location for a preferred location or a prefetch target.
fn target(st: &State, l: MemLocation, what: &str) -> Result<Loc, Fail> {
    match l.kind {
        LOC_DEVICE => concurrent_device(st, l.id, what).map(|d| (LOC_DEVICE, d as i32)),
        LOC_HOST => Ok((LOC_HOST, 0)),
        // The simulated host has a single NUMA node, 0.
        LOC_HOST_NUMA if l.id == 0 => Ok((LOC_HOST_NUMA, 0)),
        LOC_HOST_NUMA_CURRENT => Ok((LOC_HOST_NUMA, 0)),
        LOC_HOST_NUMA => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{what}: host NUMA node {} does not exist", l.id),
        )),
        k => Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("{what}: location type {k} is not valid"),
        )),
    }
}

/// The v2 location a v1 `CUdevice` stands for.
pub(crate) fn v1_location(device: CUdevice) -> MemLocation {
    if device == DEVICE_CPU {
        MemLocation { kind: LOC_HOST, id: 0 }
    } else {
        MemLocation { kind: LOC_DEVICE, id: device }
    }
}

pub(crate) fn advise(ptr: u64, count: usize, advice: u32, location: MemLocation) -> ApiResult {
    let mut st = SIM.st.lock();
    let (base, first, last) = managed_range(&st, ptr, count)?;
    let accessed_by = |st: &State| -> Result<(Option<usize>, bool), Fail> {
        match location.kind {
            LOC_DEVICE => concurrent_device(st, location.id, "ACCESSED_BY").map(|d| (Some(d), false)),
            LOC_HOST => Ok((None, true)),
            k => Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("ACCESSED_BY: location type {k} is not a device or the host"),
            )),
        }
    };
    fn m(st: &mut State, base: u64) -> &mut crate::managed::Managed {
        st.managed.get_mut(&base).expect("managed allocations have state")
    }
    match advice {
        1 | 2 => {
            let on = advice == 1;
            m(&mut st, base).update(first, last, |h| h.read_mostly = on);
        }
        3 => {
            let loc = target(&st, location, "SET_PREFERRED_LOCATION")?;
            m(&mut st, base).update(first, last, |h| h.preferred = Some(loc));
        }
        4 => m(&mut st, base).update(first, last, |h| h.preferred = None),
        5 | 6 => {
            let (dev, cpu) = accessed_by(&st)?;
            let on = advice == 5;
            m(&mut st, base).update(first, last, |h| match dev {
                Some(d) if on => h.accessed_by |= 1 << d,
                Some(d) => h.accessed_by &= !(1 << d),
                None => h.accessed_by_cpu = on && cpu,
            });
        }
        _ => {
            return Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, format!("unknown advice {advice}")));
        }
    }
    Ok(())
}

pub(crate) fn prefetch(
    ptr: u64,
    count: usize,
    location: MemLocation,
    flags: u32,
    h_stream: CUstream,
) -> ApiResult {
    let mut st = SIM.st.lock();
    let sid = crate::hold::resolve_gated(&mut st, h_stream)?;
    if flags != 0 {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_VALUE,
            format!("prefetch flags {flags:#x} must be 0"),
        ));
    }
    let (base, first, last) = managed_range(&st, ptr, count)?;
    let loc = target(&st, location, "prefetch destination")?;
    let sdev = st.streams[&sid].device;
    concurrent_device(&st, sdev as i32, "prefetch stream's device")?;
    let buffer_id = st.allocs[&base].buffer_id;
    enqueue(&mut st, sid, Work::Prefetch { base, buffer_id, first, last, loc }, Vec::new());
    Ok(())
}

/// `cuStreamAttachMemAsync`: checks the call now, and queues the attachment, which takes effect
/// (what `Managed::attach`/`stream` and the live report show) when the stream's earlier work has
/// completed, as the driver documents ("a stream-ordered operation ... will only take effect when
/// previous work in stream has completed"). The attachment names the stream it was queued on.
pub(crate) fn attach(h_stream: CUstream, dptr: u64, length: usize, flags: u32) -> ApiResult {
    let mut st = SIM.st.lock();
    let sid = crate::hold::resolve_gated(&mut st, h_stream)?;
    let bad = |m: String| Err(Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, m));
    if !matches!(flags, 1 | 2 | 4) {
        return bad(format!("attach flags {flags:#x} must be exactly one of GLOBAL, HOST, SINGLE"));
    }
    if flags == ATTACH_SINGLE && matches!(h_stream as u64, 0 | 1) {
        return bad("CU_MEM_ATTACH_SINGLE on the NULL stream".into());
    }
    let a = match st.find_alloc(dptr) {
        Some(a) if a.kind == AllocKind::Managed && a.base == dptr => a.clone(),
        Some(a) if a.kind == AllocKind::Managed => {
            return bad(format!(
                "{dptr:#x} is an interior pointer of the managed allocation at {:#x}",
                a.base
            ));
        }
        _ => return bad(format!("{dptr:#x} is not a managed allocation")),
    };
    if length != 0 && length as u64 != a.bytes {
        return bad(format!("length {length} must be 0 or the allocation's size {}", a.bytes));
    }
    enqueue(&mut st, sid, Work::Attach { base: dptr, buffer_id: a.buffer_id, flags }, Vec::new());
    // Until it runs, the attachment in effect when device work runs is not known at its call.
    if let Some(m) = st.managed.get_mut(&dptr) {
        m.queued_attachments += 1;
    }
    Ok(())
}

/// The hints of the pages `[ptr, ptr + count)` covers, which must lie inside one managed
/// allocation (`cuMemRangeGetAttribute(s)`).
pub(crate) fn pages(ptr: u64, count: usize) -> Result<Vec<PageHints>, Fail> {
    let st = SIM.st.lock();
    let (base, first, last) = managed_range(&st, ptr, count)?;
    Ok(st.managed[&base].range(first, last))
}
