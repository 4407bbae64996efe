//! The object behind `ncclReshardPlan_t`: the rank's program, its blocks and their
//! transfers (their per-round parts, exported as `ncclReshardTransfer_t`), its views (`exec::buffers::RankViews`, which check each
//! call's buffers) and its executor, computed once at creation and immutable after
//! (shareable across threads).

use super::convert::TensorInput;
use super::types::*;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::buffers::{CallBuffers, RankViews};
use crate::exec::cuda::CudaExecutor;
use crate::plan::{Block, Buffer, Config, Mode, Planner, RankProgram, Transfer};
use std::os::raw::c_int;
use std::sync::Arc;

/// Default bound on a rank's staging (`NCCL_RESHARD_STAGING_BYTES` overrides it, the config's
/// `maxStagingBytes` overrides both).
pub const DEFAULT_MAX_STAGING_BYTES: u64 = 8 << 30;

fn staging_limit(configured: u64) -> u64 {
    if configured > 0 {
        return configured;
    }
    std::env::var("NCCL_RESHARD_STAGING_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&v| v > 0)
        .unwrap_or(DEFAULT_MAX_STAGING_BYTES)
}

pub(crate) struct PlanObject {
    rank: u32,
    /// The config's mode (reported by `ncclReshardPlanGetInfo`).
    mode: Mode,
    program: Arc<RankProgram>,
    blocks: Vec<Block>,
    /// The blocks' transfers the program was formed from, in export order: by round,
    /// then block, then offset in the block.
    transfers: Vec<Transfer>,
    views: RankViews,
    executor: CudaExecutor,
}

impl PlanObject {
    pub fn new(
        inputs: Vec<TensorInput>,
        rank: u32,
        config: Config,
        max_staging_bytes: u64,
    ) -> Result<PlanObject> {
        let mut specs = Vec::with_capacity(inputs.len());
        let mut offsets = Vec::with_capacity(inputs.len());
        let mut names = Vec::with_capacity(inputs.len());
        for input in inputs {
            offsets.push((input.src_offset, input.dst_offset));
            names.push(input.name);
            specs.push(input.spec);
        }
        let planner = Planner::new(specs, config)?;
        let views = RankViews::new(rank, planner.tensors(), &offsets, names)?;
        let blocks = planner.rank_blocks(rank)?;
        let mut transfers = planner.transfers(&blocks);
        let program = Arc::new(planner.program_from_transfers(rank, &blocks, &transfers)?);
        transfers.sort_by_key(|t| (t.round, t.block, t.offset));
        // Checked here, not per call: a call refused on one rank after its peers posted their
        // messages would leave them waiting.
        let limit = staging_limit(max_staging_bytes);
        if program.staging_bytes > limit {
            return Err(Error::invalid_usage(format!(
                "the plan needs {} bytes of staging on rank {rank} (its largest round) but the limit is {limit}; raise config.rounds (more, smaller rounds), config.maxStagingBytes or NCCL_RESHARD_STAGING_BYTES, or plan in groupable mode (no staging)",
                program.staging_bytes
            )));
        }
        debug::log(Level::Info, || {
            format!(
                "plan for rank {rank}: {} tensors, {:?} mode, {} round(s), {} peers, {} sends ({} bytes), {} receives ({} bytes), {} bytes copied locally, {} staging bytes, fingerprint {:#018x}",
                views.tensors().len(),
                program.mode(),
                program.rounds().len(),
                program.peers().len(),
                program.sends.len(),
                program.bytes_sent(),
                program.recvs.len(),
                program.bytes_received(),
                program.bytes_copied_locally(),
                program.staging_bytes,
                program.fingerprint
            )
        });
        let mode = planner.config().mode;
        let executor = CudaExecutor::new(
            program.clone(),
            views.src_offsets(),
            views.dst_offsets(),
            mode == Mode::Groupable,
        );
        Ok(PlanObject {
            rank,
            mode,
            program,
            blocks,
            transfers,
            views,
            executor,
        })
    }

    pub fn ntensors(&self) -> usize {
        self.views.tensors().len()
    }

    /// This rank's views and the rules a call's buffers must follow.
    pub fn views(&self) -> &RankViews {
        &self.views
    }

    /// Runs the program on the caller's stream and communicator.
    pub fn execute(
        &self,
        buffers: &CallBuffers<'_>,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Result<()> {
        self.executor.execute(buffers, comm, stream)
    }

    pub fn info(&self) -> ncclReshardPlanInfo_t {
        let p = &self.program;
        ncclReshardPlanInfo_t {
            size: std::mem::size_of::<ncclReshardPlanInfo_t>(),
            version: super::NCCL_RESHARD_VERSION_CODE as u32,
            rank: self.rank as c_int,
            ntensors: self.ntensors() as c_int,
            mode: self.mode as c_int,
            groupable: c_int::from(self.mode == Mode::Groupable),
            peers: p.peers().len() as c_int,
            messagesSent: p.sends.len() as i64,
            messagesReceived: p.recvs.len() as i64,
            bytesSent: p.bytes_sent(),
            bytesReceived: p.bytes_received(),
            bytesCopied: p.bytes_copied_locally(),
            stagingBytes: p.staging_bytes,
            fingerprint: p.fingerprint,
            sendBytes: self.views.send_bytes(),
            recvBytes: self.views.recv_bytes(),
            rounds: p.rounds().len() as c_int,
        }
    }

    /// The C form of every transfer, in export order (see `ncclReshardTransfer_t`).
    pub fn transfers(&self) -> Result<Vec<ncclReshardTransfer_t>> {
        self.transfers
            .iter()
            .map(|transfer| {
                let b = &self.blocks[transfer.block];
                let (kind, peer) = if b.from == b.to {
                    (ncclReshardTransferKind_t::ncclReshardTransferLocal, b.to)
                } else if b.from == self.rank {
                    (ncclReshardTransferKind_t::ncclReshardTransferSend, b.to)
                } else {
                    (ncclReshardTransferKind_t::ncclReshardTransferRecv, b.from)
                };
                let src_view = match transfer.copy.src.buffer {
                    Buffer::Src => ncclReshardView_t::ncclReshardViewSource,
                    Buffer::Dst => ncclReshardView_t::ncclReshardViewDestination,
                    Buffer::Staging | Buffer::Work => {
                        return Err(Error::internal(format!(
                            "block {} of rank {} reads the staging arena",
                            transfer.block, self.rank
                        )))
                    }
                };
                let mut t = ncclReshardTransfer_t {
                    size: std::mem::size_of::<ncclReshardTransfer_t>(),
                    version: super::NCCL_RESHARD_VERSION_CODE as u32,
                    kind: kind as c_int,
                    peer: peer as c_int,
                    tensor: b.tensor as c_int,
                    ndim: b.start.len() as c_int,
                    srcOffset: transfer.copy.src.offset,
                    dstOffset: transfer.copy.dst.offset,
                    chunkBytes: transfer.copy.chunk_bytes,
                    copyNdim: transfer.copy.dims.len() as c_int,
                    bytes: transfer.copy.bytes(),
                    round: transfer.round as c_int,
                    srcView: src_view as c_int,
                    blockOffset: transfer.offset,
                    blockBytes: b.copy.bytes(),
                    ..Default::default()
                };
                for (d, (&s, &c)) in b.start.iter().zip(&b.count).enumerate() {
                    t.globalStart[d] = s as i64;
                    t.globalCount[d] = c as i64;
                }
                for (d, dim) in transfer.copy.dims.iter().enumerate() {
                    t.count[d] = dim.count as i64;
                    t.srcStride[d] = dim.src_stride as i64;
                    t.dstStride[d] = dim.dst_stride as i64;
                }
                Ok(t)
            })
            .collect()
    }
}
