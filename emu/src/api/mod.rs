//! The C entry points: the CUDA driver API (`driver`) and the CUDA runtime subset (`cudart`).
//! NCCL's are in `nccl::api`.

pub mod cudart;
pub mod driver;
