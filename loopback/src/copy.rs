//! The stand-in's copy of a message: a kernel of its own, not `cuMemcpyAsync`.
//!
//! On a real GPU (one H200, driver 580, 2026-12-04) `cuMemcpyAsync` between two ranks' buffers
//! crashed inside the driver and blocked issuing threads (loopback/README.md, "On a real GPU"):
//! the driver looks at both pointers when the copy is enqueued, and a rank's buffer may be
//! stream-ordered pool memory whose allocation or free is pending on that rank's stream, which
//! waits on flags this very thread is about to release. A kernel takes its pointers as plain
//! arguments. It is PTX written here (`sm_70`, which the driver compiles for any newer GPU),
//! loaded into each context when its first rank joins, before any rank of it waits on a flag
//! (loading a module may synchronise the context); the emulator runs it as a byte copy with its
//! usual checks of every address.

use crate::cuda::{driver, Context, DevicePtr, Function, Stream};
use crate::report::{lock, NResult};
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Mutex, OnceLock};

/// The kernel's name (the emulator knows it by this name too).
pub const NAME: &CStr = c"ncclreshardLoopbackCopy";

/// `ncclreshardLoopbackCopy(dst, src, bytes)`: grid-stride, 16-byte units when both ends and
/// the length are multiples of 16, else bytes.
const PTX: &CStr = c"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ncclreshardLoopbackCopy(
	.param .u64 ncclreshardLoopbackCopy_dst,
	.param .u64 ncclreshardLoopbackCopy_src,
	.param .u64 ncclreshardLoopbackCopy_bytes
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<12>;

	ld.param.u64 	%rd0, [ncclreshardLoopbackCopy_dst];
	ld.param.u64 	%rd1, [ncclreshardLoopbackCopy_src];
	ld.param.u64 	%rd2, [ncclreshardLoopbackCopy_bytes];
	mov.u32 	%r0, %tid.x;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %nctaid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	cvt.u64.u32 	%rd4, %r0;
	add.u64 	%rd3, %rd3, %rd4;
	mul.wide.u32 	%rd5, %r2, %r3;
	or.b64 	%rd6, %rd0, %rd1;
	or.b64 	%rd6, %rd6, %rd2;
	and.b64 	%rd6, %rd6, 15;
	setp.ne.u64 	%p0, %rd6, 0;
	@%p0 bra 	BYTES;
	shr.u64 	%rd7, %rd2, 4;
UNITS:
	setp.ge.u64 	%p1, %rd3, %rd7;
	@%p1 bra 	DONE;
	shl.b64 	%rd8, %rd3, 4;
	add.u64 	%rd9, %rd1, %rd8;
	ld.global.v4.u32 	{%r4, %r5, %r6, %r7}, [%rd9];
	add.u64 	%rd10, %rd0, %rd8;
	st.global.v4.u32 	[%rd10], {%r4, %r5, %r6, %r7};
	add.u64 	%rd3, %rd3, %rd5;
	bra.uni 	UNITS;
BYTES:
	setp.ge.u64 	%p2, %rd3, %rd2;
	@%p2 bra 	DONE;
	add.u64 	%rd9, %rd1, %rd3;
	ld.global.u8 	%r8, [%rd9];
	add.u64 	%rd10, %rd0, %rd3;
	st.global.u8 	[%rd10], %r8;
	add.u64 	%rd3, %rd3, %rd5;
	bra.uni 	BYTES;
DONE:
	ret;
}
";

const THREADS: u32 = 256;
const MAX_BLOCKS: u64 = 1024;

fn loaded() -> &'static Mutex<HashMap<Context, Function>> {
    static LOADED: OnceLock<Mutex<HashMap<Context, Function>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// The kernel in `context` (current on the calling thread), loaded there the first time.
pub fn function(context: Context) -> NResult<Function> {
    let mut loaded = lock(loaded());
    if let Some(&function) = loaded.get(&context) {
        return Ok(function);
    }
    let function = driver()?.load_function(PTX, NAME)?;
    loaded.insert(context, function);
    Ok(function)
}

/// Enqueues the copy of `bytes` from `src` to `dst` on `stream` of `context` (current).
///
/// # Safety
/// Both ranges are device (or mapped) memory valid for `bytes` bytes when the stream gets
/// there: the ranks' NCCL contract for their buffers.
pub unsafe fn launch(
    context: Context,
    stream: Stream,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: u64,
) -> NResult<()> {
    let function = function(context)?;
    let units = if (dst | src | bytes) % 16 == 0 {
        bytes / 16
    } else {
        bytes
    };
    let blocks = units.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32;
    let (mut d, mut s, mut n) = (dst, src, bytes);
    let mut params = [
        (&mut d as *mut u64).cast::<c_void>(),
        (&mut s as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
    ];
    // SAFETY: three u64 parameters, as the kernel declares; the ranges per the contract.
    unsafe { driver()?.launch(function, blocks, THREADS, stream, &mut params) }
}
