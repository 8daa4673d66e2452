//! The 64 opaque bytes of a `CUipcMemHandle` / `CUipcEventHandle` and the file they name.
//!
//! Layout (little endian): `b"cumemsim"`, kind (1 memory, 2 event) at 8, exporter pid at 12,
//! descriptor number at 16, inode at 24, size at 32, exporter buffer id at 40; the rest zero.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::CUresult;

use crate::api::Fail;

/// Bytes in a handle (`CU_IPC_HANDLE_SIZE`).
pub(crate) const SIZE: usize = 64;
const MAGIC: &[u8; 8] = b"cumemsim";

/// What a handle names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A device allocation.
    Memory = 1,
    /// An interprocess event's page.
    Event = 2,
}

/// A decoded handle.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handle {
    pub(crate) kind: Kind,
    pub(crate) pid: u32,
    pub(crate) fd: i32,
    pub(crate) ino: u64,
    pub(crate) size: u64,
    pub(crate) buffer_id: u64,
}

/// The calling process's id.
pub(crate) fn own_pid() -> u32 {
    std::process::id()
}

/// The inode and size of an open file; `None` when `fstat` fails.
fn stat(file: &OwnedFd) -> Option<(u64, u64)> {
    // SAFETY: `stat` is plain data, fully written by a successful fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `file` is an open descriptor and `st` a valid out-pointer.
    (unsafe { libc::fstat(file.as_raw_fd(), &mut st) } == 0).then_some((st.st_ino, st.st_size as u64))
}

/// The inode of an open file; `None` when `fstat` fails.
pub(crate) fn inode(file: &OwnedFd) -> Option<u64> {
    stat(file).map(|(ino, _)| ino)
}

impl Handle {
    /// The handle of `file` (held open by this process) of `size` bytes.
    pub(crate) fn of_file(kind: Kind, file: &OwnedFd, size: u64, buffer_id: u64) -> Option<Self> {
        Some(Self { kind, pid: own_pid(), fd: file.as_raw_fd(), ino: inode(file)?, size, buffer_id })
    }

    /// The 64 bytes.
    pub(crate) fn encode(&self) -> [u8; SIZE] {
        let mut b = [0u8; SIZE];
        b[..8].copy_from_slice(MAGIC);
        b[8] = self.kind as u8;
        b[12..16].copy_from_slice(&self.pid.to_le_bytes());
        b[16..20].copy_from_slice(&self.fd.to_le_bytes());
        b[24..32].copy_from_slice(&self.ino.to_le_bytes());
        b[32..40].copy_from_slice(&self.size.to_le_bytes());
        b[40..48].copy_from_slice(&self.buffer_id.to_le_bytes());
        b
    }

    /// Decodes a handle of `kind`; `INVALID_VALUE` for bytes no simulator wrote.
    pub(crate) fn decode(b: &[u8; SIZE], kind: Kind) -> Result<Self, Fail> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if &b[..8] != MAGIC || b[8] != kind as u8 {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("not an IPC {kind:?} handle made by cuIpcGet*Handle"),
            ));
        }
        Ok(Self {
            kind,
            pid: u32_at(12),
            fd: u32_at(16) as i32,
            ino: u64_at(24),
            size: u64_at(32),
            buffer_id: u64_at(40),
        })
    }

    /// Opens the exporter's file, checking it is still the exported one and holds the handle's
    /// size. `INVALID_CONTEXT` in the exporting process itself (observed on the H100 for memory
    /// handles, §17; for event handles a simulator choice, the same answer); `INVALID_VALUE`
    /// once the exporter freed it, exited, or never existed, or for a size the file does not hold.
    pub(crate) fn open(&self) -> Result<OwnedFd, Fail> {
        if self.pid == own_pid() {
            return Err(Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_CONTEXT,
                "an IPC handle cannot be opened in the process that exported it",
            ));
        }
        let gone = |why: &str| {
            Fail::misuse(
                CUresult::CUDA_ERROR_INVALID_VALUE,
                format!("IPC handle of process {} (fd {}): {why}", self.pid, self.fd),
            )
        };
        let path = CString::new(format!("/proc/{}/fd/{}", self.pid, self.fd)).expect("no NUL");
        // SAFETY: a NUL-terminated path; the result is checked before use.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(gone("the exported memory is gone (freed, or the process exited)"));
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let Some((ino, len)) = stat(&file) else {
            return Err(gone("the exported memory is gone (fstat failed)"));
        };
        if ino != self.ino {
            return Err(gone("the exported memory is gone (its descriptor now names another file)"));
        }
        // The size is untrusted bytes and the caller maps that much of the file: a mapping past
        // the file's end would fault (SIGBUS) on first touch.
        if len < self.size {
            return Err(gone(&format!("the handle claims {} bytes; the exported file has {len}", self.size)));
        }
        Ok(file)
    }
}
