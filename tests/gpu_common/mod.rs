//! What the GPU tests share (tests/gpu.rs, tests/faults.rs): NCCL as the tests call it
//! themselves, devices and ranks as threads with their communicators, and each rank's buffers
//! for a plan with the view offsets the plans are made with.
//!
//! NCCL puts one rank per GPU; the loopback stand-in (loopback/, found by its
//! `ncclreshardLoopback` symbol) runs any number of ranks on one device, so under it the
//! multi-rank tests use 8 ranks whatever the device count, rank r on device r modulo the count.
#![allow(dead_code)]

use cudarc::driver::sys::{self, CUresult};
use ncclreshard::exec::buffers::CallBuffers;
use ncclreshard::exec::{Plan, PlanTensor, StagingLimit};
use ncclreshard::quant::Conversion;
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{Config, Layout, Mesh, Mode, Placement, TensorSpec};
use ncclreshard_tools::check::{
    destination_view_bytes, source_view_bytes, verify_destination_view,
};
use std::ffi::{c_int, c_void, CString};
use std::sync::OnceLock;

pub fn ck(result: CUresult, what: &str) {
    assert_eq!(result, CUresult::CUDA_SUCCESS, "{what}");
}

/// Captures what `body` enqueues on `stream` (capture `mode`) into a graph and instantiates
/// it: (graph, executable graph), for the caller to launch and destroy.
///
/// # Safety
/// `stream` is a live stream of the current context, not capturing yet.
pub unsafe fn capture_graph(
    stream: sys::CUstream,
    mode: sys::CUstreamCaptureMode,
    body: impl FnOnce(),
) -> (sys::CUgraph, sys::CUgraphExec) {
    ck(sys::cuStreamBeginCapture_v2(stream, mode), "begin capture");
    body();
    let mut graph = std::ptr::null_mut();
    ck(sys::cuStreamEndCapture(stream, &mut graph), "end capture");
    let mut exec = std::ptr::null_mut();
    ck(
        sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        "instantiate",
    );
    (graph, exec)
}

pub type Comm = *mut c_void;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [u8; 128]);

/// The fields of `ncclConfig_t` NCCL 2.18 has (NCCL reads later fields only when `version`
/// says they exist).
#[repr(C)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const std::ffi::c_char,
    pub split_share: c_int,
}

pub const NCCL_IN_PROGRESS: c_int = 7;
pub const NCCL_FLOAT32: c_int = 7;
pub const NCCL_SUM: c_int = 0;

pub type UniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> c_int;
pub type CommFn = unsafe extern "C" fn(Comm) -> c_int;
pub type AsyncErrorFn = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
pub type GroupFn = unsafe extern "C" fn() -> c_int;
pub type InitRankFn = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
pub type InitRankConfigFn =
    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut NcclConfig) -> c_int;
pub type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;

pub type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int;
pub type CommIntFn = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
pub type LastErrorFn = unsafe extern "C" fn(Comm) -> *const std::ffi::c_char;

/// The NCCL functions the tests call themselves (the library finds the same NCCL).
pub struct Nccl {
    pub get_unique_id: UniqueIdFn,
    pub init_rank: InitRankFn,
    pub init_rank_config: InitRankConfigFn,
    pub destroy: CommFn,
    pub abort: CommFn,
    pub async_error: AsyncErrorFn,
    pub group_start: GroupFn,
    pub group_end: GroupFn,
    pub all_reduce: AllReduceFn,
    pub recv: RecvFn,
    pub count: CommIntFn,
    pub last_error: LastErrorFn,
}

pub fn nccl() -> &'static Nccl {
    static NCCL: OnceLock<Nccl> = OnceLock::new();
    NCCL.get_or_init(|| {
        let path =
            std::env::var("NCCL_RESHARD_NCCL_LIBRARY").unwrap_or_else(|_| "libnccl.so.2".into());
        let c = CString::new(path.clone()).unwrap();
        // SAFETY: loads NCCL globally so the library under test finds the same one.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "cannot load {path}");
        let sym = |name: &str| {
            let c = CString::new(name).unwrap();
            // SAFETY: looks up a symbol in the library just opened.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            assert!(!p.is_null(), "{name} missing");
            p
        };
        // SAFETY: the symbols are NCCL's functions with these C signatures (nccl.h).
        unsafe {
            use std::mem::transmute as t;
            Nccl {
                get_unique_id: t::<*mut c_void, UniqueIdFn>(sym("ncclGetUniqueId")),
                init_rank: t::<*mut c_void, InitRankFn>(sym("ncclCommInitRank")),
                init_rank_config: t::<*mut c_void, InitRankConfigFn>(sym("ncclCommInitRankConfig")),
                destroy: t::<*mut c_void, CommFn>(sym("ncclCommDestroy")),
                abort: t::<*mut c_void, CommFn>(sym("ncclCommAbort")),
                async_error: t::<*mut c_void, AsyncErrorFn>(sym("ncclCommGetAsyncError")),
                group_start: t::<*mut c_void, GroupFn>(sym("ncclGroupStart")),
                group_end: t::<*mut c_void, GroupFn>(sym("ncclGroupEnd")),
                all_reduce: t::<*mut c_void, AllReduceFn>(sym("ncclAllReduce")),
                recv: t::<*mut c_void, RecvFn>(sym("ncclRecv")),
                count: t::<*mut c_void, CommIntFn>(sym("ncclCommCount")),
                last_error: t::<*mut c_void, LastErrorFn>(sym("ncclGetLastError")),
            }
        }
    })
}

/// NCCL's last warning (one process-wide buffer).
pub fn nccl_last_error() -> String {
    // SAFETY: NCCL's static buffer, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr((nccl().last_error)(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// Waits until a nonblocking communicator has finished what it was doing.
pub fn settle(comm: Comm, result: c_int, what: &str) {
    let mut state = result;
    while state == NCCL_IN_PROGRESS {
        // SAFETY: writes one int for our communicator.
        assert_eq!(unsafe { (nccl().async_error)(comm, &mut state) }, 0);
        std::thread::yield_now();
    }
    assert_eq!(state, 0, "{what}");
}

/// The symbol `name` in the NCCL the tests use (and its dependencies), if it has one.
pub fn nccl_symbol(name: &str) -> Option<*mut c_void> {
    nccl();
    let path = std::env::var("NCCL_RESHARD_NCCL_LIBRARY").unwrap_or_else(|_| "libnccl.so.2".into());
    symbol_in(&path, name)
}

/// The symbol `name` in the already loaded library `library` (and its dependencies), if any.
fn symbol_in(library: &str, name: &str) -> Option<*mut c_void> {
    let library = CString::new(library).unwrap();
    let name = CString::new(name).unwrap();
    // SAFETY: RTLD_NOLOAD only finds a library already loaded; a lookup in it and its
    // dependencies.
    unsafe {
        let handle = libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        let p = if handle.is_null() {
            std::ptr::null_mut()
        } else {
            libc::dlsym(handle, name.as_ptr())
        };
        (!p.is_null()).then_some(p)
    }
}

/// Whether NCCL is the loopback stand-in (ranks as threads on shared devices).
pub fn loopback() -> bool {
    static LOOPBACK: OnceLock<bool> = OnceLock::new();
    *LOOPBACK.get_or_init(|| nccl_symbol("ncclreshardLoopback").is_some())
}

/// Every device's primary context (retained; the driver initialised once).
pub fn contexts() -> &'static [usize] {
    static CONTEXTS: OnceLock<Vec<usize>> = OnceLock::new();
    CONTEXTS.get_or_init(|| {
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            ck(sys::cuInit(0), "cuInit");
            let mut n = 0;
            ck(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount");
            (0..n)
                .map(|i| {
                    let mut dev = 0;
                    ck(sys::cuDeviceGet(&mut dev, i), "cuDeviceGet");
                    let mut context = std::ptr::null_mut();
                    ck(sys::cuDevicePrimaryCtxRetain(&mut context, dev), "retain");
                    context as usize
                })
                .collect()
        }
    })
}

/// Ranks the multi-rank tests use: one per device, at most 8; 8 under the loopback stand-in.
pub fn world() -> usize {
    if loopback() {
        8
    } else {
        contexts().len().min(8)
    }
}

/// The context of the device rank `ordinal` uses: device `ordinal` (one rank per device, as NCCL
/// requires), or under the loopback stand-in device `ordinal` modulo the device count.
fn rank_context(ordinal: usize) -> sys::CUcontext {
    let all = contexts();
    let ordinal = if loopback() {
        ordinal % all.len()
    } else {
        ordinal
    };
    all[ordinal] as sys::CUcontext
}

/// One device as a rank's thread uses it: its primary context, made current, and a stream.
pub struct Device {
    pub context: sys::CUcontext,
    pub stream: sys::CUstream,
    pub owns_stream: bool,
}

impl Device {
    /// Device `ordinal`'s primary context made current on this thread, with a new
    /// non-blocking stream (as PyTorch's side streams are).
    pub fn new(ordinal: usize) -> Device {
        let context = rank_context(ordinal);
        // SAFETY: a retained primary context.
        ck(unsafe { sys::cuCtxSetCurrent(context) }, "cuCtxSetCurrent");
        let mut stream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Drop.
        ck(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        );
        Device {
            context,
            stream,
            owns_stream: true,
        }
    }

    /// The same context with the calling thread's per-thread default stream
    /// (`cudaStreamPerThread`).
    pub fn per_thread(ordinal: usize) -> Device {
        let context = rank_context(ordinal);
        // SAFETY: a retained primary context.
        ck(unsafe { sys::cuCtxSetCurrent(context) }, "cuCtxSetCurrent");
        Device {
            context,
            stream: 0x2 as sys::CUstream,
            owns_stream: false,
        }
    }

    pub fn current(&self) {
        // SAFETY: a retained primary context.
        ck(
            unsafe { sys::cuCtxSetCurrent(self.context) },
            "cuCtxSetCurrent",
        );
    }

    /// Device memory holding `bytes`, copied on our stream once it is idle: a copy from or to
    /// pageable memory goes through the driver's staging buffers, and one that waited for a
    /// stream held there by NCCL peers could hold up another rank's thread that needs them
    /// (ranks are threads of one process here).
    pub fn upload(&self, bytes: &[u8]) -> u64 {
        self.current();
        let mut ptr = 0;
        // SAFETY: an allocation and a copy of `bytes` ordered on our stream, then waited for.
        unsafe {
            ck(
                sys::cuMemAlloc_v2(&mut ptr, bytes.len().max(1)),
                "cuMemAlloc",
            );
            self.sync();
            if !bytes.is_empty() {
                ck(
                    sys::cuMemcpyHtoDAsync_v2(ptr, bytes.as_ptr().cast(), bytes.len(), self.stream),
                    "HtoD",
                );
            }
        }
        self.sync();
        ptr
    }

    /// `len` bytes at `ptr`, copied once our stream is idle (see [`Device::upload`]).
    pub fn download(&self, ptr: u64, len: usize) -> Vec<u8> {
        self.current();
        self.sync();
        let mut out = vec![0u8; len];
        // SAFETY: `ptr` holds at least `len` bytes; the copy is ordered on our stream and
        // waited for.
        unsafe {
            if len > 0 {
                ck(
                    sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), ptr, len, self.stream),
                    "DtoH",
                );
            }
        }
        self.sync();
        out
    }

    /// Frees memory from `upload` once the stream is done with it. Under the loopback stand-in
    /// ranks share a device, and `cuMemFree` waits for all of the device's work (CUDA's
    /// implicit synchronisation), other ranks' included, which may wait for this rank's next
    /// call: the free is deferred until no rank runs ([`free_deferred`]).
    pub fn free(&self, ptr: u64) {
        self.current();
        // SAFETY: frees memory from `upload` once the stream is done with it.
        unsafe {
            ck(sys::cuStreamSynchronize(self.stream), "sync");
            if loopback() {
                deferred()
                    .lock()
                    .unwrap()
                    .push((self.context as usize, ptr));
            } else {
                ck(sys::cuMemFree_v2(ptr), "cuMemFree");
            }
        }
    }

    pub fn sync(&self) {
        // SAFETY: a stream of ours (or this thread's default stream).
        ck(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        );
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.owns_stream {
            // SAFETY: our stream, destroyed once after its work.
            unsafe {
                sys::cuStreamSynchronize(self.stream);
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

/// Frees deferred by [`Device::free`]: (context, pointer).
fn deferred() -> &'static std::sync::Mutex<Vec<(usize, u64)>> {
    static DEFERRED: OnceLock<std::sync::Mutex<Vec<(usize, u64)>>> = OnceLock::new();
    DEFERRED.get_or_init(Default::default)
}

/// Frees what [`Device::free`] deferred; call it once every rank's thread has ended
/// ([`with_ranks`] does).
pub fn free_deferred() {
    let frees = std::mem::take(&mut *deferred().lock().unwrap());
    for (context, ptr) in frees {
        // SAFETY: memory from `upload` in that (retained) context, unused by every stream now.
        unsafe {
            ck(
                sys::cuCtxSetCurrent(context as sys::CUcontext),
                "cuCtxSetCurrent",
            );
            ck(sys::cuMemFree_v2(ptr), "cuMemFree");
        }
    }
}

/// What one rank's thread holds.
pub struct Rank {
    pub r: u32,
    pub n: u32,
    pub device: Device,
    pub comm: Comm,
}

/// A unique id for a new communicator.
pub fn unique_id() -> UniqueId {
    let mut id = UniqueId([0; 128]);
    // SAFETY: writes 128 bytes.
    assert_eq!(unsafe { (nccl().get_unique_id)(&mut id) }, 0);
    id
}

/// Rank `r` of communicator `id` on device `r`, on this thread (blocks until all join).
pub fn join(id: UniqueId, n: usize, r: usize, blocking: bool) -> Comm {
    let mut comm = std::ptr::null_mut();
    if blocking {
        // SAFETY: one communicator handle written.
        let result = unsafe { (nccl().init_rank)(&mut comm, n as c_int, id, r as c_int) };
        assert_eq!(result, 0, "ncclCommInitRank");
    } else {
        let mut config = NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 21800,
            blocking: 0,
            cga_cluster_size: c_int::MIN,
            min_ctas: c_int::MIN,
            max_ctas: c_int::MIN,
            net_name: std::ptr::null(),
            split_share: c_int::MIN,
        };
        // SAFETY: one communicator handle written; config valid for the call.
        let result = unsafe {
            (nccl().init_rank_config)(&mut comm, n as c_int, id, r as c_int, &mut config)
        };
        assert!(result == 0 || result == NCCL_IN_PROGRESS, "init: {result}");
        settle(comm, result, "nonblocking init");
    }
    comm
}

/// Runs `f` on `n` ranks, one thread each, rank r on device r with a fresh communicator.
pub fn with_ranks<T: Send>(n: usize, blocking: bool, f: impl Fn(&Rank) -> T + Sync) -> Vec<T> {
    let id = unique_id();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                scope.spawn(move || {
                    let device = Device::new(r);
                    let comm = join(id, n, r, blocking);
                    let rank = Rank {
                        r: r as u32,
                        n: n as u32,
                        device,
                        comm,
                    };
                    let out = f(&rank);
                    rank.device.sync();
                    // SAFETY: our communicator, destroyed once.
                    let destroyed = unsafe { (nccl().destroy)(comm) };
                    settle(comm, destroyed, "ncclCommDestroy");
                    out
                })
            })
            .collect();
        let outcome = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect();
        free_deferred();
        outcome
    })
}

/// A rank's buffers for a plan: views packed at 256-byte offsets in one send and one recv
/// buffer. Element values depend on `salt` (distinct data for several calls of one plan).
pub struct RankData {
    pub send: u64,
    pub recv: u64,
    pub src_offsets: Vec<u64>,
    pub dst_offsets: Vec<u64>,
    pub dst_extents: Vec<u64>,
    pub recv_len: usize,
    pub salt: u32,
}

pub fn align(x: u64) -> u64 {
    x.div_ceil(256) * 256
}

/// Host images of a rank's send and receive buffers: (send, recv, src offsets, dst offsets,
/// dst extents).
pub type Images = (Vec<u8>, Vec<u8>, Vec<u64>, Vec<u64>, Vec<u64>);

pub fn images(tensors: &[TensorSpec], rank: u32, salt: u32) -> Images {
    let (mut send, mut recv) = (Vec::new(), Vec::new());
    let (mut src_offsets, mut dst_offsets, mut dst_extents) = (vec![], vec![], vec![]);
    for (t, spec) in tensors.iter().enumerate() {
        let src = source_view_bytes(spec, t as u32 + salt, rank)
            .unwrap()
            .unwrap_or_default();
        let dst = destination_view_bytes(spec, rank)
            .unwrap()
            .unwrap_or_default();
        src_offsets.push(align(send.len() as u64));
        send.resize(align(send.len() as u64) as usize, 0);
        send.extend_from_slice(&src);
        dst_offsets.push(align(recv.len() as u64));
        recv.resize(align(recv.len() as u64) as usize, 0);
        dst_extents.push(dst.len() as u64);
        recv.extend_from_slice(&dst);
    }
    (send, recv, src_offsets, dst_offsets, dst_extents)
}

pub fn prepare(device: &Device, tensors: &[TensorSpec], rank: u32) -> RankData {
    prepare_salted(device, tensors, rank, 0)
}

pub fn prepare_salted(device: &Device, tensors: &[TensorSpec], rank: u32, salt: u32) -> RankData {
    let (send, recv, src_offsets, dst_offsets, dst_extents) = images(tensors, rank, salt);
    RankData {
        send: device.upload(&send),
        recv: device.upload(&recv),
        src_offsets,
        dst_offsets,
        dst_extents,
        recv_len: recv.len(),
        salt,
    }
}

/// `rank`'s plan as `ncclReshardPlanCreate` makes it (the policies of plan creation, the NCCL
/// transport's limits), each tensor's views at `offsets[t]` = (source, destination, scale).
pub fn plan_at(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    rank: u32,
    config: &Config,
    offsets: &[(u64, u64, u64)],
) -> ncclreshard::Result<Plan> {
    plan_at_within(tensors, conversions, rank, config, offsets, 0)
}

/// [`plan_at`] under a staging limit of `staging` bytes (0: the default, as
/// `config.maxStagingBytes` 0 means).
fn plan_at_within(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    rank: u32,
    config: &Config,
    offsets: &[(u64, u64, u64)],
    staging: u64,
) -> ncclreshard::Result<Plan> {
    let tensors = tensors
        .iter()
        .zip(conversions)
        .zip(offsets)
        .map(|((spec, conversion), &(src, dst, scale))| PlanTensor {
            conversion: conversion.clone(),
            src_offset: src,
            dst_offset: dst,
            scale_offset: scale,
            ..PlanTensor::new(spec.clone())
        })
        .collect();
    Plan::new(
        tensors,
        rank,
        config.clone(),
        StagingLimit::new(staging),
        NcclTransport::LIMITS,
    )
}

/// `rank`'s plan with the view offsets `prepare` uses.
pub fn plan_of(tensors: &[TensorSpec], rank: u32, config: &Config) -> ncclreshard::Result<Plan> {
    plan_of_within(tensors, rank, config, 0)
}

/// [`plan_of`] under a staging limit of `staging` bytes (0: the default).
pub fn plan_of_within(
    tensors: &[TensorSpec],
    rank: u32,
    config: &Config,
    staging: u64,
) -> ncclreshard::Result<Plan> {
    let (_, _, src_offsets, dst_offsets, _) = images(tensors, rank, 0);
    let offsets: Vec<(u64, u64, u64)> = src_offsets
        .iter()
        .zip(&dst_offsets)
        .map(|(&s, &d)| (s, d, 0))
        .collect();
    let none = vec![None; tensors.len()];
    plan_at_within(tensors, &none, rank, config, &offsets, staging)
}

/// Survivor `new`'s plan after `failed` (ranks of `tensors`' layouts) failed, as
/// `ncclReshardPlanCreate` makes it with `config.failedRanks`, with the view offsets `prepare`
/// gives the survivors' tensors (`ncclreshard::plan::survivors`).
pub fn survivors_plan(
    tensors: &[TensorSpec],
    config: &Config,
    failed: &[u32],
    new: u32,
) -> ncclreshard::Result<Plan> {
    let (specs, _, _) =
        ncclreshard::plan::survivors(tensors, &vec![None; tensors.len()], config, failed)?;
    let (_, _, src, dst, _) = images(&specs, new, 0);
    let tensors = tensors
        .iter()
        .cloned()
        .zip(src.into_iter().zip(dst))
        .map(|(spec, (src_offset, dst_offset))| PlanTensor {
            src_offset,
            dst_offset,
            ..PlanTensor::new(spec)
        })
        .collect();
    Plan::survivors(
        tensors,
        failed,
        new,
        config.clone(),
        StagingLimit::new(0),
        NcclTransport::LIMITS,
    )
}

impl RankData {
    /// The single-buffer call's buffers.
    pub fn buffers(&self) -> CallBuffers<'static> {
        CallBuffers::Single {
            send: self.send as usize,
            recv: self.recv as usize,
        }
    }

    /// The per-tensor pointers (`ncclReshardMulti`): (sources, destinations).
    pub fn pointers(&self) -> (Vec<usize>, Vec<usize>) {
        (
            self.src_offsets
                .iter()
                .map(|&o| (self.send + o) as usize)
                .collect(),
            self.dst_offsets
                .iter()
                .map(|&o| (self.recv + o) as usize)
                .collect(),
        )
    }

    /// Checks every destination element; returns how many.
    pub fn verify(&self, device: &Device, tensors: &[TensorSpec], rank: u32) -> u64 {
        let got = device.download(self.recv, self.recv_len);
        let mut checked = 0;
        for (t, spec) in tensors.iter().enumerate() {
            let (o, e) = (self.dst_offsets[t] as usize, self.dst_extents[t] as usize);
            checked += verify_destination_view(spec, t as u32 + self.salt, rank, &got[o..o + e])
                .unwrap_or_else(|err| panic!("rank {rank}: {err}"));
        }
        checked
    }

    pub fn free(self, device: &Device) {
        device.free(self.send);
        device.free(self.recv);
    }
}

pub fn mesh(shape: &[u64], ranks: &[u32]) -> Mesh {
    Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap()
}

pub fn layout(mesh: Mesh, placements: &[Placement]) -> Layout {
    Layout::new(mesh, placements.to_vec())
}

pub fn config(mode: Mode) -> Config {
    Config {
        mode,
        ..Default::default()
    }
}

/// One of the emulator's fault-injection controls (`ncclreshardEmu*`, emu/README.md), found
/// through the NCCL library (the emulator's shim depends on it); absent on a GPU and under the
/// loopback stand-in (whose communicators the emulator's NCCL controls would not know).
pub fn emu_control<F: Copy>(name: &str) -> Option<F> {
    // SAFETY: the caller names the emulator's symbol with its C signature.
    nccl_symbol(name).map(|p| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// `ncclreshardEmuFailLaunchOnStream(stream, nth)`.
pub type FailLaunchFn = unsafe extern "C" fn(sys::CUstream, c_int) -> c_int;

/// `ncclreshardEmuFailLaunchOnStream`: a CUDA fault, found through the CUDA driver (the
/// emulator's shim depends on it) whichever NCCL runs; absent on a GPU.
pub fn fail_launch() -> Option<FailLaunchFn> {
    contexts();
    let name = "ncclreshardEmuFailLaunchOnStream";
    ["libcuda.so", "libcuda.so.1"]
        .iter()
        .find_map(|library| symbol_in(library, name))
        // SAFETY: the emulator's control, with this C signature (emu/README.md).
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, FailLaunchFn>(p) })
}
