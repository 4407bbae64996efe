//! The refit simulator (DESIGN §6): what a reshard would cost on a cluster we cannot run here.
//!
//! Three estimates from the same [`Cluster`] model:
//!
//! - [`simulate`] runs the real per-rank programs (from [`ncclreshard::Planner::rank_program`]):
//!   local copies and packs at HBM copy speed, then every (sender, receiver) pair's messages as
//!   one flow sharing NVLink or NIC links max-min fairly, then unpacks.
//! - [`gather_broadcast`] models the baseline NeMo RL, veRL and slime use: gather every tensor
//!   inside its source group, then broadcast it whole from one training rank to every
//!   inference rank, bucket by bucket.
//! - [`lower_bound`] is the physical floor: bytes that must enter or leave each NVLink domain
//!   and each GPU, divided by the bandwidth available there.
//!
//! The model, its parameters, their sources and where it is uncertain are in
//! `docs/simulator.md`. Everything here is pure computation on plain data: no I/O, no
//! threads, deterministic; all functions are safe to call from several threads.

mod baseline;
mod bound;
mod cluster;
mod flows;
mod reshard;

pub use baseline::{gather_broadcast, gather_broadcast_with, BaselineParams, BroadcastGroup};
pub use bound::{lower_bound, Bound, BoundKind, LowerBound};
pub use cluster::Cluster;
pub use reshard::simulate;

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
    pub phases: Vec<Phase>,
}

impl SimReport {
    /// Seconds of the phase named `name`, if present.
    pub fn phase(&self, name: &str) -> Option<f64> {
        self.phases
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.seconds)
    }
}
