//! libncclreshard: the Reshard collective for NCCL.
//!
//! A tensor sharded over source ranks in one DTensor layout arrives on destination ranks in
//! another, moving only overlapping regions peer to peer. This crate is the pure core
//! (layouts, planner, the `RankProgram` IR, a host executor); see DESIGN §4.

pub mod check;
pub mod debug;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod layout;
pub mod models;
pub mod plan;
pub mod sim;

pub use error::{Error, ErrorKind, Result};

/// The library version (from Cargo.toml, its only home).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub use layout::{DType, IndexRuns, Layout, Mesh, Placement, TensorSpec};
pub use plan::{Config, Mode, Planner, RankProgram, Topology};
