//! Which rank sends what to whom: overlaps between source and destination shards (units) and
//! the deterministic choice of sender among a source shard's replicas (DESIGN §5).
//!
//! A *unit* is the overlap between one source shard and one destination shard. Every rank that
//! sees a unit — a sender enumerating destination shards or a receiver enumerating source
//! shards — computes the same assignment from the unit alone, so no communication is needed.

use super::config::{Config, Mode};
use super::fingerprint::mix;
use super::loads::{Loads, FORWARD_SCALE};
use crate::layout::{IndexRuns, TensorSpec};
use std::borrow::Cow;

/// Which data one sender gives one receiver: a region of a tensor moving from `from` to `to`
/// (`from == to` is a local copy), as `assign` decides it for a unit.
///
/// The region is an index set per dim, not necessarily a box of the tensor. The planner cuts
/// it into [`Block`](super::Block)s — boxes contiguous on both ends, each with its strided
/// copy — and the rounds cut blocks into [`Transfer`](super::Transfer)s, which are what
/// `ncclReshardPlanGetTransfers` exports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub tensor: u32,
    pub from: u32,
    pub to: u32,
    /// Global indices per dim; the data is their Cartesian product.
    pub region: Vec<IndexRuns>,
    /// The round the data moves in, when the unit fixes it (relayed data and its relay);
    /// `None` lets the pair's data be spread over rounds by position.
    pub round: Option<u32>,
    /// The sender forwards the data from its destination view, where it arrived in an
    /// earlier round (a relay), instead of reading its source view.
    pub relay: bool,
}

impl Assignment {
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

/// Every assignment of a unit, for all its receivers.
///
/// - A receiver that holds a replica of the source shard copies locally.
/// - Receivers on a node that holds replicas get their data from those (NVLink).
/// - The others get it across the network from any replica. With relays on
///   ([`Config::relay`], staged and auto modes, known topology), receivers are grouped by
///   node: the region is cut into chunks (about one per round, at least one per member, at
///   least `split_min_bytes` each); each chunk crosses the network once, to one member, in
///   its round, and that member forwards it to the others over NVLink in the next round.
/// - Network and on-node parts are dealt round-robin over the candidate senders; when there
///   are fewer parts than candidates, parts are split further (down to `split_min_bytes`) so
///   that every candidate sends.
/// - The round-robin start rotates with a hash of the unit, spreading load across units.
///
/// Only the assignments `keep(from, to, relay)` accepts are materialised (a rank needs its own),
/// so a unit with many replicas costs no copies of regions nobody asked for.
pub(crate) fn assign(
    unit: &Unit<'_>,
    config: &Config,
    rounds: u32,
    loads: &Loads,
    keep: impl Fn(u32, u32, bool) -> bool,
    mut sink: impl FnMut(Assignment),
) {
    let senders = unit.spec.src.replicas(&unit.src_coords);
    let receivers = unit.spec.dst.replicas(&unit.dst_coords);
    let mut sorted_senders = senders.clone();
    sorted_senders.sort_unstable();
    let rotation = mix(std::iter::once(u64::from(unit.tensor))
        .chain(unit.src_coords.iter().flat_map(|c| c.iter().copied()))
        .chain([u64::MAX])
        .chain(unit.dst_coords.iter().flat_map(|c| c.iter().copied())));

    let mut out = |from: u32, to: u32, region: &[IndexRuns], round: Option<u32>, relay: bool| {
        if keep(from, to, relay) {
            sink(Assignment {
                tensor: unit.tensor,
                from,
                to,
                region: region.to_vec(),
                round,
                relay,
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
    let relay = config.relay && config.mode != Mode::Groupable && !by_node.is_empty();
    // Receiver groups in order of first appearance. The key is (node with replicas, or None
    // for the network); with relays, network receivers are grouped by their node too.
    // Flat: (group index, receiver), stably sorted by group, then one slice per group.
    let mut keys: Vec<(Option<u32>, Option<u32>)> = Vec::new();
    let mut keyed: Vec<(u32, u32)> = Vec::with_capacity(receivers.len());
    for &r in &receivers {
        if sorted_senders.binary_search(&r).is_ok() {
            out(r, r, &unit.region, None, false);
            continue;
        }
        let node = config.topology.node(r);
        let key = match node.filter(|&n| !on_node(n).is_empty()) {
            Some(n) => (Some(n), None),
            None if relay => (None, node),
            None => (None, None),
        };
        let index = match keys.iter().rposition(|k| *k == key) {
            Some(i) => i,
            None => {
                keys.push(key);
                keys.len() - 1
            }
        };
        keyed.push((index as u32, r));
    }
    keyed.sort_by_key(|&(group, _)| group);
    let members_of: Vec<u32> = keyed.iter().map(|&(_, r)| r).collect();
    let groups = keyed
        .chunk_by(|a, b| a.0 == b.0)
        .scan(0usize, |at, run| {
            let members = &members_of[*at..*at + run.len()];
            *at += run.len();
            Some((keys[run[0].0 as usize].0, members))
        })
        .collect::<Vec<(Option<u32>, &[u32])>>();

    let elem_size = u64::from(unit.spec.elem_size());
    let bytes_of = |region: &[IndexRuns]| -> u64 {
        region.iter().map(IndexRuns::len).product::<u64>() * elem_size
    };
    // Network groups: receivers that no replica reaches over NVLink, by node when relaying.
    let network_groups: Vec<&[u32]> = groups
        .iter()
        .filter(|(node, _)| node.is_none())
        .map(|&(_, members)| members)
        .collect();
    // Forwarding between receiving nodes: a fraction of the data crosses the network once, to
    // one node (the hub), which forwards it to the other nodes in the next round. Only when
    // the senders are busier than any receiver ([`Loads::forward_fraction`]), and only for
    // data received at least two rounds before the last, so a forwarded chunk's in-node relay
    // (round + 2) still lands in the plan's extra round.
    let forwarded_share = if relay && rounds >= 2 && network_groups.len() >= 2 {
        loads.forward_fraction(&sorted_senders, network_groups.len() as u64)
    } else {
        0
    };
    // Relayed overlaps: the region's chunks, computed once for every relay group. Each chunk
    // goes whole to one member (contiguous where the region is, so it can be forwarded
    // without packing); the rotation spreads chunks over members and rounds.
    let largest_group = network_groups
        .iter()
        .filter(|_| relay)
        .map(|members| members.len() as u64)
        .max()
        .unwrap_or(1);
    let chunks = if largest_group > 1 || forwarded_share > 0 {
        let n = u64::from(rounds)
            .max(largest_group)
            .min(bytes_of(&unit.region) / config.split_min_bytes.saturating_mul(RELAY_CHUNK_FACTOR))
            .max(1);
        split_region(&unit.region, n)
    } else {
        Vec::new()
    };
    // Which chunks are forwarded: a hash of (unit, chunk) below the share, so that over a
    // sender's many units the forwarded bytes approach the share.
    let forwarded: Vec<bool> = (0..chunks.len() as u64)
        .map(|c| forwarded_share > 0 && mix([rotation, c]) % FORWARD_SCALE < forwarded_share)
        .collect();
    // Network legs: (receiver, region, round) for every group, dealt out together.
    let mut network: Vec<Leg<'_>> = Vec::new();
    for (node, members) in &groups {
        if let Some(n) = node {
            let candidates: Vec<u32> = on_node(*n).iter().map(|&(_, s)| s).collect();
            let legs: Vec<Leg<'_>> = members
                .iter()
                .map(|&r| (r, Cow::Borrowed(unit.region.as_slice()), None))
                .collect();
            deal(&legs, &candidates, rotation, config, &bytes_of, &mut out);
        }
    }
    let any_forwarded = forwarded.contains(&true);
    for members in &network_groups {
        let g = members.len() as u64;
        if chunks.is_empty() || !relay || (g == 1 && !any_forwarded) {
            network.extend(
                members
                    .iter()
                    .map(|&r| (r, Cow::Borrowed(unit.region.as_slice()), None)),
            );
            continue;
        }
        for (c, chunk) in chunks.iter().enumerate() {
            if forwarded[c] {
                continue;
            }
            if g == 1 {
                network.push((members[0], Cow::Borrowed(chunk.as_slice()), None));
                continue;
            }
            // Independent offsets for round and member: in any round, the units' chunks land
            // on all members alike.
            let c = c as u64;
            let round = ((c + rotation / 65_521) % u64::from(rounds)) as u32;
            let first = ((c + rotation) % g) as usize;
            network.push((members[first], Cow::Borrowed(chunk.as_slice()), Some(round)));
            for (j, &r) in members.iter().enumerate() {
                if j != first {
                    out(members[first], r, chunk, Some(round + 1), true);
                }
            }
        }
    }
    // Forwarded chunks: to one member of the hub node in round r, from it to its node mates
    // and to one member (the entry) of every other node in r + 1, from each entry to its
    // node mates in r + 2.
    for (c, chunk) in chunks.iter().enumerate() {
        if !forwarded[c] {
            continue;
        }
        let c = c as u64;
        let round = ((c + rotation / 65_521) % u64::from(rounds - 1)) as u32;
        let hub_group = ((c + rotation / 8_191) % network_groups.len() as u64) as usize;
        let entry = |members: &[u32]| ((c + rotation) % members.len() as u64) as usize;
        let hub_members = network_groups[hub_group];
        let hub = hub_members[entry(hub_members)];
        network.push((hub, Cow::Borrowed(chunk.as_slice()), Some(round)));
        for (i, members) in network_groups.iter().enumerate() {
            let first = members[entry(members)];
            if i != hub_group {
                out(hub, first, chunk, Some(round + 1), true);
            }
            for &r in members.iter().filter(|&&r| r != first) {
                let relay_round = if i == hub_group { round + 1 } else { round + 2 };
                out(first, r, chunk, Some(relay_round), true);
            }
        }
    }
    deal(&network, &senders, rotation, config, &bytes_of, &mut out);
}

/// A relayed overlap is cut into chunks of at least this many times `split_min_bytes` (8 MiB
/// by default): each chunk is one message per replica it is forwarded to.
const RELAY_CHUNK_FACTOR: u64 = 8;

/// Emits one assignment: (from, to, region, fixed round, relay).
type Emit<'a> = dyn FnMut(u32, u32, &[IndexRuns], Option<u32>, bool) + 'a;

/// A part of a unit bound for one receiver: (receiver, region, fixed round).
type Leg<'a> = (u32, Cow<'a, [IndexRuns]>, Option<u32>);

/// Deals `legs` to `candidates` round-robin from a rotated start; with fewer legs than
/// candidates, each leg is split so every candidate sends a part.
fn deal(
    legs: &[Leg<'_>],
    candidates: &[u32],
    rotation: u64,
    config: &Config,
    bytes_of: &dyn Fn(&[IndexRuns]) -> u64,
    out: &mut Emit<'_>,
) {
    let k = candidates.len() as u64;
    let l = legs.len() as u64;
    if k == 0 || l == 0 {
        return;
    }
    let start = rotation % k;
    let mut next = 0u64;
    // Legs of one group share the unit's region: split it once.
    let mut last_split: Option<(*const IndexRuns, u64, Vec<Vec<IndexRuns>>)> = None;
    for (to, region, round) in legs {
        let parts_wanted = if l >= k {
            1
        } else {
            (k / l).min((bytes_of(region) / config.split_min_bytes).max(1))
        };
        if parts_wanted == 1 {
            let from = candidates[((next + start) % k) as usize];
            next += 1;
            out(from, *to, region, *round, false);
            continue;
        }
        let key = (region.as_ptr(), parts_wanted);
        let parts = match &last_split {
            Some((ptr, wanted, parts)) if (*ptr, *wanted) == key => parts,
            _ => {
                let parts = split_region(region, parts_wanted);
                &last_split.insert((key.0, key.1, parts)).2
            }
        };
        for part in parts {
            let from = candidates[((next + start) % k) as usize];
            next += 1;
            out(from, *to, part, *round, false);
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
