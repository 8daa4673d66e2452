//! Shareable handles: `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` with
//! POSIX file descriptors.
//!
//! Physical memory already lives in a memory file, so the exported descriptor is a duplicate of
//! that file: another process that receives it (over a Unix socket, `SCM_RIGHTS`) maps the same
//! bytes. The importer needs the creation properties too, which a bare descriptor does not carry,
//! so every memory file holds them in a trailer page after the memory (never mapped). An import
//! is new physical memory of the importer (its own handle, one reference, charged to nothing);
//! the kernel frees the bytes when every process has released its handle and unmapped them.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::CUresult;

use super::{Physical, invalid};
use crate::abi::{AllocationProp, LOC_DEVICE};
use crate::api::Fail;
use crate::state::SIM;

/// Bytes after the memory that hold the properties.
pub(super) const TRAILER: u64 = 4096;
const MAGIC: &[u8; 8] = b"cumemvmm";
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: u32 = 0x1;
/// `CU_MEM_HANDLE_TYPE_WIN32`.
const WIN32: u32 = 0x2;
/// `CU_MEM_HANDLE_TYPE_WIN32_KMT`.
const WIN32_KMT: u32 = 0x4;
/// `CU_MEM_HANDLE_TYPE_FABRIC`.
const FABRIC: u32 = 0x8;

/// Writes `prop` into the trailer of `file`, whose memory is `size` bytes.
pub(super) fn write_trailer(file: &OwnedFd, size: u64, prop: &AllocationProp) -> Option<()> {
    let mut page = [0u8; 8 + size_of::<AllocationProp>()];
    page[..8].copy_from_slice(MAGIC);
    // SAFETY: `AllocationProp` is plain `repr(C)` data; its bytes are copied into a buffer of
    // exactly its size (padding bytes, if any, are copied as they are and never interpreted).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (prop as *const AllocationProp).cast::<u8>(),
            page[8..].as_mut_ptr(),
            size_of::<AllocationProp>(),
        );
    }
    let off = libc::off_t::try_from(size).ok()?;
    // SAFETY: `page` is readable for its length; `file` is open.
    let n = unsafe { libc::pwrite(file.as_raw_fd(), page.as_ptr().cast(), page.len(), off) };
    (n == page.len() as isize).then_some(())
}

/// The memory size and properties a simulator memory file carries, or `None` for any other file.
/// `file` is this simulator's own duplicate, so the file checked is the file kept: a descriptor
/// number the caller closes (and the process reuses) meanwhile changes nothing here.
fn read_trailer(file: &OwnedFd) -> Option<(u64, AllocationProp)> {
    // SAFETY: `stat` is plain data, fully written by a successful fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer; `file` is open.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    let size = u64::try_from(st.st_size).ok()?.checked_sub(TRAILER)?;
    let mut page = [0u8; 8 + size_of::<AllocationProp>()];
    // SAFETY: `page` is writable for its length; `file` is open and owned here, so no other
    // thread can close it under the call.
    let n =
        unsafe { libc::pread(file.as_raw_fd(), page.as_mut_ptr().cast(), page.len(), size as libc::off_t) };
    if n != page.len() as isize || &page[..8] != MAGIC {
        return None;
    }
    // SAFETY: the bytes after the magic were written from an `AllocationProp` by `write_trailer`
    // (every bit pattern of its integer fields is valid; the pointer is never dereferenced).
    let prop = unsafe { page[8..].as_ptr().cast::<AllocationProp>().read_unaligned() };
    Some((size, prop))
}

/// `cuMemExportToShareableHandle` for POSIX descriptors: a new close-on-exec descriptor of the
/// memory of `handle`, which must have been created with POSIX_FD among its handle types
/// (`INVALID_VALUE` otherwise, as observed; an import has none, observed on an H100,
/// 2026-11-23); other handle types and non-zero flags give `INVALID_VALUE`.
pub(crate) fn export_fd(handle: u64, handle_type: u32, flags: u64) -> Result<i32, Fail> {
    let st = SIM.st.lock();
    let Some(p) = st.vmm.physical.get(&handle).filter(|p| p.refs > 0) else {
        return Err(invalid(format!("{handle:#x} is not a live allocation handle")));
    };
    if flags != 0 {
        return Err(invalid(format!("cuMemExportToShareableHandle flags {flags:#x} must be 0")));
    }
    if handle_type != POSIX_FD {
        return Err(invalid(format!("handle type {handle_type:#x}: only POSIX_FD (1) is exported")));
    }
    if p.prop.handle_types & POSIX_FD == 0 {
        let why = if p.charged {
            "was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
        } else {
            "is an import (an imported handle has no handle types and is not exported again)"
        };
        return Err(invalid(format!("{handle:#x} {why}")));
    }
    // SAFETY: `p.file` is open; F_DUPFD_CLOEXEC returns a new descriptor or -1.
    let fd = unsafe { libc::fcntl(p.file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    }
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` for POSIX descriptors: new physical memory (a new handle,
/// even in the exporting process) over the memory file `fd` names; the caller keeps `fd`. The
/// import's properties are the creation's with requestedHandleTypes 0: observed on an H100,
/// 2026-11-23, `cuMemGetAllocationPropertiesFromHandle` answers 0 for an imported handle, and
/// exporting it again is `INVALID_VALUE`.
/// Observed on an H100 (2026-11-23, second run): WIN32 (2), WIN32_KMT (4) and FABRIC without
/// fabric → `NOT_SUPPORTED` (WIN32 and WIN32_KMT measured with descriptor −1 only); 0 or a
/// multi-bit type → `INVALID_VALUE` (with −1, and with 0, which is `INVALID_VALUE` either way);
/// descriptor 0 → `INVALID_VALUE` whatever it is, exported memory too (the driver reads it as a
/// NULL `osHandle`); a descriptor that is not exported memory → `UNKNOWN` (a regular file,
/// `/dev/null`, a pipe, a socket, a closed descriptor number and −1 alike). The simulator checks
/// the type first, so WIN32 with descriptor 0 → `NOT_SUPPORTED`: its choice, unmeasured. A
/// device the importer does not have gives `INVALID_DEVICE`.
pub(crate) fn import_fd(fd: i32, handle_type: u32) -> Result<u64, Fail> {
    if matches!(handle_type, WIN32 | WIN32_KMT | FABRIC) {
        return Err(Fail::quiet(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }
    if handle_type != POSIX_FD {
        return Err(invalid(format!("handle type {handle_type:#x}: only POSIX_FD (1) is imported")));
    }
    if fd == 0 {
        return Err(invalid(
            "descriptor 0: osHandle is NULL (the driver refuses descriptor 0 whatever it names)",
        ));
    }
    let not_exported = |why: &str| {
        Fail::misuse(
            CUresult::CUDA_ERROR_UNKNOWN,
            format!("file descriptor {fd} {why}: not memory exported by cuMemExportToShareableHandle"),
        )
    };
    if fd < 0 {
        return Err(not_exported("is negative"));
    }
    // Duplicated first, so that the file whose trailer is read is the file kept, whatever the
    // caller does with the number meanwhile.
    // SAFETY: F_DUPFD_CLOEXEC on any number returns a new descriptor or -1; it touches no memory.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(match std::io::Error::last_os_error().raw_os_error() {
            // A closed number: the H100 answered UNKNOWN, as for any descriptor that is not
            // exported memory.
            Some(libc::EBADF) => not_exported("is closed"),
            // Out of descriptors.
            _ => Fail::quiet(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        });
    }
    // SAFETY: `dup` was just created and is owned by nothing else.
    let file = unsafe { OwnedFd::from_raw_fd(dup) };
    let Some((size, prop)) = read_trailer(&file) else {
        return Err(not_exported("names another file"));
    };
    let mut st = SIM.st.lock();
    let device = usize::try_from(prop.location.id)
        .ok()
        .filter(|&d| prop.location.kind == LOC_DEVICE && d < st.devices.len());
    let Some(device) = device else {
        return Err(Fail::misuse(
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            format!("the exported memory is on device {}", prop.location.id),
        ));
    };
    let handle = st.vmm.new_handle();
    let prop = AllocationProp { handle_types: 0, ..prop };
    st.vmm
        .physical
        .insert(handle, Physical { size, device, prop, refs: 1, mappings: 0, file, charged: false });
    Ok(handle)
}
