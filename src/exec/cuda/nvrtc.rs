//! Compiling kernels/copy.cu with NVRTC for a device architecture, cached per process.

use super::libs::{self, guard};
use crate::error::{Error, Result};
use cudarc::nvrtc::{result, sys};
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source, embedded so users need no file and no CUDA toolkit headers.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/copy.cu");
/// The kernel's entry point.
pub const KERNEL_NAME: &str = "ncclReshardCopyKernel";

/// Compiled code for one architecture and what NVRTC said while compiling it.
#[derive(Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Compiles the copy kernel for `sm_{major}{minor}` (a cubin, no PTX JIT at load time).
pub fn compile(major: u32, minor: u32) -> Result<Compiled> {
    libs::nvrtc()?;
    let arch = format!("--gpu-architecture=sm_{major}{minor}");
    let source =
        CString::new(KERNEL_SOURCE).map_err(|_| Error::internal("kernel source has a NUL"))?;
    guard("NVRTC", || -> Result<Compiled> {
        let prog = result::create_program(&source, Some(c"copy.cu"))
            .map_err(|e| Error::system(format!("nvrtcCreateProgram: {e}")))?;
        // SAFETY: `prog` was just created and is destroyed below, exactly once.
        let outcome = unsafe {
            let compiled = result::compile_program(prog, &[arch.as_str(), "-std=c++17"]);
            let log = result::get_program_log(prog)
                .map(|l| text(&l))
                .unwrap_or_default();
            match compiled {
                Err(e) => Err(Error::system(format!(
                    "NVRTC failed to compile the copy kernel for sm_{major}{minor} ({e}):\n{log}"
                ))),
                Ok(()) => {
                    let mut size = 0usize;
                    let mut status = sys::nvrtcGetCUBINSize(prog, &mut size);
                    let mut cubin = vec![0u8; size];
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        status = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                    }
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(Compiled { cubin, log })
                    } else {
                        Err(Error::system(format!(
                            "nvrtcGetCUBIN for sm_{major}{minor}: {status:?}"
                        )))
                    }
                }
            }
        };
        // SAFETY: see above.
        let _ = unsafe { result::destroy_program(prog) };
        outcome
    })?
}

/// The cubin for an architecture, compiled once per process.
pub fn cubin(major: u32, minor: u32) -> Result<Arc<Vec<u8>>> {
    type Cache = Mutex<HashMap<(u32, u32), Arc<Vec<u8>>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(hit) = cache
        .lock()
        .map_err(|_| Error::internal("kernel cache poisoned"))?
        .get(&(major, minor))
    {
        return Ok(hit.clone());
    }
    let compiled = Arc::new(compile(major, minor)?.cubin);
    cache
        .lock()
        .map_err(|_| Error::internal("kernel cache poisoned"))?
        .insert((major, minor), compiled.clone());
    Ok(compiled)
}
