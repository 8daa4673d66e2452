//! Legacy IPC: device memory and events shared with another process running the simulator.
//!
//! No broker: a handle names the exporting process and a memory file it holds open
//! (`/proc/<pid>/fd/<n>` plus the file's inode, so a reused descriptor number is not mistaken for
//! the exported file). The importer opens that path and maps the file, so both processes read and
//! write the same bytes. Device allocations are plain anonymous memory until their first export
//! ([`crate::memory::Backing::share`]); events created with `CU_EVENT_INTERPROCESS` keep their
//! recordings' completion in a one-page memory file from the start (see [`event`]). Opening
//! needs the same user (or the permission to read the exporter's `/proc/<pid>/fd`), as `ptrace`
//! rules on Linux decide.

pub(crate) mod event;
pub(crate) mod handle;
pub(crate) mod memory;

use std::collections::BTreeMap;

/// One imported allocation of this process.
pub(crate) struct Import {
    /// The exported file: (exporter pid, inode).
    pub(crate) key: (u32, u64),
    /// The context it was opened in.
    pub(crate) ctx: u64,
    /// Opens not yet closed.
    pub(crate) refs: u32,
}

/// The process's imported allocations, by their address here.
pub(crate) struct Imports {
    pub(crate) by_base: BTreeMap<u64, Import>,
}
