//! Planner configuration and the plan fingerprint.

use super::fxhash::FxHashMap;
use crate::error::{Error, Result};
use crate::layout::{Layout, Placement, TensorSpec};

/// How messages are formed (DESIGN §3).
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
    /// many messages ([`AUTO_STAGE_MIN_MESSAGES`] or more, averaging under
    /// [`AUTO_STAGE_MAX_AVG_BYTES`] or more than [`AUTO_STAGE_MAX_MESSAGES`] of them), else one
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

/// Automatic rounds ([`Config::rounds`] = 0) aim at about this many bytes per rank and round…
pub const ROUND_TARGET_BYTES: u64 = 4 << 30;
/// …with at most this many rounds (a config may ask for up to [`MAX_ROUNDS`]).
pub const AUTO_MAX_ROUNDS: u32 = 32;
/// The most rounds a config may ask for.
pub const MAX_ROUNDS: u32 = 1024;
/// Default for [`Config::split_min_bytes`].
pub const DEFAULT_SPLIT_MIN_BYTES: u64 = 1 << 20;

impl Mode {
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
    #[default]
    Unknown,
    /// Rank `r` is on node `r / ranks_per_node`.
    RanksPerNode(u32),
    /// Rank `r` is on node `table[r]`.
    NodeTable(Vec<u32>),
}

impl Topology {
    pub fn node(&self, rank: u32) -> Option<u32> {
        match self {
            Topology::Unknown => None,
            Topology::RanksPerNode(n) => Some(rank / n),
            Topology::NodeTable(table) => table.get(rank as usize).copied(),
        }
    }
}

/// Everything besides the tensors that shapes a plan. Every rank must pass the same config.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    pub mode: Mode,
    pub topology: Topology,
    /// A replicated overlap is split across several senders, and a pair's data or a relayed
    /// overlap across rounds, only into parts of at least this many bytes.
    pub split_min_bytes: u64,
    /// Route data a rank holds on both sides through a message to itself instead of a local
    /// copy. Slower; it exists so one GPU can exercise the whole NCCL path (GPU tests).
    pub local_via_messages: bool,
    /// Staged and auto modes: how many rounds the data is cut into (staging is reused by every
    /// round, relays forward in the next round); 0 picks from the tensors' sizes, aiming at
    /// [`ROUND_TARGET_BYTES`] per rank and round. Groupable mode always has one round.
    pub rounds: u32,
    /// Staged and auto modes with a known topology: when several replicas of a destination
    /// shard sit on one node and their data comes from other nodes, send each part across
    /// the network once and forward it over NVLink (relay) instead of once per replica.
    pub relay: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Auto,
            topology: Topology::Unknown,
            split_min_bytes: DEFAULT_SPLIT_MIN_BYTES,
            local_via_messages: false,
            rounds: 0,
            relay: true,
        }
    }
}

impl Config {
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

/// FNV-1a over a canonical encoding of the inputs: equal on all ranks iff they passed the same
/// descriptors and config (the rank itself is not part of it).
pub fn fingerprint(tensors: &[TensorSpec], config: &Config) -> u64 {
    let mut h = Fnv::default();
    h.u64(tensors.len() as u64);
    // A model repeats a few layouts over thousands of tensors: digest each distinct one once.
    let mut digests: FxHashMap<&Layout, u64> = FxHashMap::default();
    for t in tensors {
        h.list(&t.shape);
        h.u64(t.dtype.nccl_code() as u64);
        for layout in [&t.src, &t.dst] {
            let digest = *digests.entry(layout).or_insert_with(|| {
                let mut d = Fnv::default();
                layout_hash(&mut d, layout);
                d.0
            });
            h.u64(digest);
        }
    }
    h.u64(match config.mode {
        Mode::Groupable => 0,
        Mode::Staged => 1,
        Mode::Auto => 2,
    });
    match &config.topology {
        Topology::Unknown => h.u64(0),
        Topology::RanksPerNode(n) => {
            h.u64(1);
            h.u64(u64::from(*n));
        }
        Topology::NodeTable(table) => {
            h.u64(2);
            h.list(&table.iter().map(|&n| u64::from(n)).collect::<Vec<_>>());
        }
    }
    h.u64(config.split_min_bytes);
    h.u64(u64::from(config.local_via_messages));
    h.u64(u64::from(config.rounds));
    h.u64(u64::from(config.relay));
    h.0
}

fn layout_hash(h: &mut Fnv, layout: &Layout) {
    h.list(layout.mesh.shape());
    h.list(
        &layout
            .mesh
            .ranks()
            .iter()
            .map(|&r| u64::from(r))
            .collect::<Vec<_>>(),
    );
    h.u64(layout.placements.len() as u64);
    for p in &layout.placements {
        match *p {
            Placement::Replicate => h.u64(0),
            Placement::Shard(d) => {
                h.u64(1);
                h.u64(d as u64);
            }
            Placement::StridedShard { dim, split_factor } => {
                h.u64(2);
                h.u64(dim as u64);
                h.u64(split_factor);
            }
        }
    }
    match &layout.strides {
        None => h.u64(0),
        Some(s) => {
            h.u64(1);
            h.list(s);
        }
    }
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn u64(&mut self, v: u64) {
        for byte in v.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn list(&mut self, values: &[u64]) {
        self.u64(values.len() as u64);
        for &v in values {
            self.u64(v);
        }
    }
}

/// A small deterministic mix used to rotate sender choices between units.
pub(crate) fn mix(values: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = Fnv::default();
    for v in values {
        h.u64(v);
    }
    h.0
}
