//! The exported C entry points, grouped by API area.
//!
//! Every function has the exact symbol name and C signature cudarc 0.19 (cuda-12080) loads. Enum
//! parameters are received as `u32` (the same ABI as the bindings' `#[repr(u32)]` enums) because a
//! C caller may pass any integer and an out-of-range enum value would be undefined behaviour in
//! Rust. Every body runs through the crate's call wrapper, which contains panics and applies the
//! global rules (cuInit first, fault injection, no calls from host functions).
//!
//! All `unsafe` functions here share one contract, the C API's: every pointer argument is NULL or
//! valid for the reads/writes the CUDA driver API documents for that function.

pub mod batch_copy;
pub mod context;
pub mod control;
pub mod copy;
pub mod device;
pub mod error;
pub mod event;
pub mod init;
pub mod ipc;
pub mod legacy_names;
pub mod managed;
pub mod memory;
pub mod pci;
pub mod peer;
pub mod per_thread;
pub mod pointer_attribute;
pub mod pool;
pub mod proc_address;
pub mod stream;
pub mod vmm;
