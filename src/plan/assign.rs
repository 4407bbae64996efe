//! Which rank sends what to whom: overlaps between source and destination shards (units) and
//! the deterministic choice of sender among a source shard's replicas (DESIGN §5).
//!
//! A *unit* is the overlap between one source shard and one destination shard. Every rank that
//! sees a unit — a sender enumerating destination shards or a receiver enumerating source
//! shards — computes the same assignment from the unit alone, so no communication is needed.

use super::config::{mix, Config};
use crate::layout::{IndexRuns, TensorSpec};

/// One piece of data moving from `from` to `to` (`from == to` is a local copy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub tensor: u32,
    pub from: u32,
    pub to: u32,
    /// Global indices per dim; the data is their Cartesian product.
    pub region: Vec<IndexRuns>,
}

impl Transfer {
    /// The region's smallest multi-index: a total order key for disjoint regions of one
    /// receiver (two disjoint boxes cannot share their smallest corner).
    pub fn corner(&self) -> Vec<u64> {
        self.region.iter().map(|r| r.first().unwrap_or(0)).collect()
    }

    pub fn elements(&self) -> u64 {
        self.region.iter().map(IndexRuns::len).product()
    }
}

/// The overlap of one source shard and one destination shard, identified by their
/// coordinates on the sharding mesh axes (per tensor dim).
pub(crate) struct Unit<'a> {
    pub tensor: u32,
    pub spec: &'a TensorSpec,
    pub src_coords: Vec<&'a [u64]>,
    pub dst_coords: Vec<&'a [u64]>,
    pub region: Vec<IndexRuns>,
}

/// Every transfer of a unit, for all its receivers.
///
/// - A receiver that holds a replica of the source shard copies locally.
/// - Other receivers are grouped by candidate senders: the replicas on the receiver's node
///   when the topology is known and there are any, otherwise all replicas.
/// - A group with at least as many receivers as candidates takes whole regions round-robin;
///   a smaller group splits the region (along its outermost dim with more than one index)
///   so that every candidate sends a part, down to `split_min_bytes` per part.
/// - The starting candidate rotates with a hash of the unit, spreading load across units.
///
/// Only the transfers `keep(from, to)` accepts are materialised (a rank needs its own), so a
/// unit with many replicas costs no copies of regions nobody asked for.
pub(crate) fn assign(
    unit: &Unit<'_>,
    config: &Config,
    keep: impl Fn(u32, u32) -> bool,
    mut sink: impl FnMut(Transfer),
) {
    let senders = unit.spec.src.replicas(&unit.src_coords);
    let receivers = unit.spec.dst.replicas(&unit.dst_coords);
    let mut sorted_senders = senders.clone();
    sorted_senders.sort_unstable();
    let rotation = mix(std::iter::once(u64::from(unit.tensor))
        .chain(unit.src_coords.iter().flat_map(|c| c.iter().copied()))
        .chain([u64::MAX])
        .chain(unit.dst_coords.iter().flat_map(|c| c.iter().copied())));

    let mut out = |from: u32, to: u32, region: &[IndexRuns]| {
        if keep(from, to) {
            sink(Transfer {
                tensor: unit.tensor,
                from,
                to,
                region: region.to_vec(),
            });
        }
    };
    // Replicas by node, sorted by (node, rank), when the topology is known.
    let mut by_node: Vec<(u32, u32)> = senders
        .iter()
        .filter_map(|&s| config.topology.node(s).map(|n| (n, s)))
        .collect();
    by_node.sort_unstable();
    let on_node = |n: u32| -> &[(u32, u32)] {
        let lo = by_node.partition_point(|&(m, _)| m < n);
        let hi = by_node.partition_point(|&(m, _)| m <= n);
        &by_node[lo..hi]
    };
    // Receiver groups in order of first appearance: (node with replicas, or None for any).
    let mut groups: Vec<(Option<u32>, Vec<u32>)> = Vec::new();
    for &r in &receivers {
        if sorted_senders.binary_search(&r).is_ok() {
            out(r, r, &unit.region);
            continue;
        }
        let node = config.topology.node(r).filter(|&n| !on_node(n).is_empty());
        match groups.iter_mut().find(|(key, _)| *key == node) {
            Some((_, members)) => members.push(r),
            None => groups.push((node, vec![r])),
        }
    }

    let elem_size = u64::from(unit.spec.elem_size());
    let region_bytes = unit.region.iter().map(IndexRuns::len).product::<u64>() * elem_size;
    for (node, members) in groups {
        let candidates: Vec<u32> = match node {
            Some(n) => on_node(n).iter().map(|&(_, s)| s).collect(),
            None => senders.clone(),
        };
        let k = candidates.len() as u64;
        let g = members.len() as u64;
        let start = rotation % k;
        if g >= k {
            for (i, &r) in members.iter().enumerate() {
                out(
                    candidates[((i as u64 + start) % k) as usize],
                    r,
                    &unit.region,
                );
            }
            continue;
        }
        let parts_wanted = (k / g).min((region_bytes / config.split_min_bytes).max(1));
        let parts = split_region(&unit.region, parts_wanted);
        let p = parts.len() as u64;
        for (i, &r) in members.iter().enumerate() {
            for (q, part) in parts.iter().enumerate() {
                out(
                    candidates[((i as u64 * p + q as u64 + start) % k) as usize],
                    r,
                    part,
                );
            }
        }
    }
}

/// Splits a region into at most `parts` non-empty parts along its outermost dim that has more
/// than one index (row-major outer splits keep parts contiguous).
fn split_region(region: &[IndexRuns], parts: u64) -> Vec<Vec<IndexRuns>> {
    let Some(dim) = region
        .iter()
        .position(|r| r.len() > 1)
        .filter(|_| parts > 1)
    else {
        return vec![region.to_vec()];
    };
    let parts = parts.min(region[dim].len());
    region[dim]
        .split_even(parts)
        .into_iter()
        .map(|piece| {
            let mut part = region.to_vec();
            part[dim] = piece;
            part
        })
        .collect()
}
