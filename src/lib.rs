//! libncclreshard: the Reshard collective for NCCL.
//!
//! A tensor sharded over source ranks in one DTensor layout arrives on destination ranks in
//! another, moving only overlapping regions peer to peer. This crate is the library and only
//! the library: layouts, the planner and its `RankProgram` IR, the executors (host and CUDA)
//! and the C ABI; the CLI's tools (models, simulator, checker, case files) are the
//! `ncclreshard-tools` crate. See docs/architecture.md and DESIGN §4.

pub mod debug;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod gpu;
pub mod layout;
pub mod plan;
pub mod quant;
pub mod transport;

pub use error::{Error, ErrorKind, Result};

/// The library version (from Cargo.toml, its only home).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub use layout::{DType, IndexRuns, Layout, Mesh, Placement, TensorSpec};
pub use plan::{Config, Mode, Planner, RankProgram, Topology};
