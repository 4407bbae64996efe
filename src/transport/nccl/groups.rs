//! What travels over NCCL: each round's sends and receives as one NCCL group on the caller's
//! communicator and stream, and before them the plans' fingerprints, one per peer.

use super::deadline::Guard;
use super::library::{Nccl, NcclComm, NCCL_UINT8};
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::gpu::{CallMemory, DeviceBuffer, Event, Exchange};
use crate::plan::{Message, Round};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Default for how long `NCCL_RESHARD_CHECK=1` waits for the peers' fingerprints
/// (`NCCL_RESHARD_CHECK_TIMEOUT`, seconds).
const CHECK_TIMEOUT_SECONDS: u64 = 300;

/// The rounds of one call as NCCL groups (the exchange of `gpu::DeviceCall`).
pub(super) struct Groups<'a> {
    pub nccl: &'a Nccl,
    pub comm: NcclComm,
    pub stream: sys::CUstream,
    pub rank: u32,
    /// The rank's rounds (for messages).
    pub rounds: usize,
    /// The call's deadline, if it has one: nothing is posted once the communicator is revoked,
    /// and every group is marked on the stream as a stage of the call.
    pub guard: Option<&'a Guard>,
}

impl Groups<'_> {
    /// Posts one group: `post` its operations between `ncclGroupStart` and `ncclGroupEnd`, as
    /// `stage` of a call with a deadline (refused once its communicator is revoked, marked on
    /// the stream once issued).
    fn group(&self, stage: &str, post: impl FnOnce() -> Result<()>) -> Result<()> {
        let (nccl, comm) = (self.nccl, self.comm);
        if let Some(guard) = self.guard {
            guard.posting(stage);
        }
        let posted = {
            let _lock = self.guard.map(Guard::post_lock);
            if self.guard.is_some_and(Guard::revoked) {
                return Err(self.guard.map(Guard::revoked_error).expect("guarded"));
            }
            // SAFETY: group calls have no preconditions; the Start is matched by the End below.
            nccl.check(unsafe { (nccl.group_start)() }, "ncclGroupStart", comm)?;
            post()
        };
        // SAFETY: closes the group opened above, also after an error so NCCL's state stays
        // sane; a nonblocking communicator is waited for before anything else is enqueued
        // (unless the deadline's watchdog revokes it meanwhile). Not under the post lock: the
        // end may wait for peers, which the revoke is there to end.
        let ended =
            nccl.check_issued_unless(unsafe { (nccl.group_end)() }, "ncclGroupEnd", comm, &|| {
                self.guard.is_some_and(Guard::revoked)
            });
        let result = posted.and(ended);
        match self.guard {
            Some(guard) if guard.revoked() => Err(guard.revoked_error()),
            Some(guard) => result.and_then(|()| guard.mark(self.stream, stage.to_string())),
            None => result,
        }
    }
}

/// The distinct peers of a round's messages, ascending.
fn peers_of(round: &Round<'_>) -> Vec<u32> {
    let mut peers: Vec<u32> = round
        .sends
        .iter()
        .chain(round.recvs)
        .map(|m| m.peer)
        .collect();
    peers.sort_unstable();
    peers.dedup();
    peers
}

impl Exchange for Groups<'_> {
    fn exchange(&mut self, k: usize, round: &Round<'_>, memory: &CallMemory<'_>) -> Result<()> {
        if round.sends.is_empty() && round.recvs.is_empty() {
            return Ok(());
        }
        let (nccl, comm, stream, rank) = (self.nccl, self.comm, self.stream, self.rank);
        let stage = if let Some(step) = round.barrier {
            format!(
                "step {step} of the senders' barrier before round {} with node mates {:?}",
                round.round,
                peers_of(round)
            )
        } else {
            format!(
                "round {} (the rank's {} of {}) with peers {:?}",
                round.round,
                k + 1,
                self.rounds,
                peers_of(round)
            )
        };
        let post = |m: &Message, send: bool| -> Result<()> {
            let ptr = memory.address(m.loc) as *mut c_void;
            debug::log(Level::Trace, || {
                format!(
                    "rank {rank} round {} {} {} bytes {} rank {} at {ptr:p}",
                    round.round,
                    if send { "sends" } else { "receives" },
                    m.bytes,
                    if send { "to" } else { "from" },
                    m.peer
                )
            });
            let bytes =
                usize::try_from(m.bytes).map_err(|_| Error::invalid_usage("message too large"))?;
            // SAFETY: ptr addresses `bytes` bytes inside the caller's buffers or our staging,
            // per the plan; NCCL reads/writes them in stream order.
            let result = unsafe {
                if send {
                    (nccl.send)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream.cast())
                } else {
                    (nccl.recv)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream.cast())
                }
            };
            nccl.check_posted(result, if send { "ncclSend" } else { "ncclRecv" }, comm)
        };
        self.group(&stage, || {
            round
                .sends
                .iter()
                .try_for_each(|m| post(m, true))
                .and_then(|()| round.recvs.iter().try_for_each(|m| post(m, false)))
        })
    }
}

/// The plan's fingerprint on the device (8 bytes), sent to every peer, and one 8-byte slot per
/// peer (in `peers` order) for theirs.
pub(super) struct Fingerprints<'a> {
    pub mine: &'a DeviceBuffer,
    pub theirs: &'a DeviceBuffer,
}

impl Groups<'_> {
    /// One NCCL group with, per peer, our fingerprint's send and the receive of theirs into
    /// its slot.
    pub fn exchange_fingerprints(&self, peers: &[u32], buffers: &Fingerprints<'_>) -> Result<()> {
        let (nccl, comm, stream) = (self.nccl, self.comm, self.stream);
        let stage = format!("the fingerprint exchange with peers {peers:?}");
        self.group(&stage, || {
            peers.iter().enumerate().try_for_each(|(i, &peer)| {
                let slot = (buffers.theirs.ptr + 8 * i as u64) as *mut c_void;
                let mine = buffers.mine.ptr as *mut c_void;
                // SAFETY: both buffers are the plan's, 8 bytes per slot, alive as long as the plan
                // (the caller must not destroy it before the stream passes this call).
                unsafe {
                    nccl.check_posted(
                        (nccl.send)(mine, 8, NCCL_UINT8, peer as i32, comm, stream.cast()),
                        "ncclSend (fingerprint)",
                        comm,
                    )?;
                    nccl.check_posted(
                        (nccl.recv)(slot, 8, NCCL_UINT8, peer as i32, comm, stream.cast()),
                        "ncclRecv (fingerprint)",
                        comm,
                    )
                }
            })
        })
    }

    /// `NCCL_RESHARD_CHECK=1`: waits for the fingerprints just exchanged (at most
    /// `NCCL_RESHARD_CHECK_TIMEOUT` seconds) and fails naming the first peer whose plan
    /// differs, before any data moves. The caller made sure no NCCL group is open and the
    /// stream is not being captured.
    pub fn verify_fingerprints(
        &self,
        peers: &[u32],
        fingerprint: u64,
        buffers: &Fingerprints<'_>,
    ) -> Result<()> {
        let (rank, stream) = (self.rank, self.stream);
        let arrived = Event::new()?;
        arrived.record(stream)?;
        let timeout = std::env::var("NCCL_RESHARD_CHECK_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(CHECK_TIMEOUT_SECONDS);
        let start = Instant::now();
        while !arrived.is_done()? {
            if start.elapsed() > Duration::from_secs(timeout) {
                return Err(Error::invalid_usage(format!(
                    "rank {rank}: NCCL_RESHARD_CHECK=1: the fingerprints of peers {peers:?} did not arrive within {timeout} s (NCCL_RESHARD_CHECK_TIMEOUT); a peer does not call this plan, or planned a different set of peers; the communicator may now hold unmatched operations"
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut fingerprints = vec![0u64; peers.len()];
        buffers.theirs.download(&mut fingerprints, stream)?;
        for (&peer, &theirs) in peers.iter().zip(&fingerprints) {
            if theirs != fingerprint {
                return Err(Error::invalid_usage(format!(
                    "rank {peer} created its plan from different tensors or config than rank {rank} (fingerprint {theirs:#018x} vs {fingerprint:#018x}); every rank must pass the same descriptors and config"
                )));
            }
        }
        debug::log(Level::Info, || {
            format!(
                "rank {rank}: NCCL_RESHARD_CHECK: {} peer(s) planned the same ({fingerprint:#018x})",
                peers.len()
            )
        });
        Ok(())
    }
}

/// A program without messages (local copies and conversions only) needs no NCCL.
impl Exchange for Option<Groups<'_>> {
    fn exchange(&mut self, k: usize, round: &Round<'_>, memory: &CallMemory<'_>) -> Result<()> {
        match self {
            Some(groups) => groups.exchange(k, round, memory),
            None => Ok(()),
        }
    }
}
