//! [`Planner`]: tensors + config (+ what each tensor becomes on its way) → any rank's
//! [`RankProgram`] (docs/design.md §4–§5).
//!
//! It puts together the core (`core.rs`: tensors that arrive as they are), the conversions
//! (`quantize.rs`: tensors that arrive in another dtype, planned as inner tensors of a core of
//! their own) and the overlap pass (`overlap.rs`: late unpacks), which runs last on every
//! program: planning walks down from here, never back up.

use super::assign::Assignment;
use super::barrier;
use super::blocks::Block;
use super::config::Config;
use super::core::CorePlanner;
use super::fingerprint;
use super::overlap;
use super::program::RankProgram;
use super::quantize::{by_first_read, Conversions, WorkReads};
use super::rounds::Transfer;
use super::steps::StridedConvert;
use crate::error::Result;
use crate::layout::{Layout, TensorSpec};
use crate::quant::Conversion;

/// Validated inputs of a plan, ready to produce any rank's program. Immutable; every rank
/// that builds one from the same tensors and config gets the same decisions.
#[derive(Clone, Debug)]
pub struct Planner {
    /// The plan's tensors as the caller gave them (source dtypes).
    core: CorePlanner,
    /// Tensors that arrive in another dtype: their blocks are then made by an inner core over
    /// their conversion classes.
    conversions: Option<Box<Conversions>>,
    /// The core's fingerprint, with the conversions mixed in when there are any.
    fingerprint: u64,
}

impl Planner {
    /// Validates every tensor and the config. Errors name the field: `tensors[3].src: …`.
    pub fn new(tensors: Vec<TensorSpec>, config: Config) -> Result<Planner> {
        let core = CorePlanner::new(tensors, config)?;
        let fingerprint = core.fingerprint();
        Ok(Planner {
            core,
            conversions: None,
            fingerprint,
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
        let core = &planner.core;
        if let Some(c) = Conversions::new(core.tensors(), &conversions, core.config())? {
            planner.fingerprint = fingerprint::with_conversions(planner.fingerprint, &conversions);
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
    /// (`region_of`) rather than offsets in the rank's workspace: the exported form. Those
    /// before come with their round: the first of `transfers` (the rank's, as
    /// [`Planner::transfers`] gives them) that reads what they write, else the rank's last,
    /// cut and ordered as the program's are (`quantize::by_first_read`).
    pub fn conversion_steps(
        &self,
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
    ) -> (Vec<(u32, StridedConvert)>, Vec<StridedConvert>) {
        let Some(conversions) = &self.conversions else {
            return (Vec::new(), Vec::new());
        };
        let (before, after) = conversions.converts(self.core.tensors(), rank, blocks);
        let mut reads = WorkReads::default();
        let mut last = 0;
        for t in transfers {
            if blocks[t.block].from == rank {
                reads.note_copy(&t.copy, t.round as usize);
            }
            last = last.max(t.round);
        }
        let before = by_first_read(before, reads, last as usize)
            .into_iter()
            .map(|(k, c)| (k as u32, c))
            .collect();
        (before, after)
    }

    /// Rounds the data is spread over (see [`Config::rounds`]); relayed data takes one more.
    pub fn rounds(&self) -> u32 {
        match &self.conversions {
            Some(c) => c.inner().rounds(),
            None => self.core.rounds(),
        }
    }

    /// The plan's tensors, as given (source dtypes).
    pub fn tensors(&self) -> &[TensorSpec] {
        self.core.tensors()
    }

    /// The plan's config.
    pub fn config(&self) -> &Config {
        self.core.config()
    }

    /// Equal for two planners iff they were made from the same tensors, conversions and
    /// config (every rank's [`RankProgram::fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Every rank that appears in a source, destination or scale mesh, ascending.
    pub fn ranks(&self) -> Vec<u32> {
        let mut ranks = self.core.ranks();
        if let Some(c) = &self.conversions {
            ranks.extend(c.scale_ranks());
            ranks.sort_unstable();
            ranks.dedup();
        }
        ranks
    }

    /// This rank's assignments: those it receives (local copies included) and those it sends,
    /// each list in canonical order (tensor, then region corner).
    pub fn assignments(&self, rank: u32) -> Vec<Assignment> {
        match &self.conversions {
            Some(c) => c.assignments(rank),
            None => self.core.assignments(rank),
        }
    }

    /// This rank's blocks — every box of data it receives, sends or copies locally, with the
    /// copy geometry on both ends — in canonical order (tensor, region corner, block order).
    pub fn rank_blocks(&self, rank: u32) -> Result<Vec<Block>> {
        match &self.conversions {
            Some(c) => c.rank_blocks(self.core.tensors(), rank),
            None => self.core.rank_blocks(rank),
        }
    }

    /// The program `rank` runs. A rank outside every mesh gets an empty program. Unpacks
    /// nothing later reads are marked late, with staging of their own, so executors may run
    /// them beside the next round (`overlap.rs`; [`Planner::rank_program_sequential`] leaves
    /// every unpack before the next round and needs less staging).
    pub fn rank_program(&self, rank: u32) -> Result<RankProgram> {
        self.rank_program_within(rank, u64::MAX)
    }

    /// [`Planner::rank_program`] with at most `staging` bytes of staging for the late unpacks'
    /// arenas and the rest: where every late unpack's receive would take the rank past it,
    /// only some rounds' largest receives move (the other unpacks run before the next round);
    /// where none fits, the program of [`Planner::rank_program_sequential`].
    pub fn rank_program_within(&self, rank: u32, staging: u64) -> Result<RankProgram> {
        let mut program = self.rank_program_sequential(rank)?;
        overlap::overlap_unpacks(&mut program, staging);
        Ok(program)
    }

    /// [`Planner::rank_program`] without late unpacks: the same messages, each round's
    /// unpacks done before the next round starts, one staging arena reused by every round.
    pub fn rank_program_sequential(&self, rank: u32) -> Result<RankProgram> {
        match &self.conversions {
            Some(_) => {
                let blocks = self.rank_blocks(rank)?;
                self.program_sequential(rank, &blocks, &self.transfers(&blocks))
            }
            None => {
                let mut program = self.core.rank_program(rank)?;
                self.add_barrier(&mut program);
                Ok(program)
            }
        }
    }

    /// The ranks that pass the senders' barrier with `rank` before each round (itself
    /// included, ascending; docs/executor.md, "The senders' barrier"), or none: the ranks of
    /// its node that are in a source mesh and in no destination or scale mesh, where
    /// [`Config::sender_barrier`] asks for it.
    pub fn barrier_members(&self, rank: u32) -> Vec<u32> {
        let config = self.config();
        // Looked at only for the rank and its node mates, where the barrier can apply.
        let sends_only = |r: u32| {
            let [sends, receives] = self.core.sides_of(r);
            sends && !receives && !self.conversions.as_ref().is_some_and(|c| c.holds_scales(r))
        };
        barrier::members(
            rank,
            config.sender_barrier,
            self.rounds(),
            &config.topology,
            || self.core.ranks(),
            sends_only,
        )
    }

    /// Adds the senders' barrier of its rank to `program` (the last step of a program's
    /// forming: later passes change only receivers, which never pass it).
    fn add_barrier(&self, program: &mut RankProgram) {
        let members = self.barrier_members(program.rank);
        barrier::add(program, &members, self.rounds());
    }

    /// Forms `rank`'s program from its blocks (as [`Planner::rank_blocks`] returns them).
    pub fn program_from_blocks(&self, rank: u32, blocks: &[Block]) -> Result<RankProgram> {
        self.program_from_transfers(rank, blocks, &self.transfers(blocks))
    }

    /// Cuts a rank's blocks (as [`Planner::rank_blocks`] returns them) into the [`Transfer`]s
    /// each round moves: local copies whole in round 0; each (sender, receiver) pair's blocks
    /// spread over the rounds by one function of the pair that both ends run, so a transfer
    /// has the same round, offset and copy on both ends. The one source of rounds for the
    /// rank's program ([`Planner::program_from_transfers`]) and for the exported transfer list
    /// (`ncclReshardPlanGetTransfers`). Local copies come first, in block order, then each
    /// pair's transfers (pairs ascending) by round, in the order its messages are formed from.
    pub fn transfers(&self, blocks: &[Block]) -> Vec<Transfer> {
        match &self.conversions {
            Some(c) => c.inner().transfers(blocks),
            None => self.core.transfers(blocks),
        }
    }

    /// Forms `rank`'s program from its blocks and their transfers (as [`Planner::transfers`]
    /// returns them for those blocks), late unpacks marked as [`Planner::rank_program`] marks
    /// them.
    pub fn program_from_transfers(
        &self,
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
    ) -> Result<RankProgram> {
        let mut program = self.program_sequential(rank, blocks, transfers)?;
        overlap::overlap_unpacks(&mut program, u64::MAX);
        Ok(program)
    }

    /// [`Planner::program_from_transfers`] without late unpacks.
    fn program_sequential(
        &self,
        rank: u32,
        blocks: &[Block],
        transfers: &[Transfer],
    ) -> Result<RankProgram> {
        let mut program = match &self.conversions {
            Some(c) => c.program(
                self.core.tensors(),
                rank,
                blocks,
                transfers,
                self.fingerprint,
            ),
            None => self.core.program_from_transfers(rank, blocks, transfers),
        }?;
        self.add_barrier(&mut program);
        Ok(program)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Mesh, Placement};
    use crate::plan::{Buffer, ExecMode, Mode, Topology, GROUPABLE_MAX_MESSAGES_PER_RANK};

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

    /// A rank works out only its own side of each unit (a receiver its own legs from the
    /// segments' counts, a sender its slot's, a forwarder its group's and the hub's): every
    /// assignment either end lists, the other end lists too. Relays, forwarding between
    /// receiving nodes, on-node deals (colocated ranks), legs dealt over several replicas and
    /// legs split over many.
    #[test]
    fn both_ends_of_every_assignment_deal_it_alike() {
        let specs = [
            // One sender, a replica per node: forwarded between receiving nodes.
            TensorSpec {
                shape: vec![256, 64],
                dtype: DType::Bfloat16,
                src: layout(&[1], &[0], &[Placement::Replicate]),
                dst: layout(&[4], &[4, 8, 12, 16], &[Placement::Replicate]),
            },
            // Three nodes of two TP2 replicas: hub, entries and node mates.
            TensorSpec {
                shape: vec![128, 96],
                dtype: DType::Bfloat16,
                src: layout(&[2], &[0, 1], &[Placement::Shard(1)]),
                dst: layout(
                    &[6, 2],
                    &(4..16).collect::<Vec<u32>>(),
                    &[Placement::Replicate, Placement::Shard(0)],
                ),
            },
            // Colocated: sources and destinations share nodes (on-node deals and locals).
            TensorSpec {
                shape: vec![64, 48],
                dtype: DType::Float32,
                src: layout(
                    &[2, 2],
                    &[0, 1, 2, 3],
                    &[Placement::Shard(0), Placement::Replicate],
                ),
                dst: layout(&[4], &[0, 1, 4, 5], &[Placement::Shard(1)]),
            },
            // Two replicas, a replica per node: legs dealt over both, relayed or forwarded.
            TensorSpec {
                shape: vec![512, 64],
                dtype: DType::Bfloat16,
                src: layout(&[2], &[0, 1], &[Placement::Replicate]),
                dst: layout(&[4], &[4, 8, 12, 16], &[Placement::Replicate]),
            },
            // Two replicas, two per node on three nodes: relay groups of two.
            TensorSpec {
                shape: vec![512, 64],
                dtype: DType::Bfloat16,
                src: layout(&[2], &[0, 1], &[Placement::Replicate]),
                dst: layout(&[6], &[4, 5, 8, 9, 12, 13], &[Placement::Replicate]),
            },
            // One sender, a replica on each of 48 nodes: over 24 rounds, forwards spread over
            // two rounds (`assign::hub_spread`).
            TensorSpec {
                shape: vec![256, 64],
                dtype: DType::Bfloat16,
                src: layout(&[1], &[0], &[Placement::Replicate]),
                dst: layout(
                    &[48],
                    &(1..=48).map(|n| 4 * n).collect::<Vec<u32>>(),
                    &[Placement::Replicate],
                ),
            },
            // Many replicas, few receivers: legs split so every replica sends a part.
            TensorSpec {
                shape: vec![96, 32],
                dtype: DType::Bfloat16,
                src: layout(&[8], &(0..8).collect::<Vec<u32>>(), &[Placement::Replicate]),
                dst: layout(&[2], &[8, 12], &[Placement::Shard(0)]),
            },
        ];
        let node = |r: u32| r / 4;
        let mut forwarded = 0;
        for (mode, relay) in [
            (Mode::Staged, true),
            (Mode::Auto, true),
            (Mode::Auto, false),
        ] {
            for spec in &specs {
                for rounds in [2, 3, 5, 24] {
                    // Each layout pair alone (its loads decide forwarding), as several
                    // tensors: rotations differ between them.
                    let planner = Planner::new(
                        vec![spec.clone(), spec.clone(), spec.clone()],
                        Config {
                            mode,
                            topology: Topology::RanksPerNode(4),
                            split_min_bytes: 64,
                            rounds,
                            relay,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                    let lists: std::collections::BTreeMap<u32, Vec<Assignment>> = planner
                        .ranks()
                        .into_iter()
                        .map(|r| (r, planner.assignments(r)))
                        .collect();
                    for (rank, list) in &lists {
                        for a in list {
                            assert!(a.from == *rank || a.to == *rank, "rank {rank} lists {a:?}");
                            assert!(relay || !a.relay, "{a:?} relayed with relays off");
                            if a.from == a.to {
                                continue;
                            }
                            // A receiver forwarding to another node: between receiving nodes.
                            forwarded += usize::from(a.relay && node(a.from) != node(a.to));
                            for end in [a.from, a.to] {
                                assert!(
                                    lists[&end].contains(a),
                                    "{mode:?}, {rounds} rounds: rank {rank} lists {a:?}, rank {end} does not"
                                );
                            }
                        }
                    }
                }
            }
        }
        assert!(forwarded > 0, "nothing forwarded between receiving nodes");
    }
}
