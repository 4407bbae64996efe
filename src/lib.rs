//! libncclreshard: the Reshard collective for NCCL.
//!
//! A tensor sharded over source ranks in one DTensor layout arrives on destination ranks in
//! another, moving only overlapping regions peer to peer (docs/design.md). This crate is the
//! library and only the library; the CLI's tools (models, simulator, checker, case files) are
//! the `ncclreshard-tools` crate.
//!
//! What a Rust caller uses, from the top:
//!
//! - [`Plan`] (`exec`): one rank's plan, made from [`PlanTensor`]s and a [`Config`] exactly as
//!   `ncclReshardPlanCreate` makes it (same programs, same refusals, same messages);
//! - [`NcclTransport`] (`transport::nccl`) runs it on a CUDA stream and NCCL communicator;
//!   `transport::host` runs every rank's program over host memory (the specification);
//! - [`Layout`], [`Mesh`], [`Placement`], [`TensorSpec`] (`layout`): DTensor layouts and each
//!   rank's shard; `quant::Conversion`: what a tensor becomes on its way;
//! - [`Planner`] and [`RankProgram`] (`plan`): the planner behind every plan and its IR, for
//!   tools that plan every rank or run programs elsewhere;
//! - `ffi`: the C ABI itself (`include/ncclReshard.h` is generated from it).
//!
//! ```no_run
//! use ncclreshard::{Config, DType, Layout, Mesh, Placement, TensorSpec};
//! use ncclreshard::{NcclTransport, Plan, PlanTensor, StagingLimit};
//! use std::ffi::c_void;
//!
//! // TP2 by columns on ranks 0-1 → TP2 by rows on ranks 2-3; every rank plans the same.
//! fn refit(rank: u32, send: usize, recv: usize, comm: *mut c_void, stream: *mut c_void)
//!     -> ncclreshard::Result<()> {
//!     let mesh = |ranks: Vec<u32>| Mesh::new(vec![2], ranks);
//!     let spec = TensorSpec {
//!         shape: vec![4096, 4096],
//!         dtype: DType::Bfloat16,
//!         src: Layout::new(mesh(vec![0, 1])?, vec![Placement::Shard(1)]),
//!         dst: Layout::new(mesh(vec![2, 3])?, vec![Placement::Shard(0)]),
//!     };
//!     let tensors = vec![PlanTensor::new(spec)];
//!     let limit = StagingLimit::new(0); // NCCL_RESHARD_STAGING_BYTES, else 8 GiB
//!     let plan = Plan::new(tensors, rank, Config::default(), limit, NcclTransport::LIMITS)?;
//!     let nccl = NcclTransport::for_plan(&plan);
//!     // Every step: enqueue on the caller's stream and communicator.
//!     let buffers = plan.views().single(send, recv)?;
//!     nccl.execute(&buffers, comm, stream)
//! }
//! ```
//!
//! Layers, each using only those below it: `ffi` → `transport` → `gpu` → `exec` → `plan` →
//! `quant` → `layout` (docs/architecture.md).

#![warn(missing_docs)]

pub(crate) mod debug;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod gpu;
pub mod layout;
pub mod plan;
pub mod quant;
pub mod transport;

pub use error::{Error, ErrorKind, Result};
pub use exec::{Plan, PlanTensor, StagingLimit};
pub use layout::{DType, IndexRuns, Layout, Mesh, Placement, TensorSpec};
pub use plan::{Config, Mode, Planner, RankProgram, Topology};
pub use transport::nccl::NcclTransport;

/// The library version (from Cargo.toml, its only home).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
