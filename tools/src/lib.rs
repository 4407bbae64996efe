//! The tools around libncclreshard, in a crate of their own so that the shipped library
//! (`libncclreshard.so`/`.a`) holds only the library: layouts, the planner, the executors and
//! the C ABI (docs/architecture.md).
//!
//! - [`models`]: model inventories and the parallel layouts of an RL weight refit.
//! - [`sim`]: the refit simulator (what a reshard would cost on a cluster we cannot run).
//! - [`check`]: byte-exact end-to-end checking of a plan on the host executor, and the view
//!   contents it fills and verifies (also used by the GPU tests).
//! - [`reference_quantizer`]: what a converted tensor must hold, from the published
//!   definitions (DeepSeek-V3's `weight_quant`, SGLang/DeepGEMM's E8M0 scales, the OCP FP8
//!   formats), independent of the library's arithmetic.
//! - [`case`]: case files, the JSON descriptions of reshards the CLI reads.
//! - [`harness`]: the fuzz targets' harnesses, shared by `fuzz/` and the library's
//!   `tests/fuzz_regressions.rs`.
//!
//! Used by the `ncclreshard` CLI, the fuzz targets and the library's tests (as a
//! dev-dependency); nothing here is part of the C ABI.

pub mod case;
pub mod check;
pub mod harness;
pub mod models;
pub mod reference_quantizer;
pub mod sim;
