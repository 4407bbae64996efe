//! NCCL M2N's reshard (NVIDIA/nccl-extensions, `nccl_m2n`), modelled from its published source
//! on the same cluster model as our own reshard: one call per tensor, direct or hierarchical.
//!
//! What is modelled (docs/simulator.md §3), in M2N's terms:
//!
//! - **Meshes.** Each side of a tensor is a `[replicas, shards]` mesh over a contiguous rank
//!   range with at most one sharded tensor dim, shards even (M2N's preconditions); a tensor
//!   that does not fit, or has more than 3 dims, is skipped (as `reshard_model_bench` skips
//!   it) and counted.
//! - **Load balance** (`reshard_loadbalance.cc`): `Uniform` splits the destination replicas
//!   over the source replicas by count; `NodeAware` gives each source replica the replicas of
//!   whole destination NVLink domains.
//! - **Direct** (`prepareDirectReshardParams`): every source rank sends each destination rank
//!   of its replicas the overlap of their shards.
//! - **Hierarchical** (`prepareReshardParams`): for each destination shard, the source shards
//!   overlapping it are split into contiguous slots over the shard's replicas on the first
//!   destination domain of the range (leaders); each source sends its overlap once, to its
//!   slot's leader; every leader fans its bytes out to the shard's other replicas on its
//!   domain over NVLink and forwards them over the network to the leader of the same slot on
//!   the next domain of the range (a ring across domains), which does the same; a domain
//!   with fewer replicas collapses the slots it lacks onto its last one. All of it is
//!   pipelined in chunks, so the flows of one call run together, plus one chunk's latency
//!   per ring hop.
//! - **Calls.** Every rank of the communicator calls and plans every call anew
//!   (`call_s` of host time each, serial per rank); a call's transfer starts once every
//!   member has called (the kernel opens with a world barrier) and the previous call on its
//!   stream is done. With the PACK copy transport each sender packs what it sends and each
//!   receiver unpacks what it receives around the transfer.

use super::bound::overlaps;
use super::fabric::Network;
use super::flows::{self, Flow, MAX_LINKS};
use super::{Cluster, Direction, LinkKind, Phase, SimReport};
use ncclreshard::layout::{Layout, TensorSpec};
use std::collections::{BTreeMap, HashMap};

/// M2N's two algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum M2nAlgorithm {
    /// Point-to-point from every source to every destination rank it serves.
    Direct,
    /// Injection into the first destination domain, NVLink fan-out, a ring across domains.
    Hierarchical,
}

/// `NCCL_RESHARD_LB_MODE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadBalance {
    Uniform,
    NodeAware,
}

/// How the calls of a refit are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// One communicator over every rank; one call per tensor, in tensor order, one after
    /// another (how NeMo RL's `nccl_reshard` refit calls it).
    OneCommunicator,
    /// `reshard_model_bench`: one communicator and stream per (training stage, inference
    /// stage) pair; tensors grouped into patterns (the name with its layer index removed) run
    /// one pattern at a time, calls posted in name order, calls on different communicators
    /// overlapping.
    ModelBench,
}

/// Host cost of one M2N call on every rank of its communicator (planning, descriptor
/// uploads, launches; serial per rank). Not published: set from one measurement,
/// `reshard_model_bench` hierarchical on DeepSeek-V3 (docs/simulator.md §3), and checked
/// against the other M2N rows of `ncclreshard calibrate`.
pub const M2N_CALL_S: f64 = 0.66e-3;

/// M2N's pipeline chunk (`CHUNK_SIZE_BYTES`): one chunk's latency per ring hop.
const CHUNK_BYTES: f64 = 256.0 * 1024.0;

/// How M2N runs.
#[derive(Clone, Debug, PartialEq)]
pub struct M2nParams {
    pub algorithm: M2nAlgorithm,
    pub load_balance: LoadBalance,
    /// Host seconds per call on every member rank ([`M2N_CALL_S`]).
    pub call_s: f64,
    /// The PACK copy transport (the library's default): pack before and unpack after each
    /// transfer.
    pub pack: bool,
}

impl M2nParams {
    /// The hierarchical algorithm with node-aware load balance, as NVIDIA measured it
    /// (`--algorithm ring --lb-mode node`).
    pub fn hierarchical() -> M2nParams {
        M2nParams {
            algorithm: M2nAlgorithm::Hierarchical,
            load_balance: LoadBalance::NodeAware,
            call_s: M2N_CALL_S,
            pack: false,
        }
    }

    /// The direct algorithm with uniform load balance (`--algorithm direct --lb-mode
    /// uniform`).
    pub fn direct() -> M2nParams {
        M2nParams {
            algorithm: M2nAlgorithm::Direct,
            load_balance: LoadBalance::Uniform,
            call_s: M2N_CALL_S,
            pack: false,
        }
    }
}

/// The estimate of an M2N refit.
#[derive(Clone, Debug, PartialEq)]
pub struct M2nReport {
    pub sim: SimReport,
    /// Calls made (tensors M2N could move).
    pub calls: u64,
    /// Tensors M2N cannot move (left out of the estimate, as its benchmark leaves them out),
    /// by index into the input, and why the first cannot.
    pub skipped: Vec<usize>,
    pub first_skipped: Option<String>,
}

impl M2nReport {
    /// The time when M2N can move every tensor; `None` when it cannot run the whole refit.
    pub fn complete_time(&self) -> Option<f64> {
        self.skipped.is_empty().then_some(self.sim.time_s)
    }
}

/// One side of a tensor as M2N sees it.
#[derive(Clone, Debug)]
struct Side2 {
    reps: usize,
    shards: usize,
    /// `ranks[rep * shards + shard]`.
    ranks: Vec<u32>,
}

impl Side2 {
    fn rank(&self, shard: usize, rep: usize) -> u32 {
        self.ranks[rep * self.shards + shard]
    }
}

/// One tensor as M2N sees it: both sides and the bytes of every (source shard, destination
/// shard) overlap.
#[derive(Clone, Debug)]
struct Tensor2 {
    src: Side2,
    dst: Side2,
    /// `(source shard, destination shard) → bytes`, non-zero only.
    overlap: BTreeMap<(usize, usize), u64>,
}

/// The `[replicas, shards]` view of one side, or why M2N cannot take it.
fn side(layout: &Layout, shape: &[u64]) -> Result<Side2, String> {
    let mesh = &layout.mesh;
    let dims = mesh.shape();
    let axes: Vec<usize> = (0..dims.len())
        .filter(|&a| dims[a] > 1 && layout.placements[a].dim().is_some())
        .collect();
    if axes.len() > 1 {
        return Err("more than one sharded mesh axis".to_string());
    }
    let shards = axes.first().map_or(1, |&a| dims[a] as usize);
    if let Some(&a) = axes.first() {
        let placement = layout.placements[a];
        let dim = placement.dim().expect("a sharding axis");
        if !matches!(placement, ncclreshard::Placement::Shard(_)) {
            return Err("a strided shard".to_string());
        }
        if shape[dim] % shards as u64 != 0 {
            return Err(format!(
                "dim {dim} ({}) is uneven over {shards}",
                shape[dim]
            ));
        }
    }
    let size = mesh.size();
    let reps = size / shards;
    let mut ranks = vec![0u32; size];
    for i in 0..size {
        let coord = mesh.coord_at(i);
        let shard = axes.first().map_or(0, |&a| coord[a] as usize);
        let rep = (0..dims.len())
            .filter(|a| !axes.contains(a))
            .fold(0usize, |acc, a| acc * dims[a] as usize + coord[a] as usize);
        ranks[rep * shards + shard] = mesh.ranks()[i];
    }
    if ranks
        .iter()
        .enumerate()
        .any(|(k, &r)| u64::from(r) != u64::from(ranks[0]) + k as u64)
    {
        return Err("not a contiguous rank range in (replica, shard) order".to_string());
    }
    Ok(Side2 {
        reps,
        shards,
        ranks,
    })
}

fn tensor2(spec: &TensorSpec) -> Result<Tensor2, String> {
    if spec.shape.len() > 3 {
        return Err(format!("{} dims (M2N takes at most 3)", spec.shape.len()));
    }
    let src = side(&spec.src, &spec.shape).map_err(|e| format!("source: {e}"))?;
    let dst = side(&spec.dst, &spec.shape).map_err(|e| format!("destination: {e}"))?;
    let shard_of = |s: &Side2, rank: u32| ((rank - s.ranks[0]) as usize) % s.shards;
    let mut overlap = BTreeMap::new();
    overlaps(
        spec,
        u64::from(spec.elem_size()),
        |bytes, holders, consumers| {
            if bytes > 0 {
                let key = (shard_of(&src, holders[0]), shard_of(&dst, consumers[0]));
                *overlap.entry(key).or_insert(0) += bytes;
            }
        },
    );
    Ok(Tensor2 { src, dst, overlap })
}

/// Splits `items` into `parts` contiguous blocks, the first `items % parts` one longer (M2N's
/// way of sharing replicas, domains and sources): the range of block `i`.
fn block(i: usize, items: usize, parts: usize) -> std::ops::Range<usize> {
    let (per, extra) = (items / parts, items % parts);
    let start = i * per + i.min(extra);
    start..start + per + usize::from(i < extra)
}

/// The block of [`block`] that holds item `p`.
fn block_of(p: usize, items: usize, parts: usize) -> usize {
    let (per, extra) = (items / parts, items % parts);
    let threshold = extra * (per + 1);
    if p < threshold {
        p / (per + 1)
    } else {
        extra + (p - threshold) / per.max(1)
    }
}

/// The destination replicas source replica `i` serves (`getTargetRepRange`).
fn target_reps(
    lb: LoadBalance,
    t: &Tensor2,
    cluster: &Cluster,
    i: usize,
) -> std::ops::Range<usize> {
    let (s, d) = (t.src.reps, t.dst.reps);
    match lb {
        // More sources than destinations: the sources form `d` blocks and each block's first
        // sends; otherwise the destinations form `s` blocks.
        LoadBalance::Uniform if s > d => {
            let rep = block_of(i, s, d);
            if block(rep, s, d).start == i {
                rep..rep + 1
            } else {
                0..0
            }
        }
        LoadBalance::Uniform => block(i, d, s),
        LoadBalance::NodeAware => {
            let node = |rep: usize| cluster.domain(t.dst.rank(0, rep));
            let (first, last) = (node(0), node(d - 1));
            let nodes = (last - first + 1) as usize;
            let mine = if s >= nodes {
                if i >= nodes {
                    return 0..0;
                }
                i..i + 1
            } else {
                block(i, nodes, s)
            };
            let on = |rep: usize| mine.contains(&((node(rep) - first) as usize));
            let start = (0..d).find(|&r| on(r)).unwrap_or(d);
            let end = (start..d).find(|&r| !on(r)).unwrap_or(d);
            start..end
        }
    }
}

/// What one call moves: network or NVLink pairs with their bytes, NVLink fan-out per
/// forwarding rank, the ring's hop count, and per-rank bytes sent and received (for PACK).
#[derive(Default)]
struct CallPlan {
    pairs: HashMap<(u32, u32), f64>,
    fanout: HashMap<u32, f64>,
    hops: usize,
    sent: HashMap<u32, f64>,
    received: HashMap<u32, f64>,
}

impl CallPlan {
    fn send(&mut self, from: u32, to: u32, bytes: f64) {
        *self.pairs.entry((from, to)).or_default() += bytes;
        *self.sent.entry(from).or_default() += bytes;
        *self.received.entry(to).or_default() += bytes;
    }
}

/// M2N's plan limits (`reshard_limits.h`, checked by `validateReshardPlanLimits`): at most 16
/// source shards per destination shard and 64 destination shards per source shard
/// (hierarchical); at most 32 sources per destination shard and 64 (destination shard,
/// replica) targets per source rank (direct).
const MAX_SOURCES: usize = 16;
const MAX_TARGETS: usize = 64;
const MAX_DIRECT_SOURCES: usize = 32;
const MAX_DIRECT_TARGETS: usize = 64;

/// What one call of `t` moves, or which of M2N's limits refuses it.
fn call_plan(t: &Tensor2, cluster: &Cluster, params: &M2nParams) -> Result<CallPlan, String> {
    let mut plan = CallPlan::default();
    // Source shards overlapping each destination shard, ascending.
    let mut sources: Vec<Vec<(usize, u64)>> = vec![Vec::new(); t.dst.shards];
    let mut targets = vec![0usize; t.src.shards];
    for (&(s, d), &bytes) in &t.overlap {
        sources[d].push((s, bytes));
        targets[s] += 1;
    }
    let most_sources = sources.iter().map(Vec::len).max().unwrap_or(0);
    let most_targets = targets.iter().copied().max().unwrap_or(0);
    match params.algorithm {
        M2nAlgorithm::Hierarchical if most_sources > MAX_SOURCES => {
            return Err(format!(
                "{most_sources} source shards feed one destination shard (M2N allows {MAX_SOURCES})"
            ))
        }
        M2nAlgorithm::Hierarchical if most_targets > MAX_TARGETS => {
            return Err(format!(
                "one source shard feeds {most_targets} destination shards (M2N allows {MAX_TARGETS})"
            ))
        }
        M2nAlgorithm::Direct if most_sources > MAX_DIRECT_SOURCES => {
            return Err(format!(
                "{most_sources} source shards feed one destination shard (direct M2N allows {MAX_DIRECT_SOURCES})"
            ))
        }
        M2nAlgorithm::Direct => {
            let reps = (0..t.src.reps)
                .map(|i| target_reps(params.load_balance, t, cluster, i).len())
                .max()
                .unwrap_or(0);
            if most_targets * reps > MAX_DIRECT_TARGETS {
                return Err(format!(
                    "a source rank feeds {} targets (direct M2N allows {MAX_DIRECT_TARGETS})",
                    most_targets * reps
                ));
            }
        }
        M2nAlgorithm::Hierarchical => {}
    }
    for i in 0..t.src.reps {
        let range = target_reps(params.load_balance, t, cluster, i);
        if range.is_empty() {
            continue;
        }
        for (d, list) in sources.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            match params.algorithm {
                M2nAlgorithm::Direct => {
                    for r in range.clone() {
                        for &(s, bytes) in list {
                            plan.send(t.src.rank(s, i), t.dst.rank(d, r), bytes as f64);
                        }
                    }
                }
                M2nAlgorithm::Hierarchical => {
                    hierarchical(&mut plan, t, cluster, i, d, range.clone(), list);
                }
            }
        }
    }
    Ok(plan)
}

/// The hierarchical flows of destination shard `d` from source replica `i` over its
/// replicas `range`.
fn hierarchical(
    plan: &mut CallPlan,
    t: &Tensor2,
    cluster: &Cluster,
    i: usize,
    d: usize,
    range: std::ops::Range<usize>,
    list: &[(usize, u64)],
) {
    // The shard's replicas in the range, grouped by NVLink domain in ring order.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut last_domain = None;
    for rep in range {
        let domain = cluster.domain(t.dst.rank(d, rep));
        if last_domain != Some(domain) {
            groups.push(Vec::new());
            last_domain = Some(domain);
        }
        groups.last_mut().expect("just pushed").push(rep);
    }
    let slots = groups[0].len();
    let mut slot_bytes = vec![0.0f64; slots];
    for (p, &(s, bytes)) in list.iter().enumerate() {
        // Contiguous blocks of sources per slot.
        let slot = block_of(p, list.len(), slots).min(slots - 1);
        slot_bytes[slot] += bytes as f64;
        plan.send(
            t.src.rank(s, i),
            t.dst.rank(d, groups[0][slot]),
            bytes as f64,
        );
    }
    let mut active = slots;
    let mut holders: Vec<u32> = Vec::new();
    for (k, group) in groups.iter().enumerate() {
        active = active.min(group.len());
        let now: Vec<u32> = (0..slots)
            .map(|slot| t.dst.rank(d, group[slot.min(active - 1)]))
            .collect();
        if k > 0 {
            for slot in 0..slots {
                if slot_bytes[slot] > 0.0 {
                    plan.send(holders[slot], now[slot], slot_bytes[slot]);
                }
            }
        }
        for slot in 0..slots {
            *plan.fanout.entry(now[slot]).or_default() +=
                slot_bytes[slot] * (group.len() - 1) as f64;
        }
        holders = now;
    }
    plan.hops = plan.hops.max(groups.len() - 1);
}

/// One call ready to run: its stream, when every member has called, its flows' pairs and
/// its fixed costs before (pack) and after (unpack, ring pipeline) the transfer.
struct Call {
    stream: usize,
    issue: f64,
    pre: f64,
    post: f64,
    plan: std::rc::Rc<CallPlan>,
}

/// Runs calls (each stream's in order) over one network; returns the time every call is
/// done, from 0, and adds what crossed each link to `link_bytes`.
fn run_calls(calls: &[Call], network: &mut Network<'_>, link_bytes: &mut Vec<f64>) -> f64 {
    let mut flows: Vec<Flow> = Vec::new();
    let mut call_of: Vec<u32> = Vec::new();
    let mut first_flow: Vec<usize> = Vec::with_capacity(calls.len() + 1);
    for (c, call) in calls.iter().enumerate() {
        first_flow.push(flows.len());
        // A zero-byte marker, so a call with no data still completes.
        flows.push(Flow {
            links: [0; MAX_LINKS],
            nlinks: 0,
            capped: false,
            bytes: 0.0,
        });
        call_of.push(c as u32);
        let mut pairs: Vec<(&(u32, u32), &f64)> = call.plan.pairs.iter().collect();
        pairs.sort_unstable_by_key(|(k, _)| **k);
        for (&(from, to), &bytes) in pairs {
            flows.push(network.route(from, to, bytes));
            call_of.push(c as u32);
        }
        let mut fanout: Vec<(&u32, &f64)> = call.plan.fanout.iter().collect();
        fanout.sort_unstable_by_key(|(k, _)| **k);
        for (&rank, &bytes) in fanout {
            if bytes > 0.0 {
                let mut links = [0; MAX_LINKS];
                links[0] = network.port(rank, LinkKind::NvLink, Direction::Egress);
                flows.push(Flow {
                    links,
                    nlinks: 1,
                    capped: false,
                    bytes,
                });
                call_of.push(c as u32);
            }
        }
    }
    first_flow.push(flows.len());
    let streams = calls.iter().map(|c| c.stream + 1).max().unwrap_or(0);
    let mut queue: Vec<Vec<usize>> = vec![Vec::new(); streams];
    for (c, call) in calls.iter().enumerate() {
        queue[call.stream].push(c);
    }
    let mut next = vec![0usize; streams];
    let mut outstanding: Vec<usize> = (0..calls.len())
        .map(|c| first_flow[c + 1] - first_flow[c])
        .collect();
    let mut done = vec![0.0f64; calls.len()];
    let release = |c: usize, after: f64, out: &mut Vec<(u32, f64)>| {
        let start = calls[c].issue.max(after) + calls[c].pre;
        for f in first_flow[c]..first_flow[c + 1] {
            out.push((f as u32, start));
        }
    };
    let mut initial = Vec::new();
    for s in 0..streams {
        if let Some(&c) = queue[s].first() {
            next[s] = 1;
            release(c, 0.0, &mut initial);
        }
    }
    let outcome = flows::run_gated(
        &flows,
        &network.capacity,
        f64::INFINITY,
        initial,
        &mut |f, t, out| {
            let c = call_of[f as usize] as usize;
            outstanding[c] -= 1;
            done[c] = done[c].max(t);
            if outstanding[c] == 0 {
                done[c] += calls[c].post;
                let s = calls[c].stream;
                if let Some(&n) = queue[s].get(next[s]) {
                    next[s] += 1;
                    release(n, done[c], out);
                }
            }
        },
    );
    if link_bytes.len() < outcome.link_bytes.len() {
        link_bytes.resize(outcome.link_bytes.len(), 0.0);
    }
    for (total, b) in link_bytes.iter_mut().zip(&outcome.link_bytes) {
        *total += b;
    }
    done.iter().copied().fold(0.0, f64::max)
}

/// Estimates NCCL M2N moving `tensors` (named `names`, in checkpoint order) on `cluster`.
pub fn m2n(
    names: &[String],
    tensors: &[TensorSpec],
    cluster: &Cluster,
    params: &M2nParams,
    schedule: Schedule,
) -> M2nReport {
    let mut skipped = Vec::new();
    let mut first_skipped = None;
    // M2N's own pipeline: no NCCL channels per peer; GIN puts leave through the GPU's NIC.
    let mut network = Network::new(cluster, f64::INFINITY);
    network.pxn = false;
    let mut plans: HashMap<String, std::rc::Rc<CallPlan>> = HashMap::new();
    let mut entries: Vec<(usize, std::rc::Rc<CallPlan>)> = Vec::new();
    for (k, spec) in tensors.iter().enumerate() {
        let key = format!(
            "{:?}|{:?}|{:?}|{:?}",
            spec.shape, spec.dtype, spec.src, spec.dst
        );
        if let Some(plan) = plans.get(&key) {
            entries.push((k, plan.clone()));
            continue;
        }
        match tensor2(spec).and_then(|t| call_plan(&t, cluster, params)) {
            Ok(plan) => {
                let plan = std::rc::Rc::new(plan);
                plans.insert(key, plan.clone());
                entries.push((k, plan));
            }
            Err(why) => {
                skipped.push(k);
                first_skipped.get_or_insert_with(|| format!("{}: {why}", names[k]));
            }
        }
    }
    let pack_bw = cluster.contiguous_copy_bw();
    let fixed = |plan: &CallPlan| -> (f64, f64) {
        // The last chunk's trip: one latency, plus a chunk and a latency per ring hop.
        let hops = plan.hops as f64;
        let hop_latency =
            (hops + 1.0) * cluster.latency_s + hops * CHUNK_BYTES / cluster.nic_achievable();
        if !params.pack {
            return (0.0, hop_latency);
        }
        let most = |m: &HashMap<u32, f64>| m.values().copied().fold(0.0, f64::max);
        (
            most(&plan.sent) / pack_bw,
            most(&plan.received) / pack_bw + hop_latency,
        )
    };
    // Batches that run one after another, each a list of calls with streams.
    let mut batches: Vec<Vec<(usize, usize, std::rc::Rc<CallPlan>)>> = Vec::new();
    match schedule {
        Schedule::OneCommunicator => {
            batches.push(entries.into_iter().map(|(k, p)| (k, 0, p)).collect());
        }
        Schedule::ModelBench => {
            let mut patterns: BTreeMap<String, Vec<(usize, std::rc::Rc<CallPlan>)>> =
                BTreeMap::new();
            for (k, plan) in entries {
                patterns
                    .entry(layer_pattern(&names[k]))
                    .or_default()
                    .push((k, plan));
            }
            let mut streams: BTreeMap<(u32, u32), usize> = BTreeMap::new();
            for (_, mut list) in patterns {
                list.sort_by(|a, b| names[a.0].cmp(&names[b.0]));
                let batch = list
                    .into_iter()
                    .map(|(k, plan)| {
                        let key = (
                            tensors[k].src.mesh.sorted_ranks().next().unwrap_or(0),
                            tensors[k].dst.mesh.sorted_ranks().next().unwrap_or(0),
                        );
                        let next = streams.len();
                        (k, *streams.entry(key).or_insert(next), plan)
                    })
                    .collect();
                batches.push(batch);
            }
        }
    }
    let mut link_bytes: Vec<f64> = Vec::new();
    let mut time_s = 0.0;
    let mut host_s = 0.0f64;
    let mut calls_total = 0u64;
    let (mut bytes_total, mut bytes_offnode) = (0.0f64, 0.0f64);
    for batch in batches {
        // Host: every member posts its calls one after another.
        let mut posted: HashMap<u32, f64> = HashMap::new();
        let calls: Vec<Call> = batch
            .into_iter()
            .map(|(k, stream, plan)| {
                let spec = &tensors[k];
                let members = spec.src.mesh.ranks().iter().chain(spec.dst.mesh.ranks());
                let mut issue = 0.0f64;
                for &r in members {
                    let at = posted.entry(r).or_insert(0.0);
                    *at += params.call_s;
                    issue = issue.max(*at);
                }
                for (&(a, b), &bytes) in &plan.pairs {
                    bytes_total += bytes;
                    if cluster.node(a) != cluster.node(b) {
                        bytes_offnode += bytes;
                    }
                }
                bytes_total += plan.fanout.values().sum::<f64>();
                let (pre, post) = fixed(&plan);
                Call {
                    stream,
                    issue,
                    pre,
                    post,
                    plan,
                }
            })
            .collect();
        calls_total += calls.len() as u64;
        host_s += posted.values().copied().fold(0.0, f64::max);
        time_s += run_calls(&calls, &mut network, &mut link_bytes);
    }
    let busiest_link = network.busiest_port(&link_bytes, time_s);
    M2nReport {
        sim: SimReport {
            time_s,
            bytes_total: bytes_total.round() as u64,
            bytes_offnode: bytes_offnode.round() as u64,
            bytes_local: 0,
            messages_total: calls_total,
            messages_max_per_rank: calls_total,
            messages_mean_per_rank: calls_total as f64,
            bytes_max_per_rank: 0,
            busiest_link,
            nic_bytes: Vec::new(),
            phases: vec![Phase {
                name: "host",
                seconds: host_s,
            }],
            p90_s: time_s,
            trials: 0,
            setup_s: 0.0,
            memory: None,
            critical: None,
            rounds: None,
        },
        calls: calls_total,
        skipped,
        first_skipped,
    }
}

/// A tensor name with its layer index replaced (`model.layers.X.mlp…`): the benchmark's
/// pattern.
fn layer_pattern(name: &str) -> String {
    match name.find("layers.") {
        Some(at) => {
            let rest = &name[at + "layers.".len()..];
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return name.to_string();
            }
            format!("{}layers.X{}", &name[..at], &rest[digits..])
        }
        None => name.to_string(),
    }
}
