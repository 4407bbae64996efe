//! The C boundary's rules in one place: result codes, the thread-local last-error text, the
//! panic boundary every export goes through, and NULL-checked pointer access.

use super::types::ncclResult_t;
use crate::error::{panic_message, Error, ErrorKind, Result};
use std::cell::RefCell;
use std::ffi::CString;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

// NCCL's result codes (nccl.h); part of NCCL's ABI.
pub(crate) const NCCL_SUCCESS: ncclResult_t = 0;
pub(crate) const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub(crate) const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub(crate) const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub(crate) const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub(crate) const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub(crate) const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub(crate) const NCCL_IN_PROGRESS: ncclResult_t = 7;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (`ncclReshardGetLastError`).
pub(crate) fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// Pointer to this thread's last error text; valid until the next failing call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

pub(crate) fn code(kind: ErrorKind) -> ncclResult_t {
    match kind {
        ErrorKind::InvalidArgument => NCCL_INVALID_ARGUMENT,
        ErrorKind::InvalidUsage => NCCL_INVALID_USAGE,
        ErrorKind::Internal => NCCL_INTERNAL_ERROR,
        ErrorKind::System => NCCL_SYSTEM_ERROR,
        ErrorKind::Cuda => NCCL_UNHANDLED_CUDA_ERROR,
        ErrorKind::Nccl(code) => code,
    }
}

/// Runs an export's body: `Ok` → `ncclSuccess`; an error → its code, with the message (prefixed
/// by the function name) as the thread's last error; a panic → `ncclInternalError`, never
/// unwinding into C.
pub(crate) fn boundary(function: &str, body: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(error)) => {
            set_last_error(&format!("{function}: {}", error.message));
            code(error.kind)
        }
        Err(panic) => {
            let what = panic_message(&*panic).unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!(
                "{function}: internal error (please report): {what}"
            ));
            NCCL_INTERNAL_ERROR
        }
    }
}

/// The boundary of the exports that return text instead of a result code: a panic inside
/// (there should be none) yields a static message instead of unwinding into C.
pub(crate) fn text_boundary(body: impl FnOnce() -> *const c_char) -> *const c_char {
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|_| c"internal error in libncclreshard (please report)".as_ptr())
}

/// A shared reference from a C pointer, or an error naming the argument when it is NULL.
///
/// # Safety
/// `ptr`, when not NULL, must point to a valid `T` for the duration of the borrow.
pub(crate) unsafe fn arg<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: non-NULL pointers are valid per the caller's contract (the C API's documentation).
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::invalid_argument(format!("{name} is NULL")))
}

/// A C array as a slice; NULL is allowed only for an empty array.
///
/// # Safety
/// `ptr`, when not NULL, must point to `len` valid, initialised `T`s.
pub(crate) unsafe fn array<'a, T>(
    ptr: *const T,
    len: usize,
    name: impl std::fmt::Display,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::invalid_argument(format!(
            "{name} is NULL but {len} entries are expected"
        )));
    }
    // SAFETY: per the caller's contract `ptr` points to `len` initialised elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Reads a versioned struct (one starting with a `usize` size field) written by a caller that
/// may have been compiled against an older header: `min_size` bytes or more are required, at
/// most `size_of::<T>()` are read, missing fields keep `defaults`' values.
///
/// # Safety
/// `ptr`, when not NULL, must point to at least the number of bytes its `size` field states.
pub(crate) unsafe fn read_versioned<T: Copy>(
    ptr: *const T,
    min_size: usize,
    defaults: T,
    name: impl std::fmt::Display,
) -> Result<T> {
    if ptr.is_null() {
        return Err(Error::invalid_argument(format!("{name} is NULL")));
    }
    // SAFETY: every versioned struct begins with its size; the caller guarantees that much.
    let size = unsafe { std::ptr::read_unaligned(ptr.cast::<usize>()) };
    if size < min_size {
        return Err(Error::invalid_argument(format!(
            "{name}.size is {size} but at least {min_size} is required; initialise the struct with its NCCL_RESHARD_*_INITIALIZER"
        )));
    }
    if size > (1 << 20) {
        return Err(Error::invalid_argument(format!(
            "{name}.size is {size}, which is not a struct size; initialise the struct with its NCCL_RESHARD_*_INITIALIZER"
        )));
    }
    let mut value = defaults;
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: the caller's struct has `size` ≥ n readable bytes; `value` has size_of::<T>() ≥ n.
    unsafe {
        std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), (&mut value as *mut T).cast::<u8>(), n)
    };
    Ok(value)
}

/// Writes `value` into a caller's versioned output struct, at most its declared `size` bytes
/// (an older caller gets the fields it knows), keeping the caller's `size`.
///
/// # Safety
/// `ptr` must be valid for writes of the number of bytes its `size` field states.
pub(crate) unsafe fn write_versioned<T: Copy>(ptr: *mut T, value: &T, size: usize) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `ptr` is writable for `size` ≥ n bytes and `value` is n readable bytes; the first
    // field (size) is written back with the caller's own value so it never changes.
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), ptr.cast::<u8>(), n);
        std::ptr::write_unaligned(ptr.cast::<usize>(), size);
    }
}

/// NCCL's text for a result code (`ncclReshardGetErrorString`).
pub(crate) fn error_string(result: ncclResult_t) -> &'static std::ffi::CStr {
    match result {
        NCCL_SUCCESS => c"no error",
        NCCL_UNHANDLED_CUDA_ERROR => {
            c"unhandled cuda error (ncclReshardGetLastError() has details)"
        }
        NCCL_SYSTEM_ERROR => c"unhandled system error (ncclReshardGetLastError() has details)",
        NCCL_INTERNAL_ERROR => {
            c"internal error - please report this issue to the libncclreshard developers"
        }
        NCCL_INVALID_ARGUMENT => c"invalid argument (ncclReshardGetLastError() has details)",
        NCCL_INVALID_USAGE => c"invalid usage (ncclReshardGetLastError() has details)",
        NCCL_REMOTE_ERROR => c"remote process exited or there was a network error",
        NCCL_IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}
