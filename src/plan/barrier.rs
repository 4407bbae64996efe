//! The senders' barrier (docs/executor.md, "The senders' barrier"): which ranks pass it
//! together, and the 8-byte messages it is made of.
//!
//! A rank that only sends enters round `r + 1` as soon as its own sends of round `r` are done.
//! Where the GPUs of a node share the NICs their network traffic leaves through (NCCL's PXN
//! routes a GPU's sends through the node mate whose NIC sits on the receiver's rail), one that
//! ran ahead shares those NICs with mates still in the round before, and the rounds of a node
//! drift apart. The barrier keeps a node's sending-only ranks in the same round: before each
//! round from the second, they pass a dissemination barrier: in step `s` of `⌈log2 n⌉` (one
//! group each, on the stream) member `i` sends 8 bytes to member `i + 2^s` and receives from
//! member `i − 2^s` (cyclically), so after the last step it has heard, directly or through
//! others, from every member having finished its rounds before. Each member talks to
//! `2 ⌈log2 n⌉` mates at most, not `n − 1` (NCCL opens a connection per peer).

use super::config::{Topology, AUTO_BARRIER_MIN_SENDERS};
use super::messages::staging_aligned;
use super::program::{Message, RankProgram};
use super::steps::{Buffer, Loc};

/// Bytes of one barrier message.
const BARRIER_MESSAGE_BYTES: u64 = 8;

/// The ranks passing the senders' barrier with `rank` (itself included, ascending), or none:
/// with the barrier not switched off (`setting`: [`Config::sender_barrier`]), a plan of at
/// least 2 rounds and a known node for `rank`, the sending-only ranks of its node
/// (`sends_only`), when it is one of them and they are at least 2 (switched on) or
/// [`AUTO_BARRIER_MIN_SENDERS`] (unset). `ranks` gives every rank of the plan; with ranks per
/// node the node's own ranks are looked at instead, so a rank's cost is its node's size.
///
/// [`Config::sender_barrier`]: super::Config::sender_barrier
pub(crate) fn members(
    rank: u32,
    setting: Option<bool>,
    rounds: u32,
    topology: &Topology,
    ranks: impl FnOnce() -> Vec<u32>,
    sends_only: impl Fn(u32) -> bool,
) -> Vec<u32> {
    if setting == Some(false) || rounds < 2 {
        return Vec::new();
    }
    let Some(node) = topology.node(rank) else {
        return Vec::new();
    };
    if !sends_only(rank) {
        return Vec::new();
    }
    let candidates: Vec<u32> = match *topology {
        Topology::RanksPerNode(n) => {
            let first = node.saturating_mul(n);
            (first..first.saturating_add(n)).collect()
        }
        _ => ranks(),
    };
    let members: Vec<u32> = candidates
        .into_iter()
        .filter(|&r| topology.node(r) == Some(node) && sends_only(r))
        .collect();
    let least = if setting == Some(true) {
        2
    } else {
        AUTO_BARRIER_MIN_SENDERS
    };
    if members.len() < least {
        return Vec::new();
    }
    members
}

/// Adds the barrier of `members` (ascending, `program.rank` among them) before every round
/// `1 .. rounds` of the plan to `program`: its slot and one per step after the staging the
/// program needs; per step `s`, an 8-byte send of its slot to the member `2^s` after it and a
/// receive from the member `2^s` before it into the step's slot. Nothing for fewer than 2
/// members or rounds.
pub(crate) fn add(program: &mut RankProgram, members: &[u32], rounds: u32) {
    let rank = program.rank;
    let Some(me) = members.iter().position(|&m| m == rank) else {
        return;
    };
    if members.len() < 2 || rounds < 2 {
        return;
    }
    let at = staging_aligned(program.staging_bytes);
    let slot = |i: usize| Loc {
        buffer: Buffer::Staging,
        tensor: 0,
        offset: at + BARRIER_MESSAGE_BYTES * i as u64,
    };
    let n = members.len();
    // Steps: ⌈log2 n⌉, the distances 2^s < n (all distinct mod n, so a pair meets at most
    // once per direction in a barrier).
    let distances: Vec<usize> = std::iter::successors(Some(1usize), |&d| d.checked_mul(2))
        .take_while(|&d| d < n)
        .collect();
    program.barrier_sends = distances
        .iter()
        .map(|&d| Message {
            peer: members[(me + d) % n],
            loc: slot(0),
            bytes: BARRIER_MESSAGE_BYTES,
        })
        .collect();
    program.barrier_recvs = distances
        .iter()
        .enumerate()
        .map(|(s, &d)| Message {
            peer: members[(me + n - d) % n],
            loc: slot(s + 1),
            bytes: BARRIER_MESSAGE_BYTES,
        })
        .collect();
    program.staging_bytes = at + BARRIER_MESSAGE_BYTES * (distances.len() as u64 + 1);
    program.barrier_members = members.to_vec();
    program.barrier_rounds = rounds;
}
