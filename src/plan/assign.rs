//! Which rank sends what to whom: overlaps between source and destination shards (units) and
//! the deterministic choice of sender among a source shard's replicas (docs/design.md §5).
//!
//! A *unit* is the overlap between one source shard and one destination shard. Every rank that
//! sees a unit — a sender enumerating destination shards or a receiver enumerating source
//! shards — computes the same assignment from the unit alone, so no communication is needed.

use super::config::{Config, Mode, AUTO_DIRECT_PART_FRACTION, AUTO_MESSAGES_PER_RANK};
use super::fingerprint::mix;
use super::fxhash::FxHashMap;
use super::loads::{Loads, FORWARD_SCALE};
use crate::layout::{IndexRuns, TensorSpec};
use std::cell::OnceCell;
use std::rc::Rc;

/// Which data one sender gives one receiver: a region of a tensor moving from `from` to `to`
/// (`from == to` is a local copy), as `assign` decides it for a unit.
///
/// The region is an index set per dim, not necessarily a box of the tensor. The planner cuts
/// it into [`Block`](super::Block)s — boxes contiguous on both ends, each with its strided
/// copy — and the rounds cut blocks into [`Transfer`](super::Transfer)s, which are what
/// `ncclReshardPlanGetTransfers` exports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The tensor's index in the plan.
    pub tensor: u32,
    /// The rank that sends the data (the receiver itself for a local copy).
    pub from: u32,
    /// The rank that receives it.
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

    /// Elements of the region.
    pub fn elements(&self) -> u64 {
        self.region.iter().map(IndexRuns::len).product()
    }
}

/// One unit — the overlap of one source shard and one destination shard, identified by their
/// coordinates on the sharding mesh axes (per tensor dim) — with everything its assignments
/// depend on except the rotation.
///
/// The rotation (a hash of the tensor index and the unit's coordinates) is the only input that
/// differs between tensors of one class (same layouts, shape and dtype), so a rank prepares
/// each unit of a class once and [`Prepared::deal`]s it for every tensor of the class; the
/// assignments are exactly those the unit alone determines (module doc).
///
/// - A receiver that holds a replica of the source shard copies locally.
/// - Receivers on a node that holds replicas get their data from those (NVLink).
/// - The others get it across the network from any replica. With relays on
///   ([`Config::relay`], staged and auto modes, known topology), receivers are grouped by
///   node: the region is cut into chunks (about one per round, at least one per member, at
///   least `split_min_bytes` each); each chunk crosses the network once, to one member, in
///   its round, and that member forwards it to the others over NVLink in the next round.
/// - Forwarding between receiving nodes (same conditions, at least 2 rounds, at least 2
///   receiving nodes): when the unit's senders are busier than any receiver
///   ([`Loads::forward_fraction`]), that share of the chunks (evenly spaced, from the unit's
///   offsets, [`Spread`]) crosses the network once, to one member of one node (the hub), in a round
///   r ≤ rounds − 1 − s; the hub forwards it to its node mates in r + 1 and to one member (the
///   entry) of every other node in one of the rounds r + 1 … r + s ([`hub_spread`] `s`, 1
///   unless that would cost too many messages), and each entry to its node mates in the round
///   after.
/// - Network and on-node parts are dealt round-robin over the candidate senders; when there
///   are fewer parts than candidates, parts are split further (down to `split_min_bytes`) so
///   that every candidate sends.
/// - The round-robin start rotates with the rotation, spreading load across units.
pub(crate) struct Prepared {
    /// What the rotation hashes after the tensor index: the source coordinates, a separator,
    /// the destination coordinates.
    coords: Vec<u64>,
    /// False when no choice depends on the rotation (one candidate per deal, no relays).
    rotates: bool,
    /// The regions assignments move: `[0]` the unit's region, then the relay chunks, then the
    /// parts legs are split into.
    pub regions: Vec<Vec<IndexRuns>>,
    /// Each region's smallest multi-index ([`Assignment::corner`]), `ndim` words per region
    /// ([`Prepared::corner`]).
    corners: Vec<u64>,
    ndim: usize,
    /// The receivers in groups (shared by units with the same receivers and no sender on
    /// their nodes).
    groups: Rc<ReceiverGroups>,
    /// How the groups are dealt (shared with them).
    fanout: Rc<Fanout>,
    /// Per on-node step of the fanout, in order: its candidates and its legs.
    on_node: Vec<(Vec<u32>, Vec<Leg>)>,
    /// Relay chunks: regions `1..=chunks`.
    chunks: u32,
    /// The share of chunks forwarded between receiving nodes, in 1/[`FORWARD_SCALE`] (0:
    /// none). Then every network receiver is in a relay group (one per node) and the fanout's
    /// relay groups list them all.
    forward_share: u64,
    /// A hub forwards to each other relay group in one round in this many
    /// ([`Prepared::forward_round`], [`hub_spread`]; 1: in the round after the chunk arrived).
    hub_spread: u32,
    /// The network legs listed and split, when there are fewer than senders; `None`: every
    /// leg whole, as the fanout's segments give them.
    split: Option<Vec<Leg>>,
    senders: Vec<u32>,
    rounds: u32,
    /// A number of this unit among its tensor's (from its coordinates), for [`Turn::slot`].
    ordinal: u64,
    /// The receiving rank this unit was prepared for, with its relay group and its place
    /// among the receivers dealt to directly (found once, not at every deal).
    me: Option<Me>,
}

#[derive(Clone, Copy)]
struct Me {
    rank: u32,
    group: Option<usize>,
    direct: Option<usize>,
}

/// How a unit's receiver groups are dealt, in group order: on-node deals, relay groups and
/// the network legs' segments. It depends only on the groups and whether chunks are
/// forwarded, so units sharing their groups share it.
struct Fanout {
    steps: Vec<Step>,
    /// Indices in `steps` of the on-node deals, and of each relay group's step: a receiver
    /// deals those and its own group's only.
    on_node_steps: Vec<u32>,
    relay_steps: Vec<u32>,
    /// Relay groups' members, by node.
    relay_groups: Groups,
    /// The network legs.
    whole: Whole,
}

enum Step {
    /// Receivers on a node with replicas (the unit's `on_node[i]`), dealt over that node's
    /// replicas.
    OnNode(u32),
    /// A relay group (index into `relay_groups`): chunk `c` crosses the network to one member,
    /// which forwards it to the others in the next round.
    Relay(u32),
}

/// A unit's network legs in deal order, every leg one part (its region whole) — the unit
/// lists and splits them instead ([`Prepared::split`]) when there are fewer than senders: per
/// receiver group (in group order) its receivers' legs, or its relay chunks' legs; then, when
/// chunks are forwarded, one leg per chunk to the hub. A leg's place in the deal follows from
/// counts, so a receiver finds its own legs without walking every receiver's (thousands at
/// thousands of ranks).
#[derive(Default)]
struct Whole {
    /// The receivers of the segments that deal to receivers directly, all segments' in one.
    receivers: Vec<u32>,
    segments: Vec<Segment>,
    /// The segment of each relay group.
    relay_segment: Vec<u32>,
    /// One leg per chunk to the hub after the segments (chunks are forwarded).
    forward: bool,
}

impl Whole {
    /// Every leg `(to, region)` in deal order, skipped ones included (`chunks`: the unit's
    /// relay chunks).
    fn legs(&self, chunks: u32) -> impl Iterator<Item = (LegTo, u32)> + '_ {
        let segments = self.segments.iter().flat_map(move |seg| {
            let receivers = self.receivers
                [seg.receivers.start as usize..seg.receivers.end as usize]
                .iter()
                .map(|&r| (LegTo::Receiver(r), 0));
            let relays = seg.relay.into_iter().flat_map(move |group| {
                (0..chunks).map(move |chunk| (LegTo::Relay { group, chunk }, 1 + chunk))
            });
            receivers.chain(relays)
        });
        let forwards = (0..if self.forward { chunks } else { 0 })
            .map(|chunk| (LegTo::Forward { chunk }, 1 + chunk));
        segments.chain(forwards)
    }
}

struct Segment {
    /// Receivers dealt to directly (a range of [`Whole::receivers`]; empty for a relay group,
    /// starting where the next receivers would).
    receivers: std::ops::Range<u32>,
    /// The relay group whose chunks this segment deals (one leg per chunk).
    relay: Option<u32>,
    /// Legs to receivers, and relay groups, in the segments before this one.
    receivers_before: u32,
    relays_before: u32,
}

/// A part of a unit bound for one receiver, with the regions it is dealt as (one, or its
/// split parts, one per sender): region ids `parts`, consecutive.
struct Leg {
    to: LegTo,
    parts: std::ops::Range<u32>,
}

#[derive(Clone, Copy)]
enum LegTo {
    Receiver(u32),
    /// Relay chunk `chunk` of relay group `group`: the member and round follow the rotation.
    Relay {
        group: u32,
        chunk: u32,
    },
    /// Relay chunk `chunk` when forwarded between nodes: to the hub, which the rotation picks.
    Forward {
        chunk: u32,
    },
}

impl Whole {
    /// Legs in all, skipped ones included.
    fn legs_count(&self, chunks: u32) -> u64 {
        let chunked = self.relay_segment.len() as u64 + u64::from(self.forward);
        self.receivers.len() as u64 + chunked * u64::from(chunks)
    }
}

/// The replicas of one destination shard (a destination layout and shard coordinates), found
/// once per rank call and shared by every unit with that shard: at thousands of ranks a
/// replicated destination has thousands of receivers per unit, and a rank has thousands of
/// units with the same receivers.
pub(crate) struct Receivers {
    /// In mesh order, and sorted.
    replicas: Vec<u32>,
    sorted: Vec<u32>,
    /// The nodes they are on (sorted, distinct; known topology only).
    nodes: Vec<u32>,
    /// Their groups when no sender is one of them or on their nodes, by relay flag.
    plain: [OnceCell<Rc<ReceiverGroups>>; 2],
}

impl Receivers {
    /// The replicas of the destination shard at `dst_coords` of `spec`'s layouts.
    pub fn new(spec: &TensorSpec, dst_coords: &[&[u64]], config: &Config) -> Receivers {
        let replicas = spec.dst.replicas(dst_coords);
        let mut sorted = replicas.clone();
        sorted.sort_unstable();
        let mut nodes: Vec<u32> = replicas
            .iter()
            .filter_map(|&r| config.topology.node(r))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        Receivers {
            replicas,
            sorted,
            nodes,
            plain: [OnceCell::new(), OnceCell::new()],
        }
    }
}

/// Who holds and who needs one unit's data, grouped as its assignments are dealt: the source
/// shard's replicas (by node) and the destination shard's replicas in groups of first
/// appearance (receivers that copy locally, per node with replicas, per node for relays, the
/// network). It depends only on the two shards' replicas and the topology, so units of
/// tensors on the same layouts share it (the core caches it per rank), and units whose senders
/// touch none of the receivers' nodes share the receivers' groups.
pub(crate) struct Grouping {
    /// The source shard's replicas, in mesh order, and sorted.
    senders: Vec<u32>,
    sorted_senders: Vec<u32>,
    /// Replicas by node, sorted by (node, rank), when the topology is known.
    by_node: Vec<(u32, u32)>,
    receivers: Rc<ReceiverGroups>,
}

/// The destination shard's replicas in groups, for the senders of a unit.
pub(crate) struct ReceiverGroups {
    /// Relays are on (relay mode, not groupable, known topology).
    relay: bool,
    /// Receivers that hold a replica of the source shard (they copy locally).
    locals: Vec<u32>,
    /// Each group's node with replicas (`None`: over the network) and its members, a range of
    /// `members_of`.
    groups: Vec<(Option<u32>, std::ops::Range<u32>)>,
    members_of: Vec<u32>,
    /// The fanout without and with forwarding between receiving nodes, once asked for.
    fanouts: [OnceCell<Rc<Fanout>>; 2],
}

impl Grouping {
    /// The grouping of the unit between the source shard at `src_coords` and the destination
    /// shard whose replicas are `receivers`, of `spec`'s layouts.
    pub fn new(
        spec: &TensorSpec,
        src_coords: &[&[u64]],
        receivers: &Receivers,
        config: &Config,
    ) -> Grouping {
        let senders = spec.src.replicas(src_coords);
        let mut sorted_senders = senders.clone();
        sorted_senders.sort_unstable();
        let mut by_node: Vec<(u32, u32)> = senders
            .iter()
            .filter_map(|&s| config.topology.node(s).map(|n| (n, s)))
            .collect();
        by_node.sort_unstable();
        let relay = config.relay && config.mode != Mode::Groupable && !by_node.is_empty();
        // Senders apart from every receiver and its node: the receivers' plain groups.
        let apart = senders.iter().all(|s| {
            receivers.sorted.binary_search(s).is_err()
                && config
                    .topology
                    .node(*s)
                    .map_or(true, |n| receivers.nodes.binary_search(&n).is_err())
        });
        let groups = if apart {
            receivers.plain[usize::from(relay)]
                .get_or_init(|| {
                    Rc::new(ReceiverGroups::new(
                        &receivers.replicas,
                        &[],
                        &[],
                        relay,
                        config,
                    ))
                })
                .clone()
        } else {
            Rc::new(ReceiverGroups::new(
                &receivers.replicas,
                &sorted_senders,
                &by_node,
                relay,
                config,
            ))
        };
        Grouping {
            senders,
            sorted_senders,
            by_node,
            receivers: groups,
        }
    }
}

impl ReceiverGroups {
    /// `receivers` (in mesh order) grouped for senders `sorted_senders`, on nodes `by_node`.
    fn new(
        receivers: &[u32],
        sorted_senders: &[u32],
        by_node: &[(u32, u32)],
        relay: bool,
        config: &Config,
    ) -> ReceiverGroups {
        let on_node = |n: u32| -> bool {
            let lo = by_node.partition_point(|&(m, _)| m < n);
            by_node.get(lo).is_some_and(|&(m, _)| m == n)
        };
        // Receiver groups in order of first appearance. The key is (node with replicas, or
        // None for the network); with relays, network receivers are grouped by their node too.
        // Flat: (group index, receiver), stably sorted by group, then one slice per group.
        let mut locals = Vec::new();
        let mut keys: Vec<(Option<u32>, Option<u32>)> = Vec::new();
        // Each key's group (a receiver per node: a linear search of the keys was quadratic in
        // the replicas, the largest planning cost at thousands of ranks).
        let mut group_of: FxHashMap<(Option<u32>, Option<u32>), u32> = FxHashMap::default();
        let mut keyed: Vec<(u32, u32)> = Vec::with_capacity(receivers.len());
        for &r in receivers {
            if sorted_senders.binary_search(&r).is_ok() {
                locals.push(r);
                continue;
            }
            let node = config.topology.node(r);
            let key = match node.filter(|&n| on_node(n)) {
                Some(n) => (Some(n), None),
                None if relay => (None, node),
                None => (None, None),
            };
            // Receivers come in mesh order, so keys mostly rise: a key above every earlier one
            // is a new group without a lookup; the map is filled only once keys fall back.
            let index = match keys.last() {
                Some(last) if *last == key => keys.len() as u32 - 1,
                Some(last) if key > *last && group_of.is_empty() => {
                    keys.push(key);
                    keys.len() as u32 - 1
                }
                None => {
                    keys.push(key);
                    0
                }
                Some(_) => {
                    if group_of.is_empty() {
                        group_of.extend(keys.iter().enumerate().map(|(i, &k)| (k, i as u32)));
                    }
                    *group_of.entry(key).or_insert_with(|| {
                        keys.push(key);
                        keys.len() as u32 - 1
                    })
                }
            };
            keyed.push((index, r));
        }
        keyed.sort_by_key(|&(group, _)| group);
        let members_of: Vec<u32> = keyed.iter().map(|&(_, r)| r).collect();
        let mut groups = Vec::with_capacity(keys.len());
        let mut at = 0u32;
        for run in keyed.chunk_by(|a, b| a.0 == b.0) {
            let end = at + run.len() as u32;
            groups.push((keys[run[0].0 as usize].0, at..end));
            at = end;
        }
        ReceiverGroups {
            relay,
            locals,
            groups,
            members_of,
            fanouts: [OnceCell::new(), OnceCell::new()],
        }
    }

    /// A group's members.
    fn members(&self, group: &std::ops::Range<u32>) -> &[u32] {
        &self.members_of[group.start as usize..group.end as usize]
    }

    /// Groups dealt over the network (no replica on their node).
    fn network_groups(&self) -> u64 {
        self.groups
            .iter()
            .filter(|(node, _)| node.is_none())
            .count() as u64
    }

    /// The size of the largest group relays would serve (1 without relays).
    fn largest_relay_group(&self) -> u64 {
        self.groups
            .iter()
            .filter(|(node, _)| self.relay && node.is_none())
            .map(|(_, members)| u64::from(members.end - members.start))
            .max()
            .unwrap_or(1)
    }

    /// How these groups are dealt, with or without forwarding between receiving nodes.
    fn fanout(&self, forward: bool) -> Rc<Fanout> {
        self.fanouts[usize::from(forward)]
            .get_or_init(|| Rc::new(Fanout::new(self, forward)))
            .clone()
    }
}

impl Fanout {
    fn new(groups: &ReceiverGroups, forward: bool) -> Fanout {
        let mut fanout = Fanout {
            steps: Vec::new(),
            on_node_steps: Vec::new(),
            relay_steps: Vec::new(),
            relay_groups: Groups::default(),
            whole: Whole {
                forward,
                ..Whole::default()
            },
        };
        let whole = &mut fanout.whole;
        for (node, range) in &groups.groups {
            let members = groups.members(range);
            if node.is_some() {
                fanout.on_node_steps.push(fanout.steps.len() as u32);
                let i = fanout.on_node_steps.len() as u32 - 1;
                fanout.steps.push(Step::OnNode(i));
                continue;
            }
            let at = whole.receivers.len() as u32;
            let mut segment = Segment {
                receivers: at..at,
                relay: None,
                receivers_before: at,
                relays_before: whole.relay_segment.len() as u32,
            };
            if (members.len() == 1 && !forward) || !groups.relay {
                whole.receivers.extend_from_slice(members);
                segment.receivers.end = whole.receivers.len() as u32;
            } else {
                let group = fanout.relay_groups.len() as u32;
                fanout.relay_groups.push(members);
                fanout.relay_steps.push(fanout.steps.len() as u32);
                fanout.steps.push(Step::Relay(group));
                segment.relay = Some(group);
                whole.relay_segment.push(whole.segments.len() as u32);
            }
            whole.segments.push(segment);
        }
        fanout
    }
}

impl Prepared {
    /// Prepares the unit of `spec` between the source shard at `src_coords` and the
    /// destination shard at `dst_coords`, overlapping in `region`, for a plan of `rounds`
    /// rounds; `grouping` is [`Grouping::new`] of the same shards. `receiver`: the rank it is
    /// prepared for when that rank receives in it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &TensorSpec,
        src_coords: &[&[u64]],
        dst_coords: &[&[u64]],
        region: Vec<IndexRuns>,
        grouping: &Grouping,
        config: &Config,
        rounds: u32,
        part_bytes: u64,
        loads: &Loads,
        receiver: Option<u32>,
    ) -> Prepared {
        let coords: Vec<u64> = src_coords
            .iter()
            .flat_map(|c| c.iter().copied())
            .chain([u64::MAX])
            .chain(dst_coords.iter().flat_map(|c| c.iter().copied()))
            .collect();
        let Grouping {
            senders,
            sorted_senders,
            by_node,
            receivers: groups,
        } = grouping;
        let relay = groups.relay;
        let on_node = |n: u32| -> &[(u32, u32)] {
            let lo = by_node.partition_point(|&(m, _)| m < n);
            let hi = by_node.partition_point(|&(m, _)| m <= n);
            &by_node[lo..hi]
        };
        let elem_size = u64::from(spec.elem_size());
        let bytes_of = |region: &[IndexRuns]| -> u64 {
            region.iter().map(IndexRuns::len).product::<u64>() * elem_size
        };
        // Forwarding between receiving nodes: how much, from the senders' load.
        let network_groups = groups.network_groups();
        let forward_share = if relay && rounds >= 2 && network_groups >= 2 {
            loads.forward_fraction(sorted_senders, network_groups)
        } else {
            0
        };
        // Relayed overlaps: the region's chunks, computed once for every relay group. Each
        // chunk goes whole to one member (contiguous where the region is, so it can be
        // forwarded without packing); the rotation spreads chunks over members and rounds.
        // One chunk per (member, round) where the overlap is large enough: then every member
        // of a group takes a share of the overlap in every round, and its sender sends it in
        // every round ([`Prepared::relay_leg`]).
        let largest_group = groups.largest_relay_group();
        let chunks = if largest_group > 1 || forward_share > 0 {
            let n = u64::from(rounds)
                .saturating_mul(largest_group)
                .min(bytes_of(&region) / relay_chunk_min_bytes(largest_group, part_bytes, config))
                .max(1);
            split_region(&region, n)
        } else {
            Vec::new()
        };
        let fanout = groups.fanout(forward_share > 0);
        let spread = if forward_share > 0 {
            hub_spread(fanout.relay_groups.len() as u64, rounds)
        } else {
            1
        };
        let mut prepared = Prepared {
            coords,
            rotates: !fanout.relay_groups.is_empty(),
            regions: vec![region],
            corners: Vec::new(),
            ndim: spec.shape.len(),
            groups: groups.clone(),
            fanout: fanout.clone(),
            on_node: Vec::new(),
            chunks: chunks.len() as u32,
            forward_share,
            hub_spread: spread,
            split: None,
            senders: senders.clone(),
            rounds,
            ordinal: 0,
            me: None,
        };
        prepared.ordinal = prepared
            .coords
            .iter()
            .fold(0u64, |a, &c| a.wrapping_mul(8_191).wrapping_add(c));
        prepared.regions.extend(chunks);
        // On-node deals: each group's receivers over its node's replicas.
        for (node, range) in groups.groups.iter() {
            let Some(n) = node else { continue };
            let candidates: Vec<u32> = on_node(*n).iter().map(|&(_, s)| s).collect();
            let legs: Vec<(LegTo, u32)> = groups
                .members(range)
                .iter()
                .map(|&r| (LegTo::Receiver(r), 0))
                .collect();
            let legs = prepared.split_legs(&legs, candidates.len() as u64, config, &bytes_of);
            prepared.rotates |= candidates.len() > 1;
            prepared.on_node.push((candidates, legs));
        }
        // Network legs: whole (as the fanout's segments give them) unless there are fewer
        // than senders, then listed and split.
        let legs = fanout.whole.legs_count(prepared.chunks);
        let k = senders.len() as u64;
        if legs < k {
            let listed: Vec<(LegTo, u32)> = fanout.whole.legs(prepared.chunks).collect();
            prepared.split = Some(prepared.split_legs(&listed, k, config, &bytes_of));
        }
        prepared.rotates |= senders.len() > 1 && legs > 0;
        prepared.me = receiver.map(|rank| Me {
            rank,
            group: fanout.relay_groups.position(rank),
            direct: fanout.whole.receivers.iter().position(|&r| r == rank),
        });
        let ndim = prepared.ndim;
        prepared.corners = prepared
            .regions
            .iter()
            .flat_map(|region| (0..ndim).map(|d| region[d].first().unwrap_or(0)))
            .collect();
        prepared
    }

    /// The legs `(receiver, region)` dealt over `k` candidates, each with the regions it goes
    /// as: with fewer legs than candidates, each leg is split so every candidate sends a part.
    fn split_legs(
        &mut self,
        legs: &[(LegTo, u32)],
        k: u64,
        config: &Config,
        bytes_of: &dyn Fn(&[IndexRuns]) -> u64,
    ) -> Vec<Leg> {
        let l = legs.len() as u64;
        // Legs of one group share the unit's region: split it once.
        let mut last_split: Option<(u32, u64, std::ops::Range<u32>)> = None;
        legs.iter()
            .map(|&(to, region)| {
                let parts_wanted = if l >= k {
                    1
                } else {
                    (k / l).min(
                        (bytes_of(&self.regions[region as usize]) / config.split_min_bytes).max(1),
                    )
                };
                if parts_wanted == 1 {
                    return Leg {
                        to,
                        parts: region..region + 1,
                    };
                }
                let parts = match &last_split {
                    Some((r, wanted, parts)) if (*r, *wanted) == (region, parts_wanted) => {
                        parts.clone()
                    }
                    _ => {
                        let split = split_region(&self.regions[region as usize], parts_wanted);
                        let first = self.regions.len() as u32;
                        let ids = first..first + split.len() as u32;
                        self.regions.extend(split);
                        last_split = Some((region, parts_wanted, ids.clone()));
                        ids
                    }
                };
                Leg { to, parts }
            })
            .collect()
    }

    /// Region `region`'s smallest multi-index ([`Assignment::corner`]).
    pub fn corner(&self, region: u32) -> &[u64] {
        let at = region as usize * self.ndim;
        &self.corners[at..at + self.ndim]
    }

    /// True when some choice depends on the rotation.
    pub fn rotates(&self) -> bool {
        self.rotates
    }

    /// The rotation of this unit in tensor `tensor` (0 when nothing depends on it).
    pub fn rotation(&self, tensor: u32) -> u64 {
        if !self.rotates {
            return 0;
        }
        mix(std::iter::once(u64::from(tensor)).chain(self.coords.iter().copied()))
    }

    /// The assignments of the unit under `rotation` that `view` can keep, as
    /// `emit(from, to, region index, fixed round, relay)`, in a fixed order: every one for
    /// [`View::All`]; for a rank, a superset of those it takes part in, in the same order as
    /// in the full deal. Relay forwards (`relay` true) run between receivers, so a sender
    /// skips them, and a receiver deals only its own node's group (and the hub's forwards when
    /// it is the hub): a rank's cost follows its own traffic, not every replica's.
    pub fn deal(
        &self,
        tensor: u32,
        rotation: u64,
        position: Option<Position>,
        view: View,
        emit: &mut Emit<'_>,
    ) {
        let turn = Turn {
            rotation,
            position,
            spread: Spread::of(tensor, self.ordinal),
            slot: u64::from(tensor)
                .wrapping_mul(1_000_003)
                .wrapping_add(self.ordinal.wrapping_mul(u64::from(self.chunks))),
        };
        for &r in &self.groups.locals {
            emit(r, r, 0, None, false);
        }
        // The relay group this rank receives in, when it deals as a receiver.
        let (relays, mine) = match view {
            #[cfg(test)]
            View::All => (true, None),
            View::Sender(_) => (false, None),
            View::Receiver(rank) => (true, self.me(rank).group),
        };
        #[cfg(test)]
        let mine_only = view != View::All;
        #[cfg(not(test))]
        let mine_only = true;
        // The steps this view deals, in step order: every on-node deal, and the relay groups'
        // forwards (all of them, or the rank's own group's, merged in at its place).
        if relays && !mine_only {
            for step in &self.fanout.steps {
                self.deal_step(step, turn, view, mine, emit);
            }
        } else {
            let mut own = mine
                .filter(|_| relays)
                .and_then(|g| self.fanout.relay_steps.get(g).copied());
            for &s in &self.fanout.on_node_steps {
                if let Some(o) = own.filter(|&o| o < s) {
                    self.deal_step(&self.fanout.steps[o as usize], turn, view, mine, emit);
                    own = None;
                }
                self.deal_step(&self.fanout.steps[s as usize], turn, view, mine, emit);
            }
            if let Some(o) = own {
                self.deal_step(&self.fanout.steps[o as usize], turn, view, mine, emit);
            }
        }
        for chunk in (0..self.chunks).filter(|&c| relays && self.forwarded(c, turn)) {
            let (hub_group, hub, round) = self.hub(chunk, turn);
            let hub_is_me = matches!(view, View::Receiver(rank) if rank == hub);
            // The hub forwards to every group; another rank takes part in its own group's only.
            let groups = if !mine_only || hub_is_me {
                0..self.fanout.relay_groups.len()
            } else {
                match mine {
                    Some(g) => g..g + 1,
                    None => 0..0,
                }
            };
            for g in groups {
                let members = self.fanout.relay_groups.get(g as u32);
                let (entry, _) = self.relay_leg(g as u32, chunk, turn);
                let mates_round = if g == hub_group as usize {
                    round + 1
                } else {
                    let at = self.forward_round(hub_group, g as u32, round);
                    emit(hub, entry, 1 + chunk, Some(at), true);
                    at + 1
                };
                for &r in members.iter().filter(|&&r| r != entry) {
                    emit(entry, r, 1 + chunk, Some(mates_round), true);
                }
            }
        }
        match &self.split {
            Some(legs) => self.deal_legs(legs, &self.senders, turn, view, mine, emit),
            None => self.deal_whole(&self.fanout.whole, turn, view, mine, emit),
        }
    }

    /// Deals one fanout step: an on-node deal, or a relay group's forwards of the chunks not
    /// forwarded between nodes.
    fn deal_step(
        &self,
        step: &Step,
        turn: Turn,
        view: View,
        mine: Option<usize>,
        emit: &mut Emit<'_>,
    ) {
        match step {
            Step::OnNode(i) => {
                let (candidates, legs) = &self.on_node[*i as usize];
                self.deal_legs(legs, candidates, turn, view, mine, emit);
            }
            Step::Relay(group) => {
                let members = self.fanout.relay_groups.get(*group);
                for chunk in 0..self.chunks {
                    if self.forwarded(chunk, turn) {
                        continue;
                    }
                    let (first, round) = self.relay_leg(*group, chunk, turn);
                    for &r in members {
                        if r != first {
                            emit(first, r, 1 + chunk, Some(round + 1), true);
                        }
                    }
                }
            }
        }
    }

    /// Whether relay chunk `chunk` is forwarded between receiving nodes under `turn`: the
    /// chunks where `chunk · share + phase` crosses a multiple of [`FORWARD_SCALE`] (a line
    /// drawn at slope `share`), so a unit forwards `chunks · share` of its chunks within one,
    /// evenly spaced, and the phases of the units a receiver shares spread evenly
    /// ([`Spread`]).
    fn forwarded(&self, chunk: u32, turn: Turn) -> bool {
        self.forward_share > 0
            && on_line(
                u64::from(chunk),
                self.forward_share,
                turn.spread.scaled(0, FORWARD_SCALE),
            )
    }

    /// A forwarded chunk's hub: (relay group, member, round it arrives in, at most
    /// rounds − 1 − [`Prepared::hub_spread`], so that its forwards and the entries' relays land
    /// by the plan's extra round). Consecutive chunks take the next group and the next round,
    /// from offsets of the unit ([`Spread`]).
    fn hub(&self, chunk: u32, turn: Turn) -> (u32, u32, u32) {
        let c = u64::from(chunk);
        let groups = self.fanout.relay_groups.len() as u64;
        let group = ((c + turn.spread.scaled(2, groups)) % groups) as u32;
        let (member, _) = self.relay_leg(group, chunk, turn);
        let last = self.rounds - self.hub_spread;
        let round = match self.stream_round(chunk, turn, last) {
            Some(round) => round,
            None => {
                let last = u64::from(last);
                ((c + turn.spread.scaled(1, last)) % last) as u32
            }
        };
        (group, member, round)
    }

    /// For a tensor placed by its senders' streams, the round of `rounds` (from 0) that
    /// forwarded chunk `chunk` crosses the network in: where the chunk's middle sits among
    /// what its senders send, as a pair's stream takes its bytes in order by round
    /// (`rounds.rs`), so a sender reads (and converts) it in about the round its streams
    /// would.
    fn stream_round(&self, chunk: u32, turn: Turn, rounds: u32) -> Option<u32> {
        let [start, len] = turn.position?.map(u128::from);
        let chunks = u128::from(self.chunks.max(1));
        let at = start + len * (2 * u128::from(chunk) + 1) / (2 * chunks);
        let rounds = u128::from(rounds.max(1));
        Some(((at * rounds) >> 32).min(rounds - 1) as u32)
    }

    /// The round a hub of `hub_group` forwards a chunk that reached it in `round` to group
    /// `group`'s entry: the first after `round` congruent to −(`hub_group` + `group`) modulo
    /// [`Prepared::hub_spread`], so two groups' ranks exchange forwards in one round in
    /// `hub_spread` whatever the chunks' rounds.
    fn forward_round(&self, hub_group: u32, group: u32, round: u32) -> u32 {
        let s = u64::from(self.hub_spread);
        let next = u64::from(round) + 1;
        let wait = (s - (next + u64::from(hub_group) + u64::from(group)) % s) % s;
        (next + wait) as u32
    }

    /// The member relay chunk `chunk` of `group` crosses the network to, and its round.
    /// Consecutive chunks take the members in turn, then the next round: an overlap cut into
    /// members × rounds chunks gives each (member, round) one, and smaller ones land on all
    /// members alike in any round as the slot rotates. The member turns with the group (0.19),
    /// so that one chunk reaches its groups' nodes through different rails: with PXN a
    /// sender's message leaves its node on the rail of the GPU it goes to, and the same member
    /// in every group put a chunk to every node on one rail (docs/planner.md §3).
    fn relay_leg(&self, group: u32, chunk: u32, turn: Turn) -> (u32, u32) {
        let members = self.fanout.relay_groups.get(group);
        let g = members.len() as u64;
        let slot = turn.slot.wrapping_add(u64::from(chunk));
        let round = ((slot / g) % u64::from(self.rounds)) as u32;
        let first = ((slot % g + u64::from(group) % g) % g) as usize;
        (members[first], round)
    }

    /// Deals `legs` to `candidates` round-robin from a rotated start.
    /// `mine`: the relay group a receiving `view` is in. Legs `view` cannot keep are counted
    /// (the round-robin position moves on) but not worked out.
    fn deal_legs(
        &self,
        legs: &[Leg],
        candidates: &[u32],
        turn: Turn,
        view: View,
        mine: Option<usize>,
        emit: &mut Emit<'_>,
    ) {
        let k = candidates.len() as u64;
        if k == 0 || legs.is_empty() {
            return;
        }
        let start = turn.rotation % k;
        // A sender's slot among the candidates: it sends the parts dealt at that position.
        let my_slot = match view {
            View::Sender(rank) => match candidates.iter().position(|&c| c == rank) {
                Some(slot) => Some(slot as u64),
                // Not a candidate here: nothing of these legs is this rank's.
                None => return,
            },
            _ => None,
        };
        let mut next = 0u64;
        for leg in legs {
            if self.skipped(leg.to, turn) {
                continue;
            }
            let n = u64::from(leg.parts.end - leg.parts.start);
            let relevant = match (view, leg.to) {
                (View::Sender(_), _) => {
                    let slot = my_slot.unwrap_or(0);
                    // The parts at positions next + start .. + n (mod k) include the slot.
                    n >= k || ((slot + k - (next + start) % k) % k) < n
                }
                (View::Receiver(rank), LegTo::Receiver(r)) => r == rank,
                (View::Receiver(_), LegTo::Relay { group, .. }) => mine == Some(group as usize),
                _ => true,
            };
            if !relevant {
                next += n;
                continue;
            }
            let (to, round) = self.target(leg.to, turn);
            for part in leg.parts.clone() {
                let from = candidates[((next + start) % k) as usize];
                next += 1;
                emit(from, to, part, round, false);
            }
        }
    }

    /// `rank`'s relay group and place among the receivers dealt to directly.
    fn me(&self, rank: u32) -> Me {
        match self.me {
            Some(me) if me.rank == rank => me,
            _ => Me {
                rank,
                group: self.fanout.relay_groups.position(rank),
                direct: self.fanout.whole.receivers.iter().position(|&r| r == rank),
            },
        }
    }

    /// Whether a network leg is left out under `turn`: a relay group's chunk that is forwarded
    /// between nodes, or a hub's chunk that is not.
    fn skipped(&self, to: LegTo, turn: Turn) -> bool {
        match to {
            LegTo::Receiver(_) => false,
            LegTo::Relay { chunk, .. } => self.forwarded(chunk, turn),
            LegTo::Forward { chunk } => !self.forwarded(chunk, turn),
        }
    }

    /// Where a network leg goes under `turn`, and the round it is fixed to (if any).
    fn target(&self, to: LegTo, turn: Turn) -> (u32, Option<u32>) {
        match to {
            LegTo::Receiver(r) => (r, None),
            LegTo::Relay { group, chunk } => {
                let (member, round) = self.relay_leg(group, chunk, turn);
                // A lone member (a group only because of forwarding) forwards nothing: its
                // data is spread over rounds like any pair's.
                let alone = self.fanout.relay_groups.get(group).len() == 1;
                (member, (!alone).then_some(round))
            }
            LegTo::Forward { chunk } => {
                let (_, hub, round) = self.hub(chunk, turn);
                (hub, Some(round))
            }
        }
    }

    /// Deals [`Network::Whole`] legs over the senders, round-robin from a rotated start, as
    /// [`Prepared::deal_legs`] deals them listed: leg n of those not skipped goes from sender
    /// `(n + start) mod k`. A receiver works out where its own legs fall from the segments'
    /// counts; a sender walks the legs but skips a relay group whole when every chunk is
    /// forwarded.
    fn deal_whole(
        &self,
        whole: &Whole,
        turn: Turn,
        view: View,
        mine: Option<usize>,
        emit: &mut Emit<'_>,
    ) {
        let senders = &self.senders;
        let k = senders.len() as u64;
        if k == 0 {
            return;
        }
        let start = turn.rotation % k;
        // Each relay group deals its chunks that are not forwarded.
        let kept = (0..self.chunks)
            .filter(|&c| !self.forwarded(c, turn))
            .count() as u64;
        let mut give = |to: LegTo, region: u32, next: u64| {
            let (to, round) = self.target(to, turn);
            emit(
                senders[((next + start) % k) as usize],
                to,
                region,
                round,
                false,
            );
        };
        let chunk_legs = |group: u32, next: &mut u64, give: &mut dyn FnMut(LegTo, u32, u64)| {
            for chunk in 0..self.chunks {
                if !self.forwarded(chunk, turn) {
                    give(LegTo::Relay { group, chunk }, 1 + chunk, *next);
                    *next += 1;
                }
            }
        };
        // The hub's legs, after every segment's (`next`: the legs dealt before them).
        let forward_legs = |mut next: u64, give: &mut dyn FnMut(LegTo, u32, u64)| {
            if !whole.forward {
                return;
            }
            for chunk in 0..self.chunks {
                if self.forwarded(chunk, turn) {
                    give(LegTo::Forward { chunk }, 1 + chunk, next);
                    next += 1;
                }
            }
        };
        let slot = match view {
            View::Receiver(rank) => {
                // The rank's own leg (when it is dealt to directly) and its relay group's
                // chunks (when it is in one), in segment order, then the hub's legs.
                let own = self.me(rank).direct.map(|i| {
                    let s = whole
                        .segments
                        .partition_point(|seg| seg.receivers.end as usize <= i);
                    (s, i as u64)
                });
                let group = mine.and_then(|g| whole.relay_segment.get(g).map(|&s| (s as usize, g)));
                let mut order = [own.map(|(s, _)| s), group.map(|(s, _)| s)];
                order.sort_unstable();
                for s in order.into_iter().flatten() {
                    let seg = &whole.segments[s];
                    let relays_before = u64::from(seg.relays_before) * kept;
                    match (seg.relay, own) {
                        (Some(g), _) => {
                            let mut next = u64::from(seg.receivers_before) + relays_before;
                            chunk_legs(g, &mut next, &mut give);
                        }
                        (None, Some((_, i))) => {
                            give(LegTo::Receiver(rank), 0, i + relays_before);
                        }
                        (None, None) => {}
                    }
                }
                let before = whole.receivers.len() as u64 + whole.relay_segment.len() as u64 * kept;
                forward_legs(before, &mut give);
                return;
            }
            View::Sender(rank) => match senders.iter().position(|&c| c == rank) {
                Some(slot) => Some(slot as u64),
                // Not a sender of this unit: nothing of these legs is this rank's.
                None => return,
            },
            #[cfg(test)]
            View::All => None,
        };
        // A sender (or every view): walk the legs, giving those dealt at its slot.
        let mut give_at = |to: LegTo, region: u32, next: u64| {
            if slot.map_or(true, |slot| (next + start) % k == slot) {
                give(to, region, next);
            }
        };
        let mut next = 0u64;
        for seg in &whole.segments {
            match seg.relay {
                Some(_) if kept == 0 => {}
                Some(g) => chunk_legs(g, &mut next, &mut give_at),
                None => {
                    for &r in
                        &whole.receivers[seg.receivers.start as usize..seg.receivers.end as usize]
                    {
                        give_at(LegTo::Receiver(r), 0, next);
                        next += 1;
                    }
                }
            }
        }
        forward_legs(next, &mut give_at);
    }
}

/// Relay groups' members, one slice per group, in one allocation (a unit may have a group per
/// receiving node: hundreds at thousands of ranks).
#[derive(Default)]
struct Groups {
    members: Vec<u32>,
    ends: Vec<u32>,
}

impl Groups {
    fn push(&mut self, members: &[u32]) {
        self.members.extend_from_slice(members);
        self.ends.push(self.members.len() as u32);
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn get(&self, group: u32) -> &[u32] {
        let g = group as usize;
        let start = if g == 0 { 0 } else { self.ends[g - 1] as usize };
        &self.members[start..self.ends[g] as usize]
    }

    /// The group `rank` is a member of.
    fn position(&self, rank: u32) -> Option<usize> {
        let at = self.members.iter().position(|&r| r == rank)? as u32;
        Some(self.ends.partition_point(|&end| end <= at))
    }
}

/// Whose assignments a [`Prepared::deal`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum View {
    /// Every assignment of the unit (tests compare the others with it).
    #[cfg(test)]
    All,
    /// Those a rank sends (never relay forwards, which run between receivers).
    Sender(u32),
    /// Those a rank receives or forwards.
    Receiver(u32),
}

/// What a unit's choices depend on in one tensor: the rotation (a hash) and, for relay
/// chunks, a slot that numbers the chunks of a tensor's units consecutively, so a node's
/// members and the rounds take them in turn (balanced) rather than by hash.
#[derive(Clone, Copy)]
struct Turn {
    rotation: u64,
    /// Where the unit's forwarded chunks start ([`Prepared::forwarded`], [`Prepared::hub`]).
    spread: Spread,
    slot: u64,
    /// Where the tensor's bytes sit among what its source mesh's ranks send, when its
    /// forwarded chunks take their rounds from it ([`super::core::stream_positions`]).
    position: Option<Position>,
}

/// A unit's offsets for its forwarded chunks: which of its chunks are forwarded (a phase), the
/// round the first goes in and the hub group it goes to. Each is a Kronecker (additive
/// recurrence) sequence over the tensor index and the unit's ordinal, `tensor · a + ordinal · b`
/// modulo 2⁶⁴ with `a`, `b` from irrational numbers, read as a fraction of 2⁶⁴: the units a
/// receiver shares (one tensor after another, one source shard after another) take offsets
/// spread evenly over their range, where a hash scatters them at random. What a receiver takes
/// in per round sums over hundreds of units, and every round waits for its busiest receiver:
/// with hashed offsets the bytes DeepSeek-V3's inference ranks (`pp16,ep16 → tp32,dp8`) take
/// in per round straight from trainers, forwarded chunks as hubs included, spread by 36–41 MB
/// (standard deviation), with these by 25–30 MB (docs/simulator.md §7).
#[derive(Clone, Copy)]
struct Spread([u64; 3]);

impl Spread {
    /// Per offset: (tensor step, ordinal step), in 1/2⁶⁴ and rounded to odd: 1/φ and √2 − 1,
    /// the R2 sequence's 1/g and 1/g² (g the plastic number), 1/e and π − 3.
    const STEPS: [(u64, u64); 3] = [
        (0x9e37_79b9_7f4a_7c15, 0x6a09_e667_f3bc_c909),
        (0xc13f_a9a9_02a6_328f, 0x91e1_0da5_c79e_7b1d),
        (0x5e2d_58d8_b3bc_df1b, 0x243f_6a88_85a3_08d3),
    ];

    fn of(tensor: u32, ordinal: u64) -> Spread {
        Spread(Spread::STEPS.map(|(a, b)| {
            u64::from(tensor)
                .wrapping_mul(a)
                .wrapping_add(ordinal.wrapping_mul(b))
        }))
    }

    /// Offset `which` scaled to `0..n`.
    fn scaled(&self, which: usize, n: u64) -> u64 {
        ((u128::from(self.0[which]) * u128::from(n)) >> 64) as u64
    }
}

/// Whether item `i` of a sequence is taken when `share` of every [`FORWARD_SCALE`] are, from
/// `phase` (`< FORWARD_SCALE`): where `i · share + phase` crosses a multiple of
/// [`FORWARD_SCALE`]. Any `n` consecutive items hold `n · share / FORWARD_SCALE` taken ones,
/// rounded down or up, evenly spaced.
fn on_line(i: u64, share: u64, phase: u64) -> bool {
    (i * share + phase) / FORWARD_SCALE != ((i + 1) * share + phase) / FORWARD_SCALE
}

/// Where a tensor's bytes sit among what the ranks of its source mesh send in all, in tensor
/// order: (start, length) in 1/2³² of the mesh's total.
pub(crate) type Position = [u32; 2];

/// An overlap relayed over NVLink is cut into chunks of at least this many times
/// `split_min_bytes` (8 MiB by default): each chunk is one message per node mate it is
/// relayed to.
const RELAY_CHUNK_FACTOR: u64 = 8;

/// The smallest chunk of a relayed overlap whose largest relay group has `largest_group`
/// members, in a plan whose pair part is `part_bytes`. Relayed over NVLink (groups of several
/// members), every chunk is one message per node mate: [`RELAY_CHUNK_FACTOR`] ×
/// `split_min_bytes`. With one receiver per node the chunks only decide what is forwarded
/// between nodes: a chunk that is not forwarded joins each receiver's message of its round like
/// any pair's part, and a forwarded one is a message of its own, so it is at least a part /
/// [`AUTO_DIRECT_PART_FRACTION`], the smallest piece auto mode sends as a message of its own
/// (and at least `split_min_bytes`).
/// Such chunks spread the overlap over about every round instead of landing whole in a few.
/// Whole overlaps placed in rounds one by one leave each receiver's rounds uneven
/// (DeepSeek-V3 `pp16,ep16 → tp32,dp8`: the busiest inference rank's bytes per round ±5 %
/// around their mean), and the rounds run at the pace of their busiest ranks.
fn relay_chunk_min_bytes(largest_group: u64, part_bytes: u64, config: &Config) -> u64 {
    if largest_group > 1 {
        config.split_min_bytes.saturating_mul(RELAY_CHUNK_FACTOR)
    } else {
        config
            .split_min_bytes
            .max(part_bytes / AUTO_DIRECT_PART_FRACTION)
    }
}

/// In how many rounds a forwarded chunk's hub spreads its forwards to the other relay groups
/// ([`Prepared::forward_round`]) when `groups` relay groups forward over `rounds` rounds.
/// Forwarding each chunk to every group in the round after it arrived makes every two groups'
/// ranks exchange a message in every round (sends and receives: `2 (groups − 1) (rounds − 1)`
/// per rank, 2,772 with 64 receiving replicas over 23 rounds); spreading the forwards over `s`
/// rounds, each pair of groups in one round of `s`, divides that by `s` at the cost of some
/// forwards arriving up to `s − 1` rounds later (a hub's egress per round stays the same). The
/// least spread that keeps them within half of [`AUTO_MESSAGES_PER_RANK`], at most `groups`
/// and leaving forwarded chunks at least one round to cross the network in.
fn hub_spread(groups: u64, rounds: u32) -> u32 {
    let forwards = 2 * groups.saturating_sub(1) * u64::from(rounds.saturating_sub(1));
    let spread = forwards.div_ceil(AUTO_MESSAGES_PER_RANK / 2);
    let most = groups.min(u64::from(rounds.saturating_sub(1))).max(1);
    spread.clamp(1, most) as u32
}

/// Receives one assignment: (from, to, region index, fixed round, relay).
pub(crate) type Emit<'a> = dyn FnMut(u32, u32, u32, Option<u32>, bool) + 'a;

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

#[cfg(test)]
mod tests {
    use super::{hub_spread, on_line, Spread, FORWARD_SCALE};

    #[test]
    fn a_unit_forwards_its_share_of_chunks_evenly_spaced() {
        for share in [1, 7, 100, 341, 512, 700, 1023, FORWARD_SCALE] {
            for phase in [0, 1, 333, 512, FORWARD_SCALE - 1] {
                let taken: Vec<u64> = (0..200).filter(|&i| on_line(i, share, phase)).collect();
                // Any window of n chunks holds n · share / SCALE of them, rounded down or up.
                for n in [1u64, 3, 12, 31, 200] {
                    for start in 0..=(200 - n) {
                        let k = taken
                            .iter()
                            .filter(|&&i| i >= start && i < start + n)
                            .count();
                        let exact = n * share;
                        let (lo, hi) = (exact / FORWARD_SCALE, exact.div_ceil(FORWARD_SCALE));
                        assert!(
                            (lo..=hi).contains(&(k as u64)),
                            "share {share} phase {phase}: {k} of {n} from {start}"
                        );
                    }
                }
            }
        }
        assert!(!(0..100).any(|i| on_line(i, 0, 5)));
        assert!((0..100).all(|i| on_line(i, FORWARD_SCALE, 5)));
    }

    #[test]
    fn units_offsets_spread_evenly_where_hashed_ones_scatter() {
        // The units one receiver shares: 1,025 tensors × 16 source shards (ordinals as
        // `Prepared` builds them from coordinates, 8,191 apart). Every offset, scaled to 8
        // hub groups or 11, 12, 23 or 64 rounds, fills each bin within 10 units of the mean
        // (2,050 to 256 units); independent draws would miss it by about 2.5 standard
        // deviations, 113 units with 8 bins and 40 with 64.
        let units: Vec<Spread> = (0..1025u32)
            .flat_map(|t| (0..16u64).map(move |o| Spread::of(t, 7 * 8_191 * 8_191 + o * 8_191)))
            .collect();
        for which in 0..3 {
            for bins in [8u64, 11, 12, 23, 64] {
                let mut count = vec![0u64; bins as usize];
                for u in &units {
                    count[u.scaled(which, bins) as usize] += 1;
                }
                let mean = units.len() as f64 / bins as f64;
                let worst = count
                    .iter()
                    .map(|&c| (c as f64 - mean).abs())
                    .fold(0.0, f64::max);
                assert!(worst <= 10.0, "offset {which}, {bins} bins: {count:?}");
            }
        }
    }

    #[test]
    fn hub_spread_is_the_least_that_keeps_forwards_within_half_the_message_bound() {
        // DeepSeek-V3 tp32,dp8 (8 receiving nodes per shard, 12 rounds): 2·7·11 = 154.
        assert_eq!(hub_spread(8, 12), 1);
        // tp32,dp64 (64 nodes, 23 rounds): 2·63·22 = 2,772 → 2 (1,386 ≤ 2,048).
        assert_eq!(hub_spread(64, 23), 2);
        // tp32,dp256 (256 nodes, 23 rounds): 2·255·22 = 11,220 → 6.
        assert_eq!(hub_spread(256, 23), 6);
        // Exactly twice the budget: 2·64·32 = 4,096 → 2; a group more, 4,160 → 3.
        assert_eq!(hub_spread(65, 33), 2);
        assert_eq!(hub_spread(66, 33), 3);
        // At most the rounds a forwarded chunk may wait (rounds − 1) and the groups.
        assert_eq!(hub_spread(5000, 4), 3);
        assert_eq!(hub_spread(2, 1000), 1);
        assert_eq!(hub_spread(3, 2), 1);
        assert_eq!(hub_spread(1, 2), 1);
    }
}
