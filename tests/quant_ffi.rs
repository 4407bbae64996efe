//! Conversions through the C ABI: `dstDtype`, `ncclReshardQuant_t` and `scaleOffset` are read
//! and validated (bad values refused with `ncclInvalidArgument` naming the field), plan info
//! reports the scale tensors and workspace, and `ncclReshardPlanGetTransfers` exports the
//! convert steps and the dtypes on the wire (FP8 when the sender converts).

use ncclreshard::ffi::*;
use ncclreshard::quant::{amax, Conversion, ScaleFormat, Scheme};
use ncclreshard::{DType, Layout, Mesh, Placement, TensorSpec};
use ncclreshard_tools::check::{
    expected_conversion, rank_buffers, verify_converted_view, verify_scale_view,
};
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::c_int;

const BFLOAT16: c_int = 9;
const FLOAT8E4M3: c_int = 10;
const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(ncclReshardGetLastError()) }
        .to_string_lossy()
        .into_owned()
}

fn c_layout(first: c_int, size: i64, dim: c_int) -> ncclReshardLayout_t {
    let mut l = ncclReshardLayout_t {
        size: std::mem::size_of::<ncclReshardLayout_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        meshNdim: 1,
        meshShape: [0; 8],
        ranks: std::ptr::null(),
        firstRank: first,
        placements: [ncclReshardPlacement_t::default(); 8],
        strides: std::ptr::null(),
    };
    l.meshShape[0] = size;
    l.placements[0] = ncclReshardPlacement_t {
        kind: ncclReshardPlacementKind_t::ncclReshardShard as c_int,
        dim,
        splitFactor: 0,
    };
    l
}

fn block_quant() -> ncclReshardQuant_t {
    ncclReshardQuant_t {
        size: std::mem::size_of::<ncclReshardQuant_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        scheme: ncclReshardQuantScheme_t::ncclReshardQuantBlock as c_int,
        blockRows: 0,
        blockCols: 0,
        scaleFormat: NCCL_RESHARD_UNDEF_INT,
        scaleInverse: NCCL_RESHARD_UNDEF_INT,
        scaleLayout: std::ptr::null(),
    }
}

/// [512, 384] bfloat16, rows over ranks 0-1 → columns over ranks 2-4, as FP8 in 128 × 128
/// blocks: each source shard holds whole blocks, so the senders convert.
fn tensor(
    src: &ncclReshardLayout_t,
    dst: &ncclReshardLayout_t,
    quant: *const ncclReshardQuant_t,
) -> ncclReshardTensor_t {
    ncclReshardTensor_t {
        size: std::mem::size_of::<ncclReshardTensor_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        ndim: 2,
        shape: [512, 384, 0, 0, 0, 0, 0, 0],
        dtype: BFLOAT16,
        src,
        dst,
        srcOffset: 0,
        dstOffset: 0,
        name: std::ptr::null(),
        dstDtype: FLOAT8E4M3,
        quant,
        scaleOffset: 0,
    }
}

fn create(t: &ncclReshardTensor_t, rank: c_int) -> Result<ncclReshardPlan_t, (c_int, String)> {
    create_with(t, rank, None)
}

fn create_with(
    t: &ncclReshardTensor_t,
    rank: c_int,
    config: Option<&ncclReshardConfig_t>,
) -> Result<ncclReshardPlan_t, (c_int, String)> {
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    let config = config.map_or(std::ptr::null(), |c| c as *const ncclReshardConfig_t);
    // SAFETY: valid descriptors, config (or NULL) and out-pointer.
    let r = unsafe { ncclReshardPlanCreate(&mut plan, 1, t, rank, config) };
    if r == 0 {
        Ok(plan)
    } else {
        Err((r, last_error()))
    }
}

fn transfers(plan: ncclReshardPlan_t) -> Vec<ncclReshardTransfer_t> {
    let mut count = 0;
    // SAFETY: a NULL array with capacity 0 asks for the count.
    assert_eq!(
        unsafe { ncclReshardPlanGetTransfers(plan, std::ptr::null_mut(), 0, &mut count) },
        0
    );
    // SAFETY: all-zero bytes are a valid transfer struct (integers only).
    let mut out: Vec<ncclReshardTransfer_t> = vec![unsafe { std::mem::zeroed() }; count as usize];
    for t in &mut out {
        t.size = std::mem::size_of::<ncclReshardTransfer_t>();
    }
    // SAFETY: the array holds `count` structs of the stated size.
    assert_eq!(
        unsafe { ncclReshardPlanGetTransfers(plan, out.as_mut_ptr(), count, &mut count) },
        0,
        "{}",
        last_error()
    );
    out
}

/// A change to a valid tensor or its quant struct.
type Edit = Box<dyn Fn(&mut ncclReshardTensor_t, &mut ncclReshardQuant_t)>;

#[test]
fn bad_conversion_fields_are_refused_naming_the_field() {
    let (src, dst) = (c_layout(0, 2, 0), c_layout(2, 3, 1));
    let quant = block_quant();
    let cases: Vec<(Edit, c_int, &str)> = vec![
        (
            Box::new(|t, _| t.dstDtype = 42),
            INVALID_ARGUMENT,
            "tensors[0].dstDtype is 42",
        ),
        (
            Box::new(|t, _| t.dstDtype = 0),
            INVALID_ARGUMENT,
            "tensors[0]: dstDtype int8 is not a conversion target",
        ),
        (
            Box::new(|_, q| q.scheme = NCCL_RESHARD_UNDEF_INT),
            INVALID_ARGUMENT,
            "tensors[0].quant.scheme is not set",
        ),
        (
            Box::new(|_, q| q.scheme = 9),
            INVALID_ARGUMENT,
            "tensors[0].quant.scheme is 9",
        ),
        (
            Box::new(|_, q| q.blockRows = -1),
            INVALID_ARGUMENT,
            "tensors[0].quant.blockRows is -1",
        ),
        (
            Box::new(|_, q| q.scaleFormat = 7),
            INVALID_ARGUMENT,
            "tensors[0].quant.scaleFormat is 7",
        ),
        (
            Box::new(|_, q| q.scaleInverse = 2),
            INVALID_ARGUMENT,
            "tensors[0].quant.scaleInverse is 2",
        ),
        (
            Box::new(|_, q| q.size = 3),
            INVALID_ARGUMENT,
            "tensors[0].quant",
        ),
        (
            Box::new(|t, _| t.dstDtype = BFLOAT16),
            INVALID_ARGUMENT,
            "tensors[0]: quant.scheme block needs an FP8 dstDtype",
        ),
    ];
    for (i, (edit, code, needle)) in cases.iter().enumerate() {
        let mut q = quant;
        let mut t = tensor(&src, &dst, std::ptr::null());
        edit(&mut t, &mut q);
        t.quant = &q;
        match create(&t, 0) {
            Ok(plan) => {
                // SAFETY: a plan this test created.
                unsafe { ncclReshardPlanDestroy(plan) };
                panic!("case {i} ({needle}) was accepted");
            }
            Err((r, message)) => {
                assert_eq!(r, *code, "case {i}: {message}");
                assert!(
                    message.contains(needle),
                    "case {i}: {message:?} lacks {needle:?}"
                );
            }
        }
    }
    // Groupable mode has no step to convert in.
    let mut config = ncclReshardConfig_t {
        mode: ncclReshardMode_t::ncclReshardModeGroupable as c_int,
        ..config_initializer()
    };
    config.size = std::mem::size_of::<ncclReshardConfig_t>();
    let t = tensor(&src, &dst, &quant);
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: valid descriptors and out-pointer.
    let r = unsafe { ncclReshardPlanCreate(&mut plan, 1, &t, 0, &config) };
    assert_eq!(r, INVALID_USAGE, "{}", last_error());
    assert!(last_error().contains("groupable"), "{}", last_error());
}

fn config_initializer() -> ncclReshardConfig_t {
    ncclReshardConfig_t {
        size: std::mem::size_of::<ncclReshardConfig_t>(),
        magic: NCCL_RESHARD_CONFIG_MAGIC,
        version: NCCL_RESHARD_VERSION_CODE as u32,
        mode: NCCL_RESHARD_UNDEF_INT,
        ranksPerNode: NCCL_RESHARD_UNDEF_INT,
        nodeOfRank: std::ptr::null(),
        nodeOfRankCount: 0,
        splitMinBytes: 0,
        maxStagingBytes: 0,
        rounds: NCCL_RESHARD_UNDEF_INT,
        relay: NCCL_RESHARD_UNDEF_INT,
        timeoutMs: NCCL_RESHARD_UNDEF_INT,
        failedRanks: std::ptr::null(),
        failedRankCount: 0,
        senderBarrier: NCCL_RESHARD_UNDEF_INT,
    }
}

#[test]
fn senders_convert_and_fp8_travels() {
    let (src, dst) = (c_layout(0, 2, 0), c_layout(2, 3, 1));
    let quant = block_quant();
    let t = tensor(&src, &dst, &quant);
    let view = |v: ncclReshardView_t| v as c_int;
    let kind = |k: ncclReshardTransferKind_t| k as c_int;

    // A sender: one convert step (bf16 → FP8, its whole shard, into its Converted view with
    // the scales into its Scales view), then FP8 data and FP32 scales to each receiver.
    let plan = create(&t, 0).unwrap();
    let mut info: ncclReshardPlanInfo_t = unsafe { std::mem::zeroed() };
    info.size = std::mem::size_of::<ncclReshardPlanInfo_t>();
    // SAFETY: a valid plan and info struct.
    assert_eq!(unsafe { ncclReshardPlanGetInfo(plan, &mut info) }, 0);
    assert_eq!(info.scaleTensors, 1);
    // Its shard in FP8 plus its 2 × 3 FP32 scales.
    assert!(
        info.workBytes >= 256 * 384 + 2 * 3 * 4,
        "{}",
        info.workBytes
    );
    let list = transfers(plan);
    let converts: Vec<_> = list
        .iter()
        .filter(|x| x.kind == kind(ncclReshardTransferKind_t::ncclReshardTransferConvert))
        .collect();
    assert!(!converts.is_empty());
    let converted: u64 = converts.iter().map(|x| x.bytes).sum();
    // `bytes` counts what a convert writes: one FP8 byte per element and its 2 × 3 scales.
    assert_eq!(converted, 256 * 384 + 2 * 3 * 4);
    for c in &converts {
        assert_eq!((c.peer, c.round), (0, 0));
        assert_eq!((c.srcDtype, c.dstDtype), (BFLOAT16, FLOAT8E4M3));
        assert_eq!(c.srcView, view(ncclReshardView_t::ncclReshardViewSource));
        assert_eq!(c.dstView, view(ncclReshardView_t::ncclReshardViewConverted));
        assert_eq!(c.scaleView, view(ncclReshardView_t::ncclReshardViewScales));
    }
    let sends: Vec<_> = list
        .iter()
        .filter(|x| x.kind == kind(ncclReshardTransferKind_t::ncclReshardTransferSend))
        .collect();
    let data: u64 = sends
        .iter()
        .filter(|x| x.tensor == 0)
        .map(|x| x.bytes)
        .sum();
    let scales: u64 = sends
        .iter()
        .filter(|x| x.tensor == 1)
        .map(|x| x.bytes)
        .sum();
    assert_eq!(data, 256 * 384, "FP8 on the wire: half the bfloat16 bytes");
    assert_eq!(
        scales,
        2 * 3 * 4,
        "each receiver gets its column of the rank's scales"
    );
    for s in sends.iter().filter(|x| x.tensor == 0) {
        assert_eq!((s.srcDtype, s.dstDtype), (FLOAT8E4M3, FLOAT8E4M3));
        assert_eq!(s.srcView, view(ncclReshardView_t::ncclReshardViewConverted));
    }
    for s in sends.iter().filter(|x| x.tensor == 1) {
        assert_eq!(s.srcView, view(ncclReshardView_t::ncclReshardViewScales));
    }
    // A caller built against the 0.3 struct cannot tell converted data from plain bytes.
    let mut old: Vec<ncclReshardTransfer_t> = vec![unsafe { std::mem::zeroed() }; list.len()];
    old[0].size = std::mem::offset_of!(ncclReshardTransfer_t, dstView);
    let mut count = 0;
    // SAFETY: the array holds enough structs of the full size.
    let r = unsafe {
        ncclReshardPlanGetTransfers(plan, old.as_mut_ptr(), list.len() as c_int, &mut count)
    };
    assert_eq!(r, INVALID_USAGE, "{}", last_error());
    assert!(
        last_error().contains("transfers[0].size"),
        "{}",
        last_error()
    );
    // SAFETY: a plan this test created.
    unsafe { ncclReshardPlanDestroy(plan) };

    // A receiver: FP8 data straight into its destination view, scales into its scale view
    // (tensor ntensors + 0), nothing to convert.
    let plan = create(&t, 2).unwrap();
    let list = transfers(plan);
    assert!(list
        .iter()
        .all(|x| x.kind == kind(ncclReshardTransferKind_t::ncclReshardTransferRecv)));
    let data: u64 = list.iter().filter(|x| x.tensor == 0).map(|x| x.bytes).sum();
    let scales: u64 = list.iter().filter(|x| x.tensor == 1).map(|x| x.bytes).sum();
    assert_eq!(data, 512 * 128);
    assert_eq!(scales, 4 * 4);
    for x in &list {
        assert_eq!(
            x.dstView,
            view(ncclReshardView_t::ncclReshardViewDestination)
        );
    }
    // SAFETY: a plan this test created.
    unsafe { ncclReshardPlanDestroy(plan) };
}

#[test]
fn receivers_convert_blocks_no_source_shard_holds_whole() {
    // Source rows split at 200 (3 shards of 171, 171, 170): blocks of 128 rows straddle the
    // cuts, so bfloat16 travels and the receivers (whole columns of 128) convert.
    let (src, dst) = (c_layout(0, 3, 0), c_layout(3, 3, 1));
    let quant = block_quant();
    let t = tensor(&src, &dst, &quant);
    let plan = create(&t, 3).unwrap();
    let list = transfers(plan);
    let convert = ncclReshardTransferKind_t::ncclReshardTransferConvert as c_int;
    let recvs: Vec<_> = list.iter().filter(|x| x.kind != convert).collect();
    let converts: Vec<_> = list.iter().filter(|x| x.kind == convert).collect();
    assert!(!converts.is_empty());
    let rounds = recvs.iter().map(|x| x.round).max().unwrap();
    for c in &converts {
        assert_eq!((c.srcDtype, c.dstDtype), (BFLOAT16, FLOAT8E4M3));
        assert_eq!(
            c.srcView,
            ncclReshardView_t::ncclReshardViewUnconverted as c_int
        );
        assert_eq!(
            c.dstView,
            ncclReshardView_t::ncclReshardViewDestination as c_int
        );
        assert!(c.round > rounds, "converts run after every receive");
    }
    // Rows [0, 128) and [384, 512) lie in one source shard each: FP8 arrives. Rows
    // [128, 384) straddle the cuts at 171 and 342: bfloat16 arrives and is converted here.
    let data = |dtype: c_int| -> u64 {
        recvs
            .iter()
            .filter(|x| x.tensor == 0 && x.srcDtype == dtype)
            .map(|x| x.bytes)
            .sum()
    };
    assert_eq!(data(FLOAT8E4M3), 256 * 128);
    assert_eq!(data(BFLOAT16), 2 * 256 * 128);
    let converted: u64 = converts.iter().map(|x| x.bytes).sum();
    assert_eq!(converted, 256 * 128 + 2 * 4, "values and their two scales");
    // The senders' two scales arrive; the receiver writes the other two itself.
    let scales: u64 = recvs
        .iter()
        .filter(|x| x.tensor == 1)
        .map(|x| x.bytes)
        .sum();
    assert_eq!(scales, 2 * 4);
    // SAFETY: a plan this test created.
    unsafe { ncclReshardPlanDestroy(plan) };
}

/// A rank's memory for running exported transfers: its views as `check` fills them (scale
/// views after the tensors') and its workspace views, keyed by (tensor, view), grown on write.
struct RankMemory {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    work: HashMap<(usize, c_int), Vec<u8>>,
}

/// The workspace or user view a transfer of `tensor` names (`tensor` ≥ ntensors: a scale
/// tensor, whose workspace views belong to its data tensor `scaled[k]`).
fn view_mut<'m>(
    m: &'m mut RankMemory,
    tensor: usize,
    view: c_int,
    scaled: &[usize],
) -> &'m mut Vec<u8> {
    let n = m.src.len();
    let data = if tensor >= n {
        scaled[tensor - n]
    } else {
        tensor
    };
    match view {
        v if v == ncclReshardView_t::ncclReshardViewSource as c_int => &mut m.src[tensor],
        v if v == ncclReshardView_t::ncclReshardViewDestination as c_int => &mut m.dst[tensor],
        v => m.work.entry((data, v)).or_default(),
    }
}

/// Every byte offset of a strided copy (`chunkBytes` at each point of the `count` grid), on
/// the read side and the write side.
fn copy_offsets(x: &ncclReshardTransfer_t) -> Vec<(usize, usize)> {
    let dims = x.copyNdim as usize;
    let mut out = Vec::new();
    let total: i64 = x.count[..dims].iter().product();
    for mut point in 0..total {
        let (mut s, mut d) = (x.srcOffset as i64, x.dstOffset as i64);
        for k in (0..dims).rev() {
            let i = point % x.count[k];
            point /= x.count[k];
            s += i * x.srcStride[k];
            d += i * x.dstStride[k];
        }
        for b in 0..x.chunkBytes as i64 {
            out.push(((s + b) as usize, (d + b) as usize));
        }
    }
    out
}

fn write_at(buffer: &mut Vec<u8>, at: usize, bytes: &[u8]) {
    if buffer.len() < at + bytes.len() {
        buffer.resize(at + bytes.len(), 0);
    }
    buffer[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Runs one convert transfer by the header's description, with the tensor's conversion.
fn run_convert(
    m: &mut RankMemory,
    x: &ncclReshardTransfer_t,
    conversion: &Conversion,
    spec: &TensorSpec,
    scale_tensor: Option<usize>,
    scaled: &[usize],
) {
    let t = x.tensor as usize;
    let dims = x.ndim as usize;
    let src_dtype = DType::from_nccl_code(x.srcDtype).unwrap();
    let arithmetic = conversion.arithmetic(src_dtype);
    let block = conversion.block_shape(&spec.shape);
    let count: Vec<i64> = x.count[..dims].to_vec();
    let grid: Vec<i64> = (0..dims)
        .map(|k| (count[k] as u64).div_ceil(block[k]) as i64)
        .collect();
    let elements: i64 = count.iter().product();
    let index = |mut e: i64| -> Vec<i64> {
        let mut i = vec![0; dims];
        for k in (0..dims).rev() {
            i[k] = e % count[k];
            e /= count[k];
        }
        i
    };
    let block_of = |i: &[i64]| -> usize {
        (0..dims).fold(0usize, |acc, k| {
            acc * grid[k] as usize + (i[k] / block[k] as i64) as usize
        })
    };
    let size = src_dtype.size() as usize;
    let src = view_mut(m, t, x.srcView, scaled).clone();
    let values: Vec<(Vec<i64>, f32)> = (0..elements)
        .map(|e| {
            let i = index(e);
            let at = x.srcOffset as i64 + (0..dims).map(|k| i[k] * x.srcStride[k]).sum::<i64>();
            let at = at as usize;
            (i, arithmetic.load(&src[at..at + size]))
        })
        .collect();
    let nblocks: i64 = grid.iter().product();
    let mut divisors = vec![1.0f32; nblocks as usize];
    if conversion.is_scaled() {
        let mut amaxes = vec![Vec::new(); nblocks as usize];
        for (i, v) in &values {
            amaxes[block_of(i)].push(*v);
        }
        let scale_view = scale_tensor.expect("a scaled tensor has a scale tensor");
        let stored = conversion.scale_format.size() as usize;
        for b in 0..nblocks {
            let mut bi = vec![0i64; dims];
            let mut rest = b;
            for k in (0..dims).rev() {
                bi[k] = rest % grid[k];
                rest /= grid[k];
            }
            let scale = arithmetic.block_scale(amax(amaxes[b as usize].iter().copied()));
            divisors[b as usize] = scale.divisor;
            let at =
                x.scaleOffset as i64 + (0..dims).map(|k| bi[k] * x.scaleStride[k]).sum::<i64>();
            write_at(
                view_mut(m, scale_view, x.scaleView, scaled),
                at as usize,
                &scale.stored[..stored],
            );
        }
    }
    let out_size = conversion.dtype.size() as usize;
    for (i, v) in &values {
        let mut bytes = [0u8; 4];
        arithmetic.convert(*v, divisors[block_of(i)], &mut bytes);
        let at = x.dstOffset as i64 + (0..dims).map(|k| i[k] * x.dstStride[k]).sum::<i64>();
        write_at(
            view_mut(m, t, x.dstView, scaled),
            at as usize,
            &bytes[..out_size],
        );
    }
}

/// Runs every rank's exported transfers (`ncclReshardPlanGetTransfers`) with byte copies and
/// the header's convert rule, round by round, each round's converts of the source view right
/// before its copies (no earlier: a convert listed in a round later than a copy reading its
/// output leaves that copy reading the workspace's zeros), then checks every converted
/// element and scale against the reference quantizer's conversion of the whole tensor: the
/// export is enough to run a plan that quantizes. Returns (values and scales checked, source
/// converts listed after round 0).
fn run_exported(
    spec: &TensorSpec,
    conversion: &Conversion,
    c: &ncclReshardTensor_t,
    config: Option<&ncclReshardConfig_t>,
) -> (u64, usize) {
    let specs = std::slice::from_ref(spec);
    let conversions = [Some(conversion.clone())];
    let mut ranks: Vec<u32> = spec
        .src
        .mesh
        .ranks()
        .iter()
        .chain(spec.dst.mesh.ranks())
        .copied()
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    let scaled: Vec<usize> = if conversion.is_scaled() {
        vec![0]
    } else {
        vec![]
    };
    let mut memory: HashMap<u32, RankMemory> = HashMap::new();
    let mut lists: HashMap<u32, Vec<ncclReshardTransfer_t>> = HashMap::new();
    for &r in &ranks {
        let plan = create_with(c, r as c_int, config).unwrap();
        lists.insert(r, transfers(plan));
        // SAFETY: a plan this test created.
        unsafe { ncclReshardPlanDestroy(plan) };
        let b = rank_buffers(specs, Some(&conversions), r).unwrap();
        memory.insert(
            r,
            RankMemory {
                src: b.src,
                dst: b.dst,
                work: HashMap::new(),
            },
        );
    }
    let is = |x: &ncclReshardTransfer_t, k: ncclReshardTransferKind_t| x.kind == k as c_int;
    let convert = ncclReshardTransferKind_t::ncclReshardTransferConvert;
    let scale_tensor = conversion.is_scaled().then_some(1usize);
    // Round by round: the round's converts reading the source view, then its copies (sends
    // and local copies applied to both ends: a receive has its send's geometry); then the
    // converts reading the unconverted view.
    let from_source = |x: &ncclReshardTransfer_t| {
        is(x, convert) && x.srcView == ncclReshardView_t::ncclReshardViewSource as c_int
    };
    let later = lists
        .values()
        .flatten()
        .filter(|x| from_source(x) && x.round > 0)
        .count();
    let last = lists.values().flatten().map(|x| x.round).max().unwrap_or(0);
    for round in 0..=last {
        for &r in &ranks {
            for x in lists[&r]
                .iter()
                .filter(|x| x.round == round && from_source(x))
            {
                let m = memory.get_mut(&r).unwrap();
                run_convert(m, x, conversion, spec, scale_tensor, &scaled);
            }
        }
        for &r in &ranks {
            for x in lists[&r].iter().filter(|x| x.round == round) {
                let send = is(x, ncclReshardTransferKind_t::ncclReshardTransferSend);
                let local = is(x, ncclReshardTransferKind_t::ncclReshardTransferLocal);
                if !send && !local {
                    continue;
                }
                let t = x.tensor as usize;
                let from = view_mut(memory.get_mut(&r).unwrap(), t, x.srcView, &scaled).clone();
                let to = view_mut(
                    memory.get_mut(&(x.peer as u32)).unwrap(),
                    t,
                    x.dstView,
                    &scaled,
                );
                for (s, d) in copy_offsets(x) {
                    write_at(to, d, &[from[s]]);
                }
            }
        }
    }
    for &r in &ranks {
        for x in lists[&r].iter().filter(|x| is(x, convert)) {
            if x.srcView == ncclReshardView_t::ncclReshardViewUnconverted as c_int {
                // After every receive: the last round of the plan.
                assert_eq!(x.round, last);
                let m = memory.get_mut(&r).unwrap();
                run_convert(m, x, conversion, spec, scale_tensor, &scaled);
            }
        }
    }
    let expected = expected_conversion(spec, conversion, 0);
    let mut checked = 0;
    for &r in &ranks {
        let m = &memory[&r];
        checked += verify_converted_view(spec, conversion, &expected, 0, r, &m.dst[0])
            .unwrap_or_else(|e| panic!("{e}"));
        if conversion.is_scaled() {
            checked += verify_scale_view(spec, conversion, &expected, 0, r, &m.dst[1])
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    (checked, later)
}

fn rust_layout(first: u32, n: u32, dim: usize) -> Layout {
    Layout::new(
        Mesh::new(vec![u64::from(n)], (first..first + n).collect()).unwrap(),
        vec![Placement::Shard(dim)],
    )
}

#[test]
fn exported_transfers_run_a_quantizing_plan_elsewhere() {
    // Senders convert (FP32 scales) and receivers convert (E8M0, inverted), as above.
    let cases = [
        ((0, 2, 0), (2, 3, 1), ScaleFormat::Float32, false),
        ((0, 3, 0), (3, 3, 1), ScaleFormat::E8m0, true),
    ];
    for ((sf, sn, sd), (df, dn, dd), format, inverse) in cases {
        let spec = TensorSpec {
            shape: vec![512, 384],
            dtype: DType::Bfloat16,
            src: rust_layout(sf, sn, sd),
            dst: rust_layout(df, dn, dd),
        };
        let conversion = Conversion {
            scale_format: format,
            scale_inverse: inverse,
            ..Conversion::quantize(
                DType::Float8E4M3,
                Scheme::Block {
                    rows: 128,
                    cols: 128,
                },
            )
        };
        let (src, dst) = (
            c_layout(sf as c_int, i64::from(sn), sd as c_int),
            c_layout(df as c_int, i64::from(dn), dd as c_int),
        );
        let mut quant = block_quant();
        quant.scaleFormat = match format {
            ScaleFormat::Float32 => 0,
            ScaleFormat::E8m0 => 1,
        };
        quant.scaleInverse = c_int::from(inverse);
        let c = tensor(&src, &dst, &quant);
        let (checked, _) = run_exported(&spec, &conversion, &c, None);
        assert_eq!(checked, 512 * 384 + 4 * 3, "every element and scale");
    }
}

#[test]
fn exported_converts_come_in_the_round_that_first_reads_them() {
    // 2 senders of 256 rows (2 block rows each) → 3 receivers of 128 columns, in 2 to 6
    // rounds: a pair's stream goes out in round order, so a sender's second block row is
    // first read in a later round. Run round by round, each convert no earlier than its
    // round, the export still reproduces every element and scale; and some converts are
    // listed after round 0 (they may run beside the rounds before).
    let spec = TensorSpec {
        shape: vec![512, 384],
        dtype: DType::Bfloat16,
        src: rust_layout(0, 2, 0),
        dst: rust_layout(2, 3, 1),
    };
    let conversion = Conversion::quantize(
        DType::Float8E4M3,
        Scheme::Block {
            rows: 128,
            cols: 128,
        },
    );
    let (src, dst, quant) = (c_layout(0, 2, 0), c_layout(2, 3, 1), block_quant());
    let c = tensor(&src, &dst, &quant);
    let mut later_somewhere = false;
    for rounds in [2, 3, 4, 6] {
        let config = ncclReshardConfig_t {
            rounds,
            ..config_initializer()
        };
        let (checked, later) = run_exported(&spec, &conversion, &c, Some(&config));
        assert_eq!(
            checked,
            512 * 384 + 4 * 3,
            "{rounds} rounds: every element and scale"
        );
        later_somewhere |= later > 0;
    }
    assert!(later_somewhere, "no convert was listed after round 0");
}

#[test]
fn calls_check_the_scale_views_before_anything_runs() {
    let (src, dst) = (c_layout(0, 2, 0), c_layout(2, 3, 1));
    let quant = block_quant();
    let mut t = tensor(&src, &dst, &quant);
    let plan = create(&t, 2).unwrap();
    // Rank 2 receives columns [0, 128) as FP8 and its 4 × 1 scales: ncclReshardMulti needs a
    // scale view after the tensor's.
    let mut memory = vec![0u8; 1 << 20];
    let base = memory.as_mut_ptr();
    let recv: [*mut std::ffi::c_void; 2] = [base.cast(), std::ptr::null_mut()];
    // SAFETY: the tables hold ntensors (sends) and ntensors + scaleTensors (receives) entries;
    // the call is refused before it touches memory, CUDA or NCCL.
    let r = unsafe {
        ncclReshardMulti(
            std::ptr::null(),
            recv.as_ptr(),
            plan,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    let message = last_error();
    assert_eq!(r, INVALID_ARGUMENT, "{message}");
    assert!(
        message
            .contains("recvbuffs[1] is NULL but rank 2 receives data of the scales of tensors[0]"),
        "{message}"
    );
    // SAFETY: a plan this test created.
    unsafe { ncclReshardPlanDestroy(plan) };
    // The single-buffer call: a scale view on top of the tensor's is refused naming the
    // offset.
    t.scaleOffset = 64;
    let plan = create(&t, 2).unwrap();
    // SAFETY: as above.
    let r = unsafe {
        ncclReshard(
            std::ptr::null(),
            base.cast(),
            plan,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    let message = last_error();
    assert_eq!(r, INVALID_ARGUMENT, "{message}");
    assert!(message.contains("tensors[0].scaleOffset = 64"), "{message}");
    // SAFETY: a plan this test created.
    unsafe { ncclReshardPlanDestroy(plan) };
}
