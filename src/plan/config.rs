//! Planner configuration: modes, topology, limits and their defaults.

use crate::error::{Error, Result};

/// How messages are formed (docs/design.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Every message is sent from the source view and lands in the destination view as it is
    /// (no pack, no unpack, no staging, one round): callable inside a user's
    /// `ncclGroupStart/End`, any number of times per group. Needs one message per run that is
    /// contiguous on both ends, so regions that interleave on either end cost many messages.
    Groupable,
    /// One message per peer pair covering every tensor, packed and unpacked around it; must
    /// run outside a user group (a call inside one is refused).
    Staged,
    /// The default. Per peer pair and round: staged when sending runs as they are would need
    /// many messages (`AUTO_STAGE_MIN_MESSAGES` or more, averaging under
    /// `AUTO_STAGE_MAX_AVG_BYTES` or more than `AUTO_STAGE_MAX_MESSAGES` of them), else one
    /// message per destination-contiguous run (packed by the sender where its side is
    /// strided); in a plan of several rounds, whenever it would need more than one. Must run
    /// outside a user group (a call inside one is refused).
    Auto,
}

/// In `Auto` mode a pair is staged when its groupable form has at least this many messages…
pub const AUTO_STAGE_MIN_MESSAGES: u64 = 4;
/// …and they average fewer bytes than this…
pub const AUTO_STAGE_MAX_AVG_BYTES: u64 = 1 << 20;
/// …or there are more of them than this.
pub const AUTO_STAGE_MAX_MESSAGES: u64 = 256;
/// In an `Auto` plan of several rounds, a piece contiguous at its destination lands there as a
/// message of its own (no unpack; the sender packs it where its side is strided) when it has
/// at least [`AUTO_STAGE_MAX_AVG_BYTES`] and at least this fraction of the plan's smallest
/// pair part (see [`AUTO_MESSAGES_PER_RANK`]); smaller ones join the pair's staged message of
/// that round. Pieces far smaller than a part would each cost a message of their own where the
/// budget allows about one per part: a model that keeps thousands of 1.8 MB per-expert tensors
/// (Kimi-K2, parts of about 38 MB) would post one message per tensor and peer, 61,725 on one
/// inference rank.
pub const AUTO_DIRECT_PART_FRACTION: u64 = 8;
/// Groupable mode refuses a pair whose regions split into more runs than this before adjacent
/// runs are merged (planning them would take too much memory); auto and staged modes coalesce
/// such pairs.
pub const GROUPABLE_MAX_PIECES_PER_PAIR: u64 = 1 << 20;
/// Groupable mode refuses a rank that would post more messages (sends and receives) than this
/// in one NCCL group. NCCL posts each operation from the host one by one (about a microsecond
/// each) and runs a group's small operations a few per channel at a time, so past this many a
/// group costs tens of milliseconds of host time and far more than the bytes on the GPU. Auto
/// and staged modes coalesce such plans into few messages.
pub const GROUPABLE_MAX_MESSAGES_PER_RANK: u64 = 16384;

/// What auto mode aims one round's staging at, the arenas of late unpacks included
/// (docs/executor.md, "Overlapping unpacks"): 4 GiB.
pub const ROUND_TARGET_BYTES: u64 = 4 << 30;
/// Automatic rounds ([`Config::rounds`] = 0) aim at about this many bytes per rank and round:
/// two thirds of [`ROUND_TARGET_BYTES`], so that the arenas where a round's unpacks wait
/// beside the next round's transfers find room in the last third and take those unpacks off
/// the critical path (0.18; before, a round aimed at all of it and about half of what it
/// unpacked waited between rounds: DeepSeek-V3 `pp16,ep16 → tp32,dp8` on `dgx-h100`, 12 ms;
/// docs/planner.md, "Round size")…
pub const ROUND_DATA_BYTES: u64 = ROUND_TARGET_BYTES / 3 * 2;
/// …with at most this many rounds (a config may ask for up to [`MAX_ROUNDS`]).
pub const AUTO_MAX_ROUNDS: u32 = 32;
/// Staged and auto plans of several rounds keep a rank's messages under about this many. A
/// pair's data is cut across rounds into parts, each one staged message (or part of one):
/// without a bound a rank with 512 peers and 31 rounds would post 512 × 31. Parts are
/// therefore at least the busiest rank's bytes over (this − the plan's other ranks, which
/// bounds any rank's peers), and at least [`Config::split_min_bytes`]: a rank then has at
/// most one message per peer plus one per part. Pieces sent as they are
/// (`AUTO_DIRECT_PART_FRACTION`) and relays come on top.
pub const AUTO_MESSAGES_PER_RANK: u64 = 4096;
/// The most rounds a config may ask for.
pub const MAX_ROUNDS: u32 = 1024;
/// Default for [`Config::split_min_bytes`].
pub const DEFAULT_SPLIT_MIN_BYTES: u64 = 1 << 20;

impl Mode {
    /// The mode named `text` (`groupable`, `staged` or `auto`, as case files spell it).
    pub fn parse(text: &str) -> Result<Mode> {
        match text {
            "groupable" => Ok(Mode::Groupable),
            "staged" => Ok(Mode::Staged),
            "auto" => Ok(Mode::Auto),
            other => Err(Error::invalid_argument(format!(
                "mode {other:?} is not one of \"groupable\", \"staged\", \"auto\""
            ))),
        }
    }

    /// The mode's name, as [`Mode::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Groupable => "groupable",
            Mode::Staged => "staged",
            Mode::Auto => "auto",
        }
    }
}

/// Where ranks sit, for preferring same-node (NVLink) senders. Unknown means uniform.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Topology {
    /// No rank is preferred for being near another.
    #[default]
    Unknown,
    /// Rank `r` is on node `r / ranks_per_node`.
    RanksPerNode(u32),
    /// Rank `r` is on node `table[r]`.
    NodeTable(Vec<u32>),
    /// The survivors' ranks after the ranks `failed` (ascending, distinct) of `before` are gone,
    /// renumbered as `ncclCommShrink` renumbers (a survivor's rank less the failed ranks below
    /// it): rank `r` is where its rank before was (`plan::survivors` makes it). Its size is
    /// the failed list's, whatever the ranks' numbers.
    Survivors {
        /// The topology in the numbering before the failure.
        before: Box<Topology>,
        /// The failed ranks, in that numbering.
        failed: Vec<u32>,
    },
}

impl Topology {
    /// The node of `rank`, when the topology says.
    pub fn node(&self, rank: u32) -> Option<u32> {
        match self {
            Topology::Unknown => None,
            Topology::RanksPerNode(n) => Some(rank / n),
            Topology::NodeTable(table) => table.get(rank as usize).copied(),
            Topology::Survivors { before, failed } => before.node(rank_before(failed, rank)?),
        }
    }
}

/// The rank before the failure of survivor `rank` (`failed` ascending and distinct): `rank`
/// plus the failed ranks at or below where it lands. The k-th failed rank has
/// `failed[k] - k` survivors below it, which grows with k, so they are counted by bisection.
fn rank_before(failed: &[u32], rank: u32) -> Option<u32> {
    let (mut below, mut above) = (0, failed.len());
    while below < above {
        let k = (below + above) / 2;
        if u64::from(failed[k]) <= u64::from(rank) + k as u64 {
            below = k + 1;
        } else {
            above = k;
        }
    }
    rank.checked_add(u32::try_from(below).ok()?)
}

/// Everything besides the tensors that shapes a plan. Every rank must pass the same config.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// How messages are formed, and whether the plan may run inside a caller's NCCL group.
    pub mode: Mode,
    /// Where ranks sit: which senders are on a receiver's node.
    pub topology: Topology,
    /// A replicated overlap is split across several senders, and a pair's data or a relayed
    /// overlap across rounds, only into parts of at least this many bytes.
    pub split_min_bytes: u64,
    /// Route data a rank holds on both sides through a message to itself instead of a local
    /// copy. Slower; it exists so one GPU can exercise the whole NCCL path (GPU tests).
    pub local_via_messages: bool,
    /// Staged and auto modes: how many rounds the data is cut into (staging is reused by every
    /// round, relays forward in the next round, and where senders bind a priming round comes
    /// first, docs/planner.md "The priming round"); 0 picks from the tensors' sizes, aiming at
    /// `ROUND_DATA_BYTES` (about 2.7 GiB) per rank and round. Groupable mode always has one round.
    pub rounds: u32,
    /// Staged and auto modes with a known topology: when several replicas of a destination
    /// shard sit on one node and their data comes from other nodes, send each part across
    /// the network once and forward it over NVLink (relay) instead of once per replica.
    pub relay: bool,
    /// Staged and auto plans of several rounds with a known topology: the ranks of a node
    /// that only send (in a source mesh, in no destination mesh) enter each round together,
    /// after a barrier of 8-byte messages among them (docs/executor.md, "The senders'
    /// barrier"). `None` (the default): where such a node holds more of them than
    /// [`AUTO_BARRIER_MIN_SENDERS`] − 1, a domain of more GPUs than one NVLink server's.
    pub sender_barrier: Option<bool>,
}

/// With [`Config::sender_barrier`] unset, a node's sending-only ranks pass a barrier before
/// each round when they are at least this many: more than the 8 GPUs of one NVLink server
/// (DGX/HGX), so a multi-node NVLink domain (GB200 NVL72's 72), whose GPUs share the NICs
/// NCCL's PXN routes their network traffic through.
pub const AUTO_BARRIER_MIN_SENDERS: usize = 9;

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Auto,
            topology: Topology::Unknown,
            split_min_bytes: DEFAULT_SPLIT_MIN_BYTES,
            local_via_messages: false,
            rounds: 0,
            relay: true,
            sender_barrier: None,
        }
    }
}

impl Config {
    /// `Err` (`InvalidArgument`, naming the field) for a config no plan can use.
    pub fn validate(&self) -> Result<()> {
        if self.topology == Topology::RanksPerNode(0) {
            return Err(Error::invalid_argument(
                "config.ranks_per_node must be at least 1",
            ));
        }
        if self.rounds > MAX_ROUNDS {
            return Err(Error::invalid_argument(format!(
                "config.rounds is {}; use 0 (automatic) to {MAX_ROUNDS}",
                self.rounds
            )));
        }
        if self.split_min_bytes == 0 {
            return Err(Error::invalid_argument(
                "config.split_min_bytes must be at least 1",
            ));
        }
        Ok(())
    }
}
