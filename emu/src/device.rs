//! The emulated devices: count, architecture, memory size and the attributes the driver
//! reports.

use crate::config::config;
use crate::errors::{err, not_supported, CuResult};
use cudarc::driver::sys::{CUdevice_attribute as A, CUresult};

/// Checks a device ordinal.
pub fn check(device: i32) -> CuResult<i32> {
    if (0..config().devices).contains(&device) {
        Ok(device)
    } else {
        err(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }
}

/// The device's name, as cuDeviceGetName reports it.
pub fn name(device: i32) -> String {
    let (major, minor) = config().compute_capability;
    format!("NCCL_RESHARD emulated GPU {device} (sm_{major}{minor})")
}

/// Streaming multiprocessors, as the generation's flagship has them.
fn multiprocessors() -> i32 {
    match config().compute_capability.0 {
        8 => 108,
        9 => 132,
        10 => 148,
        _ => 80,
    }
}

/// `cuDeviceGetAttribute`. Attributes the emulator does not model return
/// CUDA_ERROR_NOT_SUPPORTED (with a note) rather than a made-up value.
pub fn attribute(attr: u32, device: i32) -> CuResult<i32> {
    check(device)?;
    let (major, minor) = config().compute_capability;
    let is = |a: A| attr == a as u32;
    let value = if is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) {
        major
    } else if is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) {
        minor
    } else if is(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) {
        multiprocessors()
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        || is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)
        || is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)
    {
        1024
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z) {
        64
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X) {
        i32::MAX
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y) || is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)
    {
        65535
    } else if is(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE) {
        32
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR) {
        2048
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK) {
        48 << 10
    } else if is(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)
        || is(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS)
    {
        1
    } else if is(A::CU_DEVICE_ATTRIBUTE_INTEGRATED)
        // Stream memory operations: the v2 32-bit calls only (not the v1 API, 64-bit words or
        // flushes of remote writes).
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1)
        || is(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
        || is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)
        || is(A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED)
        || is(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)
        || is(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)
    {
        0
    } else if is(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID) {
        device + 1
    } else if is(A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT) {
        2
    } else {
        return Err(not_supported(format_args!(
            "cuDeviceGetAttribute(attribute {attr})"
        )));
    };
    Ok(value)
}
