//! The core planner: tensors that arrive as they are + config + rank → that rank's
//! [`RankProgram`] (docs/design.md §4–§5). Conversions (`quantize.rs`) are planned as inner
//! tensors of this core; [`Planner`](super::Planner) combines the two.
//!
//! Deterministic and local: every rank computes its program from the same descriptors without
//! talking to anyone. A rank enumerates only the units it takes part in — as a receiver, the
//! source shards overlapping its destination shard; as a sender, the destination shards
//! overlapping its source shard — found per dim by intersecting index runs, so a rank in
//! neither mesh does no work for a tensor and a participant never loops over rank pairs.

use super::assign::{Assignment, Grouping, Position, Prepared, Receivers, View};
use super::blocks::{assignment_blocks_into, Block, Move, Moved, Movement};
use super::config::{
    Config, Mode, Topology, AUTO_MAX_ROUNDS, AUTO_MESSAGES_PER_RANK, MAX_ROUNDS, ROUND_DATA_BYTES,
};
use super::fingerprint;
use super::fxhash::FxHashMap;
use super::loads::Loads;
use super::messages::{Emitter, End};
use super::program::{RankProgram, RoundSpan};
use super::rounds::{self, Transfer};
use super::steps::StridedCopy;
use crate::error::{Error, Result};
use crate::layout::{
    next_index, validate_shape, DType, DimPiece, IndexRuns, Layout, Mesh, RankView, Side,
    TensorSpec,
};
use std::ops::Range;
use std::rc::Rc;

/// Validated inputs of a plan of tensors that arrive as they are, ready to produce any rank's
/// program without late unpacks (the [`Planner`](super::Planner) adds them).
#[derive(Clone, Debug)]
pub(crate) struct CorePlanner {
    tensors: Vec<TensorSpec>,
    config: Config,
    fingerprint: u64,
    /// Per tensor, ids of its (source, destination) layout among the plan's distinct layouts:
    /// tensors sharing a layout and shape share the geometry computed for them.
    layout_ids: Vec<[u32; 2]>,
    /// The distinct meshes of the tensors.
    meshes: Vec<Mesh>,
    /// Per mesh of `meshes`: whether some tensor's source, and some tensor's destination,
    /// uses it.
    mesh_sides: Vec<[bool; 2]>,
    /// Per tensor, its class: tensors with the same two layouts, shape and dtype differ only
    /// in their index, so a rank works out each class's units, views and blocks once.
    classes: Vec<u32>,
    /// Per class, its first tensor.
    class_first: Vec<u32>,
    /// Rounds the data is spread over (1 in groupable mode), the priming round included;
    /// relays add one more.
    rounds: u32,
    /// The first round pairs' streams take: 1 when round 0 primes the forwarding
    /// ([`primes`]), else 0.
    stream_first: u32,
    /// The smallest part a pair's data is cut into across rounds ([`pair_part_bytes`]).
    pair_part_bytes: u64,
    /// Estimated bytes per rank: which senders are busier than any receiver.
    loads: Loads,
    /// Per tensor, where its bytes sit among what its source mesh sends, for the tensors
    /// whose forwarded chunks take their rounds from it ([`CorePlanner::place_by_stream`]).
    positions: Vec<Option<Position>>,
}

/// Geometry computed once per rank call and shared by every tensor with the same layout,
/// shape (and element size, for views).
#[derive(Default)]
struct Memo<'a> {
    /// (layout id, shape, dim) → the layout's pieces of that dim (the key's last field is
    /// the dim here, a rank below).
    pieces: FxHashMap<RankKey<'a>, Rc<Vec<DimPiece>>>,
    /// (layout id, shape, shard number) → the shard's indices ([`Layout::shard_number`]:
    /// replicas share them).
    indices: FxHashMap<ShardKey<'a>, Rc<Vec<IndexRuns>>>,
    /// (layout id, shape, shard number, element size) → the shard's indices and view.
    views: FxHashMap<(ShardKey<'a>, u32), Rc<RankView>>,
}

type RankKey<'a> = (u32, &'a [u64], u32);
type ShardKey<'a> = (u32, &'a [u64], u64);

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
        let shard = layout.shard_number(rank)?;
        let made = self.indices.entry((id, shape, shard)).or_insert_with(|| {
            let indices = layout.rank_indices(shape, rank);
            Rc::new(indices.expect("a rank with a shard number is in the mesh"))
        });
        Some(made.clone())
    }

    /// [`TensorSpec::rank_view`] from the memoised indices.
    fn view(
        &mut self,
        id: u32,
        spec: &'a TensorSpec,
        side: Side,
        rank: u32,
    ) -> Option<Rc<RankView>> {
        let layout = spec.layout(side);
        let shard = layout.shard_number(rank)?;
        let key = ((id, spec.shape.as_slice(), shard), spec.elem_size());
        if let Some(hit) = self.views.get(&key) {
            return Some(hit.clone());
        }
        let indices = self.indices(id, layout, &spec.shape, rank)?;
        let made = Rc::new(RankView::new(layout, (*indices).clone(), spec.elem_size()));
        self.views.insert(key, made.clone());
        Some(made)
    }
}

impl CorePlanner {
    /// Validates every tensor and the config. Errors name the field: `tensors[3].src: …`.
    pub fn new(tensors: Vec<TensorSpec>, config: Config) -> Result<CorePlanner> {
        if tensors.len() > i32::MAX as usize {
            return Err(Error::invalid_argument("too many tensors"));
        }
        config.validate()?;
        // Identical layouts are interned (tensors sharing a layout share geometry), and
        // identical tensors (a model's layers) form one class, validated once.
        let (layout_ids, layouts) = intern_layouts(&tensors);
        // The distinct meshes (a mesh serves several layouts).
        let meshes: Vec<Mesh> = {
            let mut seen: FxHashMap<&Mesh, ()> = FxHashMap::default();
            layouts
                .iter()
                .map(|l| &l.mesh)
                .filter(|&m| seen.insert(m, ()).is_none())
                .cloned()
                .collect()
        };
        let mesh_sides = {
            let index: FxHashMap<&Mesh, usize> =
                meshes.iter().enumerate().map(|(i, m)| (m, i)).collect();
            let of_layout: Vec<usize> = layouts.iter().map(|l| index[&l.mesh]).collect();
            let mut sides = vec![[false; 2]; meshes.len()];
            for ids in &layout_ids {
                sides[of_layout[ids[0] as usize]][0] = true;
                sides[of_layout[ids[1] as usize]][1] = true;
            }
            sides
        };
        let mut class_of: FxHashMap<([u32; 2], &[u64], DType), u32> = FxHashMap::default();
        let mut classes = Vec::with_capacity(tensors.len());
        let mut class_first: Vec<u32> = Vec::new();
        // What validation already accepted: shapes, and layouts for a shape.
        let mut valid_shapes: FxHashMap<(&[u64], u32), ()> = FxHashMap::default();
        let mut valid_layouts: FxHashMap<(u32, &[u64], u32), ()> = FxHashMap::default();
        for (i, (t, ids)) in tensors.iter().zip(&layout_ids).enumerate() {
            let key = (*ids, t.shape.as_slice(), t.dtype);
            if let Some(&class) = class_of.get(&key) {
                classes.push(class);
                continue;
            }
            // TensorSpec::validate, each part checked once per shape.
            let context = |e: Error| e.context(format!("tensors[{i}]"));
            let (shape, elem_size) = (t.shape.as_slice(), t.elem_size());
            // (A failed check returns at once, so marking before checking is fine.)
            if valid_shapes.insert((shape, elem_size), ()).is_none() {
                validate_shape(shape, elem_size).map_err(context)?;
            }
            for (id, layout, field) in [(ids[0], &t.src, "src"), (ids[1], &t.dst, "dst")] {
                if valid_layouts.insert((id, shape, elem_size), ()).is_none() {
                    layout.validate(shape, elem_size, field).map_err(context)?;
                }
            }
            // Holes (gone ranks) must leave a surviving source for what survivors need.
            super::survivors::check_held(t, i)?;
            let class = class_first.len() as u32;
            class_first.push(i as u32);
            class_of.insert(key, class);
            classes.push(class);
        }
        drop((class_of, valid_shapes, valid_layouts));
        // A node table (perhaps before a failure) must cover every rank the tensors use.
        if config.topology != Topology::Unknown {
            let ranks = meshes.iter().flat_map(|m| m.live_ranks());
            if let Some(rank) = ranks.max().filter(|&r| config.topology.node(r).is_none()) {
                let mut table = &config.topology;
                while let Topology::Survivors { before, .. } = table {
                    table = before;
                }
                let entries = match table {
                    Topology::NodeTable(t) => t.len(),
                    _ => 0,
                };
                return Err(Error::invalid_argument(format!(
                    "config: the node table has {entries} entries but the tensors use rank {rank}{}; give every rank's node",
                    if table == &config.topology { "" } else { " (of the survivors)" }
                )));
            }
        }
        let fingerprint = fingerprint::of_interned(&tensors, &layout_ids, &layouts, &config);
        let loads = Loads::new(&tensors, &layout_ids, &layouts, &config.topology);
        let positions = vec![None; tensors.len()];
        let busiest = loads.busiest();
        drop(layouts);
        let data_rounds = rounds_for(busiest, &config);
        let stream_first = u32::from(primes(&config, &loads, data_rounds));
        // Auto mode's most rounds count the priming round.
        let rounds = match config.rounds {
            0 => (data_rounds + stream_first).min(AUTO_MAX_ROUNDS),
            _ => data_rounds + stream_first,
        };
        let pair_part_bytes = pair_part_bytes(busiest, distinct_ranks(&meshes).len(), &config);
        Ok(CorePlanner {
            tensors,
            config,
            fingerprint,
            layout_ids,
            meshes,
            mesh_sides,
            classes,
            class_first,
            rounds,
            stream_first,
            pair_part_bytes,
            loads,
            positions,
        })
    }

    /// Tensors `placed` marks take their forwarded chunks' rounds from where their bytes sit
    /// in their senders' streams ([`stream_positions`]), not from a hash: used for the
    /// tensors senders convert, which a round can only send once converted (quantize.rs).
    pub fn place_by_stream(&mut self, placed: impl Fn(usize) -> bool) {
        let positions = stream_positions(&self.tensors);
        for (t, position) in positions.into_iter().enumerate() {
            self.positions[t] = placed(t).then_some(position);
        }
    }

    /// Rounds the data is spread over (see [`Config::rounds`]), the priming round included;
    /// relayed data takes one more.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// The rounds pairs' streams take: all of them, or all but the priming round 0.
    fn stream_rounds(&self) -> std::ops::Range<u32> {
        self.stream_first..self.rounds
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
        distinct_ranks(&self.meshes)
    }

    /// Whether `rank` is in some tensor's source mesh, and whether in some tensor's
    /// destination mesh.
    pub fn sides_of(&self, rank: u32) -> [bool; 2] {
        let mut sides = [false; 2];
        for (mesh, used) in self.meshes.iter().zip(&self.mesh_sides) {
            let adds = (used[0] && !sides[0]) || (used[1] && !sides[1]);
            if adds && mesh.contains(rank) {
                sides[0] |= used[0];
                sides[1] |= used[1];
            }
        }
        sides
    }

    /// This rank's assignments: those it receives (local copies included) and those it sends,
    /// each list in canonical order (tensor, then region corner).
    pub fn assignments(&self, rank: u32) -> Vec<Assignment> {
        let mut cache = RankCache::new(self.class_first.len());
        let mut picks = Vec::new();
        let mut out = Vec::new();
        for t in 0..self.tensors.len() as u32 {
            let sides = self.tensor_picks(rank, t, &mut cache, &mut picks);
            out.extend(picks.iter().map(|pick| Assignment {
                tensor: t,
                from: pick.from,
                to: pick.to,
                region: sides.unit(pick).regions[pick.region as usize].clone(),
                round: pick.round,
                relay: pick.relay,
            }));
        }
        out
    }

    /// The assignments of tensor `t` that concern `rank`, in canonical order (region corner),
    /// into `picks`; returns the class's units they refer to.
    fn tensor_picks<'a>(
        &'a self,
        rank: u32,
        t: u32,
        cache: &mut RankCache<'a>,
        picks: &mut Vec<Pick>,
    ) -> Sides {
        picks.clear();
        let class = self.classes[t as usize];
        let sides = Sides([
            self.class_units(rank, class, true, cache),
            self.class_units(rank, class, false, cache),
        ]);
        // Units whose choices do not rotate deal the same assignments for every tensor.
        let fixed = match &cache.picks[class as usize] {
            ClassPicks::Fixed(known) => {
                picks.extend_from_slice(known);
                return sides;
            }
            ClassPicks::Rotating => false,
            ClassPicks::Unknown => sides
                .0
                .iter()
                .flatten()
                .all(|units| units.iter().all(|u| !u.rotates())),
        };
        for (side, own_is_dst) in [(0usize, true), (1, false)] {
            let Some(units) = &sides.0[side] else {
                continue;
            };
            let view = if own_is_dst {
                View::Receiver(rank)
            } else {
                View::Sender(rank)
            };
            for (u, unit) in units.iter().enumerate() {
                unit.deal(
                    t,
                    unit.rotation(t),
                    self.positions[t as usize],
                    view,
                    &mut |from, to, region, round, relay| {
                        let keep = if own_is_dst {
                            to == rank || (relay && from == rank)
                        } else {
                            from == rank && to != rank && !relay
                        };
                        if keep {
                            picks.push(Pick {
                                side: side as u8,
                                unit: u as u32,
                                region,
                                from,
                                to,
                                round,
                                relay,
                            });
                        }
                    },
                );
            }
        }
        if picks.len() > 1 {
            // Stable: assignments with one corner keep the order they were dealt in.
            picks.sort_by(|a, b| sides.corner(a).cmp(sides.corner(b)));
        }
        cache.picks[class as usize] = if fixed {
            ClassPicks::Fixed(picks.clone())
        } else {
            ClassPicks::Rotating
        };
        sides
    }

    /// The units `rank` takes part in for tensors of `class`, as a receiver (`own_is_dst`) or
    /// as a sender; `None` when it has no part on that side. Computed once per rank call.
    fn class_units<'a>(
        &'a self,
        rank: u32,
        class: u32,
        own_is_dst: bool,
        cache: &mut RankCache<'a>,
    ) -> ClassUnits {
        let slot = &cache.classes[class as usize][usize::from(!own_is_dst)];
        if let Some(known) = slot {
            return known.clone();
        }
        let t = self.class_first[class as usize] as usize;
        let spec = &self.tensors[t];
        let [src_id, dst_id] = self.layout_ids[t];
        let (own_id, own, other_id, other) = if own_is_dst {
            (dst_id, &spec.dst, src_id, &spec.src)
        } else {
            (src_id, &spec.src, dst_id, &spec.dst)
        };
        let units = own.mesh.coord_of(rank).and_then(|coord| {
            let mine = cache.memo.indices(own_id, own, &spec.shape, rank)?;
            let other_pieces: Vec<Rc<Vec<DimPiece>>> = (0..spec.shape.len())
                .map(|d| cache.memo.pieces(other_id, other, &spec.shape, d))
                .collect();
            let units = units(
                spec,
                &other_pieces,
                own,
                &mine,
                &coord,
                own_is_dst,
                &self.config,
                self.rounds,
                self.pair_part_bytes,
                &self.loads,
                [src_id, dst_id],
                own_is_dst.then_some(rank),
                &mut cache.groupings,
            );
            (!units.is_empty()).then(|| Rc::new(units))
        });
        cache.classes[class as usize][usize::from(!own_is_dst)] = Some(units.clone());
        units
    }

    /// The blocks of `pick` (an assignment of a tensor of `class`) as that class's first
    /// tensor has them: a tensor's own are these with its index and the pick's round.
    fn pick_blocks<'a>(
        &'a self,
        class: u32,
        sides: &Sides,
        pick: &Pick,
        cache: &mut RankCache<'a>,
    ) -> Result<Range<u32>> {
        let key = (
            class,
            pick.side,
            pick.unit,
            pick.region,
            pick.from,
            pick.to,
            pick.relay,
        );
        if let Some(hit) = cache.blocks.get(&key) {
            return Ok(hit.clone());
        }
        let t = self.class_first[class as usize];
        let spec = &self.tensors[t as usize];
        let [src_id, dst_id] = self.layout_ids[t as usize];
        let missing = |who: u32| Error::internal(format!("rank {who} is not in tensor {t}'s mesh"));
        let memo = &mut cache.memo;
        // A relay reads the data where it arrived: the sender's destination view.
        let from = if pick.relay {
            memo.view(dst_id, spec, Side::Dst, pick.from)
        } else {
            memo.view(src_id, spec, Side::Src, pick.from)
        }
        .ok_or_else(|| missing(pick.from))?;
        let to = memo
            .view(dst_id, spec, Side::Dst, pick.to)
            .ok_or_else(|| missing(pick.to))?;
        let movement = Movement {
            tensor: t,
            from: pick.from,
            to: pick.to,
            round: None,
            relay: pick.relay,
        };
        let region = &sides.unit(pick).regions[pick.region as usize];
        let templates = &mut cache.templates;
        let start = templates.len();
        assignment_blocks_into(templates, region, movement, &from, &to, cache.boxes);
        // Keep the blocks that move bytes, in order.
        let mut kept = start;
        for i in start..templates.len() {
            if templates[i].copy.bytes() > 0 {
                templates.swap(kept, i);
                kept += 1;
            }
        }
        templates.truncate(kept);
        let range = start as u32..kept as u32;
        cache.blocks.insert(key, range.clone());
        Ok(range)
    }

    /// This rank's blocks — every box of data it receives, sends or copies locally, with the
    /// copy geometry on both ends — in canonical order (tensor, region corner, block order).
    pub fn rank_blocks(&self, rank: u32) -> Result<Vec<Block>> {
        let (items, templates) = self.rank_items(rank, true)?;
        Ok(items
            .iter()
            .map(|item| templates[item.template as usize].of_tensor(item.tensor, item.round))
            .collect())
    }

    /// Every block of this rank in canonical order, as a tensor and its round over the block
    /// as the class's first tensor has it (`templates`, each computed once).
    /// `boxes`: fill in the blocks' boxes (`Block::start`, `count`), which only the blocks'
    /// users need, not a program (a rank has tens of thousands of blocks at thousands of
    /// ranks: two allocations each).
    fn rank_items(&self, rank: u32, boxes: bool) -> Result<(Vec<Item>, Vec<Block>)> {
        let mut cache = RankCache::new(self.class_first.len());
        cache.boxes = boxes;
        let mut picks = Vec::new();
        let mut items = Vec::with_capacity(self.tensors.len());
        for t in 0..self.tensors.len() as u32 {
            let class = self.classes[t as usize];
            if let Some(known) = &cache.resolved[class as usize] {
                for &(round, ref range) in known.iter() {
                    items.extend(range.clone().map(|template| Item {
                        tensor: t,
                        round,
                        template,
                    }));
                }
                continue;
            }
            let sides = self.tensor_picks(rank, t, &mut cache, &mut picks);
            let mut resolved = Vec::new();
            for pick in &picks {
                let range = self.pick_blocks(class, &sides, pick, &mut cache)?;
                items.extend(range.clone().map(|template| Item {
                    tensor: t,
                    round: pick.round,
                    template,
                }));
                resolved.push((pick.round, range));
            }
            // A class whose picks do not rotate has these blocks for every tensor.
            if matches!(cache.picks[class as usize], ClassPicks::Fixed(_)) {
                cache.resolved[class as usize] = Some(resolved);
            }
        }
        Ok((items, cache.templates))
    }

    /// The program `rank` runs, each round's unpacks done before the next round starts and
    /// one staging arena reused by every round. A rank outside every mesh gets an empty
    /// program.
    pub fn rank_program(&self, rank: u32) -> Result<RankProgram> {
        // The same as program_from_transfers(rank_blocks(rank), ...), without the blocks' boxes and
        // without listing the rank's transfers: each pair's are made, formed into messages
        // and dropped in turn.
        let (items, templates) = self.rank_items(rank, false)?;
        let moves: Vec<Move> = items
            .iter()
            .map(|item| Move {
                tensor: item.tensor,
                round: item.round,
                block: &templates[item.template as usize],
            })
            .collect();
        drop(items);
        let (local, pairs) = self.pairs_of(&moves);
        let local_copies = local.iter().map(|&i| whole_copy(&moves[i])).collect();
        let mut list: Vec<rounds::Spread> = Vec::new();
        self.program_of_pairs(rank, local_copies, &pairs, |indices, pair, out| {
            list.clear();
            list.extend(indices.iter().map(|&i| spread_entry(&moves, i)));
            rounds::spread_into(out, pair, &list, self.stream_rounds(), self.pair_part_bytes);
        })
    }

    /// Cuts a rank's blocks (as [`CorePlanner::rank_blocks`] returns them) into the
    /// [`Transfer`]s each round moves: local copies whole in round 0; each (sender, receiver)
    /// pair's blocks spread over the rounds by one function of the pair that both ends run, so
    /// a transfer has the same round, offset and copy on both ends. The one source of rounds
    /// for the rank's program ([`CorePlanner::program_from_transfers`]) and for the exported
    /// transfer list (`ncclReshardPlanGetTransfers`). Local copies come first, in block order,
    /// then each pair's transfers (pairs ascending) by round, in the order its messages are
    /// formed from.
    pub fn transfers(&self, blocks: &[Block]) -> Vec<Transfer> {
        let mut transfers = Vec::with_capacity(blocks.len());
        let (local, pairs) = self.pairs_of(blocks);
        transfers.extend(local.into_iter().map(|i| Transfer {
            block: i,
            round: 0,
            offset: 0,
            copy: whole_copy(&blocks[i]),
        }));
        let mut list: Vec<rounds::Spread> = Vec::new();
        for (pair, indices) in pairs {
            list.clear();
            list.extend(indices.iter().map(|&i| spread_entry(blocks, i)));
            rounds::spread_into(
                &mut transfers,
                pair,
                &list,
                self.stream_rounds(),
                self.pair_part_bytes,
            );
        }
        transfers
    }

    /// A rank's blocks by where they go: the local copies' indices (block order), and per
    /// (sender, receiver) pair, ascending, its blocks' indices in canonical (block) order.
    fn pairs_of<B: Moved>(&self, blocks: &[B]) -> (Vec<usize>, Vec<Pair>) {
        let mut local = Vec::new();
        let mut pairs: FxHashMap<(u32, u32), Vec<usize>> = FxHashMap::default();
        for (i, block) in blocks.iter().enumerate() {
            let (from, to) = block.ends();
            if from == to && !self.config.local_via_messages {
                local.push(i);
            } else {
                pairs.entry((from, to)).or_default().push(i);
            }
        }
        let mut pairs: Vec<Pair> = pairs.into_iter().collect();
        pairs.sort_unstable_by_key(|&(pair, _)| pair);
        (local, pairs)
    }

    /// Forms `rank`'s program from its blocks and their transfers (as
    /// [`CorePlanner::transfers`] returns them for those blocks), as
    /// [`CorePlanner::rank_program`] would.
    pub fn program_from_transfers(
        &self,
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
    ) -> Result<RankProgram> {
        let mut local_copies = Vec::new();
        // Per pair, its transfers' indices in the order they come (one function both ends
        // ran), which the pair's messages are formed in, round by round.
        let mut pairs: FxHashMap<(u32, u32), Vec<usize>> = FxHashMap::default();
        for (i, transfer) in transfers.iter().enumerate() {
            let block = blocks.get(transfer.block).ok_or_else(|| {
                Error::internal(format!(
                    "a transfer names block {} of {}",
                    transfer.block,
                    blocks.len()
                ))
            })?;
            if block.from == block.to && !self.config.local_via_messages {
                local_copies.push(transfer.copy.clone());
            } else {
                pairs.entry((block.from, block.to)).or_default().push(i);
            }
        }
        let mut pairs: Vec<Pair> = pairs.into_iter().collect();
        pairs.sort_unstable_by_key(|&(pair, _)| pair);
        self.program_of_pairs(rank, local_copies, &pairs, |indices, _, out| {
            out.extend(indices.iter().map(|&i| transfers[i].clone()));
            out.sort_by_key(|t| t.round);
        })
    }

    /// `rank`'s program from its local copies and its pairs (ascending): `transfers(blocks
    /// of the pair, pair, out)` appends the pair's transfers to `out` by round, ascending.
    /// Each round's messages are formed as the executors post them: the rank's sends by peer,
    /// then its receives by peer, each round's staging from 0 (rounds reuse the arena).
    fn program_of_pairs(
        &self,
        rank: u32,
        local_copies: Vec<StridedCopy>,
        pairs: &[Pair],
        mut transfers: impl FnMut(&[usize], (u32, u32), &mut Vec<Transfer>),
    ) -> Result<RankProgram> {
        // A plan of several rounds is not groupable anyway: auto coalesces every pair. (Only
        // plan-wide facts may decide how a pair is formed: both ends must agree.)
        let coalesce = self.rounds > 1;
        // Per round: whether any pair moves data in it, and its part of the program.
        let mut rounds: Vec<(bool, Emitter)> = Vec::new();
        let mut pair_transfers: Vec<Transfer> = Vec::new();
        // A message to itself (local_via_messages) is both a send and a receive.
        for end in [End::Sender, End::Receiver] {
            for ((from, to), indices) in pairs {
                let mine = match end {
                    End::Sender => *from == rank,
                    End::Receiver => *to == rank,
                };
                if !mine {
                    continue;
                }
                pair_transfers.clear();
                transfers(indices, (*from, *to), &mut pair_transfers);
                let topology = &self.config.topology;
                let node_mates =
                    topology.node(*from).is_some() && topology.node(*from) == topology.node(*to);
                let mut copies: Vec<&StridedCopy> = Vec::new();
                for run in pair_transfers.chunk_by(|a, b| a.round == b.round) {
                    let round = run[0].round as usize;
                    if rounds.len() <= round {
                        rounds.resize_with(round + 1, Default::default);
                    }
                    let (moves_data, emitter) = &mut rounds[round];
                    *moves_data = true;
                    copies.clear();
                    copies.extend(run.iter().map(|t| &t.copy));
                    emitter.pair(
                        end,
                        (*from, *to),
                        &copies,
                        self.config.mode,
                        coalesce,
                        self.pair_part_bytes,
                        node_mates,
                    )?;
                }
            }
        }
        let mut program = RankProgram {
            rank,
            fingerprint: self.fingerprint,
            local_copies,
            ..Default::default()
        };
        for (round, (moves_data, mut emitter)) in rounds.into_iter().enumerate() {
            if !moves_data {
                continue;
            }
            program.packs.append(&mut emitter.packs);
            program.sends.append(&mut emitter.sends);
            program.recvs.append(&mut emitter.recvs);
            program.unpacks.append(&mut emitter.unpacks);
            program.staging_bytes = program.staging_bytes.max(emitter.staging_bytes);
            program.round_spans.push(RoundSpan {
                round: round as u32,
                // The conversions come later (`quantize.rs`).
                converts_end: 0,
                packs_end: program.packs.len(),
                sends_end: program.sends.len(),
                recvs_end: program.recvs.len(),
                unpacks_end: program.unpacks.len(),
                late_unpacks: 0,
            });
        }
        if program.round_spans.iter().all(|s| s.round == 0) {
            program.round_spans.clear();
        }
        Ok(program)
    }
}

/// A (sender, receiver) pair and its blocks' (or transfers') indices.
type Pair = ((u32, u32), Vec<usize>);

/// A block's whole copy, with its tensor.
fn whole_copy<B: Moved>(block: &B) -> StridedCopy {
    block.copy().clone().of_tensor(block.tensor())
}

/// What [`rounds::spread_into`] needs of block `i`.
fn spread_entry<B: Moved>(blocks: &[B], i: usize) -> rounds::Spread<'_> {
    let block = &blocks[i];
    (i, block.fixed_round(), block.tensor(), block.copy())
}

/// Every rank of `meshes`, ascending.
fn distinct_ranks(meshes: &[Mesh]) -> Vec<u32> {
    let mut ranks: Vec<u32> = meshes.iter().flat_map(Mesh::live_ranks).collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// Per tensor, where its bytes sit among what the ranks of its source mesh send, in tensor
/// order ((start, length) in 1/2³² of their total; each tensor weighs its bytes times its
/// destination replicas): a pair's stream goes out in tensor order, its first round taking
/// the start (`rounds.rs`), so data placed in rounds by this position is read by its senders
/// in about the order their streams read it (docs/planner.md, "Rounds").
pub(crate) fn stream_positions(tensors: &[TensorSpec]) -> Vec<Position> {
    let mut mesh_of: FxHashMap<&Mesh, u32> = FxHashMap::default();
    let mut totals: Vec<u128> = Vec::new();
    let weighed: Vec<(u32, u128)> = tensors
        .iter()
        .map(|t| {
            let next = totals.len() as u32;
            let m = *mesh_of.entry(&t.src.mesh).or_insert(next);
            if m == next {
                totals.push(0);
            }
            let replicas = (t.dst.mesh.size() as u64 / t.dst.shards()).max(1);
            let bytes = u128::from(t.shape.iter().product::<u64>()) * u128::from(t.elem_size());
            let w = bytes.saturating_mul(u128::from(replicas));
            totals[m as usize] = totals[m as usize].saturating_add(w);
            (m, w)
        })
        .collect();
    let mut before = vec![0u128; totals.len()];
    weighed
        .into_iter()
        .map(|(m, w)| {
            let total = totals[m as usize].max(1);
            let at = before[m as usize];
            before[m as usize] = at.saturating_add(w);
            // x ≤ total: shifted so that both fit in 64 bits before scaling by 2³².
            let shift = (128 - total.leading_zeros()).saturating_sub(64);
            let scale = |x: u128| {
                (((x >> shift) << 32) / (total >> shift).max(1)).min(u128::from(u32::MAX)) as u32
            };
            [scale(at), scale(w)]
        })
        .collect()
}

/// Every tensor's (source, destination) layout ids, and the distinct layouts by id. A model
/// lists tensors of one layout in a row, so each side tries the previous tensor's first.
fn intern_layouts(tensors: &[TensorSpec]) -> (Vec<[u32; 2]>, Vec<&Layout>) {
    let mut ids: FxHashMap<&Layout, u32> = FxHashMap::default();
    let mut layouts: Vec<&Layout> = Vec::new();
    let mut last: [Option<(&Layout, u32)>; 2] = [None, None];
    let layout_ids = tensors
        .iter()
        .map(|t| {
            let mut pair = [0u32; 2];
            for (side, layout) in [&t.src, &t.dst].into_iter().enumerate() {
                pair[side] = match last[side] {
                    Some((previous, id)) if previous == layout => id,
                    _ => {
                        let next = layouts.len() as u32;
                        let id = *ids.entry(layout).or_insert_with(|| {
                            layouts.push(layout);
                            next
                        });
                        last[side] = Some((layout, id));
                        id
                    }
                };
            }
            pair
        })
        .collect();
    (layout_ids, layouts)
}

/// Rounds for a plan whose busiest rank moves `busiest` bytes: 1 in groupable mode, the
/// config's count, or enough that the busiest rank moves about [`ROUND_DATA_BYTES`] per
/// round.
fn rounds_for(busiest: u128, config: &Config) -> u32 {
    if config.mode == Mode::Groupable {
        return 1;
    }
    if config.rounds > 0 {
        return config.rounds;
    }
    let rounds = busiest.div_ceil(u128::from(ROUND_DATA_BYTES));
    rounds.clamp(1, u128::from(AUTO_MAX_ROUNDS)) as u32
}

/// Whether the plan's round 0 primes its forwarding between receiving nodes (docs/planner.md,
/// "The priming round"): with `data_rounds` rounds for the data (at least 2) and a sender
/// busier than the busiest receiver ([`Loads::senders_bind`]), units forward chunks between
/// receiving nodes ([`Loads::forward_fraction`]), and a receiver takes forwarded chunks only
/// from round 1 on. Round 0 then carries what crosses the network before it is forwarded
/// (hub and relay chunks) and the pairs' streams start in round 1: had the streams started in
/// round 0, the receivers would take in less there than in any other round while their
/// senders, sending hub chunks besides, bound it (DeepSeek-V3 `pp16,ep16 → tp32,dp8` on
/// `dgx-h100`: 2.2 GB against 2.5 GB, 6 ms of idle inference NICs).
fn primes(config: &Config, loads: &Loads, data_rounds: u32) -> bool {
    config.relay
        && config.mode != Mode::Groupable
        && config.topology != Topology::Unknown
        && (2..MAX_ROUNDS).contains(&data_rounds)
        && loads.senders_bind()
}

/// The smallest part a pair's data is cut into across rounds: `split_min_bytes`, or the
/// busiest rank's bytes over the parts [`AUTO_MESSAGES_PER_RANK`] leaves once every other
/// rank of the plan is a peer (at least a quarter of it), when that is larger. A rank's
/// pairs then have at most one part each plus that many in all, however many peers and
/// rounds it has: a rank receiving from 512 peers over 31 rounds posts a few thousand
/// messages, not 512 × 31.
fn pair_part_bytes(busiest: u128, ranks: usize, config: &Config) -> u64 {
    let others = (ranks as u64).saturating_sub(1);
    let parts = AUTO_MESSAGES_PER_RANK
        .saturating_sub(others)
        .max(AUTO_MESSAGES_PER_RANK / 4);
    let share = busiest / u128::from(parts);
    config
        .split_min_bytes
        .max(u64::try_from(share).unwrap_or(u64::MAX))
}

/// One assignment of a tensor that concerns the rank being planned: which side's units it
/// comes from (0 receiving, 1 sending), the unit, the unit's region index, and how it moves.
#[derive(Clone, Copy)]
struct Pick {
    side: u8,
    unit: u32,
    region: u32,
    from: u32,
    to: u32,
    round: Option<u32>,
    relay: bool,
}

/// A class's units on the receiving and the sending side of one rank.
struct Sides([ClassUnits; 2]);

impl Sides {
    fn unit(&self, pick: &Pick) -> &Prepared {
        let units = self.0[usize::from(pick.side)]
            .as_ref()
            .expect("a pick comes from a side with units");
        &units[pick.unit as usize]
    }

    fn corner(&self, pick: &Pick) -> &[u64] {
        self.unit(pick).corner(pick.region)
    }
}

/// One block of a rank: tensor `tensor`'s copy of block `template` of its class, moving in
/// `round` when its unit fixed one.
struct Item {
    tensor: u32,
    round: Option<u32>,
    template: u32,
}

/// A pick's fixed round and its blocks' range in [`RankCache::templates`].
type PickBlocks = (Option<u32>, Range<u32>);

/// A class's units on one side of a rank (`None`: the rank has none there).
type ClassUnits = Option<Rc<Vec<Prepared>>>;

/// Blocks of one assignment, by (class, side, unit, region, from, to, relay).
type BlockKey = (u32, u8, u32, u32, u32, u32, bool);

/// What one rank call computes once and reuses across tensors.
struct RankCache<'a> {
    memo: Memo<'a>,
    /// Per class, per side (receiving, sending): its units once known (`Some(None)`: none).
    classes: Vec<[Option<ClassUnits>; 2]>,
    /// Per class: its tensors' picks when they do not depend on the tensor.
    picks: Vec<ClassPicks>,
    /// Per class whose picks are fixed: (round, blocks in `templates`) of each pick.
    resolved: Vec<Option<Vec<PickBlocks>>>,
    /// Per assignment, its blocks in `templates`.
    blocks: FxHashMap<BlockKey, Range<u32>>,
    /// Blocks as the first tensor of their class has them.
    templates: Vec<Block>,
    /// Whether `templates` get their boxes ([`CorePlanner::rank_items`]).
    boxes: bool,
    /// Units' groupings by (layout ids, shard coordinates): tensors on the same layouts
    /// share them; and destination shards' replicas by (layout id, coordinates).
    groupings: Groupings,
}

/// [`Grouping`]s by (layout ids, unit coordinates), and the [`Receivers`] they group by
/// (destination layout id, destination coordinates).
#[derive(Default)]
struct Groupings {
    units: FxHashMap<GroupingKey, Rc<Grouping>>,
    receivers: FxHashMap<(u32, Vec<u64>), Rc<Receivers>>,
}

/// The source and destination layout ids and the unit's coordinates (source, `u64::MAX`,
/// destination).
type GroupingKey = ([u32; 2], Vec<u64>);

#[derive(Clone)]
enum ClassPicks {
    Unknown,
    /// No unit of the class rotates: every tensor has these picks.
    Fixed(Vec<Pick>),
    Rotating,
}

impl RankCache<'_> {
    fn new(classes: usize) -> Self {
        RankCache {
            memo: Memo::default(),
            classes: vec![[None, None]; classes],
            picks: vec![ClassPicks::Unknown; classes],
            resolved: vec![None; classes],
            templates: Vec::new(),
            boxes: true,
            blocks: FxHashMap::default(),
            groupings: Groupings::default(),
        }
    }
}

/// The units between `mine` (this rank's shard on `own`) and every overlapping shard of
/// `other`, prepared for dealing. `own_is_dst` says which side `own` is.
#[allow(clippy::too_many_arguments)]
fn units(
    spec: &TensorSpec,
    other_pieces: &[Rc<Vec<DimPiece>>],
    own: &Layout,
    mine: &[IndexRuns],
    coord: &[u64],
    own_is_dst: bool,
    config: &Config,
    rounds: u32,
    part_bytes: u64,
    loads: &Loads,
    layout_ids: [u32; 2],
    receiver: Option<u32>,
    groupings: &mut Groupings,
) -> Vec<Prepared> {
    let ndim = spec.shape.len();
    let mut out = Vec::new();
    if mine.iter().any(IndexRuns::is_empty) {
        return out;
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
            return out;
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
            (&other_refs, &own_refs)
        } else {
            (&own_refs, &other_refs)
        };
        let key: Vec<u64> = src_coords
            .iter()
            .flat_map(|c| c.iter().copied())
            .chain([u64::MAX])
            .chain(dst_coords.iter().flat_map(|c| c.iter().copied()))
            .collect();
        let Groupings { units, receivers } = &mut *groupings;
        let grouping = units
            .entry((layout_ids, key))
            .or_insert_with(|| {
                let dst_key: Vec<u64> = dst_coords.iter().flat_map(|c| c.iter().copied()).collect();
                let receivers = receivers
                    .entry((layout_ids[1], dst_key))
                    .or_insert_with(|| Rc::new(Receivers::new(spec, dst_coords, config)));
                Rc::new(Grouping::new(spec, src_coords, receivers, config))
            })
            .clone();
        out.push(Prepared::new(
            spec, src_coords, dst_coords, region, &grouping, config, rounds, part_bytes, loads,
            receiver,
        ));
        if !next_index(&mut choice, |d| overlaps[d].len()) {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{rounds_for, stream_positions};
    use crate::layout::{DType, Layout, Mesh, Placement, TensorSpec};
    use crate::plan::config::{
        Config, Mode, AUTO_MAX_ROUNDS, ROUND_DATA_BYTES, ROUND_TARGET_BYTES,
    };

    /// Automatic rounds carry about two thirds of the staging target each (docs/planner.md,
    /// "Round size"); a config's count and groupable mode's single round are kept.
    #[test]
    fn automatic_rounds_leave_a_third_of_the_staging_target_for_late_unpacks() {
        let auto = Config::default();
        let data = u128::from(ROUND_DATA_BYTES);
        assert_eq!(ROUND_DATA_BYTES, ROUND_TARGET_BYTES / 3 * 2);
        assert_eq!(rounds_for(0, &auto), 1);
        assert_eq!(rounds_for(data, &auto), 1);
        assert_eq!(rounds_for(data + 1, &auto), 2);
        assert_eq!(rounds_for(u128::from(ROUND_TARGET_BYTES), &auto), 2);
        // 30 GiB: 12 rounds (8 when rounds aimed at the whole target).
        assert_eq!(rounds_for(30 << 30, &auto), 12);
        assert_eq!(rounds_for(u128::MAX, &auto), AUTO_MAX_ROUNDS);
        let fixed = Config {
            rounds: 5,
            ..Config::default()
        };
        assert_eq!(rounds_for(u128::MAX, &fixed), 5);
        let groupable = Config {
            mode: Mode::Groupable,
            ..Config::default()
        };
        assert_eq!(rounds_for(u128::MAX, &groupable), 1);
    }

    fn spec(shape: &[u64], src_ranks: &[u32], dst: (&[u64], &[u32], Placement)) -> TensorSpec {
        let mesh = |shape: &[u64], ranks: &[u32]| {
            Mesh::new(shape.to_vec(), ranks.to_vec()).expect("valid mesh")
        };
        TensorSpec {
            shape: shape.to_vec(),
            dtype: DType::Bfloat16,
            src: Layout::new(
                mesh(&[src_ranks.len() as u64], src_ranks),
                vec![Placement::Shard(0)],
            ),
            dst: Layout::new(mesh(dst.0, dst.1), vec![Placement::Replicate, dst.2]),
        }
    }

    /// Each tensor's place among its source mesh's tensors in tensor order, weighed by bytes
    /// times destination replicas; tensors of other meshes do not count; sizes far past 2⁶⁴
    /// bytes in all scale without overflow.
    #[test]
    fn positions_are_shares_of_the_source_meshs_bytes_in_tensor_order() {
        let two_replicas = (&[2u64, 2][..], &[4u32, 5, 6, 7][..], Placement::Shard(1));
        let four_replicas = (&[4u64, 1][..], &[4u32, 5, 6, 7][..], Placement::Shard(1));
        let tensors = vec![
            spec(&[64, 64], &[0, 1], two_replicas),
            spec(&[64, 64], &[2, 3], two_replicas),
            spec(&[64, 32], &[0, 1], four_replicas),
            spec(&[64, 64], &[0, 1], two_replicas),
        ];
        // Mesh [0, 1]: weights 2·8192, 4·4096, 2·8192 bytes: a third each.
        let third = (1u64 << 32) / 3;
        let p = stream_positions(&tensors);
        assert_eq!(p[0], [0, third as u32]);
        assert_eq!(p[1], [0, u32::MAX]);
        assert_eq!(p[2], [third as u32, third as u32]);
        assert_eq!(p[3], [(2 * third) as u32, third as u32]);
        let huge = vec![spec(&[1 << 40, 1 << 22], &[0], two_replicas); 3];
        let p = stream_positions(&huge);
        assert_eq!(
            p.iter().map(|q| q[0]).collect::<Vec<_>>(),
            [0, third as u32, (2 * third) as u32]
        );
    }
}
