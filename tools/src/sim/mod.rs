//! The refit simulator (docs/design.md §6): what a reshard would cost on a cluster we cannot run here.
//! Its numbers are simulations; [`calibrate`] compares it with every public measurement it
//! can reproduce.
//!
//! Every estimate uses the same [`Cluster`] model (link speeds NCCL reaches, NCCL's
//! per-message, per-round and per-peer costs, a rail-optimised fabric with PXN, copy speed by
//! run length, free memory, jitter):
//!
//! - [`simulate`] / [`simulate_with`] run the real per-rank programs (from
//!   [`ncclreshard::Planner::rank_program`]): host posting, packs, every (sender, receiver)
//!   pair's messages of a round as one flow sharing links max-min fairly, unpacks; rounds per
//!   rank without global barriers (only the senders' barriers the programs carry); median and
//!   p90 over jittered trials; memory and one-time setup.
//! - [`m2n`] models NCCL M2N's direct and hierarchical reshard, one call per tensor, as its
//!   benchmark or as NeMo RL calls it; [`nemo_rl_reshard`] NeMo RL's `nccl_reshard` refit.
//! - [`gather_broadcast`] models the baseline NeMo RL, veRL and slime use: gather every tensor
//!   inside its source group, then broadcast it whole from one training rank to every
//!   inference rank, bucket by bucket.
//! - [`lower_bound`] gives the physical floor (forwarding allowed) and the floor of direct
//!   plans: bytes that must enter or leave each NVLink domain and each GPU, divided by the
//!   rated bandwidth there.
//!
//! The model, its parameters, their sources and where it is uncertain are in
//! `docs/simulator.md`. Everything here is pure computation on plain data: no I/O,
//! deterministic (trials draw from a seed); [`simulate_with`] runs its trials on scoped
//! threads; all functions are safe to call from several threads.

mod baseline;
mod bound;
pub mod calibrate;
mod cluster;
mod fabric;
mod flows;
mod m2n;
mod peers;
mod reshard;

pub use baseline::{
    gather_broadcast, gather_broadcast_with, BaselineParams, BroadcastGroup, NEMO_RL_PER_TENSOR_S,
};
pub use bound::{lower_bound, lower_bound_converted, Bound, BoundKind, LowerBound};
pub use cluster::Cluster;
pub use m2n::{m2n, LoadBalance, M2nAlgorithm, M2nParams, M2nReport, Schedule, M2N_CALL_S};
pub use peers::{is_feed_forward, nemo_rl_reshard, ENGINE_POSTPROCESS_S};
pub use reshard::{simulate, simulate_with, SimOptions};

use std::fmt;

/// Which kind of link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkKind {
    NvLink,
    Nic,
}

/// Which way data crosses a link, seen from its GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Egress,
    Ingress,
}

/// How much one link of one GPU was used.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkUse {
    /// The GPU (= rank) the link belongs to.
    pub rank: u32,
    pub kind: LinkKind,
    pub direction: Direction,
    /// Bytes that crossed the link.
    pub bytes: u64,
    /// Time the link was busy at full bandwidth over the whole estimated time (0..1).
    pub busy_fraction: f64,
}

impl fmt::Display for LinkUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            LinkKind::NvLink => "NVLink",
            LinkKind::Nic => "NIC",
        };
        let direction = match self.direction {
            Direction::Egress => "egress",
            Direction::Ingress => "ingress",
        };
        write!(
            f,
            "rank {} {kind} {direction}: {:.1} GB, {:.0} % busy",
            self.rank,
            self.bytes as f64 / 1e9,
            self.busy_fraction * 100.0
        )
    }
}

/// One named part of an estimate. For [`simulate`] these are maxima over ranks (`prepare`:
/// local copies and packs; `transfer`: the longest time a rank spends with messages in flight;
/// `unpack`), so they need not add up to the total. For [`gather_broadcast`] they are sums
/// over buckets, which overlap through double buffering.
#[derive(Clone, Debug, PartialEq)]
pub struct Phase {
    pub name: &'static str,
    pub seconds: f64,
}

/// An estimate of one way of moving the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Wall-clock seconds from the start until the last rank is done.
    pub time_s: f64,
    /// Bytes sent over NVLink or a NIC (each byte counted once per receiving GPU).
    pub bytes_total: u64,
    /// Of those, bytes between GPUs on different nodes.
    pub bytes_offnode: u64,
    /// Bytes copied locally on colocated ranks (never on a link).
    pub bytes_local: u64,
    /// Messages posted (for the baseline: collective calls).
    pub messages_total: u64,
    /// Most messages one rank posts, sends and receives together (baseline: collective calls
    /// one rank joins).
    pub messages_max_per_rank: u64,
    /// Mean over the ranks taking part.
    pub messages_mean_per_rank: f64,
    /// Most bytes one rank sends or receives (the larger of the two).
    pub bytes_max_per_rank: u64,
    /// The link with the highest busy fraction; `None` when nothing crossed a link.
    pub busiest_link: Option<LinkUse>,
    /// Bytes through each GPU's NIC as (rank, egress, ingress), for ranks whose NIC carried
    /// any (the run without jitter; with PXN a byte leaves on the receiver's rail, through a
    /// node mate's NIC); empty where the method does not simulate links per GPU.
    pub nic_bytes: Vec<(u32, u64, u64)>,
    pub phases: Vec<Phase>,
    /// The 90th percentile of the time over the Monte Carlo trials (`time_s` when there were
    /// none).
    pub p90_s: f64,
    /// Monte Carlo trials behind `time_s` (their median) and `p90_s`; 0: one run without
    /// jitter.
    pub trials: u32,
    /// One-time costs before the first call (connections to every peer, kernel compilation),
    /// not part of `time_s`.
    pub setup_s: f64,
    /// Device memory of the rank that needs the most; `None` where the method's memory is not
    /// modelled.
    pub memory: Option<MemoryUse>,
    /// Where the last rank's time went (the run without jitter); `None` for methods that are
    /// not simulated per rank program.
    pub critical: Option<CriticalPath>,
    /// Each round's busiest link against the busiest link's whole load (the run without
    /// jitter); `None` for methods that are not simulated per rank program.
    pub rounds: Option<RoundsProfile>,
}

/// How evenly the rounds load the links (docs/simulator.md §7, "Rounds"). A rank's round ends
/// when its last flow does, and a flow starts only once both its ends have entered its round,
/// so where every rank pairs with many others in every round (an all-to-all refit) the ranks'
/// rounds are coupled. If they moved from round to round together, each round would last at
/// least as long as its busiest link needs for that round's bytes:
/// [`lockstep_s`](Self::lockstep_s), the sum of those, against `busiest_total_s`, what the
/// busiest link needs for all its bytes, is what uneven rounds would cost, whatever happens
/// inside a round. Ranks are not strictly
/// in lockstep (a rank whose peers are done enters its next round), so they can take less
/// than `lockstep_s`; ranks that share no peer are not coupled at all.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundsProfile {
    /// One entry per round that moves bytes over a GPU link, in round order (relays of a
    /// round's data move in the round after it, so a plan with relays has one more).
    pub rounds: Vec<RoundLoad>,
    /// The most seconds any GPU link needs for its bytes of all rounds at achievable speed.
    pub busiest_total_s: f64,
}

impl RoundsProfile {
    /// The rounds' busiest links' seconds, summed: the transfers' time if all ranks moved
    /// from round to round together and each round's flows ended together on its busiest
    /// link.
    pub fn lockstep_s(&self) -> f64 {
        self.rounds.iter().map(|r| r.seconds).sum()
    }

    /// [`lockstep_s`](Self::lockstep_s) − `busiest_total_s`: what uneven rounds cost ranks
    /// that move in lockstep (0 when one link is the busiest of every round).
    pub fn unevenness_s(&self) -> f64 {
        (self.lockstep_s() - self.busiest_total_s).max(0.0)
    }
}

/// One round's busiest GPU link: the one whose bytes of that round take longest at its
/// achievable speed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundLoad {
    /// The round, as the programs number them.
    pub round: u32,
    /// The GPU (= rank) the link belongs to.
    pub rank: u32,
    pub kind: LinkKind,
    pub direction: Direction,
    /// The round's bytes through the link.
    pub bytes: u64,
    /// Those bytes at the link's achievable speed.
    pub seconds: f64,
}

/// The critical path of a simulated reshard: the rank that finishes last, its clock split into
/// what it spent on (docs/simulator.md §7, "Where the time goes"). The parts sum to its finish
/// time (`packs_s + conversions_s + waits_s + transfers_s + unpacks_s + late_tail_s`, unpacks
/// including receiver-side conversions). Inside `transfers_s`: `rated_s` (the rank's bytes at
/// rated speed), `efficiency_s` (what link efficiency adds to them) and `latency_s` (per round,
/// the latency before any of its bytes move); the rest is sharing links with other ranks'
/// flows, incast and waiting for peers to reach a round.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CriticalPath {
    pub rank: u32,
    /// Packs and local copies on the caller's stream, before each round's transfers.
    pub packs_s: f64,
    /// Sender-side and receiver-side conversion kernels.
    pub conversions_s: f64,
    /// Waiting to start a round once packed: for the host to post it, for late unpacks whose
    /// staging the round reuses, for the senders' barrier's mates, and jitter.
    pub waits_s: f64,
    /// Inside `waits_s`: at the senders' barriers, from arriving until every mate had and the
    /// barrier's messages were through (`barrier_s` of its rounds, and of the barriers after
    /// its last round; 0 outside a barrier).
    pub barrier_s: f64,
    /// From a round's start until its last flow is done: bytes over shared links, at achievable
    /// speed, plus per-message latencies and waiting for peers to reach the round.
    pub transfers_s: f64,
    /// The per-message latencies inside `transfers_s` that no byte of the rank overlaps: per
    /// round, the shortest of its pairs' (their other latencies overlap with bytes moving).
    pub latency_s: f64,
    /// What link efficiency (NCCL's achievable against rated speed) adds to `rated_s`.
    pub efficiency_s: f64,
    /// The rank's own bytes at rated speed on its busiest port: what `transfers_s` would be
    /// with no other traffic, full link efficiency and no latency (the rest is link
    /// efficiency, sharing with other ranks' flows, incast and waiting for peers).
    pub rated_s: f64,
    /// Inside `transfers_s`, past its bytes, efficiency and latency: per round, how long after
    /// the rank was ready its last peer there was (when the round's last flow could start),
    /// at most what the round took beyond the rank's own bytes of it at achievable speed on
    /// its busiest port and its latency. Rounds are coupled through peers: a sender enters
    /// round `k + 1` only when its last receiver of round `k` is done, so a receiver that
    /// finished early waits for it (docs/simulator.md §7, "Where the time goes").
    pub peers_s: f64,
    /// Unpacks before the next round.
    pub unpacks_s: f64,
    /// Late unpacks still running after the last round's transfers.
    pub late_tail_s: f64,
    /// The same rank round by round, every round of the plan in order (rounds it has no
    /// flows in included): where each round's time went, and which peer it waited for.
    pub rounds: Vec<CriticalRound>,
}

/// One round of the [`CriticalPath`]'s rank. Times are from the start of the call; the
/// rank's `transfers_s` is the sum of `done_s − ready_s`, its `unpacks_s` of `unpack_s`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CriticalRound {
    /// The plan's round number.
    pub round: u32,
    /// When the rank entered the round (its previous round's unpacks done).
    pub entered_s: f64,
    /// When its flows could start: packed, posted, past the late unpacks whose staging the
    /// round reuses, and past the senders' barriers before the round.
    pub ready_s: f64,
    /// Of `ready_s − entered_s`: at the senders' barriers before the round, from arriving
    /// (packed and posted) until every mate had and the barrier's messages were through (0
    /// outside a barrier, docs/executor.md, "The senders' barrier").
    pub barrier_s: f64,
    /// When its last flow of the round was done (`ready_s` where it has none).
    pub done_s: f64,
    /// Its own bytes of the round at achievable speed on its busiest port: what `done_s −
    /// ready_s` would be with no other traffic and no waiting.
    pub own_s: f64,
    /// The peer of the round that was ready last (`None`: no flows), and how long after
    /// this rank (0 if before it): while it was not there, its flows with this rank could
    /// not start.
    pub last_peer: Option<u32>,
    pub last_peer_after_s: f64,
    /// Unpacks on the call's stream after the transfers, before the next round.
    pub unpack_s: f64,
    /// Unpacks beside the next round, on the side stream.
    pub late_unpack_s: f64,
    /// The rank's flows (one per peer and direction) in the round.
    pub flows: usize,
}

/// Device memory a rank needs for one call besides its weights, against what is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    pub rank: u32,
    /// The rank's staging arena (its largest round's).
    pub staging_bytes: u64,
    /// NCCL's buffers for the rank's point-to-point connections.
    pub nccl_bytes: u64,
    /// The rank's conversion workspace (tensors cast or quantized on the way): converted
    /// source data and received data waiting for conversion.
    pub work_bytes: u64,
    /// [`Cluster::free_memory_bytes`].
    pub free_bytes: u64,
}

impl MemoryUse {
    pub fn total(&self) -> u64 {
        self.staging_bytes
            .saturating_add(self.nccl_bytes)
            .saturating_add(self.work_bytes)
    }

    pub fn fits(&self) -> bool {
        self.total() <= self.free_bytes
    }
}

impl SimReport {
    /// False when a rank's staging and NCCL buffers exceed its free memory: the call was not
    /// simulated and `time_s` is infinite.
    pub fn fits(&self) -> bool {
        self.memory.map_or(true, |m| m.fits())
    }

    /// Seconds of the phase named `name`, if present.
    pub fn phase(&self, name: &str) -> Option<f64> {
        self.phases
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.seconds)
    }
}

/// A small deterministic random source (SplitMix64) for the Monte Carlo trials, so that a
/// seed gives the same estimate on every machine.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Exponentially distributed with the given mean (0 when the mean is 0).
    pub fn exp(&mut self, mean: f64) -> f64 {
        if mean > 0.0 {
            -mean * self.unit().ln()
        } else {
            0.0
        }
    }
}

/// The median and the 90th percentile (nearest rank) of `samples`.
pub(crate) fn median_p90(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let median = if n % 2 == 1 {
        samples[n / 2]
    } else {
        0.5 * (samples[n / 2 - 1] + samples[n / 2])
    };
    let p90 = samples[((0.9 * n as f64).ceil() as usize).clamp(1, n) - 1];
    (median, p90)
}
