//! Planning conversions (docs/quantization.md §3): where each quantization block of a tensor
//! that arrives in another dtype is converted, and the blocks and steps that do it, around the
//! planner's unchanged core.
//!
//! Per dim, `W_d` holds the elements of the blocks that some source piece holds whole; the
//! blocks in their product are exactly those one source shard holds whole. Those are converted
//! by their sender before the first round, into its workspace, and travel in the destination
//! dtype (FP8 on the wire: half the bytes of BF16). Every other block travels in the source
//! dtype into its receivers' workspace and is converted there after the last round, so each
//! receiver must hold it whole; plan creation refuses, naming a block, layouts where neither
//! side does.
//!
//! The core plans each class as a tensor of its own (an *inner tensor*): the sender class
//! with the destination dtype and a dense source (the sender's converted image), the receiver
//! class with a dense destination (the receiver's landing area). Its blocks are then cut to
//! the class and their locations moved to workspace regions. Scales of sender-converted blocks
//! travel from each sender's scale grid to the scale tensor's destination layout as blocks of
//! their own; receivers write the scales of the blocks they convert. The rank's program is
//! formed from all these blocks by the core, and the conversions are added before and after.
//!
//! While blocks are formed, a `Buffer::Work` location names a workspace *region* in
//! `Loc::tensor` ([`region`]) and an offset in it, the same on both ends of a pair; the program
//! then places each region the rank uses in its workspace ([`Conversions::program`]).

use super::assign::Assignment;
use super::blocks::{assignment_blocks, Block, Movement};
use super::bytesets::{ByteSet, Reads};
use super::config::{Config, Mode};
use super::core::CorePlanner;
use super::fingerprint::mix;
use super::messages::STAGING_ALIGN;
use super::program::RankProgram;
use super::rounds::Transfer;
use super::steps::{Buffer, ConvertDim, CopyDim, Loc, StridedConvert, StridedCopy};
use crate::error::{Error, Result};
use crate::layout::{next_index, IndexRuns, Layout, RankView, Side, TensorSpec};
use crate::quant::{Arithmetic, Conversion};
use std::collections::HashMap;

/// Workspace regions of a converted tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkRegion {
    /// The sender's source view converted: a dense row-major array of its local source shape
    /// in the destination dtype (the blocks it holds whole).
    Converted,
    /// The sender's scales: a dense row-major array over the indices of the blocks it holds
    /// whole.
    Scales,
    /// The receiver's landing area: a dense row-major array of its local destination shape in
    /// the source dtype, converted into its destination view after the last round.
    Unconverted,
}

const REGIONS: [WorkRegion; 3] = [
    WorkRegion::Converted,
    WorkRegion::Scales,
    WorkRegion::Unconverted,
];

/// The `Loc::tensor` of tensor `t`'s workspace region `kind` (while blocks are formed and in
/// the exported transfers).
pub fn region(t: u32, kind: WorkRegion) -> u32 {
    3 * t + kind as u32
}

/// Which tensor and region a workspace `Loc::tensor` names.
pub fn region_of(id: u32) -> (u32, WorkRegion) {
    (id / 3, REGIONS[(id % 3) as usize])
}

/// What an inner tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A tensor without conversion.
    Plain(u32),
    /// The blocks of a converted tensor its senders convert.
    Sender(u32),
    /// The blocks of a converted tensor its receivers convert.
    Receiver(u32),
}

/// A scale tensor: its index among the plan's destination views (after the tensors), shape,
/// destination layout and element size.
#[derive(Clone, Debug)]
struct ScaleTensor {
    index: u32,
    shape: Vec<u64>,
    layout: Layout,
    size: u32,
}

/// How one converted tensor is planned.
#[derive(Clone, Debug)]
struct TensorPlan {
    arithmetic: Arithmetic,
    /// Elements per quantization block along each dim (1 for a cast).
    block: Vec<u64>,
    /// Per dim, the elements of the blocks some source piece holds whole.
    sender_whole: Vec<IndexRuns>,
    /// Inner tensors of the sender and receiver classes, when not empty.
    sender: Option<u32>,
    receiver: Option<u32>,
    scale: Option<ScaleTensor>,
}

impl TensorPlan {
    /// The receiver class as a union of products of per-dim sets: product k has `W_d` before
    /// dim k, the complement of `W_k` at k, and every index after.
    fn receiver_parts(&self, shape: &[u64]) -> Vec<Vec<IndexRuns>> {
        let n = shape.len();
        (0..n)
            .map(|k| {
                (0..n)
                    .map(|d| match d.cmp(&k) {
                        std::cmp::Ordering::Less => self.sender_whole[d].clone(),
                        std::cmp::Ordering::Equal => complement(&self.sender_whole[d], shape[d]),
                        std::cmp::Ordering::Greater => IndexRuns::full(shape[d]),
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|part| part.iter().all(|s| !s.is_empty()))
            .collect()
    }
}

/// The conversions of a plan: the inner planner over the classes, and per tensor how it is
/// converted.
#[derive(Clone, Debug)]
pub(crate) struct Conversions {
    inner: CorePlanner,
    roles: Vec<Role>,
    /// Per (user) tensor, its plan when it converts.
    plans: Vec<Option<TensorPlan>>,
    conversions: Vec<Option<Conversion>>,
}

/// `[start, end)` index sets as runs, sorted and merged.
fn union(mut ranges: Vec<(u64, u64)>) -> IndexRuns {
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (a, b) in ranges {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    IndexRuns::from_ranges(merged)
}

/// The indices of `0..n` not in `set`.
fn complement(set: &IndexRuns, n: u64) -> IndexRuns {
    let mut ranges = Vec::new();
    let mut at = 0;
    for run in set.runs() {
        ranges.push((at, run.start));
        at = run.end;
    }
    ranges.push((at, n));
    IndexRuns::from_ranges(ranges.into_iter().filter(|r| r.0 < r.1))
}

/// Per dim, the indices of the blocks (`block[d]` wide) that some piece of `layout` holds
/// whole: the union over its pieces along that dim.
fn held_whole(layout: &Layout, shape: &[u64], block: &[u64]) -> Vec<IndexRuns> {
    (0..shape.len())
        .map(|d| {
            union(
                layout
                    .dim_pieces(shape, d)
                    .iter()
                    .flat_map(|p| {
                        whole_blocks(&p.indices, block[d], shape[d])
                            .runs()
                            .iter()
                            .map(|r| (r.start, r.end))
                            .collect::<Vec<_>>()
                    })
                    .collect(),
            )
        })
        .collect()
}

/// The elements of the blocks (of `block` elements along a dim of `n`) that `indices` holds
/// whole.
fn whole_blocks(indices: &IndexRuns, block: u64, n: u64) -> IndexRuns {
    IndexRuns::from_ranges(indices.runs().iter().filter_map(|run| {
        let first = run.start.div_ceil(block);
        let end = if run.end == n {
            n.div_ceil(block)
        } else {
            run.end / block
        };
        (first < end).then(|| (first * block, (end * block).min(n)))
    }))
}

/// The block indices of `elements` (a union of whole blocks).
fn block_indices(elements: &IndexRuns, block: u64) -> IndexRuns {
    IndexRuns::from_ranges(
        elements
            .runs()
            .iter()
            .map(|r| (r.start / block, r.end.div_ceil(block))),
    )
}

/// A block box `[lo, hi)` along each dim, for messages: `[256, 384) × [0, 128)`.
fn describe_box(lo: &[u64], hi: &[u64]) -> String {
    lo.iter()
        .zip(hi)
        .map(|(a, b)| format!("[{a}, {b})"))
        .collect::<Vec<_>>()
        .join(" × ")
}

/// Where dim `d`'s pieces of `layout` cut the block `[lo, hi)`: the first index inside it
/// where a piece starts or ends.
fn cut_inside(layout: &Layout, shape: &[u64], d: usize, lo: u64, hi: u64) -> Option<u64> {
    layout
        .dim_pieces(shape, d)
        .iter()
        .flat_map(|p| p.indices.runs().iter().flat_map(|r| [r.start, r.end]))
        .filter(|&x| x > lo && x < hi)
        .min()
}

impl Conversions {
    /// Plans `tensors` (source dtypes) with their `conversions`; `Ok(None)` when none
    /// converts. Errors name the tensor: `tensors[3]: …`.
    pub(crate) fn new(
        tensors: &[TensorSpec],
        conversions: &[Option<Conversion>],
        config: &Config,
    ) -> Result<Option<Conversions>> {
        if conversions.len() != tensors.len() {
            return Err(Error::invalid_argument(format!(
                "{} conversions for {} tensors",
                conversions.len(),
                tensors.len()
            )));
        }
        if conversions.iter().all(Option::is_none) {
            return Ok(None);
        }
        if config.mode == Mode::Groupable {
            let t = conversions.iter().position(Option::is_some).unwrap_or(0);
            return Err(Error::invalid_usage(format!(
                "tensors[{t}] converts to another dtype on the way, which needs conversion steps before the sends or after the receives: groupable mode has none; use auto or staged mode"
            )));
        }
        let ntensors = tensors.len() as u32;
        let mut inner_specs = Vec::with_capacity(tensors.len());
        let mut roles = Vec::with_capacity(tensors.len());
        let mut plans = Vec::with_capacity(tensors.len());
        let mut scales = 0u32;
        for (t, (spec, conversion)) in tensors.iter().zip(conversions).enumerate() {
            let t32 = t as u32;
            let Some(conversion) = conversion else {
                roles.push(Role::Plain(t32));
                inner_specs.push(spec.clone());
                plans.push(None);
                continue;
            };
            let at = |e: Error| e.context(format!("tensors[{t}]"));
            conversion.validate(spec).map_err(at)?;
            let plan = tensor_plan(
                spec,
                conversion,
                ntensors + scales,
                &mut roles,
                &mut inner_specs,
                t32,
            )
            .map_err(at)?;
            scales += u32::from(plan.scale.is_some());
            plans.push(Some(plan));
        }
        let mut inner = CorePlanner::new(inner_specs, config.clone())?;
        // What senders convert is read in about the order of their streams.
        inner.place_by_stream(|v| matches!(roles[v], Role::Sender(_)));
        let conversions = Conversions {
            inner,
            roles,
            plans,
            conversions: conversions.to_vec(),
        };
        conversions.check_scale_holders(tensors)?;
        Ok(Some(conversions))
    }

    pub(crate) fn inner(&self) -> &CorePlanner {
        &self.inner
    }

    pub(crate) fn conversions(&self) -> &[Option<Conversion>] {
        &self.conversions
    }

    /// Every rank of a scale layout.
    pub(crate) fn scale_ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.plans
            .iter()
            .flatten()
            .filter_map(|p| p.scale.as_ref())
            .flat_map(|s| s.layout.mesh.live_ranks())
    }

    /// Whether `rank` is in some scale layout's mesh.
    pub(crate) fn holds_scales(&self, rank: u32) -> bool {
        self.plans
            .iter()
            .flatten()
            .filter_map(|p| p.scale.as_ref())
            .any(|s| s.layout.mesh.contains(rank))
    }

    /// The scale tensors: (tensor, shape, layout, element size), in tensor order.
    pub(crate) fn scale_tensors(&self) -> Vec<(u32, Vec<u64>, Layout, u32)> {
        self.plans
            .iter()
            .enumerate()
            .filter_map(|(t, p)| {
                let s = p.as_ref()?.scale.as_ref()?;
                Some((t as u32, s.shape.clone(), s.layout.clone(), s.size))
            })
            .collect()
    }

    /// Receivers write the scales of the blocks they convert: every rank holding such a
    /// block's scale must hold the block, and every rank holding the block its scale.
    fn check_scale_holders(&self, tensors: &[TensorSpec]) -> Result<()> {
        for (t, (spec, plan)) in tensors.iter().zip(&self.plans).enumerate() {
            let Some(plan) = plan else { continue };
            let (Some(scale), Some(_)) = (&plan.scale, plan.receiver) else {
                continue;
            };
            let parts = plan.receiver_parts(&spec.shape);
            let mut ranks: Vec<u32> = spec
                .dst
                .mesh
                .live_ranks()
                .chain(scale.layout.mesh.live_ranks())
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            for rank in ranks {
                let data = spec.dst.rank_indices(&spec.shape, rank);
                let scales = scale.layout.rank_indices(&scale.shape, rank);
                for part in &parts {
                    let held = |d: usize| -> IndexRuns {
                        let Some(data) = &data else {
                            return IndexRuns::empty();
                        };
                        block_indices(&part[d].intersect(&data[d]), plan.block[d])
                    };
                    let in_scales = |d: usize| -> IndexRuns {
                        let Some(scales) = &scales else {
                            return IndexRuns::empty();
                        };
                        block_indices(&part[d], plan.block[d]).intersect(&scales[d])
                    };
                    let n = spec.shape.len();
                    let a: Vec<IndexRuns> = (0..n).map(held).collect();
                    let b: Vec<IndexRuns> = (0..n).map(in_scales).collect();
                    let empty = |x: &[IndexRuns]| x.iter().any(IndexRuns::is_empty);
                    let agree = (empty(&a) && empty(&b)) || (!empty(&a) && !empty(&b) && a == b);
                    if !agree {
                        let (holds, lacks) = if empty(&a) || (!empty(&b) && a != b) {
                            ("its scale", "the block")
                        } else {
                            ("the block", "its scale")
                        };
                        let set = if empty(&a) { &b } else { &a };
                        let lo: Vec<u64> = set
                            .iter()
                            .zip(&plan.block)
                            .map(|(s, b)| s.first().unwrap_or(0) * b)
                            .collect();
                        let hi: Vec<u64> = lo
                            .iter()
                            .zip(&plan.block)
                            .zip(&spec.shape)
                            .map(|((l, b), n)| (l + b).min(*n))
                            .collect();
                        return Err(Error::invalid_argument(format!(
                            "tensors[{t}].quant.scale_layout: the block {} is converted by its receivers (no source shard holds it whole), which write its scale themselves, but rank {rank} holds {holds} and not {lacks}; give the scale the destination's mesh and placements (the default) or layouts where a source shard holds whole blocks",
                            describe_box(&lo, &hi)
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The inner tensor's spec, view of `rank` on `side` (memoised).
    fn view<'a>(
        &self,
        memo: &'a mut HashMap<(u32, Side, u32), Option<RankView>>,
        v: u32,
        side: Side,
        rank: u32,
    ) -> Option<&'a RankView> {
        memo.entry((v, side, rank))
            .or_insert_with(|| self.inner.tensors()[v as usize].rank_view(side, rank))
            .as_ref()
    }

    /// `rank`'s blocks: the inner planner's, cut to their class and moved to the workspace,
    /// then the scales of sender-converted blocks. Canonical order: tensors' data (inner
    /// tensor order), then scales (tensor order).
    pub(crate) fn rank_blocks(&self, tensors: &[TensorSpec], rank: u32) -> Result<Vec<Block>> {
        let mut memo = HashMap::new();
        let mut out = Vec::new();
        for block in self.inner.rank_blocks(rank)? {
            let v = block.tensor;
            match self.roles[v as usize] {
                Role::Plain(t) => out.push(retensor(block, t)),
                Role::Sender(t) => {
                    let plan = self.plan(t);
                    let parts = [plan.sender_whole.clone()];
                    for piece in self.cut(&block, &parts, &mut memo)? {
                        out.push(self.relocate(piece, t, Role::Sender(t)));
                    }
                }
                Role::Receiver(t) => {
                    let plan = self.plan(t);
                    let parts = plan.receiver_parts(&tensors[t as usize].shape);
                    for piece in self.cut(&block, &parts, &mut memo)? {
                        out.push(self.relocate(piece, t, Role::Receiver(t)));
                    }
                }
            }
        }
        for (t, plan) in self.plans.iter().enumerate() {
            if let Some(plan) = plan {
                self.scale_blocks(&tensors[t], t as u32, plan, rank, &mut out)?;
            }
        }
        Ok(out)
    }

    fn plan(&self, t: u32) -> &TensorPlan {
        self.plans[t as usize]
            .as_ref()
            .expect("a converted tensor has a plan")
    }

    /// The parts of `block` inside the union of the products `parts` (disjoint), each with its
    /// copy; the block itself when it lies inside one.
    fn cut(
        &self,
        block: &Block,
        parts: &[Vec<IndexRuns>],
        memo: &mut HashMap<(u32, Side, u32), Option<RankView>>,
    ) -> Result<Vec<Block>> {
        let n = block.start.len();
        let inside = |part: &Vec<IndexRuns>| {
            (0..n).all(|d| {
                let range = IndexRuns::range(block.start[d], block.start[d] + block.count[d]);
                part[d].intersect(&range).len() == block.count[d]
            })
        };
        if parts.iter().any(inside) {
            return Ok(vec![block.clone()]);
        }
        let v = block.tensor;
        let elem = u64::from(self.inner.tensors()[v as usize].elem_size());
        let from_side = if block.copy.src.buffer == Buffer::Dst {
            Side::Dst
        } else {
            Side::Src
        };
        let missing =
            |who: u32| Error::internal(format!("rank {who} has no view of inner tensor {v}"));
        let from = self
            .view(memo, v, from_side, block.from)
            .ok_or_else(|| missing(block.from))?
            .view
            .byte_strides();
        let to = self
            .view(memo, v, Side::Dst, block.to)
            .ok_or_else(|| missing(block.to))?
            .view
            .byte_strides();
        let mut out = Vec::new();
        for part in parts {
            let runs: Vec<IndexRuns> = (0..n)
                .map(|d| {
                    part[d].intersect(&IndexRuns::range(
                        block.start[d],
                        block.start[d] + block.count[d],
                    ))
                })
                .collect();
            if runs.iter().any(IndexRuns::is_empty) {
                continue;
            }
            let mut choice = vec![0usize; n];
            loop {
                let start: Vec<u64> = (0..n).map(|d| runs[d].runs()[choice[d]].start).collect();
                let count: Vec<u64> = (0..n).map(|d| runs[d].runs()[choice[d]].len()).collect();
                let shift = |strides: &[u64]| -> u64 {
                    (0..n)
                        .map(|d| (start[d] - block.start[d]) * strides[d])
                        .sum()
                };
                let dims: Vec<CopyDim> = (0..n)
                    .map(|d| CopyDim {
                        count: count[d],
                        src_stride: from[d],
                        dst_stride: to[d],
                    })
                    .collect();
                let copy = StridedCopy::new(
                    Loc {
                        offset: block.copy.src.offset + shift(&from),
                        ..block.copy.src
                    },
                    Loc {
                        offset: block.copy.dst.offset + shift(&to),
                        ..block.copy.dst
                    },
                    elem,
                    &dims,
                );
                out.push(Block {
                    start,
                    count,
                    copy,
                    ..block.clone()
                });
                if !next_index(&mut choice, |d| runs[d].runs().len()) {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Moves an inner block of tensor `t`'s class to the locations the rank's program uses:
    /// the sender class reads the sender's converted image, the receiver class lands in the
    /// receiver's unconverted area (and a relay forwards from there).
    fn relocate(&self, mut block: Block, t: u32, role: Role) -> Block {
        let work = |kind, offset| Loc {
            buffer: Buffer::Work,
            tensor: region(t, kind),
            offset,
        };
        let view = |buffer, offset| Loc {
            buffer,
            tensor: t,
            offset,
        };
        let (src, dst) = (block.copy.src, block.copy.dst);
        let (src, dst) = match role {
            Role::Sender(_) => (
                match src.buffer {
                    Buffer::Src => work(WorkRegion::Converted, src.offset),
                    _ => view(Buffer::Dst, src.offset),
                },
                view(Buffer::Dst, dst.offset),
            ),
            Role::Receiver(_) | Role::Plain(_) => (
                match src.buffer {
                    Buffer::Src => view(Buffer::Src, src.offset),
                    _ => work(WorkRegion::Unconverted, src.offset),
                },
                work(WorkRegion::Unconverted, dst.offset),
            ),
        };
        block.tensor = t;
        block.copy.src = src;
        block.copy.dst = dst;
        block
    }

    /// The blocks of tensor `t`'s scales that `rank` sends or receives: from each source
    /// shard's scale grid (the scales of the blocks it holds whole) to every rank of the
    /// scale layout holding some of them, sent by one replica of the shard (the receiver
    /// itself when it is one, else one on its node if any, rotated over the rest).
    fn scale_blocks(
        &self,
        spec: &TensorSpec,
        t: u32,
        plan: &TensorPlan,
        rank: u32,
        out: &mut Vec<Block>,
    ) -> Result<()> {
        let (Some(scale), Some(_)) = (&plan.scale, plan.sender) else {
            return Ok(());
        };
        let n = spec.shape.len();
        let topology = &self.inner.config().topology;
        // Per dim, the source pieces: (coords, indices of the blocks the piece holds whole).
        let pieces: Vec<Vec<(Vec<u64>, IndexRuns)>> = (0..n)
            .map(|d| {
                spec.src
                    .dim_pieces(&spec.shape, d)
                    .into_iter()
                    .map(|p| {
                        let whole = whole_blocks(&p.indices, plan.block[d], spec.shape[d]);
                        (p.coords, block_indices(&whole, plan.block[d]))
                    })
                    .filter(|(_, blocks)| !blocks.is_empty())
                    .collect()
            })
            .collect();
        let sender_of = |coords: &[&[u64]], to: u32| -> Result<u32> {
            let replicas = spec.src.replicas(coords);
            if replicas.contains(&to) {
                return Ok(to);
            }
            if replicas.is_empty() {
                return Err(Error::invalid_usage(format!(
                    "tensors[{t}]: rank {to} holds scales of blocks whose source shard (coordinates {coords:?}) no surviving rank holds; give the scales the destination's layout, or keep a replica of every source shard"
                )));
            }
            let near: Vec<u32> = match topology.node(to) {
                Some(node) => replicas
                    .iter()
                    .copied()
                    .filter(|&r| topology.node(r) == Some(node))
                    .collect(),
                None => Vec::new(),
            };
            let candidates = if near.is_empty() { replicas } else { near };
            let h = mix(std::iter::once(u64::from(t))
                .chain(coords.iter().flat_map(|c| c.iter().copied()))
                .chain([u64::MAX, u64::from(to)]));
            Ok(candidates[(h % candidates.len() as u64) as usize])
        };
        let grid_view = |blocks: Vec<IndexRuns>| RankView::dense(blocks, u64::from(scale.size));
        // Scales move in the last round of data: the scale of a block is written by the
        // conversion that writes the block, which must run before the first round that reads
        // either (`by_first_read`); in a pair's stream, where a window of rounds may start
        // anywhere, a few bytes of scales would hold the conversion of their whole blocks back
        // to that pair's first round.
        let last_round = self.inner.rounds().saturating_sub(1);
        let mut emit = |from: u32, to: u32, area: Vec<IndexRuns>, grid: &RankView| -> Result<()> {
            let Some(dst) = scale.layout.rank_view(&scale.shape, scale.size, to) else {
                return Err(Error::internal(format!(
                    "rank {to} holds no scales of tensor {t}"
                )));
            };
            let movement = Movement {
                tensor: scale.index,
                from,
                to,
                round: Some(last_round),
                relay: false,
            };
            for mut block in assignment_blocks(&area, movement, grid, &dst) {
                if block.copy.bytes() == 0 {
                    continue;
                }
                block.copy.src = Loc {
                    buffer: Buffer::Work,
                    tensor: region(t, WorkRegion::Scales),
                    offset: block.copy.src.offset,
                };
                out.push(block);
            }
            Ok(())
        };
        // As a sender: this rank's shard's scales to the scale layout's ranks it serves.
        if let Some(coord) = spec.src.mesh.coord_of(rank) {
            let mine: Vec<Option<usize>> = (0..n)
                .map(|d| {
                    let own: Vec<u64> = spec.src.shard_axes(d).iter().map(|&a| coord[a]).collect();
                    pieces[d].iter().position(|(c, _)| *c == own)
                })
                .collect();
            if mine.iter().all(Option::is_some) {
                let own: Vec<&(Vec<u64>, IndexRuns)> = (0..n)
                    .map(|d| &pieces[d][mine[d].expect("checked")])
                    .collect();
                let coords: Vec<&[u64]> = own.iter().map(|(c, _)| c.as_slice()).collect();
                let grid = grid_view(own.iter().map(|(_, b)| b.clone()).collect());
                // Per dim, the scale layout's pieces overlapping this shard's blocks.
                let overlaps: Vec<Vec<(Vec<u64>, IndexRuns)>> = (0..n)
                    .map(|d| {
                        scale
                            .layout
                            .dim_pieces(&scale.shape, d)
                            .into_iter()
                            .filter_map(|p| {
                                let overlap = p.indices.intersect(&own[d].1);
                                (!overlap.is_empty()).then_some((p.coords, overlap))
                            })
                            .collect()
                    })
                    .collect();
                if overlaps.iter().all(|o| !o.is_empty()) {
                    let mut choice = vec![0usize; n];
                    loop {
                        let scale_coords: Vec<&[u64]> = (0..n)
                            .map(|d| overlaps[d][choice[d]].0.as_slice())
                            .collect();
                        let region: Vec<IndexRuns> =
                            (0..n).map(|d| overlaps[d][choice[d]].1.clone()).collect();
                        for to in scale.layout.replicas(&scale_coords) {
                            if sender_of(&coords, to)? == rank {
                                emit(rank, to, region.clone(), &grid)?;
                            }
                        }
                        if !next_index(&mut choice, |d| overlaps[d].len()) {
                            break;
                        }
                    }
                }
            }
        }
        // As a receiver: from every source shard whose blocks it holds scales of.
        if let Some(held) = scale.layout.rank_indices(&scale.shape, rank) {
            let overlaps: Vec<Vec<(&[u64], IndexRuns, &IndexRuns)>> = (0..n)
                .map(|d| {
                    pieces[d]
                        .iter()
                        .filter_map(|(c, blocks)| {
                            let overlap = blocks.intersect(&held[d]);
                            (!overlap.is_empty()).then_some((c.as_slice(), overlap, blocks))
                        })
                        .collect()
                })
                .collect();
            if overlaps.iter().all(|o| !o.is_empty()) {
                let mut choice = vec![0usize; n];
                loop {
                    let coords: Vec<&[u64]> = (0..n).map(|d| overlaps[d][choice[d]].0).collect();
                    let from = sender_of(&coords, rank)?;
                    if from != rank {
                        let region: Vec<IndexRuns> =
                            (0..n).map(|d| overlaps[d][choice[d]].1.clone()).collect();
                        let grid =
                            grid_view((0..n).map(|d| overlaps[d][choice[d]].2.clone()).collect());
                        emit(from, rank, region, &grid)?;
                    }
                    if !next_index(&mut choice, |d| overlaps[d].len()) {
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// `rank`'s conversions, with workspace locations as regions: before the rounds, the
    /// sender's (of tensors whose converted image or scales its blocks read), after them, the
    /// receiver's (of the blocks it holds of the receiver class).
    pub(crate) fn converts(
        &self,
        tensors: &[TensorSpec],
        rank: u32,
        blocks: &[Block],
    ) -> (Vec<StridedConvert>, Vec<StridedConvert>) {
        let mut before = Vec::new();
        let mut after = Vec::new();
        // The tensors whose converted image or scales the rank's blocks read as their sender,
        // in one pass over the blocks (not one per tensor: a rank's blocks and a model's
        // tensors both run to thousands).
        let mut read = vec![false; self.plans.len()];
        for b in blocks {
            if b.from == rank && b.copy.src.buffer == Buffer::Work {
                if let (u, WorkRegion::Converted | WorkRegion::Scales) =
                    region_of(b.copy.src.tensor)
                {
                    if let Some(r) = read.get_mut(u as usize) {
                        *r = true;
                    }
                }
            }
        }
        for (t, plan) in self.plans.iter().enumerate() {
            let Some(plan) = plan else { continue };
            let spec = &tensors[t];
            let reads_work = read[t];
            let t = t as u32;
            if plan.sender.is_some() && reads_work {
                before.extend(sender_converts(spec, t, plan, rank));
            }
            if plan.receiver.is_some() {
                after.extend(receiver_converts(spec, t, plan, rank));
            }
        }
        (before, after)
    }

    /// The program of `rank` from its blocks and their transfers (as
    /// [`Conversions::rank_blocks`] and the inner planner's `transfers` give them): the inner
    /// planner forms the messages, the conversions are added, and the workspace regions the
    /// program uses are laid out in its workspace.
    pub(crate) fn program(
        &self,
        tensors: &[TensorSpec],
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
        fingerprint: u64,
    ) -> Result<RankProgram> {
        let mut program = self.inner.program_from_transfers(rank, blocks, transfers)?;
        program.fingerprint = fingerprint;
        let (before, after) = self.converts(tensors, rank, blocks);
        program.converts_before = before;
        program.converts_after = after;
        converts_by_round(&mut program);
        self.place_regions(tensors, rank, &mut program);
        Ok(program)
    }

    /// Bytes of tensor `t`'s workspace region `kind` on `rank`.
    fn region_bytes(&self, tensors: &[TensorSpec], t: u32, kind: WorkRegion, rank: u32) -> u64 {
        let spec = &tensors[t as usize];
        let plan = self.plan(t);
        let elements = |side: Side| {
            spec.layout(side)
                .rank_indices(&spec.shape, rank)
                .map_or(0, |i| i.iter().map(IndexRuns::len).product::<u64>())
        };
        match kind {
            WorkRegion::Converted => elements(Side::Src) * u64::from(plan.arithmetic.dst.size()),
            WorkRegion::Unconverted => elements(Side::Dst) * u64::from(plan.arithmetic.src.size()),
            WorkRegion::Scales => {
                let Some(scale) = &plan.scale else { return 0 };
                spec.src
                    .rank_indices(&spec.shape, rank)
                    .map_or(0, |indices| {
                        indices
                            .iter()
                            .enumerate()
                            .map(|(d, i)| {
                                whole_blocks(i, plan.block[d], spec.shape[d])
                                    .len()
                                    .div_ceil(plan.block[d])
                            })
                            .product::<u64>()
                    })
                    * u64::from(scale.size)
            }
        }
    }

    /// Gives every workspace region the program uses a place in the rank's workspace (in
    /// region order, 256-byte aligned) and rewrites its locations to offsets there.
    fn place_regions(&self, tensors: &[TensorSpec], rank: u32, program: &mut RankProgram) {
        let mut used: Vec<u32> = Vec::new();
        {
            let mut note = |loc: &Loc| {
                if loc.buffer == Buffer::Work {
                    used.push(loc.tensor);
                }
            };
            for copy in program
                .local_copies
                .iter()
                .chain(&program.packs)
                .chain(&program.unpacks)
            {
                note(&copy.src);
                note(&copy.dst);
            }
            for m in program.sends.iter().chain(&program.recvs) {
                note(&m.loc);
            }
            for c in program
                .converts_before
                .iter()
                .chain(&program.converts_after)
            {
                note(&c.src);
                note(&c.dst);
                if let Some(s) = &c.scale {
                    note(s);
                }
            }
        }
        used.sort_unstable();
        used.dedup();
        let mut base: HashMap<u32, u64> = HashMap::new();
        let mut at = 0u64;
        for id in used {
            let (t, kind) = region_of(id);
            at = at.div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
            base.insert(id, at);
            at += self.region_bytes(tensors, t, kind, rank);
        }
        program.work_bytes = at;
        let place = |loc: &mut Loc| {
            if loc.buffer == Buffer::Work {
                loc.offset += base[&loc.tensor];
            }
        };
        for copy in program
            .local_copies
            .iter_mut()
            .chain(program.packs.iter_mut())
            .chain(program.unpacks.iter_mut())
        {
            place(&mut copy.src);
            place(&mut copy.dst);
        }
        for m in program.sends.iter_mut().chain(program.recvs.iter_mut()) {
            place(&mut m.loc);
        }
        for c in program
            .converts_before
            .iter_mut()
            .chain(program.converts_after.iter_mut())
        {
            place(&mut c.src);
            place(&mut c.dst);
            if let Some(s) = c.scale.as_mut() {
                place(s);
            }
        }
    }

    /// The inner planner's assignments of `rank`, with the tensors' own indices.
    pub(crate) fn assignments(&self, rank: u32) -> Vec<Assignment> {
        self.inner
            .assignments(rank)
            .into_iter()
            .map(|mut a| {
                a.tensor = match self.roles[a.tensor as usize] {
                    Role::Plain(t) | Role::Sender(t) | Role::Receiver(t) => t,
                };
                a
            })
            .collect()
    }
}

/// An inner block of a plain tensor, renamed to the tensor.
fn retensor(mut block: Block, t: u32) -> Block {
    block.tensor = t;
    block.copy.src.tensor = t;
    block.copy.dst.tensor = t;
    block
}

/// Plans one converted tensor: its classes (inner tensors, appended to `inner` with their
/// roles) and its scale tensor (index `scale_index` among the destination views).
fn tensor_plan(
    spec: &TensorSpec,
    conversion: &Conversion,
    scale_index: u32,
    roles: &mut Vec<Role>,
    inner: &mut Vec<TensorSpec>,
    t: u32,
) -> Result<TensorPlan> {
    let n = spec.shape.len();
    let block = conversion.block_shape(&spec.shape);
    let sender_whole = held_whole(&spec.src, &spec.shape, &block);
    let mut plan = TensorPlan {
        arithmetic: conversion.arithmetic(spec.dtype),
        block,
        sender_whole,
        sender: None,
        receiver: None,
        scale: conversion.scale_layout(spec).map(|layout| ScaleTensor {
            index: scale_index,
            shape: conversion.scale_shape(&spec.shape),
            layout,
            size: conversion.scale_format.size(),
        }),
    };
    let empty = spec.shape.contains(&0);
    let receiver_parts = plan.receiver_parts(&spec.shape);
    // A 0-d tensor is one block that every shard holds whole.
    let sender_class = !empty && (n == 0 || plan.sender_whole.iter().all(|w| !w.is_empty()));
    let receiver_class = !empty && !receiver_parts.is_empty();
    if receiver_class {
        // Receivers convert these blocks: each must lie whole in one destination piece per dim.
        let dst_whole = held_whole(&spec.dst, &spec.shape, &plan.block);
        for part in &receiver_parts {
            for d in 0..n {
                let bad = part[d].intersect(&complement(&dst_whole[d], spec.shape[d]));
                let Some(x) = bad.first() else { continue };
                // A block of this part split by both sides: along d by the destination, along
                // some dim by the source (the part's defining dim, whose W excludes it).
                let k = (0..n)
                    .find(|&k| part[k] != plan.sender_whole[k] && part[k].len() < spec.shape[k])
                    .unwrap_or(d);
                let mut lo: Vec<u64> = part
                    .iter()
                    .zip(&plan.block)
                    .map(|(s, b)| s.first().unwrap_or(0) / b * b)
                    .collect();
                lo[d] = x / plan.block[d] * plan.block[d];
                let hi: Vec<u64> = lo
                    .iter()
                    .zip(&plan.block)
                    .zip(&spec.shape)
                    .map(|((l, b), n)| (l + b).min(*n))
                    .collect();
                let src_cut = cut_inside(&spec.src, &spec.shape, k, lo[k], hi[k]);
                let dst_cut = cut_inside(&spec.dst, &spec.shape, d, lo[d], hi[d]);
                return Err(Error::invalid_argument(format!(
                    "the quantization block {} is split by the source layout (along dim {k}{}) and by the destination layout (along dim {d}{}): neither side holds it whole, so no rank can compute its scale; use layouts where one side holds whole blocks, or a smaller block",
                    describe_box(&lo, &hi),
                    src_cut.map(|c| format!(" at index {c}")).unwrap_or_default(),
                    dst_cut.map(|c| format!(" at index {c}")).unwrap_or_default(),
                )));
            }
        }
    }
    if sender_class {
        plan.sender = Some(inner.len() as u32);
        roles.push(Role::Sender(t));
        inner.push(TensorSpec {
            shape: spec.shape.clone(),
            dtype: conversion.dtype,
            src: Layout {
                strides: None,
                ..spec.src.clone()
            },
            dst: spec.dst.clone(),
        });
    }
    if receiver_class {
        plan.receiver = Some(inner.len() as u32);
        roles.push(Role::Receiver(t));
        inner.push(TensorSpec {
            shape: spec.shape.clone(),
            dtype: spec.dtype,
            src: spec.src.clone(),
            dst: Layout {
                strides: None,
                ..spec.dst.clone()
            },
        });
    }
    Ok(plan)
}

/// Per dim, the maximal runs of `set`, as (start, count); the boxes are their product.
fn boxes(set: &[IndexRuns]) -> Vec<(Vec<u64>, Vec<u64>)> {
    let n = set.len();
    if set.iter().any(IndexRuns::is_empty) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut choice = vec![0usize; n];
    loop {
        out.push((
            (0..n).map(|d| set[d].runs()[choice[d]].start).collect(),
            (0..n).map(|d| set[d].runs()[choice[d]].len()).collect(),
        ));
        if !next_index(&mut choice, |d| set[d].runs().len()) {
            return out;
        }
    }
}

/// Byte offset of the element at global `start` in a view holding `indices`.
fn offset_in(view: &RankView, start: &[u64]) -> u64 {
    let pos: Vec<u64> = start
        .iter()
        .zip(&view.indices)
        .map(|(&s, i)| i.position_of(s).expect("the view holds the box"))
        .collect();
    view.view.byte_offset(&pos)
}

/// Cuts `program.converts_before` by the first of the rank's rounds that reads what they
/// write and orders them by it, ending each round's conversions there
/// ([`RoundSpan::converts_end`](super::RoundSpan::converts_end)), so that an executor may run
/// a round's conversions beside the round before it (docs/quantization.md, "Conversions beside
/// transfers"). The reads are the round's packs and sends, and the local copies, which run
/// with the first round; the cutting is [`by_first_read`]'s. Run while workspace locations
/// still name their regions (before they are placed).
fn converts_by_round(program: &mut RankProgram) {
    let rounds = program.round_spans.len();
    if rounds < 2 || program.converts_before.is_empty() {
        if let Some(span) = program.round_spans.last_mut() {
            span.converts_end = program.converts_before.len();
        }
        return;
    }
    let mut reads = WorkReads::default();
    for copy in &program.local_copies {
        reads.note_copy(copy, 0);
    }
    let (mut packs, mut sends) = (0, 0);
    for (k, span) in program.round_spans.iter().enumerate() {
        let (packs_end, sends_end) = (span.packs_end, span.sends_end);
        for copy in program.packs.get(packs..packs_end).unwrap_or_default() {
            reads.note_copy(copy, k);
        }
        for m in program.sends.get(sends..sends_end).unwrap_or_default() {
            reads.note_run(m.loc, m.bytes, k);
        }
        (packs, sends) = (packs_end, sends_end);
    }
    let keyed = by_first_read(
        std::mem::take(&mut program.converts_before),
        reads,
        rounds - 1,
    );
    let firsts: Vec<usize> = keyed.iter().map(|&(k, _)| k).collect();
    program.converts_before = keyed.into_iter().map(|(_, c)| c).collect();
    for (k, span) in program.round_spans.iter_mut().enumerate() {
        span.converts_end = firsts.partition_point(|&r| r <= k);
    }
}

/// Where a rank reads its conversion workspace, keyed by when (a round): per region, the byte
/// sets read with their keys.
#[derive(Default)]
pub(crate) struct WorkReads(HashMap<u32, Vec<(usize, ByteSet)>>);

impl WorkReads {
    /// The bytes `copy` reads, at `key`; reads of other buffers are not noted.
    pub(crate) fn note_copy(&mut self, copy: &StridedCopy, key: usize) {
        if copy.src.buffer == Buffer::Work && copy.bytes() > 0 {
            self.0
                .entry(copy.src.tensor)
                .or_default()
                .push((key, ByteSet::of_copy(copy, true)));
        }
    }

    /// `bytes` bytes from `loc` on, read at `key`; reads of other buffers are not noted.
    pub(crate) fn note_run(&mut self, loc: Loc, bytes: u64, key: usize) {
        if loc.buffer == Buffer::Work && bytes > 0 {
            self.0
                .entry(loc.tensor)
                .or_default()
                .push((key, ByteSet::run(loc.offset, bytes)));
        }
    }
}

/// The most slabs [`by_first_read`] cuts one box into.
const SLABS_MAX: u64 = 256;

/// Most comparisons of a written slab with a read [`by_first_read`] makes for one rank before
/// it keys every further slab by the first read whose extent meets it (conservative).
const FIRST_READ_WORK: u64 = 1 << 22;

/// A sender's conversions (workspace locations naming their regions), each keyed by the first
/// of `reads` that may touch what it writes (its converted bytes or its scales), in key order
/// (stable within a key); nothing read: `last`, and no key is above it.
///
/// A pair's stream is sent in its rounds in stream order (`rounds.rs`), so a tensor's blocks
/// are first read over several rounds, and a round may read a thin slice of many blocks (a
/// tensor-parallel shard's rows of every expert, or its columns of every row). Each box is cut
/// into slabs of whole blocks along every dim of more than one block, outermost first, each
/// into as many pieces as keep the box within [`SLABS_MAX`] slabs (a box's cost stays bounded
/// however many blocks it has), each slab keyed by the first read that may share a byte with
/// it (`bytesets.rs`: exact for runs and rows, never later than the first real read), and
/// slabs with one key that make a box join into one conversion. The program's conversions
/// ([`RoundSpan::converts_end`](super::RoundSpan::converts_end)) and the exported convert
/// transfers (`ncclReshardPlanGetTransfers`) are both cut here. (Until 0.14 slabs were cut
/// along the outermost such dim only and keyed by the extents of reads, so one strided read
/// across a tensor's experts keyed all of them.)
pub(crate) fn by_first_read(
    converts: Vec<StridedConvert>,
    reads: WorkReads,
    last: usize,
) -> Vec<(usize, StridedConvert)> {
    let reads: HashMap<u32, Reads> = reads
        .0
        .into_iter()
        .map(|(id, list)| (id, Reads::new(list)))
        .collect();
    let mut work = FIRST_READ_WORK;
    let mut key_of = |c: &StridedConvert| -> usize {
        let mut first = |id: u32, set: ByteSet| {
            reads
                .get(&id)
                .and_then(|r| r.first_meeting(&set, &mut work))
        };
        let mut k = first(c.dst.tensor, written_values(c));
        if let Some((scale, set)) = c.scale.zip(written_scales(c)) {
            k = match (k, first(scale.tensor, set)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        k.unwrap_or(last).min(last)
    };
    let mut keyed: Vec<(usize, StridedConvert)> = Vec::new();
    for convert in converts {
        // Per dim of more than one block, outermost first: its cut into pieces of `step`
        // elements (whole blocks), as many as the slabs left allow.
        let mut cuts: Vec<(usize, u64)> = Vec::new();
        let mut left = SLABS_MAX;
        for (d, dim) in convert.dims.iter().enumerate() {
            let block = dim.block.max(1);
            let blocks = dim.count.div_ceil(block);
            if blocks < 2 || left < 2 {
                continue;
            }
            let step = blocks.div_ceil(blocks.min(left)) * block;
            left /= dim.count.div_ceil(step);
            cuts.push((d, step));
        }
        cut_keyed(convert, &cuts, &mut key_of, &mut keyed);
    }
    keyed.sort_by_key(|&(k, _)| k);
    keyed
}

/// Appends `convert` cut along `cuts` ((dim, step), outermost first) to `out`, each slab with
/// its key: the pieces along the first cut's dim that stay whole (one key for all their slabs)
/// join the piece before them when it stayed whole with the same key.
fn cut_keyed(
    convert: StridedConvert,
    cuts: &[(usize, u64)],
    key_of: &mut dyn FnMut(&StridedConvert) -> usize,
    out: &mut Vec<(usize, StridedConvert)>,
) {
    let Some((&(d, step), rest)) = cuts.split_first() else {
        out.push((key_of(&convert), convert));
        return;
    };
    let count = convert.dims[d].count;
    // The last piece if it stayed whole: its place in `out` and where it starts along `d`.
    let mut whole: Option<(usize, u64)> = None;
    for from in (0..count).step_by(step as usize) {
        let to = (from + step).min(count);
        let at = out.len();
        cut_keyed(slab_of(&convert, d, from, to), rest, key_of, out);
        if out.len() != at + 1 {
            whole = None;
            continue;
        }
        match whole {
            Some((before, start)) if out[before].0 == out[at].0 => {
                out.pop();
                out[before].1 = slab_of(&convert, d, start, to);
            }
            _ => whole = Some((at, from)),
        }
    }
}

/// The converted bytes `c` writes, as a byte set of its destination region.
fn written_values(c: &StridedConvert) -> ByteSet {
    let size = u64::from(c.arithmetic.dst.size());
    dense_rows(
        c.dst.offset,
        size,
        c.dims.iter().map(|d| (d.count, d.dst_stride)).collect(),
    )
}

/// The scale bytes `c` writes (scaled conversions only), as a byte set of its scale region.
fn written_scales(c: &StridedConvert) -> Option<ByteSet> {
    let (scale, encoding) = c.scale.zip(c.arithmetic.scale)?;
    Some(dense_rows(
        scale.offset,
        u64::from(encoding.format.size()),
        c.dims
            .iter()
            .map(|d| (d.count.div_ceil(d.block.max(1)), d.scale_stride))
            .collect(),
    ))
}

/// `size`-byte elements at `offset + Σ i_d · stride_d` (`dims`: (count, stride), outermost
/// first) as a byte set, inner dims that continue their element runs folded into the chunk.
fn dense_rows(offset: u64, size: u64, mut dims: Vec<(u64, u64)>) -> ByteSet {
    let mut chunk = size;
    if dims.iter().any(|&(count, _)| count == 0) {
        return ByteSet::run(offset, 0);
    }
    dims.retain(|&(count, _)| count > 1);
    while let Some(&(count, stride)) = dims.last() {
        if stride != chunk {
            break;
        }
        chunk = chunk.saturating_mul(count);
        dims.pop();
    }
    ByteSet {
        offset,
        chunk,
        dims,
    }
}

/// Elements `from .. to` along dim `d` of `convert`'s box (block-aligned: `from` a multiple of
/// the dim's block), as a conversion of its own.
fn slab_of(convert: &StridedConvert, d: usize, from: u64, to: u64) -> StridedConvert {
    let mut slab = convert.clone();
    let dim = convert.dims[d];
    slab.start[d] += from;
    slab.dims[d].count = to - from;
    slab.src.offset += from * dim.src_stride;
    slab.dst.offset += from * dim.dst_stride;
    if let Some(scale) = slab.scale.as_mut() {
        scale.offset += from / dim.block.max(1) * dim.scale_stride;
    }
    slab
}

/// A rank's conversions of the blocks its source shard holds whole: source view → converted
/// image (and scale grid), one box per product of whole-block runs.
fn sender_converts(spec: &TensorSpec, t: u32, plan: &TensorPlan, rank: u32) -> Vec<StridedConvert> {
    let n = spec.shape.len();
    let Some(src) = spec.rank_view(Side::Src, rank) else {
        return Vec::new();
    };
    let dst_size = u64::from(plan.arithmetic.dst.size());
    let image = RankView::dense(src.indices.clone(), dst_size);
    let whole: Vec<IndexRuns> = (0..n)
        .map(|d| whole_blocks(&src.indices[d], plan.block[d], spec.shape[d]))
        .collect();
    let grid: Vec<IndexRuns> = (0..n)
        .map(|d| block_indices(&whole[d], plan.block[d]))
        .collect();
    let scale = plan
        .scale
        .as_ref()
        .map(|s| RankView::dense(grid.clone(), u64::from(s.size)));
    let (src_strides, image_strides) = (src.view.byte_strides(), image.view.byte_strides());
    let scale_strides = scale.as_ref().map(|s| s.view.byte_strides());
    boxes(&whole)
        .into_iter()
        .map(|(start, count)| {
            let first_block: Vec<u64> = start.iter().zip(&plan.block).map(|(s, b)| s / b).collect();
            let ends = ConvertEnds {
                src: Loc {
                    buffer: Buffer::Src,
                    tensor: t,
                    offset: offset_in(&src, &start),
                },
                dst: Loc {
                    buffer: Buffer::Work,
                    tensor: region(t, WorkRegion::Converted),
                    offset: offset_in(&image, &start),
                },
                scale: scale.as_ref().map(|s| Loc {
                    buffer: Buffer::Work,
                    tensor: region(t, WorkRegion::Scales),
                    offset: offset_in(s, &first_block),
                }),
                strides: [&src_strides, &image_strides],
                scale_strides: scale_strides.as_deref(),
            };
            ends.convert(t, start, &count, plan)
        })
        .collect()
}

/// Where one box's conversion reads and writes: its locations and the byte strides of the
/// source, destination and scale views.
struct ConvertEnds<'a> {
    src: Loc,
    dst: Loc,
    scale: Option<Loc>,
    strides: [&'a [u64]; 2],
    scale_strides: Option<&'a [u64]>,
}

impl ConvertEnds<'_> {
    /// The conversion of the box at global `start` of `count` elements per dim.
    fn convert(&self, t: u32, start: Vec<u64>, count: &[u64], plan: &TensorPlan) -> StridedConvert {
        StridedConvert {
            tensor: t,
            start,
            src: self.src,
            dst: self.dst,
            scale: self.scale,
            dims: (0..count.len())
                .map(|d| ConvertDim {
                    count: count[d],
                    src_stride: self.strides[0][d],
                    dst_stride: self.strides[1][d],
                    block: plan.block[d],
                    scale_stride: self.scale_strides.map_or(0, |s| s[d]),
                })
                .collect(),
            arithmetic: plan.arithmetic,
        }
    }
}

/// A rank's conversions of the receiver-class blocks of its destination shard: unconverted
/// area → destination view (and the scale view), one box per product of runs contiguous in
/// the scale view too.
fn receiver_converts(
    spec: &TensorSpec,
    t: u32,
    plan: &TensorPlan,
    rank: u32,
) -> Vec<StridedConvert> {
    let n = spec.shape.len();
    let Some(dst) = spec
        .dst
        .rank_view(&spec.shape, plan.arithmetic.dst.size(), rank)
    else {
        return Vec::new();
    };
    let src_size = u64::from(plan.arithmetic.src.size());
    let landing = RankView::dense(dst.indices.clone(), src_size);
    let scale = plan.scale.as_ref().and_then(|s| {
        s.layout
            .rank_view(&s.shape, s.size, rank)
            .map(|v| (s.index, v))
    });
    let (landing_strides, dst_strides) = (landing.view.byte_strides(), dst.view.byte_strides());
    let scale_strides = scale.as_ref().map(|(_, v)| v.view.byte_strides());
    let mut out = Vec::new();
    for part in plan.receiver_parts(&spec.shape) {
        let mine: Vec<IndexRuns> = (0..n).map(|d| part[d].intersect(&dst.indices[d])).collect();
        for (start, count) in boxes_split(&mine, plan, &scale) {
            let first_block: Vec<u64> = start.iter().zip(&plan.block).map(|(s, b)| s / b).collect();
            let ends = ConvertEnds {
                src: Loc {
                    buffer: Buffer::Work,
                    tensor: region(t, WorkRegion::Unconverted),
                    offset: offset_in(&landing, &start),
                },
                dst: Loc {
                    buffer: Buffer::Dst,
                    tensor: t,
                    offset: offset_in(&dst, &start),
                },
                scale: scale.as_ref().map(|(index, v)| Loc {
                    buffer: Buffer::Dst,
                    tensor: *index,
                    offset: offset_in(v, &first_block),
                }),
                strides: [&landing_strides, &dst_strides],
                scale_strides: scale_strides.as_deref(),
            };
            out.push(ends.convert(t, start, &count, plan));
        }
    }
    out
}

/// The boxes of `set` (whole blocks along each dim), cut where the scale view's block
/// indices stop being contiguous: a run of `set` may join blocks the scale view holds apart.
fn boxes_split(
    set: &[IndexRuns],
    plan: &TensorPlan,
    scale: &Option<(u32, RankView)>,
) -> Vec<(Vec<u64>, Vec<u64>)> {
    let Some((_, v)) = scale else {
        return boxes(set);
    };
    let n = set.len();
    let pieces: Vec<Vec<(u64, u64)>> = (0..n)
        .map(|d| {
            let b = plan.block[d];
            let mut out = Vec::new();
            for run in set[d].runs() {
                let blocks = IndexRuns::range(run.start / b, run.end.div_ceil(b));
                for (s, len) in blocks.contiguous_pieces(&[&v.indices[d]]) {
                    let lo = (s * b).max(run.start);
                    let hi = ((s + len) * b).min(run.end);
                    out.push((lo, hi - lo));
                }
            }
            out
        })
        .collect();
    if pieces.iter().any(Vec::is_empty) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut choice = vec![0usize; n];
    loop {
        out.push((
            (0..n).map(|d| pieces[d][choice[d]].0).collect(),
            (0..n).map(|d| pieces[d][choice[d]].1).collect(),
        ));
        if !next_index(&mut choice, |d| pieces[d].len()) {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_blocks_of_runs() {
        let runs = IndexRuns::from_ranges([(0, 150), (200, 300)]);
        // Blocks of 128 over 300: [0, 128) is whole in [0, 150); [256, 300) is the last
        // (short) block, whole in [200, 300).
        assert_eq!(
            whole_blocks(&runs, 128, 300),
            IndexRuns::from_ranges([(0, 128), (256, 300)])
        );
        assert_eq!(
            block_indices(&IndexRuns::from_ranges([(0, 128), (256, 300)]), 128),
            IndexRuns::from_ranges([(0, 1), (2, 3)])
        );
        assert_eq!(
            complement(&IndexRuns::from_ranges([(0, 128), (256, 300)]), 300),
            IndexRuns::range(128, 256)
        );
    }
}
