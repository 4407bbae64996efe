//! The plan fingerprint, and the small deterministic hash the planner rotates choices with.
//!
//! Both are FNV-1a over a canonical encoding of plain numbers, so every rank, whatever its
//! platform or build, computes the same values from the same descriptors.

use super::config::{Config, Mode, Topology};
use super::fxhash::FxHashMap;
use crate::layout::{Layout, Placement, TensorSpec};
use crate::quant::{Conversion, ScaleFormat, Scheme};

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
