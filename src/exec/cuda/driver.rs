//! The few CUDA driver calls the executor makes, through cudarc's `sys` layer (never its safe
//! wrappers: the caller owns the streams, and nothing of theirs may be destroyed by a drop).
//! Every call goes through [`call`], which turns a missing symbol into an error and a failing
//! `CUresult` into an error carrying the driver's own text.

use super::libs::guard;
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use std::ffi::{c_void, CStr};

/// An error for a failing driver call, with the driver's name and text for the code.
pub(crate) fn check(status: CUresult, what: &str) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it NULL.
    let _ = guard("cuGetErrorString", || unsafe {
        sys::cuGetErrorString(status, &mut text)
    });
    let detail = if text.is_null() {
        format!("{status:?}")
    } else {
        // SAFETY: non-NULL pointers from cuGetErrorString are static C strings.
        format!(
            "{status:?}: {}",
            unsafe { CStr::from_ptr(text) }.to_string_lossy()
        )
    };
    Err(Error {
        kind: crate::error::ErrorKind::Cuda,
        message: format!("{what} failed ({detail})"),
    })
}

/// Runs one driver call (`f` returns its `CUresult`).
pub(crate) fn call(what: &str, f: impl FnOnce() -> CUresult) -> Result<()> {
    check(guard(what, f)?, what)
}

/// The device ordinal a device pointer belongs to, or an error when it is not device memory.
pub(crate) fn pointer_device(ptr: usize, name: &str) -> Result<i32> {
    let mut ordinal: i32 = -1;
    // SAFETY: cuPointerGetAttribute writes one int for DEVICE_ORDINAL.
    call("cuPointerGetAttribute", || unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as sys::CUdeviceptr,
        )
    })
    .map_err(|e| {
        Error::invalid_argument(format!(
            "{name} ({ptr:#x}) is not CUDA device memory: {}",
            e.message
        ))
    })?;
    Ok(ordinal)
}

/// True while `stream` is being captured into a CUDA graph.
pub(crate) fn is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one capture status for a stream the caller owns.
    call("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// A device's primary context, retained for the life of this value.
pub(crate) struct PrimaryContext {
    pub device: sys::CUdevice,
    pub ordinal: i32,
    pub context: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe); the
// value only retains and releases it.
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(ordinal: i32) -> Result<PrimaryContext> {
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes one device handle.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in Drop.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, device)
        })?;
        Ok(PrimaryContext {
            device,
            ordinal,
            context,
        })
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        let attr = |a: sys::CUdevice_attribute, what: &str| -> Result<u32> {
            let mut value = 0i32;
            // SAFETY: writes one int.
            call(what, || unsafe {
                sys::cuDeviceGetAttribute(&mut value, a, self.device)
            })?;
            Ok(value as u32)
        };
        Ok((
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "compute capability",
            )?,
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "compute capability",
            )?,
        ))
    }

    /// Makes the context current on this thread until the guard drops (restoring the caller's).
    pub fn push(&self) -> Result<CurrentContext> {
        // SAFETY: pushes a retained context; popped by the guard.
        call("cuCtxPushCurrent", || unsafe {
            sys::cuCtxPushCurrent_v2(self.context)
        })?;
        Ok(CurrentContext)
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device)
        });
    }
}

/// Pops the context pushed by [`PrimaryContext::push`].
pub(crate) struct CurrentContext;

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed.
        let _ = call("cuCtxPopCurrent", || unsafe {
            sys::cuCtxPopCurrent_v2(&mut previous)
        });
    }
}

/// Device memory owned by the plan (descriptor tables, staging), freed on drop. Must be
/// dropped with its context alive (the owner keeps the PrimaryContext longer).
pub(crate) struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
}

impl DeviceBuffer {
    pub fn alloc(bytes: usize, what: &str) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Ok(DeviceBuffer { ptr: 0 });
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed in Drop.
        call(
            &format!("cuMemAlloc ({bytes} bytes of {what})"),
            || unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) },
        )?;
        Ok(DeviceBuffer { ptr })
    }

    /// Allocates and fills from host memory (synchronous; warm-up only).
    pub fn upload<T: Copy>(data: &[T], what: &str) -> Result<DeviceBuffer> {
        let bytes = std::mem::size_of_val(data);
        let buffer = DeviceBuffer::alloc(bytes, what)?;
        if bytes > 0 {
            // SAFETY: `data` is `bytes` readable bytes; the buffer was just allocated that large.
            call("cuMemcpyHtoD", || unsafe {
                sys::cuMemcpyHtoD_v2(buffer.ptr, data.as_ptr().cast::<c_void>(), bytes)
            })?;
        }
        Ok(buffer)
    }

    /// Copies the first `out.len()` elements back to the host, after `stream` has finished.
    pub fn download<T: Copy>(&self, out: &mut [T], stream: sys::CUstream) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        // SAFETY: waits for work the caller enqueued on its own stream.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream)
        })?;
        if bytes > 0 {
            // SAFETY: the buffer holds at least `bytes` bytes (the caller allocated it so);
            // `out` is `bytes` writable bytes.
            call("cuMemcpyDtoH", || unsafe {
                sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast::<c_void>(), self.ptr, bytes)
            })?;
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: frees memory this value allocated, once.
            let _ = call("cuMemFree", || unsafe { sys::cuMemFree_v2(self.ptr) });
        }
    }
}

/// A loaded module and the copy kernel in it.
pub(crate) struct Kernel {
    module: sys::CUmodule,
    pub function: sys::CUfunction,
}

// SAFETY: module and function handles are usable from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    pub fn load(cubin: &[u8], name: &str) -> Result<Kernel> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `cubin` is a complete image produced by NVRTC.
        call("cuModuleLoadData", || unsafe {
            sys::cuModuleLoadData(&mut module, cubin.as_ptr().cast())
        })?;
        let name =
            std::ffi::CString::new(name).map_err(|_| Error::internal("kernel name has a NUL"))?;
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: looks up a function in the module just loaded.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
        })?;
        Ok(Kernel { module, function })
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: unloads the module this value loaded, once.
        let _ = call("cuModuleUnload", || unsafe {
            sys::cuModuleUnload(self.module)
        });
    }
}
