//! Error codes and their texts, as the real libraries report them: `CUresult` (driver),
//! `cudaError_t` (runtime) and the mapping between them.

use crate::diag;
use cudarc::driver::sys::CUresult;
use std::ffi::{c_char, CStr};

/// An API call's failure: the code it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuError(pub CUresult);

/// A driver-level result.
pub type CuResult<T> = Result<T, CuError>;

impl From<CUresult> for CuError {
    fn from(code: CUresult) -> Self {
        CuError(code)
    }
}

/// `CUDA_ERROR_NOT_SUPPORTED`, after saying why (an emulator limit, never a silent success).
pub fn not_supported(what: impl std::fmt::Display) -> CuError {
    diag::report(format_args!(
        "{what}: not supported by the emulator (see emu/README.md); returning CUDA_ERROR_NOT_SUPPORTED"
    ));
    CuError(CUresult::CUDA_ERROR_NOT_SUPPORTED)
}

/// Shorthand for the common codes.
pub fn err<T>(code: CUresult) -> CuResult<T> {
    Err(CuError(code))
}

/// One error: driver code and name, runtime code and name, text (shared by both libraries).
struct Entry {
    driver: Option<(u32, &'static CStr)>,
    runtime: Option<(u32, &'static CStr)>,
    text: &'static CStr,
}

macro_rules! entries {
    ($( $d:expr, $dn:literal, $r:expr, $rn:literal, $text:literal; )*) => {
        &[$(Entry {
            driver: if ($d as i64) < 0 { None } else { Some((($d as i64) as u32, $dn)) },
            runtime: if ($r as i64) < 0 { None } else { Some((($r as i64) as u32, $rn)) },
            text: $text,
        },)*]
    };
}

// Texts as the real cuGetErrorString / cudaGetErrorString return them.
static TABLE: &[Entry] = entries! {
    0, c"CUDA_SUCCESS", 0, c"cudaSuccess", c"no error";
    1, c"CUDA_ERROR_INVALID_VALUE", 1, c"cudaErrorInvalidValue", c"invalid argument";
    2, c"CUDA_ERROR_OUT_OF_MEMORY", 2, c"cudaErrorMemoryAllocation", c"out of memory";
    3, c"CUDA_ERROR_NOT_INITIALIZED", 3, c"cudaErrorInitializationError", c"initialization error";
    4, c"CUDA_ERROR_DEINITIALIZED", 4, c"cudaErrorCudartUnloading", c"driver shutting down";
    -1, c"", 9, c"cudaErrorInvalidConfiguration", c"invalid configuration argument";
    -1, c"", 17, c"cudaErrorInvalidDevicePointer", c"invalid device pointer";
    -1, c"", 21, c"cudaErrorInvalidMemcpyDirection", c"invalid copy direction for memcpy";
    100, c"CUDA_ERROR_NO_DEVICE", 100, c"cudaErrorNoDevice", c"no CUDA-capable device is detected";
    101, c"CUDA_ERROR_INVALID_DEVICE", 101, c"cudaErrorInvalidDevice", c"invalid device ordinal";
    200, c"CUDA_ERROR_INVALID_IMAGE", 200, c"cudaErrorInvalidKernelImage", c"device kernel image is invalid";
    201, c"CUDA_ERROR_INVALID_CONTEXT", 201, c"cudaErrorDeviceUninitialized", c"invalid device context";
    209, c"CUDA_ERROR_NO_BINARY_FOR_GPU", 209, c"cudaErrorNoKernelImageForDevice", c"no kernel image is available for execution on the device";
    218, c"CUDA_ERROR_INVALID_PTX", 218, c"cudaErrorInvalidPtx", c"a PTX JIT compilation failed";
    222, c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 222, c"cudaErrorUnsupportedPtxVersion", c"the provided PTX was compiled with an unsupported toolchain.";
    400, c"CUDA_ERROR_INVALID_HANDLE", 400, c"cudaErrorInvalidResourceHandle", c"invalid resource handle";
    401, c"CUDA_ERROR_ILLEGAL_STATE", 401, c"cudaErrorIllegalState", c"the operation cannot be performed in the present state";
    500, c"CUDA_ERROR_NOT_FOUND", 500, c"cudaErrorSymbolNotFound", c"named symbol not found";
    600, c"CUDA_ERROR_NOT_READY", 600, c"cudaErrorNotReady", c"device not ready";
    700, c"CUDA_ERROR_ILLEGAL_ADDRESS", 700, c"cudaErrorIllegalAddress", c"an illegal memory access was encountered";
    701, c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 701, c"cudaErrorLaunchOutOfResources", c"too many resources requested for launch";
    709, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", 709, c"cudaErrorContextIsDestroyed", c"context is destroyed";
    719, c"CUDA_ERROR_LAUNCH_FAILED", 719, c"cudaErrorLaunchFailure", c"unspecified launch failure";
    800, c"CUDA_ERROR_NOT_PERMITTED", 800, c"cudaErrorNotPermitted", c"operation not permitted";
    801, c"CUDA_ERROR_NOT_SUPPORTED", 801, c"cudaErrorNotSupported", c"operation not supported";
    900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", 900, c"cudaErrorStreamCaptureUnsupported", c"operation not permitted when stream is capturing";
    901, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", 901, c"cudaErrorStreamCaptureInvalidated", c"operation failed due to a previous error during capture";
    902, c"CUDA_ERROR_STREAM_CAPTURE_MERGE", 902, c"cudaErrorStreamCaptureMerge", c"operation would result in a merge of separate capture sequences";
    903, c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", 903, c"cudaErrorStreamCaptureUnmatched", c"capture was not initiated in this stream";
    904, c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED", 904, c"cudaErrorStreamCaptureUnjoined", c"capturing stream has unjoined work";
    905, c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION", 905, c"cudaErrorStreamCaptureIsolation", c"dependency created on uncaptured work in another stream";
    906, c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", 906, c"cudaErrorStreamCaptureImplicit", c"operation would make the legacy stream depend on a capturing blocking stream";
    907, c"CUDA_ERROR_CAPTURED_EVENT", 907, c"cudaErrorCapturedEvent", c"operation not permitted on an event last recorded in a capturing stream";
    908, c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", 908, c"cudaErrorStreamCaptureWrongThread", c"attempt to terminate a thread-local capture sequence from another thread";
    999, c"CUDA_ERROR_UNKNOWN", 999, c"cudaErrorUnknown", c"unknown error";
};

fn driver_entry(code: u32) -> Option<&'static Entry> {
    TABLE
        .iter()
        .find(|e| e.driver.is_some_and(|(c, _)| c == code))
}

fn runtime_entry(code: u32) -> Option<&'static Entry> {
    TABLE
        .iter()
        .find(|e| e.runtime.is_some_and(|(c, _)| c == code))
}

/// `cuGetErrorName`: the static name of a driver code, or None for codes the emulator never
/// returns.
pub fn driver_name(code: u32) -> Option<*const c_char> {
    driver_entry(code).and_then(|e| e.driver.map(|(_, n)| n.as_ptr()))
}

/// `cuGetErrorString`: the static text of a driver code.
pub fn driver_text(code: u32) -> Option<*const c_char> {
    driver_entry(code)
        .filter(|e| e.driver.is_some())
        .map(|e| e.text.as_ptr())
}

/// `cudaGetErrorName`: like cudart, an unknown code gives "unrecognized error code".
pub fn runtime_name(code: u32) -> *const c_char {
    runtime_entry(code)
        .and_then(|e| e.runtime.map(|(_, n)| n.as_ptr()))
        .unwrap_or(c"unrecognized error code".as_ptr())
}

/// `cudaGetErrorString`.
pub fn runtime_text(code: u32) -> *const c_char {
    runtime_entry(code)
        .map(|e| e.text.as_ptr())
        .unwrap_or(c"unrecognized error code".as_ptr())
}

/// The runtime code cudart returns for a driver failure.
pub fn runtime_code(code: CUresult) -> u32 {
    driver_entry(code as u32)
        .and_then(|e| e.runtime.map(|(c, _)| c))
        .unwrap_or(999)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_and_runtime_codes_map_through_the_table() {
        assert_eq!(runtime_code(CUresult::CUDA_ERROR_INVALID_CONTEXT), 201);
        assert_eq!(runtime_code(CUresult::CUDA_ERROR_OUT_OF_MEMORY), 2);
        assert_eq!(
            runtime_code(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
            906
        );
        assert!(driver_name(123456).is_none());
        for e in TABLE {
            if let Some((code, name)) = e.driver {
                // Every driver name matches cudarc's variant name for the code.
                // SAFETY: CUresult is repr(u32) and every code in the table is a variant.
                let variant: CUresult = unsafe { std::mem::transmute(code) };
                assert_eq!(format!("{variant:?}"), name.to_str().unwrap());
            }
        }
    }
}
