//! The C ABI's data types. `#[repr(C)]`, NCCL style: structs start with `size` and `version`
//! (the config also `magic`), fields are only ever appended, and the library accepts any
//! `size` from the first released one up, filling defaults for fields the caller lacks.
//!
//! The ABI contract in one place: `size` is the versioning mechanism (the library reads at
//! most `size` bytes of an input struct and writes at most `size` bytes of an output struct);
//! `version` records the header the caller was compiled against: in an input struct a version
//! newer than the library is refused (its fields might mean something this library does not
//! know), in an output struct the library writes its own. Tunables a caller leaves unset hold
//! `NCCL_RESHARD_UNDEF_INT` (or 0 for byte sizes, NULL for pointers), which the library resolves,
//! so a default that changes reaches binaries built against older headers. The
//! `NCCL_RESHARD_*_INITIALIZER` macros are written from the tables below, one per struct.

#![allow(non_camel_case_types, non_snake_case)]

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// NCCL's result code (`ncclResult_t` from nccl.h, a C enum: int-sized).
pub type ncclResult_t = c_int;
/// NCCL's element type (`ncclDataType_t` from nccl.h).
pub type ncclDataType_t = c_int;
/// NCCL's communicator handle (`ncclComm_t` from nccl.h).
pub type ncclComm_t = *mut c_void;
/// A CUDA stream (`cudaStream_t` from cuda_runtime_api.h).
pub type cudaStream_t = *mut c_void;
/// NCCL's communicator configuration (`ncclConfig_t` from nccl.h), passed to NCCL as it is.
pub type ncclConfig_t = c_void;
/// NCCL's unique identifier (`ncclUniqueId` from nccl.h).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    /// The identifier's bytes.
    pub internal: [c_char; 128],
}

/// Most tensor dims and most mesh axes a descriptor can carry.
pub const NCCL_RESHARD_MAX_DIMS: usize = 8;
/// Identifies an initialised `ncclReshardConfig_t` (NCCL's configs carry a magic the same way;
/// "RESH"). Written into the header in hex by tests/header.rs.
/// cbindgen:ignore
pub const NCCL_RESHARD_CONFIG_MAGIC: c_uint = 0x5245_5348;
/// An `int` field the caller left unset (NCCL's `NCCL_CONFIG_UNDEF_INT`): the library uses its
/// default, or refuses a field that has none. Written into the header by tests/header.rs.
/// cbindgen:ignore
pub const NCCL_RESHARD_UNDEF_INT: c_int = c_int::MIN;

/// A mesh position whose rank is gone (`ncclReshardLayout_t.ranks`): a survivors' layout.
/// Written into the header, parenthesised, by tests/header.rs.
/// cbindgen:ignore
pub const NCCL_RESHARD_RANK_NONE: c_int = -1;

/// One field of a struct's `NCCL_RESHARD_*_INITIALIZER`: its name, its C initial value and a
/// comment. tests/header.rs writes each macro from its table, one field per line, and fails
/// when a table and its struct do not list the same fields in the same order.
/// cbindgen:ignore
pub struct InitializerField {
    /// The C field's name, as the struct spells it.
    pub name: &'static str,
    /// The C expression the macro gives the field.
    pub value: &'static str,
    /// The comment written beside the value in the macro.
    pub comment: &'static str,
}

/// cbindgen:ignore
const fn field(name: &'static str, value: &'static str, comment: &'static str) -> InitializerField {
    InitializerField {
        name,
        value,
        comment,
    }
}

/// `NCCL_RESHARD_LAYOUT_INITIALIZER`.
/// cbindgen:ignore
pub const LAYOUT_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardLayout_t)", "size"),
    field("version", "NCCL_RESHARD_VERSION_CODE", "version"),
    field("meshNdim", "0", "meshNdim: set it (1 to 8)"),
    field("meshShape", "{0}", "meshShape"),
    field("ranks", "NULL", "ranks: NULL = contiguous from firstRank"),
    field("firstRank", "0", "firstRank"),
    field("placements", "{{0, 0, 0}}", "placements: Replicate"),
    field("strides", "NULL", "strides: NULL = dense row-major"),
];

/// `NCCL_RESHARD_TENSOR_INITIALIZER`.
/// cbindgen:ignore
pub const TENSOR_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardTensor_t)", "size"),
    field("version", "NCCL_RESHARD_VERSION_CODE", "version"),
    field("ndim", "0", "ndim"),
    field("shape", "{0}", "shape"),
    field(
        "dtype",
        "(ncclDataType_t)NCCL_RESHARD_UNDEF_INT",
        "dtype: set it (no default)",
    ),
    field("src", "NULL", "src: set it"),
    field("dst", "NULL", "dst: set it"),
    field("srcOffset", "0", "srcOffset"),
    field("dstOffset", "0", "dstOffset"),
    field("name", "NULL", "name: optional"),
    field(
        "dstDtype",
        "(ncclDataType_t)NCCL_RESHARD_UNDEF_INT",
        "dstDtype: dtype (no conversion)",
    ),
    field("quant", "NULL", "quant: none (a plain cast)"),
    field("scaleOffset", "0", "scaleOffset"),
];

/// `NCCL_RESHARD_QUANT_INITIALIZER`.
/// cbindgen:ignore
pub const QUANT_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardQuant_t)", "size"),
    field("version", "NCCL_RESHARD_VERSION_CODE", "version"),
    field("scheme", "NCCL_RESHARD_UNDEF_INT", "scheme: set it"),
    field("blockRows", "0", "blockRows: 128"),
    field("blockCols", "0", "blockCols: 128"),
    field(
        "scaleFormat",
        "NCCL_RESHARD_UNDEF_INT",
        "scaleFormat: ncclReshardScaleFloat32",
    ),
    field(
        "scaleInverse",
        "NCCL_RESHARD_UNDEF_INT",
        "scaleInverse: 0 (store the scale)",
    ),
    field(
        "scaleLayout",
        "NULL",
        "scaleLayout: dst's mesh and placements",
    ),
];

/// `NCCL_RESHARD_CONFIG_INITIALIZER`.
/// cbindgen:ignore
pub const CONFIG_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardConfig_t)", "size"),
    field("magic", "NCCL_RESHARD_CONFIG_MAGIC", "magic"),
    field("version", "NCCL_RESHARD_VERSION_CODE", "version"),
    field(
        "mode",
        "NCCL_RESHARD_UNDEF_INT",
        "mode: the library's default (auto)",
    ),
    field(
        "ranksPerNode",
        "NCCL_RESHARD_UNDEF_INT",
        "ranksPerNode: unknown topology",
    ),
    field("nodeOfRank", "NULL", "nodeOfRank: none"),
    field("nodeOfRankCount", "0", "nodeOfRankCount"),
    field(
        "splitMinBytes",
        "0",
        "splitMinBytes: the library's default (1 MiB)",
    ),
    field(
        "maxStagingBytes",
        "0",
        "maxStagingBytes: NCCL_RESHARD_STAGING_BYTES, else 8 GiB",
    ),
    field(
        "rounds",
        "NCCL_RESHARD_UNDEF_INT",
        "rounds: chosen from the tensors",
    ),
    field("relay", "NCCL_RESHARD_UNDEF_INT", "relay: on"),
    field(
        "timeoutMs",
        "NCCL_RESHARD_UNDEF_INT",
        "timeoutMs: NCCL_RESHARD_TIMEOUT_MS, else no deadline",
    ),
    field("failedRanks", "NULL", "failedRanks: none"),
    field("failedRankCount", "0", "failedRankCount"),
    field(
        "senderBarrier",
        "NCCL_RESHARD_UNDEF_INT",
        "senderBarrier: where a node holds more than 8 sending-only ranks",
    ),
];

/// `NCCL_RESHARD_PLAN_INFO_INITIALIZER` (an output: only `size` matters).
/// cbindgen:ignore
pub const PLAN_INFO_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardPlanInfo_t)", "size"),
    field(
        "version",
        "NCCL_RESHARD_VERSION_CODE",
        "version: the library writes its own",
    ),
    field("rank", "0", "rank"),
    field("ntensors", "0", "ntensors"),
    field("mode", "0", "mode"),
    field("groupable", "0", "groupable"),
    field("peers", "0", "peers"),
    field("messagesSent", "0", "messagesSent"),
    field("messagesReceived", "0", "messagesReceived"),
    field("bytesSent", "0", "bytesSent"),
    field("bytesReceived", "0", "bytesReceived"),
    field("bytesCopied", "0", "bytesCopied"),
    field("stagingBytes", "0", "stagingBytes"),
    field("fingerprint", "0", "fingerprint"),
    field("sendBytes", "0", "sendBytes"),
    field("recvBytes", "0", "recvBytes"),
    field("rounds", "0", "rounds"),
    field("scaleTensors", "0", "scaleTensors"),
    field("workBytes", "0", "workBytes"),
];

/// `NCCL_RESHARD_TRANSFER_INITIALIZER` (an output: only `size` matters).
/// cbindgen:ignore
pub const TRANSFER_INITIALIZER: &[InitializerField] = &[
    field("size", "sizeof(ncclReshardTransfer_t)", "size"),
    field(
        "version",
        "NCCL_RESHARD_VERSION_CODE",
        "version: the library writes its own",
    ),
    field("kind", "0", "kind"),
    field("peer", "0", "peer"),
    field("tensor", "0", "tensor"),
    field("ndim", "0", "ndim"),
    field("globalStart", "{0}", "globalStart"),
    field("globalCount", "{0}", "globalCount"),
    field("srcOffset", "0", "srcOffset"),
    field("dstOffset", "0", "dstOffset"),
    field("chunkBytes", "0", "chunkBytes"),
    field("copyNdim", "0", "copyNdim"),
    field("count", "{0}", "count"),
    field("srcStride", "{0}", "srcStride"),
    field("dstStride", "{0}", "dstStride"),
    field("bytes", "0", "bytes"),
    field("round", "0", "round"),
    field("srcView", "ncclReshardViewSource", "srcView"),
    field("blockOffset", "0", "blockOffset"),
    field("blockBytes", "0", "blockBytes"),
    field("dstView", "ncclReshardViewDestination", "dstView"),
    field("srcDtype", "0", "srcDtype"),
    field("dstDtype", "0", "dstDtype"),
    field("scaleView", "ncclReshardViewDestination", "scaleView"),
    field("scaleOffset", "0", "scaleOffset"),
    field("scaleStride", "{0}", "scaleStride"),
];

/// How a tensor is placed along one mesh axis (torch `Replicate`, `Shard`, `_StridedShard`, and
/// `ShardBlocks`, which torch lacks).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardPlacementKind_t {
    /// Every rank along the mesh axis holds the whole tensor (torch `Replicate()`); the
    /// placement's `dim` and `splitFactor` are ignored.
    ncclReshardReplicate = 0,
    /// The mesh axis cuts tensor dim `dim` into contiguous chunks as torch.chunk does (trailing
    /// chunks short or empty): torch `Shard(dim)`. `splitFactor` is ignored.
    ncclReshardShard = 1,
    /// torch `_StridedShard(dim, split_factor)`, as FSDP2 + TP produce it: dim `dim` is cut into
    /// `splitFactor` pieces, each piece cut across the mesh axis, and a rank holds its part of
    /// every piece.
    ncclReshardStridedShard = 2,
    /// Not a torch placement: the mesh axis cuts tensor dim `dim` into blocks of `splitFactor`
    /// indices (≥ 1): coordinate c holds `[c·splitFactor, (c+1)·splitFactor)` of the current
    /// index list, clipped to it, so trailing coordinates hold short or empty blocks. vLLM's
    /// vocab-parallel embedding and LM head (blocks of `Vp / tp` rows of the vocabulary padded
    /// to `Vp`) and Megatron's are placed so; torch.chunk would cut them elsewhere.
    ncclReshardShardBlocks = 3,
}

/// How messages are formed: auto (the default: coalesced and staged per
/// peer pair where that saves messages, sent as they are otherwise), staged (one packed message
/// per peer pair), or groupable (every message sent from the source view and received into the
/// destination view as it is: no staging, one round, so a call may sit inside
/// `ncclGroupStart/End`, any number of times per group; regions interleaved on either side cost
/// one message per contiguous run, at most 16384 per rank). Only groupable plans may be called
/// inside a group; other plans called there are refused with `ncclInvalidUsage`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardMode_t {
    /// Every message goes from the source view straight into the destination view: one round,
    /// no staging, callable inside `ncclGroupStart/End`. Plan creation refuses a rank past
    /// 16384 messages and any tensor that converts.
    ncclReshardModeGroupable = 0,
    /// One packed message per peer pair and round, unpacked on arrival. Not callable inside a
    /// group.
    ncclReshardModeStaged = 1,
    /// The default: a peer pair is staged where sending its runs as they are would take many
    /// small messages, else its runs are sent as they are. Not callable inside a group.
    ncclReshardModeAuto = 2,
}

/// Which part a transfer plays for the plan's rank.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardTransferKind_t {
    /// This rank sends the transfer's bytes to `peer`.
    ncclReshardTransferSend = 0,
    /// This rank receives the transfer's bytes from `peer`.
    ncclReshardTransferRecv = 1,
    /// This rank holds the data on both sides and copies it locally (`peer` is itself).
    ncclReshardTransferLocal = 2,
    /// This rank converts a box of a tensor to its `dstDtype` (`peer` is itself): see
    /// `ncclReshardTransfer_t`, *Conversions*.
    ncclReshardTransferConvert = 3,
}

/// Which of the sender's views of a tensor a transfer reads (`ncclReshardTransfer_t.srcView`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardView_t {
    /// The sender's source view (`sendbuff` + the tensor's `srcOffset` in `ncclReshard`).
    ncclReshardViewSource = 0,
    /// The sender's destination view (`recvbuff` + the tensor's `dstOffset`): the sender
    /// forwards bytes it received in an earlier round (a relay).
    ncclReshardViewDestination = 1,
    /// A converted tensor's source view after conversion, on its sender: a dense row-major
    /// array of the rank's local source shape in the tensor's `dstDtype`, holding the blocks
    /// the rank holds whole (written by the rank's convert transfers).
    ncclReshardViewConverted = 2,
    /// A converted tensor's destination before conversion, on its receiver: a dense row-major
    /// array of the rank's local destination shape in the tensor's (source) `dtype`, into which
    /// the blocks the receiver converts arrive.
    ncclReshardViewUnconverted = 3,
    /// A scaled tensor's scales on its sender: a dense row-major array of one scale per block
    /// the rank holds whole in its source view, over those blocks' indices (written by its
    /// convert transfers).
    ncclReshardViewScales = 4,
}

/// How a tensor's values are scaled on the way (`ncclReshardQuant_t.scheme`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardQuantScheme_t {
    /// No scaling: each element is converted alone (round to nearest even, saturating for
    /// FP8).
    ncclReshardQuantNone = 0,
    /// One scale for the whole tensor.
    ncclReshardQuantPerTensor = 1,
    /// One scale per index of every dim but the last (per output channel of a weight).
    ncclReshardQuantPerChannel = 2,
    /// One scale per `blockRows × blockCols` block of the last two dims.
    ncclReshardQuantBlock = 3,
}

/// How scales are stored (`ncclReshardQuant_t.scaleFormat`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclReshardScaleFormat_t {
    /// FP32 (4 bytes).
    ncclReshardScaleFloat32 = 0,
    /// E8M0 (1 byte, a biased power-of-two exponent, as MX formats store scales); the scale
    /// is rounded up to a power of two.
    ncclReshardScaleE8M0 = 1,
}

/// How a tensor is quantized on its way (`ncclReshardTensor_t.quant`): the semantics, bit for
/// bit, are in docs/quantization.md. Per block (the whole tensor, one index of the leading
/// dims, or `blockRows × blockCols` of the last two dims), with amax the largest magnitude of
/// its elements (NaNs ignored): `s = max(amax, 1e-4) / fmax` in FP32 (fmax = 448 for
/// float8_e4m3fn, 57344 for float8_e5m2), rounded up to a power of two for E8M0; each element
/// becomes `x / s` rounded to nearest even and saturated; the stored scale is `s` (what
/// dequantization multiplies by: DeepSeek's `weight_scale_inv`, vLLM's `weight_scale`) or,
/// with `scaleInverse`, `1 / s`.
///
/// The scales form a tensor of their own, of shape `ceil(shape[d] / block[d])` per dim, with
/// the destination layout `scaleLayout` (NULL: the tensor's destination mesh and placements,
/// dense), written by the reshard into each rank's scale view: at `recvbuff` + the tensor's
/// `scaleOffset` in `ncclReshard`, in `recvbuffs[ntensors + k]` for the k-th tensor with
/// scales in `ncclReshardMulti`. Read during `ncclReshardPlanCreate` only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclReshardQuant_t {
    /// `sizeof(ncclReshardQuant_t)` of the caller's header (the initializer sets it). The
    /// struct is unchanged since it was added in 0.4; a smaller size is refused.
    pub size: usize,
    /// The `NCCL_RESHARD_VERSION_CODE` of the caller's header (the initializer sets it); a
    /// version newer than the library is refused, 0 is taken as the oldest.
    pub version: c_uint,
    /// An `ncclReshardQuantScheme_t` (no default: set it). The scaled schemes need an FP8
    /// `dstDtype`; `ncclReshardQuantNone` is a plain cast, the same as `quant` = NULL.
    pub scheme: c_int,
    /// `ncclReshardQuantBlock` only: the block's extent along the second-to-last dim, in
    /// elements; 0 = 128, negative values are refused. Ignored by the other schemes.
    pub blockRows: i64,
    /// `ncclReshardQuantBlock` only: the block's extent along the last dim, in
    /// elements; 0 = 128, negative values are refused. Ignored by the other schemes.
    pub blockCols: i64,
    /// An `ncclReshardScaleFormat_t` (unset: `ncclReshardScaleFloat32`).
    pub scaleFormat: c_int,
    /// 1: store `1 / s` instead of `s` (unset: 0).
    pub scaleInverse: c_int,
    /// The scale tensor's destination layout (NULL: the tensor's `dst` mesh and placements).
    pub scaleLayout: *const ncclReshardLayout_t,
}

/// One placement: `kind` is an `ncclReshardPlacementKind_t`; `dim` is the tensor dim for
/// Shard, StridedShard and ShardBlocks; `splitFactor` is StridedShard's split factor or
/// ShardBlocks' block size (≥ 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclReshardPlacement_t {
    /// An `ncclReshardPlacementKind_t`; any other value (there is no Partial) is refused.
    pub kind: c_int,
    /// The tensor dim the mesh axis shards, 0 to the tensor's `ndim` − 1 (Shard, StridedShard
    /// and ShardBlocks; ignored for Replicate).
    pub dim: c_int,
    /// StridedShard's split factor or ShardBlocks' block size, at least 1; ignored by the other
    /// kinds.
    pub splitFactor: i64,
}

/// One side of a reshard: a device mesh of communicator ranks and one placement per mesh axis.
///
/// `ranks` is the row-major rank table of `meshShape` (last axis fastest), any order, no
/// duplicates; when NULL the mesh is the contiguous ranks `firstRank, firstRank + 1, …`.
/// `strides`, when not NULL, holds one element stride per tensor dim for every rank's local
/// view (a view into a larger buffer, e.g. one half of a fused parameter); NULL means dense
/// row-major. The pointed-to arrays are read during `ncclReshardPlanCreate` only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclReshardLayout_t {
    /// `sizeof(ncclReshardLayout_t)` of the caller's header (the initializer sets it). The
    /// struct is unchanged since 0.1; a smaller size is refused.
    pub size: usize,
    /// The `NCCL_RESHARD_VERSION_CODE` of the caller's header (the initializer sets it); a
    /// version newer than the library is refused, 0 is taken as the oldest.
    pub version: c_uint,
    /// Number of mesh axes, 1 to `NCCL_RESHARD_MAX_DIMS` (the initializer's 0 is refused).
    pub meshNdim: c_int,
    /// Ranks along each of the first `meshNdim` mesh axes, each at least 1, at most 2^20 ranks
    /// in all; later entries are ignored.
    pub meshShape: [i64; NCCL_RESHARD_MAX_DIMS],
    /// NULL, or one communicator rank per mesh position (the product of `meshShape` entries,
    /// row-major, last axis fastest): non-negative, no duplicates, any order, or
    /// `NCCL_RESHARD_RANK_NONE` for a position whose rank is gone (its shard is then held only
    /// by replicas elsewhere, if any). Holes since 0.5.
    pub ranks: *const c_int,
    /// With `ranks` NULL, the mesh's first rank (non-negative): position i holds rank
    /// `firstRank + i`. Ignored when `ranks` is set.
    pub firstRank: c_int,
    /// One placement per mesh axis (the first `meshNdim` entries; later ones are ignored). The
    /// initializer's zeroed entries are `ncclReshardReplicate`.
    pub placements: [ncclReshardPlacement_t; NCCL_RESHARD_MAX_DIMS],
    /// NULL (every local view dense row-major), or one stride per tensor dim (the tensor's
    /// `ndim` entries), in elements, not bytes, used by every rank's local view on this
    /// side. The strides must not make elements overlap.
    pub strides: *const i64,
}

/// One global tensor: shape, dtype, source and destination layouts, and where this rank's
/// views sit inside the buffers passed to `ncclReshard`.
///
/// `dtype` is the source's element type. A tensor may arrive in another, `dstDtype`
/// (float32, bfloat16 or float16 → bfloat16, float16, float8_e4m3fn or float8_e5m2; unset:
/// `dtype`), converted on the way: cast element by element (round to nearest even,
/// saturating for FP8) when `quant` is NULL, else quantized per block as `quant` says, its
/// scales written to a scale tensor of their own (`scaleOffset`: this rank's scale view in
/// `recvbuff` for `ncclReshard`). Conversions run where the data is whole: a block that one
/// source shard holds is converted by its sender (the wire carries `dstDtype`), any other by
/// each receiver, which must hold it whole (plan creation refuses layouts where neither side
/// does). Plans with conversions cannot be made in groupable mode. `dstDtype`, `quant` and
/// `scaleOffset` were added in 0.4.
///
/// `srcOffset`/`dstOffset` are byte offsets of this tensor's local views from `sendbuff` /
/// `recvbuff` in `ncclReshard` (ignored by `ncclReshardMulti`, which takes one pointer per
/// tensor). They are local to the calling rank and may differ between ranks; for `ncclReshard`
/// the views of different tensors in one buffer must not overlap (it refuses the call
/// otherwise; a plan only called with `ncclReshardMulti` may leave them 0). Every other field
/// must be identical on all ranks. `name` is optional (NULL), used in messages only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclReshardTensor_t {
    /// `sizeof(ncclReshardTensor_t)` of the caller's header (the initializer sets it), at
    /// least the 0.1 struct's (which ends before `dstDtype`). It is also the stride of the
    /// `tensors` array, so every element must state the same size.
    pub size: usize,
    /// The `NCCL_RESHARD_VERSION_CODE` of the caller's header (the initializer sets it); a
    /// version newer than the library is refused, 0 is taken as the oldest.
    pub version: c_uint,
    /// Number of tensor dims, 0 (a single element) to `NCCL_RESHARD_MAX_DIMS`.
    pub ndim: c_int,
    /// The global tensor's extent along each of the first `ndim` dims, in elements
    /// (non-negative; later entries are ignored). The whole tensor must stay under 2^63 bytes.
    pub shape: [i64; NCCL_RESHARD_MAX_DIMS],
    /// The source's element type, an `ncclDataType_t` (0 to 11, `ncclInt8` to
    /// `ncclFloat8e5m2`). No default: `NCCL_RESHARD_UNDEF_INT` is refused.
    pub dtype: ncclDataType_t,
    /// The source layout (not NULL). Its strides count elements of `dtype`.
    pub src: *const ncclReshardLayout_t,
    /// The destination layout (not NULL). Its strides count elements of `dstDtype`.
    pub dst: *const ncclReshardLayout_t,
    /// Byte offset of this rank's source view from `sendbuff` in `ncclReshard`, per rank
    /// (unused on a rank without a source view and by `ncclReshardMulti`).
    pub srcOffset: usize,
    /// Byte offset of this rank's destination view from `recvbuff` in `ncclReshard`, per
    /// rank (unused on a rank without a destination view and by `ncclReshardMulti`).
    pub dstOffset: usize,
    /// NULL, or a NUL-terminated name that error and log messages use for the tensor; copied
    /// during `ncclReshardPlanCreate`.
    pub name: *const c_char,
    /// The destination's element type (`ncclBfloat16`, `ncclFloat16`, `ncclFloat8e4m3` or
    /// `ncclFloat8e5m2`, from a float32, bfloat16 or float16 `dtype`). `NCCL_RESHARD_UNDEF_INT`
    /// (the initializer's), or `dtype` itself with `quant` NULL: no conversion. Since 0.4.
    pub dstDtype: ncclDataType_t,
    /// NULL: a plain cast to `dstDtype` (if it differs from `dtype`); else how the tensor is
    /// quantized, which needs `dstDtype` set. Read during `ncclReshardPlanCreate` only. Since
    /// 0.4.
    pub quant: *const ncclReshardQuant_t,
    /// Byte offset of this rank's view of the tensor's scales from `recvbuff` in
    /// `ncclReshard`. Per rank; used only when `quant` has a scaled scheme and the rank holds
    /// scales, unused by `ncclReshardMulti`. Since 0.4.
    pub scaleOffset: usize,
}

/// Plan options; pass NULL for defaults, or start from `NCCL_RESHARD_CONFIG_INITIALIZER` and set
/// what you need. Every rank must pass the same values. Fields left at `NCCL_RESHARD_UNDEF_INT`
/// (or 0 for the byte sizes) get the library's defaults.
///
/// `mode` is an `ncclReshardMode_t` (default `ncclReshardModeAuto`). The topology (for
/// preferring same-node senders) is `ranksPerNode` (rank r on node r / ranksPerNode; 0 or unset
/// = unknown) or, when `nodeOfRank` is not NULL, the node id of each of `nodeOfRankCount` ranks.
/// `splitMinBytes` is the smallest part a replicated overlap is split into across senders
/// (0 = 1 MiB). `maxStagingBytes` bounds the staging one call of the plan needs on this rank,
/// checked at plan creation (0 = `NCCL_RESHARD_STAGING_BYTES`, else 8 GiB); staging comes from
/// a stream-ordered pool for each call and goes back at its end. `rounds` (staged and auto
/// modes) cuts the data into that many rounds (0 or unset = chosen from the tensors' sizes,
/// about 2.7 GiB per rank and round since 0.18, 4 GiB before). `relay` (staged and auto
/// modes, topology known): 1 (the default) sends data that several replicas on one node need
/// across the network once and forwards it over NVLink, and, with at least 2 rounds, lets
/// receiving nodes forward part of an overloaded sender's data to each other over the
/// network; 0 sends it to each replica from a source rank. `rounds` and `relay` were added in 0.2:
/// a struct from an older header (smaller `size`) gets the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclReshardConfig_t {
    /// `sizeof(ncclReshardConfig_t)` of the caller's header (the initializer sets it), at
    /// least the 0.1 struct's (which ends before `rounds`); fields past it get their defaults.
    pub size: usize,
    /// Must be `NCCL_RESHARD_CONFIG_MAGIC` (the initializer sets it); anything else is refused
    /// with `ncclInvalidArgument`.
    pub magic: c_uint,
    /// The `NCCL_RESHARD_VERSION_CODE` of the caller's header (the initializer sets it); a
    /// version newer than the library is refused, 0 is taken as the oldest.
    pub version: c_uint,
    /// An `ncclReshardMode_t`; `NCCL_RESHARD_UNDEF_INT`: `ncclReshardModeAuto`.
    pub mode: c_int,
    /// Ranks per node when rank r sits on node r / ranksPerNode; 0 or `NCCL_RESHARD_UNDEF_INT`:
    /// topology unknown, negative values are refused. Ignored when `nodeOfRank` is set.
    pub ranksPerNode: c_int,
    /// NULL, or `nodeOfRankCount` node ids (non-negative), entry r being rank r's node; ranks
    /// at or past `nodeOfRankCount` have no known node. Read during `ncclReshardPlanCreate`.
    pub nodeOfRank: *const c_int,
    /// Entries in `nodeOfRank` (non-negative); ignored when `nodeOfRank` is NULL.
    pub nodeOfRankCount: c_int,
    /// The smallest part, in bytes, that a replicated overlap is split into across senders,
    /// and a peer pair's data or a relay across rounds; 0: 1 MiB.
    pub splitMinBytes: usize,
    /// Bound, in bytes, on what one call of the plan allocates on this rank (staging plus
    /// conversion workspace), checked at plan creation (`ncclInvalidUsage` when over); 0:
    /// `NCCL_RESHARD_STAGING_BYTES`, else 8 GiB. Not part of the plan's fingerprint.
    pub maxStagingBytes: usize,
    /// Staged and auto modes: how many rounds the data is cut into, 0 to 1024 (relays forward
    /// in the round after their data arrives, which may add one; since 0.19 a plan whose
    /// senders send more per GPU than any receiving node takes in adds a round before them
    /// that primes its forwarding between nodes). 0 or
    /// `NCCL_RESHARD_UNDEF_INT`: chosen from the tensors' sizes (about 2.7 GiB per rank and
    /// round, at most 32; 4 GiB before 0.18). Groupable plans always have one round. Since 0.2.
    pub rounds: c_int,
    /// Staged and auto modes with a known topology: 1 sends data that several replicas on one
    /// node need across the network once and forwards it within the node, 0 sends it to each
    /// replica from a source rank. `NCCL_RESHARD_UNDEF_INT`: 1. Since 0.2.
    pub relay: c_int,
    /// The deadline of each call of the plan, in milliseconds: a call whose work has not
    /// completed by then (counted from when its stream reaches it) revokes the communicator so
    /// that nothing waits longer, and reports the failure through `ncclReshardCommGetStatus`
    /// and `ncclReshardCommWait` (docs/resilience.md). 0: no deadline; negative values are
    /// refused; `NCCL_RESHARD_UNDEF_INT`: `NCCL_RESHARD_TIMEOUT_MS`, else no deadline. Not
    /// part of the plan's fingerprint. Since 0.5.
    pub timeoutMs: c_int,
    /// NULL, or `failedRankCount` ranks (of the communicator the descriptors number ranks in)
    /// that are gone: the plan is then the survivors' plan, with ranks renumbered as
    /// `ncclCommShrink` renumbers them (each survivor's rank less the failed ranks below it),
    /// failed destination ranks receiving nothing and failed sources' data taken from a
    /// surviving replica; `rank` is this rank's rank among the survivors. Every survivor must
    /// pass the same list. Read during `ncclReshardPlanCreate`. Since 0.5.
    pub failedRanks: *const c_int,
    /// Entries in `failedRanks` (non-negative); ignored when `failedRanks` is NULL. Since 0.5.
    pub failedRankCount: c_int,
    /// Staged and auto plans of several rounds with a known topology: 1 makes the ranks of a
    /// node that only send (in some tensor's source mesh, in no destination mesh) enter each
    /// round together, after a barrier of 8-byte messages among them (docs/executor.md,
    /// "The senders' barrier"); every such rank must then call the plan, also one with no
    /// data to send. 0: no barrier. `NCCL_RESHARD_UNDEF_INT`: a barrier where a node holds
    /// more than 8 such ranks (a multi-node NVLink domain such as GB200 NVL72's). Since 0.17.
    pub senderBarrier: c_int,
}

/// What a plan does on its rank (`ncclReshardPlanGetInfo`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclReshardPlanInfo_t {
    /// Set by the caller to `sizeof(ncclReshardPlanInfo_t)` (the initializer does), at least
    /// the 0.1 struct's (which ends before `rounds`). The library writes at most that many
    /// bytes and leaves `size` as it is.
    pub size: usize,
    /// Written by the library: its own `NCCL_RESHARD_VERSION_CODE`.
    pub version: c_uint,
    /// The plan's rank.
    pub rank: c_int,
    /// Number of tensors the plan was created with (`ncclReshardPlanCreate`'s `ntensors`).
    pub ntensors: c_int,
    /// The configured `ncclReshardMode_t`.
    pub mode: c_int,
    /// 1 when the plan was created in `ncclReshardModeGroupable`: its calls may sit inside
    /// `ncclGroupStart/End` (the same on every rank).
    pub groupable: c_int,
    /// Number of distinct peers this rank sends to or receives from.
    pub peers: c_int,
    /// NCCL sends one call of the plan posts on this rank, over every round (the per-call
    /// fingerprint exchange not counted).
    pub messagesSent: i64,
    /// NCCL receives one call of the plan posts on this rank, over every round (the per-call
    /// fingerprint exchange not counted).
    pub messagesReceived: i64,
    /// Bytes this rank sends to other ranks per call, over every round, forwards of relayed
    /// data included: the sum of `bytes` of its send transfers.
    pub bytesSent: u64,
    /// Bytes this rank receives from other ranks per call, over every round: the sum of
    /// `bytes` of its receive transfers.
    pub bytesReceived: u64,
    /// Bytes copied locally (colocated source and destination on this rank).
    pub bytesCopied: u64,
    /// Staging arena bytes the plan addresses (packs and unpacks): the most a call takes,
    /// single-buffer calls (whose receives may land in place) or per-tensor calls.
    pub stagingBytes: u64,
    /// Equal on all ranks iff they created the plan from the same descriptors and config.
    pub fingerprint: u64,
    /// Bytes of `sendbuff` a single-buffer `ncclReshard` call reads at most: the end of this
    /// rank's furthest source view (`srcOffset` + extent); 0 on a rank without source views.
    pub sendBytes: u64,
    /// Bytes of `recvbuff` a single-buffer `ncclReshard` call writes at most: the end of this
    /// rank's furthest destination or scale view (`dstOffset` or `scaleOffset` + extent); 0 on
    /// a rank without destination views.
    pub recvBytes: u64,
    /// Rounds this rank runs (each: packs, one NCCL group, unpacks); 1 for a groupable plan.
    /// Added in 0.2: an older caller's smaller struct does not get it.
    pub rounds: c_int,
    /// Tensors with scales (quantized tensors): `ncclReshardMulti`'s `recvbuffs` holds
    /// `ntensors + scaleTensors` entries. Added in 0.4.
    pub scaleTensors: c_int,
    /// Bytes of conversion workspace a call allocates on this rank (with its staging, from
    /// the same pool): converted source data and received data waiting for conversion.
    /// Added in 0.4.
    pub workBytes: u64,
}

/// One transfer of the plan's rank (`ncclReshardPlanGetTransfers`): a strided byte copy from a
/// view of the sender to the receiver's destination view, the round it runs in, and which data
/// it carries.
///
/// **The copy.** `chunkBytes` contiguous bytes at every point of a `copyNdim`-dim grid
/// (`count[k]` points along axis k, outermost first): grid point `i` is read at
/// `srcOffset + Σ i[k]·srcStride[k]` of the sender's `srcView` of `tensor` and written at
/// `dstOffset + Σ i[k]·dstStride[k]` of the receiver's destination view of `tensor`; `bytes`
/// is the total. Offsets and strides are in
/// bytes, relative to the views (in a single-buffer `ncclReshard` call a view starts at the
/// buffer plus the tensor's `srcOffset` or `dstOffset`: the sender's `dstOffset` when `srcView`
/// is `ncclReshardViewDestination`). A transport needs nothing else to move the data, and the
/// grid's chunks in row-major order are the transfer's bytes in order.
///
/// **The data.** The plan moves *blocks*: boxes of the global tensor, `globalStart[d] ..
/// globalStart[d] + globalCount[d]` for d < `ndim`, contiguous per dim in both ranks' views. A
/// block's `blockBytes` bytes are its elements in row-major order of the box (element i is
/// bytes `i·elemSize .. (i+1)·elemSize`). A transfer moves bytes `blockOffset .. blockOffset +
/// bytes` of its block. A block travels whole (`blockOffset` 0, `bytes` = `blockBytes`) unless
/// the plan's rounds cut it: staged and auto plans of several rounds cut each peer pair's data
/// into per-round chunks at byte positions, so one block may be several transfers, in one or
/// several rounds, whose byte ranges tile it. Such a piece need not be a box of the tensor nor
/// hold whole elements; `globalStart`/`globalCount` always describe the whole block.
///
/// **Execution rule.** A transfer of round r may start once every receive of rounds < r on this
/// rank has completed; nothing else orders transfers: the sends, receives and local copies of
/// one round may run in any order or concurrently (a transport whose sends wait for the
/// matching receive must post a round's receives before waiting on its sends, as NCCL does in
/// one group). Local copies have round 0 and read the source view. A send with `srcView` =
/// `ncclReshardViewDestination` forwards bytes this rank received in an earlier round (relays:
/// staged and auto plans with a topology and `config.relay` = 1); the rule is what makes them
/// present. Every
/// destination byte is written by exactly one transfer, and the only bytes one transfer reads
/// that another writes are those a forward reads, written by a receive of an earlier round on
/// the forwarding rank: the rule is all the ordering a transport must respect.
///
/// **Matching.** A send from rank A to rank B and B's receive from A carry the same round and
/// the same fields except `kind` and `peer`; among one pair's transfers of one round, A's sends
/// to B and B's receives from A come in the same order. Every round's sends and receives match
/// one to one across the plans of all ranks.
///
/// **Conversions** (tensors with a `dstDtype` or `quant`, docs/quantization.md). Blocks a
/// sender converts travel in `dstDtype`, read from the sender's `ncclReshardViewConverted`
/// view; blocks a receiver converts travel in the tensor's `dtype` into its
/// `ncclReshardViewUnconverted` view (`dstView`); `srcDtype`/`dstDtype` say which. A scaled
/// tensor's scales travel from the sender's `ncclReshardViewScales` to the receiver's scale
/// view, with `tensor` = ntensors + k for the k-th tensor with scales (that view is
/// `recvbuffs[ntensors + k]`, or `recvbuff` + its `scaleOffset`) and `globalStart`/`globalCount`
/// indices of its block grid, in the plan's last round of data (since 0.14; before, anywhere in
/// the pair's rounds). A convert transfer (`ncclReshardTransferConvert`, `peer` = the
/// rank) converts the box `globalStart`/`globalCount` of `tensor`, whole quantization blocks:
/// `count[k]` elements along each dim k < `copyNdim` (= `ndim`), element `i` read at
/// `srcOffset + Σ i[k]·srcStride[k]` of `srcView` (Source or Unconverted) as `srcDtype` and
/// written at `dstOffset + Σ i[k]·dstStride[k]` of `dstView` (Converted or Destination) as
/// `dstDtype`, the scale of block `b` (its index within the box) at `scaleOffset + Σ
/// b[k]·scaleStride[k]` of `scaleView`, by the tensor's `quant`; `chunkBytes` is 0 and `bytes`
/// the bytes written. Ordering: a convert transfer reading the Source view has the round of
/// the first of the rank's transfers that reads what it writes (its Converted or Scales
/// bytes; the rank's last round if none does), is listed before that round's transfers, and
/// must be done before the rank's transfers that read it start (it may run beside the rounds
/// before; since 0.13 a box is cut by the round that first reads it, until then every such
/// convert had round 0); one reading the Unconverted view has a round one past the rank's last
/// and runs after every receive.
///
/// `round`, `srcView`, `blockOffset` and `blockBytes` were added in 0.2: a caller whose struct
/// is the older size gets the other fields only. Its copies are still exact, and without
/// forwards (groupable mode, no topology, or `config.relay` = 0) every transfer reads the source
/// view and the order of transfers does not matter for the data; for a plan with forwards
/// `ncclReshardPlanGetTransfers` refuses such a struct.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ncclReshardTransfer_t {
    /// Set by the caller in the array's first struct (the initializer does): every struct is
    /// taken to be that size, at most that many bytes of each are written, and `size` is left
    /// as it is. Below the 0.1 struct's it is refused (`ncclInvalidArgument`); below 0.2's for
    /// a plan with forwards and below 0.4's for a plan that converts (`ncclInvalidUsage`).
    pub size: usize,
    /// Written by the library: its own `NCCL_RESHARD_VERSION_CODE`.
    pub version: c_uint,
    /// An `ncclReshardTransferKind_t`.
    pub kind: c_int,
    /// The other rank (this rank for a local copy).
    pub peer: c_int,
    /// The tensor whose data the transfer carries: its index in `ncclReshardPlanCreate`'s
    /// `tensors`, or `ntensors + k` for the scales of the k-th tensor with scales.
    pub tensor: c_int,
    /// Dims of the block, the tensor's `ndim`: the number of `globalStart`/`globalCount`
    /// entries that count (later ones are 0).
    pub ndim: c_int,
    /// The block's first global index along each dim d < `ndim`, in elements (for scales, in
    /// blocks of the scale grid).
    pub globalStart: [i64; NCCL_RESHARD_MAX_DIMS],
    /// The block's extent along each dim d < `ndim`, in elements (for scales, in blocks).
    pub globalCount: [i64; NCCL_RESHARD_MAX_DIMS],
    /// Byte offset of the first grid point (a convert transfer: the box's first element) in
    /// the sender's `srcView` of `tensor`.
    pub srcOffset: u64,
    /// Byte offset of the first grid point (a convert transfer: the box's first element) in
    /// the receiver's `dstView` of `tensor`.
    pub dstOffset: u64,
    /// Contiguous bytes copied at each grid point; 0 for a convert transfer.
    pub chunkBytes: u64,
    /// Axes of the copy grid, 0 (one chunk) to `NCCL_RESHARD_MAX_DIMS`; for a convert transfer,
    /// the box's dims (= `ndim`). `count`, `srcStride` and `dstStride` hold that many entries.
    pub copyNdim: c_int,
    /// Grid points along each axis k < `copyNdim`, outermost first (a convert transfer:
    /// elements along dim k).
    pub count: [i64; NCCL_RESHARD_MAX_DIMS],
    /// Bytes between neighbouring grid points along axis k in the sender's view (a convert
    /// transfer: between elements along dim k of `srcView`).
    pub srcStride: [i64; NCCL_RESHARD_MAX_DIMS],
    /// Bytes between neighbouring grid points along axis k in the receiver's view (a convert
    /// transfer: between elements along dim k of `dstView`).
    pub dstStride: [i64; NCCL_RESHARD_MAX_DIMS],
    /// Bytes the transfer moves, `chunkBytes` times the product of `count`; for a convert
    /// transfer, the bytes it writes (values, then scales).
    pub bytes: u64,
    /// The round (see the execution rule), equal on both ends of a send and its receive.
    pub round: c_int,
    /// An `ncclReshardView_t`: the sender's view `srcOffset` and `srcStride` address.
    pub srcView: c_int,
    /// Where the transfer's bytes sit in its block's bytes.
    pub blockOffset: u64,
    /// The whole block's bytes (all transfers of the block together).
    pub blockBytes: u64,
    /// An `ncclReshardView_t`: the receiver's view `dstOffset` and `dstStride` address
    /// (`ncclReshardViewDestination`, or `ncclReshardViewUnconverted` for data a receiver
    /// converts; for a convert transfer, the view it writes). Added in 0.4, as the fields
    /// below.
    pub dstView: c_int,
    /// The element type read (`ncclDataType_t`): the tensor's `dtype` for data that travels
    /// unconverted, its `dstDtype` for data its sender converted, `ncclUint8` for scales; for
    /// a convert transfer, the type it converts from.
    pub srcDtype: c_int,
    /// The element type written (`ncclDataType_t`): `srcDtype` for every transfer but a
    /// convert transfer, for which it is the type converted to (the tensor's `dstDtype`).
    pub dstDtype: c_int,
    /// Convert transfers of quantized tensors: the view the box's block scales go to
    /// (`ncclReshardViewScales` on a sender, `ncclReshardViewDestination` = the scale view on a
    /// receiver). Other transfers hold `ncclReshardViewDestination`, to be ignored.
    pub scaleView: c_int,
    /// Convert transfers of quantized tensors: byte offset of the box's first block's scale in
    /// `scaleView`; 0 otherwise.
    pub scaleOffset: u64,
    /// Convert transfers of quantized tensors: bytes between the scales of neighbouring blocks
    /// along each dim k < `copyNdim` in `scaleView`; ignore it otherwise.
    pub scaleStride: [i64; NCCL_RESHARD_MAX_DIMS],
}
