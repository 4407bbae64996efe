//! The GPU runtime any device transport uses (docs/design.md §4): the CUDA driver loaded at run
//! time (`driver.rs`), each device's primary context with its copy kernel, staging pool and
//! side streams (`device.rs`), staging given back after each call (`release.rs`), the kernel compiled by NVRTC from `kernels/copy.cu`
//! (`nvrtc.rs`), the kernel's descriptor tables (`descriptors.rs`), a program's tables on a
//! device (`tables.rs`) and one call's local steps on a stream (`call.rs`). Nothing here knows
//! NCCL: a transport adds its exchange (`call::Exchange`).

mod call;
#[doc(hidden)]
pub mod descriptors;
mod device;
pub(crate) mod driver;
#[doc(hidden)]
pub mod nvrtc;
mod release;
mod tables;

pub(crate) use call::{CallMemory, DeviceCall, Exchange};
pub(crate) use device::Device;
pub(crate) use driver::{DeviceBuffer, Event};
pub use tables::DeviceLimits;
pub(crate) use tables::{DeviceProgram, PlanDevice, Tables};
