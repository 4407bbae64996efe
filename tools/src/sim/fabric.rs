//! Links and routes: the GPUs' NVLink and NIC ports, the leaf switches of a rail-optimised
//! fabric, and the path a point-to-point flow takes through them (PXN or not).

use super::flows::{Flow, MAX_LINKS};
use super::{Cluster, Direction, LinkKind, LinkUse, RoundLoad, RoundsProfile};
use std::collections::{BTreeMap, HashMap};

/// GPU ports per GPU, in link-id order: NVLink egress, NVLink ingress, NIC egress, NIC ingress.
const PORTS: [(LinkKind, Direction); 4] = [
    (LinkKind::NvLink, Direction::Egress),
    (LinkKind::NvLink, Direction::Ingress),
    (LinkKind::Nic, Direction::Egress),
    (LinkKind::Nic, Direction::Ingress),
];

/// What a link id stands for.
#[derive(Clone, Copy, Debug)]
enum Link {
    Gpu {
        rank: u32,
        port: u8,
    },
    /// The uplinks (`up`) or the downlinks from the spine of one rail's leaf in one
    /// scalable unit.
    Leaf,
}

/// The links flows of one simulation use, created as routes need them, with their capacity
/// (achievable bytes per second).
pub(crate) struct Network<'a> {
    pub cluster: &'a Cluster,
    gpus: HashMap<u32, u32>,
    leaves: HashMap<(u32, u32, bool), u32>,
    links: Vec<Link>,
    pub capacity: Vec<f64>,
    /// Bandwidth one network pair may use (NCCL's channels per peer); infinite: no cap.
    pub peer_cap: f64,
    /// Route cross-rail messages through PXN (NCCL's point-to-point does when the cluster
    /// says so; M2N's device-initiated puts leave through the GPU's own NIC).
    pub pxn: bool,
}

impl<'a> Network<'a> {
    /// A network on `cluster` whose network pairs are capped at `peer_cap` bytes per second,
    /// routing with PXN when `cluster.pxn` says so.
    pub fn new(cluster: &'a Cluster, peer_cap: f64) -> Network<'a> {
        Network {
            pxn: cluster.pxn,
            cluster,
            gpus: HashMap::new(),
            leaves: HashMap::new(),
            links: Vec::new(),
            capacity: Vec::new(),
            peer_cap,
        }
    }

    fn push(&mut self, link: Link, capacity: f64) -> u32 {
        self.links.push(link);
        self.capacity.push(capacity);
        (self.links.len() - 1) as u32
    }

    /// The id of one of `rank`'s ports.
    pub fn port(&mut self, rank: u32, kind: LinkKind, direction: Direction) -> u32 {
        let first = match self.gpus.get(&rank) {
            Some(&first) => first,
            None => {
                let first = self.links.len() as u32;
                for (port, &(kind, _)) in PORTS.iter().enumerate() {
                    let bw = match kind {
                        LinkKind::NvLink => self.cluster.nvlink_achievable(),
                        LinkKind::Nic => self.cluster.nic_achievable(),
                    };
                    self.push(
                        Link::Gpu {
                            rank,
                            port: port as u8,
                        },
                        bw,
                    );
                }
                self.gpus.insert(rank, first);
                first
            }
        };
        let offset = PORTS
            .iter()
            .position(|&p| p == (kind, direction))
            .expect("every port is listed");
        first + offset as u32
    }

    fn leaf(&mut self, group: u32, rail: u32, up: bool) -> u32 {
        if let Some(&id) = self.leaves.get(&(group, rail, up)) {
            return id;
        }
        let id = self.push(Link::Leaf, self.cluster.leaf_uplink_bw());
        self.leaves.insert((group, rail, up), id);
        id
    }

    /// The route of `bytes` from GPU `from` to GPU `to`: NVLink inside a domain; between
    /// domains the sender's NIC (or with PXN, NVLink to the node-local GPU on the receiver's
    /// rail and that GPU's NIC), the receiver's NIC, the leaf uplink and spine downlink when
    /// the path leaves a leaf (another scalable unit, or another rail without PXN); a network
    /// flow is capped at `peer_cap` (flows::run_gated's cap).
    pub fn route(&mut self, from: u32, to: u32, bytes: f64) -> Flow {
        let c = self.cluster;
        let mut links = [0u32; MAX_LINKS];
        let mut n = 0;
        let mut add = |links: &mut [u32; MAX_LINKS], id: u32| {
            links[n] = id;
            n += 1;
        };
        if c.same_domain(from, to) {
            add(
                &mut links,
                self.port(from, LinkKind::NvLink, Direction::Egress),
            );
            add(
                &mut links,
                self.port(to, LinkKind::NvLink, Direction::Ingress),
            );
        } else {
            let (rail_from, rail_to) = (c.rail(from), c.rail(to));
            let proxy = c.node(from) * c.gpus_per_node + rail_to;
            let via_proxy = self.pxn && rail_from != rail_to && c.same_domain(from, proxy);
            let leaving_rail = if via_proxy {
                add(
                    &mut links,
                    self.port(from, LinkKind::NvLink, Direction::Egress),
                );
                add(
                    &mut links,
                    self.port(proxy, LinkKind::Nic, Direction::Egress),
                );
                rail_to
            } else {
                add(
                    &mut links,
                    self.port(from, LinkKind::Nic, Direction::Egress),
                );
                rail_from
            };
            add(&mut links, self.port(to, LinkKind::Nic, Direction::Ingress));
            // A non-blocking leaf never binds: its uplinks carry no more than its ports do.
            let (group_from, group_to) = (c.leaf_group(from), c.leaf_group(to));
            if c.oversubscription > 1.0 && (group_from != group_to || leaving_rail != rail_to) {
                add(&mut links, self.leaf(group_from, leaving_rail, true));
                add(&mut links, self.leaf(group_to, rail_to, false));
            }
        }
        Flow {
            links,
            nlinks: n as u8,
            capped: !c.same_domain(from, to) && self.peer_cap.is_finite(),
            bytes,
        }
    }

    /// Bytes through each GPU's NIC, (rank, egress, ingress), for ranks whose NIC carried any,
    /// by rank.
    pub fn nic_bytes(&self, link_bytes: &[f64]) -> Vec<(u32, u64, u64)> {
        let mut out: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for (link, &bytes) in self.links.iter().zip(link_bytes) {
            let Link::Gpu { rank, port } = *link else {
                continue;
            };
            let (kind, direction) = PORTS[port as usize];
            if kind != LinkKind::Nic || bytes <= 0.0 {
                continue;
            }
            let (egress, ingress) = out.entry(rank).or_default();
            let ends = if direction == Direction::Egress {
                egress
            } else {
                ingress
            };
            *ends += bytes.round() as u64;
        }
        out.into_iter().map(|(r, (e, i))| (r, e, i)).collect()
    }

    /// Per round, the GPU link whose bytes of that round take longest at achievable speed,
    /// and the longest any GPU link takes for all its bytes: `flows` with the index (into
    /// `labels`, the rounds' numbers) of the round each moves in.
    pub fn rounds_profile<'f>(
        &self,
        flows: impl Iterator<Item = (&'f Flow, usize)>,
        labels: &[u32],
    ) -> RoundsProfile {
        let links = self.links.len();
        let mut bytes = vec![0.0f64; labels.len() * links];
        for (flow, round) in flows {
            for &l in &flow.links[..usize::from(flow.nlinks)] {
                bytes[round * links + l as usize] += flow.bytes;
            }
        }
        let gpu = |l: usize| match self.links[l] {
            Link::Gpu { rank, port } => Some((rank, port)),
            Link::Leaf => None,
        };
        let rounds = (0..labels.len())
            .filter_map(|k| {
                let of_round = &bytes[k * links..(k + 1) * links];
                (0..links)
                    .filter(|&l| of_round[l] > 0.0)
                    .filter_map(|l| gpu(l).map(|g| (l, g, of_round[l] / self.capacity[l])))
                    .max_by(|a, b| a.2.total_cmp(&b.2).then(b.0.cmp(&a.0)))
                    .map(|(l, (rank, port), seconds)| RoundLoad {
                        round: labels[k],
                        rank,
                        kind: PORTS[port as usize].0,
                        direction: PORTS[port as usize].1,
                        bytes: of_round[l].round() as u64,
                        seconds,
                    })
            })
            .collect();
        let busiest_total_s = (0..links)
            .filter(|&l| gpu(l).is_some())
            .map(|l| {
                (0..labels.len()).map(|k| bytes[k * links + l]).sum::<f64>() / self.capacity[l]
            })
            .fold(0.0, f64::max);
        RoundsProfile {
            rounds,
            busiest_total_s,
        }
    }

    /// The GPU port with the highest busy fraction over `time_s` (ties: the lowest id).
    pub fn busiest_port(&self, link_bytes: &[f64], time_s: f64) -> Option<LinkUse> {
        (0..self.links.len())
            .filter_map(|l| match self.links[l] {
                Link::Gpu { rank, port } if link_bytes[l] > 0.0 => {
                    let busy = if time_s > 0.0 && time_s.is_finite() {
                        link_bytes[l] / self.capacity[l] / time_s
                    } else {
                        0.0
                    };
                    Some((l, rank, port, busy))
                }
                _ => None,
            })
            .max_by(|a, b| a.3.total_cmp(&b.3).then(b.0.cmp(&a.0)))
            .map(|(l, rank, port, busy)| LinkUse {
                rank,
                kind: PORTS[port as usize].0,
                direction: PORTS[port as usize].1,
                bytes: link_bytes[l].round() as u64,
                busy_fraction: busy,
            })
    }
}
