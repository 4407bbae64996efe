//! Executors: what runs a rank's `RankProgram`. [`buffers`] is the contract about a call's
//! buffers every executor (and any other transport) follows; [`host`] runs all ranks' programs
//! over host memory, [`cuda`] one rank's on a CUDA stream and NCCL communicator.

pub mod buffers;
pub mod cuda;
pub mod host;
