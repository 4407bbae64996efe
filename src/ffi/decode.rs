//! Decoding C descriptors into the core's types, validating every field and naming it in errors
//! (`tensors[2].src->placements[1].dim: …`).

use super::boundary::{array, read_versioned};
use super::types::*;
use crate::error::{Error, Result};
use crate::exec::PlanTensor;
use crate::layout::{DType, Layout, Mesh, Placement, TensorSpec};
use crate::plan::{Config, Mode, Topology, DEFAULT_SPLIT_MIN_BYTES, MAX_ROUNDS};
use crate::quant::{Conversion, FieldNames, ScaleFormat, Scheme};
use std::fmt;
use std::os::raw::c_int;

/// Sizes of the first released version of each struct: callers must provide at least these.
pub(crate) const LAYOUT_MIN_SIZE: usize = std::mem::size_of::<ncclReshardLayout_t>();
/// The tensor's size in 0.1, before `dstDtype`, `quant` and `scaleOffset`.
pub(crate) const TENSOR_MIN_SIZE: usize = std::mem::offset_of!(ncclReshardTensor_t, dstDtype);
pub(crate) const QUANT_MIN_SIZE: usize = std::mem::size_of::<ncclReshardQuant_t>();
/// The default quantization block (rows and columns), DeepSeek-V3's.
pub(crate) const DEFAULT_BLOCK: u64 = 128;
/// The config's size in 0.1, before `rounds` and `relay`.
pub(crate) const CONFIG_MIN_SIZE: usize = std::mem::offset_of!(ncclReshardConfig_t, rounds);
/// The plan info's size in 0.1, before `rounds`.
pub(crate) const INFO_MIN_SIZE: usize = std::mem::offset_of!(ncclReshardPlanInfo_t, rounds);
/// The smallest transfer struct that holds `dstView` … `scaleStride` (which a plan with
/// conversions needs).
pub(crate) const TRANSFER_CONVERT_SIZE: usize = std::mem::size_of::<ncclReshardTransfer_t>();
/// The transfer's size in 0.1, before `round`, `srcView`, `blockOffset` and `blockBytes`.
pub(crate) const TRANSFER_MIN_SIZE: usize = std::mem::offset_of!(ncclReshardTransfer_t, round);
/// The smallest transfer struct that holds `srcView` (which a plan with forwards needs).
pub(crate) const TRANSFER_SRC_VIEW_SIZE: usize =
    std::mem::offset_of!(ncclReshardTransfer_t, srcView) + std::mem::size_of::<c_int>();

/// Refuses a struct from a header newer than this library: its fields may mean what this
/// library does not know. 0 (a struct not from an initializer) is taken as the oldest.
fn header_version(version: u32, field: impl fmt::Display) -> Result<()> {
    let library = super::NCCL_RESHARD_VERSION_CODE as u32;
    if version > library {
        return Err(Error::invalid_argument(format!(
            "{field}.version is {version}: the caller was compiled against a newer ncclReshard.h than this library ({library}); use the header of the library you run, or a newer library"
        )));
    }
    Ok(())
}

pub(crate) fn count(value: c_int, max: usize, field: impl fmt::Display) -> Result<usize> {
    usize::try_from(value)
        .ok()
        .filter(|&n| n <= max)
        .ok_or_else(|| {
            Error::invalid_argument(format!("{field} is {value}; it must be 0 to {max}"))
        })
}

fn rank(value: c_int, field: impl fmt::Display) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| Error::invalid_argument(format!("{field} is {value}; ranks are non-negative")))
}

pub(crate) fn sizes(values: &[i64], field: impl fmt::Display) -> Result<Vec<u64>> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u64::try_from(v).map_err(|_| {
                Error::invalid_argument(format!("{field}[{i}] is {v}; sizes are non-negative"))
            })
        })
        .collect()
}

/// A field's name, formatted only when displayed (an error needs it): `base` (the struct it
/// belongs to), then `name`, then `[index]`, e.g. `tensors[3]`, `tensors[3].src`,
/// `tensors[3].src->placements[1]`.
#[derive(Clone, Copy)]
struct Field<'a> {
    base: Option<&'a dyn fmt::Display>,
    name: &'static str,
    index: Option<usize>,
}

impl fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(base) = self.base {
            write!(f, "{base}")?;
        }
        f.write_str(self.name)?;
        match self.index {
            Some(i) => write!(f, "[{i}]"),
            None => Ok(()),
        }
    }
}

/// A mesh's rank table as a layout gives it.
pub(crate) enum MeshRanks<'a> {
    /// The contiguous ranks from this one.
    From(u32),
    Table(&'a [c_int]),
}

/// The meshes the layouts of one call have built, so that tensors on the same mesh share one
/// rank table (`Mesh` is shared) and each distinct table is validated once: a model passes
/// tens of thousands of layouts over a few meshes of hundreds of ranks.
#[derive(Default)]
pub(crate) struct Meshes {
    /// Every mesh built, with its inputs (shape, first rank, rank table).
    built: Vec<BuiltMesh>,
    /// Indices into `built` by a hash of the inputs.
    by_hash: std::collections::HashMap<u64, Vec<usize>>,
    /// The most recently used, most recent first: layouts come in runs on a few meshes, and
    /// comparing a table is cheaper than hashing it.
    recent: Vec<usize>,
}

/// A mesh [`Meshes`] built, with its shape, first rank and rank table.
type BuiltMesh = (Vec<u64>, Option<u32>, Vec<c_int>, Mesh);

/// How many meshes [`Meshes`] compares before hashing.
const RECENT_MESHES: usize = 4;

impl Meshes {
    /// The mesh of `shape` over `ranks` (whose entries are non-negative or
    /// `NCCL_RESHARD_RANK_NONE`): `Mesh::new` or
    /// `Mesh::contiguous` the first time, the same mesh after.
    pub(crate) fn get(&mut self, shape: Vec<u64>, ranks: MeshRanks) -> Result<Mesh> {
        let (first, table): (Option<u32>, &[c_int]) = match ranks {
            MeshRanks::From(first) => (Some(first), &[]),
            MeshRanks::Table(table) => (None, table),
        };
        let same =
            |&(ref s, f, ref t, _): &BuiltMesh| *s == shape && f == first && t.as_slice() == table;
        let found = match self.recent.iter().position(|&i| same(&self.built[i])) {
            Some(at) => Some(self.recent.remove(at)),
            None => {
                let mut hash = 0u64;
                let words = shape.iter().copied().chain(first.map(u64::from));
                for word in words.chain(table.iter().map(|&r| r as u64)) {
                    hash = (hash.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
                }
                let candidates = self.by_hash.entry(hash).or_default();
                match candidates.iter().copied().find(|&i| same(&self.built[i])) {
                    Some(i) => Some(i),
                    None => {
                        let mesh = match first {
                            Some(first) => Mesh::contiguous(shape.clone(), first),
                            None => Mesh::new(
                                shape.clone(),
                                table
                                    .iter()
                                    .map(|&r| {
                                        if r == NCCL_RESHARD_RANK_NONE {
                                            Mesh::HOLE
                                        } else {
                                            r as u32
                                        }
                                    })
                                    .collect(),
                            ),
                        }?;
                        candidates.push(self.built.len());
                        self.built.push((shape, first, table.to_vec(), mesh));
                        None
                    }
                }
            }
        };
        let index = found.unwrap_or(self.built.len() - 1);
        self.recent.insert(0, index);
        self.recent.truncate(RECENT_MESHES);
        Ok(self.built[index].3.clone())
    }
}

fn default_layout() -> ncclReshardLayout_t {
    ncclReshardLayout_t {
        size: LAYOUT_MIN_SIZE,
        version: 0,
        meshNdim: 0,
        meshShape: [0; NCCL_RESHARD_MAX_DIMS],
        ranks: std::ptr::null(),
        firstRank: 0,
        placements: [ncclReshardPlacement_t::default(); NCCL_RESHARD_MAX_DIMS],
        strides: std::ptr::null(),
    }
}

/// # Safety
/// `ptr` must be NULL or point to a layout whose pointers are NULL or valid for the lengths
/// the layout implies.
pub(crate) unsafe fn layout(
    ptr: *const ncclReshardLayout_t,
    ndim: usize,
    field: &dyn fmt::Display,
    meshes: &mut Meshes,
) -> Result<Layout> {
    // SAFETY: forwarded contract.
    let c = unsafe { read_versioned(ptr, LAYOUT_MIN_SIZE, default_layout(), field) }?;
    header_version(c.version, field)?;
    let mesh_ndim = count(
        c.meshNdim,
        NCCL_RESHARD_MAX_DIMS,
        format_args!("{field}->meshNdim"),
    )?;
    if mesh_ndim == 0 {
        return Err(Error::invalid_argument(format!(
            "{field}->meshNdim is 0; a mesh needs at least one axis"
        )));
    }
    let shape = sizes(
        &c.meshShape[..mesh_ndim],
        format_args!("{field}->meshShape"),
    )?;
    let mesh = if c.ranks.is_null() {
        let first = rank(c.firstRank, format_args!("{field}->firstRank"))?;
        meshes.get(shape, MeshRanks::From(first))
    } else {
        let n = shape
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .unwrap_or(u64::MAX);
        if n > i32::MAX as u64 {
            return Err(Error::invalid_argument(format!(
                "{field}->meshShape {shape:?} holds more ranks than NCCL can address"
            )));
        }
        // SAFETY: the caller's rank table has one entry per mesh position.
        let table = unsafe { array(c.ranks, n as usize, format_args!("{field}->ranks")) }?;
        if let Some(i) = table
            .iter()
            .position(|&r| r < 0 && r != NCCL_RESHARD_RANK_NONE)
        {
            return Err(Error::invalid_argument(format!(
                "{field}->ranks[{i}] is {}; ranks are non-negative, or NCCL_RESHARD_RANK_NONE (-1) for a position whose rank is gone",
                table[i]
            )));
        }
        meshes.get(shape, MeshRanks::Table(table))
    }
    .map_err(|e| e.context(field))?;
    let placements = c.placements[..mesh_ndim]
        .iter()
        .enumerate()
        .map(|(axis, p)| {
            let at = Field {
                base: Some(field),
                name: "->placements",
                index: Some(axis),
            };
            let dim = || {
                usize::try_from(p.dim).map_err(|_| {
                    Error::invalid_argument(format!("{at}.dim is {}; dims are non-negative", p.dim))
                })
            };
            match p.kind {
                0 => Ok(Placement::Replicate),
                1 => Ok(Placement::Shard(dim()?)),
                2 => {
                    let split_factor = u64::try_from(p.splitFactor).ok().filter(|&s| s >= 1);
                    let split_factor = split_factor.ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "{at}.splitFactor is {}; it must be at least 1",
                            p.splitFactor
                        ))
                    })?;
                    Ok(Placement::StridedShard { dim: dim()?, split_factor })
                }
                3 => {
                    let block = u64::try_from(p.splitFactor).ok().filter(|&b| b >= 1);
                    let block = block.ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "{at}.splitFactor is {}; for ncclReshardShardBlocks it is the block size, at least 1",
                            p.splitFactor
                        ))
                    })?;
                    Ok(Placement::ShardBlocks { dim: dim()?, block })
                }
                other => Err(Error::invalid_argument(format!(
                    "{at}.kind is {other}; use ncclReshardReplicate, ncclReshardShard, ncclReshardStridedShard or ncclReshardShardBlocks (Partial is not supported)"
                ))),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let mut result = Layout::new(mesh, placements);
    if !c.strides.is_null() {
        // SAFETY: strides has one entry per tensor dim.
        let strides = unsafe { array(c.strides, ndim, format_args!("{field}->strides")) }?;
        result.strides = Some(sizes(strides, format_args!("{field}->strides"))?);
    }
    Ok(result)
}

pub(crate) fn default_tensor() -> ncclReshardTensor_t {
    ncclReshardTensor_t {
        size: TENSOR_MIN_SIZE,
        version: 0,
        ndim: 0,
        shape: [0; NCCL_RESHARD_MAX_DIMS],
        dtype: 0,
        src: std::ptr::null(),
        dst: std::ptr::null(),
        srcOffset: 0,
        dstOffset: 0,
        name: std::ptr::null(),
        dstDtype: NCCL_RESHARD_UNDEF_INT,
        quant: std::ptr::null(),
        scaleOffset: 0,
    }
}

fn default_quant() -> ncclReshardQuant_t {
    ncclReshardQuant_t {
        size: QUANT_MIN_SIZE,
        version: 0,
        scheme: NCCL_RESHARD_UNDEF_INT,
        blockRows: 0,
        blockCols: 0,
        scaleFormat: NCCL_RESHARD_UNDEF_INT,
        scaleInverse: NCCL_RESHARD_UNDEF_INT,
        scaleLayout: std::ptr::null(),
    }
}

/// The conversion a tensor descriptor asks for (`dstDtype`, `quant`), or `None`.
///
/// # Safety
/// `quant` must be NULL or point to a quant struct whose `scaleLayout` is NULL or valid.
unsafe fn conversion(
    dtype: DType,
    dst_dtype: c_int,
    quant: *const ncclReshardQuant_t,
    ndim: usize,
    field: &dyn fmt::Display,
    meshes: &mut Meshes,
) -> Result<Option<Conversion>> {
    let target = if dst_dtype == NCCL_RESHARD_UNDEF_INT {
        dtype
    } else {
        DType::from_nccl_code(dst_dtype).ok_or_else(|| {
            Error::invalid_argument(format!(
                "{field}.dstDtype is {dst_dtype}, not an ncclDataType_t"
            ))
        })?
    };
    if quant.is_null() {
        return Ok((target != dtype).then(|| Conversion::cast(target)));
    }
    let at = format!("{field}.quant");
    // SAFETY: forwarded contract.
    let q = unsafe { read_versioned(quant, QUANT_MIN_SIZE, default_quant(), &at) }?;
    header_version(q.version, &at)?;
    let block = |value: i64, name: &str| -> Result<u64> {
        match value {
            0 => Ok(DEFAULT_BLOCK),
            v if v > 0 => Ok(v as u64),
            v => Err(Error::invalid_argument(format!(
                "{at}.{name} is {v}; use a positive block size (0 = 128)"
            ))),
        }
    };
    let scheme = match q.scheme {
        NCCL_RESHARD_UNDEF_INT => {
            return Err(Error::invalid_argument(format!(
                "{at}.scheme is not set; set it to an ncclReshardQuantScheme_t (ncclReshardQuantBlock, …)"
            )))
        }
        0 => Scheme::None,
        1 => Scheme::PerTensor,
        2 => Scheme::PerChannel,
        3 => Scheme::Block {
            rows: block(q.blockRows, "blockRows")?,
            cols: block(q.blockCols, "blockCols")?,
        },
        other => {
            return Err(Error::invalid_argument(format!(
                "{at}.scheme is {other}; use ncclReshardQuantNone, ncclReshardQuantPerTensor, ncclReshardQuantPerChannel or ncclReshardQuantBlock"
            )))
        }
    };
    let scale_format = match q.scaleFormat {
        NCCL_RESHARD_UNDEF_INT | 0 => ScaleFormat::Float32,
        1 => ScaleFormat::E8m0,
        other => {
            return Err(Error::invalid_argument(format!(
                "{at}.scaleFormat is {other}; use ncclReshardScaleFloat32 or ncclReshardScaleE8M0"
            )))
        }
    };
    let scale_inverse = match q.scaleInverse {
        NCCL_RESHARD_UNDEF_INT | 0 => false,
        1 => true,
        other => {
            return Err(Error::invalid_argument(format!(
                "{at}.scaleInverse is {other}; use 0 (store the scale) or 1 (store its inverse)"
            )))
        }
    };
    let scale_layout = if q.scaleLayout.is_null() {
        None
    } else {
        // SAFETY: forwarded contract; the scale tensor has the tensor's number of dims.
        Some(unsafe { layout(q.scaleLayout, ndim, &format!("{at}.scaleLayout"), meshes) }?)
    };
    Ok(Some(Conversion {
        dtype: target,
        scheme,
        scale_format,
        scale_inverse,
        scale_layout,
    }))
}

/// Converts the tensor array. The array's element stride is `tensors[0].size` (all elements
/// must state the same size), so callers built against older headers work.
///
/// # Safety
/// `tensors` must point to `ntensors` tensor structs of `tensors[0].size` bytes each whose
/// pointers are NULL or valid.
pub(crate) unsafe fn tensors(
    tensors: *const ncclReshardTensor_t,
    ntensors: c_int,
) -> Result<Vec<PlanTensor>> {
    let n = usize::try_from(ntensors)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| {
            Error::invalid_argument(format!("ntensors is {ntensors}; it must be at least 1"))
        })?;
    if tensors.is_null() {
        return Err(Error::invalid_argument("tensors is NULL"));
    }
    // SAFETY: tensors[0] begins with its size.
    let stride = unsafe { std::ptr::read_unaligned(tensors.cast::<usize>()) };
    let mut out = Vec::with_capacity(n);
    let mut meshes = Meshes::default();
    for i in 0..n {
        // Named only when an error needs it: a model's tensors number tens of thousands.
        let field = Field {
            base: None,
            name: "tensors",
            index: Some(i),
        };
        // SAFETY: element i starts at i * stride bytes within the caller's array; stride is
        // validated against the minimum size by read_versioned on element 0 first.
        let ptr = unsafe { tensors.cast::<u8>().add(i * stride) }.cast::<ncclReshardTensor_t>();
        let c = unsafe { read_versioned(ptr, TENSOR_MIN_SIZE, default_tensor(), field) }?;
        if c.size != stride {
            return Err(Error::invalid_argument(format!(
                "{field}.size is {} but tensors[0].size is {stride}; all tensors must use the same struct size",
                c.size
            )));
        }
        header_version(c.version, field)?;
        let ndim = count(c.ndim, NCCL_RESHARD_MAX_DIMS, format_args!("{field}.ndim"))?;
        let shape = sizes(&c.shape[..ndim], format_args!("{field}.shape"))?;
        if c.dtype == NCCL_RESHARD_UNDEF_INT {
            return Err(Error::invalid_argument(format!(
                "{field}.dtype is not set; set it to the tensor's ncclDataType_t (ncclBfloat16, …)"
            )));
        }
        let dtype = DType::from_nccl_code(c.dtype).ok_or_else(|| {
            Error::invalid_argument(format!(
                "{field}.dtype is {}, not an ncclDataType_t",
                c.dtype
            ))
        })?;
        // SAFETY: forwarded contract.
        let side = |name| Field {
            base: Some(&field),
            name,
            index: None,
        };
        let src = unsafe { layout(c.src, ndim, &side(".src"), &mut meshes) }?;
        let dst = unsafe { layout(c.dst, ndim, &side(".dst"), &mut meshes) }?;
        // SAFETY: forwarded contract.
        let conversion =
            unsafe { conversion(dtype, c.dstDtype, c.quant, ndim, &field, &mut meshes) }?;
        let name = (!c.name.is_null())
            // SAFETY: a non-NULL name is a NUL-terminated string per the API.
            .then(|| {
                unsafe { std::ffi::CStr::from_ptr(c.name) }
                    .to_string_lossy()
                    .into_owned()
            });
        let spec = TensorSpec {
            shape,
            dtype,
            src,
            dst,
        };
        // Checked here so that errors name the C struct's fields (`dstDtype`, `quant.…`);
        // the planner checks again, naming them as case files do. The tensor first: a
        // conversion is only checked against a valid tensor.
        if let Some(c) = &conversion {
            spec.validate()
                .and_then(|()| c.validate_named(&spec, &FieldNames::C))
                .map_err(|e| e.context(field))?;
        }
        out.push(PlanTensor {
            spec,
            conversion,
            src_offset: c.srcOffset as u64,
            dst_offset: c.dstOffset as u64,
            scale_offset: c.scaleOffset as u64,
            name,
        });
    }
    Ok(out)
}

/// What a config says besides the planner's `Config`.
#[derive(Default)]
pub(crate) struct CallConfig {
    /// `maxStagingBytes` (0: `NCCL_RESHARD_STAGING_BYTES`, else 8 GiB).
    pub max_staging_bytes: u64,
    /// `timeoutMs` (`None`: unset, `NCCL_RESHARD_TIMEOUT_MS` decides; 0: no deadline).
    pub timeout_ms: Option<u64>,
    /// `failedRanks`, ascending (the survivors' plan when not empty).
    pub failed_ranks: Vec<u32>,
}

/// A config with every field unset (what an older header's struct lacks reads as this).
fn default_config() -> ncclReshardConfig_t {
    ncclReshardConfig_t {
        size: CONFIG_MIN_SIZE,
        magic: NCCL_RESHARD_CONFIG_MAGIC,
        version: 0,
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

/// Converts the optional config (NULL → defaults): the planner's config and what bounds or
/// guards the plan's execution.
///
/// # Safety
/// `config` must be NULL or point to a config whose `nodeOfRank` is NULL or holds
/// `nodeOfRankCount` entries, and whose `failedRanks` is NULL or holds `failedRankCount`.
pub(crate) unsafe fn config(config: *const ncclReshardConfig_t) -> Result<(Config, CallConfig)> {
    if config.is_null() {
        return Ok((Config::default(), CallConfig::default()));
    }
    // SAFETY: forwarded contract.
    let c = unsafe { read_versioned(config, CONFIG_MIN_SIZE, default_config(), "config") }?;
    if c.magic != NCCL_RESHARD_CONFIG_MAGIC {
        return Err(Error::invalid_argument(format!(
            "config.magic is {:#x}, not NCCL_RESHARD_CONFIG_MAGIC; initialise the config with NCCL_RESHARD_CONFIG_INITIALIZER",
            c.magic
        )));
    }
    header_version(c.version, "config")?;
    let set = |value: c_int, default: c_int| {
        if value == NCCL_RESHARD_UNDEF_INT {
            default
        } else {
            value
        }
    };
    let mode = match set(c.mode, ncclReshardMode_t::ncclReshardModeAuto as c_int) {
        0 => Mode::Groupable,
        1 => Mode::Staged,
        2 => Mode::Auto,
        other => {
            return Err(Error::invalid_argument(format!(
                "config.mode is {other}; use ncclReshardModeGroupable, ncclReshardModeStaged or ncclReshardModeAuto"
            )))
        }
    };
    let topology = if !c.nodeOfRank.is_null() {
        let n = usize::try_from(c.nodeOfRankCount).map_err(|_| {
            Error::invalid_argument(format!("config.nodeOfRankCount is {}", c.nodeOfRankCount))
        })?;
        // SAFETY: nodeOfRank holds nodeOfRankCount entries.
        let table = unsafe { array(c.nodeOfRank, n, "config.nodeOfRank") }?;
        Topology::NodeTable(
            table
                .iter()
                .enumerate()
                .map(|(i, &v)| rank(v, format_args!("config.nodeOfRank[{i}]")))
                .collect::<Result<_>>()?,
        )
    } else {
        match set(c.ranksPerNode, 0) {
            0 => Topology::Unknown,
            n if n > 0 => Topology::RanksPerNode(n as u32),
            n => {
                return Err(Error::invalid_argument(format!(
                    "config.ranksPerNode is {n}; use 0 for unknown or a positive count"
                )))
            }
        }
    };
    let split_min_bytes = match c.splitMinBytes {
        0 => DEFAULT_SPLIT_MIN_BYTES,
        n => n as u64,
    };
    let rounds = u32::try_from(set(c.rounds, 0))
        .ok()
        .filter(|&r| r <= MAX_ROUNDS)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "config.rounds is {}; use 0 (automatic) to {MAX_ROUNDS}",
                c.rounds
            ))
        })?;
    let relay = match set(c.relay, 1) {
        0 => false,
        1 => true,
        other => {
            return Err(Error::invalid_argument(format!(
                "config.relay is {other}; use 1 (forward over NVLink, the default) or 0"
            )))
        }
    };
    let sender_barrier = match c.senderBarrier {
        NCCL_RESHARD_UNDEF_INT => None,
        0 => Some(false),
        1 => Some(true),
        other => {
            return Err(Error::invalid_argument(format!(
                "config.senderBarrier is {other}; use 1 (a barrier among a node's sending-only ranks before each round), 0 (none) or leave it NCCL_RESHARD_UNDEF_INT (where a node holds more than 8 of them)"
            )))
        }
    };
    let timeout_ms = match c.timeoutMs {
        NCCL_RESHARD_UNDEF_INT => None,
        ms => Some(u64::try_from(ms).map_err(|_| {
            Error::invalid_argument(format!(
                "config.timeoutMs is {ms}; use 0 (no deadline) or a positive number of milliseconds"
            ))
        })?),
    };
    let failed_ranks = if c.failedRanks.is_null() {
        Vec::new()
    } else {
        let n = usize::try_from(c.failedRankCount).map_err(|_| {
            Error::invalid_argument(format!("config.failedRankCount is {}", c.failedRankCount))
        })?;
        // SAFETY: failedRanks holds failedRankCount entries.
        let table = unsafe { array(c.failedRanks, n, "config.failedRanks") }?;
        let mut ranks = table
            .iter()
            .enumerate()
            .map(|(i, &v)| rank(v, format_args!("config.failedRanks[{i}]")))
            .collect::<Result<Vec<u32>>>()?;
        ranks.sort_unstable();
        if let Some(w) = ranks.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid_argument(format!(
                "config.failedRanks names rank {} twice",
                w[0]
            )));
        }
        ranks
    };
    Ok((
        Config {
            mode,
            topology,
            split_min_bytes,
            local_via_messages: false,
            rounds,
            relay,
            sender_barrier,
        },
        CallConfig {
            max_staging_bytes: c.maxStagingBytes as u64,
            timeout_ms,
            failed_ranks,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(ranks: &[c_int], kind: c_int) -> ncclReshardLayout_t {
        let mut l = default_layout();
        l.size = std::mem::size_of::<ncclReshardLayout_t>();
        l.meshNdim = 1;
        l.meshShape[0] = ranks.len() as i64;
        l.ranks = ranks.as_ptr();
        l.placements[0] = ncclReshardPlacement_t {
            kind,
            dim: 0,
            splitFactor: 0,
        };
        l
    }

    fn tensor(src: &ncclReshardLayout_t, dst: &ncclReshardLayout_t) -> ncclReshardTensor_t {
        let mut t = default_tensor();
        t.size = std::mem::size_of::<ncclReshardTensor_t>();
        t.ndim = 1;
        t.shape[0] = 8;
        t.dtype = DType::Float32.nccl_code();
        t.src = src;
        t.dst = dst;
        t
    }

    fn convert(tensors: &[ncclReshardTensor_t]) -> Result<Vec<PlanTensor>> {
        // SAFETY: every tensor and layout outlives the call; tables hold meshShape entries.
        unsafe { super::tensors(tensors.as_ptr(), tensors.len() as c_int) }
    }

    #[test]
    fn a_config_of_an_older_header_leaves_the_failure_fields_unset() {
        // A 0.4 caller's struct ends before timeoutMs: whatever follows it in memory is not read.
        let failed = [3];
        let mut c = ncclReshardConfig_t {
            size: std::mem::offset_of!(ncclReshardConfig_t, timeoutMs),
            version: 400,
            timeoutMs: 77,
            failedRanks: failed.as_ptr(),
            failedRankCount: 1,
            ..default_config()
        };
        // SAFETY: a complete struct, its failedRanks holding failedRankCount entries.
        let (_, call) = unsafe { config(&c) }.unwrap();
        assert_eq!(call.timeout_ms, None);
        assert!(call.failed_ranks.is_empty());
        c.size = std::mem::size_of::<ncclReshardConfig_t>();
        // SAFETY: as above.
        let (_, call) = unsafe { config(&c) }.unwrap();
        assert_eq!(call.timeout_ms, Some(77));
        assert_eq!(call.failed_ranks, vec![3]);
    }

    #[test]
    fn errors_name_the_field_of_the_tensor_they_are_in() {
        let good_table = [0, 1];
        let bad_table = [2, -3];
        let good = layout(&good_table, 1);
        let bad_rank = layout(&bad_table, 1);
        let bad_kind = layout(&good_table, 7);
        let error = |t: &[ncclReshardTensor_t]| convert(t).expect_err("refused").message;
        let ok = tensor(&good, &good);
        assert_eq!(
            error(&[ok, tensor(&good, &bad_rank)]),
            "tensors[1].dst->ranks[1] is -3; ranks are non-negative, or NCCL_RESHARD_RANK_NONE (-1) for a position whose rank is gone"
        );
        assert!(error(&[tensor(&bad_kind, &good)])
            .starts_with("tensors[0].src->placements[0].kind is 7; use ncclReshardReplicate"));
    }

    #[test]
    fn tensors_on_equal_rank_tables_share_one_mesh() {
        // Two copies of one table and a different one, interleaved as a model's layouts are.
        let (a, a_copy, b) = ([4, 5, 6, 7], [4, 5, 6, 7], [0, 1, 2, 3]);
        let (la, la_copy, lb) = (layout(&a, 1), layout(&a_copy, 0), layout(&b, 1));
        let mut tensors = Vec::new();
        for _ in 0..3 {
            tensors.extend([tensor(&lb, &la), tensor(&lb, &la_copy)]);
        }
        let converted = convert(&tensors).unwrap();
        let dst: Vec<&Mesh> = converted.iter().map(|t| &t.spec.dst.mesh).collect();
        let src: Vec<&Mesh> = converted.iter().map(|t| &t.spec.src.mesh).collect();
        assert!(dst.iter().all(|m| m.shares_table(dst[0])));
        assert!(src.iter().all(|m| m.shares_table(src[0])));
        assert!(!src[0].shares_table(dst[0]));
        assert_eq!(dst[0].ranks(), &[4, 5, 6, 7]);
    }
}
