//! The CUDA + NCCL executor (DESIGN §4): runs a rank's `RankProgram` on the caller's stream and
//! communicator, with kernels compiled by NVRTC at first use and NCCL taken from the process.

pub mod descriptors;
mod device;
pub(crate) mod driver;
mod executor;
pub(crate) mod libs;
pub(crate) mod nccl;
pub mod nvrtc;

pub use executor::CudaExecutor;
