//! NCCL, taken from the process: the symbols are looked up in what is already loaded first
//! (`dlsym(RTLD_DEFAULT, …)`: the libnccl the application or PyTorch links), then in
//! `dlopen("libnccl.so.2")`; `NCCL_RESHARD_NCCL_LIBRARY` names a file to use instead. Only
//! functions present in NCCL 2.18 are required, so any NCCL from 2.18 on works.

use super::libs::dlerror;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

pub(crate) type NcclResult = c_int;
pub(crate) type NcclComm = *mut c_void;
pub(crate) type CudaStream = *mut c_void;

/// `ncclUint8`: messages are byte counts.
pub(crate) const NCCL_UINT8: c_int = 1;
/// `ncclInvalidUsage`.
const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclInProgress`: a nonblocking communicator is still issuing the operation.
const NCCL_IN_PROGRESS: NcclResult = 7;

// C signatures from nccl.h.
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type CommIntFn = unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult;
type ErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(NcclComm) -> *const c_char;
type VersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type AsyncErrorFn = unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult;

/// The NCCL functions the executor calls.
pub(crate) struct Nccl {
    pub send: SendFn,
    pub recv: RecvFn,
    pub group_start: GroupFn,
    pub group_end: GroupFn,
    pub comm_count: CommIntFn,
    pub comm_cu_device: CommIntFn,
    pub comm_user_rank: CommIntFn,
    pub get_error_string: ErrorStringFn,
    pub get_last_error: LastErrorFn,
    pub get_version: VersionFn,
    pub comm_get_async_error: AsyncErrorFn,
    /// Where the symbols came from, for messages.
    pub origin: String,
}

/// Looks `name` up in `handle` (RTLD_DEFAULT when NULL).
fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: dlsym with a valid handle (or RTLD_DEFAULT) and C string.
    let ptr = unsafe {
        libc::dlsym(
            if handle.is_null() {
                libc::RTLD_DEFAULT
            } else {
                handle
            },
            c.as_ptr(),
        )
    };
    (!ptr.is_null()).then_some(ptr)
}

fn load_from(handle: *mut c_void, origin: String) -> Result<Nccl> {
    macro_rules! resolve {
        ($name:literal, $ty:ty) => {{
            let ptr = symbol(handle, $name).ok_or_else(|| {
                Error::system(format!(
                    "{origin} has no symbol {}; libncclreshard needs NCCL 2.18 or newer",
                    $name
                ))
            })?;
            // SAFETY: the symbol is NCCL's function of that name, whose C signature (nccl.h)
            // is the field's type.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(ptr) }
        }};
    }
    Ok(Nccl {
        send: resolve!("ncclSend", SendFn),
        recv: resolve!("ncclRecv", RecvFn),
        group_start: resolve!("ncclGroupStart", GroupFn),
        group_end: resolve!("ncclGroupEnd", GroupFn),
        comm_count: resolve!("ncclCommCount", CommIntFn),
        comm_cu_device: resolve!("ncclCommCuDevice", CommIntFn),
        comm_user_rank: resolve!("ncclCommUserRank", CommIntFn),
        get_error_string: resolve!("ncclGetErrorString", ErrorStringFn),
        get_last_error: resolve!("ncclGetLastError", LastErrorFn),
        get_version: resolve!("ncclGetVersion", VersionFn),
        comm_get_async_error: resolve!("ncclCommGetAsyncError", AsyncErrorFn),
        origin,
    })
}

fn open(path: &str) -> Result<*mut c_void> {
    let c = CString::new(path)
        .map_err(|_| Error::invalid_argument("NCCL library path has a NUL byte"))?;
    // SAFETY: dlopen with a valid C string; the handle stays open for the process's life.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        Err(Error::system(format!("cannot open {path}: {}", dlerror())))
    } else {
        Ok(handle)
    }
}

fn load() -> Result<Nccl> {
    if let Ok(path) = std::env::var("NCCL_RESHARD_NCCL_LIBRARY") {
        return load_from(open(&path)?, format!("NCCL_RESHARD_NCCL_LIBRARY={path}"));
    }
    if symbol(std::ptr::null_mut(), "ncclSend").is_some() {
        return load_from(std::ptr::null_mut(), "the process's NCCL".into());
    }
    let handle = open("libnccl.so.2").map_err(|e| {
        Error::system(format!(
            "NCCL is not loaded in this process and {}; link libnccl, or set NCCL_RESHARD_NCCL_LIBRARY",
            e.message
        ))
    })?;
    load_from(handle, "libnccl.so.2".into())
}

/// The process's NCCL, loaded once.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<Result<Nccl>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let loaded = load();
        match &loaded {
            Ok(n) => debug::log(Level::Info, || {
                format!("using NCCL {} from {}", n.version(), n.origin)
            }),
            Err(e) => debug::log(Level::Warn, || e.message.clone()),
        }
        loaded
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Nccl {
    /// An error for a failing NCCL call, with NCCL's own texts.
    pub fn check(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns static strings (or NULL) from these.
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let general = text(unsafe { (self.get_error_string)(result) });
        let last = text(unsafe { (self.get_last_error)(comm) });
        let kind = crate::error::ErrorKind::Nccl(result);
        Err(Error {
            kind,
            message: format!(
                "{what} returned {result} ({general}){}",
                if last.is_empty() {
                    String::new()
                } else {
                    format!(": {last}")
                }
            ),
        })
    }

    /// NCCL's version code (e.g. 22703).
    pub fn version(&self) -> i32 {
        let mut v = 0;
        // SAFETY: writes one int.
        unsafe { (self.get_version)(&mut v) };
        v
    }
}

impl Nccl {
    /// Checks the result of an operation that a nonblocking communicator may still be issuing
    /// (`ncclInProgress`): waits until NCCL has issued it, as NCCL requires before the next
    /// call on that communicator and before anything else is enqueued on its stream (the
    /// operation's kernel is not on the stream until then).
    pub fn check_issued(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result != NCCL_IN_PROGRESS {
            return self.check(result, what, comm);
        }
        loop {
            let mut state = NCCL_IN_PROGRESS;
            // SAFETY: writes one result for the caller's communicator.
            let queried = unsafe { (self.comm_get_async_error)(comm, &mut state) };
            self.check(queried, "ncclCommGetAsyncError", comm)?;
            if state != NCCL_IN_PROGRESS {
                return self.check(state, what, comm);
            }
            std::thread::yield_now();
        }
    }

    /// Checks the result of `ncclSend`/`ncclRecv` posted inside a group: a nonblocking
    /// communicator may answer `ncclInProgress` there, which the group's end settles.
    pub fn check_posted(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result == NCCL_IN_PROGRESS {
            return Ok(());
        }
        self.check(result, what, comm)
    }

    /// `Ok` when this thread has no NCCL group open; otherwise `why` as `ncclInvalidUsage`.
    ///
    /// NCCL has no query for an open group, but `ncclGroupEnd` with none open returns
    /// `ncclInvalidUsage` and changes nothing (NCCL logs "ncclGroupEnd: not in a group call."
    /// when `NCCL_DEBUG` is WARN or more). With a group open it closes one level (if that was
    /// the outermost, NCCL issues what the caller posted in the group so far); the level is
    /// reopened at once and the message says so.
    pub fn refuse_open_group(&self, why: impl FnOnce() -> String) -> Result<()> {
        // SAFETY: group calls have no preconditions; a closed level is reopened below.
        let ended = unsafe { (self.group_end)() };
        if ended == NCCL_INVALID_USAGE {
            return Ok(());
        }
        // SAFETY: reopens the level closed above.
        let reopened = unsafe { (self.group_start)() };
        let mut message = format!(
            "{} (libncclreshard found the group open by ending it, as NCCL has no query for it: the operations posted in the group before this call were issued; the group was reopened",
            why()
        );
        if ended != 0 && ended != NCCL_IN_PROGRESS {
            message.push_str(&format!("; ncclGroupEnd returned {ended}"));
        }
        if reopened != 0 {
            message.push_str(&format!("; reopening it returned {reopened}"));
        }
        message.push(')');
        Err(Error::invalid_usage(message))
    }
}
