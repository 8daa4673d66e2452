//! Allocations and the host memory behind them.
//!
//! Device memory is backed by a separate anonymous mapping (never at the device address itself);
//! pinned host memory is a real host mapping whose address doubles as its device address (UVA).
//! Each allocation is shared through an `Arc`, so an operation still queued on a stream keeps its
//! backing alive even if the program frees the allocation early.

use std::ptr::NonNull;

/// The kind of memory an allocation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AllocKind {
    /// `cuMemAlloc`.
    Device,
    /// `cuMemAllocPitch`.
    Pitched,
    /// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync`: a block of a pool chunk.
    Pool,
    /// `cuMemAllocManaged`: host memory whose device address equals its host address.
    Managed,
    /// `cuMemAllocHost` / `cuMemHostAlloc`.
    PinnedHost,
    /// `cuMemHostRegister`: the program's own memory, page-locked (never unmapped by us).
    Registered,
}

impl AllocKind {
    /// The name used in the live report.
    pub(crate) fn report_name(self) -> &'static str {
        match self {
            AllocKind::Device => "device",
            AllocKind::Pitched => "pitched",
            AllocKind::Pool => "pool",
            AllocKind::Managed => "managed",
            AllocKind::PinnedHost => "pinned_host",
            AllocKind::Registered => "registered",
        }
    }

    /// Device-only memory (no host mapping): `cuMemAlloc`, `cuMemAllocPitch`, pool blocks.
    pub(crate) fn device_only(self) -> bool {
        matches!(self, AllocKind::Device | AllocKind::Pitched | AllocKind::Pool)
    }

    /// Page-locked host memory (pinned allocations and registrations).
    pub(crate) fn pinned(self) -> bool {
        matches!(self, AllocKind::PinnedHost | AllocKind::Registered)
    }
}

/// An anonymous read-write mapping that backs an allocation.
pub(crate) struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    /// `false` for the program's own memory (registrations): never unmapped here.
    owned: bool,
}

// SAFETY: the mapping is plain memory owned by this value; every access goes through raw pointers
// whose ordering is established by stream order and the state lock, as for real device memory.
unsafe impl Send for Backing {}
// SAFETY: as above; `Backing` itself has no interior state besides the mapping.
unsafe impl Sync for Backing {}

impl Backing {
    /// Maps at least `len` bytes (one page for `len == 0`); `None` when the kernel refuses.
    pub(crate) fn new(len: usize) -> Option<Self> {
        let map_len = len.max(1);
        // SAFETY: an anonymous private mapping with a NULL hint cannot alias existing memory; the
        // result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(Self { ptr: NonNull::new(p.cast::<u8>())?, len: map_len, owned: true })
    }

    /// Stands for `len` bytes of the program's memory at `ptr` (a host registration); dropping it
    /// does not unmap anything. `None` for a NULL `ptr`.
    pub(crate) fn borrowed(ptr: *mut u8, len: usize) -> Option<Self> {
        Some(Self { ptr: NonNull::new(ptr)?, len, owned: false })
    }

    /// The first byte of the mapping.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: the mapping was created by `new` with this length and is owned by `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// One live (or, while queued work still holds it, just-freed) allocation.
pub(crate) struct Allocation {
    pub(crate) kind: AllocKind,
    /// Device (UVA) address of the first byte.
    pub(crate) base: u64,
    /// Requested size.
    pub(crate) bytes: u64,
    /// Bytes charged against the device's capacity.
    pub(crate) charged: u64,
    pub(crate) device: i32,
    pub(crate) ctx: u64,
    /// Process-unique, never reused (`CU_POINTER_ATTRIBUTE_BUFFER_ID`).
    pub(crate) buffer_id: u64,
    /// `cuMemHostGetFlags` answer for pinned memory; the registration flags of registered
    /// memory; the attach flags a managed allocation was created with.
    pub(crate) host_flags: u32,
    /// The pool of a pool allocation (0 otherwise).
    pub(crate) pool: u64,
    pub(crate) backing: Backing,
}

impl Allocation {
    /// Whether `addr` lies inside the allocation (a zero-byte allocation contains its base only).
    pub(crate) fn contains(&self, addr: u64) -> bool {
        addr >= self.base && (addr - self.base < self.bytes || (self.bytes == 0 && addr == self.base))
    }

    /// Whether `[addr, addr + len)` lies entirely inside the allocation.
    pub(crate) fn contains_range(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|end| end <= self.base + self.bytes)
    }

    /// Host pointer to the byte at `offset` of the backing.
    pub(crate) fn host_ptr(&self, offset: usize) -> *mut u8 {
        self.backing.as_ptr().wrapping_add(offset)
    }
}
