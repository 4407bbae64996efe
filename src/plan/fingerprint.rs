//! The plan fingerprint, and the small deterministic hash the planner rotates choices with.
//!
//! Both are FNV-1a over a canonical encoding of plain numbers, so every rank, whatever its
//! platform or build, computes the same values from the same descriptors.

use super::config::{Config, Mode, Topology};
use super::fxhash::FxHashMap;
use crate::layout::{Layout, Placement, TensorSpec};

/// FNV-1a over a canonical encoding of the inputs: equal on all ranks iff they passed the same
/// descriptors and config (the rank itself is not part of it).
pub fn fingerprint(tensors: &[TensorSpec], config: &Config) -> u64 {
    let mut ids: FxHashMap<&Layout, u32> = FxHashMap::default();
    let mut layouts: Vec<&Layout> = Vec::new();
    let layout_ids: Vec<[u32; 2]> = tensors
        .iter()
        .map(|t| {
            [&t.src, &t.dst].map(|layout| {
                let next = layouts.len() as u32;
                *ids.entry(layout).or_insert_with(|| {
                    layouts.push(layout);
                    next
                })
            })
        })
        .collect();
    of_interned(tensors, &layout_ids, &layouts, config)
}

/// [`fingerprint`] of tensors whose layouts are interned: `layout_ids` per tensor (source,
/// destination) index `layouts`. A model repeats a few layouts over thousands of tensors:
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
    h.u64(tensors.len() as u64);
    for (t, ids) in tensors.iter().zip(layout_ids) {
        h.list(&t.shape);
        h.u64(t.dtype.nccl_code() as u64);
        for &id in ids {
            h.u64(digests[id as usize]);
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
