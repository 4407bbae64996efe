//! The planner: tensors + config + rank → that rank's [`RankProgram`] (DESIGN §4–§5).
//!
//! Deterministic and local: every rank computes its program from the same descriptors without
//! talking to anyone. A rank enumerates only the units it takes part in — as a receiver, the
//! source shards overlapping its destination shard; as a sender, the destination shards
//! overlapping its source shard — found per dim by intersecting index runs, so a rank in
//! neither mesh does no work for a tensor and a participant never loops over rank pairs.

mod assign;
mod blocks;
mod config;
mod convert;
mod fingerprint;
mod fxhash;
mod messages;
mod program;
mod quantize;
mod rounds;

pub use assign::Assignment;
pub use blocks::Block;
pub use config::{
    Config, Mode, Topology, AUTO_MAX_ROUNDS, AUTO_STAGE_MAX_AVG_BYTES, AUTO_STAGE_MAX_MESSAGES,
    AUTO_STAGE_MIN_MESSAGES, DEFAULT_SPLIT_MIN_BYTES, GROUPABLE_MAX_MESSAGES_PER_RANK,
    GROUPABLE_MAX_PIECES_PER_PAIR, MAX_ROUNDS, ROUND_TARGET_BYTES,
};
pub use convert::{ConvertDim, StridedConvert};
pub use fingerprint::fingerprint;
pub use messages::STAGING_ALIGN;
pub use program::{
    Buffer, CopyDim, ExecMode, Loc, Message, RankProgram, Round, RoundSpan, StridedCopy,
};
pub use quantize::{region, region_of, WorkRegion};
pub use rounds::Transfer;

use crate::error::{Error, Result};
use crate::layout::{next_index, DType, DimPiece, IndexRuns, Layout, RankView, Side, TensorSpec};
use crate::quant::Conversion;
use assign::{assign, Unit};
use blocks::assignment_blocks;
use fxhash::{FxHashMap, FxHashSet};
use messages::{Emitter, End};
use std::collections::BTreeMap;
use std::rc::Rc;

/// Validated inputs of a plan, ready to produce any rank's program.
#[derive(Clone, Debug)]
pub struct Planner {
    tensors: Vec<TensorSpec>,
    config: Config,
    fingerprint: u64,
    /// Per tensor, ids of its (source, destination) layout among the plan's distinct layouts:
    /// tensors sharing a layout and shape share the geometry computed for them.
    layout_ids: Vec<[u32; 2]>,
    /// Rounds the data is spread over (1 in groupable mode); relays add one more.
    rounds: u32,
    /// Tensors that arrive in another dtype (`plan/quantize.rs`): the blocks are then made by
    /// an inner planner over their conversion classes.
    conversions: Option<Box<quantize::Conversions>>,
}

/// Geometry computed once per rank call and shared by every tensor with the same layout,
/// shape (and element size, for views).
#[derive(Default)]
struct Memo<'a> {
    /// (layout id, shape, dim) → the layout's pieces of that dim (the key's last field is
    /// the dim here, a rank below).
    pieces: FxHashMap<RankKey<'a>, Rc<Vec<DimPiece>>>,
    /// (layout id, shape, rank) → the rank's indices, if it is in the mesh.
    indices: FxHashMap<RankKey<'a>, Option<Rc<Vec<IndexRuns>>>>,
    /// (layout id, shape, element size, rank) → the rank's indices and view.
    views: FxHashMap<(RankKey<'a>, u32), Option<Rc<RankView>>>,
}

type RankKey<'a> = (u32, &'a [u64], u32);

impl<'a> Memo<'a> {
    fn pieces(
        &mut self,
        id: u32,
        layout: &Layout,
        shape: &'a [u64],
        dim: usize,
    ) -> Rc<Vec<DimPiece>> {
        self.pieces
            .entry((id, shape, dim as u32))
            .or_insert_with(|| Rc::new(layout.dim_pieces(shape, dim)))
            .clone()
    }

    fn indices(
        &mut self,
        id: u32,
        layout: &Layout,
        shape: &'a [u64],
        rank: u32,
    ) -> Option<Rc<Vec<IndexRuns>>> {
        self.indices
            .entry((id, shape, rank))
            .or_insert_with(|| layout.rank_indices(shape, rank).map(Rc::new))
            .clone()
    }

    /// [`TensorSpec::rank_view`] from the memoised indices.
    fn view(
        &mut self,
        id: u32,
        spec: &'a TensorSpec,
        side: Side,
        rank: u32,
    ) -> Option<Rc<RankView>> {
        let key = ((id, spec.shape.as_slice(), rank), spec.elem_size());
        if let Some(hit) = self.views.get(&key) {
            return hit.clone();
        }
        let layout = spec.layout(side);
        let made = self
            .indices(id, layout, &spec.shape, rank)
            .map(|indices| Rc::new(RankView::new(layout, (*indices).clone(), spec.elem_size())));
        self.views.insert(key, made.clone());
        made
    }
}

impl Planner {
    /// Validates every tensor and the config. Errors name the field: `tensors[3].src: …`.
    pub fn new(tensors: Vec<TensorSpec>, config: Config) -> Result<Planner> {
        if tensors.len() > i32::MAX as usize {
            return Err(Error::invalid_argument("too many tensors"));
        }
        config.validate()?;
        // Identical layouts are interned (tensors sharing a layout share geometry), and
        // identical tensors (a model's layers) are validated once.
        let layout_ids: Vec<[u32; 2]> = {
            let mut ids: FxHashMap<&Layout, u32> = FxHashMap::default();
            let mut id = |layout| {
                let next = ids.len() as u32;
                *ids.entry(layout).or_insert(next)
            };
            tensors.iter().map(|t| [id(&t.src), id(&t.dst)]).collect()
        };
        let mut valid: FxHashSet<([u32; 2], &[u64], DType)> = FxHashSet::default();
        for (i, (t, ids)) in tensors.iter().zip(&layout_ids).enumerate() {
            let key = (*ids, t.shape.as_slice(), t.dtype);
            if valid.contains(&key) {
                continue;
            }
            t.validate()
                .map_err(|e| e.context(format!("tensors[{i}]")))?;
            valid.insert(key);
        }
        if let Topology::NodeTable(table) = &config.topology {
            let ranks = tensors
                .iter()
                .flat_map(|t| t.src.mesh.ranks().iter().chain(t.dst.mesh.ranks()));
            if let Some(&rank) = ranks.max() {
                if rank as usize >= table.len() {
                    return Err(Error::invalid_argument(format!(
                        "config: the node table has {} entries but the tensors use rank {rank}; give every rank's node",
                        table.len()
                    )));
                }
            }
        }
        let fingerprint = fingerprint(&tensors, &config);
        let rounds = rounds_for(&tensors, &layout_ids, &config);
        Ok(Planner {
            tensors,
            config,
            fingerprint,
            layout_ids,
            rounds,
            conversions: None,
        })
    }

    /// Like [`Planner::new`], with what each tensor becomes on its way: `conversions[t]`
    /// (`None`: it arrives as it is) converts tensor t from its `dtype` to the conversion's
    /// (docs/quantization.md). Errors name the tensor (`tensors[3]: …`): a conversion its
    /// tensor does not allow, layouts where neither side holds a quantization block whole,
    /// groupable mode.
    pub fn with_conversions(
        tensors: Vec<TensorSpec>,
        conversions: Vec<Option<Conversion>>,
        config: Config,
    ) -> Result<Planner> {
        let mut planner = Planner::new(tensors, config)?;
        if let Some(c) =
            quantize::Conversions::new(&planner.tensors, &conversions, &planner.config)?
        {
            planner.fingerprint = fingerprint::with_conversions(planner.fingerprint, &conversions);
            planner.rounds = c.inner().rounds();
            planner.conversions = Some(Box::new(c));
        }
        Ok(planner)
    }

    /// What each tensor becomes on its way (`None` when no tensor converts).
    pub fn conversions(&self) -> Option<&[Option<Conversion>]> {
        self.conversions.as_deref().map(|c| c.conversions())
    }

    /// The scale tensors of quantized tensors, in tensor order: (tensor, scale shape, scale
    /// destination layout, bytes per scale). The k-th is the program's destination view
    /// `tensors().len() + k` (`Loc::tensor`).
    pub fn scale_tensors(&self) -> Vec<(u32, Vec<u64>, Layout, u32)> {
        self.conversions
            .as_deref()
            .map_or_else(Vec::new, |c| c.scale_tensors())
    }

    /// The conversions `rank` runs before and after the rounds, for `rank`'s blocks (as
    /// [`Planner::rank_blocks`] gives them), with workspace locations naming regions
    /// ([`region_of`]) rather than offsets in the rank's workspace: the exported form.
    pub fn conversion_steps(
        &self,
        rank: u32,
        blocks: &[Block],
    ) -> (Vec<StridedConvert>, Vec<StridedConvert>) {
        match &self.conversions {
            Some(c) => c.converts(&self.tensors, rank, blocks),
            None => (Vec::new(), Vec::new()),
        }
    }

    /// Rounds the data is spread over (see [`Config::rounds`]); relayed data takes one more.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Every rank that appears in a source or destination mesh, ascending.
    pub fn ranks(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self
            .tensors
            .iter()
            .flat_map(|t| t.src.mesh.ranks().iter().chain(t.dst.mesh.ranks()).copied())
            .chain(self.conversions.iter().flat_map(|c| c.scale_ranks()))
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// This rank's assignments: those it receives (local copies included) and those it sends,
    /// each list in canonical order (tensor, then region corner).
    pub fn assignments(&self, rank: u32) -> Vec<Assignment> {
        if let Some(c) = &self.conversions {
            return c.assignments(rank);
        }
        self.assignments_with(rank, &mut Memo::default())
    }

    fn assignments_with<'a>(&'a self, rank: u32, memo: &mut Memo<'a>) -> Vec<Assignment> {
        let mut out = Vec::new();
        for (t, spec) in self.tensors.iter().enumerate() {
            let [src_id, dst_id] = self.layout_ids[t];
            let t = t as u32;
            let sides = [
                (true, dst_id, &spec.dst, src_id, &spec.src),
                (false, src_id, &spec.src, dst_id, &spec.dst),
            ];
            for (own_is_dst, own_id, own, other_id, other) in sides {
                let Some(coord) = own.mesh.coord_of(rank) else {
                    continue;
                };
                let Some(mine) = memo.indices(own_id, own, &spec.shape, rank) else {
                    continue;
                };
                let other_pieces: Vec<Rc<Vec<DimPiece>>> = (0..spec.shape.len())
                    .map(|d| memo.pieces(other_id, other, &spec.shape, d))
                    .collect();
                units(
                    spec,
                    t,
                    &other_pieces,
                    own,
                    &mine,
                    &coord,
                    own_is_dst,
                    &self.config,
                    self.rounds,
                    &|from, to, relay| {
                        if own_is_dst {
                            to == rank || (relay && from == rank)
                        } else {
                            from == rank && to != rank && !relay
                        }
                    },
                    |tr| out.push(tr),
                );
            }
        }
        out.sort_by_cached_key(|t| (t.tensor, t.corner()));
        out
    }

    /// This rank's blocks — every box of data it receives, sends or copies locally, with the
    /// copy geometry on both ends — in canonical order (tensor, region corner, block order).
    pub fn rank_blocks(&self, rank: u32) -> Result<Vec<Block>> {
        if let Some(c) = &self.conversions {
            return c.rank_blocks(&self.tensors, rank);
        }
        let mut memo = Memo::default();
        let assignments = self.assignments_with(rank, &mut memo);
        let mut blocks = Vec::new();
        for assignment in &assignments {
            let spec = &self.tensors[assignment.tensor as usize];
            let [src_id, dst_id] = self.layout_ids[assignment.tensor as usize];
            let missing = |who: u32| {
                Error::internal(format!(
                    "rank {who} is not in tensor {}'s mesh",
                    assignment.tensor
                ))
            };
            // A relay reads the data where it arrived: the sender's destination view.
            let from = if assignment.relay {
                memo.view(dst_id, spec, Side::Dst, assignment.from)
            } else {
                memo.view(src_id, spec, Side::Src, assignment.from)
            }
            .ok_or_else(|| missing(assignment.from))?;
            let to = memo
                .view(dst_id, spec, Side::Dst, assignment.to)
                .ok_or_else(|| missing(assignment.to))?;
            blocks.extend(
                assignment_blocks(assignment, &from, &to)
                    .into_iter()
                    .filter(|b| b.copy.bytes() > 0),
            );
        }
        Ok(blocks)
    }

    /// The program `rank` runs. A rank outside every mesh gets an empty program.
    pub fn rank_program(&self, rank: u32) -> Result<RankProgram> {
        self.program_from_blocks(rank, &self.rank_blocks(rank)?)
    }

    /// Forms `rank`'s program from its blocks (as [`Planner::rank_blocks`] returns them).
    pub fn program_from_blocks(&self, rank: u32, blocks: &[Block]) -> Result<RankProgram> {
        self.program_from_transfers(rank, blocks, &self.transfers(blocks))
    }

    /// Cuts a rank's blocks (as [`Planner::rank_blocks`] returns them) into the
    /// [`Transfer`]s each round moves: local copies whole in round 0; each (sender, receiver)
    /// pair's blocks spread over the rounds by one function of the pair that both ends run, so
    /// a transfer has the same round, offset and copy on both ends. The one source of rounds
    /// for the rank's program ([`Planner::program_from_transfers`]) and for the exported
    /// transfer list (`ncclReshardPlanGetTransfers`). Local copies come first, in block order,
    /// then each pair's transfers (pairs ascending) by round, in the order its messages are
    /// formed from.
    pub fn transfers(&self, blocks: &[Block]) -> Vec<Transfer> {
        if let Some(c) = &self.conversions {
            return c.inner().transfers(blocks);
        }
        type PairBlocks<'b> = BTreeMap<(u32, u32), Vec<(usize, Option<u32>, &'b StridedCopy)>>;
        let mut transfers = Vec::new();
        // Per (sender, receiver): (block index, fixed round, copy) in canonical order.
        let mut pairs: PairBlocks<'_> = BTreeMap::new();
        for (i, block) in blocks.iter().enumerate() {
            if block.from == block.to && !self.config.local_via_messages {
                transfers.push(Transfer {
                    block: i,
                    round: 0,
                    offset: 0,
                    copy: block.copy.clone(),
                });
            } else {
                pairs.entry((block.from, block.to)).or_default().push((
                    i,
                    block.round,
                    &block.copy,
                ));
            }
        }
        for (pair, list) in pairs {
            transfers.extend(rounds::spread(
                pair,
                &list,
                self.rounds,
                self.config.split_min_bytes,
            ));
        }
        transfers
    }

    /// Forms `rank`'s program from its blocks and their transfers (as [`Planner::transfers`]
    /// returns them for those blocks).
    pub fn program_from_transfers(
        &self,
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
    ) -> Result<RankProgram> {
        if let Some(c) = &self.conversions {
            return c.program(&self.tensors, rank, blocks, transfers, self.fingerprint);
        }
        let mut program = RankProgram {
            rank,
            fingerprint: self.fingerprint,
            ..Default::default()
        };
        // Per (round, peer), per direction: the transfers' copies, in the order the pair's transfers
        // come (one function both ends ran).
        let mut sends: BTreeMap<(u32, u32), Vec<&StridedCopy>> = BTreeMap::new();
        let mut recvs: BTreeMap<(u32, u32), Vec<&StridedCopy>> = BTreeMap::new();
        for transfer in transfers {
            let block = blocks.get(transfer.block).ok_or_else(|| {
                Error::internal(format!(
                    "a transfer names block {} of {}",
                    transfer.block,
                    blocks.len()
                ))
            })?;
            if block.from == block.to && !self.config.local_via_messages {
                program.local_copies.push(transfer.copy.clone());
                continue;
            }
            // A message to itself (local_via_messages) is both.
            if block.from == rank {
                sends
                    .entry((transfer.round, block.to))
                    .or_default()
                    .push(&transfer.copy);
            }
            if block.to == rank {
                recvs
                    .entry((transfer.round, block.from))
                    .or_default()
                    .push(&transfer.copy);
            }
        }
        let mut round_ids: Vec<u32> = sends.keys().chain(recvs.keys()).map(|k| k.0).collect();
        round_ids.dedup();
        round_ids.sort_unstable();
        round_ids.dedup();
        // A plan of several rounds is not groupable anyway: auto coalesces every pair. (Only
        // plan-wide facts may decide how a pair is formed: both ends must agree.)
        let coalesce = self.rounds > 1;
        for round in round_ids {
            let mut emitter = Emitter::default();
            for ((_, peer), copies) in sends.range((round, 0)..=(round, u32::MAX)) {
                let pair = (rank, *peer);
                emitter.pair(End::Sender, pair, copies, self.config.mode, coalesce)?;
            }
            program.sends.append(&mut emitter.messages);
            for ((_, peer), copies) in recvs.range((round, 0)..=(round, u32::MAX)) {
                let pair = (*peer, rank);
                emitter.pair(End::Receiver, pair, copies, self.config.mode, coalesce)?;
            }
            program.recvs.append(&mut emitter.messages);
            program.packs.append(&mut emitter.packs);
            program.unpacks.append(&mut emitter.unpacks);
            program.staging_bytes = program.staging_bytes.max(emitter.staging_bytes);
            program.round_spans.push(RoundSpan {
                round,
                packs_end: program.packs.len(),
                sends_end: program.sends.len(),
                recvs_end: program.recvs.len(),
                unpacks_end: program.unpacks.len(),
            });
        }
        if program.round_spans.iter().all(|s| s.round == 0) {
            program.round_spans.clear();
        }
        Ok(program)
    }
}

/// Rounds for a plan: 1 in groupable mode, the config's count, or enough that the busiest
/// rank moves about [`ROUND_TARGET_BYTES`] per round, estimated from the tensors alone (every
/// rank must get the same count): a destination rank receives its shard of each tensor, a
/// source rank sends its share of what every destination replica needs. Per-rank sums are
/// taken per distinct layout, so the cost is tensors + ranks × layouts.
fn rounds_for(tensors: &[TensorSpec], layout_ids: &[[u32; 2]], config: &Config) -> u32 {
    if config.mode == Mode::Groupable {
        return 1;
    }
    if config.rounds > 0 {
        return config.rounds;
    }
    let shards = |layout: &Layout| -> u128 {
        (0..layout.placements.len())
            .filter(|&a| layout.placements[a].dim().is_some())
            .map(|a| u128::from(layout.mesh.shape()[a]))
            .product::<u128>()
            .max(1)
    };
    // Bytes each rank of a layout moves, per distinct layout (and the layout itself).
    let mut per_layout: FxHashMap<u32, (&Layout, u128)> = FxHashMap::default();
    for (t, ids) in tensors.iter().zip(layout_ids) {
        let bytes = u128::from(t.shape.iter().product::<u64>()) * u128::from(t.elem_size());
        let dst_ranks = t.dst.mesh.ranks().len() as u128;
        let dst_shards = shards(&t.dst);
        let src_ranks = (t.src.mesh.ranks().len() as u128).max(1);
        let replicas = (dst_ranks / dst_shards).max(1);
        per_layout.entry(ids[0]).or_insert((&t.src, 0)).1 += bytes * replicas / src_ranks;
        per_layout.entry(ids[1]).or_insert((&t.dst, 0)).1 += bytes / dst_shards;
    }
    let mut per_rank: FxHashMap<u32, u128> = FxHashMap::default();
    for (layout, bytes) in per_layout.values() {
        for &rank in layout.mesh.ranks() {
            *per_rank.entry(rank).or_default() += bytes;
        }
    }
    let busiest = per_rank.values().copied().max().unwrap_or(0);
    let rounds = busiest.div_ceil(u128::from(ROUND_TARGET_BYTES));
    rounds.clamp(1, u128::from(AUTO_MAX_ROUNDS)) as u32
}

/// Enumerates the units between `mine` (this rank's shard on `own`) and every overlapping shard
/// of `other`, and feeds the assignments of each unit to `sink`. `own_is_dst` says which side
/// `own` is.
#[allow(clippy::too_many_arguments)]
fn units(
    spec: &TensorSpec,
    tensor: u32,
    other_pieces: &[Rc<Vec<DimPiece>>],
    own: &Layout,
    mine: &[IndexRuns],
    coord: &[u64],
    own_is_dst: bool,
    config: &Config,
    rounds: u32,
    keep: &dyn Fn(u32, u32, bool) -> bool,
    mut sink: impl FnMut(Assignment),
) {
    let ndim = spec.shape.len();
    if mine.iter().any(IndexRuns::is_empty) {
        return;
    }
    // Per dim: the other side's pieces overlapping mine, as (coords, overlap).
    let mut overlaps: Vec<Vec<(&[u64], IndexRuns)>> = Vec::with_capacity(ndim);
    for (d, my_indices) in mine.iter().enumerate() {
        let list: Vec<(&[u64], IndexRuns)> = other_pieces[d]
            .iter()
            .filter_map(|piece| {
                let overlap = piece.indices.intersect(my_indices);
                (!overlap.is_empty()).then_some((piece.coords.as_slice(), overlap))
            })
            .collect();
        if list.is_empty() {
            return;
        }
        overlaps.push(list);
    }
    let own_coords: Vec<Vec<u64>> = (0..ndim)
        .map(|d| own.shard_axes(d).iter().map(|&a| coord[a]).collect())
        .collect();
    let own_refs: Vec<&[u64]> = own_coords.iter().map(Vec::as_slice).collect();
    let mut choice = vec![0usize; ndim];
    loop {
        let other_refs: Vec<&[u64]> = (0..ndim).map(|d| overlaps[d][choice[d]].0).collect();
        let region: Vec<IndexRuns> = (0..ndim)
            .map(|d| overlaps[d][choice[d]].1.clone())
            .collect();
        let (src_coords, dst_coords) = if own_is_dst {
            (other_refs, own_refs.clone())
        } else {
            (own_refs.clone(), other_refs)
        };
        let unit = Unit {
            tensor,
            spec,
            src_coords,
            dst_coords,
            region,
        };
        assign(&unit, config, rounds, keep, &mut sink);
        if !next_index(&mut choice, |d| overlaps[d].len()) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Mesh, Placement};

    fn groupable() -> Config {
        Config {
            mode: Mode::Groupable,
            ..Default::default()
        }
    }

    fn layout(shape: &[u64], ranks: &[u32], placements: &[Placement]) -> Layout {
        Layout::new(
            Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
            placements.to_vec(),
        )
    }

    fn tp2_to_tp1_dim1(mode: Mode) -> Planner {
        let spec = TensorSpec {
            shape: vec![64, 32],
            dtype: DType::Bfloat16,
            src: layout(&[2], &[0, 1], &[Placement::Shard(1)]),
            dst: layout(&[1], &[2], &[Placement::Replicate]),
        };
        Planner::new(
            vec![spec],
            Config {
                mode,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn groupable_sends_one_message_per_destination_row() {
        let planner = tp2_to_tp1_dim1(Mode::Groupable);
        let receiver = planner.rank_program(2).unwrap();
        assert_eq!(receiver.mode(), ExecMode::Groupable);
        assert_eq!(receiver.recvs.len(), 2 * 64);
        assert!(receiver
            .recvs
            .iter()
            .all(|m| m.bytes == 16 * 2 && m.loc.buffer == Buffer::Dst));
        // The sender's rows are contiguous in its buffer and adjacent rows merge on its side
        // only if they are adjacent on the receiver's: they are not, so no merging, no packs.
        let sender = planner.rank_program(0).unwrap();
        assert_eq!(sender.sends.len(), 64);
        assert!(sender.packs.is_empty());
    }

    #[test]
    fn staged_coalesces_each_pair_into_one_message() {
        for mode in [Mode::Staged, Mode::Auto] {
            let planner = tp2_to_tp1_dim1(mode);
            let receiver = planner.rank_program(2).unwrap();
            assert_eq!(receiver.mode(), ExecMode::Staged);
            assert_eq!(receiver.recvs.len(), 2);
            assert!(receiver.recvs.iter().all(|m| m.bytes == 64 * 16 * 2));
            assert_eq!(receiver.unpacks.len(), 2);
            // The whole source shard is one contiguous run: sent without a pack.
            let sender = planner.rank_program(1).unwrap();
            assert_eq!(sender.sends.len(), 1);
            assert!(sender.packs.is_empty());
            assert_eq!(sender.sends[0].loc.buffer, Buffer::Src);
        }
    }

    #[test]
    fn gathering_a_row_split_packs_on_the_sender_except_in_groupable_mode() {
        // TP1 → TP2 on dim 1: each receiver's half is contiguous for it but strided for the
        // sender. Auto and staged: the sender packs and sends one message per receiver.
        // Groupable: nothing is packed (a pack into staging would be overwritten by a second
        // call in the same NCCL group before NCCL reads it), so one message per row.
        let spec = TensorSpec {
            shape: vec![8, 8],
            dtype: DType::Float32,
            src: layout(&[1], &[0], &[Placement::Replicate]),
            dst: layout(&[2], &[1, 2], &[Placement::Shard(1)]),
        };
        let auto = Config {
            mode: Mode::Auto,
            ..Default::default()
        };
        let planner = Planner::new(vec![spec.clone()], auto).unwrap();
        let sender = planner.rank_program(0).unwrap();
        assert_eq!(sender.sends.len(), 2);
        assert_eq!(sender.packs.len(), 2);
        assert!(sender
            .sends
            .iter()
            .all(|m| m.loc.buffer == Buffer::Staging && m.bytes == 8 * 4 * 4));
        assert_eq!(planner.rank_program(1).unwrap().recvs.len(), 1);

        let planner = Planner::new(vec![spec], groupable()).unwrap();
        let sender = planner.rank_program(0).unwrap();
        assert_eq!(sender.mode(), ExecMode::Groupable);
        assert!(sender.packs.is_empty() && sender.staging_bytes == 0);
        assert_eq!(sender.sends.len(), 2 * 8);
        assert!(sender
            .sends
            .iter()
            .all(|m| m.loc.buffer == Buffer::Src && m.bytes == 4 * 4));
        let receiver = planner.rank_program(1).unwrap();
        assert_eq!(receiver.recvs.len(), 8);
        assert!(receiver.recvs.iter().all(|m| m.loc.buffer == Buffer::Dst));
    }

    #[test]
    fn groupable_caps_messages_per_rank() {
        // 16384 rows gathered from two senders, each row half from each: 32768 receives on
        // one rank, over the groupable cap; auto mode coalesces them into two.
        let spec = TensorSpec {
            shape: vec![16384, 2],
            dtype: DType::Float32,
            src: layout(&[2], &[0, 1], &[Placement::Shard(1)]),
            dst: layout(&[1], &[2], &[Placement::Replicate]),
        };
        let planner = Planner::new(vec![spec.clone()], groupable()).unwrap();
        let err = planner.rank_program(2).unwrap_err();
        assert!(
            err.message.contains(&format!(
                "more than {GROUPABLE_MAX_MESSAGES_PER_RANK} messages on rank 2"
            )) && err.message.contains("use auto or staged mode"),
            "{err}"
        );
        let auto = Config {
            mode: Mode::Auto,
            ..Default::default()
        };
        assert_eq!(
            Planner::new(vec![spec], auto)
                .unwrap()
                .rank_program(2)
                .unwrap()
                .recvs
                .len(),
            2
        );
    }

    #[test]
    fn colocated_rank_copies_its_own_overlap() {
        let spec = TensorSpec {
            shape: vec![8],
            dtype: DType::Float32,
            src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
            dst: layout(&[2], &[1, 0], &[Placement::Shard(0)]),
        };
        let planner = Planner::new(vec![spec], groupable()).unwrap();
        let p = planner.rank_program(0).unwrap();
        assert!(p.local_copies.is_empty());
        assert_eq!((p.sends.len(), p.recvs.len()), (1, 1));
        let same = TensorSpec {
            shape: vec![8],
            dtype: DType::Float32,
            src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
            dst: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
        };
        let p = Planner::new(vec![same], groupable())
            .unwrap()
            .rank_program(1)
            .unwrap();
        assert_eq!(p.bytes_copied_locally(), 16);
        assert!(p.sends.is_empty() && p.recvs.is_empty());
    }

    #[test]
    fn replicas_share_the_sending() {
        // DP4 replicas of a TP2 shard feed a single TP1 receiver: four senders split the rows.
        let spec = TensorSpec {
            shape: vec![4096, 1024],
            dtype: DType::Bfloat16,
            src: layout(
                &[4, 2],
                &(0..8).collect::<Vec<_>>(),
                &[Placement::Replicate, Placement::Shard(0)],
            ),
            dst: layout(&[1], &[8], &[Placement::Replicate]),
        };
        let planner = Planner::new(vec![spec], groupable()).unwrap();
        let receiver = planner.rank_program(8).unwrap();
        assert_eq!(receiver.peers(), (0..8).collect::<Vec<_>>());
        assert_eq!(receiver.bytes_received(), 4096 * 1024 * 2);
    }

    #[test]
    fn same_node_replica_is_preferred() {
        let spec = TensorSpec {
            shape: vec![1024],
            dtype: DType::Float32,
            src: layout(&[2], &[0, 8], &[Placement::Replicate]),
            dst: layout(&[2], &[1, 9], &[Placement::Replicate]),
        };
        let config = Config {
            topology: Topology::RanksPerNode(8),
            ..Default::default()
        };
        let planner = Planner::new(vec![spec], config).unwrap();
        assert_eq!(planner.rank_program(1).unwrap().peers(), [0]);
        assert_eq!(planner.rank_program(9).unwrap().peers(), [8]);
    }

    #[test]
    fn ranks_outside_every_mesh_get_empty_programs() {
        let planner = tp2_to_tp1_dim1(Mode::Auto);
        assert!(planner.rank_program(7).unwrap().is_empty());
    }

    #[test]
    fn a_node_table_must_cover_every_rank() {
        let planner = tp2_to_tp1_dim1(Mode::Auto);
        let config = Config {
            topology: Topology::NodeTable(vec![0, 0]),
            ..Default::default()
        };
        let err = Planner::new(planner.tensors().to_vec(), config).unwrap_err();
        assert!(
            err.message
                .contains("node table has 2 entries but the tensors use rank 2"),
            "{err}"
        );
    }

    #[test]
    fn groupable_refuses_absurd_message_counts() {
        // 2^21 rows, each half a row from each of two senders: groupable would need 2^21
        // messages per pair; auto coalesces them.
        let spec = TensorSpec {
            shape: vec![1 << 21, 2],
            dtype: DType::Int8,
            src: layout(&[2], &[0, 1], &[Placement::Shard(1)]),
            dst: layout(&[1], &[2], &[Placement::Replicate]),
        };
        let groupable = Planner::new(vec![spec.clone()], groupable()).unwrap();
        let err = groupable.rank_program(2).unwrap_err();
        assert!(err.message.contains("use auto or staged mode"), "{err}");
        let auto = Planner::new(
            vec![spec],
            Config {
                mode: Mode::Auto,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(auto.rank_program(2).unwrap().recvs.len(), 2);
    }
}
