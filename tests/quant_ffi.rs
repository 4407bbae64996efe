//! Conversions through the C ABI: `dstDtype`, `ncclReshardQuant_t` and `scaleOffset` are read
//! and validated (bad values refused with `ncclInvalidArgument` naming the field), plan info
//! reports the scale tensors and workspace, and `ncclReshardPlanGetTransfers` exports the
//! convert steps and the dtypes on the wire (FP8 when the sender converts).

use ncclreshard::ffi::*;
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
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: valid descriptors and out-pointer.
    let r = unsafe { ncclReshardPlanCreate(&mut plan, 1, t, rank, std::ptr::null()) };
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
            "tensors[0]",
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
            "tensors[0]",
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
