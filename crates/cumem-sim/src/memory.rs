//! Allocations and the host memory behind them.
//!
//! Device memory is backed by a separate anonymous mapping (never at the device address itself);
//! pinned host memory is a real host mapping whose address doubles as its device address (UVA).
//! A pool allocation is a *view* of its pool chunk's mapping (one mapping per reserved chunk), so
//! two allocations that reuse the same address share the same bytes, as on a GPU.
//! Each allocation is shared through an `Arc`, so an operation still queued on a stream keeps its
//! backing (for a view: the whole chunk mapping) alive even if the program frees the allocation
//! early; the allocation records when its free took effect, so the engine can report such an
//! operation as a use after free.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device may only read the registered memory.
pub(crate) const REGISTER_READ_ONLY: u32 = 0x8;

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
    /// `cuMemMap`: one mapping of physical memory (`cuMemCreate`) into a reservation.
    Vmm,
    /// `cuIpcOpenMemHandle`: another process's device allocation, mapped here.
    IpcImport,
    /// `cuMemPoolImportPointer`: a block of another process's exportable pool, mapped here.
    PoolImport,
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
            AllocKind::Vmm => "vmm_mapping",
            AllocKind::IpcImport => "ipc_import",
            AllocKind::PoolImport => "pool_import",
        }
    }

    /// Device-only memory (no host mapping): `cuMemAlloc`, `cuMemAllocPitch`, pool blocks, VMM
    /// mappings.
    pub(crate) fn device_only(self) -> bool {
        matches!(
            self,
            AllocKind::Device
                | AllocKind::Pitched
                | AllocKind::Pool
                | AllocKind::Vmm
                | AllocKind::IpcImport
                | AllocKind::PoolImport
        )
    }

    /// Page-locked host memory (pinned allocations and registrations).
    pub(crate) fn pinned(self) -> bool {
        matches!(self, AllocKind::PinnedHost | AllocKind::Registered)
    }
}

/// An anonymous read-write mapping that backs an allocation, or a view of part of one.
pub(crate) struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    /// `false` for the program's own memory (registrations) and for views: never unmapped here.
    owned: bool,
    /// For a view (a pool allocation inside its chunk): the mapping it lies in, kept alive by it.
    parent: Option<Arc<Backing>>,
    /// The memory file behind the mapping once it is shared with other processes
    /// ([`Backing::share`]); open for as long as the mapping lives, so that another process can
    /// open it through `/proc/<pid>/fd/<n>`.
    file: OnceLock<OwnedFd>,
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backing")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("owned", &self.owned)
            .field("view", &self.parent.is_some())
            .finish()
    }
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
        Some(Self {
            ptr: NonNull::new(p.cast::<u8>())?,
            len: map_len,
            owned: true,
            parent: None,
            file: OnceLock::new(),
        })
    }

    /// Two mappings of the same `len` bytes (one page for `len == 0`), each unmapped when dropped:
    /// managed memory, which the host reaches through one and the engine through the other, so
    /// that the host's can be protected while the device uses the memory. `None` when the kernel
    /// refuses.
    pub(crate) fn shared_pair(len: usize) -> Option<(Self, Self)> {
        let map_len = len.max(1);
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"cumem-sim-managed".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        let map = || {
            // SAFETY: a shared mapping of the memory file with a NULL hint cannot alias existing
            // memory; the result is checked for MAP_FAILED before use.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_NORESERVE,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            NonNull::new(p.cast::<u8>()).map(|ptr| Self {
                ptr,
                len: map_len,
                owned: true,
                parent: None,
                file: OnceLock::new(),
            })
        };
        // SAFETY: `fd` is the memory file created above.
        let sized = unsafe { libc::ftruncate(fd, map_len as libc::off_t) } == 0;
        let pair = if sized { map().zip(map()) } else { None };
        // SAFETY: `fd` is ours; the mappings keep the memory alive without it.
        unsafe { libc::close(fd) };
        pair
    }

    /// `len` bytes of inaccessible (`PROT_NONE`) address space, unmapped when dropped: the host
    /// view of a VMM reservation, into which physical memory is mapped piece by piece so that
    /// adjacent mappings are adjacent bytes. `None` when the kernel refuses.
    pub(crate) fn reserved(len: usize) -> Option<Self> {
        let map_len = len.max(1);
        // SAFETY: an anonymous PROT_NONE mapping with a NULL hint touches no existing memory; the
        // result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(Self {
            ptr: NonNull::new(p.cast::<u8>())?,
            len: map_len,
            owned: true,
            parent: None,
            file: OnceLock::new(),
        })
    }

    /// Stands for `len` bytes of the program's memory at `ptr` (a host registration); dropping it
    /// does not unmap anything. `None` for a NULL `ptr`.
    pub(crate) fn borrowed(ptr: *mut u8, len: usize) -> Option<Self> {
        Some(Self { ptr: NonNull::new(ptr)?, len, owned: false, parent: None, file: OnceLock::new() })
    }

    /// The `len` bytes at `offset` of `parent` (a pool chunk's mapping), sharing its memory: every
    /// view of the same range reads and writes the same bytes. The view keeps `parent` mapped.
    /// `None` if the range does not lie inside `parent`.
    pub(crate) fn view(parent: &Arc<Backing>, offset: usize, len: usize) -> Option<Self> {
        if offset.checked_add(len)? > parent.len {
            return None;
        }
        let ptr = NonNull::new(parent.as_ptr().wrapping_add(offset))?;
        Some(Self { ptr, len, owned: false, parent: Some(Arc::clone(parent)), file: OnceLock::new() })
    }

    /// Maps all of the memory file `file` (`len` bytes) shared: an allocation another process
    /// exported, or an IPC event's page. `None` when the kernel refuses.
    pub(crate) fn from_file(file: &OwnedFd, len: usize) -> Option<Self> {
        Self::from_file_at(file, 0, len)
    }

    /// Maps `len` bytes of the memory file `file` from `offset` (a multiple of the page size)
    /// shared: a chunk of an exportable pool, or an imported block of one. `None` when the kernel
    /// refuses.
    pub(crate) fn from_file_at(file: &OwnedFd, offset: u64, len: usize) -> Option<Self> {
        let map_len = len.max(1);
        let offset = libc::off_t::try_from(offset).ok()?;
        // SAFETY: a shared mapping of an open file with a NULL hint cannot alias existing memory;
        // the result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let ptr = NonNull::new(p.cast::<u8>())?;
        Some(Self { ptr, len: map_len, owned: true, parent: None, file: OnceLock::new() })
    }

    /// The memory file behind this (owned, anonymous) mapping, created on first use: its bytes
    /// are copied into a new memory file that is then mapped over the same addresses, so every
    /// pointer into the mapping stays valid and now reaches memory another process can map too.
    /// Allocation stays one anonymous `mmap` and only exported memory pays for a file. The caller
    /// must make sure nothing writes the memory meanwhile: it holds the state lock, without which
    /// no queued operation starts, and waits until no engine batch in flight touches the memory
    /// (`crate::ipc::memory::get_handle`). `None` for a view or borrowed memory, or when the kernel refuses.
    pub(crate) fn share(&self) -> Option<&OwnedFd> {
        if let Some(file) = self.file.get() {
            return Some(file);
        }
        if !self.owned {
            return None;
        }
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let fd = unsafe { libc::memfd_create(c"cumem-sim-ipc".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = libc::off_t::try_from(self.len).ok()?;
        // SAFETY: `fd` is the memory file created above.
        if unsafe { libc::ftruncate(fd, len) } != 0 {
            return None;
        }
        let mut off = 0usize;
        while off < self.len {
            // SAFETY: `self.ptr..+len` is this value's readable mapping; `fd` is a file of `len`
            // bytes, so the write stays inside it.
            let n = unsafe {
                libc::pwrite(fd, self.ptr.as_ptr().add(off).cast(), self.len - off, off as libc::off_t)
            };
            if n <= 0 {
                return None;
            }
            off += n as usize;
        }
        // SAFETY: MAP_FIXED over exactly the range this value owns replaces its pages with the
        // file's (which now hold the same bytes); no other mapping is touched.
        let p = unsafe {
            libc::mmap(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(self.file.get_or_init(|| file))
    }

    /// The memory file behind the mapping, if it was shared already.
    pub(crate) fn shared_file(&self) -> Option<&OwnedFd> {
        self.file.get()
    }

    /// Length of the mapping in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
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
    /// Set when the free took effect (`cuMemFree*` / context reset at the call; `cuMemFreeAsync`
    /// when the engine reaches the free in stream order): how it was freed. Queued work that
    /// completes after this is set used the memory after its free.
    pub(crate) freed: OnceLock<Freed>,
}

/// How and where an allocation's free took effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Freed {
    /// `cuMemFreeAsync`, executed in the order of this stream (internal stream id).
    StreamOrdered { stream: u64 },
    /// Freed at the call of this API (`cuMemFree_v2`, `cuMemFreeHost`, a context reset…).
    AtCall { api: &'static str },
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

    /// Records that the free took effect (the first record wins).
    pub(crate) fn mark_freed(&self, how: Freed) {
        let _ = self.freed.set(how);
    }

    /// Host pointer to the byte at `offset` of the backing.
    pub(crate) fn host_ptr(&self, offset: usize) -> *mut u8 {
        self.backing.as_ptr().wrapping_add(offset)
    }
}
