//! NCCL as the emulator's NCCL tests call it: communicators over devices, point-to-point
//! operations of bytes, groups, device memory filled and read back.

use super::*;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use std::ffi::c_void;

pub type Comm = *mut c_void;
pub const UINT8: i32 = 1;

/// Communicators for devices 0..n, each with a non-blocking stream on its device.
pub fn comms(n: usize) -> Vec<(Comm, CUstream)> {
    let mut c = vec![std::ptr::null_mut(); n];
    // SAFETY: n communicators for devices 0..n.
    assert_eq!(
        unsafe { ncclCommInitAll(c.as_mut_ptr(), n as i32, std::ptr::null()) },
        0
    );
    (0..n)
        .map(|r| {
            use_device(r as i32);
            (c[r], stream(1))
        })
        .collect()
}

pub fn send(buf: CUdeviceptr, bytes: usize, peer: i32, (comm, s): (Comm, CUstream)) -> i32 {
    // SAFETY: device memory of the communicator's device.
    unsafe { ncclSend(buf as *const c_void, bytes, UINT8, peer, comm, s.cast()) }
}

pub fn recv(buf: CUdeviceptr, bytes: usize, peer: i32, (comm, s): (Comm, CUstream)) -> i32 {
    // SAFETY: as above.
    unsafe { ncclRecv(buf as *mut c_void, bytes, UINT8, peer, comm, s.cast()) }
}

pub fn group<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: balanced group calls.
    assert_eq!(unsafe { ncclGroupStart() }, 0);
    let out = f();
    // SAFETY: closes the group.
    assert_eq!(unsafe { ncclGroupEnd() }, 0);
    out
}

/// Device memory on device `d` holding `bytes`.
pub fn on_device(d: i32, bytes: &[u8]) -> CUdeviceptr {
    use_device(d);
    let p = alloc(bytes.len());
    let s = stream(1);
    upload_async(p, bytes, s);
    sync(s);
    p
}

pub fn read(d: i32, p: CUdeviceptr, len: usize) -> Vec<u8> {
    use_device(d);
    download(p, len)
}
