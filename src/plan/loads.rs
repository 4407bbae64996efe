//! Bytes each rank moves, estimated from the tensors alone (every rank computes the same):
//! what sizes the rounds, and what tells the assignment which senders are overloaded and
//! should have part of their data forwarded between receiving nodes (docs/design.md §5).
//!
//! A destination rank receives its shard of each tensor; a source rank sends its share of what
//! every destination replica needs (the tensor's bytes × destination replicas, spread over the
//! source mesh's ranks). Sums are taken per distinct layout and then spread over that layout's
//! ranks, so the cost is tensors + ranks × layouts, never ranks × tensors.
//!
//! With a known topology the comparison of senders and receivers is per node: a node's
//! traffic leaves and enters through all its GPUs' NICs (NCCL routes a message through the
//! node-local GPU on the receiver's rail), so a node's load per GPU is what binds, not one
//! rank's.

use super::config::Topology;
use super::fxhash::{FxHashMap, FxHashSet};
use crate::layout::{Layout, TensorSpec};

/// Estimated bytes per rank, by direction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Loads {
    sends: FxHashMap<u32, u128>,
    receives: FxHashMap<u32, u128>,
    /// Per rank, the bytes its node sends across the network per participating GPU (its own
    /// sends without a topology): a destination shard's replicas on one node count once, as
    /// relays forward to node mates over NVLink.
    send_load: FxHashMap<u32, u128>,
    /// The largest bytes per participating GPU a node (or, without a topology, a rank)
    /// receives across the network, a destination shard's replicas on one node counted once
    /// (relays forward to node mates over NVLink): what the busiest receiver's NICs take in,
    /// which no plan can beat (every byte of a destination shard reaches its node at least
    /// once).
    max_receive: u128,
    /// The same counted node by node: the most bytes per participating GPU any node takes in
    /// across the network, its distinct destination shards' bytes once each. Where nodes hold
    /// a layout's ranks unevenly (a partly filled NVLink domain) this is the node that binds,
    /// which `max_receive`'s per-layout average misses.
    node_max_receive: u128,
}

/// Forwarding brings a sender's estimated network egress down to this share of the busiest
/// receiver's ingress, so that receivers, which no plan can relieve, bind rather than senders.
/// 95 %: the slack absorbs the estimate's error (it spreads a layout's bytes evenly over its
/// ranks); under the calibrated simulator DeepSeek-V3 `pp16,ep16 → tp32,dp8` on `dgx-h100`
/// takes 1.065 s at 100 %, 1.035 s at 95 %, 1.058 s at 90 %, 1.083 s at 85 % (docs/planner.md).
const FORWARD_TARGET_PERCENT: u128 = 95;

/// Forwarded fractions are in units of 1/`FORWARD_SCALE`.
pub(crate) const FORWARD_SCALE: u64 = 1024;

impl Loads {
    /// `layouts` are the plan's distinct layouts, `layout_ids` each tensor's (source,
    /// destination) indices into them.
    pub fn new(
        tensors: &[TensorSpec],
        layout_ids: &[[u32; 2]],
        layouts: &[&Layout],
        topology: &Topology,
    ) -> Loads {
        let shards: Vec<u128> = layouts.iter().map(|l| u128::from(l.shards())).collect();
        // Nodes holding one destination shard's replicas, per distinct destination layout.
        let mut replica_nodes: Vec<Option<u128>> = vec![None; layouts.len()];
        let mut replica_nodes_of = |id: u32, t: &TensorSpec| -> u128 {
            *replica_nodes[id as usize].get_or_insert_with(|| {
                let zeros: Vec<Vec<u64>> = (0..t.shape.len())
                    .map(|d| vec![0; t.dst.shard_axes(d).len()])
                    .collect();
                let coords: Vec<&[u64]> = zeros.iter().map(Vec::as_slice).collect();
                let mut nodes: Vec<u32> = t
                    .dst
                    .replicas(&coords)
                    .into_iter()
                    .map(|r| topology.node(r).unwrap_or(r))
                    .collect();
                nodes.sort_unstable();
                nodes.dedup();
                nodes.len() as u128
            })
        };
        // Per distinct layout: bytes each of its ranks sends, of which across the network,
        // bytes each receives, of which across the network.
        let mut per_layout = vec![(0u128, 0u128, 0u128, 0u128); layouts.len()];
        for (t, &[src, dst]) in tensors.iter().zip(layout_ids) {
            let bytes = u128::from(t.shape.iter().product::<u64>()) * u128::from(t.elem_size());
            let dst_ranks = t.dst.mesh.size() as u128;
            let replicas = (dst_ranks / shards[dst as usize]).max(1);
            let nodes = replica_nodes_of(dst, t).clamp(1, replicas);
            let src_ranks = (t.src.mesh.size() as u128).max(1);
            per_layout[src as usize].0 += bytes * replicas / src_ranks;
            per_layout[src as usize].1 += bytes * nodes / src_ranks;
            per_layout[dst as usize].2 += bytes / shards[dst as usize];
            per_layout[dst as usize].3 += bytes * nodes / (shards[dst as usize] * replicas);
        }
        let mut loads = Loads::default();
        let mut network_sends: FxHashMap<u32, u128> = FxHashMap::default();
        let mut network_receives: FxHashMap<u32, u128> = FxHashMap::default();
        for (layout, &(sends, network, receives, network_in)) in layouts.iter().zip(&per_layout) {
            for rank in layout.mesh.live_ranks() {
                if sends > 0 {
                    *loads.sends.entry(rank).or_default() += sends;
                    *network_sends.entry(rank).or_default() += network;
                }
                if receives > 0 {
                    *loads.receives.entry(rank).or_default() += receives;
                    *network_receives.entry(rank).or_default() += network_in;
                }
            }
        }
        // Per node: (GPUs taking part, bytes sent, bytes received).
        let mut nodes: FxHashMap<u32, (u128, u128, u128)> = FxHashMap::default();
        let node_of = |rank: u32| topology.node(rank).unwrap_or(rank);
        let ranks: Vec<u32> = {
            let mut ranks: Vec<u32> = loads
                .sends
                .keys()
                .chain(loads.receives.keys())
                .copied()
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            ranks
        };
        for &rank in &ranks {
            let entry = nodes.entry(node_of(rank)).or_default();
            entry.0 += 1;
            entry.1 += network_sends.get(&rank).copied().unwrap_or(0);
            entry.2 += network_receives.get(&rank).copied().unwrap_or(0);
        }
        loads.max_receive = nodes
            .values()
            .map(|&(gpus, _, r)| r / gpus)
            .max()
            .unwrap_or(0);
        // Per node, the bytes of the destination shards it holds, each shard once.
        let mut node_in: FxHashMap<u32, u128> = FxHashMap::default();
        let mut held: FxHashSet<(u32, u64)> = FxHashSet::default();
        for (layout, &(_, _, receives, _)) in layouts.iter().zip(&per_layout) {
            if receives == 0 {
                continue;
            }
            held.clear();
            for rank in layout.mesh.live_ranks() {
                let shard = layout.shard_number(rank).unwrap_or(0);
                if held.insert((node_of(rank), shard)) {
                    *node_in.entry(node_of(rank)).or_default() += receives;
                }
            }
        }
        loads.node_max_receive = node_in
            .iter()
            .map(|(node, &bytes)| bytes / nodes.get(node).map_or(1, |n| n.0.max(1)))
            .max()
            .unwrap_or(0);
        loads.send_load = ranks
            .iter()
            .filter(|r| loads.sends.contains_key(r))
            .map(|&rank| {
                let (gpus, sent, _) = nodes[&node_of(rank)];
                (rank, sent / gpus)
            })
            .collect();
        loads
    }

    /// The most bytes any rank moves (sent plus received).
    pub fn busiest(&self) -> u128 {
        let ranks = self.sends.keys().chain(self.receives.keys());
        ranks
            .map(|r| self.sends.get(r).unwrap_or(&0) + self.receives.get(r).unwrap_or(&0))
            .max()
            .unwrap_or(0)
    }

    /// Whether some sender's node sends more per GPU across the network than the busiest
    /// receiving node takes in, counted node by node (`node_max_receive`): then the senders,
    /// not the receivers, bind a round in which receivers take in nothing forwarded.
    pub fn senders_bind(&self) -> bool {
        self.send_load.values().any(|&s| s > self.node_max_receive)
    }

    /// Of the data a unit's `senders` send to `groups` receiving nodes (≥ 2), the fraction
    /// (in 1/[`FORWARD_SCALE`]) that should cross the network once, to one node, and be
    /// forwarded from there to the others, so that the senders' estimated egress comes down to
    /// [`FORWARD_TARGET_PERCENT`] of what the busiest receiver takes in anyway (`T`).
    /// Forwarding a fraction `f` of a sender's data cuts its sends `S` by
    /// `S · f · (groups − 1) / groups`; solving for `S' = T`:
    /// `f = (S − T) · groups / (S · (groups − 1))`. 0 when the senders are no busier than the
    /// busiest receiver: forwarding costs a round of latency and receivers' egress.
    pub fn forward_fraction(&self, senders: &[u32], groups: u64) -> u64 {
        if groups < 2 || senders.is_empty() {
            return 0;
        }

        let sends = senders
            .iter()
            .map(|s| self.send_load.get(s).copied().unwrap_or(0))
            .sum::<u128>()
            / senders.len() as u128;
        if sends <= self.max_receive {
            return 0;
        }
        let target = self.max_receive * FORWARD_TARGET_PERCENT / 100;
        let groups = u128::from(groups);
        let fraction =
            (sends - target) * groups * u128::from(FORWARD_SCALE) / (sends * (groups - 1));
        fraction.min(u128::from(FORWARD_SCALE)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Mesh, Placement};

    fn spec(shape: &[u64], src: Layout, dst: Layout) -> TensorSpec {
        TensorSpec {
            shape: shape.to_vec(),
            dtype: DType::Bfloat16,
            src,
            dst,
        }
    }

    fn layout(ranks: Vec<u32>, placements: Vec<Placement>) -> Layout {
        let n = ranks.len() as u64;
        Layout::new(Mesh::new(vec![n], ranks).unwrap(), placements)
    }

    #[test]
    fn one_sender_feeding_many_replicas_forwards_the_excess() {
        // Rank 0 holds the tensor; ranks 1..=4 each need all of it: rank 0 sends 4×, a
        // receiver takes 1×. Forwarding f of it with 4 groups: 4 − 4·f·3/4 = 0.95 → f > 1.
        let t = spec(
            &[1024],
            layout(vec![0], vec![Placement::Replicate]),
            layout(vec![1, 2, 3, 4], vec![Placement::Replicate]),
        );
        let loads = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::Unknown,
        );
        assert_eq!(loads.max_receive, 2048);
        assert_eq!(loads.sends[&0], 4 * 2048);
        assert_eq!(loads.forward_fraction(&[0], 4), FORWARD_SCALE);
        assert_eq!(loads.forward_fraction(&[0], 1), 0);
        assert_eq!(loads.busiest(), 4 * 2048);
    }

    #[test]
    fn balanced_senders_forward_nothing() {
        // Two senders, each half of the tensor once: no sender is busier than a receiver.
        let t = spec(
            &[1024],
            layout(vec![0, 1], vec![Placement::Shard(0)]),
            layout(vec![2, 3], vec![Placement::Shard(0)]),
        );
        let loads = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::Unknown,
        );
        assert_eq!(loads.forward_fraction(&[0], 2), 0);
    }

    #[test]
    fn replicas_on_one_node_count_once_in_what_receivers_take_in() {
        // Two senders on node 0 each hold half the tensor; four replicas on nodes 1 and 2, two
        // per node (relays forward to the node mate over NVLink). Each sender's node sends
        // every byte to both nodes: 2 × 2048 / 2 = 2048 per GPU; each receiving node takes in
        // 2048 across the network, 1024 per GPU (each GPU receives 2048 in all). The senders
        // are twice as busy as receivers' NICs: with 2 groups, f = (2048 − 972) · 2 · 1024 /
        // (2048 · 1) = 1076 → all of it. Counting every replica's bytes as taken in over the
        // network (2048 per GPU), nothing was forwarded.
        let t = spec(
            &[1024],
            layout(vec![0, 1], vec![Placement::Shard(0)]),
            layout(vec![2, 3, 4, 5], vec![Placement::Replicate]),
        );
        let loads = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::RanksPerNode(2),
        );
        assert_eq!(loads.receives[&2], 2048);
        assert_eq!(loads.max_receive, 1024);
        assert_eq!(loads.send_load[&0], 2048);
        assert_eq!(loads.forward_fraction(&[0, 1], 2), FORWARD_SCALE);
    }

    #[test]
    fn a_sender_somewhat_busier_forwards_part() {
        // Source: 2 ranks each hold half; destination: 3 replicas of the whole tensor.
        // Sends per source rank: 3 × 2048 / 2 = 3072; receives 2048 per rank.
        let t = spec(
            &[1024],
            layout(vec![0, 1], vec![Placement::Shard(0)]),
            layout(vec![2, 3, 4], vec![Placement::Replicate]),
        );
        let loads = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::Unknown,
        );
        // Target 95 % of 2048 = 1945: (3072 − 1945) · 3 · 1024 / (3072 · 2) = 563
        assert_eq!(loads.forward_fraction(&[0], 3), 563);
    }

    #[test]
    fn a_partly_filled_node_binds_by_its_own_gpus() {
        // Four senders on node 0 each hold a quarter of the tensor (512 bytes); two replicas
        // of four shards: node 1 holds every shard on 7 GPUs (4 · 512 / 7 = 292 per GPU), node
        // 2 one shard on its one GPU (512). The per-layout estimate spreads what a replica's
        // nodes take in over its ranks (256 per GPU) and finds the senders (512 per GPU)
        // binding; counted node by node, node 2's one GPU takes in as much as a sender sends.
        let dst = Layout::new(
            Mesh::new(vec![2, 4], (4..12).collect()).unwrap(),
            vec![Placement::Replicate, Placement::Shard(0)],
        );
        let t = spec(
            &[1024],
            layout(vec![0, 1, 2, 3], vec![Placement::Shard(0)]),
            dst,
        );
        let mut table = vec![0, 0, 0, 0];
        table.extend([1, 1, 1, 1, 1, 1, 1, 2]);
        let loads = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::NodeTable(table),
        );
        assert_eq!(loads.max_receive, 256);
        assert_eq!(loads.node_max_receive, 512);
        assert_eq!(loads.send_load[&0], 512);
        assert!(!loads.senders_bind());
        // The same replicas on two full nodes: what a node takes in per GPU is the estimate.
        let even = Loads::new(
            std::slice::from_ref(&t),
            &[[0, 1]],
            &[&t.src, &t.dst],
            &Topology::RanksPerNode(4),
        );
        assert_eq!(even.node_max_receive, 512);
    }
}
