//! Mappings: `cuMemMap` and `cuMemUnmap`.
//!
//! Mapping puts the physical allocation's memory file into its device's host view at the
//! mapping's place and registers an allocation of kind `Vmm` for it (with no access until
//! `cuMemSetAccess`). Unmapping puts `PROT_NONE` back at once, as a GPU's unmap returns at once
//! (observed on an H100, 2026-11-24: it waits for no stream): queued work over the mapping is
//! reported as a violation, and when it runs it moves no bytes and is reported as a use after free.
//! The unmap waits only for the engine's batch in progress over the bytes (see `pending`).

use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUresult;

use super::{GRANULARITY, Mapping, invalid, physical, require_vmm};
use crate::api::Fail;
use crate::memory::{AllocKind, Allocation, Backing, Freed};
use crate::state::SIM;

/// `cuMemMap`: binds the whole of `handle` (`offset` 0, `size` its size: anything else is
/// `NOT_SUPPORTED`, as observed, before the address is looked at) to `[ptr, ptr + size)`.
pub(crate) fn map(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    let (size, offset) = (size as u64, offset as u64);
    // A handle value that was never one crashed the H100's driver (SIGSEGV, 2026-11-23, second
    // run); INVALID_VALUE for it is the simulator's own answer. A released one is §17's.
    let Some(p) = st.vmm.physical.get(&handle) else {
        return Err(invalid(format!("{handle:#x} is not a live allocation handle")));
    };
    if p.refs == 0 {
        return Err(invalid(format!("handle {handle:#x} was already released")));
    }
    let (device, phys_size, fd) = (p.device, p.size, p.file.as_raw_fd());
    require_vmm(&st, device)?;
    if flags != 0 {
        return Err(invalid(format!("cuMemMap flags {flags:#x} must be 0")));
    }
    if size == 0 {
        return Err(invalid("cuMemMap of 0 bytes"));
    }
    // Observed on an H100, 2026-11-23: anything but exactly the whole allocation at offset 0 (a
    // prefix, a non-zero offset, more than it holds), created or imported alike, is
    // NOT_SUPPORTED (the documentation only says the offset "currently must be zero"). The
    // second run that day placed the rule: after the handle, flags and zero-size checks (each
    // INVALID_VALUE also for a partial map), before everything about the address: a partial map
    // that is misaligned (address, size or offset, at 4096), outside any reservation, past a
    // reservation's end or over a mapping is NOT_SUPPORTED too. (A vmm-less device was not
    // measured: its NOT_SUPPORTED is the documentation's, §9, and it comes first either way.)
    if (offset, size) != (0, phys_size) {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            format!(
                "[{offset}, +{size}) is not the whole {phys_size}-byte allocation {handle:#x}: \
                 cuMemMap maps a whole allocation at offset 0"
            ),
        ));
    }
    // The whole allocation's size and offset 0 are granularity multiples: only the address is
    // left to check (a whole allocation at a misaligned address: INVALID_VALUE, as observed).
    if !ptr.is_multiple_of(GRANULARITY) {
        return Err(invalid(format!("address {ptr:#x} is not a multiple of the granularity {GRANULARITY}")));
    }
    let Some((rbase, r)) = st.vmm.reservation_of(ptr) else {
        return Err(invalid(format!("{ptr:#x} is not inside a reservation")));
    };
    // Not the H100's answer (docs/vmm.md, "Observed on a GPU"; 2026-11-23, second run): it
    // accepted a whole allocation that starts inside a reservation and runs past its end (onto
    // reserved but unmapped space of a neighbouring reservation; 4 granules at the last granule
    // too), and refused it (INVALID_VALUE) only where the overhang was mapped: its rule looks
    // like "starts inside a reservation, overlaps no mapping". Accepting it here would put
    // memory at addresses another reservation holds, aliasing space its owner takes for its own
    // and unmapped (what freeing that neighbour does then was not measured), so the simulator
    // refuses it.
    if size > r.size - (ptr - rbase) {
        return Err(invalid(format!(
            "[{ptr:#x}, +{size}) runs past the end of the reservation [{rbase:#x}, +{}) (the H100 \
             maps it into the neighbouring addresses; the simulator refuses)",
            r.size
        )));
    }
    let overlap = st
        .vmm
        .mapping_of(ptr)
        .map(|(b, _)| b)
        .or_else(|| st.vmm.mappings.range(ptr..ptr + size).next().map(|(b, _)| *b));
    if let Some(m) = overlap {
        return Err(invalid(format!("[{ptr:#x}, +{size}) overlaps the mapping at {m:#x}")));
    }
    let space = &st.vmm.spaces[&r.device];
    let (view, at) = (Arc::clone(&space.host), (ptr - space.base) as usize);
    // SAFETY: `[at, at + size)` is the reservation's part of its device's view (checked above)
    // and currently PROT_NONE (no mapping overlaps it); MAP_FIXED replaces exactly that range
    // with the memory file's pages, which nothing else references.
    let p = unsafe {
        libc::mmap(
            view.as_ptr().add(at).cast(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    }
    let backing = Backing::view(&view, at, size as usize).expect("inside the device's view");
    let buffer_id = st.next_buffer_id;
    st.next_buffer_id += 1;
    let alloc = Allocation {
        kind: AllocKind::Vmm,
        base: ptr,
        bytes: size,
        charged: 0,
        device: device as i32,
        // Owned by no context: destroying one leaves mappings alone.
        ctx: 0,
        buffer_id,
        host_flags: 0,
        pool: 0,
        backing,
        freed: OnceLock::new(),
    };
    st.allocs.insert(ptr, Arc::new(alloc));
    st.vmm.physical.get_mut(&handle).expect("found above").mappings += 1;
    st.vmm
        .mappings
        .insert(ptr, Mapping { size, handle, offset, reservation: rbase, access: Default::default() });
    Ok(())
}

/// The bases of the whole mappings that exactly tile `[ptr, ptr + size)`, or why not.
pub(crate) fn tiling(vmm: &super::Vmm, ptr: u64, size: u64, what: &str) -> Result<Vec<u64>, Fail> {
    let end = ptr.checked_add(size).ok_or_else(|| invalid(format!("range {ptr:#x} + {size} overflows")))?;
    let mut bases = Vec::new();
    let mut at = ptr;
    while at < end {
        match vmm.mappings.get(&at) {
            Some(m) if at + m.size <= end => {
                bases.push(at);
                at += m.size;
            }
            Some(m) => {
                return Err(invalid(format!(
                    "{what}: [{ptr:#x}, +{size}) covers only part of the mapping [{at:#x}, +{})",
                    m.size
                )));
            }
            None => {
                return Err(match vmm.mapping_of(at) {
                    Some((b, m)) => invalid(format!(
                        "{what}: [{ptr:#x}, +{size}) covers only part of the mapping [{b:#x}, +{})",
                        m.size
                    )),
                    None => invalid(format!("{what}: {at:#x} in [{ptr:#x}, +{size}) is not mapped")),
                });
            }
        }
    }
    if bases.is_empty() {
        return Err(invalid(format!("{what}: empty range at {ptr:#x}")));
    }
    Ok(bases)
}

/// `cuMemUnmap`: unmaps the whole mappings that make up `[ptr, ptr + size)`.
pub(crate) fn unmap(ptr: u64, size: usize) -> Result<(), Fail> {
    let mut st = SIM.st.lock();
    tiling(&st.vmm, ptr, size as u64, "cuMemUnmap")?;
    let end = ptr + size as u64;
    super::pending::report_queued_work(&st, None, ptr, end, "cuMemUnmap");
    // Only the engine's current batch moving bytes here is waited for (its bytes move with the lock
    // released); queued work is not, and no device is held: see `pending`. Marked as unmapping
    // meanwhile, the range gets no bytes moved by the batches taken after this one, so the wait
    // ends with it.
    let range = (ptr, size as u64);
    st.vmm.unmapping.push(range);
    while super::pending::executing_over(&st, ptr, end) {
        SIM.changed.wait(&mut st);
    }
    let mine = st.vmm.unmapping.iter().position(|&r| r == range).expect("pushed above");
    st.vmm.unmapping.swap_remove(mine);
    // Another thread may have unmapped some of it while we waited.
    let bases = tiling(&st.vmm, ptr, size as u64, "cuMemUnmap")?;
    for base in bases {
        let m = st.vmm.mappings.remove(&base).expect("tiled");
        let space = &st.vmm.spaces[&st.vmm.reservations[&m.reservation].device];
        let at = (base - space.base) as usize;
        // SAFETY: `[at, at + m.size)` is this mapping's part of its device's view; no operation
        // of the engine's batch moves bytes in it (waited for above, with no release of the lock
        // since: a batch taken while the range was marked as unmapping moves none there), and the
        // engine moves no bytes of work that reaches it once its allocation is marked freed below
        // (`pending::reaches_unmapped`). MAP_FIXED replaces it with inaccessible anonymous
        // space, dropping the memory file's pages from the view.
        let p = unsafe {
            libc::mmap(
                space.host.as_ptr().add(at).cast(),
                m.size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        // Should the kernel refuse, the view keeps the pages until the reservation is freed:
        // harmless, since no allocation names them any more.
        let _ = p;
        if let Some(a) = st.allocs.remove(&base) {
            a.mark_freed(Freed::AtCall { api: crate::api::caller().0 });
            crate::sync_memops::forget(a.buffer_id);
        }
        if let Some(p) = st.vmm.physical.get_mut(&m.handle) {
            p.mappings -= 1;
        }
        physical::collect(&mut st, m.handle);
    }
    Ok(())
}
