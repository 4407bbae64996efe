//! The object behind `ncclReshardPlan_t`: the rank's program, its views
//! (`exec::buffers::RankViews`, which check each call's buffers) and its executor, computed
//! once at creation and immutable after (shareable across threads); its blocks and their
//! transfers (their per-round parts, exported as `ncclReshardTransfer_t`) are computed on the
//! first `ncclReshardPlanGetTransfers`, since only transports other than NCCL need them.

use super::convert::TensorInput;
use super::types::*;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::buffers::{CallBuffers, RankViews};
use crate::exec::cuda::{descriptors, CudaExecutor};
use crate::plan::{
    region_of, Block, Buffer, Config, Loc, Mode, Planner, RankProgram, StridedConvert, Transfer,
    WorkRegion,
};
use std::os::raw::c_int;
use std::sync::{Arc, OnceLock};

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

/// A rank's blocks, their transfers in export order, and its conversions before and after the
/// rounds.
type Export = (
    Vec<Block>,
    Vec<Transfer>,
    (Vec<StridedConvert>, Vec<StridedConvert>),
);

pub(crate) struct PlanObject {
    rank: u32,
    /// The config's mode (reported by `ncclReshardPlanGetInfo`).
    mode: Mode,
    program: Arc<RankProgram>,
    planner: Planner,
    /// The rank's blocks, the transfers the program is formed from (one function of the
    /// blocks: `Planner::transfers`, in export order: by round, then block, then offset in the
    /// block) and its conversions before and after the rounds (exported form). Computed when
    /// first exported.
    export: OnceLock<Export>,
    /// The dtypes of each tensor's source and destination, for the export.
    dtypes: Vec<(i32, i32)>,
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
        let mut conversions = Vec::with_capacity(inputs.len());
        let mut offsets = Vec::with_capacity(inputs.len());
        let mut scale_offsets = Vec::with_capacity(inputs.len());
        let mut names = Vec::with_capacity(inputs.len());
        for input in inputs {
            offsets.push((input.src_offset, input.dst_offset));
            scale_offsets.push(input.scale_offset);
            names.push(input.name);
            conversions.push(input.conversion);
            specs.push(input.spec);
        }
        let dtypes = specs
            .iter()
            .zip(&conversions)
            .map(|(s, c)| {
                let dst = c.as_ref().map_or(s.dtype, |c| c.dtype);
                (s.dtype.nccl_code(), dst.nccl_code())
            })
            .collect();
        let planner = Planner::with_conversions(specs, conversions, config)?;
        let views = RankViews::with_conversions(
            rank,
            planner.tensors(),
            planner.conversions(),
            &offsets,
            &scale_offsets,
            names,
        )?;
        // The same program as program_from_transfers(rank_blocks, transfers), without listing
        // the blocks (tests/transfers.rs checks that they agree).
        let limit = staging_limit(max_staging_bytes);
        let mut program = planner.rank_program(rank)?;
        // Late unpacks' arenas add staging (docs/executor.md, "Overlapping unpacks"); past the
        // limit the rank runs every unpack before the next round instead (the same messages).
        if program.staging_bytes.saturating_add(program.work_bytes) > limit
            && program.has_late_unpacks()
        {
            program = planner.rank_program_sequential(rank)?;
        }
        let program = Arc::new(program);
        // Checked here, not per call: a call refused on one rank after its peers posted their
        // messages would leave them waiting.
        let needed = program.staging_bytes.saturating_add(program.work_bytes);
        if needed > limit {
            return Err(Error::invalid_usage(format!(
                "the plan needs {} bytes of staging on rank {rank} (its largest round{}) but the limit is {limit}; raise config.rounds (more, smaller rounds), config.maxStagingBytes or NCCL_RESHARD_STAGING_BYTES, or plan in groupable mode (no staging)",
                needed,
                if program.work_bytes > 0 {
                    format!(", plus {} bytes of conversion workspace", program.work_bytes)
                } else {
                    String::new()
                }
            )));
        }
        // The kernel's conversion tables grow with a box's segments (rows × blocks along the
        // last dim): bounded here, where every rank refuses alike, not at the first call.
        for (when, converts) in [
            ("before", &program.converts_before),
            ("after", &program.converts_after),
        ] {
            let (_, tiles) = descriptors::convert_tables(converts);
            if tiles > descriptors::MAX_CONVERT_TILES {
                return Err(Error::invalid_usage(format!(
                    "rank {rank}'s conversions {when} the rounds need {tiles} kernel tiles, more than {}: its boxes have too many rows or too narrow blocks for their size; use wider quantization blocks (quant.blockCols) or fewer elements per rank",
                    descriptors::MAX_CONVERT_TILES
                )));
            }
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
            planner,
            export: OnceLock::new(),
            dtypes,
            views,
            executor,
        })
    }

    pub fn ntensors(&self) -> usize {
        self.dtypes.len()
    }

    /// Destination views of a call: the tensors', then their scales'.
    pub fn ndestinations(&self) -> usize {
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
            scaleTensors: (self.ndestinations() - self.ntensors()) as c_int,
            workBytes: p.work_bytes,
        }
    }

    /// The rank's blocks, transfers in export order and conversions, computed on first use.
    fn export(&self) -> Result<&Export> {
        if let Some(export) = self.export.get() {
            return Ok(export);
        }
        let blocks = self.planner.rank_blocks(self.rank)?;
        let mut transfers = self.planner.transfers(&blocks);
        transfers.sort_by_key(|t| (t.round, t.block, t.offset));
        let converts = self.planner.conversion_steps(self.rank, &blocks);
        // Another thread may have set it meanwhile: both computed the same.
        let _ = self.export.set((blocks, transfers, converts));
        Ok(self.export.get().expect("set above"))
    }

    /// The C form of every transfer, in export order (see `ncclReshardTransfer_t`): the
    /// conversions before the rounds, the transfers by round, the conversions after them.
    pub fn transfers(&self) -> Result<Vec<ncclReshardTransfer_t>> {
        let (blocks, transfers, converts) = self.export()?;
        // A location as the export names it: (view, offset in it).
        let view_of = |loc: Loc| -> (ncclReshardView_t, u64) {
            let view = match loc.buffer {
                Buffer::Src => ncclReshardView_t::ncclReshardViewSource,
                Buffer::Dst | Buffer::Staging => ncclReshardView_t::ncclReshardViewDestination,
                Buffer::Work => match region_of(loc.tensor).1 {
                    WorkRegion::Converted => ncclReshardView_t::ncclReshardViewConverted,
                    WorkRegion::Scales => ncclReshardView_t::ncclReshardViewScales,
                    WorkRegion::Unconverted => ncclReshardView_t::ncclReshardViewUnconverted,
                },
            };
            (view, loc.offset)
        };
        // The element types of a block's bytes: the tensor's source dtype where they land
        // unconverted (in the receiver's workspace), else its destination dtype (its dtype
        // when it does not convert); scales move as bytes.
        let dtypes_of = |tensor: u32, dst: Loc| -> (c_int, c_int) {
            match self.dtypes.get(tensor as usize) {
                None => (NCCL_UINT8, NCCL_UINT8),
                Some(&(from, _)) if dst.buffer == Buffer::Work => (from, from),
                Some(&(_, to)) => (to, to),
            }
        };
        let mut out = Vec::new();
        let convert = |c: &StridedConvert, round: u32| -> ncclReshardTransfer_t {
            let (src_view, src_offset) = view_of(c.src);
            let (dst_view, dst_offset) = view_of(c.dst);
            let (scale_view, scale_offset) = c
                .scale
                .map_or((ncclReshardView_t::ncclReshardViewDestination, 0), view_of);
            let mut t = ncclReshardTransfer_t {
                size: std::mem::size_of::<ncclReshardTransfer_t>(),
                version: super::NCCL_RESHARD_VERSION_CODE as u32,
                kind: ncclReshardTransferKind_t::ncclReshardTransferConvert as c_int,
                peer: self.rank as c_int,
                tensor: c.tensor as c_int,
                ndim: c.dims.len() as c_int,
                srcOffset: src_offset,
                dstOffset: dst_offset,
                chunkBytes: 0,
                copyNdim: c.dims.len() as c_int,
                bytes: c.dst_bytes(),
                round: round as c_int,
                srcView: src_view as c_int,
                blockOffset: 0,
                blockBytes: c.dst_bytes(),
                dstView: dst_view as c_int,
                srcDtype: c.arithmetic.src.nccl_code(),
                dstDtype: c.arithmetic.dst.nccl_code(),
                scaleView: scale_view as c_int,
                scaleOffset: scale_offset,
                ..Default::default()
            };
            for (d, dim) in c.dims.iter().enumerate() {
                t.count[d] = dim.count as i64;
                t.srcStride[d] = dim.src_stride as i64;
                t.dstStride[d] = dim.dst_stride as i64;
                t.scaleStride[d] = dim.scale_stride as i64;
            }
            for (d, (&start, dim)) in c.start.iter().zip(&c.dims).enumerate() {
                t.globalStart[d] = start as i64;
                t.globalCount[d] = dim.count as i64;
            }
            t
        };
        for c in &converts.0 {
            out.push(convert(c, 0));
        }
        for transfer in transfers {
            let b = &blocks[transfer.block];
            let (kind, peer) = if b.from == b.to {
                (ncclReshardTransferKind_t::ncclReshardTransferLocal, b.to)
            } else if b.from == self.rank {
                (ncclReshardTransferKind_t::ncclReshardTransferSend, b.to)
            } else {
                (ncclReshardTransferKind_t::ncclReshardTransferRecv, b.from)
            };
            if transfer.copy.src.buffer == Buffer::Staging {
                return Err(Error::internal(format!(
                    "block {} of rank {} reads the staging arena",
                    transfer.block, self.rank
                )));
            }
            let (src_view, src_offset) = view_of(transfer.copy.src);
            let (dst_view, dst_offset) = view_of(transfer.copy.dst);
            let (src_dtype, dst_dtype) = dtypes_of(b.tensor, transfer.copy.dst);
            let mut t = ncclReshardTransfer_t {
                size: std::mem::size_of::<ncclReshardTransfer_t>(),
                version: super::NCCL_RESHARD_VERSION_CODE as u32,
                kind: kind as c_int,
                peer: peer as c_int,
                tensor: b.tensor as c_int,
                ndim: b.start.len() as c_int,
                srcOffset: src_offset,
                dstOffset: dst_offset,
                chunkBytes: transfer.copy.chunk_bytes,
                copyNdim: transfer.copy.dims.len() as c_int,
                bytes: transfer.copy.bytes(),
                round: transfer.round as c_int,
                srcView: src_view as c_int,
                blockOffset: transfer.offset,
                blockBytes: b.copy.bytes(),
                dstView: dst_view as c_int,
                srcDtype: src_dtype,
                dstDtype: dst_dtype,
                scaleView: ncclReshardView_t::ncclReshardViewDestination as c_int,
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
            out.push(t);
        }
        let last = self.program.rounds().last().map_or(0, |r| r.round + 1);
        for c in &converts.1 {
            out.push(convert(c, last));
        }
        Ok(out)
    }
}

/// `ncclUint8`: the type scales travel as in the export.
const NCCL_UINT8: c_int = 1;
