//! The object behind `ncclReshardPlan_t`: the rank's program, its blocks and their per-round
//! parts (the exported transfers) and its view geometry, computed once at creation and
//! immutable after (shareable across threads).

use super::boundary::array;
use super::convert::{self, TensorInput};
use super::types::*;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::cuda::{CallBuffers, CudaExecutor};
use crate::layout::Side;
use crate::plan::{Block, BlockPart, Buffer, Config, Mode, Planner, RankProgram};
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

/// Where one tensor's views sit for this rank: (byte offset in the single-buffer call, bytes),
/// `None` when the rank has no view on that side.
#[derive(Clone, Copy, Debug, Default)]
struct Views {
    src: Option<(u64, u64)>,
    dst: Option<(u64, u64)>,
}

pub(crate) struct PlanObject {
    rank: u32,
    planner: Planner,
    program: Arc<RankProgram>,
    blocks: Vec<Block>,
    /// The blocks' per-round parts the program was formed from, in export order: by round,
    /// then block, then offset in the block.
    parts: Vec<BlockPart>,
    views: Vec<Views>,
    names: Vec<Option<String>>,
    executor: CudaExecutor,
}

/// Checks that no two of `ranges` (offset, bytes, tensor) overlap; `what` names the buffer.
fn check_disjoint(mut ranges: Vec<(u64, u64, usize)>, what: &str, field: &str) -> Result<()> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(Error::invalid_argument(format!(
                "tensors[{}].{field} = {}: its view overlaps tensor {}'s view in {what} (bytes [{}, {})); give each tensor its own byte range",
                w[1].2,
                w[1].0,
                w[0].2,
                w[0].0,
                w[0].0 + w[0].1
            )));
        }
    }
    Ok(())
}

impl PlanObject {
    pub fn new(
        inputs: Vec<TensorInput>,
        rank: u32,
        config: Config,
        max_staging_bytes: u64,
    ) -> Result<PlanObject> {
        let mut specs = Vec::with_capacity(inputs.len());
        let mut views = Vec::with_capacity(inputs.len());
        let mut names = Vec::with_capacity(inputs.len());
        for input in inputs {
            views.push((input.src_offset, input.dst_offset));
            names.push(input.name);
            specs.push(input.spec);
        }
        let planner = Planner::new(specs, config)?;
        let views: Vec<Views> = planner
            .tensors()
            .iter()
            .zip(views)
            .map(|(spec, (src_offset, dst_offset))| Views {
                src: spec
                    .rank_view(Side::Src, rank)
                    .map(|v| (src_offset, v.view.extent_bytes())),
                dst: spec
                    .rank_view(Side::Dst, rank)
                    .map(|v| (dst_offset, v.view.extent_bytes())),
            })
            .collect();
        for (i, v) in views.iter().enumerate() {
            for (side, view) in [("srcOffset", v.src), ("dstOffset", v.dst)] {
                if let Some((offset, extent)) = view {
                    offset
                        .checked_add(extent)
                        .filter(|&end| end <= i64::MAX as u64)
                        .ok_or_else(|| {
                            Error::invalid_argument(format!(
                                "tensors[{i}].{side} = {offset} puts the view past 2^63 bytes"
                            ))
                        })?;
                }
            }
        }
        let src_ranges = views
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.src.map(|(o, e)| (o, e, i)))
            .collect();
        check_disjoint(src_ranges, "sendbuff", "srcOffset")?;
        let dst_ranges = views
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.dst.map(|(o, e)| (o, e, i)))
            .collect();
        check_disjoint(dst_ranges, "recvbuff", "dstOffset")?;
        let blocks = planner.rank_blocks(rank)?;
        let mut parts = planner.block_parts(&blocks);
        let program = Arc::new(planner.program_from_parts(rank, &blocks, &parts)?);
        parts.sort_by_key(|p| (p.round, p.block, p.offset));
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
                views.len(),
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
        let executor = CudaExecutor::new(
            program.clone(),
            views.iter().map(|v| v.src.map_or(0, |(o, _)| o)).collect(),
            views.iter().map(|v| v.dst.map_or(0, |(o, _)| o)).collect(),
            planner.config().mode == Mode::Groupable,
        );
        Ok(PlanObject {
            rank,
            planner,
            program,
            blocks,
            parts,
            views,
            names,
            executor,
        })
    }

    pub fn ntensors(&self) -> usize {
        self.views.len()
    }

    pub fn needs_send_buffer(&self) -> bool {
        self.views.iter().any(|v| v.src.is_some_and(|(_, e)| e > 0))
    }

    pub fn needs_recv_buffer(&self) -> bool {
        self.views.iter().any(|v| v.dst.is_some_and(|(_, e)| e > 0))
    }

    fn send_bytes(&self) -> u64 {
        self.views
            .iter()
            .filter_map(|v| v.src.map(|(o, e)| o + e))
            .max()
            .unwrap_or(0)
    }

    fn recv_bytes(&self) -> u64 {
        self.views
            .iter()
            .filter_map(|v| v.dst.map(|(o, e)| o + e))
            .max()
            .unwrap_or(0)
    }

    fn tensor_name(&self, t: usize) -> String {
        match &self.names[t] {
            Some(name) => format!("tensors[{t}] ({name})"),
            None => format!("tensors[{t}]"),
        }
    }

    /// Buffers for the single-buffer call, after checking NULLs and overlap.
    pub fn single_buffers(&self, send: usize, recv: usize) -> Result<CallBuffers<'static>> {
        if send == 0 && self.needs_send_buffer() {
            return Err(Error::invalid_argument(format!(
                "sendbuff is NULL but rank {} holds source data of {}",
                self.rank,
                self.tensor_name(
                    self.views
                        .iter()
                        .position(|v| v.src.is_some_and(|(_, e)| e > 0))
                        .unwrap_or(0)
                )
            )));
        }
        if recv == 0 && self.needs_recv_buffer() {
            return Err(Error::invalid_argument(format!(
                "recvbuff is NULL but rank {} receives data of {}",
                self.rank,
                self.tensor_name(
                    self.views
                        .iter()
                        .position(|v| v.dst.is_some_and(|(_, e)| e > 0))
                        .unwrap_or(0)
                )
            )));
        }
        let (sb, rb) = (self.send_bytes() as usize, self.recv_bytes() as usize);
        if send != 0
            && recv != 0
            && sb > 0
            && rb > 0
            && send < recv.saturating_add(rb)
            && recv < send.saturating_add(sb)
        {
            return Err(Error::invalid_argument(format!(
                "sendbuff ({send:#x}, {sb} bytes) and recvbuff ({recv:#x}, {rb} bytes) overlap; in-place reshards are not supported"
            )));
        }
        Ok(CallBuffers::Single { send, recv })
    }

    /// Buffers for the per-tensor call, after checking NULLs and per-tensor overlap.
    pub fn multi_buffers<'a>(
        &self,
        send: &'a [usize],
        recv: &'a [usize],
    ) -> Result<CallBuffers<'a>> {
        let send_at = |t: usize| send.get(t).copied().unwrap_or(0);
        let recv_at = |t: usize| recv.get(t).copied().unwrap_or(0);
        for (t, v) in self.views.iter().enumerate() {
            let src = v.src.filter(|&(_, e)| e > 0);
            let dst = v.dst.filter(|&(_, e)| e > 0);
            if src.is_some() && send_at(t) == 0 {
                return Err(Error::invalid_argument(format!(
                    "sendbuffs[{t}] is NULL but rank {} holds source data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
            if dst.is_some() && recv_at(t) == 0 {
                return Err(Error::invalid_argument(format!(
                    "recvbuffs[{t}] is NULL but rank {} receives data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
            if let (Some((_, se)), Some((_, de))) = (src, dst) {
                let (s, d) = (send_at(t), recv_at(t));
                if s < d.saturating_add(de as usize) && d < s.saturating_add(se as usize) {
                    return Err(Error::invalid_argument(format!(
                        "sendbuffs[{t}] and recvbuffs[{t}] overlap; in-place reshards are not supported"
                    )));
                }
            }
        }
        Ok(CallBuffers::PerTensor { send, recv })
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
            ntensors: self.views.len() as c_int,
            mode: self.planner.config().mode as c_int,
            groupable: c_int::from(self.planner.config().mode == Mode::Groupable),
            peers: p.peers().len() as c_int,
            messagesSent: p.sends.len() as i64,
            messagesReceived: p.recvs.len() as i64,
            bytesSent: p.bytes_sent(),
            bytesReceived: p.bytes_received(),
            bytesCopied: p.bytes_copied_locally(),
            stagingBytes: p.staging_bytes,
            fingerprint: p.fingerprint,
            sendBytes: self.send_bytes(),
            recvBytes: self.recv_bytes(),
            rounds: p.rounds().len() as c_int,
        }
    }

    /// One transfer per part, in export order (see `ncclReshardTransfer_t`).
    pub fn transfers(&self) -> Result<Vec<ncclReshardTransfer_t>> {
        self.parts
            .iter()
            .map(|part| {
                let b = &self.blocks[part.block];
                let (kind, peer) = if b.from == b.to {
                    (ncclReshardTransferKind_t::ncclReshardTransferLocal, b.to)
                } else if b.from == self.rank {
                    (ncclReshardTransferKind_t::ncclReshardTransferSend, b.to)
                } else {
                    (ncclReshardTransferKind_t::ncclReshardTransferRecv, b.from)
                };
                let src_view = match part.copy.src.buffer {
                    Buffer::Src => ncclReshardView_t::ncclReshardViewSource,
                    Buffer::Dst => ncclReshardView_t::ncclReshardViewDestination,
                    Buffer::Staging => {
                        return Err(Error::internal(format!(
                            "block {} of rank {} reads the staging arena",
                            part.block, self.rank
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
                    srcOffset: part.copy.src.offset,
                    dstOffset: part.copy.dst.offset,
                    chunkBytes: part.copy.chunk_bytes,
                    copyNdim: part.copy.dims.len() as c_int,
                    bytes: part.copy.bytes(),
                    round: part.round as c_int,
                    srcView: src_view as c_int,
                    blockOffset: part.offset,
                    blockBytes: b.copy.bytes(),
                    ..Default::default()
                };
                for (d, (&s, &c)) in b.start.iter().zip(&b.count).enumerate() {
                    t.globalStart[d] = s as i64;
                    t.globalCount[d] = c as i64;
                }
                for (d, dim) in part.copy.dims.iter().enumerate() {
                    t.count[d] = dim.count as i64;
                    t.srcStride[d] = dim.src_stride as i64;
                    t.dstStride[d] = dim.dst_stride as i64;
                }
                Ok(t)
            })
            .collect()
    }
}

/// `ncclReshardLocalShape`'s body.
///
/// # Safety
/// Pointers are NULL or valid for the lengths the arguments state.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn local_shape(
    layout: *const ncclReshardLayout_t,
    ndim: c_int,
    shape: *const i64,
    rank: c_int,
    local_shape: *mut i64,
    runs: *mut i64,
    runs_capacity: c_int,
    runs_per_dim: *mut c_int,
) -> Result<()> {
    let n = usize::try_from(ndim)
        .ok()
        .filter(|&n| n <= NCCL_RESHARD_MAX_DIMS)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "ndim is {ndim}; it must be 0 to {NCCL_RESHARD_MAX_DIMS}"
            ))
        })?;
    // SAFETY: shape holds ndim entries.
    let global = unsafe { array(shape, n, "shape") }?;
    let mut c_tensor = ncclReshardTensor_t {
        ndim,
        src: layout,
        dst: layout,
        ..convert::default_tensor()
    };
    c_tensor.shape[..n].copy_from_slice(global);
    // SAFETY: c_tensor is a valid descriptor; its layout pointers are the caller's.
    let input = unsafe { convert::tensors(&c_tensor, 1) }
        .map_err(|e| Error {
            message: e
                .message
                .replace("tensors[0].src->", "layout->")
                .replace("tensors[0].", ""),
            ..e
        })?
        .pop()
        .ok_or_else(|| Error::internal("no tensor converted"))?;
    input.spec.validate().map_err(|e| Error {
        message: e.message.replace("src: ", "layout: "),
        ..e
    })?;
    let rank_u =
        u32::try_from(rank).map_err(|_| Error::invalid_argument(format!("rank is {rank}")))?;
    let indices = input
        .spec
        .src
        .rank_indices(&input.spec.shape, rank_u)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "rank {rank} is not in the layout's mesh; it has no local view"
            ))
        })?;
    if local_shape.is_null() && n > 0 {
        return Err(Error::invalid_argument("localShape is NULL"));
    }
    let total_runs: usize = indices.iter().map(|r| r.runs().len()).sum();
    if !runs.is_null() {
        if runs_per_dim.is_null() {
            return Err(Error::invalid_argument(
                "runs is given but runsPerDim is NULL",
            ));
        }
        if usize::try_from(runs_capacity).map_or(true, |c| c < total_runs) {
            return Err(Error::invalid_argument(format!(
                "runsCapacity is {runs_capacity} but {total_runs} runs are needed; call with runs = NULL to get runsPerDim first"
            )));
        }
    }
    // All checks passed: write outputs.
    for (d, r) in indices.iter().enumerate() {
        // SAFETY: localShape holds ndim entries.
        unsafe { local_shape.add(d).write(r.len() as i64) };
        if !runs_per_dim.is_null() {
            // SAFETY: runsPerDim holds ndim entries.
            unsafe { runs_per_dim.add(d).write(r.runs().len() as c_int) };
        }
    }
    if !runs.is_null() {
        let mut at = 0;
        for r in &indices {
            for run in r.runs() {
                // SAFETY: runs holds runsCapacity ≥ total_runs pairs.
                unsafe {
                    runs.add(2 * at).write(run.start as i64);
                    runs.add(2 * at + 1).write(run.end as i64);
                }
                at += 1;
            }
        }
    }
    Ok(())
}
