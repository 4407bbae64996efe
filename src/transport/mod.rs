//! Transports: what runs a plan's programs (docs/design.md §4). One folder (or file) per
//! transport, each running `RankProgram`s through the one walk of `exec::schedule`:
//!
//! - [`host`]: every rank as a thread over host memory, the executable specification of the
//!   others (same walk, same messages; where NCCL would hang it reports the ranks);
//! - [`nccl`]: one rank on the caller's CUDA stream and NCCL communicator, rounds as NCCL
//!   groups, local steps from the GPU runtime (`crate::gpu`).
//!
//! A new transport goes into a folder of its own here (see docs/architecture.md, "Where new
//! things go").

pub mod host;
pub mod nccl;
