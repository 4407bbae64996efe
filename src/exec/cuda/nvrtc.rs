//! Compiling kernels/copy.cu with NVRTC for a device architecture, cached per process.
//!
//! NVRTC is opened directly (not through cudarc, whose lookup knows only the CUDA 12 names):
//! `NCCL_RESHARD_NVRTC_LIBRARY` when set, else libnvrtc.so.13, .so.12, .so.11.2, libnvrtc.so
//! from the loader's search path — whichever the machine has (a CUDA toolkit, PyTorch's
//! `nvidia-cuda-nvrtc` wheel). A missing NVRTC is an error saying how to provide one.

use super::libs::dlerror;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
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

type Program = *mut c_void;
type Status = c_int;

// Signatures from nvrtc.h (stable since CUDA 11.1).
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type FillFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;

/// The NVRTC functions used.
struct Nvrtc {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: FillFn,
    cubin_size: SizeFn,
    cubin: FillFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    origin: String,
}

fn open_nvrtc() -> Result<Nvrtc> {
    let candidates: Vec<String> = match std::env::var("NCCL_RESHARD_NVRTC_LIBRARY") {
        Ok(path) => vec![path],
        Err(_) => [
            "libnvrtc.so.13",
            "libnvrtc.so.12",
            "libnvrtc.so.11.2",
            "libnvrtc.so",
        ]
        .map(String::from)
        .to_vec(),
    };
    let mut tried = Vec::new();
    for name in &candidates {
        let c = CString::new(name.as_str())
            .map_err(|_| Error::invalid_argument("NVRTC path has a NUL byte"))?;
        // SAFETY: dlopen with a valid C string; the handle stays open for the process's life.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            tried.push(format!("{name} ({})", dlerror()));
            continue;
        }
        let sym = |symbol: &str| -> Result<*mut c_void> {
            let s = CString::new(symbol).expect("symbol names have no NUL");
            // SAFETY: dlsym on the handle just opened.
            let p = unsafe { libc::dlsym(handle, s.as_ptr()) };
            (!p.is_null())
                .then_some(p)
                .ok_or_else(|| Error::system(format!("{name} has no {symbol}")))
        };
        // SAFETY: each symbol is NVRTC's function of that name with the field's C signature.
        unsafe {
            use std::mem::transmute as t;
            return Ok(Nvrtc {
                create: t::<*mut c_void, CreateFn>(sym("nvrtcCreateProgram")?),
                compile: t::<*mut c_void, CompileFn>(sym("nvrtcCompileProgram")?),
                log_size: t::<*mut c_void, SizeFn>(sym("nvrtcGetProgramLogSize")?),
                log: t::<*mut c_void, FillFn>(sym("nvrtcGetProgramLog")?),
                cubin_size: t::<*mut c_void, SizeFn>(sym("nvrtcGetCUBINSize")?),
                cubin: t::<*mut c_void, FillFn>(sym("nvrtcGetCUBIN")?),
                destroy: t::<*mut c_void, DestroyFn>(sym("nvrtcDestroyProgram")?),
                error_string: t::<*mut c_void, ErrorStringFn>(sym("nvrtcGetErrorString")?),
                origin: name.clone(),
            });
        }
    }
    Err(Error::system(format!(
        "NVRTC was not found (tried {}); it compiles the copy kernels at first use. Install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`, and put its lib directory on LD_LIBRARY_PATH or set NCCL_RESHARD_NVRTC_LIBRARY to the file",
        tried.join(", ")
    )))
}

fn nvrtc() -> Result<&'static Nvrtc> {
    static NVRTC: OnceLock<Result<Nvrtc>> = OnceLock::new();
    NVRTC.get_or_init(open_nvrtc).as_ref().map_err(Clone::clone)
}

impl Nvrtc {
    fn check(&self, status: Status, what: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status.
        let text = unsafe { std::ffi::CStr::from_ptr((self.error_string)(status)) };
        Err(Error::system(format!(
            "{what} ({}): {}",
            self.origin,
            text.to_string_lossy()
        )))
    }
}

/// Compiles the copy kernel for `sm_{major}{minor}` (a cubin, no PTX JIT at load time).
pub fn compile(major: u32, minor: u32) -> Result<Compiled> {
    let n = nvrtc()?;
    let source =
        CString::new(KERNEL_SOURCE).map_err(|_| Error::internal("kernel source has a NUL"))?;
    let options: Vec<CString> = [
        format!("--gpu-architecture=sm_{major}{minor}"),
        "-std=c++17".into(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("options have no NUL"))
    .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: valid C strings; `prog` is destroyed below exactly once.
    n.check(
        unsafe {
            (n.create)(
                &mut prog,
                source.as_ptr(),
                c"copy.cu".as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: `prog` is a live program; buffers are sized from NVRTC's own size queries.
    let outcome = unsafe {
        let compiled = (n.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let mut size = 0usize;
        let mut log = String::new();
        if (n.log_size)(prog, &mut size) == 0 && size > 1 {
            let mut text = vec![0u8; size];
            if (n.log)(prog, text.as_mut_ptr().cast()) == 0 {
                log = String::from_utf8_lossy(&text[..size - 1])
                    .trim()
                    .to_string();
            }
        }
        if compiled != 0 {
            let failure = n.check(compiled, "nvrtcCompileProgram").unwrap_err();
            Err(Error::system(format!(
                "{} for sm_{major}{minor}:\n{log}",
                failure.message
            )))
        } else {
            let mut size = 0usize;
            n.check((n.cubin_size)(prog, &mut size), "nvrtcGetCUBINSize")
                .and_then(|()| {
                    let mut cubin = vec![0u8; size];
                    n.check((n.cubin)(prog, cubin.as_mut_ptr().cast()), "nvrtcGetCUBIN")
                        .map(|()| Compiled { cubin, log })
                })
        }
    };
    // SAFETY: destroys the program created above.
    unsafe { (n.destroy)(&mut prog) };
    outcome
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
