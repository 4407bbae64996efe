//! The `plan_create` harness: bytes → C-ABI descriptors → every plan entry point of the C API.
//!
//! The decoder keeps the *shape* of an input small (at most [`MAX_TENSORS`] tensors sharing up
//! to [`MAX_LAYOUTS`] layouts, small rank tables) so that valid plans are quick, but any field
//! it hands the library may be hostile: wrong `size`/`magic`, NULL pointers, negative counts,
//! sizes near 2^63. It honours the C contract itself — every non-NULL pointer is valid for
//! the length the descriptor states — so a crash is the library's, not the harness's.
//!
//! The structs are built from all-zero values with each field set by name, so fields appended
//! in later versions start as zero (a C caller's `= {0}`) and, now and then, get input bytes.
//!
//! Besides "no crash, no panic, no abort", it checks what the header documents: a failing
//! call leaves its outputs untouched and sets a last-error text, no call reports
//! `ncclInternalError` (the panic boundary's code), and what a plan reports is consistent
//! (rank and tensor count, transfer byte counts, local shapes against their index runs).

use ncclreshard::ffi::*;
use std::ffi::{CStr, CString};
use std::mem::{offset_of, size_of};
use std::os::raw::{c_char, c_int, c_uint};
use std::ptr;

const NCCL_SUCCESS: ncclResult_t = 0;
const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
const MAX_DIMS: usize = NCCL_RESHARD_MAX_DIMS;

/// Most tensors in one input.
pub const MAX_TENSORS: usize = 4;
/// Most distinct layouts the tensors of one input share.
pub const MAX_LAYOUTS: usize = 3;
/// Largest mesh the decoder gives an explicit rank table (larger ones use `firstRank`).
const MAX_RANK_TABLE: u64 = 256;
/// Most ranks the library accepts in one mesh; larger meshes must be refused.
const LIBRARY_MAX_MESH: u64 = 1 << 20;
/// Largest accepted mesh the decoder lets through. Planning is linear in the mesh size (about
/// a microsecond a rank per layout, per call), so a million-rank mesh is correct but takes
/// seconds, which would drown the search; accepted sizes above this are shrunk, while sizes
/// the library must refuse (negative, zero, overflowing, over its limit) pass unchanged.
const MAX_QUICK_MESH: u64 = 1 << 12;
/// Largest `size` the library accepts for a versioned struct; the harness backs any declared
/// size up to this with real memory, and larger ones (which no caller can own) with the
/// struct alone.
const MAX_STRUCT_SIZE: usize = 1 << 20;
/// Most transfers whose full list the harness asks for (the count query is always made).
const MAX_FILLED_TRANSFERS: usize = 1 << 14;
/// Most index runs the harness allocates room for in `ncclReshardLocalShape`.
const MAX_FILLED_RUNS: usize = 1 << 16;
/// Byte every output buffer starts with, to see what a call wrote.
const UNTOUCHED: u8 = 0xa5;

/// Edge values for 64-bit fields (shapes, split factors, strides).
const HOSTILE_I64: [i64; 15] = [
    0,
    -1,
    -2,
    i64::MIN,
    i64::MAX,
    1 << 16,
    (1 << 16) + 1,
    1 << 20,
    (1 << 20) + 1,
    1 << 31,
    1 << 32,
    1 << 40,
    1 << 62,
    u32::MAX as i64,
    3,
];

/// Edge values for `int` fields (counts, ranks, kinds, modes, dims).
const HOSTILE_I32: [i32; 15] = [
    0,
    -1,
    -2,
    i32::MIN,
    i32::MAX,
    i32::MAX - 1,
    8,
    9,
    1 << 16,
    1 << 20,
    (1 << 20) + 1,
    1 << 24,
    255,
    256,
    1 << 30,
];

/// Edge values for `size_t` fields (offsets, byte bounds).
const HOSTILE_USIZE: [usize; 15] = [
    0,
    1,
    usize::MAX,
    usize::MAX - 1,
    1 << 63,
    (1 << 63) - 1,
    (1 << 63) - 4096,
    1 << 62,
    1 << 32,
    u32::MAX as usize,
    1 << 40,
    4095,
    4097,
    7,
    1 << 20,
];

/// Reads the fuzz input as a stream of decisions. Past the end every byte reads as 0, the
/// most ordinary choice, so any prefix of an input is itself an input.
struct Decisions<'a> {
    data: &'a [u8],
}

impl Decisions<'_> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn raw<const N: usize>(&mut self) -> [u8; N] {
        let mut bytes = [0u8; N];
        bytes.iter_mut().for_each(|b| *b = self.byte());
        bytes
    }

    /// True about `in_256` times in 256 (never past the end of the input).
    fn rare(&mut self, in_256: u8) -> bool {
        self.byte() >= 255 - in_256.saturating_sub(1)
    }

    /// One byte: below 240, `typical(byte)`; otherwise entry `byte - 240` of `hostile`, or,
    /// for the last slot, raw bytes from the input.
    fn pick<T: Copy>(&mut self, typical: impl FnOnce(u8) -> T, hostile: &[T; 15]) -> Option<T> {
        match self.byte() {
            b @ 0..=239 => Some(typical(b)),
            b if usize::from(b - 240) < hostile.len() => Some(hostile[usize::from(b - 240)]),
            _ => None,
        }
    }

    fn i64(&mut self, typical: impl FnOnce(u8) -> i64) -> i64 {
        match self.pick(typical, &HOSTILE_I64) {
            Some(v) => v,
            None => i64::from_le_bytes(self.raw()),
        }
    }

    fn int(&mut self, typical: impl FnOnce(u8) -> i32) -> c_int {
        match self.pick(typical, &HOSTILE_I32) {
            Some(v) => v,
            None => i32::from_le_bytes(self.raw()),
        }
    }

    fn usize(&mut self, typical: impl FnOnce(u8) -> usize) -> usize {
        match self.pick(typical, &HOSTILE_USIZE) {
            Some(v) => v,
            None => u64::from_le_bytes(self.raw()) as usize,
        }
    }

    /// A struct's `size` field: usually the real size, sometimes one that is too small, too
    /// large, unaligned or absurd.
    fn struct_size(&mut self, real: usize) -> usize {
        let hostile = [
            0,
            8,
            real - 8,
            real - 1,
            real + 1,
            real + 8,
            real + 64,
            4096,
            MAX_STRUCT_SIZE,
            MAX_STRUCT_SIZE + 1,
            usize::MAX,
            1 << 32,
            real,
            real,
            real,
        ];
        self.pick(|_| real, &hostile).unwrap_or(real)
    }

    /// A `version` field: the header's, or raw bytes.
    fn version(&mut self) -> c_uint {
        if self.rare(8) {
            u32::from_le_bytes(self.raw())
        } else {
            NCCL_RESHARD_VERSION_CODE as c_uint
        }
    }
}

/// Caller memory: 8-aligned words, prefilled with [`UNTOUCHED`].
#[derive(Clone, PartialEq, Eq)]
struct Memory {
    words: Vec<u64>,
}

impl Memory {
    fn new(bytes: usize) -> Memory {
        Memory {
            words: vec![u64::from_ne_bytes([UNTOUCHED; 8]); bytes.div_ceil(8).max(1)],
        }
    }

    /// Room for a versioned struct of real size `real` whose `size` field says `declared`.
    fn for_struct(real: usize, declared: usize) -> Memory {
        let bytes = if declared <= MAX_STRUCT_SIZE {
            declared.max(real)
        } else {
            real
        };
        Memory::new(bytes)
    }

    fn len(&self) -> usize {
        self.words.len() * 8
    }

    /// Now and then, overwrites the bytes of the `T` at the start of this memory from `known`
    /// (the end of the last field the harness sets) to the end of `T` with input bytes, so that
    /// fields appended to the struct in later versions are fuzzed without being named here.
    /// Otherwise they stay zero, as in a C caller's `= {0}`.
    fn appended_fields<T>(&mut self, known: usize, input: &mut Decisions) {
        if input.rare(32) {
            for at in known..size_of::<T>() {
                self.put(at, input.byte());
            }
        }
    }

    fn put<T: Copy>(&mut self, at: usize, value: T) {
        assert!(at + size_of::<T>() <= self.len());
        // SAFETY: the assertion keeps the write inside the buffer; unaligned writes are allowed.
        unsafe { ptr::write_unaligned(self.words.as_mut_ptr().cast::<u8>().add(at).cast(), value) };
    }

    fn get<T: Copy>(&self, at: usize) -> T {
        assert!(at + size_of::<T>() <= self.len());
        // SAFETY: as in `put`; the harness reads only plain-data C structs (any bits valid).
        unsafe { ptr::read_unaligned(self.words.as_ptr().cast::<u8>().add(at).cast()) }
    }

    fn ptr<T>(&self) -> *const T {
        self.words.as_ptr().cast()
    }

    fn mut_ptr<T>(&mut self) -> *mut T {
        self.words.as_mut_ptr().cast()
    }
}

/// The element size of an `ncclDataType_t`, from nccl.h (an oracle independent of the
/// library's own table).
fn elem_size(dtype: ncclDataType_t) -> Option<u64> {
    match dtype {
        0 | 1 | 10 | 11 => Some(1),
        6 | 9 => Some(2),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        _ => None,
    }
}

fn last_error() -> String {
    let text = ncclReshardGetLastError();
    assert!(!text.is_null(), "ncclReshardGetLastError returned NULL");
    // SAFETY: the library returns a NUL-terminated string valid until its next failing call.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// Checks a call's result: never the panic boundary's code, and a failure leaves a message.
fn returned(call: &str, result: ncclResult_t) -> bool {
    assert_ne!(
        result,
        NCCL_INTERNAL_ERROR,
        "{call} reported an internal error: {}",
        last_error()
    );
    if result != NCCL_SUCCESS {
        let message = last_error();
        assert!(
            !message.is_empty(),
            "{call} returned {result} without a last-error message"
        );
    }
    result == NCCL_SUCCESS
}

/// Everything the descriptors of one input point to, kept alive across the calls.
struct Descriptors {
    /// The layouts, each in memory sized by its own `size` field.
    layouts: Vec<Memory>,
    /// The rank tables and stride arrays the layouts point to.
    _tables: Vec<Vec<c_int>>,
    _strides: Vec<Vec<i64>>,
    _names: Vec<CString>,
    /// The tensor array, elements `tensors[0].size` bytes apart.
    tensors: Memory,
    /// Copies of what was written into `tensors` (for the checks after the calls).
    tensor_values: Vec<ncclReshardTensor_t>,
    ntensors: c_int,
    config: Option<Memory>,
    _node_table: Vec<c_int>,
    /// The failed ranks the config points to.
    _failed: Vec<c_int>,
    rank: c_int,
    /// The quant structs tensors point to, boxed so that their addresses stay put while the
    /// vector grows.
    #[allow(clippy::vec_box)]
    _quants: Vec<Box<ncclReshardQuant_t>>,
}

fn decode_layout(
    input: &mut Decisions,
    tables: &mut Vec<Vec<c_int>>,
    strides: &mut Vec<Vec<i64>>,
) -> Memory {
    let real = size_of::<ncclReshardLayout_t>();
    let size = input.struct_size(real);
    let mesh_ndim = input.int(|b| i32::from(b % 3) + 1);
    let mut mesh_shape = [0i64; MAX_DIMS];
    let mut placements = [ncclReshardPlacement_t::default(); MAX_DIMS];
    let axes = usize::try_from(mesh_ndim).map_or(0, |n| n.min(MAX_DIMS));
    for axis in 0..axes {
        mesh_shape[axis] = input.i64(|b| i64::from(b % 4) + 1);
        placements[axis] = ncclReshardPlacement_t {
            // ShardBlocks (3) for the top bytes only, so that inputs saved before it existed
            // still decode as they did.
            kind: input.int(|b| if b >= 250 { 3 } else { i32::from(b % 3) }),
            dim: input.int(|b| i32::from(b % 4)),
            splitFactor: input.i64(|b| i64::from(b % 4) + 1),
        };
    }
    let mesh_size = |shape: &[i64]| {
        (axes >= 1)
            .then(|| {
                shape[..axes].iter().try_fold(1u64, |acc, &n| {
                    u64::try_from(n).ok().and_then(|n| acc.checked_mul(n))
                })
            })
            .flatten()
    };
    while mesh_size(&mesh_shape).is_some_and(|n| n > MAX_QUICK_MESH && n <= LIBRARY_MAX_MESH) {
        let widest = (0..axes).max_by_key(|&a| mesh_shape[a]).unwrap_or(0);
        mesh_shape[widest] = (mesh_shape[widest] + 1) / 2;
    }
    // A rank table must hold one entry per mesh position (the C contract); meshes too large
    // for a small table, or whose size the library rejects before reading it, use firstRank.
    let positions = mesh_size(&mesh_shape).filter(|&n| n <= MAX_RANK_TABLE);
    let first_rank = input.int(|b| i32::from(b % 8));
    let ranks = match positions {
        Some(n) if input.byte() % 2 == 1 => {
            // A permutation of first_rank.. with a few swaps, then perhaps a duplicate or a
            // hostile entry.
            let base = first_rank.clamp(0, 64);
            let mut table: Vec<c_int> = (0..n as c_int).map(|i| base + i).collect();
            for _ in 0..input.byte() % 4 {
                if n > 1 {
                    let (a, b) = (input.byte() as usize, input.byte() as usize);
                    table.swap(a % n as usize, b % n as usize);
                }
            }
            if n > 0 && input.rare(16) {
                let at = input.byte() as usize % n as usize;
                table[at] = input.int(|b| i32::from(b % 16));
            }
            tables.push(table);
            tables.last().map_or(ptr::null(), |t| t.as_ptr())
        }
        _ => ptr::null(),
    };
    let strides_ptr = if input.rare(24) {
        // Room for every ndim LocalShape is called with (see `local_shape`).
        let values: Vec<i64> = (0..2 * MAX_DIMS)
            .map(|_| input.i64(|b| i64::from(b % 64) + 1))
            .collect();
        strides.push(values);
        strides.last().map_or(ptr::null(), |s| s.as_ptr())
    } else {
        ptr::null()
    };
    // SAFETY: all-zero bytes are a valid layout (integers, arrays, NULL pointers).
    let mut layout: ncclReshardLayout_t = unsafe { std::mem::zeroed() };
    layout.size = size;
    layout.version = input.version();
    layout.meshNdim = mesh_ndim;
    layout.meshShape = mesh_shape;
    layout.ranks = ranks;
    layout.firstRank = first_rank;
    layout.placements = placements;
    layout.strides = strides_ptr;
    let mut memory = Memory::for_struct(real, size);
    memory.put(0, layout);
    let known = offset_of!(ncclReshardLayout_t, strides) + size_of::<*const i64>();
    memory.appended_fields::<ncclReshardLayout_t>(known, input);
    memory
}

fn decode_config(input: &mut Decisions, node_table: &mut Vec<c_int>) -> Option<Memory> {
    if input.rare(64) {
        return None;
    }
    let real = size_of::<ncclReshardConfig_t>();
    let size = input.struct_size(real);
    let magic = if input.rare(8) {
        u32::from_le_bytes(input.raw())
    } else {
        NCCL_RESHARD_CONFIG_MAGIC
    };
    let (node_of_rank, node_of_rank_count) = if input.rare(48) {
        let n = usize::from(input.byte() % 17);
        *node_table = (0..n).map(|_| input.int(|b| i32::from(b % 4))).collect();
        // The count may understate the table or be negative, never overstate it.
        let count = match input.byte() {
            0..=223 => n as c_int,
            224..=239 => (n as c_int - 1).max(0),
            b if b % 2 == 0 => -1,
            _ => i32::MIN,
        };
        (node_table.as_ptr(), count)
    } else {
        (ptr::null(), 0)
    };
    const BYTES: [usize; 8] = [0, 1, 2, 3, 64, 4096, 1 << 20, 1 << 30];
    // SAFETY: all-zero bytes are a valid config (integers and NULL pointers).
    let mut config: ncclReshardConfig_t = unsafe { std::mem::zeroed() };
    config.size = size;
    config.magic = magic;
    config.version = input.version();
    config.mode = input.int(|b| i32::from(b % 3));
    config.ranksPerNode = input.int(|b| i32::from(b % 5));
    config.nodeOfRank = node_of_rank;
    config.nodeOfRankCount = node_of_rank_count;
    config.splitMinBytes = input.usize(|b| BYTES[usize::from(b % 8)]);
    config.maxStagingBytes = input.usize(|b| BYTES[usize::from(b % 8)]);
    let mut memory = Memory::for_struct(real, size);
    memory.put(0, config);
    let known = offset_of!(ncclReshardConfig_t, maxStagingBytes) + size_of::<usize>();
    memory.appended_fields::<ncclReshardConfig_t>(known, input);
    Some(memory)
}

fn decode(input: &mut Decisions) -> Descriptors {
    let mut tables = Vec::new();
    let mut strides = Vec::new();
    let nlayouts = usize::from(input.byte()) % MAX_LAYOUTS + 1;
    let layouts: Vec<Memory> = (0..nlayouts)
        .map(|_| decode_layout(input, &mut tables, &mut strides))
        .collect();

    let real = size_of::<ncclReshardTensor_t>();
    let declared = input.struct_size(real);
    // The library steps through the array by tensors[0].size; it reads further elements only
    // when that size is acceptable, so other sizes need room for element 0 alone.
    let stride = if (real..=MAX_STRUCT_SIZE).contains(&declared) {
        declared
    } else {
        real
    };
    let count = usize::from(input.byte()) % MAX_TENSORS + 1;
    // A hostile count never claims more tensors than the array holds.
    let ntensors = match input.byte() {
        0..=239 => count as c_int,
        240..=243 => 0,
        244..=247 => -1,
        248..=251 => i32::MIN,
        _ => (count as c_int - 1).max(0),
    };
    let mut names = Vec::new();
    let mut tensor_values = Vec::with_capacity(count);
    let mut tensors = Memory::new(count * stride + real);
    for i in 0..count {
        let ndim = input.int(|b| i32::from(b % 3) + 1);
        let mut shape = [0i64; MAX_DIMS];
        for extent in shape
            .iter_mut()
            .take(usize::try_from(ndim).map_or(0, |n| n.min(MAX_DIMS)))
        {
            *extent = input.i64(|b| i64::from(b % 13));
        }
        let side = |input: &mut Decisions| {
            if input.rare(4) {
                ptr::null()
            } else {
                layouts[usize::from(input.byte()) % nlayouts].ptr::<ncclReshardLayout_t>()
            }
        };
        let src = side(input);
        let dst = side(input);
        let name = if input.rare(16) {
            let text: Vec<u8> = (0..input.byte() % 8).map(|_| input.byte().max(1)).collect();
            names.push(CString::new(text).unwrap_or_default());
            names.last().map_or(ptr::null(), |n| n.as_ptr())
        } else {
            ptr::null::<c_char>()
        };
        // SAFETY: all-zero bytes are a valid tensor (integers, arrays, NULL pointers).
        let mut tensor: ncclReshardTensor_t = unsafe { std::mem::zeroed() };
        tensor.size = if i > 0 && input.rare(4) {
            input.struct_size(real)
        } else {
            declared
        };
        tensor.version = input.version();
        tensor.ndim = ndim;
        tensor.shape = shape;
        tensor.dtype = input.int(|b| i32::from(b % 12));
        tensor.src = src;
        tensor.dst = dst;
        tensor.srcOffset = input.usize(|b| usize::from(b % 4) * 4096);
        tensor.dstOffset = input.usize(|b| usize::from(b % 4) * 4096);
        tensor.name = name;
        // Zero would ask for a conversion to int8: the seeds predate conversions.
        tensor.dstDtype = NCCL_RESHARD_UNDEF_INT;
        tensors.put(i * stride, tensor);
        tensor_values.push(tensor);
    }
    let mut node_table = Vec::new();
    let mut config = decode_config(input, &mut node_table);
    let rank = input.int(|b| i32::from(b % 16));
    // Conversions last, so inputs written before they existed decode as before (an exhausted
    // input reads zeros: no conversion).
    let mut quants = Vec::new();
    for (i, tensor) in tensor_values.iter_mut().enumerate() {
        if !input.rare(48) {
            continue;
        }
        // float16, bfloat16, the FP8 types, or anything.
        tensor.dstDtype = input.int(|b| [6, 9, 10, 11][usize::from(b % 4)]);
        if input.rare(128) {
            let mut quant = Box::new(ncclReshardQuant_t {
                size: input.struct_size(size_of::<ncclReshardQuant_t>()),
                version: input.version(),
                scheme: input.int(|b| i32::from(b % 4)),
                blockRows: input.i64(|b| i64::from(b % 5)),
                blockCols: input.i64(|b| i64::from(b % 5)),
                scaleFormat: input.int(|b| i32::from(b % 2)),
                scaleInverse: input.int(|b| i32::from(b % 2)),
                scaleLayout: ptr::null(),
            });
            if input.rare(64) {
                quant.scaleLayout =
                    layouts[usize::from(input.byte()) % nlayouts].ptr::<ncclReshardLayout_t>();
            }
            tensor.quant = &*quant;
            quants.push(quant);
        }
        tensor.scaleOffset = input.usize(|b| usize::from(b % 4) * 4096);
        if tensor.size >= size_of::<ncclReshardTensor_t>() {
            tensors.put(i * stride, *tensor);
        }
    }
    // Failed ranks last too (a survivors' plan): a valid table or none, whatever random bytes
    // the config's appended fields got (a pointer must point somewhere the count covers).
    let mut failed = Vec::new();
    if let Some(config) = config.as_mut() {
        let at = offset_of!(ncclReshardConfig_t, failedRanks);
        let count_at = offset_of!(ncclReshardConfig_t, failedRankCount);
        if config.len() >= count_at + size_of::<c_int>() {
            let (table, count) = if input.rare(32) {
                let n = usize::from(input.byte() % 4);
                // Ranks 0-8, now and then -1 (refused) or a repeat (refused).
                failed = (0..n)
                    .map(|_| input.int(|b| i32::from(b % 10) - 1))
                    .collect();
                (failed.as_ptr(), n as c_int)
            } else {
                (ptr::null(), 0)
            };
            config.put(at, table);
            config.put(count_at, count);
        }
    }
    Descriptors {
        _quants: quants,
        _failed: failed,
        layouts,
        _tables: tables,
        _strides: strides,
        _names: names,
        tensors,
        tensor_values,
        ntensors,
        config,
        _node_table: node_table,
        rank,
    }
}

/// What one input reached, so replays can tell that the decoder still produces valid plans.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// `ncclReshardPlanCreate` succeeded.
    pub planned: bool,
    /// Transfers the plan reported.
    pub transfers: usize,
    /// `ncclReshardLocalShape` calls that succeeded.
    pub local_shapes: usize,
    /// Messages the plan's rank sends and receives (`ncclReshardPlanGetInfo`), when queried.
    pub messages: i64,
    /// The plan was created with some tensor asking for a conversion (`dstDtype` set).
    pub converts: bool,
}

/// Runs one input through the C API; panics when the library breaks a documented promise.
pub fn run(data: &[u8]) -> Outcome {
    let mut input = Decisions { data };
    let d = decode(&mut input);
    let mut outcome = Outcome::default();
    let rank = d.rank;
    let sentinel = ptr::NonNull::<ncclReshardPlan>::dangling().as_ptr();
    let mut plan: ncclReshardPlan_t = sentinel;
    let plan_out = if input.rare(4) {
        ptr::null_mut()
    } else {
        &mut plan as *mut ncclReshardPlan_t
    };
    let tensors = if input.rare(4) {
        ptr::null()
    } else {
        d.tensors.ptr::<ncclReshardTensor_t>()
    };
    let config = d
        .config
        .as_ref()
        .map_or(ptr::null(), |c| c.ptr::<ncclReshardConfig_t>());
    // SAFETY: every pointer is NULL or valid for what its descriptor states (see decode).
    let result = unsafe { ncclReshardPlanCreate(plan_out, d.ntensors, tensors, rank, config) };
    if returned("ncclReshardPlanCreate", result) {
        assert!(
            !plan.is_null() && plan != sentinel,
            "ncclReshardPlanCreate succeeded without a plan"
        );
        outcome.planned = true;
        outcome.converts = d
            .tensor_values
            .iter()
            .any(|t| t.dstDtype != NCCL_RESHARD_UNDEF_INT);
        plan_queries(plan, &d, &mut input, &mut outcome);
        // SAFETY: plan came from ncclReshardPlanCreate and is destroyed once.
        let destroyed = unsafe { ncclReshardPlanDestroy(plan) };
        assert!(returned("ncclReshardPlanDestroy", destroyed));
    } else {
        assert!(
            plan == sentinel,
            "a failing ncclReshardPlanCreate wrote *plan"
        );
    }
    // SAFETY: NULL is documented as a no-op.
    let destroyed = unsafe { ncclReshardPlanDestroy(ptr::null_mut()) };
    assert!(returned("ncclReshardPlanDestroy(NULL)", destroyed));

    let tensor_count = d.tensor_values.len();
    for t in &d.tensor_values[..tensor_count.min(2)] {
        for layout in [t.src, t.dst] {
            if local_shape(layout, t, rank, &mut input) {
                outcome.local_shapes += 1;
            }
        }
    }
    if let Some(first) = d.layouts.first() {
        // The same layout with a NULL shape array: invalid unless ndim is 0.
        let mut shape_out = [0i64; MAX_DIMS];
        // SAFETY: every non-NULL pointer holds MAX_DIMS entries and ndim is at most that.
        let result = unsafe {
            ncclReshardLocalShape(
                first.ptr(),
                1,
                ptr::null(),
                rank,
                shape_out.as_mut_ptr(),
                ptr::null_mut(),
                0,
                ptr::null_mut(),
            )
        };
        assert!(!returned("ncclReshardLocalShape(shape = NULL)", result));
    }
    outcome
}

/// Queries a created plan: its info and transfers, with good and bad output structs.
/// Records the transfer and message counts in `outcome`.
fn plan_queries(
    plan: ncclReshardPlan_t,
    d: &Descriptors,
    input: &mut Decisions,
    outcome: &mut Outcome,
) {
    let real = size_of::<ncclReshardPlanInfo_t>();
    let size = input.struct_size(real);
    let mut info = Memory::for_struct(real, size);
    info.put(0, size);
    let before = info.clone();
    // SAFETY: info holds at least the bytes its size field states (or the whole struct).
    let result = unsafe { ncclReshardPlanGetInfo(plan, info.mut_ptr()) };
    if returned("ncclReshardPlanGetInfo", result) {
        assert_eq!(info.get::<usize>(0), size, "GetInfo changed info.size");
        if size >= real {
            let got: ncclReshardPlanInfo_t = info.get(0);
            assert_eq!(got.rank, d.rank, "info.rank");
            assert_eq!(got.ntensors, d.ntensors, "info.ntensors");
            assert!((0..=2).contains(&got.mode), "info.mode {}", got.mode);
            outcome.messages = got.messagesSent.saturating_add(got.messagesReceived);
            assert!(
                info.words[real.div_ceil(8)..]
                    .iter()
                    .all(|&w| w == u64::from_ne_bytes([UNTOUCHED; 8])),
                "GetInfo wrote past the struct"
            );
        }
    } else {
        assert!(info == before, "a failing GetInfo wrote *info");
    }
    let mut spare = Memory::for_struct(real, real);
    spare.put(0, real);
    // SAFETY: NULL handles and NULL outputs are documented errors.
    unsafe {
        assert!(!returned(
            "ncclReshardPlanGetInfo(NULL plan)",
            ncclReshardPlanGetInfo(ptr::null_mut(), spare.mut_ptr())
        ));
        assert!(!returned(
            "ncclReshardPlanGetInfo(NULL info)",
            ncclReshardPlanGetInfo(plan, ptr::null_mut())
        ));
        assert!(!returned(
            "ncclReshardPlanGetTransfers(NULL count)",
            ncclReshardPlanGetTransfers(plan, ptr::null_mut(), 0, ptr::null_mut())
        ));
    }

    let mut count: c_int = -7;
    // SAFETY: with transfers NULL only *count is written.
    let result = unsafe { ncclReshardPlanGetTransfers(plan, ptr::null_mut(), 0, &mut count) };
    assert!(returned("ncclReshardPlanGetTransfers(count)", result));
    let total = usize::try_from(count).expect("a negative transfer count");
    outcome.transfers = total;
    if total > MAX_FILLED_TRANSFERS {
        return;
    }
    let real = size_of::<ncclReshardTransfer_t>();
    // The 0.1 struct (before `round`) is the smallest a caller may pass.
    let oldest = std::mem::offset_of!(ncclReshardTransfer_t, round);
    let mut size = input.struct_size(real);
    if (oldest..=MAX_STRUCT_SIZE).contains(&size) && total * size > 64 << 20 {
        size = real;
    }
    // An acceptable size is the array's stride; any other is refused before anything is
    // written, so the array needs room for real-sized elements only.
    let stride = if (oldest..=MAX_STRUCT_SIZE).contains(&size) {
        size
    } else {
        real
    };
    let short = input.rare(32) && total > 0;
    let capacity = if short { total - 1 } else { total };
    let mut array = Memory::new(total.max(1) * stride);
    array.put(0, size);
    let before = array.clone();
    let mut filled: c_int = -7;
    // SAFETY: array holds max(total, 1) elements of `stride` bytes, which covers what its
    // first element's size states unless that size is one the library must reject.
    let result = unsafe {
        ncclReshardPlanGetTransfers(plan, array.mut_ptr(), capacity as c_int, &mut filled)
    };
    if !returned("ncclReshardPlanGetTransfers(fill)", result) {
        assert!(array == before, "a failing GetTransfers wrote transfers");
        assert_eq!(filled, -7, "a failing GetTransfers wrote *count");
        // A struct without srcView is refused for a plan with forwards (relays).
        let without_views = size < std::mem::offset_of!(ncclReshardTransfer_t, srcView) + 4
            && last_error().contains("forwards relayed data");
        // A struct from before 0.4 (without dstView, the dtypes and the scale fields) is
        // refused for a plan that converts tensors on the way.
        let without_dtypes = size < real && last_error().contains("converts tensors on the way");
        assert!(
            short || stride != size || size < oldest || without_views || without_dtypes,
            "GetTransfers refused a large enough array: {}",
            last_error()
        );
        return;
    }
    assert!(!short, "GetTransfers accepted a capacity below the count");
    assert_eq!(filled, count, "the fill's count differs from the query's");
    if stride == size && size == real {
        for i in 0..total {
            check_transfer(&array.get(i * stride), d);
        }
    }
}

fn check_transfer(t: &ncclReshardTransfer_t, d: &Descriptors) {
    let ntensors = d.tensor_values.len();
    // Tensors, then (plans that quantize) one scale tensor per quantized tensor at most.
    let tensor = usize::try_from(t.tensor)
        .ok()
        .filter(|&i| i < 2 * ntensors)
        .unwrap_or_else(|| panic!("transfer of tensor {} of {ntensors}", t.tensor));
    // Scale blocks read a sender's scale grid (view 4) and name the scale tensor, numbered
    // after the plan's tensors (which may be fewer than the harness described).
    let scale = t.kind != 3 && t.srcView == 4;
    assert!(
        scale || tensor < ntensors,
        "transfer of tensor {tensor} of {ntensors}"
    );
    let spec = &d.tensor_values[tensor % ntensors];
    if !scale {
        assert_eq!(t.ndim, spec.ndim, "transfer ndim");
    }
    match t.kind {
        2 | 3 => assert_eq!(t.peer, d.rank, "a local copy's or conversion's peer: {t:?}"),
        0 | 1 => assert_ne!(t.peer, d.rank, "a send or receive to itself"),
        other => panic!("transfer kind {other}"),
    }
    let copy_ndim = usize::try_from(t.copyNdim)
        .ok()
        .filter(|&n| n <= MAX_DIMS)
        .unwrap_or_else(|| panic!("copyNdim {}", t.copyNdim));
    let ndim = t.ndim as usize;
    if !scale {
        for dim in 0..ndim {
            let end = t.globalStart[dim].checked_add(t.globalCount[dim]);
            assert!(
                t.globalStart[dim] >= 0 && end.is_some_and(|e| e <= spec.shape[dim]),
                "box outside the tensor on dim {dim}: {t:?}"
            );
        }
    }
    if t.kind == 3 {
        // A conversion: a box of elements, read in srcDtype and written in dstDtype.
        assert_eq!(copy_ndim, ndim, "a conversion's copyNdim: {t:?}");
        let elements = t.count[..copy_ndim]
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64));
        let dst = elem_size(t.dstDtype).expect("a conversion writes a sized dtype");
        assert!(elem_size(t.srcDtype).is_some(), "a conversion reads {t:?}");
        // `bytes` is what it writes: the box in dstDtype, then its blocks' scales.
        let values = elements.and_then(|e| e.checked_mul(dst));
        assert!(
            values.is_some_and(|v| v > 0 && v <= t.bytes),
            "a conversion's bytes do not hold its box in dstDtype: {t:?}"
        );
        assert!(
            (0..=4).contains(&t.srcView) && (0..=4).contains(&t.dstView),
            "{t:?}"
        );
        assert!(t.round >= 0, "round {}", t.round);
        return;
    }
    let grid = t.count[..copy_ndim]
        .iter()
        .try_fold(t.chunkBytes, |acc, &n| acc.checked_mul(n as u64));
    assert_eq!(
        grid,
        Some(t.bytes),
        "bytes is not chunkBytes × counts: {t:?}"
    );
    // The bytes' element type: the tensor's dtype, or with conversions the dtype they move
    // in (dstDtype; scales as bytes).
    let wire = if t.dstDtype != 0 || t.srcDtype != 0 {
        t.dstDtype
    } else {
        spec.dtype
    };
    let elem = elem_size(wire).expect("a planned dtype has a size");
    let boxed = t.globalCount[..ndim]
        .iter()
        .try_fold(elem, |acc, &n| acc.checked_mul(n as u64));
    if scale {
        // Scales move as bytes: a box of blocks, each its scale format's size.
        assert!(
            boxed.is_some_and(|b| b > 0 && t.blockBytes % b == 0),
            "a scale block's bytes are not whole scales of its box: {t:?}"
        );
    } else {
        assert_eq!(
            boxed,
            Some(t.blockBytes),
            "blockBytes is not the box's size: {t:?}"
        );
    }
    assert!(
        t.bytes > 0
            && t.blockOffset
                .checked_add(t.bytes)
                .is_some_and(|end| end <= t.blockBytes),
        "the transfer's bytes are not inside its block: {t:?}"
    );
    match (t.kind, t.srcView) {
        (2, 0 | 2 | 3 | 4) => assert_eq!(t.round, 0, "a local copy after round 0: {t:?}"),
        (0 | 1, 0..=4) => assert!(t.round >= 0, "round {}", t.round),
        (kind, view) => panic!("a transfer of kind {kind} reads view {view}"),
    }
}

/// `ncclReshardLocalShape` for one tensor's layout: shape only, then runs per dim, then all
/// runs. Returns whether the first call succeeded.
fn local_shape(
    layout: *const ncclReshardLayout_t,
    tensor: &ncclReshardTensor_t,
    rank: c_int,
    input: &mut Decisions,
) -> bool {
    // The shape array holds 2 × MAX_DIMS entries, so ndim up to that honours the contract;
    // larger values (which the library must refuse) are left out.
    const ROOM: usize = 2 * MAX_DIMS;
    let ndim = tensor.ndim;
    if ndim > ROOM as c_int {
        return false;
    }
    let mut shape = [0i64; ROOM];
    shape[..MAX_DIMS].copy_from_slice(&tensor.shape);
    let blank = i64::from_ne_bytes([UNTOUCHED; 8]);
    let mut local = [blank; ROOM];
    let mut per_dim = [c_int::from_ne_bytes([UNTOUCHED; 4]); ROOM];
    let (local_before, per_dim_before) = (local, per_dim);
    let call = |local: &mut [i64; ROOM],
                runs: &mut [i64],
                capacity: usize,
                per_dim: &mut [c_int; ROOM]| {
        let runs_ptr = if runs.is_empty() {
            ptr::null_mut()
        } else {
            runs.as_mut_ptr()
        };
        assert!(runs.len() >= 2 * capacity);
        // SAFETY: layout is NULL or a decoded layout; shape, local and per_dim hold ROOM ≥ ndim
        // entries; runs is NULL or holds at least `capacity` pairs.
        unsafe {
            ncclReshardLocalShape(
                layout,
                ndim,
                shape.as_ptr(),
                rank,
                local.as_mut_ptr(),
                runs_ptr,
                capacity as c_int,
                per_dim.as_mut_ptr(),
            )
        }
    };
    let result = call(&mut local, &mut [], 0, &mut per_dim);
    if !returned("ncclReshardLocalShape", result) {
        assert!(
            local == local_before && per_dim == per_dim_before,
            "a failing LocalShape wrote its outputs"
        );
        return false;
    }
    let n = ndim as usize;
    assert!(
        local[n..] == local_before[n..] && per_dim[n..] == per_dim_before[n..],
        "LocalShape wrote past ndim"
    );
    for dim in 0..n {
        assert!(
            (0..=shape[dim]).contains(&local[dim]),
            "local extent {} of dim {dim} outside 0..={}",
            local[dim],
            shape[dim]
        );
        assert!(per_dim[dim] >= 0, "negative run count");
    }
    let total: usize = per_dim[..n].iter().map(|&r| r as usize).sum();
    if total > MAX_FILLED_RUNS {
        return true;
    }
    let short = total > 0 && input.rare(32);
    let capacity = if short { total - 1 } else { total };
    let mut runs = vec![blank; 2 * total + 2];
    let runs_before = runs.clone();
    let mut local_again = [blank; ROOM];
    let result = call(&mut local_again, &mut runs, capacity, &mut per_dim);
    if !returned("ncclReshardLocalShape(runs)", result) {
        assert!(short, "LocalShape refused enough room for its runs");
        assert!(runs == runs_before, "a failing LocalShape wrote runs");
        return true;
    }
    assert!(!short, "LocalShape accepted too little room for its runs");
    assert_eq!(
        local_again, local,
        "LocalShape's shapes differ between calls"
    );
    assert_eq!(runs[2 * total..], runs_before[2 * total..], "runs overflow");
    // Runs come in local order, which need not be ascending: check them sorted.
    let mut at = 0;
    for dim in 0..n {
        let count = per_dim[dim] as usize;
        let mut dim_runs: Vec<(i64, i64)> = (at..at + count)
            .map(|r| (runs[2 * r], runs[2 * r + 1]))
            .collect();
        at += count;
        dim_runs.sort_unstable();
        let mut held = 0i64;
        let mut previous_end = 0i64;
        for (start, end) in dim_runs {
            assert!(
                previous_end <= start && start < end && end <= shape[dim],
                "dim {dim}: run [{start}, {end}) overlaps or leaves 0..{}",
                shape[dim]
            );
            held += end - start;
            previous_end = end;
        }
        assert_eq!(
            held, local[dim],
            "dim {dim}: runs do not add up to the extent"
        );
    }
    true
}
