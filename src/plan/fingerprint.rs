//! The plan fingerprint, and the small deterministic hash the planner rotates choices with.
//!
//! Both are FNV-1a over a canonical encoding of plain numbers, so every rank, whatever its
//! platform or build, computes the same values from the same descriptors. The fingerprint
//! takes a 64-bit word per step (a model's 70,000 tensors are hashed on every rank's plan);
//! the rotation hash a byte per step, which the planner's choices depend on.

use super::config::{Config, Mode, Topology};
use crate::layout::{Layout, Placement, TensorSpec};
use crate::quant::{Conversion, ScaleFormat, Scheme};

/// Which planner made a plan: raised whenever the same descriptors and config would be planned
/// into other programs (0.6: forwards spread over rounds; 0.7: overlaps forwarded between
/// single-receiver nodes cut into about one chunk per round; 0.8: receivers' network load
/// counts a node's replicas once, relayed overlaps cut into a chunk per member and round; 0.10:
/// a relay forward to a node mate that its sender packs travels as a message of its own; 0.11:
/// a pair's chunks take consecutive rounds; 0.12: a pair's stream goes out in round order;
/// 0.14: chunks of sender-converted tensors forwarded between nodes take their rounds from
/// where they sit in their senders' streams, and scales move in the last round of data;
/// 0.15: in auto plans of several rounds, large pieces contiguous at the destination land
/// there as messages of their own, whatever their source side; 0.16: which chunks are
/// forwarded between nodes, their hubs and rounds follow offsets spread evenly over the units
/// instead of a hash; 0.17: the senders' barrier, by default where a node holds more than 8
/// sending-only ranks; 0.18: automatic rounds aim at two thirds of the staging target; 0.19:
/// windows of rounds not rounded to whole rounds, relay chunks from evenly spread starts with
/// rails turning with the node, and a priming round where senders bind),
/// so that ranks running planners that disagree never agree on a fingerprint (the exchange at
/// the first call refuses the mix instead of posting messages the peer does not expect).
/// Before 0.6 it was not hashed.
const PLANNER_REVISION: u64 = 17;

/// FNV-1a (a word per step) over a canonical encoding of the inputs: equal on all ranks iff
/// they passed the same descriptors and config (the rank itself is not part of it). Tensors'
/// layouts are interned: `layout_ids` per tensor (source, destination) index `layouts`. A model repeats a few layouts over thousands of tensors:
/// each distinct one is digested once.
pub(crate) fn of_interned(
    tensors: &[TensorSpec],
    layout_ids: &[[u32; 2]],
    layouts: &[&Layout],
    config: &Config,
) -> u64 {
    let digests: Vec<u64> = layouts
        .iter()
        .map(|layout| {
            let mut d = Fnv::default();
            layout_hash(&mut d, layout);
            d.0
        })
        .collect();
    let mut h = Fnv::default();
    h.word(PLANNER_REVISION);
    h.word(tensors.len() as u64);
    for (t, ids) in tensors.iter().zip(layout_ids) {
        h.words(&t.shape);
        h.word(t.dtype.nccl_code() as u64);
        for &id in ids {
            h.word(digests[id as usize]);
        }
    }
    h.word(match config.mode {
        Mode::Groupable => 0,
        Mode::Staged => 1,
        Mode::Auto => 2,
    });
    topology(&mut h, &config.topology);
    h.word(config.split_min_bytes);
    h.word(u64::from(config.local_via_messages));
    h.word(u64::from(config.rounds));
    h.word(u64::from(config.relay));
    // Unset, nothing: plans from before the field keep their fingerprints.
    if let Some(on) = config.sender_barrier {
        h.word(2 + u64::from(on));
    }
    h.0
}

/// The fingerprint of a plan whose tensors convert on the way: `base` (the plain
/// fingerprint of its tensors and config) mixed with every tensor's conversion.
pub(crate) fn with_conversions(base: u64, conversions: &[Option<Conversion>]) -> u64 {
    let mut h = Fnv(base);
    for conversion in conversions {
        let Some(c) = conversion else {
            h.u64(0);
            continue;
        };
        h.u64(1);
        h.u64(c.dtype.nccl_code() as u64);
        match c.scheme {
            Scheme::None => h.u64(0),
            Scheme::PerTensor => h.u64(1),
            Scheme::PerChannel => h.u64(2),
            Scheme::Block { rows, cols } => {
                h.u64(3);
                h.u64(rows);
                h.u64(cols);
            }
        }
        h.u64(match c.scale_format {
            ScaleFormat::Float32 => 0,
            ScaleFormat::E8m0 => 1,
        });
        h.u64(u64::from(c.scale_inverse));
        match &c.scale_layout {
            None => h.u64(0),
            Some(layout) => {
                h.u64(1);
                layout_hash(&mut h, layout);
            }
        }
    }
    h.0
}

fn topology(h: &mut Fnv, topology: &Topology) {
    match topology {
        Topology::Unknown => h.word(0),
        Topology::RanksPerNode(n) => {
            h.word(1);
            h.word(u64::from(*n));
        }
        Topology::NodeTable(table) => {
            h.word(2);
            h.word(table.len() as u64);
            for &n in table.iter() {
                h.word(u64::from(n));
            }
        }
        Topology::Survivors { before, failed } => {
            h.word(3);
            self::topology(h, before);
            h.word(failed.len() as u64);
            for &r in failed {
                h.word(u64::from(r));
            }
        }
    }
}

fn layout_hash(h: &mut Fnv, layout: &Layout) {
    h.words(layout.mesh.shape());
    let ranks = layout.mesh.ranks();
    h.word(ranks.len() as u64);
    for &r in ranks {
        h.word(u64::from(r));
    }
    h.word(layout.placements.len() as u64);
    for p in &layout.placements {
        match *p {
            Placement::Replicate => h.word(0),
            Placement::Shard(d) => {
                h.word(1);
                h.word(d as u64);
            }
            Placement::StridedShard { dim, split_factor } => {
                h.word(2);
                h.word(dim as u64);
                h.word(split_factor);
            }
            Placement::ShardBlocks { dim, block } => {
                h.word(3);
                h.word(dim as u64);
                h.word(block);
            }
        }
    }
    match &layout.strides {
        None => h.word(0),
        Some(s) => {
            h.word(1);
            h.words(s);
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

    /// One FNV-1a step over a whole word: each step is a bijection of the state for a given
    /// word, so inputs differing in one word always differ in the result.
    fn word(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x0000_0100_0000_01b3);
    }

    fn words(&mut self, values: &[u64]) {
        self.word(values.len() as u64);
        for &v in values {
            self.word(v);
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
