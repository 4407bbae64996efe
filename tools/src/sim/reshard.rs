//! Simulating the real per-rank programs of a reshard.

use super::fabric::Network;
use super::flows::{self, Flow};
use super::{median_p90, Cluster, CriticalPath, CriticalRound, MemoryUse, Phase, Rng, SimReport};
use ncclreshard::plan::{Message, RankProgram, StridedConvert, StridedCopy};
use std::collections::HashMap;

/// How [`simulate_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Monte Carlo trials with jitter (`Cluster::jitter_s`, `Cluster::flow_jitter`); the
    /// report's time is their median and `p90_s` their 90th percentile. 0: one run without
    /// jitter.
    pub trials: u32,
    /// Seed of the trials' random draws (the same seed gives the same estimate).
    pub seed: u64,
    /// The rank whose time the report's [`CriticalPath`] breaks down; `None` (or a rank with
    /// no program): the rank that finishes last.
    pub rank: Option<u32>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            trials: 0,
            seed: 1,
            rank: None,
        }
    }
}

/// Estimates the time of a reshard from every participating rank's program, without jitter
/// ([`simulate_with`] with no trials).
pub fn simulate(programs: &[RankProgram], cluster: &Cluster) -> SimReport {
    simulate_with(programs, cluster, &SimOptions::default())
}

/// Estimates the time of a reshard from every participating rank's program.
///
/// `programs` should hold one program per rank of the plan (ranks without one are idle;
/// ranks may be any communicator ranks). First the memory: a rank's staging plus NCCL's
/// buffers for its connections must fit in `cluster.free_memory_bytes`, else the call is not
/// simulated (`fits()` is false, the time infinite). Then each rank, as the executor runs it
/// (docs/simulator.md §2):
///
/// - its host posts the fingerprint exchange (two operations per peer, one group), then for
///   every round its operations (`host_op_s` each) and one group (`group_s`), never waiting
///   for the GPU;
/// - its GPU runs the round's packs (one launch, each copy at `hbm_copy_bw` times the copy
///   kernel's efficiency for its run length), then the round's messages: those of one
///   (sender, receiver) pair form one flow that starts once both ends are in the round, have
///   packed and have posted the round, plus the pair's per-message latency; flows share
///   NVLink, NIC, PXN and leaf links max-min fairly, a network pair at most NCCL's channels
///   per peer; once its flows are done it unpacks and enters its next round;
/// - a member of a senders' barrier (`RankProgram::has_barrier`), once packed for each plan
///   round `1 .. barrier_rounds` (also one it has no part in), waits until every mate has
///   arrived there, that is, finished its rounds before, plus one message latency per step
///   of the dissemination barrier; its host posts each step as a group of its own. The
///   barrier's 8-byte messages are no flows.
///
/// Otherwise ranks drift apart freely; flows of different rounds share links when their
/// ranks are in different rounds. With trials, every rank's start of every round is delayed
/// by an exponential draw (`jitter_s`) and every flow carries an exponentially drawn extra
/// fraction of its bytes (`flow_jitter`). Sends are taken as the truth for what crosses the
/// network (receives mirror them by construction).
pub fn simulate_with(
    programs: &[RankProgram],
    cluster: &Cluster,
    options: &SimOptions,
) -> SimReport {
    let model = Model::build(programs, cluster);
    let memory = memory_use(programs, cluster, &model);
    let setup_s = setup_seconds(programs, cluster, &model);
    let counts = counts(programs, cluster);
    if !memory.map_or(true, |m| m.fits()) {
        return report(
            programs,
            counts,
            Run::not_run(),
            (f64::INFINITY, 0),
            setup_s,
            memory,
        );
    }
    // The run without jitter and the trials, together on the machine's threads.
    let mut runs = runs(&model, cluster, options);
    let nominal = runs.remove(0);
    let link_bytes = nominal.link_bytes.clone();
    let (time, p90, trials) = if options.trials == 0 {
        (nominal.time_s, nominal.time_s, 0)
    } else {
        let mut samples: Vec<f64> = runs.iter().map(|r| r.time_s).collect();
        let (median, p90) = median_p90(&mut samples);
        (median, p90, options.trials)
    };
    let mut report = report(programs, counts, nominal, (time, trials), setup_s, memory);
    report.p90_s = p90;
    report.busiest_link = model.network.busiest_port(&link_bytes, report.time_s);
    report.nic_bytes = model.network.nic_bytes(&link_bytes);
    report.rounds = Some(model.network.rounds_profile(
        model.flows.iter().zip(model.meta.iter().map(|m| m.round)),
        &model.labels,
    ));
    report
}

/// The run without jitter, then `options.trials` jittered runs, on as many threads as the
/// machine offers. Trial `t` draws from its own seed, so the result does not depend on the
/// threads.
fn runs(model: &Model<'_>, cluster: &Cluster, options: &SimOptions) -> Vec<Run> {
    let jobs: Vec<Option<u32>> = std::iter::once(None)
        .chain((0..options.trials).map(Some))
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    let one = |job: Option<u32>| match job {
        None => model.run(cluster, None, options.rank),
        Some(t) => {
            let mut rng = Rng::new(
                options
                    .seed
                    .wrapping_mul(0x9E37_79B9)
                    .wrapping_add(u64::from(t)),
            );
            model.run(cluster, Some(&mut rng), None)
        }
    };
    let mut done: Vec<(usize, Run)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                let (one, jobs) = (&one, &jobs);
                scope.spawn(move || {
                    (k..jobs.len())
                        .step_by(threads)
                        .map(|i| (i, one(jobs[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a run does not panic"))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, run)| run).collect()
}

/// One (sender, receiver) pair's messages of one round: a flow.
struct PairFlow {
    round: usize,
    from: usize,
    to: usize,
    /// The pair's per-message latencies, summed.
    latency_s: f64,
}

/// Everything about a call that does not change between trials.
struct Model<'a> {
    nr: usize,
    /// The programs' round numbers, ascending: round index `k` is `labels[k]`.
    labels: Vec<u32>,
    n: usize,
    /// Per (rank, round): seconds of the packs (and local copies), of the unpacks, and the
    /// time the host has posted the round.
    pack: Vec<f64>,
    unpack: Vec<f64>,
    /// Per (rank, round): seconds of the late unpacks, which run on a side stream beside the
    /// next round (they must be done before the round after next posts its group).
    late: Vec<f64>,
    /// Per (rank, round): seconds of side work forked as the rank enters this round (after
    /// `side_after` of it): the conversions of its next round, and in its first round the
    /// local copies where they run beside it, first; its next round (or its end) waits for it.
    side_next: Vec<f64>,
    /// Per (rank, round): when, after the rank enters the round, that side work is forked (the
    /// first round's conversions, on the call's stream, come first).
    side_after: Vec<f64>,
    posted: Vec<f64>,
    /// Per rank: its host's total posting time.
    host: Vec<f64>,
    /// Per rank: its conversions' seconds before its first round's packs and after its last
    /// round (inside `pack` of its first round and `unpack` of its last), for the critical
    /// path's breakdown (later rounds' conversions run on the side stream).
    converts: Vec<(f64, f64)>,
    /// Per (rank, round): the shortest per-message latency of the pair flows it takes part
    /// in (a flow starts its bytes after its pair's latencies, so before that none of the
    /// rank's bytes move; the longer latencies of its other flows overlap with these bytes).
    latency: Vec<f64>,
    /// Per rank: its own bytes at rated speed on its busiest port (NIC for other NVLink
    /// domains, NVLink inside its own), the least its transfers could take.
    rated: Vec<f64>,
    /// Per rank: the same bytes at achievable speed (link efficiency), the least NCCL could take.
    achievable: Vec<f64>,
    ends_of: Vec<Vec<u32>>,
    flows: Vec<Flow>,
    meta: Vec<PairFlow>,
    network: Network<'a>,
    /// Distinct ranks of the communicator the programs span.
    ranks: Vec<u32>,
    /// The senders' barriers of the programs.
    barriers: Barriers,
}

/// The senders' barrier of the programs (docs/executor.md, "The senders' barrier";
/// [`RankProgram::barrier_step`]): before each plan round `1 .. barrier_rounds` the members
/// (`RankProgram::barrier_members`) pass a dissemination barrier of `⌈log2 n⌉` steps, each
/// one group of an 8-byte send and receive, which a member gets through once every member has
/// arrived, that is, has finished its rounds before. Barrier messages carry no data: they are
/// no flows, only time.
///
/// Its cost, from the cluster model's parameters (docs/simulator.md §1), none of them new:
/// - on the GPU, one barrier takes its steps' message latencies after the last member
///   arrives, one after another (each step's message waits for the step before): steps ×
///   [`Cluster::message_latency`] (`nvlink_latency_s` between node mates of one NVLink
///   domain, `latency_s` otherwise), the largest over the rank's barrier peers;
/// - on the host, each step is one more group of 2 operations (`host_op_s` each, plus
///   `group_s`), posted in the rank's posting clock before the round's own group, as every
///   group is (the host never waits for the GPU, so this delays a round only where posting
///   is behind).
///
/// With the presets (both `nvlink_latency_s` 3.4 µs, `host_op_s` 1 µs, `group_s` 8.4 µs) a
/// GB200 NVL72 domain's 72 senders pass each barrier 7 × 3.4 = 23.8 µs after the last of them
/// arrives, each host having spent 7 × (2 × 1 + 8.4) = 72.8 µs posting it. The NCCL
/// connections the barrier opens (at most 2 per step) count in [`memory_use`] and
/// [`setup_seconds`].
///
/// Slots: a barrier belongs to slot `k` (`0 ..= nr`) when it comes before the rank's round
/// index `k`, that is, for plan rounds after `labels[k - 1]` up to `labels[k]`; slot `nr`
/// holds those after the last labelled round (posted after the rank's last round).
#[derive(Default)]
struct Barriers {
    /// Per (rank, slot): how many barriers the rank passes there.
    count: Vec<u32>,
    /// Per (rank, slot): when its host has posted them.
    posted: Vec<f64>,
    /// Per rank: its group (an index into `groups`), or `NO_GROUP`.
    group: Vec<u32>,
    groups: Vec<BarrierGroup>,
}

/// Ranks that list the same barrier members (`RankProgram::barrier_members`).
struct BarrierGroup {
    /// The members with a program (rank indices): those that arrive.
    members: Vec<usize>,
    /// How many members the list names: until that many arrive, nobody passes (a member
    /// without a program, or one listing other mates, leaves the group stuck).
    listed: u32,
    /// Seconds of one barrier on the GPU once the last member arrived.
    cost_s: f64,
}

const NO_GROUP: u32 = u32::MAX;

/// Barriers of a program with `barrier_rounds` that fall into slot `slot` (plan rounds in
/// `(labels[slot - 1], labels[slot]]`, from 1 and before `barrier_rounds`; the last slot,
/// `labels.len()` or more, takes every plan round after the last label).
fn barriers_in_slot(labels: &[u32], slot: usize, barrier_rounds: u32) -> u32 {
    let after = match slot {
        0 => 0,
        _ => match labels.get(slot - 1) {
            Some(&l) => u64::from(l) + 1,
            None => return 0,
        },
    };
    let upto = labels.get(slot).map_or(u64::MAX, |&l| u64::from(l));
    let first = after.max(1);
    let last = upto.min(u64::from(barrier_rounds).saturating_sub(1));
    if last < first || barrier_rounds < 2 {
        0
    } else {
        (last - first + 1) as u32
    }
}

impl Barriers {
    /// The barriers of `programs`, whose round indices are `labels` and whose ranks
    /// (indexed) are `ranks`; nothing posted yet.
    fn build(
        programs: &[RankProgram],
        cluster: &Cluster,
        labels: &[u32],
        ranks: &[u32],
    ) -> Barriers {
        let (n, slots) = (ranks.len(), labels.len().max(1) + 1);
        let mut b = Barriers::default();
        if !programs.iter().any(RankProgram::has_barrier) {
            return b;
        }
        b.count = vec![0; n * slots];
        b.posted = vec![0.0; n * slots];
        b.group = vec![NO_GROUP; n];
        let mut ids: HashMap<Vec<u32>, u32> = HashMap::new();
        for p in programs.iter().filter(|p| p.has_barrier()) {
            let Ok(i) = ranks.binary_search(&p.rank) else {
                continue;
            };
            let mut list: Vec<u32> = p.barrier_members.clone();
            list.sort_unstable();
            list.dedup();
            // Its steps one after another, each one message latency (the largest of them).
            let cost_s = f64::from(p.barrier_steps())
                * p.barrier_sends
                    .iter()
                    .map(|m| cluster.message_latency(p.rank, m.peer))
                    .fold(0.0, f64::max);
            let listed = list.len() as u32;
            let next = b.groups.len() as u32;
            let g = *ids.entry(list).or_insert(next);
            if g == next {
                b.groups.push(BarrierGroup {
                    members: Vec::new(),
                    listed,
                    cost_s: 0.0,
                });
            }
            let group = &mut b.groups[g as usize];
            group.members.push(i);
            group.cost_s = group.cost_s.max(cost_s);
            b.group[i] = g;
            for slot in 0..slots {
                b.count[i * slots + slot] = barriers_in_slot(labels, slot, p.barrier_rounds);
            }
        }
        b
    }

    /// Rank `i`'s host posts its barriers of `slots`, `each` seconds apiece, on `clock`.
    fn post(
        &mut self,
        i: usize,
        slots: std::ops::RangeInclusive<usize>,
        each: f64,
        clock: &mut f64,
    ) {
        let width = self.count.len() / self.group.len().max(1);
        for slot in slots {
            let at = i * width + slot;
            *clock += f64::from(self.count[at]) * each;
            self.posted[at] = *clock;
        }
    }
}

/// One run's outcome.
struct Run {
    time_s: f64,
    phases: [f64; 4],
    link_bytes: Vec<f64>,
    critical: Option<CriticalPath>,
}

impl Run {
    fn not_run() -> Run {
        Run {
            time_s: f64::INFINITY,
            phases: [0.0; 4],
            link_bytes: Vec::new(),
            critical: None,
        }
    }
}

/// Every rank's progress in one run of [`Model::run`]: the round it is in, when that round's
/// packs were done, the last finish of its flows in it, how many are still moving; its side
/// stream; and where it stands at its senders' barriers.
struct Walk<'r, 'a> {
    model: &'r Model<'a>,
    /// Per (rank, round): the jitter added to when its flows could start.
    delay: &'r [f64],
    /// Per rank: the round index whose flows it may start (`nr`: done; a rank waiting at a
    /// barrier keeps the round before, or `usize::MAX` before its first).
    position: Vec<usize>,
    ready: Vec<f64>,
    last: Vec<f64>,
    /// Per (rank, round): its flows still moving.
    outstanding: Vec<usize>,
    finished: Vec<f64>,
    busy: Vec<f64>,
    /// Per rank, its side stream: when the late unpacks queued so far are done, and when
    /// those queued before its last finished round's are (the next round's group waits for
    /// these: it reuses their staging).
    side_free: Vec<f64>,
    side_wait: Vec<f64>,
    /// Per rank: when the conversions of its next round (started on the side stream as it
    /// entered its current one) are done.
    converted: Vec<f64>,
    /// Per (rank, round): when the rank entered it, when its flows could start and when they
    /// were done (the critical path's breakdown).
    entered: Vec<f64>,
    ready_at: Vec<f64>,
    done_at: Vec<f64>,
    /// Per (group, slot): members arrived at the slot's barriers, and the latest arrival.
    arrived: Vec<u32>,
    latest: Vec<f64>,
    /// Per (rank, slot): when it arrived at the slot's barriers and when it passed them.
    reached: Vec<f64>,
    passed: Vec<f64>,
    /// Per rank: when it entered the round it waits at a barrier for (or finished its last).
    waiting_from: Vec<f64>,
    /// Ranks to walk on: (rank, round index, time it entered it, when it passed the
    /// barriers before it, if it has).
    todo: Vec<(usize, usize, f64, Option<f64>)>,
}

impl<'r, 'a> Walk<'r, 'a> {
    fn new(model: &'r Model<'a>, delay: &'r [f64]) -> Walk<'r, 'a> {
        let (n, nr) = (model.n, model.nr);
        let barrier_slots = if model.barriers.groups.is_empty() {
            (0, 0)
        } else {
            (model.barriers.groups.len() * (nr + 1), n * (nr + 1))
        };
        Walk {
            model,
            delay,
            position: vec![usize::MAX; n],
            ready: vec![0.0; n],
            last: vec![0.0; n],
            outstanding: model.ends_of.iter().map(Vec::len).collect(),
            finished: vec![0.0; n],
            busy: vec![0.0; n],
            side_free: vec![0.0; n],
            side_wait: vec![0.0; n],
            converted: vec![0.0; n],
            entered: vec![0.0; n * nr],
            ready_at: vec![0.0; n * nr],
            done_at: vec![0.0; n * nr],
            arrived: vec![0; barrier_slots.0],
            latest: vec![f64::NEG_INFINITY; barrier_slots.0],
            reached: vec![0.0; barrier_slots.1],
            passed: vec![0.0; barrier_slots.1],
            waiting_from: vec![0.0; if barrier_slots.1 > 0 { n } else { 0 }],
            todo: Vec::new(),
        }
    }

    /// Enters rank `i` into round `k` at time `t`, passing through rounds it has no flows in
    /// and stopping at a barrier until its group is there, and releases the flows whose other
    /// end is already there (into `release`: flow, start time). A group completed on the way
    /// walks its waiting members on too.
    fn enter(&mut self, i: usize, k: usize, t: f64, release: &mut Vec<(u32, f64)>) {
        let mut todo = std::mem::take(&mut self.todo);
        todo.push((i, k, t, None));
        while let Some((i, k, t, through)) = todo.pop() {
            self.walk(i, k, t, through, release, &mut todo);
        }
        self.todo = todo;
    }

    /// One rank's walk from round `k` (entered at `t`; `through`: when it passed the barriers
    /// before it, if it already has) until it waits for flows, for its barrier group, or is
    /// done.
    fn walk(
        &mut self,
        i: usize,
        mut k: usize,
        mut t: f64,
        mut through: Option<f64>,
        release: &mut Vec<(u32, f64)>,
        todo: &mut Vec<(usize, usize, f64, Option<f64>)>,
    ) {
        let m = self.model;
        let nr = m.nr;
        let (side_next, side_after) = (&m.side_next, &m.side_after);
        loop {
            let passed = match through.take() {
                Some(p) => p,
                None if m
                    .barriers
                    .count
                    .get(i * (nr + 1) + k)
                    .is_some_and(|&c| c > 0) =>
                {
                    self.arrive(i, k, t, todo);
                    return;
                }
                None => f64::NEG_INFINITY,
            };
            if k == nr {
                self.position[i] = nr;
                self.finished[i] = t.max(passed).max(self.side_free[i]);
                return;
            }
            let slot = i * nr + k;
            self.position[i] = k;
            self.ready[i] = (t + m.pack[slot])
                .max(m.posted[slot])
                .max(self.side_wait[i])
                .max(self.converted[i])
                .max(passed)
                + self.delay[slot];
            if side_next[slot] > 0.0 {
                self.side_free[i] = self.side_free[i].max(t + side_after[slot]) + side_next[slot];
                self.converted[i] = self.side_free[i];
            }
            self.last[i] = self.ready[i];
            self.entered[slot] = t;
            self.ready_at[slot] = self.ready[i];
            if !m.ends_of[slot].is_empty() {
                for &f in &m.ends_of[slot] {
                    let pair = &m.meta[f as usize];
                    let other = if pair.from == i { pair.to } else { pair.from };
                    if other == i || self.position[other] == k {
                        let start = self.ready[i].max(self.ready[other]) + pair.latency_s;
                        release.push((f, start));
                    }
                }
                return;
            }
            t = self.ready[i] + m.unpack[slot];
            k += 1;
        }
    }

    /// Rank `i`, having entered round `k` at `t`, arrives at the barriers before it (packed,
    /// past the late unpacks and conversions it waits for, and posted) and waits there; the
    /// last member to arrive lets the whole group through, one barrier's cost per barrier
    /// after the latest arrival ([`Barriers`]).
    fn arrive(
        &mut self,
        i: usize,
        k: usize,
        t: f64,
        todo: &mut Vec<(usize, usize, f64, Option<f64>)>,
    ) {
        let m = self.model;
        let (nr, b) = (m.nr, &m.barriers);
        let at = i * (nr + 1) + k;
        let mut arrival = t.max(b.posted[at]);
        if k < nr {
            let slot = i * nr + k;
            arrival = arrival
                .max(t + m.pack[slot])
                .max(self.side_wait[i])
                .max(self.converted[i]);
        }
        self.reached[at] = arrival;
        self.waiting_from[i] = t;
        let g = b.group[i] as usize;
        let group = &b.groups[g];
        let gs = g * (nr + 1) + k;
        self.arrived[gs] += 1;
        self.latest[gs] = self.latest[gs].max(arrival);
        if self.arrived[gs] == group.listed {
            for &member in &group.members {
                let at = member * (nr + 1) + k;
                let pass = self.latest[gs] + f64::from(b.count[at]) * group.cost_s;
                self.passed[at] = pass;
                todo.push((member, k, self.waiting_from[member], Some(pass)));
            }
        }
    }

    /// Flow `f` finished at `t`: its ends that have no flow left in the round unpack and
    /// enter their next round.
    fn flow_done(&mut self, f: u32, t: f64, release: &mut Vec<(u32, f64)>) {
        let m = self.model;
        let nr = m.nr;
        let pair = &m.meta[f as usize];
        let k = pair.round;
        for e in [pair.from, pair.to] {
            if e == pair.to && pair.to == pair.from {
                continue;
            }
            let slot = e * nr + k;
            self.outstanding[slot] -= 1;
            self.last[e] = self.last[e].max(t);
            if self.outstanding[slot] == 0 {
                self.busy[e] += self.last[e] - self.ready[e];
                self.done_at[slot] = self.last[e];
                let done = self.last[e] + m.unpack[slot];
                self.side_wait[e] = self.side_free[e];
                if m.late[slot] > 0.0 {
                    self.side_free[e] = self.side_free[e].max(self.last[e]) + m.late[slot];
                }
                self.enter(e, k + 1, done, release);
            }
        }
    }
}

/// Seconds the copy kernel takes for `copy`: its bytes at `hbm_copy_bw` times the efficiency
/// of its contiguous run length and alignment ([`Cluster::copy_efficiency`]).
pub(crate) fn copy_seconds(copy: &StridedCopy, cluster: &Cluster) -> f64 {
    let bytes = copy.bytes();
    if bytes == 0 {
        return 0.0;
    }
    let mut align = 16u64;
    let values = [copy.chunk_bytes, copy.src.offset, copy.dst.offset]
        .into_iter()
        .chain(copy.dims.iter().flat_map(|d| [d.src_stride, d.dst_stride]));
    for v in values {
        while align > 1 && v % align != 0 {
            align /= 2;
        }
    }
    bytes as f64 / (cluster.hbm_copy_bw * Cluster::copy_efficiency(copy.chunk_bytes, align))
}

/// Seconds of the conversion kernels running `converts` (docs/quantization.md): for scaled
/// schemes the strips' partial amaxes, one pass per further reduction level (a block of more
/// than 64 partials: per-tensor and per-channel scales of long rows), the block scales and the
/// values; one launch for plain casts. The first and last passes read the source, the last
/// writes the destination, at [`Cluster::CONVERT_EFFICIENCY`] of HBM speed (a copy of B bytes
/// moves 2·B, so traffic runs at twice `hbm_copy_bw`).
pub(crate) fn convert_seconds(converts: &[StridedConvert], cluster: &Cluster) -> f64 {
    if converts.is_empty() {
        return 0.0;
    }
    let scaled = converts.iter().any(|c| c.scale.is_some());
    let traffic: u64 = converts
        .iter()
        .map(|c| {
            let reads = if c.scale.is_some() { 2 } else { 1 };
            reads * c.src_bytes() + c.dst_bytes()
        })
        .sum();
    // Partials per block: one per 16-byte strip of a row, per 64 rows.
    let levels = converts
        .iter()
        .filter(|c| c.scale.is_some())
        .map(|c| {
            let elem = u64::from(c.arithmetic.src.size()).max(1);
            let partials = c.dims.split_last().map_or(1, |(inner, outer)| {
                let strips = (inner.block.min(inner.count) * elem).div_ceil(16);
                let rows: u64 = outer.iter().map(|d| d.block.min(d.count)).product();
                strips.saturating_mul(rows.div_ceil(64))
            });
            let mut levels = 0u32;
            let mut left = partials;
            while left > 64 {
                left = left.div_ceil(64);
                levels += 1;
            }
            levels
        })
        .max()
        .unwrap_or(0);
    let launches = if scaled { 3.0 + f64::from(levels) } else { 1.0 };
    traffic as f64 / (2.0 * cluster.hbm_copy_bw * Cluster::CONVERT_EFFICIENCY)
        + launches * cluster.launch_s
}

/// Seconds of one kernel running `copies` (a launch when there is any).
fn kernel_seconds<'c>(copies: impl IntoIterator<Item = &'c StridedCopy>, cluster: &Cluster) -> f64 {
    let mut any = false;
    let s: f64 = copies
        .into_iter()
        .inspect(|_| any = true)
        .map(|c| copy_seconds(c, cluster))
        .sum();
    if any {
        s + cluster.launch_s
    } else {
        0.0
    }
}

impl<'a> Model<'a> {
    fn build(programs: &[RankProgram], cluster: &'a Cluster) -> Model<'a> {
        let mut labels: Vec<u32> = programs
            .iter()
            .flat_map(|p| p.rounds_iter().map(|r| r.round))
            .collect();
        labels.sort_unstable();
        labels.dedup();
        let nr = labels.len().max(1);
        let mut ranks: Vec<u32> = programs
            .iter()
            .map(|p| p.rank)
            .chain(programs.iter().flat_map(|p| p.sends.iter().map(|m| m.peer)))
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        let index = |rank: u32| ranks.binary_search(&rank).expect("every rank is indexed");
        let n = ranks.len();
        let mut network = Network::new(cluster, cluster.p2p_peer_cap(n));

        let mut pack = vec![0.0f64; n * nr];
        let mut unpack = vec![0.0f64; n * nr];
        let mut late = vec![0.0f64; n * nr];
        let mut side_next = vec![0.0f64; n * nr];
        let mut side_after = vec![0.0f64; n * nr];
        let mut posted = vec![0.0f64; n * nr];
        let mut host = vec![0.0f64; n];
        let mut converts_s = vec![(0.0f64, 0.0f64); n];
        let mut latency = vec![f64::INFINITY; n * nr];
        // Per rank: bytes (sent, received) over NICs and over NVLink.
        let mut port_bytes = vec![[0u64; 4]; n];
        let mut ends_of: Vec<Vec<u32>> = vec![Vec::new(); n * nr];
        let mut flows: Vec<Flow> = Vec::new();
        let mut meta: Vec<PairFlow> = Vec::new();
        let mut barriers = Barriers::build(programs, cluster, &labels, &ranks);
        for p in programs {
            let i = index(p.rank);
            // The host's time to post one barrier (a group of its own), and the next slot
            // whose barriers it has not posted yet.
            let barrier_post = p.has_barrier().then(|| {
                (p.barrier_sends.len() + p.barrier_recvs.len()) as f64 * cluster.host_op_s
                    + f64::from(p.barrier_steps()) * cluster.group_s
            });
            let mut barrier_slot = 0usize;
            // The fingerprint exchange: one 8-byte send and receive per peer, one group,
            // finished after one message latency.
            let peers = p.peers();
            let mut clock = 0.0;
            if !peers.is_empty() {
                let latency = peers
                    .iter()
                    .map(|&q| cluster.message_latency(p.rank, q))
                    .fold(0.0, f64::max);
                clock += 2.0 * peers.len() as f64 * cluster.host_op_s + cluster.group_s;
                clock += latency;
            }
            let mut last: Option<usize> = None;
            let beside = p.local_copies_beside();
            for round in p.rounds_iter() {
                let k = labels
                    .binary_search(&round.round)
                    .expect("every round is labelled");
                let local: &[StridedCopy] = if last.is_none() { &p.local_copies } else { &[] };
                // Senders convert a round's data before its packs: the first round's on the
                // call's stream, a later round's on the side stream from the start of the
                // round before (at the side stream's share of the copy speed).
                let converting = convert_seconds(round.converts, cluster);
                match last {
                    None => {
                        converts_s[i].0 += converting;
                        pack[i * nr + k] += converting;
                        if beside {
                            side_after[i * nr + k] = converting;
                            side_next[i * nr + k] +=
                                kernel_seconds(local, cluster) / Cluster::LATE_UNPACK_SHARE;
                        }
                    }
                    Some(before) => {
                        side_next[i * nr + before] += converting / Cluster::LATE_UNPACK_SHARE;
                    }
                }
                last = Some(k);
                let local = if beside { &[][..] } else { local };
                pack[i * nr + k] += kernel_seconds(local.iter().chain(round.packs), cluster);
                unpack[i * nr + k] += kernel_seconds(round.early_unpacks(), cluster);
                late[i * nr + k] +=
                    kernel_seconds(round.late_unpacks(), cluster) / Cluster::LATE_UNPACK_SHARE;
                // The barriers before this round come first (the executor posts them right
                // before the round's exchange).
                if let Some(each) = barrier_post {
                    barriers.post(i, barrier_slot..=k, each, &mut clock);
                    barrier_slot = k + 1;
                }
                let ops = round.sends.len() + round.recvs.len();
                if ops > 0 {
                    clock += ops as f64 * cluster.host_op_s + cluster.group_s;
                }
                posted[i * nr + k] = clock;
                for run in round.sends.chunk_by(|a, b| a.peer == b.peer) {
                    let (from, to) = (p.rank, run[0].peer);
                    let j = index(to);
                    let bytes: u64 = run.iter().map(|m| m.bytes).sum();
                    let f = flows.len() as u32;
                    flows.push(network.route(from, to, bytes as f64));
                    let latency_s = run.len() as f64 * cluster.message_latency(from, to);
                    if j != i {
                        let port = egress_port(cluster, from, to);
                        port_bytes[i][port] += bytes;
                        port_bytes[j][port + 1] += bytes;
                    }
                    latency[i * nr + k] = latency[i * nr + k].min(latency_s);
                    latency[j * nr + k] = latency[j * nr + k].min(latency_s);
                    meta.push(PairFlow {
                        round: k,
                        from: i,
                        to: j,
                        latency_s,
                    });
                    ends_of[i * nr + k].push(f);
                    if j != i {
                        ends_of[j * nr + k].push(f);
                    }
                }
            }
            // Receivers convert after their last round's unpacks.
            if let Some(k) = last {
                let converting = convert_seconds(&p.converts_after, cluster);
                converts_s[i].1 += converting;
                unpack[i * nr + k] += converting;
            }
            // The barriers after its last round.
            if let Some(each) = barrier_post {
                barriers.post(i, barrier_slot..=nr, each, &mut clock);
            }
            host[i] = clock;
            // Rounds the rank has no part in are posted when its last posted round was.
            for k in 1..nr {
                posted[i * nr + k] = posted[i * nr + k].max(posted[i * nr + k - 1]);
            }
        }
        Model {
            nr,
            labels,
            n,
            pack,
            unpack,
            late,
            side_next,
            side_after,
            posted,
            host,
            converts: converts_s,
            latency: latency
                .into_iter()
                .map(|l| if l.is_finite() { l } else { 0.0 })
                .collect(),
            rated: busiest_port_s(&port_bytes, cluster.nic_bw, cluster.nvlink_bw),
            achievable: busiest_port_s(
                &port_bytes,
                cluster.nic_achievable(),
                cluster.nvlink_achievable(),
            ),
            ends_of,
            flows,
            meta,
            network,
            ranks,
            barriers,
        }
    }

    /// One run (jittered when `rng` is given), the critical path broken down for `focus`
    /// (when it has a program) or for the rank that finishes last.
    fn run(&self, cluster: &Cluster, mut rng: Option<&mut Rng>, focus: Option<u32>) -> Run {
        let (n, nr) = (self.n, self.nr);
        let delay: Vec<f64> = (0..n * nr)
            .map(|_| rng.as_mut().map_or(0.0, |r| r.exp(cluster.jitter_s)))
            .collect();
        let flows: Vec<Flow> = self
            .flows
            .iter()
            .map(|f| {
                let mut f = f.clone();
                if let Some(r) = rng.as_mut() {
                    f.bytes *= 1.0 + r.exp(cluster.flow_jitter);
                }
                f
            })
            .collect();
        let mut walk = Walk::new(self, &delay);
        let mut initial = Vec::new();
        for i in 0..n {
            walk.enter(i, 0, 0.0, &mut initial);
        }
        let outcome = flows::run_gated(
            &flows,
            &self.network.capacity,
            self.network.peer_cap,
            initial,
            &mut |f, t, release| walk.flow_done(f, t, release),
        );
        let Walk {
            position,
            finished,
            busy,
            entered,
            ready_at,
            done_at,
            reached,
            passed,
            ..
        } = walk;
        let (pack, unpack, late, side_next, ends_of, meta) = (
            &self.pack,
            &self.unpack,
            &self.late,
            &self.side_next,
            &self.ends_of,
            &self.meta,
        );
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
        // Seconds rank i spent at its barriers of slot k (0 without), from `Walk::reached`
        // and `Walk::passed`.
        let at_barrier = |i: usize, k: usize| -> f64 {
            let b = i * (nr + 1) + k;
            if self.barriers.count.get(b).is_some_and(|&c| c > 0) {
                (passed[b] - reached[b]).max(0.0)
            } else {
                0.0
            }
        };
        // The rank that finishes last (or the one asked for), round by round: what its clock
        // spent where.
        let critical = (!stuck && n > 0).then(|| {
            let i = focus
                .and_then(|r| self.ranks.iter().position(|&x| x == r))
                .or_else(|| (0..n).max_by(|&a, &b| finished[a].total_cmp(&finished[b])))
                .unwrap_or(0);
            let mut c = CriticalPath {
                rank: self.ranks[i],
                ..CriticalPath::default()
            };
            let mut exit = 0.0f64;
            for k in 0..nr {
                let slot = i * nr + k;
                let mut round = CriticalRound {
                    round: self.labels.get(k).copied().unwrap_or(0),
                    entered_s: entered[slot],
                    ready_s: ready_at[slot],
                    done_s: ready_at[slot],
                    unpack_s: unpack[slot],
                    late_unpack_s: late[slot],
                    flows: ends_of[slot].len(),
                    barrier_s: at_barrier(i, k),
                    ..CriticalRound::default()
                };
                c.packs_s += pack[slot];
                c.unpacks_s += unpack[slot];
                c.barrier_s += round.barrier_s;
                if ends_of[slot].is_empty() {
                    c.waits_s += ready_at[slot] - entered[slot] - pack[slot];
                    exit = ready_at[slot] + unpack[slot];
                    c.rounds.push(round);
                    continue;
                }
                c.waits_s += (ready_at[slot] - entered[slot] - pack[slot]).max(0.0);
                let took = done_at[slot] - ready_at[slot];
                c.transfers_s += took;
                c.latency_s += self.latency[slot];
                // The peer of the round that was ready last, and how long after the rank.
                let (peer, after) = ends_of[slot]
                    .iter()
                    .map(|&f| {
                        let m = &meta[f as usize];
                        let other = if m.from == i { m.to } else { m.from };
                        (other, ready_at[other * nr + k] - ready_at[slot])
                    })
                    .fold(
                        (i, f64::NEG_INFINITY),
                        |best, x| if x.1 > best.1 { x } else { best },
                    );
                let after = after.max(0.0);
                let own = self.round_need_s(i, k, cluster);
                let beyond = took - own - self.latency[slot];
                c.peers_s += after.min(beyond).max(0.0);
                exit = done_at[slot] + unpack[slot];
                round.done_s = done_at[slot];
                round.own_s = own;
                round.last_peer = Some(self.ranks[peer]);
                round.last_peer_after_s = after;
                c.rounds.push(round);
            }
            // The barriers after its last round: waiting (for the host to post them too),
            // before the late unpacks' tail.
            let b = i * (nr + 1) + nr;
            if self.barriers.count.get(b).is_some_and(|&c| c > 0) {
                let through = passed[b];
                c.barrier_s += at_barrier(i, nr);
                c.waits_s += (through - exit).max(0.0);
                exit = exit.max(through);
            }
            c.rated_s = self.rated[i];
            c.efficiency_s = (self.achievable[i] - self.rated[i]).max(0.0);
            let (before, after) = self.converts[i];
            c.conversions_s = before + after;
            c.packs_s = (c.packs_s - before).max(0.0);
            c.unpacks_s = (c.unpacks_s - after).max(0.0);
            c.late_tail_s = (finished[i] - exit).max(0.0);
            c
        });
        Run {
            critical,
            time_s,
            phases: [
                sum_per_rank(
                    &pack
                        .iter()
                        .zip(side_next)
                        .map(|(p, c)| p + c)
                        .collect::<Vec<_>>(),
                ),
                busy.iter().copied().fold(0.0, f64::max),
                sum_per_rank(
                    &unpack
                        .iter()
                        .zip(late)
                        .map(|(u, l)| u + l)
                        .collect::<Vec<_>>(),
                ),
                self.host.iter().copied().fold(0.0, f64::max),
            ],
            link_bytes: outcome.link_bytes,
        }
    }

    /// Rank `i`'s own bytes of round `k` at achievable speed on its busiest port in that round.
    fn round_need_s(&self, i: usize, k: usize, cluster: &Cluster) -> f64 {
        let mut ports = [0u64; 4];
        for &f in &self.ends_of[i * self.nr + k] {
            let m = &self.meta[f as usize];
            if m.from == m.to {
                continue;
            }
            let port = egress_port(cluster, self.ranks[m.from], self.ranks[m.to]);
            ports[port + usize::from(m.to == i)] += self.flows[f as usize].bytes as u64;
        }
        port_seconds(
            &ports,
            cluster.nic_achievable(),
            cluster.nvlink_achievable(),
        )
    }
}

/// Which of a rank's ports (`[NIC out, NIC in, NVLink out, NVLink in]`) a flow from `from` to
/// `to` leaves `from` by; it enters `to` by the next one.
fn egress_port(cluster: &Cluster, from: u32, to: u32) -> usize {
    usize::from(cluster.same_domain(from, to)) * 2
}

/// NCCL buffer bytes of one connection to `peer`: its channels times `chunk × 8` steps
/// (NCCL's `p2pChunkSize × NCCL_STEPS`: 128 KiB chunks over the network, 512 KiB over
/// NVLink).
fn connection_bytes(cluster: &Cluster, rank: u32, peer: u32, channels: u32) -> u64 {
    let chunk: u64 = if cluster.same_domain(rank, peer) {
        512 << 10
    } else {
        128 << 10
    };
    u64::from(channels) * chunk * 8
}

/// The distinct peers of `data` and `barrier` messages (a connection carries both).
fn connected_peers(data: &[Message], barrier: &[Message]) -> Vec<u32> {
    let mut peers: Vec<u32> = data.iter().chain(barrier).map(|m| m.peer).collect();
    peers.sort_unstable();
    peers.dedup();
    peers
}

/// The rank needing the most memory for staging plus NCCL connections (those the senders'
/// barrier's messages open to mates included). `None` for no programs.
fn memory_use(programs: &[RankProgram], cluster: &Cluster, model: &Model) -> Option<MemoryUse> {
    let channels = cluster.p2p_channels_per_peer(model.ranks.len());
    programs
        .iter()
        .map(|p| {
            let connections = |data: &[Message], barrier: &[Message]| -> u64 {
                connected_peers(data, barrier)
                    .iter()
                    .map(|&q| connection_bytes(cluster, p.rank, q, channels))
                    .sum()
            };
            MemoryUse {
                rank: p.rank,
                staging_bytes: p.staging_bytes,
                nccl_bytes: connections(&p.sends, &p.barrier_sends)
                    + connections(&p.recvs, &p.barrier_recvs),
                work_bytes: p.work_bytes,
                free_bytes: cluster.free_memory_bytes,
            }
        })
        .max_by_key(|m| (m.total(), std::cmp::Reverse(m.rank)))
}

/// One-time costs: compiling the copy kernel, and connecting every (peer, channel) of the
/// rank with the most connections (the senders' barrier's included), one after another.
fn setup_seconds(programs: &[RankProgram], cluster: &Cluster, model: &Model) -> f64 {
    let channels = f64::from(cluster.p2p_channels_per_peer(model.ranks.len()));
    let connections = programs
        .iter()
        .map(|p| {
            connected_peers(&p.sends, &p.barrier_sends).len()
                + connected_peers(&p.recvs, &p.barrier_recvs).len()
        })
        .max()
        .unwrap_or(0);
    let copies = programs.iter().any(|p| {
        !p.packs.is_empty()
            || !p.unpacks.is_empty()
            || !p.local_copies.is_empty()
            || !p.converts_before.is_empty()
            || !p.converts_after.is_empty()
    });
    connections as f64 * channels * cluster.connect_s + if copies { cluster.compile_s } else { 0.0 }
}

/// Byte totals of the programs: (total over links, off-node, local copies).
fn counts(programs: &[RankProgram], cluster: &Cluster) -> (u64, u64, u64) {
    let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
    let mut local = 0u64;
    for p in programs {
        local += p.bytes_copied_locally();
        for m in &p.sends {
            *pairs.entry((p.rank, m.peer)).or_default() += m.bytes;
        }
    }
    let total = pairs.values().sum();
    let offnode = pairs
        .iter()
        .filter(|((a, b), _)| cluster.node(*a) != cluster.node(*b))
        .map(|(_, b)| b)
        .sum();
    (total, offnode, local)
}

/// Per rank, the seconds its busiest port takes for its bytes (`port_bytes`: sent and received
/// over NICs, then over NVLink) at `nic_bw` and `nvlink_bw`.
fn busiest_port_s(port_bytes: &[[u64; 4]], nic_bw: f64, nvlink_bw: f64) -> Vec<f64> {
    port_bytes
        .iter()
        .map(|b| port_seconds(b, nic_bw, nvlink_bw))
        .collect()
}

/// The seconds a rank's busiest port takes for `bytes` (per port, as [`egress_port`] numbers
/// them).
fn port_seconds(bytes: &[u64; 4], nic_bw: f64, nvlink_bw: f64) -> f64 {
    let nic = bytes[0].max(bytes[1]) as f64 / nic_bw;
    let nvlink = bytes[2].max(bytes[3]) as f64 / nvlink_bw;
    nic.max(nvlink)
}

/// The report of a call: times as simulated, message and byte counts from the programs.
fn report(
    programs: &[RankProgram],
    (bytes_total, bytes_offnode, bytes_local): (u64, u64, u64),
    run: Run,
    (time_s, trials): (f64, u32),
    setup_s: f64,
    memory: Option<MemoryUse>,
) -> SimReport {
    let participants = programs.iter().filter(|p| !p.is_empty()).count();
    let posted = |p: &RankProgram| (p.sends.len() + p.recvs.len()) as u64;
    let total_posted: u64 = programs.iter().map(posted).sum();
    let [prepare, transfer, unpack, host] = run.phases;
    let critical = run.critical;
    SimReport {
        critical,
        rounds: None,
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
        busiest_link: None,
        nic_bytes: Vec::new(),
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
            Phase {
                name: "host",
                seconds: host,
            },
        ],
        p90_s: time_s,
        trials,
        setup_s,
        memory,
    }
}
