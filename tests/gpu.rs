//! GPU tests (docs/design.md §7.6–7.7): the CUDA + NCCL executor on CUDA devices, ranks as threads
//! (as a multi-process job would run them), every destination byte checked.
//!
//! They need a CUDA driver, NCCL and NVRTC, so they are ignored by default.
//! `scripts/emulated-gpu-tests.sh` runs them on 8 emulated devices (every CI run: emu/), and
//! `scripts/gpu-check.sh` on real GPUs (it prints the `gpu: …` report lines). A test that needs
//! more ranks than there are devices (NCCL puts one rank per GPU) says so and returns; on one
//! GPU the one-rank tests route data through NCCL self messages (`Config::local_via_messages`).
//! Through the loopback stand-in (loopback/) the multi-rank tests run 8 ranks on however few
//! devices there are (scripts/emulated-gpu-tests.sh: on one emulated device).

mod gpu_common;

use cudarc::driver::sys;
use gpu_common::*;
use ncclreshard::exec::buffers::CallBuffers;
use ncclreshard::exec::Plan;
use ncclreshard::plan::{Buffer, RankProgram};
use ncclreshard::quant::{Conversion, ScaleFormat, Scheme};
use ncclreshard::transport::host::{execute, RankBuffers};
use ncclreshard::transport::nccl::{self as transport, NcclTransport};
use ncclreshard::{Config, DType, ErrorKind, Mode, Placement, Planner, TensorSpec, Topology};
use ncclreshard_tools::check::{
    check_with_conversions, converted_destination_view_bytes, converted_source_view_bytes,
    destination_view_bytes, rank_buffers, scale_view_bytes, source_view_bytes,
    verify_destination_view,
};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Plans `rank`'s part (as every rank does on its own), runs it once on the rank's stream and
/// communicator, checks every destination byte. Returns the elements checked.
fn reshard(rank: &Rank, tensors: &[TensorSpec], config: &Config) -> u64 {
    let plan = plan_of(tensors, rank.r, config).unwrap();
    let data = prepare(&rank.device, tensors, rank.r);
    let executor = NcclTransport::for_plan(&plan);
    executor
        .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
        .unwrap_or_else(|e| panic!("rank {}: {e}", rank.r));
    let checked = data.verify(&rank.device, tensors, rank.r);
    data.free(&rank.device);
    checked
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
    let odd_bf16 = {
        // Rows of an odd number of 2-byte elements: the kernel's 2-byte path.
        let mut t = dense(vec![129, 333], DType::Bfloat16);
        t.dst.strides = Some(vec![335, 1]);
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
        ("transposed source view", vec![transposed_src]),
        ("odd bfloat16 rows", vec![odd_bf16]),
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

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn one_rank_colocated_layouts_are_byte_exact() {
    let cases = one_rank_cases();
    let outcome: Vec<(u64, u32)> = with_ranks(1, true, |rank| {
        let mut total = 0;
        // Plans whose late unpacks ran on a side stream beside the next round.
        let mut overlapped = 0;
        for (name, tensors) in &cases {
            for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
                for (via_nccl, rounds) in [(false, 0), (true, 0), (true, 3)] {
                    // Three rounds with small parts: packs, groups and unpacks per round, the
                    // staging reused in stream order (groupable mode stays one round).
                    let config = Config {
                        mode,
                        local_via_messages: via_nccl,
                        rounds,
                        split_min_bytes: if rounds > 0 { 4096 } else { 1 << 20 },
                        ..Default::default()
                    };
                    let plan = match plan_of(tensors, 0, &config) {
                        Ok(plan) => plan,
                        // Element-wise interleaving through self messages: past groupable
                        // mode's message cap (auto and staged take it).
                        Err(e) if mode == Mode::Groupable && via_nccl => {
                            assert!(e.message.contains("groupable mode needs"), "{name}: {e}");
                            continue;
                        }
                        Err(e) => panic!("{name}: {e}"),
                    };
                    let program = plan.program();
                    if via_nccl {
                        assert!(!program.sends.is_empty(), "{name}: expected self messages");
                    }
                    overlapped += u32::from(program.has_late_unpacks());
                    let data = prepare(&rank.device, tensors, 0);
                    let executor = NcclTransport::for_plan(&plan);
                    for _ in 0..2 {
                        executor
                            .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
                            .unwrap_or_else(|e| panic!("{name}, {mode:?}: {e}"));
                    }
                    total += data.verify(&rank.device, tensors, 0);
                    data.free(&rank.device);
                }
            }
        }
        (total, overlapped)
    });
    let total: u64 = outcome.iter().map(|o| o.0).sum();
    let overlapped: u32 = outcome.iter().map(|o| o.1).sum();
    assert!(overlapped > 0, "no plan with late unpacks");
    println!(
        "gpu: one-rank colocated layouts: {} cases x 3 modes x (local, NCCL self, NCCL self in 3 rounds) byte-exact, {total} elements checked; {overlapped} plans ran late unpacks on a side stream",
        cases.len()
    );
}

/// Runs `plan` on `rank` alone through the per-tensor call, every view in a device allocation
/// of its own that starts `shifts[v].0` (source) or `.1` (destination) bytes before the view
/// and ends exactly where the view ends, so a kernel that reads or writes a byte past a view's
/// end faults (the emulator aborts, naming the access). `src`/`dst`: the views' initial bytes
/// (destination views: the tensors', then the scale views). Returns the destination views.
fn run_exact_views(
    rank: &Rank,
    plan: &ncclreshard::exec::Plan,
    src: &[Vec<u8>],
    dst: &[Vec<u8>],
    shifts: &[(u64, u64)],
) -> Vec<Vec<u8>> {
    let shift = |v: usize, side: usize| {
        shifts
            .get(v)
            .map_or(0, |s| if side == 0 { s.0 } else { s.1 })
    };
    let upload = |bytes: &Vec<u8>, by: u64| -> (u64, u64) {
        if bytes.is_empty() {
            return (0, 0);
        }
        let mut image = vec![0x5au8; by as usize];
        image.extend_from_slice(bytes);
        let base = rank.device.upload(&image);
        (base, base + by)
    };
    let send: Vec<(u64, u64)> = src
        .iter()
        .enumerate()
        .map(|(v, b)| upload(b, shift(v, 0)))
        .collect();
    let recv: Vec<(u64, u64)> = dst
        .iter()
        .enumerate()
        .map(|(v, b)| upload(b, shift(v, 1)))
        .collect();
    let send_ptrs: Vec<usize> = send.iter().map(|p| p.1 as usize).collect();
    let recv_ptrs: Vec<usize> = recv.iter().map(|p| p.1 as usize).collect();
    NcclTransport::for_plan(plan)
        .execute(
            &CallBuffers::PerTensor {
                send: &send_ptrs,
                recv: &recv_ptrs,
            },
            rank.comm,
            rank.device.stream.cast(),
        )
        .unwrap_or_else(|e| panic!("rank {}: {e}", rank.r));
    let got = recv
        .iter()
        .zip(dst)
        .map(|(&(_, view), want)| {
            if view == 0 {
                Vec::new()
            } else {
                rank.device.download(view, want.len())
            }
        })
        .collect();
    for &(base, _) in send.iter().chain(&recv).filter(|p| p.0 != 0) {
        rank.device.free(base);
    }
    got
}

/// Copies for every path of the copy kernel, one tensor each, with the source and destination
/// view shifts (bytes) they run at: rows of every length from 1 to 600 bytes, each twice, at
/// every pair of source and destination alignments mod 16 (so every relative alignment), with
/// padded pitches on either side; the same for 2-, 4- and 8-byte elements; rows longer than a
/// tile (the kernel cuts them), a contiguous run of 300 KB, and copies of 2 and 3 dims.
fn copy_geometries() -> Vec<(TensorSpec, (u64, u64))> {
    let one = || mesh(&[1], &[0]);
    let r = Placement::Replicate;
    let spec = |shape: Vec<u64>, dtype, src: Option<Vec<u64>>, dst: Option<Vec<u64>>| {
        let mut t = TensorSpec {
            shape,
            dtype,
            src: layout(one(), &[r]),
            dst: layout(one(), &[r]),
        };
        t.src.strides = src;
        t.dst.strides = dst;
        t
    };
    let mut out = Vec::new();
    for (dtype, size, count) in [
        (DType::Int8, 1u64, 1200u64),
        (DType::Bfloat16, 2, 256),
        (DType::Float32, 4, 128),
        (DType::Float64, 8, 64),
    ] {
        let max = 600 / size;
        let places = 16 / size;
        for i in 0..count {
            // 37 is prime to every `max`: i ↦ n covers 1..=max before repeating.
            let n = 1 + (i * 37) % max;
            let shifts = ((i % places) * size, ((i / places) % places) * size);
            let src_pitch = n + i % 7;
            let dst_pitch = n + (i / 7) % 9;
            out.push((
                spec(
                    vec![3, n],
                    dtype,
                    Some(vec![src_pitch, 1]),
                    Some(vec![dst_pitch, 1]),
                ),
                shifts,
            ));
        }
    }
    out.push((
        spec(vec![3, 100_003], DType::Int8, None, Some(vec![100_010, 1])),
        (5, 11),
    ));
    out.push((spec(vec![300_001], DType::Int8, None, None), (3, 14)));
    out.push((
        spec(
            vec![2, 70_001],
            DType::Bfloat16,
            None,
            Some(vec![70_004, 1]),
        ),
        (2, 6),
    ));
    out.push((
        spec(
            vec![4, 20_000],
            DType::Float32,
            Some(vec![20_001, 1]),
            Some(vec![20_003, 1]),
        ),
        (4, 12),
    ));
    out.push((
        spec(vec![3, 9000], DType::Float64, None, Some(vec![9001, 1])),
        (8, 0),
    ));
    out.push((
        spec(
            vec![6, 5, 37],
            DType::Int8,
            None,
            Some(vec![5 * 45 + 3, 45, 1]),
        ),
        (7, 2),
    ));
    out.push((
        spec(
            vec![4, 3, 2, 33],
            DType::Bfloat16,
            Some(vec![3 * 2 * 40, 2 * 40, 40, 1]),
            None,
        ),
        (6, 10),
    ));
    out
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn copy_paths_are_byte_exact_for_every_row_length_and_alignment() {
    let cases = copy_geometries();
    let outcome = with_ranks(1, true, |rank| {
        let (mut elements, mut bytes) = (0u64, 0u64);
        for via_nccl in [false, true] {
            // Local copies, then packs into staging, NCCL self messages and unpacks.
            let config = Config {
                local_via_messages: via_nccl,
                ..Default::default()
            };
            for group in cases.chunks(400) {
                let tensors: Vec<TensorSpec> = group.iter().map(|c| c.0.clone()).collect();
                let shifts: Vec<(u64, u64)> = group.iter().map(|c| c.1).collect();
                let none = vec![None; tensors.len()];
                let plan = plan_at(&tensors, &none, 0, &config, &vec![(0, 0, 0); tensors.len()])
                    .unwrap_or_else(|e| panic!("{e}"));
                let (src, dst): (Vec<Vec<u8>>, Vec<Vec<u8>>) = tensors
                    .iter()
                    .enumerate()
                    .map(|(t, spec)| {
                        (
                            source_view_bytes(spec, t as u32, 0)
                                .unwrap()
                                .unwrap_or_default(),
                            destination_view_bytes(spec, 0).unwrap().unwrap_or_default(),
                        )
                    })
                    .unzip();
                let got = run_exact_views(rank, &plan, &src, &dst, &shifts);
                for (t, spec) in tensors.iter().enumerate() {
                    elements += verify_destination_view(spec, t as u32, 0, &got[t])
                        .unwrap_or_else(|e| panic!("{spec:?} at shifts {:?}: {e}", shifts[t]));
                    bytes += got[t].len() as u64;
                }
            }
        }
        (elements, bytes)
    });
    println!(
        "gpu: copy paths: {} copies (rows of 1-600 bytes at every alignment pair mod 16, 1/2/4/8-byte elements, rows across tiles, 2-3 dims) x (local, NCCL self) byte-exact in views that end where their allocations end: {} elements, {} bytes checked",
        cases.len(),
        outcome[0].0,
        outcome[0].1
    );
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn a_deadline_never_fires_on_a_healthy_call_and_a_revoke_frees_the_stream() {
    // The whole cycle of docs/resilience.md on two ranks: rank 1 stalls (after healthy calls it
    // matches nothing more), rank 0's NCCL receive from it blocks the stream until the revoke,
    // and rank 0 shrinks excluding rank 1 and refits on its own. On one GPU under real NCCL
    // (one rank) there is no peer to leave a receive unmatched (NCCL refuses a receive from
    // self without its send in the same group) nor a rank to exclude (NCCL refuses a shrink
    // excluding none): the revoke ends healthy work there, and the loopback pass shows the rest.
    let n = world().min(2);
    let (tensors, via_self) = all_to_all(n as u32, 256);
    let config = Config {
        mode: Mode::Auto,
        rounds: 2,
        split_min_bytes: 1024,
        local_via_messages: via_self,
        ..Default::default()
    };
    let freed = with_ranks(n, true, |rank| {
        let plan = plan_of(&tensors, rank.r, &config).unwrap();
        let guarded = NcclTransport::for_plan(&plan).with_deadline(Some(2000));
        let stream = rank.device.stream.cast();
        // Healthy calls with a deadline: byte-exact, no revoke.
        for salt in [0, 1] {
            let data = prepare_salted(&rank.device, &tensors, rank.r, salt);
            guarded
                .execute(&data.buffers(), rank.comm, stream)
                .unwrap_or_else(|e| panic!("healthy call: {e}"));
            transport::comm_wait(rank.comm).unwrap_or_else(|e| panic!("false alarm: {e}"));
            rank.device.sync();
            data.verify(&rank.device, &tensors, rank.r);
            data.free(&rank.device);
        }
        // NCCL before 2.28.7 has no revoke (the library aborts instead): nothing to shrink.
        nccl_symbol("ncclCommRevoke")?;
        // Rank 0: an operation the stalled rank never matches blocks the stream until the
        // communicator is revoked.
        let dangling = rank.device.upload(&[0u8; 64]);
        let revoked_at = if rank.r == 0 && n > 1 {
            // SAFETY: a receive into our own buffer on our communicator and stream.
            let posted =
                unsafe { (nccl().recv)(dangling as *mut c_void, 64, 0, 1, rank.comm, stream) };
            assert_eq!(posted, 0);
            // SAFETY: a query of our own stream.
            let busy = unsafe { sys::cuStreamQuery(rank.device.stream) };
            assert_eq!(
                busy,
                sys::CUresult::CUDA_ERROR_NOT_READY,
                "the receive should wait"
            );
            Some(Instant::now())
        } else {
            None
        };
        // SAFETY: our communicator.
        unsafe { transport::comm_revoke(rank.comm) }.unwrap();
        rank.device.sync();
        let freed = revoked_at.map(|at| at.elapsed());
        if let Some(freed) = freed {
            assert!(
                freed < Duration::from_secs(5),
                "the stream stayed blocked {freed:?}"
            );
        }
        let failure = transport::comm_status(rank.comm).expect_err("revoked");
        assert!(
            failure.message.contains("ncclReshardCommRevoke"),
            "{failure}"
        );
        // Nothing more is posted on it: refused before any NCCL operation.
        let data = prepare(&rank.device, &tensors, rank.r);
        let refused = guarded
            .execute(&data.buffers(), rank.comm, stream)
            .expect_err("a revoked communicator");
        assert_eq!(refused.kind, ErrorKind::InvalidUsage, "{refused}");
        assert!(refused.message.contains("was revoked"), "{refused}");
        data.free(&rank.device);
        rank.device.free(dangling);
        // A shrink excluding no rank: NCCL refuses it, the library first.
        // SAFETY: our communicator.
        let empty = unsafe { transport::comm_shrink(rank.comm, &[], std::ptr::null_mut(), true) }
            .expect_err("a shrink excluding no rank");
        assert_eq!(empty.kind, ErrorKind::InvalidArgument, "{empty}");
        assert!(empty.message.contains("excludeRanksCount is 0"), "{empty}");
        if rank.r != 0 || n == 1 {
            return Some(freed);
        }
        // The survivor shrinks excluding the stalled rank and refits alone on the new
        // communicator, byte-exact.
        // SAFETY: our communicator, shrunk by every (the one) survivor.
        let shrunk = unsafe { transport::comm_shrink(rank.comm, &[1], std::ptr::null_mut(), true) }
            .unwrap_or_else(|e| panic!("shrink: {e}"));
        let (alone, _) = all_to_all(1, 256);
        let config = Config {
            local_via_messages: true,
            ..config.clone()
        };
        let plan = plan_of(&alone, 0, &config).unwrap();
        let executor = NcclTransport::for_plan(&plan).with_deadline(Some(2000));
        let data = prepare(&rank.device, &alone, 0);
        executor
            .execute(&data.buffers(), shrunk, stream)
            .unwrap_or_else(|e| panic!("after the shrink: {e}"));
        transport::comm_wait(shrunk).unwrap_or_else(|e| panic!("after the shrink: {e}"));
        rank.device.sync();
        data.verify(&rank.device, &alone, 0);
        data.free(&rank.device);
        // SAFETY: the new communicator, destroyed once (the harness destroys the old one).
        unsafe {
            let destroyed = (nccl().destroy)(shrunk);
            settle(shrunk, destroyed, "ncclCommDestroy");
        }
        Some(freed)
    });
    match freed[0] {
        None => println!(
            "gpu: deadline, {n} rank(s): healthy calls byte-exact with no revoke; revoke and shrink skipped: this NCCL has no ncclCommRevoke (2.28.7 or newer)"
        ),
        Some(Some(freed)) => println!(
            "gpu: deadline, {n} ranks: healthy calls byte-exact with no revoke; an NCCL receive the stalled rank never matches ended by ncclCommRevoke, the stream free after {} ms; the revoked communicators refused, a shrink excluding no rank refused, the survivor's shrink byte-exact",
            freed.as_millis()
        ),
        Some(None) => println!(
            "gpu: deadline, 1 rank: healthy calls byte-exact with no revoke; the revoked communicator refused, a shrink excluding no rank refused (a stalled peer and a shrink excluding it need 2 ranks: the loopback pass)"
        ),
    }
}

#[test]
#[ignore = "needs a GPU"]
fn deadline_overhead_on_healthy_calls() {
    // What a deadline costs a call that completes (docs/resilience.md): the same plan called
    // with and without one, alternately, every rank's call synchronized and the ranks lined up
    // before and after each; medians of the wall time per call. On several devices a refit
    // (half the ranks TP-shard rows, the other half columns), on one the rank's data through
    // NCCL self messages. A measurement, not a speed test: it asserts only that calls succeed.
    let n = world();
    let (tensors, what) = if n >= 2 {
        let half = (n / 2) as u32;
        let train: Vec<u32> = (0..half).collect();
        let infer: Vec<u32> = (half..n as u32).collect();
        let spec = TensorSpec {
            shape: vec![4096, 256],
            dtype: DType::Float32,
            src: layout(mesh(&[half as u64], &train), &[Placement::Shard(0)]),
            dst: layout(mesh(&[infer.len() as u64], &infer), &[Placement::Shard(1)]),
        };
        (vec![spec], format!("a {n}-rank refit of 4 MiB"))
    } else {
        (
            all_to_all(1, 65536).0,
            "2 MiB through NCCL self messages".to_string(),
        )
    };
    let config = Config {
        mode: Mode::Auto,
        rounds: 2,
        local_via_messages: n == 1,
        ..Default::default()
    };
    let lined_up = std::sync::Barrier::new(n);
    let times = with_ranks(n, true, |rank| {
        let plan = plan_of(&tensors, rank.r, &config).unwrap();
        let calls = [
            NcclTransport::for_plan(&plan).with_deadline(Some(0)),
            NcclTransport::for_plan(&plan).with_deadline(Some(60_000)),
        ];
        let stream = rank.device.stream.cast();
        let data = prepare(&rank.device, &tensors, rank.r);
        let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        for i in 0..41 {
            for (k, call) in calls.iter().enumerate() {
                lined_up.wait();
                let started = Instant::now();
                call.execute(&data.buffers(), rank.comm, stream).unwrap();
                rank.device.sync();
                transport::comm_wait(rank.comm).unwrap();
                lined_up.wait();
                if i > 0 {
                    times[k].push(started.elapsed());
                }
            }
        }
        data.verify(&rank.device, &tensors, rank.r);
        data.free(&rank.device);
        times
    });
    let [without, with] = times[0].clone().map(|mut t| {
        t.sort();
        t[t.len() / 2]
    });
    let extra = with.as_secs_f64() - without.as_secs_f64();
    println!(
        "gpu: deadline overhead: {:.1} us per call ({:+.1}%): median {:.1} us without a deadline, {:.1} us with one ({what}, 2 rounds, 40 calls each)",
        extra * 1e6,
        100.0 * extra / without.as_secs_f64(),
        without.as_secs_f64() * 1e6,
        with.as_secs_f64() * 1e6,
    );
}

#[test]
#[ignore = "needs a GPU"]
fn a_dead_rank_is_replaced_through_shrink_and_grow() {
    // The whole cycle of docs/resilience.md on 8 ranks: inference rank 7 dies before a call
    // (it never makes it); the survivors' calls end by their deadline; the survivors shrink
    // the communicator, plan for themselves and refit byte-exact; then a replacement joins
    // through ncclCommGrow as rank 7 and the full plan runs byte-exact on the grown communicator.
    let n = world();
    if n < 8 {
        println!("gpu: shrink and grow skipped: {n} device(s), 8 needed");
        return;
    }
    const DEAD: u32 = 7;
    const DEADLINE_MS: u64 = 2000;
    let trainers = || mesh(&[2, 2], &[0, 1, 2, 3]);
    let inference = || mesh(&[4], &[4, 5, 6, 7]);
    let tensors = vec![
        TensorSpec {
            shape: vec![64, 32],
            dtype: DType::Float32,
            src: layout(trainers(), &[Placement::Replicate, Placement::Shard(0)]),
            dst: layout(inference(), &[Placement::Shard(1)]),
        },
        TensorSpec {
            shape: vec![48, 40],
            dtype: DType::Bfloat16,
            src: layout(trainers(), &[Placement::Replicate, Placement::Shard(1)]),
            dst: layout(inference(), &[Placement::Shard(0)]),
        },
    ];
    let config = Config {
        mode: Mode::Auto,
        topology: Topology::RanksPerNode(4),
        rounds: 2,
        ..Default::default()
    };
    let id = unique_id();
    let stopped = std::sync::Barrier::new(n);
    let recovered = std::sync::Barrier::new(n);
    let offered = std::sync::Barrier::new(n);
    let grow_id = std::sync::Mutex::new([0u8; 128]);
    let outcomes: Vec<(u32, u64, Duration)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n as u32)
            .map(|r| {
                let (tensors, config, stopped, recovered, offered, grow_id) =
                    (&tensors, &config, &stopped, &recovered, &offered, &grow_id);
                scope.spawn(move || {
                    let device = Device::new(r as usize);
                    let stream = device.stream.cast();
                    let comm = join(id, n, r as usize, true);
                    let mut ended = Duration::ZERO;
                    // A warm-up call without a deadline: each rank loads the copy kernel on its
                    // first call, and on the emulator they arrive seconds apart (a deadline
                    // counts waiting for peers), then a healthy step with the deadline.
                    let plan = plan_of(tensors, r, config).unwrap();
                    let data = prepare(&device, tensors, r);
                    NcclTransport::for_plan(&plan)
                        .execute(&data.buffers(), comm, stream)
                        .unwrap_or_else(|e| panic!("rank {r}: warm-up call: {e}"));
                    stopped.wait();
                    NcclTransport::for_plan(&plan)
                        .with_deadline(Some(DEADLINE_MS))
                        .execute(&data.buffers(), comm, stream)
                        .and_then(|()| transport::comm_wait(comm))
                        .unwrap_or_else(|e| panic!("rank {r}: healthy call: {e}"));
                    device.sync();
                    let mut checked = data.verify(&device, tensors, r);
                    data.free(&device);
                    stopped.wait();
                    // The step rank 7 does not live to call.
                    let survivor = r != DEAD;
                    let shrunk = if survivor {
                        let data = prepare_salted(&device, tensors, r, 3);
                        let started = Instant::now();
                        let outcome = NcclTransport::for_plan(&plan)
                            .with_deadline(Some(DEADLINE_MS))
                            .execute(&data.buffers(), comm, stream)
                            .and_then(|()| transport::comm_wait(comm));
                        device.sync();
                        ended = started.elapsed();
                        if let Err(e) = &outcome {
                            assert_eq!(e.kind, ErrorKind::Nccl(6), "rank {r}: {e}");
                        }
                        data.free(&device);
                        stopped.wait();
                        // Every survivor knows rank 7 is gone (the application's part): shrink,
                        // the survivors' plan (rank r keeps its number: 7 was the last), refit.
                        // SAFETY: our communicator, shrunk by every survivor with one list.
                        let shrunk = unsafe {
                            transport::comm_shrink(comm, &[DEAD as i32], std::ptr::null_mut(), true)
                        }
                        .unwrap_or_else(|e| panic!("rank {r}: shrink: {e}"));
                        let plan = survivors_plan(tensors, config, &[DEAD], r).unwrap();
                        let (specs, _, _) =
                            ncclreshard::plan::survivors(tensors, &[None, None], config, &[DEAD])
                                .unwrap();
                        let data = prepare_salted(&device, &specs, r, 1);
                        NcclTransport::for_plan(&plan)
                            .with_deadline(Some(DEADLINE_MS))
                            .execute(&data.buffers(), shrunk, stream)
                            .and_then(|()| transport::comm_wait(shrunk))
                            .unwrap_or_else(|e| panic!("rank {r}: survivors' call: {e}"));
                        device.sync();
                        checked += data.verify(&device, &specs, r);
                        data.free(&device);
                        // SAFETY: the parent, shrunk away.
                        unsafe { (nccl().destroy)(comm) };
                        Some(shrunk)
                    } else {
                        stopped.wait();
                        None
                    };
                    recovered.wait();
                    // The replacement joins at the end: rank 7 of the grown communicator.
                    if r == 0 {
                        // SAFETY: our communicator.
                        *grow_id.lock().unwrap() =
                            unsafe { transport::comm_get_unique_id(shrunk.unwrap()) }.unwrap();
                    }
                    offered.wait();
                    let gid = *grow_id.lock().unwrap();
                    // SAFETY: every rank of the shrunk communicator and the new one call it.
                    let grown = unsafe {
                        match shrunk {
                            Some(parent) => transport::comm_grow(
                                parent,
                                8,
                                (r == 0).then_some(&gid),
                                -1,
                                std::ptr::null_mut(),
                            ),
                            None => {
                                // The dead process's state is gone; a new one takes its place.
                                (nccl().abort)(comm);
                                transport::comm_grow(
                                    std::ptr::null_mut(),
                                    8,
                                    Some(&gid),
                                    DEAD as i32,
                                    std::ptr::null_mut(),
                                )
                            }
                        }
                    }
                    .unwrap_or_else(|e| panic!("rank {r}: grow: {e}"));
                    let plan = plan_of(tensors, r, config).unwrap();
                    let data = prepare_salted(&device, tensors, r, 2);
                    NcclTransport::for_plan(&plan)
                        .with_deadline(Some(DEADLINE_MS))
                        .execute(&data.buffers(), grown, stream)
                        .and_then(|()| transport::comm_wait(grown))
                        .unwrap_or_else(|e| panic!("rank {r}: after the grow: {e}"));
                    device.sync();
                    checked += data.verify(&device, tensors, r);
                    data.free(&device);
                    // SAFETY: communicators of ours, not used again.
                    unsafe {
                        let destroyed = (nccl().destroy)(grown);
                        settle(grown, destroyed, "ncclCommDestroy (grown)");
                        if let Some(parent) = shrunk {
                            (nccl().destroy)(parent);
                        }
                    }
                    (r, checked, ended)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    free_deferred();
    let worst = outcomes.iter().map(|o| o.2).max().unwrap_or_default();
    assert!(
        worst < Duration::from_millis(DEADLINE_MS + 1500),
        "a survivor's call took {worst:?}"
    );
    let checked: u64 = outcomes.iter().map(|o| o.1).sum();
    println!(
        "gpu: 8 ranks, inference rank 7 dead: every survivor's call ended within {} ms (deadline {DEADLINE_MS} ms); shrink + survivors' plan byte-exact, then a replacement grown in as rank 7 byte-exact ({checked} elements)",
        worst.as_millis()
    );
}

/// Multi-rank cases over `n` ranks (mesh [n] on ranks 0..n unless said otherwise).
fn multi_rank_cases(n: u32) -> Vec<(&'static str, Vec<TensorSpec>, Config)> {
    let ranks: Vec<u32> = (0..n).collect();
    let all = || mesh(&[n as u64], &ranks);
    let reversed = || {
        mesh(
            &[n as u64],
            &ranks.iter().rev().copied().collect::<Vec<_>>(),
        )
    };
    let column_to_row = TensorSpec {
        shape: vec![1003, 517],
        dtype: DType::Bfloat16,
        src: layout(all(), &[Placement::Shard(0)]),
        dst: layout(all(), &[Placement::Shard(1)]),
    };
    let gather = |rows: u64| TensorSpec {
        shape: vec![rows, 64],
        dtype: DType::Float32,
        src: layout(all(), &[Placement::Shard(1)]),
        dst: layout(all(), &[Placement::Replicate]),
    };
    let padded = {
        // Row-parallel into the padded rows of a fused destination buffer, on ranks in
        // reverse order (part of each rank's data is its own: a local copy).
        let mut t = TensorSpec {
            shape: vec![96, 200],
            dtype: DType::Float16,
            src: layout(all(), &[Placement::Shard(1)]),
            dst: layout(reversed(), &[Placement::Shard(1)]),
        };
        t.dst.strides = Some(vec![256, 1]);
        t
    };
    let uneven = TensorSpec {
        // 5 rows over n ranks: trailing shards empty.
        shape: vec![5, 7, 3],
        dtype: DType::Int8,
        src: layout(all(), &[Placement::Shard(0)]),
        dst: layout(reversed(), &[Placement::Shard(2)]),
    };
    let mut cases = Vec::new();
    for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
        cases.push((
            "column → row parallel, all-gather, padded colocated, uneven",
            vec![
                column_to_row.clone(),
                gather(if mode == Mode::Groupable { 96 } else { 4096 }),
                padded.clone(),
                uneven.clone(),
            ],
            config(mode),
        ));
    }
    cases.push((
        "three rounds (auto)",
        vec![column_to_row.clone(), gather(4096)],
        Config {
            mode: Mode::Auto,
            rounds: 3,
            split_min_bytes: 4096,
            ..Default::default()
        },
    ));
    if n >= 8 {
        // TP2 → TP2 × DP4 with 4 ranks per node: node 1 holds two replicas of each
        // destination shard, so each part crosses the network once and is forwarded (relay).
        // Then column shards into row shards: what a relay forwards is strided on both ends,
        // so its node-mates receive it into staging and nothing later reads what they unpack
        // (late unpacks, run on a side stream beside the next round): the forwarders send what
        // they forward from the arena it arrived in, beside those unpacks.
        for (name, shape, src, rounds) in [
            ("relayed TP2 → TP2×DP4", [4096, 512], Placement::Shard(0), 2),
            (
                "relayed with late unpacks TP2 (columns) → TP2×DP4 (rows)",
                [2048, 768],
                Placement::Shard(1),
                4,
            ),
        ] {
            cases.push((
                name,
                vec![TensorSpec {
                    shape: shape.to_vec(),
                    dtype: DType::Bfloat16,
                    src: layout(mesh(&[2], &[0, 1]), &[src]),
                    dst: layout(
                        mesh(&[4, 2], &(0..8).collect::<Vec<_>>()),
                        &[Placement::Replicate, Placement::Shard(0)],
                    ),
                }],
                Config {
                    mode: Mode::Auto,
                    topology: Topology::RanksPerNode(4),
                    rounds,
                    split_min_bytes: 4096,
                    ..Default::default()
                },
            ));
        }
        // Trainers on node 0 → TP2 × DP2 inference on node 1: the trainers only send, and
        // pass the senders' barrier before each of the rounds after the first. Rank 3's only
        // shard is empty (3 rows over 4): it has nothing to send and still passes it.
        let to_inference = || {
            layout(
                mesh(&[2, 2], &[4, 5, 6, 7]),
                &[Placement::Replicate, Placement::Shard(0)],
            )
        };
        cases.push((
            "senders' barrier TP3 → TP2×DP2, a trainer with nothing to send",
            vec![
                TensorSpec {
                    shape: vec![1024, 384],
                    dtype: DType::Bfloat16,
                    src: layout(mesh(&[3], &[0, 1, 2]), &[Placement::Shard(1)]),
                    dst: to_inference(),
                },
                TensorSpec {
                    shape: vec![3, 64],
                    dtype: DType::Float32,
                    src: layout(mesh(&[4], &[0, 1, 2, 3]), &[Placement::Shard(0)]),
                    dst: to_inference(),
                },
            ],
            Config {
                mode: Mode::Auto,
                topology: Topology::RanksPerNode(4),
                rounds: 3,
                split_min_bytes: 4096,
                sender_barrier: Some(true),
                ..Default::default()
            },
        ));
    }
    cases
}

/// Runs `plan` on `rank` as callers do: `ncclReshard` twice (the second call reuses
/// everything), then `ncclReshardMulti` on fresh buffers; checks every destination element after
/// each and returns how many.
fn single_twice_then_per_tensor(
    rank: &Rank,
    tensors: &[TensorSpec],
    plan: &Plan,
    name: &str,
) -> u64 {
    let executor = NcclTransport::for_plan(plan);
    let data = prepare(&rank.device, tensors, rank.r);
    for _ in 0..2 {
        executor
            .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
            .unwrap_or_else(|e| panic!("{name}, rank {}: {e}", rank.r));
    }
    let mut checked = data.verify(&rank.device, tensors, rank.r);
    let fresh = prepare(&rank.device, tensors, rank.r);
    let (send, recv) = fresh.pointers();
    let send: Vec<usize> = send
        .iter()
        .zip(tensors)
        .map(|(&p, t)| {
            if t.src.mesh.ranks().contains(&rank.r) {
                p
            } else {
                0
            }
        })
        .collect();
    executor
        .execute(
            &CallBuffers::PerTensor {
                send: &send,
                recv: &recv,
            },
            rank.comm,
            rank.device.stream.cast(),
        )
        .unwrap_or_else(|e| panic!("{name} (per-tensor), rank {}: {e}", rank.r));
    checked += fresh.verify(&rank.device, tensors, rank.r);
    data.free(&rank.device);
    fresh.free(&rank.device);
    checked
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn multi_rank_reshards_are_byte_exact_in_every_mode() {
    let n = world();
    if n < 2 {
        println!("gpu: multi-rank reshards skipped: {n} device(s)");
        return;
    }
    for (name, tensors, config) in multi_rank_cases(n as u32) {
        let outcome = with_ranks(n, true, |rank| {
            let plan = plan_of(&tensors, rank.r, &config).unwrap();
            let program = plan.program();
            // A relay's forwarder sends from its destination view, or packs from it, or (where
            // its data arrived in a late-unpack arena) packs or sends it from the arena.
            let from_arena = program.rounds().iter().any(|round| {
                round.packs.iter().any(|c| c.src.buffer == Buffer::Staging)
                    || round.sends.iter().any(|m| {
                        m.loc.buffer == Buffer::Staging
                            && !round.packs.iter().any(|c| {
                                c.dst.buffer == Buffer::Staging
                                    && c.dst.offset <= m.loc.offset
                                    && m.loc.offset < c.dst.offset + c.bytes()
                            })
                    })
            });
            let forwards = program.sends.iter().any(|m| m.loc.buffer == Buffer::Dst)
                || program.packs.iter().any(|c| c.src.buffer == Buffer::Dst)
                || from_arena;
            let late = program.has_late_unpacks();
            let beside = program.local_copies_beside();
            let barrier = program.has_barrier();
            if name.starts_with("senders' barrier") && rank.r == 3 {
                assert!(program.sends.is_empty() && barrier && !program.is_empty());
            }
            let checked = single_twice_then_per_tensor(rank, &tensors, &plan, name);
            (checked, forwards, late, from_arena, beside, barrier)
        });
        let checked: u64 = outcome.iter().map(|o| o.0).sum();
        let beside = outcome.iter().filter(|o| o.4).count();
        if name.contains("colocated") && config.mode != Mode::Groupable {
            assert!(
                beside > 0,
                "{name}: no rank copies locally beside its first round"
            );
        }
        if name.starts_with("senders' barrier") {
            let passing: Vec<bool> = outcome.iter().map(|o| o.5).collect();
            assert_eq!(
                passing,
                (0..n).map(|r| r < 4).collect::<Vec<_>>(),
                "{name}: the trainers, and only they, pass the barrier"
            );
        }
        if name.starts_with("relayed") {
            assert!(outcome.iter().any(|o| o.1), "{name}: no rank forwards");
        }
        if name.contains("late unpacks") {
            assert!(
                outcome.iter().any(|o| o.2),
                "{name}: no rank has late unpacks"
            );
            assert!(
                outcome.iter().any(|o| o.3),
                "{name}: no rank forwards from the arena its data arrived in"
            );
        }
        println!(
            "gpu: {n} ranks, {name} ({:?}, {} round(s)): byte-exact, {checked} elements ({beside} rank(s) copy locally beside the first round)",
            config.mode, config.rounds
        );
    }
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn receives_land_in_place_where_views_sit_back_to_back() {
    let n = world();
    if n < 4 {
        println!("gpu: receiving in place skipped: {n} device(s)");
        return;
    }
    // 8 tensors [16, cols] f32, 0..4 whole on rank 0 and 4..8 on rank 1, split by columns
    // over ranks 2 and 3: each sender's message to a receiver is its four column halves,
    // packed. With 64 columns a receiver's views are 2 KiB, so `prepare` (views at 256-byte
    // offsets) puts them back to back and the messages land in place; with 66 they are
    // 2112 bytes, 192 bytes apart, and they must not.
    use ncclreshard::{Layout, Mesh};
    for cols in [64u64, 66] {
        let tensors: Vec<TensorSpec> = (0..8u32)
            .map(|k| TensorSpec {
                shape: vec![16, cols],
                dtype: DType::Float32,
                src: Layout::new(
                    Mesh::new(vec![1], vec![k / 4]).unwrap(),
                    vec![Placement::Replicate],
                ),
                dst: Layout::new(
                    Mesh::new(vec![2], vec![2, 3]).unwrap(),
                    vec![Placement::Shard(1)],
                ),
            })
            .collect();
        for (mode, rounds) in [(Mode::Staged, 0), (Mode::Auto, 3)] {
            let config = Config {
                mode,
                rounds,
                ..Default::default()
            };
            let outcome = with_ranks(n, true, |rank| {
                let plan = plan_of(&tensors, rank.r, &config).unwrap();
                // Single-buffer calls run the placed program; per-tensor calls the plan's own.
                let program = plan.placed().unwrap_or(plan.program());
                let in_place = program
                    .recvs
                    .iter()
                    .filter(|m| m.loc.buffer == Buffer::Dst)
                    .count();
                // ncclReshardMulti runs the plan's own program (its views could sit anywhere).
                let checked = single_twice_then_per_tensor(rank, &tensors, &plan, "in place");
                (checked, in_place, program.unpacks.len())
            });
            let checked: u64 = outcome.iter().map(|o| o.0).sum();
            let landed: usize = outcome.iter().map(|o| o.1).sum();
            let unpacks: usize = outcome.iter().map(|o| o.2).sum();
            if cols == 64 {
                assert!(landed >= 4, "{mode:?}: {landed} receives landed in place");
                assert_eq!(unpacks, 0, "{mode:?}: unpacks left");
            } else {
                assert_eq!(landed, 0, "{mode:?}: receives landed across gaps");
            }
            println!(
                "gpu: {n} ranks, receiving in place, views {} ({mode:?}, {} round(s)): byte-exact, {checked} elements ({landed} receives in place, {unpacks} unpacks)",
                if cols == 64 { "back to back" } else { "192 bytes apart" },
                if rounds == 0 { 1 } else { rounds }
            );
        }
    }
}

/// A named plan of tensors and their conversions.
type QuantizedCase = (
    &'static str,
    Vec<TensorSpec>,
    Vec<Option<Conversion>>,
    Config,
);

/// Conversions on the way (docs/quantization.md) over ranks `0..n` (n ≥ 4): FP8 blocks its
/// senders convert (also in 4 rounds, later rounds' blocks converted on the side stream beside
/// the round before), FP8 E5M2 blocks with E8M0 inverted scales its receivers convert, and a
/// plan mixing a cast, a per-channel quantization and a plain tensor.
fn quantized_cases(n: u32) -> Vec<QuantizedCase> {
    let half = n / 2;
    let lower: Vec<u32> = (0..half).collect();
    let upper: Vec<u32> = (half..n).collect();
    let m = |ranks: &[u32]| mesh(&[ranks.len() as u64], ranks);
    let block = |dtype, rows, cols| Conversion::quantize(dtype, Scheme::Block { rows, cols });
    let senders = TensorSpec {
        shape: vec![256, 192],
        dtype: DType::Bfloat16,
        src: layout(m(&lower), &[Placement::Shard(0)]),
        dst: layout(m(&upper), &[Placement::Shard(1)]),
    };
    // 96 rows cut into `half` shards; 40-row blocks straddle some cuts, so those travel as
    // float32 and the receivers (all rows, 32 columns each) convert them.
    let receivers = TensorSpec {
        shape: vec![96, 32 * u64::from(n - half)],
        dtype: DType::Float32,
        src: layout(m(&lower), &[Placement::Shard(0)]),
        dst: layout(m(&upper), &[Placement::Shard(1)]),
    };
    let mx = Conversion {
        scale_format: ScaleFormat::E8m0,
        scale_inverse: true,
        ..block(DType::Float8E5M2, 40, 32)
    };
    let in_rounds = TensorSpec {
        shape: vec![1024, 512],
        ..senders.clone()
    };
    let rounds = Config {
        rounds: 4,
        split_min_bytes: 4096,
        ..config(Mode::Auto)
    };
    let everyone: Vec<u32> = (0..n).collect();
    let mixed = vec![
        TensorSpec {
            shape: vec![64, 48],
            dtype: DType::Float32,
            src: layout(m(&lower), &[Placement::Shard(1)]),
            dst: layout(m(&everyone), &[Placement::Shard(0)]),
        },
        TensorSpec {
            shape: vec![40, 64],
            dtype: DType::Float16,
            src: layout(m(&upper), &[Placement::Shard(0)]),
            dst: layout(m(&lower), &[Placement::Replicate]),
        },
        TensorSpec {
            shape: vec![33],
            dtype: DType::Bfloat16,
            src: layout(m(&lower), &[Placement::Replicate]),
            dst: layout(m(&upper), &[Placement::Shard(0)]),
        },
    ];
    vec![
        (
            "bf16 → fp8 64x64 blocks, senders convert",
            vec![senders],
            vec![Some(block(DType::Float8E4M3, 64, 64))],
            config(Mode::Auto),
        ),
        (
            "bf16 → fp8 64x64 blocks in 4 rounds, later rounds' converted beside the round before",
            vec![in_rounds],
            vec![Some(block(DType::Float8E4M3, 64, 64))],
            rounds,
        ),
        (
            "f32 → fp8 e5m2 blocks, receivers convert",
            vec![receivers],
            vec![Some(mx)],
            config(Mode::Auto),
        ),
        (
            "cast, per-channel and plain in one plan",
            mixed,
            vec![
                Some(Conversion::cast(DType::Bfloat16)),
                Some(Conversion::quantize(DType::Float8E4M3, Scheme::PerChannel)),
                None,
            ],
            config(Mode::Auto),
        ),
        (
            "a 0-d tensor quantized per tensor (its box: one dim of one element)",
            vec![TensorSpec {
                shape: vec![],
                dtype: DType::Float32,
                src: layout(m(&upper), &[Placement::Replicate]),
                dst: layout(m(&lower), &[Placement::Replicate]),
            }],
            vec![Some(Conversion::quantize(
                DType::Float8E4M3,
                Scheme::PerTensor,
            ))],
            config(Mode::Auto),
        ),
    ]
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn quantized_plans_match_the_host_executor() {
    let n = world();
    if n < 4 {
        println!("gpu: quantized plans skipped: {n} device(s)");
        return;
    }
    for (name, tensors, conversions, config) in quantized_cases(n as u32) {
        let planner =
            Planner::with_conversions(tensors.clone(), conversions.clone(), config.clone())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        // The host executor is the specification; its result is checked against the reference
        // quantizer by tests/quant_e2e.rs and here once more.
        check_with_conversions(&tensors, &conversions, &config)
            .unwrap_or_else(|e| panic!("{name}: host: {e}"));
        let ranks = planner.ranks();
        let programs: Vec<RankProgram> = ranks
            .iter()
            .map(|&r| planner.rank_program(r).unwrap())
            .collect();
        // Conversions of a rank's rounds after its first (run beside the round before).
        let beside: usize = programs
            .iter()
            .flat_map(|p| p.rounds().into_iter().skip(1).map(|r| r.converts.len()))
            .sum();
        if config.rounds > 1 {
            assert!(beside > 0, "{name}: no conversion runs beside a round");
        }
        let mut host: Vec<RankBuffers> = ranks
            .iter()
            .map(|&r| rank_buffers(&tensors, Some(&conversions), r).unwrap())
            .collect();
        execute(&programs, &mut host).unwrap_or_else(|e| panic!("{name}: host: {e}"));

        let device_views = with_ranks(n, true, |rank| {
            let plan_with = |offsets: &[(u64, u64, u64)]| {
                plan_at(&tensors, &conversions, rank.r, &config, offsets)
                    .unwrap_or_else(|e| panic!("{name}, rank {}: {e}", rank.r))
            };
            let memory = rank_buffers(&tensors, Some(&conversions), rank.r).unwrap();
            let upload = |v: &Vec<u8>| {
                if v.is_empty() {
                    0
                } else {
                    rank.device.upload(v)
                }
            };
            let send: Vec<u64> = memory.src.iter().map(upload).collect();
            let recv: Vec<u64> = memory.dst.iter().map(upload).collect();
            let as_usize = |v: &[u64]| v.iter().map(|&p| p as usize).collect::<Vec<_>>();
            let (send_ptrs, recv_ptrs) = (as_usize(&send), as_usize(&recv));
            let executor = NcclTransport::for_plan(&plan_with(&vec![(0, 0, 0); tensors.len()]));
            executor
                .execute(
                    &CallBuffers::PerTensor {
                        send: &send_ptrs,
                        recv: &recv_ptrs,
                    },
                    rank.comm,
                    rank.device.stream.cast(),
                )
                .unwrap_or_else(|e| panic!("{name}, rank {}: {e}", rank.r));
            let views: Vec<Vec<u8>> = recv
                .iter()
                .zip(&memory.dst)
                .map(|(&p, v)| {
                    if p == 0 {
                        Vec::new()
                    } else {
                        rank.device.download(p, v.len())
                    }
                })
                .collect();
            for p in send.into_iter().chain(recv).filter(|&p| p != 0) {
                rank.device.free(p);
            }
            // The single-buffer call (`ncclReshard`): every view, scale views included, at
            // 256-byte aligned offsets of one send and one receive buffer.
            let pack = |views: &[Vec<u8>]| -> (Vec<u8>, Vec<u64>) {
                let mut buffer = Vec::new();
                let mut offsets = Vec::new();
                for v in views {
                    buffer.resize(align(buffer.len() as u64) as usize, 0);
                    offsets.push(buffer.len() as u64);
                    buffer.extend_from_slice(v);
                }
                (buffer, offsets)
            };
            let (send_image, src_offsets) = pack(&memory.src);
            let (recv_image, dst_offsets) = pack(&memory.dst);
            let (send, recv) = (
                rank.device.upload(&send_image),
                rank.device.upload(&recv_image),
            );
            // The k-th scale view (after the tensors' views) is that of the k-th quantized tensor.
            let mut scale_offsets = vec![0; tensors.len()];
            for (k, (t, ..)) in planner.scale_tensors().into_iter().enumerate() {
                scale_offsets[t as usize] = dst_offsets[tensors.len() + k];
            }
            let offsets: Vec<(u64, u64, u64)> = (0..tensors.len())
                .map(|t| (src_offsets[t], dst_offsets[t], scale_offsets[t]))
                .collect();
            let executor = NcclTransport::for_plan(&plan_with(&offsets));
            executor
                .execute(
                    &CallBuffers::Single {
                        send: send as usize,
                        recv: recv as usize,
                    },
                    rank.comm,
                    rank.device.stream.cast(),
                )
                .unwrap_or_else(|e| panic!("{name} (single buffer), rank {}: {e}", rank.r));
            let got = rank.device.download(recv, recv_image.len());
            for (v, (&o, want)) in dst_offsets.iter().zip(&views).enumerate() {
                let o = o as usize;
                assert!(
                    got[o..o + want.len()] == want[..],
                    "{name} (single buffer), rank {}, view {v}: differs from the per-tensor call",
                    rank.r
                );
            }
            rank.device.free(send);
            rank.device.free(recv);
            views
        });
        let mut bytes = 0;
        for (i, &r) in ranks.iter().enumerate() {
            for (v, (got, want)) in device_views[r as usize]
                .iter()
                .zip(&host[i].dst)
                .enumerate()
            {
                assert!(
                    got == want,
                    "{name}: rank {r}, destination view {v}: the kernel's bytes differ from the host executor's"
                );
                bytes += got.len();
            }
        }
        println!(
            "gpu: {n} ranks, {name}: kernel conversions equal the host executor's, {bytes} bytes ({beside} conversions beside a round)"
        );
    }
}

/// Runs `tensors` converted by `conversions` on `rank` alone (the per-tensor call, every view
/// in an allocation of its own that ends where the view ends) and on the host executor, both
/// from the checker's source values or from `sources` (per tensor), and checks that every
/// destination and scale byte is the host's. Returns the bytes compared.
fn conversions_match_the_host(
    rank: &Rank,
    name: &str,
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    config: &Config,
    sources: &[Option<Vec<u8>>],
) -> usize {
    let planner = Planner::with_conversions(tensors.to_vec(), conversions.to_vec(), config.clone())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut memory = rank_buffers(tensors, Some(conversions), 0).unwrap();
    for (t, bytes) in sources.iter().enumerate() {
        if let Some(bytes) = bytes {
            assert_eq!(bytes.len(), memory.src[t].len(), "{name}: source view {t}");
            memory.src[t] = bytes.clone();
        }
    }
    let (src, initial) = (memory.src.clone(), memory.dst.clone());
    let mut host = vec![memory];
    execute(&[planner.rank_program(0).unwrap()], &mut host)
        .unwrap_or_else(|e| panic!("{name}: host: {e}"));
    let plan = plan_at(
        tensors,
        conversions,
        0,
        config,
        &vec![(0, 0, 0); tensors.len()],
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = run_exact_views(rank, &plan, &src, &initial, &[]);
    let mut bytes = 0;
    for (v, (got, want)) in got.iter().zip(&host[0].dst).enumerate() {
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            panic!(
                "{name}: destination view {v}, byte {i}: the kernel wrote {:#04x}, the host executor {:#04x}",
                got[i], want[i]
            );
        }
        bytes += got.len();
    }
    bytes
}

/// Every 16-bit pattern once, little-endian, as a [256, 256] tensor's bytes.
fn all_16_bit_patterns() -> Vec<u8> {
    (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect()
}

/// FP32 values where conversions to bfloat16, float16 and both FP8 formats change their
/// result: every midpoint between neighbouring codes of each format and the FP32 values just
/// below and above it, each format's largest finite value and where it overflows or
/// saturates, FP32 subnormals and extremes, signed zeros, infinities and NaNs; as bytes.
fn boundary_f32_values() -> Vec<u8> {
    use ncclreshard::quant::float::{e4m3fn_to_f32, e5m2_to_f32, f16_to_f32};
    let mut values: Vec<u32> = Vec::new();
    let mut around = |x: f32| {
        let b = x.to_bits();
        values.extend([b.wrapping_sub(1), b, b.wrapping_add(1)]);
        values.extend([
            (-x).to_bits().wrapping_sub(1),
            (-x).to_bits(),
            (-x).to_bits().wrapping_add(1),
        ]);
    };
    // bfloat16 midpoints are FP32 values with the low half 0x8000.
    for code in 0..0x7f80u32 {
        around(f32::from_bits(code << 16 | 0x8000));
    }
    for code in 0..0x7c00u16 {
        around((f16_to_f32(code) + f16_to_f32(code + 1)) / 2.0);
    }
    for code in 0..0x7eu8 {
        around((e4m3fn_to_f32(code) + e4m3fn_to_f32(code + 1)) / 2.0);
    }
    for code in 0..0x7bu8 {
        around((e5m2_to_f32(code) + e5m2_to_f32(code + 1)) / 2.0);
    }
    for x in [
        448.0,
        464.0,
        480.0,
        57344.0,
        61440.0,
        65504.0,
        65520.0,
        3.3895314e38,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
        1e-40,
        1.0,
    ] {
        around(x);
    }
    values.extend([
        0.0f32.to_bits(),
        (-0.0f32).to_bits(),
        f32::INFINITY.to_bits(),
    ]);
    values.extend([
        f32::NEG_INFINITY.to_bits(),
        0x7fc0_0000,
        0xffc0_0001,
        0x7f80_0001,
    ]);
    // A whole number of 256-element rows.
    while values.len() % 256 != 0 {
        values.push(0x3f80_0000);
    }
    values.iter().flat_map(|b| b.to_le_bytes()).collect()
}

/// A one-rank tensor of `shape` and `dtype`, both views dense.
fn one_rank_dense(shape: Vec<u64>, dtype: DType) -> TensorSpec {
    let one = || mesh(&[1], &[0]);
    TensorSpec {
        shape,
        dtype,
        src: layout(one(), &[Placement::Replicate]),
        dst: layout(one(), &[Placement::Replicate]),
    }
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn one_rank_conversions_match_the_host_executor_on_every_16_bit_pattern_and_boundary() {
    // On a GPU this is the hardware's cvt (FP8 from sm_89, bfloat16 and float16 from sm_80);
    // on emulated devices the kernel's software path; either must give the host's bits.
    let block = |dtype, rows, cols| Conversion::quantize(dtype, Scheme::Block { rows, cols });
    let patterns = all_16_bit_patterns();
    let boundaries = boundary_f32_values();
    let rows = boundaries.len() as u64 / 4 / 256;
    let mut cases: Vec<(String, TensorSpec, Conversion, Option<Vec<u8>>)> = Vec::new();
    for (src, targets) in [
        (
            DType::Bfloat16,
            [DType::Float8E4M3, DType::Float8E5M2, DType::Float16],
        ),
        (
            DType::Float16,
            [DType::Float8E4M3, DType::Float8E5M2, DType::Bfloat16],
        ),
    ] {
        for dst in targets {
            cases.push((
                format!("every {src} pattern cast to {dst}"),
                one_rank_dense(vec![256, 256], src),
                Conversion::cast(dst),
                Some(patterns.clone()),
            ));
        }
        cases.push((
            format!("every {src} pattern in 128x128 FP8 blocks"),
            one_rank_dense(vec![256, 256], src),
            block(DType::Float8E4M3, 128, 128),
            Some(patterns.clone()),
        ));
    }
    for dst in [
        DType::Bfloat16,
        DType::Float16,
        DType::Float8E4M3,
        DType::Float8E5M2,
    ] {
        cases.push((
            format!("float32 rounding boundaries cast to {dst}"),
            one_rank_dense(vec![rows, 256], DType::Float32),
            Conversion::cast(dst),
            Some(boundaries.clone()),
        ));
    }
    // Odd shapes, strided boxes and every scheme (the kernel's element-by-element path where
    // strips are partial or misaligned, reductions where a block has many partials).
    let mut padded = one_rank_dense(vec![130, 200], DType::Bfloat16);
    padded.dst.strides = Some(vec![201, 1]);
    let mut transposed = one_rank_dense(vec![96, 80], DType::Float32);
    transposed.src.strides = Some(vec![1, 96]);
    let mx = Conversion {
        scale_format: ScaleFormat::E8m0,
        scale_inverse: true,
        ..block(DType::Float8E5M2, 1, 32)
    };
    for (name, spec, conversion) in [
        (
            "130x200 bfloat16 into rows of 201 FP8, 128x128 blocks",
            padded,
            block(DType::Float8E4M3, 128, 128),
        ),
        (
            "transposed float32 source, 40x32 blocks",
            transposed,
            block(DType::Float8E4M3, 40, 32),
        ),
        (
            "[3, 5, 77] float32 per tensor",
            one_rank_dense(vec![3, 5, 77], DType::Float32),
            Conversion::quantize(DType::Float8E4M3, Scheme::PerTensor),
        ),
        (
            "[64, 1000] bfloat16 per channel",
            one_rank_dense(vec![64, 1000], DType::Bfloat16),
            Conversion::quantize(DType::Float8E4M3, Scheme::PerChannel),
        ),
        (
            "[40, 96] float16 in 1x32 E8M0 blocks",
            one_rank_dense(vec![40, 96], DType::Float16),
            mx,
        ),
        (
            "[1024, 1024] bfloat16 per tensor (two reduction levels)",
            one_rank_dense(vec![1024, 1024], DType::Bfloat16),
            Conversion::quantize(DType::Float8E4M3, Scheme::PerTensor),
        ),
        (
            "[33] bfloat16 cast to float16",
            one_rank_dense(vec![33], DType::Bfloat16),
            Conversion::cast(DType::Float16),
        ),
    ] {
        cases.push((name.to_string(), spec, conversion, None));
    }
    let totals = with_ranks(1, true, |rank| {
        let mut bytes = 0;
        for via_nccl in [false, true] {
            // Receivers convert what NCCL self messages deliver; or the conversion runs on the
            // local copy's way.
            let config = Config {
                local_via_messages: via_nccl,
                ..Default::default()
            };
            for (name, spec, conversion, source) in &cases {
                bytes += conversions_match_the_host(
                    rank,
                    name,
                    std::slice::from_ref(spec),
                    &[Some(conversion.clone())],
                    &config,
                    std::slice::from_ref(source),
                );
            }
        }
        bytes
    });
    println!(
        "gpu: one rank, {} conversions (every bfloat16 and float16 pattern cast to both FP8 formats and to the other 16-bit type and in 128x128 blocks, {} float32 rounding boundaries cast to each type, odd shapes, strided boxes, every scheme) x (local, NCCL self): every byte equals the host executor's, {} bytes",
        cases.len(),
        boundaries.len() / 4,
        totals[0]
    );
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn graph_capture_replays_a_plan_with_conversions() {
    // A cast and FP8 blocks through NCCL self messages in two rounds: the conversion passes
    // (amaxes, scales, values) and the copies are captured once and replayed.
    let tensors = vec![
        one_rank_dense(vec![192, 256], DType::Bfloat16),
        one_rank_dense(vec![64, 96], DType::Float32),
    ];
    let conversions = vec![
        Some(Conversion::quantize(
            DType::Float8E4M3,
            Scheme::Block {
                rows: 64,
                cols: 128,
            },
        )),
        Some(Conversion::cast(DType::Bfloat16)),
    ];
    let config = Config {
        local_via_messages: true,
        rounds: 2,
        split_min_bytes: 4096,
        ..Default::default()
    };
    let planner =
        Planner::with_conversions(tensors.clone(), conversions.clone(), config.clone()).unwrap();
    let mut host = vec![rank_buffers(&tensors, Some(&conversions), 0).unwrap()];
    let (src, initial) = (host[0].src.clone(), host[0].dst.clone());
    execute(&[planner.rank_program(0).unwrap()], &mut host).unwrap();
    with_ranks(1, true, |rank| {
        let plan = plan_at(&tensors, &conversions, 0, &config, &[(0, 0, 0); 2]).unwrap();
        let executor = NcclTransport::for_plan(&plan);
        let upload = |b: &Vec<u8>| rank.device.upload(b);
        let send: Vec<u64> = src.iter().map(upload).collect();
        let recv: Vec<u64> = initial.iter().map(upload).collect();
        let send_ptrs: Vec<usize> = send.iter().map(|&p| p as usize).collect();
        let recv_ptrs: Vec<usize> = recv.iter().map(|&p| p as usize).collect();
        let buffers = CallBuffers::PerTensor {
            send: &send_ptrs,
            recv: &recv_ptrs,
        };
        executor
            .execute(&buffers, rank.comm, rank.device.stream.cast())
            .unwrap();
        rank.device.sync();
        let fresh = Device::new(0);
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: capture on our own stream; graph objects destroyed below.
        unsafe {
            let (graph, exec) = capture_graph(fresh.stream, mode, || {
                executor
                    .execute(&buffers, rank.comm, fresh.stream.cast())
                    .unwrap_or_else(|e| panic!("capture: {e}"));
            });
            for replay in 0..3 {
                // Reset the destinations (values and scales), replay, compare with the host.
                for (&p, b) in recv.iter().zip(&initial) {
                    let fill = fresh.upload(b);
                    ck(
                        sys::cuMemcpyDtoDAsync_v2(p, fill, b.len(), fresh.stream),
                        "reset",
                    );
                    fresh.sync();
                    fresh.free(fill);
                }
                ck(sys::cuGraphLaunch(exec, fresh.stream), "launch");
                fresh.sync();
                for (v, (&p, want)) in recv.iter().zip(&host[0].dst).enumerate() {
                    assert!(
                        fresh.download(p, want.len()) == *want,
                        "replay {replay}: destination view {v} differs from the host executor's"
                    );
                }
            }
            ck(sys::cuGraphExecDestroy(exec), "destroy exec");
            ck(sys::cuGraphDestroy(graph), "destroy graph");
        }
        for p in send.into_iter().chain(recv) {
            rank.device.free(p);
        }
    });
    println!("gpu: one rank, a cast and 64x128 FP8 blocks through NCCL self messages in 2 rounds: captured on a fresh stream after a warm-up, 3 replays equal the host executor's bytes");
}

/// An all-to-all layout over `n` ranks (every rank a peer of every other, or of itself alone
/// through self messages when n = 1), for tests about groups, streams and checks.
fn all_to_all(n: u32, rows: u64) -> (Vec<TensorSpec>, bool) {
    let ranks: Vec<u32> = (0..n).collect();
    let all = || mesh(&[n as u64], &ranks);
    let spec = TensorSpec {
        shape: vec![rows, 8 * n as u64],
        dtype: DType::Float32,
        src: layout(all(), &[Placement::Shard(0)]),
        dst: layout(all(), &[Placement::Shard(1)]),
    };
    (vec![spec], n == 1)
}

/// [`all_to_all`] and back: row shards into column shards land strided, so receivers unpack
/// (in plans of several rounds, late unpacks on a side stream).
fn there_and_back(n: u32, rows: u64) -> (Vec<TensorSpec>, bool) {
    let (mut tensors, via_self) = all_to_all(n, rows);
    let back = TensorSpec {
        src: tensors[0].dst.clone(),
        dst: tensors[0].src.clone(),
        ..tensors[0].clone()
    };
    tensors.push(back);
    (tensors, via_self)
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn a_groupable_plan_runs_twice_in_a_callers_group_next_to_an_allreduce() {
    // Defect: groupable plans used to pack into one staging arena when called, and NCCL read
    // it at the group's end, after the second call had overwritten it.
    let n = world();
    let (tensors, via_self) = all_to_all(n as u32, 64);
    let config = Config {
        local_via_messages: via_self,
        ..config(Mode::Groupable)
    };
    with_ranks(n, true, |rank| {
        let plan = plan_of(&tensors, rank.r, &config).unwrap();
        let first = prepare(&rank.device, &tensors, rank.r);
        // The second call's sources hold other values (a second step's weights): anything the
        // first call left for NCCL to read at the group's end being overwritten would show.
        let second = prepare_salted(&rank.device, &tensors, rank.r, 7);
        let executor = NcclTransport::for_plan(&plan);
        let counts: Vec<f32> = (0..1024).map(|i| i as f32).collect();
        let bytes: Vec<u8> = counts.iter().flat_map(|x| x.to_le_bytes()).collect();
        let sum_in = rank.device.upload(&bytes);
        let sum_out = rank.device.upload(&bytes);
        let stream = rank.device.stream.cast();
        // The loopback stand-in has no collectives (it refuses ncclAllReduce): the group holds
        // the two calls alone there.
        let all_reduce = !loopback();
        // SAFETY: balanced group calls; buffers alive until the stream is synchronised.
        unsafe {
            assert_eq!((nccl().group_start)(), 0);
            executor
                .execute(&first.buffers(), rank.comm, stream)
                .unwrap_or_else(|e| panic!("rank {}: first call: {e}", rank.r));
            if all_reduce {
                assert_eq!(
                    (nccl().all_reduce)(
                        sum_in as *const c_void,
                        sum_out as *mut c_void,
                        1024,
                        NCCL_FLOAT32,
                        NCCL_SUM,
                        rank.comm,
                        stream
                    ),
                    0
                );
            }
            executor
                .execute(&second.buffers(), rank.comm, stream)
                .unwrap_or_else(|e| panic!("rank {}: second call: {e}", rank.r));
            assert_eq!((nccl().group_end)(), 0);
        }
        first.verify(&rank.device, &tensors, rank.r);
        second.verify(&rank.device, &tensors, rank.r);
        if all_reduce {
            let reduced = rank.device.download(sum_out, bytes.len());
            for (i, chunk) in reduced.chunks(4).enumerate() {
                let got = f32::from_le_bytes(chunk.try_into().unwrap());
                assert_eq!(got, i as f32 * rank.n as f32, "allreduce element {i}");
            }
        }
        rank.device.free(sum_in);
        rank.device.free(sum_out);
        first.free(&rank.device);
        second.free(&rank.device);
    });
    if loopback() {
        println!("gpu: {n} rank(s): a groupable plan called twice in one ncclGroupStart/End: byte-exact (the ncclAllReduce between skipped under the loopback stand-in, which has no collectives)");
    } else {
        println!("gpu: {n} rank(s): a groupable plan called twice in one ncclGroupStart/End with an ncclAllReduce between: byte-exact");
    }
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn staged_and_multi_round_plans_inside_a_group_are_refused_on_every_rank() {
    // Defect: such a plan inside a caller's group had its unpacks enqueued before NCCL (which
    // defers the group to its end) received anything: wrong data, silently.
    let n = world();
    let (tensors, via_self) = all_to_all(n as u32, 64);
    for (mode, rounds) in [(Mode::Staged, 0), (Mode::Auto, 3)] {
        let config = Config {
            mode,
            rounds,
            split_min_bytes: 1024,
            local_via_messages: via_self,
            ..Default::default()
        };
        let outcome = with_ranks(n, true, |rank| {
            let plan = plan_of(&tensors, rank.r, &config).unwrap();
            let data = prepare(&rank.device, &tensors, rank.r);
            let executor = NcclTransport::for_plan(&plan);
            let stream = rank.device.stream.cast();
            // SAFETY: balanced group calls.
            unsafe {
                assert_eq!((nccl().group_start)(), 0);
                let err = executor
                    .execute(&data.buffers(), rank.comm, stream)
                    .expect_err("a staged plan inside a group must be refused");
                assert_eq!(err.kind, ErrorKind::InvalidUsage, "{err}");
                assert!(
                    err.message.contains("inside ncclGroupStart/ncclGroupEnd")
                        && err.message.contains("groupable mode"),
                    "{err}"
                );
                // The group is still open (a probe would have reopened it): closing it is valid.
                assert_eq!((nccl().group_end)(), 0);
            }
            // Nothing was posted: the same call outside the group works. Asking whether a
            // group is open must make NCCL log nothing (defect: ending a group that was not
            // open, one NCCL WARN "not in a group call" per call with NCCL_DEBUG=WARN). NCCL's
            // last warning is process-wide: rank 0 alone checks it.
            let marker = (rank.r == 0).then(|| {
                // SAFETY: a NULL output, which NCCL refuses with a warning of its own.
                let refused = unsafe { (nccl().count)(rank.comm, std::ptr::null_mut()) };
                assert_ne!(refused, 0);
                nccl_last_error()
            });
            executor
                .execute(&data.buffers(), rank.comm, stream)
                .unwrap_or_else(|e| panic!("rank {}: {e}", rank.r));
            data.verify(&rank.device, &tensors, rank.r);
            data.free(&rank.device);
            marker.map(|m| nccl_last_error() == m)
        });
        if let Some(quiet) = outcome.into_iter().flatten().next() {
            if transport::group_depth_readable() {
                assert!(quiet, "{mode:?}: the call made NCCL log a warning");
            } else {
                assert!(!emulated(), "the emulator's NCCL names its group depth");
                println!("gpu: this NCCL's symbol table does not name its group depth: open groups are found by ncclGroupEnd, which NCCL logs");
            }
        }
    }
    println!("gpu: {n} rank(s): staged and multi-round plans inside a group refused on every rank before any NCCL operation; outside it byte-exact");
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn a_launch_failing_mid_call_still_posts_every_group_so_no_peer_waits() {
    // Defect: a failure after the call's first NCCL group (a launch in round >= 1) returned at
    // once, leaving the peers blocked in NCCL waiting for the later rounds' messages.
    let Some(fail) = fail_launch() else {
        println!("gpu: mid-call launch failure skipped: needs the emulator's fault injection");
        return;
    };
    let n = world();
    let (tensors, via_self) = all_to_all(n as u32, 256);
    let config = Config {
        mode: Mode::Auto,
        rounds: 3,
        split_min_bytes: 1024,
        local_via_messages: via_self,
        ..Default::default()
    };
    with_ranks(n, true, |rank| {
        let plan = plan_of(&tensors, rank.r, &config).unwrap();
        let rounds = plan.program().rounds().len();
        let data = prepare(&rank.device, &tensors, rank.r);
        let executor = NcclTransport::for_plan(&plan);
        let stream = rank.device.stream.cast();
        executor
            .execute(&data.buffers(), rank.comm, stream)
            .unwrap_or_else(|e| panic!("warm-up: {e}"));
        rank.device.sync();
        if rank.r == 0 {
            // The first launch of the next call: its local copies or unpacks, before the
            // groups of the later rounds.
            assert!(
                rounds >= 2,
                "rank 0 should run several rounds, runs {rounds}"
            );
            // SAFETY: the emulator's control, with its C signature; our stream.
            assert_eq!(unsafe { fail(rank.device.stream, 1) }, 0);
        }
        let result = executor.execute(&data.buffers(), rank.comm, stream);
        if rank.r == 0 {
            let err = result.expect_err("the armed launch fails");
            assert_eq!(err.kind, ErrorKind::Cuda, "{err}");
            assert!(err.message.contains("cuLaunchKernel"), "{err}");
        } else {
            result.unwrap_or_else(|e| panic!("rank {}: {e}", rank.r));
        }
        // Every rank's stream completes: no message was left unmatched.
        rank.device.sync();
        // The communicators are still in step: the next call is byte-exact everywhere.
        let fresh = prepare(&rank.device, &tensors, rank.r);
        executor
            .execute(&fresh.buffers(), rank.comm, stream)
            .unwrap_or_else(|e| panic!("rank {}: after the failure: {e}", rank.r));
        fresh.verify(&rank.device, &tensors, rank.r);
        data.free(&rank.device);
        fresh.free(&rank.device);
    });
    println!("gpu: {n} rank(s): a launch failing on rank 0 mid-call returns its error there while every group is still posted; no rank waits, the next call is byte-exact");
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn graph_capture_replays_the_reshard_including_a_first_call_on_a_fresh_stream() {
    // Defect: the first call on a new stream allocated and uploaded (illegal during capture);
    // torch.cuda.graph captures on a stream of its own, so warming up elsewhere did not help.
    let n = world();
    let (tensors, via_self) = there_and_back(n as u32, 1024);
    for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
        // Staged in 3 rounds: late unpacks, which a captured call keeps on its stream (in 2
        // rounds every pair sends the strided tensor, which receivers unpack, in the last).
        let config = Config {
            mode,
            rounds: if mode == Mode::Groupable { 0 } else { 3 },
            split_min_bytes: 1024,
            local_via_messages: via_self,
            ..Default::default()
        };
        let late = with_ranks(n, true, |rank| {
            let plan = plan_of(&tensors, rank.r, &config).unwrap();
            let data = prepare(&rank.device, &tensors, rank.r);
            let late = plan.program().has_late_unpacks();
            let executor = NcclTransport::for_plan(&plan);
            // Ranks are threads of one process here, so captures are thread-local: in global
            // mode another rank's allocation would (rightly) invalidate this rank's capture. A
            // job runs one process per GPU, where torch's global mode is fine.
            let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            // Never run: a capture is refused cleanly and stays valid.
            let capture = Device::new(rank.r as usize);
            // SAFETY: capture on our own stream; graph objects destroyed below.
            unsafe {
                ck(
                    sys::cuStreamBeginCapture_v2(capture.stream, mode),
                    "begin capture",
                );
                let err = executor
                    .execute(&data.buffers(), rank.comm, capture.stream.cast())
                    .expect_err("first call during a capture");
                assert!(err.message.contains("run the plan once outside"), "{err}");
                let mut graph = std::ptr::null_mut();
                ck(
                    sys::cuStreamEndCapture(capture.stream, &mut graph),
                    "the refused call left the capture valid",
                );
                ck(sys::cuGraphDestroy(graph), "destroy graph");
            }
            // Warm up on the rank's stream, then capture on a fresh one and replay there.
            executor
                .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
                .unwrap_or_else(|e| panic!("warm-up: {e}"));
            rank.device.sync();
            let fresh = Device::new(rank.r as usize);
            // SAFETY: as above.
            unsafe {
                let (graph, exec) = capture_graph(fresh.stream, mode, || {
                    executor
                        .execute(&data.buffers(), rank.comm, fresh.stream.cast())
                        .unwrap_or_else(|e| panic!("{mode:?} capture on a fresh stream: {e}"));
                });
                for _ in 0..3 {
                    // Reset the destination, replay, check.
                    let zeros = vec![0u8; data.recv_len];
                    let zero = fresh.upload(&zeros);
                    ck(
                        sys::cuMemcpyDtoDAsync_v2(data.recv, zero, data.recv_len, fresh.stream),
                        "reset",
                    );
                    ck(sys::cuGraphLaunch(exec, fresh.stream), "launch");
                    fresh.sync();
                    data.verify(&fresh, &tensors, rank.r);
                    fresh.free(zero);
                }
                ck(sys::cuGraphExecDestroy(exec), "destroy exec");
                ck(sys::cuGraphDestroy(graph), "destroy graph");
            }
            data.free(&rank.device);
            late
        });
        let late = late.iter().filter(|&&l| l).count();
        if mode == Mode::Staged {
            assert!(late > 0, "a staged 3-round plan without late unpacks");
        }
        println!(
            "gpu: {n} rank(s), {mode:?}: a first call during capture refused (capture still valid); after a warm-up, capture on a fresh stream + 3 replays byte-exact ({late} rank(s) with late unpacks)"
        );
    }
}

/// True on the CPU emulator (emu/), whose kernels run on the host: tests that measure keep
/// their data small there.
fn emulated() -> bool {
    contexts();
    let mut name = [0 as std::ffi::c_char; 128];
    // SAFETY: a buffer of the stated length; device 0 exists wherever these tests run.
    ck(
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 128, 0) },
        "cuDeviceGetName",
    );
    // SAFETY: the driver wrote a NUL-terminated name.
    unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .contains("emulated")
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn late_unpacks_overlap_the_next_round() {
    // A staged 3-round plan through NCCL self messages whose unpacks are slow (bf16 rows of
    // 1023 elements into a padded view): its unpacks run late, on the side stream beside the
    // next round, and must leave every byte right call after call; on a GPU the same plan
    // with every unpack before the next round (the program without the arenas) is timed beside
    // it, and the overlap should show (docs/executor.md, "Overlapping unpacks").
    let small = emulated();
    let rows: u64 = if small { 512 } else { 1 << 18 };
    let one = || mesh(&[1], &[0]);
    let mut spec = TensorSpec {
        shape: vec![rows, 1023],
        dtype: DType::Bfloat16,
        src: layout(one(), &[Placement::Replicate]),
        dst: layout(one(), &[Placement::Replicate]),
    };
    spec.dst.strides = Some(vec![1025, 1]);
    let tensors = vec![spec];
    let config = Config {
        mode: Mode::Staged,
        rounds: 3,
        split_min_bytes: 64 << 10,
        local_via_messages: true,
        ..Default::default()
    };
    let bytes = rows * 1023 * 2;
    let calls = if small { 2 } else { 10 };
    with_ranks(1, true, |rank| {
        let late = plan_of(&tensors, 0, &config).unwrap();
        assert!(late.program().has_late_unpacks(), "no late unpacks");
        let sequential = Planner::new(tensors.clone(), config.clone())
            .unwrap()
            .rank_program_sequential(0)
            .unwrap();
        let in_order =
            plan_of_within(&tensors, 0, &config, sequential.staging_bytes.max(1)).unwrap();
        assert!(!in_order.program().has_late_unpacks());
        let mut ms = Vec::new();
        for plan in [&late, &in_order] {
            let data = prepare(&rank.device, &tensors, 0);
            let executor = NcclTransport::for_plan(plan);
            let stream = rank.device.stream;
            let best = time_ms(stream, calls, || {
                executor
                    .execute(&data.buffers(), rank.comm, stream.cast())
                    .unwrap_or_else(|e| panic!("{e}"))
            });
            rank.device.sync();
            data.verify(&rank.device, &tensors, 0);
            data.free(&rank.device);
            ms.push(best);
        }
        let verdict = if small {
            "not timed on the emulator"
        } else if ms[0] < ms[1] {
            "overlap shows: met"
        } else {
            "overlap does not show: MISSED"
        };
        println!(
            "gpu: late unpacks, 3 rounds of {:.1} MiB of bf16 rows of 1023 into a padded view, {calls} calls each, byte-exact: {:.3} ms with late unpacks vs {:.3} ms with every unpack before the next round ({verdict})",
            bytes as f64 / f64::from(1 << 20),
            ms[0],
            ms[1]
        );
    });
}

/// Three column-sharded tensors into row shards replicated on two nodes (relays into staging,
/// unpacks nothing later reads) on 8 ranks, each rank's plan under a staging limit halfway
/// between what its program without late unpacks needs and what all of them need: only some
/// rounds' largest receives move into the late arenas (docs/executor.md, "Overlapping
/// unpacks"), the side stream runs those unpacks, and every byte lands, call after call.
fn partial_late_unpack_case() -> (Vec<TensorSpec>, Config) {
    let tensors = [768u64, 384, 1280]
        .iter()
        .map(|&cols| TensorSpec {
            shape: vec![512, cols],
            dtype: DType::Bfloat16,
            src: layout(mesh(&[2], &[0, 1]), &[Placement::Shard(1)]),
            dst: layout(
                mesh(&[4, 2], &(0..8).collect::<Vec<_>>()),
                &[Placement::Replicate, Placement::Shard(0)],
            ),
        })
        .collect();
    let config = Config {
        mode: Mode::Staged,
        topology: Topology::RanksPerNode(4),
        rounds: 4,
        split_min_bytes: 4096,
        ..Default::default()
    };
    (tensors, config)
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn late_unpacks_under_a_staging_limit_are_byte_exact() {
    let n = world();
    if n < 8 {
        println!("gpu: late unpacks under a staging limit skipped: {n} device(s)");
        return;
    }
    let (tensors, config) = partial_late_unpack_case();
    let planner = Planner::new(tensors.clone(), config.clone()).unwrap();
    let late = |p: &RankProgram| p.round_spans.iter().map(|s| s.late_unpacks).sum::<usize>();
    let outcome = with_ranks(8, true, |rank| {
        let all = planner.rank_program(rank.r).unwrap();
        let none = planner.rank_program_sequential(rank.r).unwrap();
        let limit = (none.staging_bytes + all.staging_bytes) / 2;
        let plan = plan_of_within(&tensors, rank.r, &config, limit.max(1)).unwrap();
        let program = plan.program();
        assert!(program.staging_bytes <= limit.max(none.staging_bytes));
        let data = prepare(&rank.device, &tensors, rank.r);
        let executor = NcclTransport::for_plan(&plan);
        for call in 0..2 {
            executor
                .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
                .unwrap_or_else(|e| panic!("rank {} call {call}: {e}", rank.r));
        }
        let checked = data.verify(&rank.device, &tensors, rank.r);
        data.free(&rank.device);
        (checked, late(program), late(&all))
    });
    let partial = outcome
        .iter()
        .filter(|&&(_, some, all)| some > 0 && some < all)
        .count();
    assert!(partial > 0, "no rank kept only some of its unpacks late");
    let checked: u64 = outcome.iter().map(|o| o.0).sum();
    println!(
        "gpu: 8 ranks, late unpacks under a staging limit ({partial} ranks with some late): byte-exact, {checked} elements"
    );
}

/// Free device memory as the driver reports it (context current).
fn free_memory() -> usize {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two out-pointers.
    ck(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    );
    free
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn staging_goes_back_after_each_call_captured_or_not() {
    // A staged plan through NCCL self messages (one GPU suffices): its staging is taken from the
    // device for each call and must be back once the stream has passed the call, ordinary calls
    // at the next synchronization, captured ones after each launch (docs/executor.md, "Staging
    // memory"). Defect: the pool kept every call's staging until the plan was destroyed, and
    // a captured call's until the graph's memory was trimmed by hand.
    // Rows into a padded view: the receive lands in staging and is unpacked.
    let one = || mesh(&[1], &[0]);
    let mut spec = TensorSpec {
        shape: vec![16384, 256],
        dtype: DType::Float32,
        src: layout(one(), &[Placement::Replicate]),
        dst: layout(one(), &[Placement::Replicate]),
    };
    spec.dst.strides = Some(vec![272, 1]);
    let tensors = vec![spec];
    let config = Config {
        mode: Mode::Staged,
        local_via_messages: true,
        ..Default::default()
    };
    with_ranks(1, true, |rank| {
        let plan = plan_of(&tensors, 0, &config).unwrap();
        let staging = plan.program().staging_bytes;
        assert!(staging >= 16 << 20, "the plan stages only {staging} bytes");
        let data = prepare(&rank.device, &tensors, 0);
        let executor = NcclTransport::for_plan(&plan);
        let call = |stream: sys::CUstream| {
            executor
                .execute(&data.buffers(), rank.comm, stream.cast())
                .unwrap_or_else(|e| panic!("{e}"))
        };
        // The first call uploads the plan's tables and connects NCCL: measure after it.
        call(rank.device.stream);
        rank.device.sync();
        let before = free_memory();
        call(rank.device.stream);
        rank.device.sync();
        let after = free_memory();
        assert_eq!(
            after,
            before,
            "an ordinary call kept {} bytes after the stream synchronized",
            before as i64 - after as i64
        );
        data.verify(&rank.device, &tensors, 0);
        let fresh = Device::new(0);
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: capture on our own stream; graph objects destroyed below.
        let waited = unsafe {
            let (graph, exec) = capture_graph(fresh.stream, mode, || call(fresh.stream));
            let instantiated = free_memory();
            let mut waited = Duration::ZERO;
            for _ in 0..2 {
                ck(sys::cuGraphLaunch(exec, fresh.stream), "launch");
                fresh.sync();
                data.verify(&fresh, &tensors, 0);
                // The library's trimmer takes the graph's memory back just after the launch.
                let start = Instant::now();
                while free_memory() != instantiated && start.elapsed() < Duration::from_secs(5) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                waited = waited.max(start.elapsed());
                let now = free_memory();
                assert_eq!(
                    now,
                    instantiated,
                    "a captured call kept {} bytes after its launch",
                    instantiated as i64 - now as i64
                );
            }
            ck(sys::cuGraphExecDestroy(exec), "destroy exec");
            ck(sys::cuGraphDestroy(graph), "destroy graph");
            waited
        };
        // At rest the plan holds its tables, not its staging: destroying it gives back little.
        rank.device.current();
        let at_rest = free_memory();
        drop(executor);
        let held = free_memory().saturating_sub(at_rest);
        assert!(
            held < staging as usize / 2,
            "the plan held {held} bytes at rest (its staging is {staging})"
        );
        data.free(&rank.device);
        println!(
            "gpu: staging ({staging} bytes) back after each call: ordinary calls at the stream's synchronization, captured ones {} ms after each launch; the plan holds {held} bytes at rest",
            waited.as_millis()
        );
    });
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn concurrent_calls_on_per_thread_default_streams_and_several_plans() {
    // Defect: staging was keyed by the stream handle, and cudaStreamPerThread is the same
    // handle on every thread: two threads shared one arena.
    let n = world();
    // Both plans in rounds with late unpacks: concurrent calls take side streams from one
    // device's pool.
    let (tensors, via_self) = there_and_back(n as u32, 1024);
    let staged = Config {
        mode: Mode::Staged,
        rounds: 3,
        split_min_bytes: 1024,
        local_via_messages: via_self,
        ..Default::default()
    };
    let auto = Config {
        mode: Mode::Auto,
        rounds: 4,
        split_min_bytes: 1024,
        local_via_messages: via_self,
        ..Default::default()
    };
    // Each rank: two threads, each with its own communicator and its per-thread default
    // stream, calling the same staged plan (shared) three times, and a second plan.
    let ids = [unique_id(), unique_id()];
    // cuMemFree waits for all work of the device, the other thread's NCCL calls included, which
    // wait for peers that may be freeing too: every thread frees only once all are done (as
    // on a GPU).
    let done = std::sync::Barrier::new(2 * n);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for r in 0..n {
            let plan = plan_of(&tensors, r as u32, &staged).unwrap();
            assert!(plan.program().has_late_unpacks(), "no late unpacks");
            let shared = Arc::new(NcclTransport::for_plan(&plan));
            for (k, id) in ids.iter().enumerate() {
                let (tensors, auto, shared) = (tensors.clone(), auto.clone(), shared.clone());
                let (id, done) = (*id, &done);
                handles.push(scope.spawn(move || {
                    let device = Device::per_thread(r);
                    let comm = join(id, n, r, true);
                    let second = plan_of(&tensors, r as u32, &auto).unwrap();
                    // On one rank each tensor is whole and contiguous on both sides: Auto
                    // sends it as it is (nothing to unpack); the staged plan alone takes side
                    // streams there.
                    assert!(
                        n == 1 || second.program().has_late_unpacks(),
                        "no late unpacks"
                    );
                    let other = NcclTransport::for_plan(&second);
                    let steps: Vec<RankData> = (0..3)
                        .map(|step| {
                            prepare_salted(&device, &tensors, r as u32, 10 * k as u32 + step)
                        })
                        .collect();
                    for (step, data) in steps.iter().enumerate() {
                        shared
                            .execute(&data.buffers(), comm, device.stream.cast())
                            .unwrap_or_else(|e| panic!("rank {r} thread {k} step {step}: {e}"));
                        other
                            .execute(&data.buffers(), comm, device.stream.cast())
                            .unwrap_or_else(|e| panic!("rank {r} thread {k} step {step}: {e}"));
                        data.verify(&device, &tensors, r as u32);
                    }
                    device.sync();
                    done.wait();
                    for data in steps {
                        data.free(&device);
                    }
                    // SAFETY: our communicator, destroyed once.
                    assert_eq!(unsafe { (nccl().destroy)(comm) }, 0);
                }));
            }
        }
        for h in handles {
            h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
    });
    free_deferred();
    println!("gpu: {n} rank(s) x 2 threads on cudaStreamPerThread with their own communicators: one shared staged 3-round plan and a 4-round plan, both with late unpacks on side streams, 3 steps each, byte-exact");
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn a_nonblocking_communicator_runs_every_round() {
    // Defect: ncclGroupEnd's ncclInProgress was taken for an error after round 0.
    let n = world();
    let (tensors, via_self) = all_to_all(n as u32, 128);
    for mode in [Mode::Groupable, Mode::Auto] {
        let config = Config {
            mode,
            rounds: if mode == Mode::Auto { 3 } else { 0 },
            split_min_bytes: 1024,
            local_via_messages: via_self,
            ..Default::default()
        };
        with_ranks(n, false, |rank| reshard(rank, &tensors, &config));
    }
    println!("gpu: {n} rank(s) on a nonblocking communicator (groupable, 3 rounds): byte-exact");
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn nccl_reshard_check_refuses_a_rank_that_planned_differently_and_tolerates_mixed_settings() {
    let n = world();
    if n < 2 {
        println!("gpu: NCCL_RESHARD_CHECK across ranks skipped: {n} device(s)");
        return;
    }
    let (tensors, _) = all_to_all(n as u32, 64);
    let mut other = tensors.clone();
    other[0].shape[0] += 1;
    // The last rank plans from a different shape: every rank's call (all are its peers)
    // returns invalid usage naming a peer, before any data moves, instead of hanging.
    let errors = with_ranks(n, true, |rank| {
        let mine = if rank.r + 1 == rank.n {
            &other
        } else {
            &tensors
        };
        let plan = plan_of(mine, rank.r, &Config::default()).unwrap();
        let data = prepare(&rank.device, mine, rank.r);
        let executor = NcclTransport::for_plan(&plan).with_peer_check(true);
        let result = executor.execute(&data.buffers(), rank.comm, rank.device.stream.cast());
        data.free(&rank.device);
        result.err()
    });
    for (r, e) in errors.iter().enumerate() {
        let e = e.as_ref().unwrap_or_else(|| panic!("rank {r} accepted"));
        assert_eq!(e.kind, ErrorKind::InvalidUsage);
        assert!(e.message.contains("different tensors or config"), "{e}");
    }
    // Defect: a rank with the check and a peer without it paired check messages with data.
    // Now the fingerprints travel on every call either way; only the waiting differs.
    with_ranks(n, true, |rank| {
        let plan = plan_of(&tensors, rank.r, &Config::default()).unwrap();
        let data = prepare(&rank.device, &tensors, rank.r);
        let executor = NcclTransport::for_plan(&plan).with_peer_check(rank.r % 2 == 0);
        for _ in 0..2 {
            executor
                .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
                .unwrap_or_else(|e| panic!("rank {}: {e}", rank.r));
        }
        data.verify(&rank.device, &tensors, rank.r);
        data.free(&rank.device);
    });
    println!("gpu: {n} ranks: NCCL_RESHARD_CHECK refuses a rank that planned differently on every rank; ranks with and without it interoperate");
}

#[test]
#[ignore = "needs CUDA and NCCL: scripts/gpu-check.sh, scripts/emulated-gpu-tests.sh"]
fn streams_of_another_device_or_context_are_refused() {
    // Defect: the stream's capture state was read before the communicator's context was
    // current, and streams of a non-primary context were not checked at all.
    let (tensors, _) = all_to_all(1, 64);
    let config = Config {
        mode: Mode::Staged,
        local_via_messages: true,
        ..Default::default()
    };
    with_ranks(1, true, |rank| {
        let plan = plan_of(&tensors, 0, &config).unwrap();
        let data = prepare(&rank.device, &tensors, 0);
        let executor = NcclTransport::for_plan(&plan);
        let mut own = std::ptr::null_mut();
        let mut stream = std::ptr::null_mut();
        // SAFETY: a context of our own on device 0 and a stream in it, destroyed below.
        unsafe {
            let mut dev = 0;
            ck(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
            ck(sys::cuCtxCreate_v2(&mut own, 0, dev), "cuCtxCreate");
            ck(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate");
            ck(
                sys::cuCtxSetCurrent(rank.device.context),
                "back to the primary",
            );
        }
        let err = executor
            .execute(&data.buffers(), rank.comm, stream.cast())
            .expect_err("a stream of a non-primary context");
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(err.message.contains("primary context"), "{err}");
        // SAFETY: ours, destroyed once.
        unsafe {
            ck(sys::cuCtxSetCurrent(own), "own");
            ck(sys::cuStreamDestroy_v2(stream), "cuStreamDestroy");
            ck(sys::cuCtxDestroy_v2(own), "cuCtxDestroy");
            ck(
                sys::cuCtxSetCurrent(rank.device.context),
                "back to the primary",
            );
        }
        if contexts().len() > 1 {
            let other = Device::new(1);
            rank.device.current();
            let err = executor
                .execute(&data.buffers(), rank.comm, other.stream.cast())
                .expect_err("a stream of another device");
            assert!(err.message.contains("primary context"), "{err}");
        }
        rank.device.current();
        executor
            .execute(&data.buffers(), rank.comm, rank.device.stream.cast())
            .unwrap_or_else(|e| panic!("the right stream: {e}"));
        data.verify(&rank.device, &tensors, 0);
        data.free(&rank.device);
    });
    println!("gpu: streams of another device or of a non-primary context refused with ncclInvalidArgument");
}

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

/// " (target >= 0.85x: met)" for a measured ratio against its target, or "" without one.
fn against(ratio: f64, target: Option<f64>) -> String {
    match target {
        Some(t) => format!(
            " (target >= {t:.2}x: {})",
            if ratio >= t { "met" } else { "MISSED" }
        ),
        None => String::new(),
    }
}

/// Milliseconds of one cuMemcpy2DAsync of `height` rows of `width` bytes at the given pitches
/// (the fair baseline for pitched rows: it writes the same partial lines).
fn memcpy2d_ms(
    stream: sys::CUstream,
    (src, src_pitch): (u64, u64),
    (dst, dst_pitch): (u64, u64),
    width: u64,
    height: u64,
) -> f32 {
    time_ms(stream, 5, || {
        // Every field named: all-zero is not a CUDA_MEMCPY2D (CUmemorytype has no 0).
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: both buffers hold `height` rows at their pitches (the test's views).
        ck(
            unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) },
            "cuMemcpy2DAsync",
        );
    })
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL (not run on emulated devices: it measures speed)"]
fn copy_kernel_bandwidth_against_memcpy() {
    // Targets (docs/executor.md, "The kernel"): against cudaMemcpy of the same bytes, or
    // against cuMemcpy2DAsync with the same pitches where rows leave partial lines.
    type Case = (
        &'static str,
        Vec<u64>,
        DType,
        Option<Vec<u64>>,
        Config,
        Option<f64>,
        bool,
    );
    let cases: Vec<Case> = vec![
        (
            "contiguous 1 GiB",
            vec![16384, 16384],
            DType::Float32,
            None,
            Config::default(),
            Some(0.9),
            false,
        ),
        (
            "64 KiB rows into a padded view, 1 GiB",
            vec![16384, 16384],
            DType::Float32,
            Some(vec![16384 + 64, 1]),
            Config::default(),
            Some(0.9),
            false,
        ),
        (
            "64-byte rows at an 80-byte pitch, 256 MiB",
            vec![1 << 22, 32],
            DType::Bfloat16,
            Some(vec![40, 1]),
            Config::default(),
            Some(0.9),
            true,
        ),
        (
            "64-byte rows at a 128-byte pitch, 256 MiB",
            vec![1 << 22, 32],
            DType::Bfloat16,
            Some(vec![64, 1]),
            Config::default(),
            Some(0.9),
            true,
        ),
        (
            "4 KiB rows, 256 MiB",
            vec![1 << 16, 1024],
            DType::Float32,
            Some(vec![1024 + 32, 1]),
            Config::default(),
            Some(0.85),
            false,
        ),
        (
            "bf16 rows of 1023 elements (2-byte aligned, shifted 16-byte units), 256 MiB",
            vec![1 << 17, 1023],
            DType::Bfloat16,
            Some(vec![1025, 1]),
            Config::default(),
            Some(0.85),
            false,
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
            None,
            false,
        ),
    ];
    with_ranks(1, true, |rank| {
        let device = &rank.device;
        for (name, shape, dtype, strides, config, target, pitched) in &cases {
            let mut spec = one_rank_dense(shape.clone(), *dtype);
            spec.dst.strides = strides.clone();
            let tensors = vec![spec];
            let plan = plan_of(&tensors, 0, config).unwrap();
            let data = prepare(device, &tensors, 0);
            let size = u64::from(dtype.size());
            let bytes: u64 = tensors[0].shape.iter().product::<u64>() * size;
            let executor = NcclTransport::for_plan(&plan);
            let buffers = data.buffers();
            let ours = time_ms(device.stream, 5, || {
                executor
                    .execute(&buffers, rank.comm, device.stream.cast())
                    .unwrap();
            });
            data.verify(device, &tensors, 0);
            let (src, dst) = (data.send, data.recv);
            let (baseline, what) = if *pitched {
                let width = shape[1] * size;
                let pitch = strides.as_ref().map_or(width, |s| s[0] * size);
                let ms = memcpy2d_ms(device.stream, (src, width), (dst, pitch), width, shape[0]);
                (
                    ms,
                    format!("cuMemcpy2DAsync ({width}-byte rows, pitches {width} and {pitch})"),
                )
            } else {
                // SAFETY: both buffers hold at least `bytes` bytes.
                let ms = time_ms(device.stream, 5, || unsafe {
                    ck(
                        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes as usize, device.stream),
                        "DtoD",
                    );
                });
                (ms, "cudaMemcpy".to_string())
            };
            let gbs = |ms: f32| bytes as f64 / (ms as f64 * 1e-3) / 1e9;
            let ratio = (baseline / ours) as f64;
            println!(
                "gpu: {name}: {:.0} GB/s vs {what} {:.0} GB/s = {ratio:.2}x{} ({ours:.3} ms vs {baseline:.3} ms)",
                gbs(ours),
                gbs(baseline),
                against(ratio, *target)
            );
            data.free(device);
        }

        // Conversions on one rank (the sender converts into its workspace, then an NCCL self
        // message moves the FP8 bytes to the view, as a sender sends from its workspace): the
        // call's reads and writes (amax pass: source; values pass: source + FP8; the message:
        // FP8 twice; scales) against cudaMemcpy moving as many bytes. Until 0.13.1 a local
        // copy moved them, on the side stream on half the SMs (0.32x then).
        let block =
            |rows, cols| Conversion::quantize(DType::Float8E4M3, Scheme::Block { rows, cols });
        // One source for the three (generating 512 MiB of values on the host costs seconds;
        // the speed does not depend on which conversion's test values it holds).
        let tensors = vec![one_rank_dense(vec![16384, 16384], DType::Bfloat16)];
        let source = converted_source_view_bytes(&tensors[0], Some(&block(128, 128)), 0, 0)
            .unwrap()
            .unwrap();
        let send = [device.upload(&source)];
        drop(source);
        for (name, conversion, target) in [
            (
                "bf16 -> fp8 e4m3, 128x128 blocks",
                block(128, 128),
                Some(0.7),
            ),
            (
                "bf16 -> fp8 e4m3, per tensor",
                Conversion::quantize(DType::Float8E4M3, Scheme::PerTensor),
                None,
            ),
            (
                "bf16 -> fp8 e4m3, cast",
                Conversion::cast(DType::Float8E4M3),
                None,
            ),
        ] {
            let conversions = vec![Some(conversion.clone())];
            let config = Config {
                local_via_messages: true,
                ..Default::default()
            };
            let plan = plan_at(&tensors, &conversions, 0, &config, &[(0, 0, 0)]).unwrap();
            let mut dst = vec![
                converted_destination_view_bytes(&tensors[0], &conversion, 0)
                    .unwrap()
                    .unwrap(),
            ];
            dst.extend(scale_view_bytes(&tensors[0], &conversion, 0).unwrap());
            let recv: Vec<u64> = dst.iter().map(|b| device.upload(b)).collect();
            let send_ptrs: Vec<usize> = send.iter().map(|&p| p as usize).collect();
            let recv_ptrs: Vec<usize> = recv.iter().map(|&p| p as usize).collect();
            let executor = NcclTransport::for_plan(&plan);
            let buffers = CallBuffers::PerTensor {
                send: &send_ptrs,
                recv: &recv_ptrs,
            };
            let ours = time_ms(device.stream, 5, || {
                executor
                    .execute(&buffers, rank.comm, device.stream.cast())
                    .unwrap();
            });
            let n = 16384u64 * 16384;
            let scaled = conversions[0].as_ref().unwrap().is_scaled();
            let scales: u64 = dst[1..].iter().map(|v| v.len() as u64).sum();
            let traffic = if scaled { 2 * n } else { 0 } + 3 * n + 2 * n + scales;
            // SAFETY: both buffers hold the 2n source bytes.
            let memcpy = time_ms(device.stream, 5, || unsafe {
                ck(
                    sys::cuMemcpyDtoDAsync_v2(send[0], send[0] + n, n as usize, device.stream),
                    "DtoD",
                );
            });
            // cudaMemcpy of n bytes reads and writes 2n.
            let rate = 2.0 * n as f64 / (memcpy as f64 * 1e-3);
            let ratio = traffic as f64 / rate / (ours as f64 * 1e-3);
            println!(
                "gpu: {name}, 512 MiB of bf16: {ours:.3} ms = {:.0} GB/s of source; {:.2} GB read+written at {:.0} GB/s = {ratio:.2}x cudaMemcpy of the same bytes{}",
                2.0 * n as f64 / (ours as f64 * 1e-3) / 1e9,
                traffic as f64 / 1e9,
                traffic as f64 / (ours as f64 * 1e-3) / 1e9,
                against(ratio, target)
            );
            for p in recv {
                device.free(p);
            }
        }
        device.free(send[0]);
    });
}
