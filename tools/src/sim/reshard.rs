//! Simulating the real per-rank programs of a reshard.

use super::flows::{self, Flow};
use super::{Cluster, Direction, LinkKind, LinkUse, Phase, SimReport};
use ncclreshard::plan::{RankProgram, StridedCopy};
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
/// Programs with several rounds run as their stream would: a rank packs round `r`, its
/// round-`r` flows start once the peer is in round `r` too (and has packed), and it unpacks
/// once they are all done, then moves to its next round — ranks drift apart freely, and flows
/// of different rounds share links when their ranks are in different rounds.
pub fn simulate(programs: &[RankProgram], cluster: &Cluster) -> SimReport {
    let mut rounds: Vec<u32> = programs
        .iter()
        .flat_map(|p| p.round_spans.iter().map(|s| s.round))
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    if rounds.len() <= 1 {
        return simulate_round(programs, cluster);
    }
    simulate_rounds(programs, cluster, &rounds)
}

/// One (sender, receiver) pair's messages of one round: a flow.
struct PairFlow {
    round: usize,
    from: usize,
    to: usize,
    messages: u64,
}

/// The multi-round model of [`simulate`]; `labels` are every round any rank has, ascending.
fn simulate_rounds(programs: &[RankProgram], cluster: &Cluster, labels: &[u32]) -> SimReport {
    let copy_bytes = |copies: &[StridedCopy]| copies.iter().map(StridedCopy::bytes).sum::<u64>();
    let nr = labels.len();
    let mut ranks: Vec<u32> = programs
        .iter()
        .map(|p| p.rank)
        .chain(programs.iter().flat_map(|p| p.sends.iter().map(|m| m.peer)))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    let index = |rank: u32| ranks.binary_search(&rank).expect("every rank is indexed");
    let n = ranks.len();

    let mut capacity: Vec<f64> = (0..n * LINKS_PER_GPU)
        .map(|l| match LINKS[l % LINKS_PER_GPU].0 {
            LinkKind::NvLink => cluster.nvlink_bw,
            LinkKind::Nic => cluster.nic_bw,
        })
        .collect();
    // Per (rank, round): pack and unpack seconds, and the flows the rank is an end of.
    let mut pack = vec![0.0f64; n * nr];
    let mut unpack = vec![0.0f64; n * nr];
    let mut ends_of: Vec<Vec<u32>> = vec![Vec::new(); n * nr];
    let mut flows: Vec<Flow> = Vec::new();
    let mut meta: Vec<PairFlow> = Vec::new();
    let (mut bytes_total, mut bytes_offnode, mut bytes_local) = (0u64, 0u64, 0u64);
    for p in programs {
        let i = index(p.rank);
        let local = copy_bytes(&p.local_copies);
        bytes_local += local;
        pack[i * nr] += local as f64 / cluster.hbm_copy_bw;
        for round in p.rounds() {
            let k = labels
                .binary_search(&round.round)
                .expect("every round is labelled");
            pack[i * nr + k] += copy_bytes(round.packs) as f64 / cluster.hbm_copy_bw;
            unpack[i * nr + k] += copy_bytes(round.unpacks) as f64 / cluster.hbm_copy_bw;
            for run in round.sends.chunk_by(|a, b| a.peer == b.peer) {
                let (from, to) = (p.rank, run[0].peer);
                let j = index(to);
                let bytes: u64 = run.iter().map(|m| m.bytes).sum();
                bytes_total += bytes;
                if cluster.node(from) != cluster.node(to) {
                    bytes_offnode += bytes;
                }
                let f = flows.len() as u32;
                flows.push(pair_flow(cluster, (from, to), (i, j), bytes, &mut capacity));
                meta.push(PairFlow {
                    round: k,
                    from: i,
                    to: j,
                    messages: run.len() as u64,
                });
                ends_of[i * nr + k].push(f);
                if j != i {
                    ends_of[j * nr + k].push(f);
                }
            }
        }
    }

    // Each rank's progress: the round it is in, when that round's packs were done, the last
    // finish of its flows in it, and how many are still moving.
    let mut position = vec![0usize; n];
    let mut ready = vec![0.0f64; n];
    let mut last = vec![0.0f64; n];
    let mut outstanding: Vec<usize> = ends_of.iter().map(Vec::len).collect();
    let mut finished = vec![0.0f64; n];
    let mut busy = vec![0.0f64; n];
    // Enters rank i into round k at time t, passing through rounds it has no flows in, and
    // releases the flows whose other end is already there.
    let enter = |i: usize,
                 mut k: usize,
                 mut t: f64,
                 position: &mut Vec<usize>,
                 ready: &mut Vec<f64>,
                 last: &mut Vec<f64>,
                 finished: &mut Vec<f64>,
                 release: &mut Vec<(u32, f64)>| {
        while k < nr {
            position[i] = k;
            ready[i] = t + pack[i * nr + k];
            last[i] = ready[i];
            // No flow of a round can finish before both its ends entered it.
            if !ends_of[i * nr + k].is_empty() {
                for &f in &ends_of[i * nr + k] {
                    let m = &meta[f as usize];
                    let other = if m.from == i { m.to } else { m.from };
                    if other == i || position[other] == k {
                        let start =
                            ready[i].max(ready[other]) + m.messages as f64 * cluster.latency_s;
                        release.push((f, start));
                    }
                }
                return;
            }
            t = ready[i] + unpack[i * nr + k];
            k += 1;
        }
        position[i] = nr;
        finished[i] = t;
    };
    let mut initial = Vec::new();
    // Ranks not yet entered sit at an impossible position so nobody releases to them early.
    position.iter_mut().for_each(|p| *p = usize::MAX);
    for i in 0..n {
        enter(
            i,
            0,
            0.0,
            &mut position,
            &mut ready,
            &mut last,
            &mut finished,
            &mut initial,
        );
    }
    let outcome = flows::run_gated(&flows, &capacity, initial, &mut |f, t, release| {
        let m = &meta[f as usize];
        let k = m.round;
        for e in [m.from, m.to] {
            if e == m.to && m.to == m.from {
                continue;
            }
            let slot = e * nr + k;
            outstanding[slot] -= 1;
            last[e] = last[e].max(t);
            if outstanding[slot] == 0 {
                busy[e] += last[e] - ready[e];
                let done = last[e] + unpack[slot];
                enter(
                    e,
                    k + 1,
                    done,
                    &mut position,
                    &mut ready,
                    &mut last,
                    &mut finished,
                    release,
                );
            }
        }
    });
    let stuck = position.iter().any(|&k| k != nr);
    let time_s = if stuck {
        f64::INFINITY
    } else {
        finished.iter().copied().fold(0.0, f64::max)
    };

    let sum_per_rank = |v: &[f64]| -> f64 {
        (0..n)
            .map(|i| v[i * nr..(i + 1) * nr].iter().sum::<f64>())
            .fold(0.0, f64::max)
    };
    report(
        programs,
        time_s,
        (bytes_total, bytes_offnode, bytes_local),
        busiest_link(&outcome.link_bytes, &capacity, &ranks, time_s),
        [
            sum_per_rank(&pack),
            busy.iter().copied().fold(0.0, f64::max),
            sum_per_rank(&unpack),
        ],
    )
}

/// The flow of one (sender, receiver) pair (`ends`: their dense indices): the sender's egress
/// and the receiver's ingress, NVLink inside a domain and NICs between; with a peer fraction,
/// also a private link (pushed onto `capacity`) that caps this pair. Starts at 0.
fn pair_flow(
    cluster: &Cluster,
    (from, to): (u32, u32),
    (i, j): (usize, usize),
    bytes: u64,
    capacity: &mut Vec<f64>,
) -> Flow {
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
        links[2] = capacity.len() as u32;
        capacity.push(fraction * cluster.link_bw(from, to));
        nlinks = 3;
    }
    Flow {
        links,
        nlinks,
        bytes: bytes as f64,
        start: 0.0,
    }
}

/// The link with the highest busy fraction over `time_s` (ties: the lowest link id).
fn busiest_link(
    link_bytes: &[f64],
    capacity: &[f64],
    ranks: &[u32],
    time_s: f64,
) -> Option<LinkUse> {
    (0..ranks.len() * LINKS_PER_GPU)
        .filter(|&l| link_bytes[l] > 0.0)
        .map(|l| {
            let busy = if time_s > 0.0 {
                link_bytes[l] / capacity[l] / time_s
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
            bytes: link_bytes[l].round() as u64,
            busy_fraction: busy,
        })
}

/// The report of a call: times and link use as simulated, message and byte counts from the
/// programs. `bytes` is (total, off-node, local); `phases` the prepare, transfer and unpack
/// seconds.
fn report(
    programs: &[RankProgram],
    time_s: f64,
    (bytes_total, bytes_offnode, bytes_local): (u64, u64, u64),
    busiest_link: Option<LinkUse>,
    [prepare, transfer, unpack]: [f64; 3],
) -> SimReport {
    let participants = programs.iter().filter(|p| !p.is_empty()).count();
    let posted = |p: &RankProgram| (p.sends.len() + p.recvs.len()) as u64;
    let total_posted: u64 = programs.iter().map(posted).sum();
    SimReport {
        time_s,
        bytes_total,
        bytes_offnode,
        bytes_local,
        messages_total: programs.iter().map(|p| p.sends.len() as u64).sum(),
        messages_max_per_rank: programs.iter().map(posted).max().unwrap_or(0),
        messages_mean_per_rank: if participants > 0 {
            total_posted as f64 / participants as f64
        } else {
            0.0
        },
        bytes_max_per_rank: programs
            .iter()
            .map(|p| p.bytes_sent().max(p.bytes_received()))
            .max()
            .unwrap_or(0),
        busiest_link,
        phases: vec![
            Phase {
                name: "prepare",
                seconds: prepare,
            },
            Phase {
                name: "transfer",
                seconds: transfer,
            },
            Phase {
                name: "unpack",
                seconds: unpack,
            },
        ],
    }
}

/// One round (or a one-round program): local copies and packs, one group, unpacks.
fn simulate_round(programs: &[RankProgram], cluster: &Cluster) -> SimReport {
    let copy_bytes = |copies: &[StridedCopy]| copies.iter().map(StridedCopy::bytes).sum::<u64>();

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
    for p in programs {
        let local = copy_bytes(&p.local_copies);
        bytes_local += local;
        let r = index(p.rank);
        prepared[r] = (local + copy_bytes(&p.packs)) as f64 / cluster.hbm_copy_bw;
        unpack_s[r] = copy_bytes(&p.unpacks) as f64 / cluster.hbm_copy_bw;
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
        let mut flow = pair_flow(cluster, (from, to), (i, j), bytes, &mut capacity);
        flow.start = prepared[i].max(prepared[j]) + count as f64 * cluster.latency_s;
        flow_list.push(flow);
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

    report(
        programs,
        time_s,
        (bytes_total, bytes_offnode, bytes_local),
        busiest_link(&outcome.link_bytes, &capacity, &ranks, time_s),
        [
            prepared.iter().copied().fold(0.0, f64::max),
            transfer_s,
            unpack_s.iter().copied().fold(0.0, f64::max),
        ],
    )
}
