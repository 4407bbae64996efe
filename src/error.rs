//! The one error type of the library. Every fallible call returns it; the C boundary maps
//! [`ErrorKind`] onto `ncclResult_t` and the message onto `ncclReshardGetLastError()`.

use std::fmt;

/// What class of failure an [`Error`] is, mirroring the NCCL result codes callers see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A descriptor, argument or file is malformed (`ncclInvalidArgument`).
    InvalidArgument,
    /// The call is well-formed but not allowed in this state (`ncclInvalidUsage`).
    InvalidUsage,
    /// A broken invariant inside the library (`ncclInternalError`); always a bug.
    Internal,
    /// A system facility is missing or failed: a library that cannot be loaded, an executor
    /// this build or machine lacks (`ncclSystemError`).
    System,
    /// A CUDA driver call failed (`ncclUnhandledCudaError`).
    Cuda,
    /// An NCCL call failed with this `ncclResult_t`, passed through unchanged.
    Nccl(i32),
}

/// An error with a message that names the offending field and value, meant to be read by the
/// person who wrote the descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// The class of failure; the C boundary returns the `ncclResult_t` it maps to.
    pub kind: ErrorKind,
    /// What is wrong, naming the field and its value (`src: placements[1] = Shard(3) shards
    /// dim 3 but the tensor has 2 dims`). The C boundary prefixes the function's name and
    /// makes it the thread's last error.
    pub message: String,
}

/// The library's `Result`: the error is an [`Error`] unless a signature names another.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`ErrorKind::InvalidArgument`] error: a descriptor, argument or file the caller must
    /// fix. The message should name the field and its value.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::InvalidArgument,
            message: message.into(),
        }
    }

    /// An [`ErrorKind::InvalidUsage`] error: a well-formed request that the plan or the
    /// current state does not allow.
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::InvalidUsage,
            message: message.into(),
        }
    }

    /// An [`ErrorKind::System`] error: a library, executor or facility this build or machine
    /// lacks, or whose loading failed.
    pub fn system(message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::System,
            message: message.into(),
        }
    }

    /// An [`ErrorKind::Internal`] error: a broken invariant of the library, always a bug.
    pub fn internal(message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Internal,
            message: message.into(),
        }
    }

    /// Prefixes the message with where the error happened (`tensors[3].src: …`).
    pub fn context(mut self, prefix: impl fmt::Display) -> Self {
        self.message = format!("{prefix}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// What a caught panic says: its `String` or `&str` payload, if it has one.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
}

/// Checked arithmetic on sizes: every product or sum of user-given sizes goes through these so
/// that an absurd descriptor is an error, never a wrapped offset.
pub(crate) fn checked_mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b)
        .ok_or_else(|| Error::invalid_argument(format!("{what} overflows 64 bits ({a} * {b})")))
}

pub(crate) fn checked_add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b)
        .ok_or_else(|| Error::invalid_argument(format!("{what} overflows 64 bits ({a} + {b})")))
}
