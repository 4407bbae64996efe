//! Simulating the real per-rank programs of a reshard.

use super::flows::{self, Flow};
use super::{Cluster, Direction, LinkKind, LinkUse, Phase, SimReport};
use crate::plan::{Copy, RankProgram};
use std::collections::HashMap;

/// Links per GPU, in link-id order: NVLink egress, NVLink ingress, NIC egress, NIC ingress.
const LINKS_PER_GPU: usize = 4;
const LINKS: [(LinkKind, Direction); LINKS_PER_GPU] = [
    (LinkKind::NvLink, Direction::Egress),
    (LinkKind::NvLink, Direction::Ingress),
    (LinkKind::Nic, Direction::Egress),
    (LinkKind::Nic, Direction::Ingress),
];

/// Estimates the time of a reshard from every participating rank's program.
///
/// `programs` should hold one program per rank of the plan (ranks without one are idle). Each
/// rank first runs its local copies and packs at `cluster.hbm_copy_bw`; then its messages are
/// in flight (one NCCL group): the messages of one (sender, receiver) pair form one flow of
/// their summed bytes that starts once both ends have prepared, plus `cluster.latency_s` per
/// message; flows share each GPU's NVLink (same domain) or NIC (different domains) egress and
/// ingress max-min fairly; a rank unpacks once all its flows are done. Sends are taken as the
/// truth for what crosses the network (receives mirror them by construction).
///
/// Ranks may be any communicator ranks (sparse is fine). The cluster should pass
/// [`Cluster::validate`]: a zero bandwidth gives an infinite time, not an error.
///
/// Programs with several rounds run round after round as if every rank finished a round
/// before any starts the next (a barrier per round): conservative, since real ranks drift
/// ahead into the next round as soon as their own part is done. Phases and times add up over
/// rounds; the busiest link is judged over the whole call.
pub fn simulate(programs: &[RankProgram], cluster: &Cluster) -> SimReport {
    let mut rounds: Vec<u32> = programs
        .iter()
        .flat_map(|p| p.round_spans.iter().map(|s| s.round))
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    if rounds.len() <= 1 {
        return simulate_round(programs, cluster).0;
    }
    let mut time_s = 0.0;
    let mut phases: Vec<Phase> = Vec::new();
    let mut link_bytes: HashMap<(u32, usize), f64> = HashMap::new();
    let mut whole = SimReport {
        time_s: 0.0,
        bytes_total: 0,
        bytes_offnode: 0,
        bytes_local: 0,
        messages_total: 0,
        messages_max_per_rank: 0,
        messages_mean_per_rank: 0.0,
        bytes_max_per_rank: 0,
        busiest_link: None,
        phases: Vec::new(),
    };
    for (i, &round) in rounds.iter().enumerate() {
        let part: Vec<RankProgram> = programs
            .iter()
            .map(|p| {
                let mut sub = RankProgram {
                    rank: p.rank,
                    fingerprint: p.fingerprint,
                    ..Default::default()
                };
                if i == 0 {
                    sub.local_copies = p.local_copies.clone();
                }
                if let Some(r) = p.rounds().into_iter().find(|r| r.round == round) {
                    sub.packs = r.packs.to_vec();
                    sub.sends = r.sends.to_vec();
                    sub.recvs = r.recvs.to_vec();
                    sub.unpacks = r.unpacks.to_vec();
                }
                sub
            })
            .collect();
        let (report, links) = simulate_round(&part, cluster);
        time_s += report.time_s;
        whole.bytes_total += report.bytes_total;
        whole.bytes_offnode += report.bytes_offnode;
        whole.bytes_local += report.bytes_local;
        for phase in report.phases {
            match phases.iter_mut().find(|p| p.name == phase.name) {
                Some(p) => p.seconds += phase.seconds,
                None => phases.push(phase),
            }
        }
        for (key, bytes) in links {
            *link_bytes.entry(key).or_default() += bytes;
        }
    }
    let participants = programs.iter().filter(|p| !p.is_empty()).count();
    let posted: u64 = programs
        .iter()
        .map(|p| (p.sends.len() + p.recvs.len()) as u64)
        .sum();
    whole.time_s = time_s;
    whole.phases = phases;
    whole.messages_total = programs.iter().map(|p| p.sends.len() as u64).sum();
    whole.messages_max_per_rank = programs
        .iter()
        .map(|p| (p.sends.len() + p.recvs.len()) as u64)
        .max()
        .unwrap_or(0);
    whole.messages_mean_per_rank = if participants > 0 {
        posted as f64 / participants as f64
    } else {
        0.0
    };
    whole.bytes_max_per_rank = programs
        .iter()
        .map(|p| p.bytes_sent().max(p.bytes_received()))
        .max()
        .unwrap_or(0);
    let mut links: Vec<((u32, usize), f64)> = link_bytes.into_iter().collect();
    links.sort_unstable_by_key(|&(key, _)| key);
    whole.busiest_link = links
        .into_iter()
        .filter(|&(_, bytes)| bytes > 0.0)
        .map(|((rank, l), bytes)| {
            let capacity = match LINKS[l].0 {
                LinkKind::NvLink => cluster.nvlink_bw,
                LinkKind::Nic => cluster.nic_bw,
            };
            let busy = if time_s > 0.0 {
                bytes / capacity / time_s
            } else {
                0.0
            };
            LinkUse {
                rank,
                kind: LINKS[l].0,
                direction: LINKS[l].1,
                bytes: bytes.round() as u64,
                busy_fraction: busy,
            }
        })
        .max_by(|a, b| {
            a.busy_fraction
                .total_cmp(&b.busy_fraction)
                .then(b.rank.cmp(&a.rank))
        });
    whole
}

/// Per-GPU link bytes of a round: ((rank, link index in [`LINKS`]), bytes).
type LinkBytes = Vec<((u32, usize), f64)>;

/// One round (or a one-round program): local copies and packs, one group, unpacks.
fn simulate_round(programs: &[RankProgram], cluster: &Cluster) -> (SimReport, LinkBytes) {
    let copy_bytes = |copies: &[Copy]| copies.iter().map(Copy::bytes).sum::<u64>();

    // One flow per (sender, receiver) pair.
    let mut pairs: HashMap<(u32, u32), (u64, u64)> = HashMap::new();
    for p in programs {
        // Sends come grouped by peer: add each run of one peer's messages at once.
        for run in p.sends.chunk_by(|a, b| a.peer == b.peer) {
            let entry = pairs.entry((p.rank, run[0].peer)).or_default();
            entry.0 += run.iter().map(|m| m.bytes).sum::<u64>();
            entry.1 += run.len() as u64;
        }
    }
    let mut pairs: Vec<((u32, u32), (u64, u64))> = pairs.into_iter().collect();
    pairs.sort_unstable_by_key(|&(pair, _)| pair);

    // Ranks may be sparse (any communicator rank): index the ones that appear densely.
    let mut ranks: Vec<u32> = programs
        .iter()
        .map(|p| p.rank)
        .chain(pairs.iter().flat_map(|&((from, to), _)| [from, to]))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    let index = |rank: u32| ranks.binary_search(&rank).expect("every rank is indexed");

    // Phase 1 per rank: local copies and packs.
    let mut prepared = vec![0.0f64; ranks.len()];
    let mut unpack_s = vec![0.0f64; ranks.len()];
    let mut bytes_local = 0u64;
    let mut messages_total = 0u64;
    let mut messages_max = 0u64;
    let mut bytes_max = 0u64;
    for p in programs {
        let local = copy_bytes(&p.local_copies);
        bytes_local += local;
        let r = index(p.rank);
        prepared[r] = (local + copy_bytes(&p.packs)) as f64 / cluster.hbm_copy_bw;
        unpack_s[r] = copy_bytes(&p.unpacks) as f64 / cluster.hbm_copy_bw;
        messages_total += p.sends.len() as u64;
        messages_max = messages_max.max((p.sends.len() + p.recvs.len()) as u64);
        bytes_max = bytes_max.max(p.bytes_sent().max(p.bytes_received()));
    }

    let gpu_links = ranks.len() * LINKS_PER_GPU;
    let mut capacity: Vec<f64> = (0..gpu_links)
        .map(|l| match LINKS[l % LINKS_PER_GPU].0 {
            LinkKind::NvLink => cluster.nvlink_bw,
            LinkKind::Nic => cluster.nic_bw,
        })
        .collect();
    let mut bytes_total = 0u64;
    let mut bytes_offnode = 0u64;
    let mut flow_list = Vec::with_capacity(pairs.len());
    let mut ends = Vec::with_capacity(pairs.len());
    for &((from, to), (bytes, count)) in &pairs {
        bytes_total += bytes;
        if cluster.node(from) != cluster.node(to) {
            bytes_offnode += bytes;
        }
        let (i, j) = (index(from), index(to));
        ends.push((i, j));
        let (out, inn) = if cluster.same_domain(from, to) {
            (0, 1)
        } else {
            (2, 3)
        };
        let mut links = [
            (i * LINKS_PER_GPU + out) as u32,
            (j * LINKS_PER_GPU + inn) as u32,
            0,
        ];
        let mut nlinks = 2;
        if let Some(fraction) = cluster.peer_fraction {
            // A private link caps this pair's flow.
            links[2] = capacity.len() as u32;
            capacity.push(fraction * cluster.link_bw(from, to));
            nlinks = 3;
        }
        flow_list.push(Flow {
            links,
            nlinks,
            bytes: bytes as f64,
            start: prepared[i].max(prepared[j]) + count as f64 * cluster.latency_s,
        });
    }

    let outcome = flows::run(&flow_list, &capacity);

    // A rank leaves its group when all its flows are done, then unpacks.
    let mut group_end = prepared.clone();
    for (&(i, j), &done) in ends.iter().zip(&outcome.finish) {
        group_end[i] = group_end[i].max(done);
        group_end[j] = group_end[j].max(done);
    }
    let mut time_s = 0.0f64;
    let mut transfer_s = 0.0f64;
    for r in 0..ranks.len() {
        time_s = time_s.max(group_end[r] + unpack_s[r]);
        transfer_s = transfer_s.max(group_end[r] - prepared[r]);
    }

    let busiest_link = (0..gpu_links)
        .filter(|&l| outcome.link_bytes[l] > 0.0)
        .map(|l| {
            let busy = if time_s > 0.0 {
                outcome.link_bytes[l] / capacity[l] / time_s
            } else {
                0.0
            };
            (l, busy)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
        .map(|(l, busy)| LinkUse {
            rank: ranks[l / LINKS_PER_GPU],
            kind: LINKS[l % LINKS_PER_GPU].0,
            direction: LINKS[l % LINKS_PER_GPU].1,
            bytes: outcome.link_bytes[l].round() as u64,
            busy_fraction: busy,
        });

    let participants = programs.iter().filter(|p| !p.is_empty()).count();
    let posted: u64 = programs
        .iter()
        .map(|p| (p.sends.len() + p.recvs.len()) as u64)
        .sum();
    let links: LinkBytes = (0..gpu_links)
        .filter(|&l| outcome.link_bytes[l] > 0.0)
        .map(|l| {
            (
                (ranks[l / LINKS_PER_GPU], l % LINKS_PER_GPU),
                outcome.link_bytes[l],
            )
        })
        .collect();
    let report = SimReport {
        time_s,
        bytes_total,
        bytes_offnode,
        bytes_local,
        messages_total,
        messages_max_per_rank: messages_max,
        messages_mean_per_rank: if participants > 0 {
            posted as f64 / participants as f64
        } else {
            0.0
        },
        bytes_max_per_rank: bytes_max,
        busiest_link,
        phases: vec![
            Phase {
                name: "prepare",
                seconds: prepared.iter().copied().fold(0.0, f64::max),
            },
            Phase {
                name: "transfer",
                seconds: transfer_s,
            },
            Phase {
                name: "unpack",
                seconds: unpack_s.iter().copied().fold(0.0, f64::max),
            },
        ],
    };
    (report, links)
}
