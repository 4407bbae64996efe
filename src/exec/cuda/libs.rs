//! Finding the CUDA driver at run time. Nothing CUDA is linked at build time: the driver
//! (libcuda.so.1) is opened by cudarc on first use, which panics when it is missing — so we
//! check first and turn absence into an error, and every cudarc call runs inside [`guard`].

use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

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
