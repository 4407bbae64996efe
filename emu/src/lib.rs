//! A strict CPU emulation of the CUDA driver API, a subset of the CUDA runtime and NCCL, built as
//! one shared library (`libncclreshard_emu.so`) that shims named `libcuda.so.1`,
//! `libcudart.so.12` and `libnccl.so.2` point at (`scripts/build-emulator.sh`). It is a test
//! double for libncclreshard (docs/design.md §7.6): the unchanged library runs on emulated devices, ranks
//! as threads, and every misuse the emulator can see (out-of-bounds or dangling device pointers,
//! unordered stream work, illegal calls during graph capture, unmatched NCCL messages, deadlocks)
//! aborts the process with a report instead of silently passing.
//!
//! What it models and what it does not is in emu/README.md. Layout: the emulated machine
//! (`device`, `memory`, `context`, `stream`, `transfer`, `event`, `capture`, `graph`, `pool`,
//! `module`, `kernel`, `memop`, `nccl`, `watchdog`), injected faults for tests (`faults`), its plumbing (`config`, `diag` for reports and the
//! panic boundary, `errors`, `handles`, `completion`), and the C entry points over it
//! (`api::driver`, `api::cudart`, `nccl::api`), which only convert arguments and results.
//!
//! Every export is `unsafe extern "C"` with the C signature of the function it emulates; its
//! safety contract is the one CUDA's and NCCL's documentation states for that function.
#![allow(clippy::missing_safety_doc)]

pub mod api;
pub mod capture;
pub mod completion;
pub mod config;
pub mod context;
pub mod device;
pub mod diag;
pub mod errors;
pub mod event;
pub mod faults;
pub mod graph;
pub mod handles;
pub mod kernel;
pub mod memop;
pub mod memory;
pub mod module;
pub mod nccl;
pub mod pool;
pub mod stream;
pub mod transfer;
pub mod watchdog;

pub use api::cudart::*;
pub use api::driver::*;
pub use nccl::api::*;
