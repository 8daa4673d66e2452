//! `cumem-sim`: a CPU-backed implementation of the CUDA driver API for testing without a GPU.
//!
//! Built as a cdylib with the soname `libcuda.so`, it exports the driver's C entry points (exact
//! symbol names, `_v2` suffixes included). Loading it by path before cudarc's first call makes
//! cudarc's `dlopen("libcuda.so")` resolve to it. It models devices, primary contexts, device and
//! pinned memory (device pointers live in a reserved address range and are never host addresses),
//! asynchronous streams with latency, events, and the driver's documented error codes for misuse;
//! misuse is also recorded in a violation log. See the crate README for the configuration keys
//! and what is and is not modelled.
//!
//! As an rlib, this crate gives programs and tests [`library_path`] (where the `.so` is) and
//! [`control`] (a client for the loaded simulator's control interface).

pub mod abi;
mod address_space;
mod alloc;
mod api;
mod attributes;
mod calls;
mod config;
mod context;
pub mod control;
mod copy;
mod engine;
mod errors;
mod event;
pub mod exports;
mod fault;
mod hints;
mod hold;
mod ipc;
mod leak;
mod lifecycle;
mod locate;
mod managed;
mod memory;
mod order;
mod peer;
mod pointer;
mod pool;
mod report;
mod state;
mod stream;
mod sync_memops;
mod violation;
mod vmm;

pub use control::{Control, ControlError, FaultId, FaultRule, LiveReport, Violation};
pub use locate::{LIBRARY_FILE_NAME, library_path};
