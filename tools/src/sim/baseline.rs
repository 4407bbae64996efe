//! The gather + broadcast baseline (what NeMo RL, veRL and slime do today).

use super::{Cluster, Direction, LinkKind, LinkUse, Phase, SimReport};
use ncclreshard::layout::{Side, TensorSpec};
use std::collections::{BTreeMap, BTreeSet};

/// Which ranks join the broadcast communicator besides the inference ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BroadcastGroup {
    /// Every training rank joins (current NeMo RL: the refit group spans all training and
    /// inference workers, only rank 0 sends), so the root's node drives all its NICs and the
    /// ring also passes through the other training nodes.
    AllSourceRanks,
    /// Only the root joins (older NeMo RL, veRL): the root's node has one GPU in the ring and
    /// drives one NIC.
    RootOnly,
}

/// How the baseline is run. [`BaselineParams::nemo_rl`] gives NeMo RL's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineParams {
    /// A bucket is broadcast once it holds more than this many bytes (NeMo RL:
    /// `NRL_REFIT_BUFFER_MEMORY_RATIO` (0.02) × GPU memory, at most 5 GiB).
    pub bucket_bytes: u64,
    /// Buckets in flight: gathering bucket k waits until bucket k − `buffers` has been
    /// broadcast (NeMo RL: `NRL_REFIT_NUM_BUFFERS` = 2).
    pub buffers: u32,
    /// Host-side software cost per checkpoint tensor (export, conversion, packing, the
    /// inference engine's `load_weights`), serial with the gathers. See docs/simulator.md for
    /// where the default comes from.
    pub per_tensor_s: f64,
    /// Fixed cost of launching one collective, besides the cluster's group cost and
    /// `cluster.latency_s` per ring hop between domains.
    pub launch_s: f64,
    /// The broadcasting rank; `None`: the smallest source rank (training rank 0).
    pub root: Option<u32>,
    pub group: BroadcastGroup,
}

/// NeMo RL's target bucket fraction of GPU memory (`NRL_REFIT_BUFFER_MEMORY_RATIO`).
const NEMO_RL_BUCKET_RATIO: f64 = 0.02;
/// NeMo RL's bucket cap (5 GiB).
const NEMO_RL_BUCKET_MAX: u64 = 5 << 30;
/// Per-checkpoint-tensor software cost inferred from NeMo RL's NIXL refit of DeepSeek-V3
/// (docs/simulator.md §4): (9.25 s − 1.60 s of transfers − the engine post-processing every
/// refit pays) ÷ 45,395 tensors.
pub const NEMO_RL_PER_TENSOR_S: f64 = 153e-6;

impl BaselineParams {
    /// NeMo RL's packed broadcast on `cluster`.
    pub fn nemo_rl(cluster: &Cluster) -> BaselineParams {
        BaselineParams {
            bucket_bytes: ((cluster.gpu_memory_bytes as f64 * NEMO_RL_BUCKET_RATIO) as u64)
                .min(NEMO_RL_BUCKET_MAX),
            buffers: 2,
            per_tensor_s: NEMO_RL_PER_TENSOR_S,
            launch_s: cluster.launch_s,
            root: None,
            group: BroadcastGroup::AllSourceRanks,
        }
    }
}

/// The baseline with NeMo RL's parameters ([`BaselineParams::nemo_rl`]).
pub fn gather_broadcast(tensors: &[TensorSpec], cluster: &Cluster) -> SimReport {
    gather_broadcast_with(tensors, cluster, &BaselineParams::nemo_rl(cluster))
}

/// Per-tensor costs of the gather side.
struct Gathered {
    /// Checkpoint tensors this spec stands for.
    pieces: u64,
    bytes: u64,
    /// Bandwidth seconds of the gather (PP hop + all-gather) for the whole spec.
    gather_s: f64,
    gather_bytes: u64,
    gather_offnode: u64,
}

/// The baseline, step by step as NeMo RL runs it (`packed_broadcast_producer`): tensors in
/// order, each one's checkpoint tensors (a rank ≥ 3 tensor stacks matrices along its leading
/// dims, e.g. `[experts, rows, cols]`, one checkpoint tensor each) appended to a bucket; the
/// bucket's gather is every tensor's trip to the root — a pipeline-parallel hop when the root
/// is not in the tensor's source mesh (each source rank sends its shard over its own link, as
/// Megatron-Bridge's PP broadcast does), then a ring all-gather inside the source mesh's shard
/// group — plus `per_tensor_s` per checkpoint tensor; once the bucket exceeds `bucket_bytes`
/// the root packs it into one buffer (at `cluster.hbm_copy_bw`) and broadcasts it as one NCCL
/// ring broadcast. With `buffers` buckets in flight the next bucket's gather overlaps this
/// broadcast. PP stages are serial: one root, one pass over all tensors, as in NeMo RL.
///
/// `messages_*` count collective calls (one gather per checkpoint tensor that needs one, one
/// broadcast per bucket); `bytes_total` counts every byte each ring member receives.
pub fn gather_broadcast_with(
    tensors: &[TensorSpec],
    cluster: &Cluster,
    params: &BaselineParams,
) -> SimReport {
    let root = params.root.unwrap_or_else(|| {
        tensors
            .iter()
            .filter_map(|t| t.src.mesh.sorted_ranks().next())
            .min()
            .unwrap_or(0)
    });
    let dst_ranks: BTreeSet<u32> = tensors
        .iter()
        .flat_map(|t| t.dst.mesh.ranks().iter().copied())
        .collect();
    let src_ranks: BTreeSet<u32> = tensors
        .iter()
        .flat_map(|t| t.src.mesh.ranks().iter().copied())
        .collect();
    let mut comm: BTreeSet<u32> = dst_ranks.clone();
    comm.insert(root);
    if params.group == BroadcastGroup::AllSourceRanks {
        comm.extend(src_ranks.iter().copied());
    }
    let comm: Vec<u32> = comm.into_iter().collect();
    let receivers = comm.len().saturating_sub(1) as u64;
    let bcast_bw = ring_bw(cluster, &comm);
    let comm_domains = domains(cluster, &comm).len();
    let comm_nodes: BTreeSet<u32> = comm.iter().map(|&r| cluster.node(r)).collect();
    let bcast_latency = params.launch_s + cluster.group_s + comm_domains as f64 * cluster.latency_s;
    // `torch.cat` of a bucket: contiguous copies.
    let pack_bw = cluster.contiguous_copy_bw();

    // Walk the checkpoint tensors into buckets, accumulating each bucket's gather seconds.
    let mut buckets: Vec<(f64, u64)> = Vec::new(); // (gather seconds, bytes)
    let mut open = (0.0f64, 0u64);
    let mut software_s = 0.0;
    let mut gather_bw_s = 0.0;
    let mut gather_bytes = 0u64;
    let mut gather_offnode = 0u64;
    let mut gather_calls = 0u64;
    for spec in tensors {
        let g = gathered(spec, cluster, root);
        if g.bytes == 0 {
            continue;
        }
        gather_bw_s += g.gather_s;
        gather_bytes += g.gather_bytes;
        gather_offnode += g.gather_offnode;
        if g.gather_s > 0.0 {
            gather_calls += g.pieces;
        }
        software_s += g.pieces as f64 * params.per_tensor_s;
        // Equal pieces (the last also takes the rounding remainder), added to buckets a run
        // at a time: as many as keep the bucket at or under its target, plus the one that
        // tips it over.
        let piece_bytes = g.bytes / g.pieces;
        let piece_s = g.gather_s / g.pieces as f64 + params.per_tensor_s;
        let mut left = g.pieces;
        while left > 0 {
            let room = params.bucket_bytes.saturating_sub(open.1);
            let take = (room / piece_bytes + 1).min(left);
            left -= take;
            open.0 += take as f64 * piece_s;
            open.1 += take * piece_bytes;
            if left == 0 {
                open.1 += g.bytes - piece_bytes * g.pieces;
            }
            if open.1 > params.bucket_bytes {
                buckets.push(open);
                open = (0.0, 0);
            }
        }
    }
    if open.1 > 0 {
        buckets.push(open);
    }

    // Double-buffered pipeline: gather k waits for the broadcast that last used its buffer;
    // broadcasts run one after another on the one communicator.
    let buffers = params.buffers.max(1) as usize;
    let mut bcast_end: Vec<f64> = Vec::with_capacity(buckets.len());
    let mut gather_end = 0.0f64;
    let mut broadcast_s = 0.0;
    let mut pack_s = 0.0;
    for (k, &(gather_s, bytes)) in buckets.iter().enumerate() {
        let buffer_free = if k >= buffers {
            bcast_end[k - buffers]
        } else {
            0.0
        };
        // The root packs the bucket into one buffer (`torch.cat`) before broadcasting it.
        let pack = bytes as f64 / pack_bw;
        pack_s += pack;
        gather_end = gather_end.max(buffer_free) + gather_s + pack;
        let previous = bcast_end.last().copied().unwrap_or(0.0);
        let b = bcast_latency + bytes as f64 / bcast_bw;
        broadcast_s += b;
        bcast_end.push(gather_end.max(previous) + b);
    }
    let time_s = bcast_end.last().copied().unwrap_or(0.0);

    let total_bytes: u64 = buckets.iter().map(|b| b.1).sum();
    let bcast_offnode = total_bytes * comm_nodes.len().saturating_sub(1) as u64;
    // The broadcast's bottleneck: the domain with the fewest ring GPUs, each of whose NICs
    // carries its share of every byte.
    let busiest_link = bottleneck_domain(cluster, &comm).map(|(rank, gpus)| {
        let bytes = total_bytes / gpus as u64;
        let (kind, bw) = if comm_domains > 1 {
            (LinkKind::Nic, cluster.nic_achievable())
        } else {
            (LinkKind::NvLink, cluster.nvlink_achievable())
        };
        LinkUse {
            rank,
            kind,
            direction: if rank == root {
                Direction::Egress
            } else {
                Direction::Ingress
            },
            bytes,
            busy_fraction: if time_s > 0.0 {
                bytes as f64 / bw / time_s
            } else {
                0.0
            },
        }
    });
    let calls = gather_calls + buckets.len() as u64;
    // Training ranks join every export collective and every broadcast; inference ranks only
    // the broadcasts.
    let train_in_comm = comm.iter().filter(|r| src_ranks.contains(r)).count() as u64;
    let infer_only = comm.len() as u64 - train_in_comm;
    let per_rank_sum = train_in_comm * calls + infer_only * buckets.len() as u64;
    SimReport {
        time_s,
        bytes_total: gather_bytes + total_bytes * receivers,
        bytes_offnode: gather_offnode + bcast_offnode,
        bytes_local: 0,
        messages_total: calls,
        messages_max_per_rank: calls,
        messages_mean_per_rank: if comm.is_empty() {
            0.0
        } else {
            per_rank_sum as f64 / comm.len() as f64
        },
        bytes_max_per_rank: total_bytes,
        busiest_link,
        nic_bytes: Vec::new(),
        phases: vec![
            Phase {
                name: "gather",
                seconds: gather_bw_s,
            },
            Phase {
                name: "software",
                seconds: software_s,
            },
            Phase {
                name: "pack",
                seconds: pack_s,
            },
            Phase {
                name: "broadcast",
                seconds: broadcast_s,
            },
        ],
        p90_s: time_s,
        trials: 0,
        setup_s: 0.0,
        memory: None,
        critical: None,
        rounds: None,
    }
}

/// Number of checkpoint tensors a spec stands for: the product of the leading dims of a
/// tensor with three or more dims (stacked matrices), else one.
fn checkpoint_pieces(shape: &[u64]) -> u64 {
    if shape.len() >= 3 {
        shape[..shape.len() - 2].iter().product::<u64>().max(1)
    } else {
        1
    }
}

fn gathered(spec: &TensorSpec, cluster: &Cluster, root: u32) -> Gathered {
    let elem = u64::from(spec.elem_size());
    let bytes = spec.shape.iter().product::<u64>() * elem;
    let layout = &spec.src;
    // The shard group: ranks whose replicate-axis coordinates are all 0 (one of each shard).
    let replicate = layout.replicate_axes();
    let group: Vec<u32> = layout
        .mesh
        .ranks()
        .iter()
        .enumerate()
        .filter(|&(i, _)| {
            let coord = layout.mesh.coord_at(i);
            replicate.iter().all(|&a| coord[a] == 0)
        })
        .map(|(_, &r)| r)
        .collect();
    let local = |rank: u32| -> u64 {
        spec.rank_view(Side::Src, rank)
            .map_or(0, |v| v.view.elements() * elem)
    };
    let locals: Vec<u64> = group.iter().map(|&r| local(r)).collect();
    let max_local = locals.iter().copied().max().unwrap_or(0);
    let min_local = locals.iter().copied().min().unwrap_or(0);

    let mut gather_s = 0.0;
    let mut gather_bytes = 0u64;
    let mut gather_offnode = 0u64;
    // Pipeline-parallel hop: every source rank forwards its shard toward the root's stage.
    if !layout.mesh.contains(root) {
        let from = group.first().copied().unwrap_or(root);
        let link = if cluster.same_domain(from, root) {
            cluster.nvlink_achievable()
        } else {
            cluster.nic_achievable()
        };
        gather_s += max_local as f64 / link;
        gather_bytes += bytes;
        if cluster.node(from) != cluster.node(root) {
            gather_offnode += bytes;
        }
    }
    // Ring all-gather inside the shard group.
    let need = bytes - min_local;
    if group.len() > 1 && need > 0 {
        gather_s += need as f64 / ring_bw(cluster, &group);
        gather_bytes += need * group.len() as u64;
        let nodes: BTreeSet<u32> = group.iter().map(|&r| cluster.node(r)).collect();
        if nodes.len() > 1 {
            gather_offnode += need * nodes.len() as u64;
        }
    }
    Gathered {
        pieces: checkpoint_pieces(&spec.shape),
        bytes,
        gather_s,
        gather_bytes,
        gather_offnode,
    }
}

/// GPUs of `ranks` per NVLink domain.
fn domains(cluster: &Cluster, ranks: &[u32]) -> BTreeMap<u32, u32> {
    let mut out = BTreeMap::new();
    for &r in ranks {
        *out.entry(cluster.domain(r)).or_insert(0) += 1;
    }
    out
}

/// Bus bandwidth of an NCCL ring over `ranks`: within one NVLink domain, NVLink; across
/// domains, each channel's ring enters and leaves every domain once, and the channels spread
/// over the NICs of the domain's ring GPUs, so the domain with the fewest ring GPUs bounds it.
fn ring_bw(cluster: &Cluster, ranks: &[u32]) -> f64 {
    let per_domain = domains(cluster, ranks);
    if per_domain.len() <= 1 {
        return cluster.nvlink_achievable();
    }
    let fewest = per_domain.values().copied().min().unwrap_or(1);
    (f64::from(fewest) * cluster.nic_achievable()).min(cluster.nvlink_achievable())
}

/// The ring's bottleneck domain: (its first ring rank, its ring GPUs).
fn bottleneck_domain(cluster: &Cluster, ranks: &[u32]) -> Option<(u32, u32)> {
    let per_domain = domains(cluster, ranks);
    let (&domain, &gpus) = per_domain.iter().min_by_key(|&(d, &n)| (n, *d))?;
    let first = ranks
        .iter()
        .copied()
        .find(|&r| cluster.domain(r) == domain)?;
    Some((first, gpus))
}
