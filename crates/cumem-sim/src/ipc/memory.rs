//! `cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`.
//!
//! An import is an allocation of kind `ipc_import` in the importer's live report, at an address of
//! the importer's own device range, charged to nothing (the exporter's device already paid). The
//! exporter's free does not take the importer's bytes away: both processes map the same memory
//! file, and the kernel frees it when the exporter has freed it and every importer has closed it.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

use super::Import;
use super::handle::{Handle, Kind, SIZE};
use crate::api::Fail;
use crate::context;
use crate::memory::{AllocKind, Allocation, Backing};
use crate::state::{SIM, State};

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the only defined open flag.
const LAZY_ENABLE_PEER_ACCESS: u32 = 1;

fn invalid(message: String) -> Fail {
    Fail::misuse(CUresult::CUDA_ERROR_INVALID_VALUE, message)
}

/// `cuIpcGetMemHandle`: the handle of the `cuMemAlloc`/`cuMemAllocPitch` allocation containing
/// `dptr` (an interior pointer names its allocation, as on the H100). Pool, VMM, managed, host
/// and imported memory are not legacy-IPC capable (`INVALID_VALUE`). Not gated by another
/// thread's implicit synchronisation, and it does not wait for the device's queued work: an
/// H100 returned it (2026-11-24) while another thread's `cuMemFree` waited for a stream held by
/// a blocked host function, and the first export of an allocation with a memset queued on a held
/// stream returned at once (same day, a single run). The first export moves the allocation's
/// bytes into a shareable file under the state lock ([`crate::memory::Backing::share`]); queued
/// work cannot start without that lock, so the export waits only while an engine batch already
/// taken (which runs without the lock) reads or writes the allocation: a moment, never the
/// stream's backlog.
pub(crate) fn get_handle(dptr: u64) -> Result<[u8; SIZE], Fail> {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let Some(a) = st.find_alloc(dptr).cloned() else {
        return Err(invalid(format!("{dptr:#x} is not inside a live device allocation")));
    };
    if !matches!(a.kind, AllocKind::Device | AllocKind::Pitched) {
        return Err(invalid(format!(
            "{dptr:#x} is {} memory, which is not legacy-IPC capable (only cuMemAlloc memory is)",
            a.kind.report_name()
        )));
    }
    if a.backing.shared_file().is_none() {
        while touched_in_flight(&st, &a) {
            SIM.changed.wait(&mut st);
        }
        match st.allocs.get(&a.base) {
            Some(now) if Arc::ptr_eq(now, &a) => {}
            _ => return Err(invalid(format!("{dptr:#x} was freed while its export waited"))),
        }
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let file = a.backing.share().ok_or_else(oom)?;
    let handle = Handle::of_file(Kind::Memory, file, a.bytes, a.buffer_id).ok_or_else(oom)?;
    Ok(handle.encode())
}

/// Whether an operation of the engine's batch in flight (taken from its queue, running without
/// the state lock) reads or writes allocation `a`.
fn touched_in_flight(st: &State, a: &Allocation) -> bool {
    let (lo, hi) = (a.base, a.base.saturating_add(a.bytes));
    st.in_flight.iter().any(|f| f.spans.iter().any(|&(p, n)| p < hi && lo < p.saturating_add(n)))
}

/// `cuIpcOpenMemHandle_v2`: maps another process's exported allocation into the current
/// context and returns its address here. Opening the same handle again in the same context
/// counts one more open and returns the same address; opening it in a second context of the same
/// device while the first holds it gives `ALREADY_MAPPED` [I]. No current context, or the exporting
/// process itself, gives `INVALID_CONTEXT`; bytes no simulator exported, memory already gone or
/// undefined flags give `INVALID_VALUE`.
pub(crate) fn open(bytes: &[u8; SIZE], flags: u32) -> Result<u64, Fail> {
    let mut st = SIM.st.lock();
    let (ctx, d) = context::current_ctx(&st)?;
    let handle = Handle::decode(bytes, Kind::Memory)?;
    if flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(invalid(format!(
            "cuIpcOpenMemHandle flags {flags:#x}: only LAZY_ENABLE_PEER_ACCESS (1)"
        )));
    }
    let file = handle.open()?;
    let key = (handle.pid, handle.ino);
    let again = st
        .ipc
        .by_base
        .iter()
        .find(|(base, i)| i.key == key && i.ctx == ctx && st.allocs.contains_key(base))
        .map(|(&base, _)| base);
    if let Some(base) = again {
        st.ipc.by_base.get_mut(&base).expect("just found").refs += 1;
        return Ok(base);
    }
    // A handle may be opened by one context per device per process (§12). The code for a second
    // context is not on record: ALREADY_MAPPED [I], the code UCX handles for a handle already
    // opened in the process (ucx#3192, "Element already exists").
    let elsewhere = st.ipc.by_base.iter().any(|(base, i)| {
        i.key == key && i.ctx != ctx && st.ctx_device(i.ctx) == Some(d) && st.allocs.contains_key(base)
    });
    if elsewhere {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_ALREADY_MAPPED,
            format!(
                "this handle is already open in another context of device {d}: a process may open it in one context per device"
            ),
        ));
    }
    let oom = || Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    let len = usize::try_from(handle.size).map_err(|_| oom())?;
    let backing = Backing::from_file(&file, len).ok_or_else(oom)?;
    let base = st.devices[d].va.allocate(handle.size.max(1), 512).ok_or_else(oom)?;
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let alloc = Allocation {
        kind: AllocKind::IpcImport,
        base,
        bytes: handle.size,
        charged: 0,
        device: d as i32,
        ctx,
        buffer_id,
        host_flags: 0,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(base, Arc::new(alloc));
    st.ipc.by_base.insert(base, Import { key, ctx, refs: 1 });
    Ok(base)
}

/// `cuIpcCloseMemHandle`: closes one open of the import at `dptr`; the last close waits for the
/// device's queued work (which may still use the memory) and unmaps it. No current context gives
/// `INVALID_CONTEXT`; anything but an open import (closing twice, say) gives `INVALID_VALUE`.
pub(crate) fn close(dptr: u64) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    context::require(&st)?;
    let live = st.allocs.get(&dptr).filter(|a| a.kind == AllocKind::IpcImport).cloned();
    let (Some(a), Some(import)) = (live, st.ipc.by_base.get_mut(&dptr)) else {
        st.ipc.by_base.remove(&dptr);
        return Err(invalid(format!("{dptr:#x} is not an open IPC import (closed twice, or never opened)")));
    };
    import.refs -= 1;
    if import.refs > 0 {
        return Ok(());
    }
    st.ipc.by_base.remove(&dptr);
    crate::hold::drain_devices(&mut st, &[a.device as usize]);
    if st.allocs.get(&dptr).is_some_and(|now| Arc::ptr_eq(now, &a)) {
        st.allocs.remove(&dptr);
        st.forget(&a, None);
    }
    Ok(())
}
