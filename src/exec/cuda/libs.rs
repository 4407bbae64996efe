//! Finding the CUDA libraries at run time. Nothing CUDA is linked at build time: the driver
//! (libcuda.so.1) and NVRTC (libnvrtc.so.12) are opened by cudarc on first use, which panics
//! when a library is missing — so we check first and turn absence into an error, and every
//! cudarc call runs inside [`guard`].
//!
//! `NCCL_RESHARD_NVRTC_LIBRARY` may name a libnvrtc to use (e.g. the one from the
//! `nvidia-cuda-nvrtc-cu12` wheel or PyTorch's); it is opened with RTLD_GLOBAL first, so the
//! later lookup by SONAME finds it.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Opens `path` with RTLD_NOW | RTLD_GLOBAL, keeping it loaded for the life of the process.
pub(crate) fn preload(path: &str, what: &str) -> Result<()> {
    let c = CString::new(path)
        .map_err(|_| Error::invalid_argument(format!("{what} path contains a NUL byte")))?;
    // SAFETY: dlopen with a valid C string; the handle is intentionally never closed.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return Err(Error::system(format!(
            "cannot open {what} {path:?}: {}",
            dlerror()
        )));
    }
    Ok(())
}

/// The text of the last dlopen/dlsym failure.
pub(crate) fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (see above).
        unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Runs a cudarc call, turning its panics (a missing library or symbol) into errors.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let detail = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Error::system(format!("{what}: {detail}"))
    })
}

/// Makes sure NVRTC can be loaded (once per process).
pub(crate) fn nvrtc() -> Result<()> {
    static READY: OnceLock<Result<()>> = OnceLock::new();
    READY
        .get_or_init(|| {
            if let Ok(path) = std::env::var("NCCL_RESHARD_NVRTC_LIBRARY") {
                preload(&path, "NCCL_RESHARD_NVRTC_LIBRARY")?;
            }
            // SAFETY: only probes whether the library can be opened.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                Ok(())
            } else {
                Err(Error::system(
                    "NVRTC (libnvrtc.so.12) was not found; it compiles the copy kernels at first use. \
                     Install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`, and put its \
                     lib directory on LD_LIBRARY_PATH or set NCCL_RESHARD_NVRTC_LIBRARY to the file",
                ))
            }
        })
        .clone()
}

/// Makes sure the CUDA driver can be loaded and is initialised (once per process).
pub(crate) fn driver() -> Result<()> {
    static READY: OnceLock<Result<()>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only probes whether the library can be opened.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(Error::system(
                    "the CUDA driver (libcuda.so.1) was not found: ncclReshard needs an NVIDIA GPU and driver",
                ));
            }
            // SAFETY: cuInit has no preconditions.
            let status = guard("cuInit", || unsafe { cudarc::driver::sys::cuInit(0) })?;
            super::driver::check(status, "cuInit")
        })
        .clone()
}
