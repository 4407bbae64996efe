//! GPU tests (DESIGN §7.6): the CUDA executor on real GPUs with real NCCL. They need a CUDA GPU,
//! its driver, libnccl.so.2 and NVRTC, so they are ignored by default; `scripts/gpu-check.sh`
//! runs them and prints the report lines (`gpu: …`).
//!
//! One GPU: a one-rank communicator, colocated layouts (strided views, several tensors, every
//! element size) through local copies and through NCCL self send/receive in every mode, byte
//! checked; copy kernel bandwidth against cuMemcpyDtoD; CUDA graph capture and replay.
//! Two or more GPUs: multi-rank reshards in one ncclGroupStart/End from one thread.

use cudarc::driver::sys::{self, CUresult};
use ncclreshard::check::{destination_view_bytes, source_view_bytes, verify_destination_view};
use ncclreshard::exec::cuda::{CallBuffers, CudaExecutor};
use ncclreshard::plan::RankProgram;
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, Planner, TensorSpec};
use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;

fn ck(result: CUresult, what: &str) {
    assert_eq!(result, CUresult::CUDA_SUCCESS, "{what}");
}

type Comm = *mut c_void;

/// The NCCL functions the tests call themselves (the library finds its own the same way).
struct Nccl {
    init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
}

fn nccl() -> Nccl {
    let path = std::env::var("NCCL_RESHARD_NCCL_LIBRARY").unwrap_or_else(|_| "libnccl.so.2".into());
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
        Nccl {
            init_all: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int,
            >(sym("ncclCommInitAll")),
            destroy: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Comm) -> c_int>(sym(
                "ncclCommDestroy",
            )),
            group_start: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(sym(
                "ncclGroupStart",
            )),
            group_end: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(sym(
                "ncclGroupEnd",
            )),
        }
    }
}

/// One device: its primary context (made current) and a stream.
struct Device {
    context: sys::CUcontext,
    stream: sys::CUstream,
}

fn devices() -> Vec<Device> {
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
                ck(sys::cuCtxSetCurrent(context), "set current");
                let mut stream = std::ptr::null_mut();
                ck(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate");
                Device { context, stream }
            })
            .collect()
    }
}

impl Device {
    fn current(&self) {
        // SAFETY: a retained primary context.
        ck(
            unsafe { sys::cuCtxSetCurrent(self.context) },
            "cuCtxSetCurrent",
        );
    }
    fn upload(&self, bytes: &[u8]) -> u64 {
        self.current();
        let mut ptr = 0;
        // SAFETY: allocation and a synchronous copy of `bytes`.
        unsafe {
            ck(
                sys::cuMemAlloc_v2(&mut ptr, bytes.len().max(1)),
                "cuMemAlloc",
            );
            if !bytes.is_empty() {
                ck(
                    sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), bytes.len()),
                    "HtoD",
                );
            }
        }
        ptr
    }
    fn download(&self, ptr: u64, len: usize) -> Vec<u8> {
        self.current();
        let mut out = vec![0u8; len];
        // SAFETY: `ptr` holds at least `len` bytes.
        unsafe {
            ck(sys::cuStreamSynchronize(self.stream), "sync");
            if len > 0 {
                ck(
                    sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, len),
                    "DtoH",
                );
            }
        }
        out
    }
    fn free(&self, ptr: u64) {
        self.current();
        // SAFETY: frees memory from `upload`.
        ck(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree");
    }
    fn sync(&self) {
        self.current();
        // SAFETY: a stream we created.
        ck(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        );
    }
}

/// A rank's buffers for a plan: views packed at 256-byte offsets in one send and one recv buffer.
struct RankData {
    send: u64,
    recv: u64,
    src_offsets: Vec<u64>,
    dst_offsets: Vec<u64>,
    dst_extents: Vec<u64>,
    recv_len: usize,
}

impl RankData {
    /// An executor for `program` with this rank's view offsets.
    fn executor(&self, program: RankProgram) -> CudaExecutor {
        CudaExecutor::new(
            Arc::new(program),
            self.src_offsets.clone(),
            self.dst_offsets.clone(),
            0,
        )
    }

    /// The single-buffer call's buffers.
    fn buffers(&self) -> CallBuffers<'static> {
        CallBuffers::Single {
            send: self.send as usize,
            recv: self.recv as usize,
        }
    }
}

fn align(x: u64) -> u64 {
    x.div_ceil(256) * 256
}

fn prepare(device: &Device, tensors: &[TensorSpec], rank: u32) -> RankData {
    let (mut send, mut recv) = (Vec::new(), Vec::new());
    let (mut src_offsets, mut dst_offsets, mut dst_extents) = (vec![], vec![], vec![]);
    for (t, spec) in tensors.iter().enumerate() {
        let src = source_view_bytes(spec, t as u32, rank)
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
    RankData {
        send: device.upload(&send),
        recv: device.upload(&recv),
        src_offsets,
        dst_offsets,
        dst_extents,
        recv_len: recv.len(),
    }
}

fn verify(device: &Device, tensors: &[TensorSpec], rank: u32, data: &RankData) -> u64 {
    let got = device.download(data.recv, data.recv_len);
    let mut checked = 0;
    for (t, spec) in tensors.iter().enumerate() {
        let (o, e) = (data.dst_offsets[t] as usize, data.dst_extents[t] as usize);
        checked += verify_destination_view(spec, t as u32, rank, &got[o..o + e])
            .unwrap_or_else(|err| panic!("rank {rank}: {err}"));
    }
    checked
}

fn mesh(shape: &[u64], ranks: &[u32]) -> Mesh {
    Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap()
}

fn layout(mesh: Mesh, placements: &[Placement]) -> Layout {
    Layout::new(mesh, placements.to_vec())
}

/// Colocated cases on the single rank 0: strided views, several tensors, every element size.
fn one_rank_cases() -> Vec<(&'static str, Vec<TensorSpec>)> {
    let one = || mesh(&[1], &[0]);
    let r = Placement::Replicate;
    let dense = |shape: Vec<u64>, dtype| TensorSpec {
        shape,
        dtype,
        src: layout(one(), &[r]),
        dst: layout(one(), &[r]),
    };
    let padded_dst = {
        // The gate half of a fused [2·rows, cols] buffer is rows × cols with row stride cols;
        // here a padded row stride instead: the bytes between rows must survive.
        let mut t = dense(vec![300, 1000], DType::Bfloat16);
        t.dst.strides = Some(vec![1024, 1]);
        t
    };
    let transposed_src = {
        let mut t = dense(vec![64, 48], DType::Float32);
        t.src.strides = Some(vec![1, 64]);
        t
    };
    vec![
        ("1-D float32", vec![dense(vec![1 << 20], DType::Float32)]),
        ("scalar float64", vec![dense(vec![], DType::Float64)]),
        (
            "rank-8 int8",
            vec![dense(vec![2, 3, 2, 3, 2, 3, 2, 5], DType::Int8)],
        ),
        ("padded destination view", vec![padded_dst.clone()]),
        ("transposed source view", vec![transposed_src.clone()]),
        (
            "four tensors, all element sizes",
            vec![
                dense(vec![7, 13], DType::Int8),
                dense(vec![4097], DType::Float16),
                padded_dst,
                dense(vec![3, 5, 7], DType::Int64),
            ],
        ),
    ]
}

fn run_rank0(
    device: &Device,
    comm: Comm,
    tensors: &[TensorSpec],
    config: &Config,
) -> (RankProgram, u64) {
    let planner = Planner::new(tensors.to_vec(), config.clone()).unwrap();
    let program = planner.rank_program(0).unwrap();
    let data = prepare(device, tensors, 0);
    let executor = data.executor(program.clone());
    let buffers = data.buffers();
    executor
        .execute(&buffers, comm, device.stream.cast())
        .unwrap_or_else(|e| panic!("execute: {e}"));
    let checked = verify(device, tensors, 0, &data);
    device.free(data.send);
    device.free(data.recv);
    (program, checked)
}

fn init_comms(nccl: &Nccl, n: usize) -> Vec<Comm> {
    let mut comms = vec![std::ptr::null_mut(); n];
    let devs: Vec<c_int> = (0..n as c_int).collect();
    // SAFETY: n communicators for devices 0..n.
    assert_eq!(
        unsafe { (nccl.init_all)(comms.as_mut_ptr(), n as c_int, devs.as_ptr()) },
        0,
        "ncclCommInitAll"
    );
    comms
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn one_gpu_colocated_layouts_are_byte_exact() {
    let devs = devices();
    assert!(!devs.is_empty(), "no CUDA device");
    let nccl = nccl();
    let comms = init_comms(&nccl, 1);
    let mut total = 0;
    for (name, tensors) in one_rank_cases() {
        for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
            for (via_nccl, rounds) in [(false, 0), (true, 0), (true, 3)] {
                // Three rounds with small parts: packs, groups and unpacks per round, the
                // staging arena reused in stream order (groupable mode stays one round).
                let config = Config {
                    mode,
                    local_via_messages: via_nccl,
                    rounds,
                    split_min_bytes: if rounds > 0 { 4096 } else { 1 << 20 },
                    ..Default::default()
                };
                let (program, checked) = run_rank0(&devs[0], comms[0], &tensors, &config);
                if via_nccl {
                    assert!(!program.sends.is_empty(), "{name}: expected self messages");
                }
                total += checked;
            }
        }
    }
    println!("gpu: one-rank colocated layouts: {} cases x 3 modes x (local, NCCL self, NCCL self in 3 rounds) byte-exact, {total} elements checked", one_rank_cases().len());
    // NCCL_RESHARD_CHECK's fingerprint exchange (with itself here) passes and data still moves.
    let (name, tensors) = &one_rank_cases()[5];
    let config = Config {
        mode: Mode::Auto,
        local_via_messages: true,
        ..Default::default()
    };
    let planner = Planner::new(tensors.clone(), config).unwrap();
    let data = prepare(&devs[0], tensors, 0);
    let executor = data
        .executor(planner.rank_program(0).unwrap())
        .with_peer_check(true);
    executor
        .execute(&data.buffers(), comms[0], devs[0].stream.cast())
        .unwrap_or_else(|e| panic!("{name} with the peer check: {e}"));
    verify(&devs[0], tensors, 0, &data);
    devs[0].free(data.send);
    devs[0].free(data.recv);
    println!("gpu: NCCL_RESHARD_CHECK fingerprint exchange passes on a consistent plan");
    // SAFETY: communicator from ncclCommInitAll.
    unsafe { (nccl.destroy)(comms[0]) };
}

/// Driver and NCCL handles handed to a rank's thread.
#[derive(Clone, Copy)]
struct Handles {
    context: sys::CUcontext,
    stream: sys::CUstream,
    comm: Comm,
}

// SAFETY: CUDA contexts, streams and NCCL communicators may be used from any thread (one
// thread per communicator here).
unsafe impl Send for Handles {}

/// Milliseconds per call of `f` (enqueued on `stream`), best of `reps` after a warm-up.
fn time_ms(stream: sys::CUstream, reps: usize, mut f: impl FnMut()) -> f32 {
    // SAFETY: events on the current context, recorded on our stream.
    unsafe {
        let (mut start, mut end) = (std::ptr::null_mut(), std::ptr::null_mut());
        ck(sys::cuEventCreate(&mut start, 0), "event");
        ck(sys::cuEventCreate(&mut end, 0), "event");
        f();
        let mut best = f32::MAX;
        for _ in 0..reps {
            ck(sys::cuEventRecord(start, stream), "record");
            f();
            ck(sys::cuEventRecord(end, stream), "record");
            ck(sys::cuEventSynchronize(end), "sync");
            let mut ms = 0f32;
            ck(sys::cuEventElapsedTime(&mut ms, start, end), "elapsed");
            best = best.min(ms);
        }
        best
    }
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn copy_kernel_bandwidth_against_memcpy() {
    let devs = devices();
    let device = &devs[0];
    let nccl = nccl();
    let comms = init_comms(&nccl, 1);
    let one = || mesh(&[1], &[0]);
    let r = Placement::Replicate;
    // (name, shape, dtype, dst strides): large contiguous, large rows into a padded view,
    // small 64-byte rows, and the staged pack → NCCL self send → unpack path.
    type Case = (&'static str, Vec<u64>, DType, Option<Vec<u64>>, Config);
    let cases: Vec<Case> = vec![
        (
            "contiguous 1 GiB",
            vec![16384, 16384],
            DType::Float32,
            None,
            Config::default(),
        ),
        (
            "64 KiB rows into a padded view, 1 GiB",
            vec![16384, 16384],
            DType::Float32,
            Some(vec![16384 + 64, 1]),
            Config::default(),
        ),
        (
            "64-byte rows into a padded view, 256 MiB",
            vec![1 << 22, 32],
            DType::Bfloat16,
            Some(vec![40, 1]),
            Config::default(),
        ),
        (
            "4 KiB rows, 256 MiB",
            vec![1 << 16, 1024],
            DType::Float32,
            Some(vec![1024 + 32, 1]),
            Config::default(),
        ),
        (
            "staged: pack + NCCL self send + unpack, 512 MiB",
            vec![8192, 16384],
            DType::Float32,
            Some(vec![16384 + 64, 1]),
            Config {
                mode: Mode::Staged,
                local_via_messages: true,
                ..Default::default()
            },
        ),
    ];
    for (name, shape, dtype, strides, config) in cases {
        let mut spec = TensorSpec {
            shape,
            dtype,
            src: layout(one(), &[r]),
            dst: layout(one(), &[r]),
        };
        spec.dst.strides = strides;
        let tensors = vec![spec];
        let planner = Planner::new(tensors.clone(), config).unwrap();
        let program = planner.rank_program(0).unwrap();
        let data = prepare(device, &tensors, 0);
        let bytes: u64 = tensors[0].shape.iter().product::<u64>() * u64::from(dtype.size());
        let executor = data.executor(program);
        let buffers = data.buffers();
        let ours = time_ms(device.stream, 5, || {
            executor
                .execute(&buffers, comms[0], device.stream.cast())
                .unwrap();
        });
        verify(device, &tensors, 0, &data);
        let (src, dst) = (data.send, data.recv);
        // SAFETY: both buffers hold at least `bytes` bytes.
        let memcpy = time_ms(device.stream, 5, || unsafe {
            ck(
                sys::cuMemcpyDtoDAsync_v2(dst, src, bytes as usize, device.stream),
                "DtoD",
            );
        });
        let gbs = |ms: f32| bytes as f64 / (ms as f64 * 1e-3) / 1e9;
        println!(
            "gpu: {name}: {:.0} GB/s vs cudaMemcpy {:.0} GB/s = {:.2}x ({ours:.3} ms vs {memcpy:.3} ms)",
            gbs(ours),
            gbs(memcpy),
            memcpy / ours
        );
        device.free(data.send);
        device.free(data.recv);
    }
    // SAFETY: communicator from ncclCommInitAll.
    unsafe { (nccl.destroy)(comms[0]) };
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn graph_capture_replays_the_reshard() {
    let devs = devices();
    let device = &devs[0];
    let nccl = nccl();
    let comms = init_comms(&nccl, 1);
    let (_, tensors) = one_rank_cases().pop().unwrap();
    for config in [
        Config::default(),
        Config {
            mode: Mode::Staged,
            local_via_messages: true,
            ..Default::default()
        },
    ] {
        let planner = Planner::new(tensors.clone(), config.clone()).unwrap();
        let program = planner.rank_program(0).unwrap();
        let data = prepare(device, &tensors, 0);
        let executor = data.executor(program);
        let buffers = data.buffers();
        executor
            .execute(&buffers, comms[0], device.stream.cast())
            .unwrap(); // warm-up
        device.sync();
        // SAFETY: capture on our stream; graph objects destroyed below.
        unsafe {
            ck(
                sys::cuStreamBeginCapture_v2(
                    device.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
                ),
                "begin capture",
            );
            executor
                .execute(&buffers, comms[0], device.stream.cast())
                .unwrap_or_else(|e| panic!("capture: {e}"));
            let mut graph = std::ptr::null_mut();
            ck(
                sys::cuStreamEndCapture(device.stream, &mut graph),
                "end capture",
            );
            let mut exec = std::ptr::null_mut();
            ck(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "instantiate",
            );
            for _ in 0..3 {
                // Reset the destination, replay, check.
                let fresh = prepare(device, &tensors, 0);
                ck(
                    sys::cuMemcpyDtoDAsync_v2(data.recv, fresh.recv, data.recv_len, device.stream),
                    "reset",
                );
                ck(sys::cuGraphLaunch(exec, device.stream), "launch");
                verify(device, &tensors, 0, &data);
                device.free(fresh.send);
                device.free(fresh.recv);
            }
            ck(sys::cuGraphExecDestroy(exec), "destroy exec");
            ck(sys::cuGraphDestroy(graph), "destroy graph");
        }
        device.free(data.send);
        device.free(data.recv);
        println!(
            "gpu: graph capture + 3 replays byte-exact ({:?} mode, local via NCCL: {})",
            config.mode, config.local_via_messages
        );
    }
    // SAFETY: communicator from ncclCommInitAll.
    unsafe { (nccl.destroy)(comms[0]) };
}

/// Runs each rank's executor on its own thread (as a multi-process job would), with the rank's
/// context current; returns each rank's outcome.
fn execute_on_threads(
    devs: &[Device],
    comms: &[Comm],
    runs: &[(RankData, CudaExecutor)],
) -> Vec<Result<(), String>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .enumerate()
            .map(|(r, (data, executor))| {
                let h = Handles {
                    context: devs[r].context,
                    stream: devs[r].stream,
                    comm: comms[r],
                };
                scope.spawn(move || {
                    let h = h;
                    // SAFETY: a retained primary context.
                    ck(
                        unsafe { sys::cuCtxSetCurrent(h.context) },
                        "cuCtxSetCurrent",
                    );
                    executor
                        .execute(&data.buffers(), h.comm, h.stream.cast())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
#[ignore = "needs two or more CUDA GPUs and NCCL"]
fn multi_gpu_reshards_in_one_group() {
    let devs = devices();
    let n = devs.len();
    if n < 2 {
        println!("gpu: multi-GPU reshard skipped: {n} GPU visible");
        return;
    }
    let nccl = nccl();
    let comms = init_comms(&nccl, n);
    let ranks: Vec<u32> = (0..n as u32).collect();
    let all = || mesh(&[n as u64], &ranks);
    let tensors = vec![
        // Column-parallel → row-parallel, uneven sizes.
        TensorSpec {
            shape: vec![1003, 517],
            dtype: DType::Bfloat16,
            src: layout(all(), &[Placement::Shard(0)]),
            dst: layout(all(), &[Placement::Shard(1)]),
        },
        // Sharded → replicated (an all-gather).
        TensorSpec {
            shape: vec![4096, 64],
            dtype: DType::Float32,
            src: layout(all(), &[Placement::Shard(1)]),
            dst: layout(all(), &[Placement::Replicate]),
        },
    ];
    for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
        let planner = Planner::new(
            tensors.clone(),
            Config {
                mode,
                ..Default::default()
            },
        )
        .unwrap();
        let mut runs = Vec::new();
        for (r, device) in devs.iter().enumerate() {
            let program = planner.rank_program(r as u32).unwrap();
            let data = prepare(device, &tensors, r as u32);
            let executor = data.executor(program);
            runs.push((data, executor));
        }
        // Warm up each rank (allocation), then the real call. Groupable plans: every rank from
        // this thread inside one ncclGroupStart/End. Staged plans must not run inside a group:
        // one thread per rank, as a multi-process job would.
        for pass in 0..2 {
            if mode == Mode::Groupable {
                // SAFETY: group calls, balanced.
                unsafe { assert_eq!((nccl.group_start)(), 0) };
                for (r, (data, executor)) in runs.iter().enumerate() {
                    devs[r].current();
                    let buffers = data.buffers();
                    executor
                        .execute(&buffers, comms[r], devs[r].stream.cast())
                        .unwrap_or_else(|e| panic!("rank {r} pass {pass}: {e}"));
                }
                // SAFETY: closes the group.
                unsafe { assert_eq!((nccl.group_end)(), 0) };
            } else {
                for (r, result) in execute_on_threads(&devs, &comms, &runs).iter().enumerate() {
                    if let Err(e) = result {
                        panic!("rank {r} pass {pass}: {e}");
                    }
                }
            }
        }
        let mut checked = 0;
        for (r, (data, _)) in runs.iter().enumerate() {
            checked += verify(&devs[r], &tensors, r as u32, data);
        }
        println!("gpu: {n}-GPU reshard in one group ({mode:?}) byte-exact, {checked} elements");
        for (r, (data, _)) in runs.into_iter().enumerate() {
            devs[r].free(data.send);
            devs[r].free(data.recv);
        }
    }
    // NCCL_RESHARD_CHECK: rank 1 plans from a different shape; every rank's call fails with
    // invalid usage naming a peer, before any data moves, instead of hanging or corrupting.
    let mut other = tensors.clone();
    other[0].shape = vec![1003, 518];
    let plans = [
        Planner::new(tensors.clone(), Config::default()).unwrap(),
        Planner::new(other.clone(), Config::default()).unwrap(),
    ];
    let runs: Vec<_> = devs
        .iter()
        .enumerate()
        .map(|(r, device)| {
            let mine = if r == 1 { &other } else { &tensors };
            let planner = &plans[usize::from(r == 1)];
            let data = prepare(device, mine, r as u32);
            let executor = data
                .executor(planner.rank_program(r as u32).unwrap())
                .with_peer_check(true);
            (data, executor)
        })
        .collect();
    let errors: Vec<String> = execute_on_threads(&devs, &comms, &runs)
        .into_iter()
        .map(|r| r.err().unwrap_or_default())
        .collect();
    for (r, e) in errors.iter().enumerate().take(2) {
        assert!(
            e.contains("different tensors or config"),
            "rank {r} should refuse the mismatched plan: {e:?}"
        );
    }
    println!("gpu: NCCL_RESHARD_CHECK refuses a rank with a different descriptor: {errors:?}");
    for (r, (data, _)) in runs.into_iter().enumerate() {
        devs[r].free(data.send);
        devs[r].free(data.recv);
    }
    for c in comms {
        // SAFETY: communicators from ncclCommInitAll.
        unsafe { (nccl.destroy)(c) };
    }
}
