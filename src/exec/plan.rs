//! [`Plan`]: one rank's plan, the object behind `ncclReshardPlan_t` and what Rust callers
//! create the same way (docs/design.md §3–§4). It owns every policy of plan creation, so every
//! caller gets the same programs, refusals and messages: the staging limit (the config's, or
//! `NCCL_RESHARD_STAGING_BYTES`, or 8 GiB), the program without late-unpack arenas when those
//! would pass it, the refusal naming staging when even that does not fit, and the limits of
//! the transport that will run the plan ([`Limits`]), all checked here, where every rank
//! refuses alike, rather than at a call, where a rank refusing after its peers posted their
//! messages would leave them waiting.

use super::buffers::RankViews;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::layout::{DType, TensorSpec};
use crate::plan::{
    overlap_unpacks, receive_in_place, Block, Config, DstRange, Mode, Planner, RankProgram,
    StridedConvert, Transfer,
};
use crate::quant::Conversion;
use std::sync::{Arc, OnceLock};

/// One tensor of a plan as a rank describes it: the tensor, what it becomes on its way, and
/// where this rank's views sit in the buffers of a single-buffer call (`ncclReshard`).
#[derive(Clone, Debug)]
pub struct PlanTensor {
    /// The tensor: shape, dtype, source and destination layouts.
    pub spec: TensorSpec,
    /// What the tensor becomes on its way (`None`: it arrives as it is).
    pub conversion: Option<Conversion>,
    /// Byte offset of this rank's source view in the call's source buffer.
    pub src_offset: u64,
    /// Byte offset of this rank's destination view in the call's destination buffer.
    pub dst_offset: u64,
    /// Byte offset of this rank's scale view (quantized tensors) in the destination buffer.
    pub scale_offset: u64,
    /// A name for messages (`tensors[3] (layers.0.wq)`).
    pub name: Option<String>,
}

impl PlanTensor {
    /// `spec` arriving as it is, its views at offset 0, unnamed.
    pub fn new(spec: TensorSpec) -> PlanTensor {
        PlanTensor {
            spec,
            conversion: None,
            src_offset: 0,
            dst_offset: 0,
            scale_offset: 0,
            name: None,
        }
    }
}

/// What a transport cannot run, stated by the transport and checked by [`Plan::new`] (and
/// [`rank_program`]) on every rank's program.
pub trait Limits: Sync {
    /// `Err` (`ncclInvalidUsage`, naming what is over which limit and what to change) when the
    /// transport cannot run `program`.
    fn check(&self, program: &RankProgram) -> Result<()>;
}

/// The limits of a transport that runs any program (the host executor).
pub struct NoLimits;

impl Limits for NoLimits {
    fn check(&self, _: &RankProgram) -> Result<()> {
        Ok(())
    }
}

/// How many bytes of staging plus conversion workspace a rank's program may address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingLimit(u64);

impl StagingLimit {
    /// The limit when neither the config nor the environment sets one.
    pub const DEFAULT_BYTES: u64 = 8 << 30;

    /// `configured` bytes (the config's `maxStagingBytes`); when 0, `NCCL_RESHARD_STAGING_BYTES`
    /// if set to a positive count, else [`StagingLimit::DEFAULT_BYTES`].
    pub fn new(configured: u64) -> StagingLimit {
        if configured > 0 {
            return StagingLimit(configured);
        }
        StagingLimit(
            std::env::var("NCCL_RESHARD_STAGING_BYTES")
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&v| v > 0)
                .unwrap_or(Self::DEFAULT_BYTES),
        )
    }

    /// The limit in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// The program plan creation gives `rank`: the planner's, with only as much of the late
/// unpacks' arenas as keeps the rank within `staging` (the same messages, the other unpacks
/// before the next round, docs/executor.md "Overlapping unpacks"); refused when even the
/// program without arenas does not fit, or when the transport's `limits` refuse it.
/// [`Plan::new`] is this plus the rank's views; tools that plan every rank with one planner
/// call it directly.
pub fn rank_program(
    planner: &Planner,
    rank: u32,
    staging: StagingLimit,
    limits: &dyn Limits,
) -> Result<RankProgram> {
    let sequential = planner.rank_program_sequential(rank)?;
    within(sequential, rank, staging, limits)
}

/// The program a single-buffer call (`ncclReshard`) of a rank whose destination views sit at
/// `dst` runs (view `t` at `dst[t]`, tensors then scale tensors; views that do not overlap):
/// [`rank_program`]'s, with its staged receives whose bytes would be unpacked, in order, onto
/// adjacent destination bytes landing there instead (docs/executor.md, "Receiving in place");
/// [`rank_program`]'s itself when there are none.
pub fn rank_program_placed(
    planner: &Planner,
    rank: u32,
    staging: StagingLimit,
    limits: &dyn Limits,
    dst: Option<&[Option<DstRange>]>,
) -> Result<RankProgram> {
    let sequential = planner.rank_program_sequential(rank)?;
    let placed = dst.and_then(|dst| receive_in_place(&sequential, dst));
    within(placed.unwrap_or(sequential), rank, staging, limits)
}

/// A program without late unpacks made into the program plan creation gives: its late
/// unpacks marked within `staging` (all of them, or as many as fit), checked.
fn within(
    sequential: RankProgram,
    rank: u32,
    staging: StagingLimit,
    limits: &dyn Limits,
) -> Result<RankProgram> {
    let limit = staging.bytes();
    let needs = |p: &RankProgram| p.staging_bytes.saturating_add(p.work_bytes);
    let mut program = sequential.clone();
    overlap_unpacks(&mut program, u64::MAX);
    if needs(&program) > limit && program.has_late_unpacks() {
        let staging = limit.saturating_sub(program.work_bytes);
        program = sequential;
        overlap_unpacks(&mut program, staging);
    }
    let needed = needs(&program);
    if needed > limit {
        return Err(Error::invalid_usage(format!(
            "the plan needs {needed} bytes of staging on rank {rank} (its largest round{}) but the limit is {limit}; raise config.rounds (more, smaller rounds), config.maxStagingBytes or NCCL_RESHARD_STAGING_BYTES, or plan in groupable mode (no staging)",
            if program.work_bytes > 0 {
                format!(", plus {} bytes of conversion workspace", program.work_bytes)
            } else {
                String::new()
            }
        )));
    }
    limits.check(&program)?;
    Ok(program)
}

/// A rank's part of its plan as data (`ncclReshardPlanGetTransfers`): its blocks, the
/// transfers they are cut into in export order (by round, then block, then offset in the
/// block), and its conversions before and after the rounds, with workspace locations naming
/// regions (`plan::region_of`).
#[derive(Clone, Debug)]
pub struct Export {
    /// Every box of data the rank sends, receives or copies locally (`Planner::rank_blocks`).
    pub blocks: Vec<Block>,
    /// The blocks' parts by round (`Transfer::block` indexes `blocks`), in export order.
    pub transfers: Vec<Transfer>,
    /// Conversions of what the rank sends (or copies locally), with the round of the first
    /// transfer that reads their output (they must be done before it), by round.
    pub converts_before: Vec<(u32, StridedConvert)>,
    /// Conversions the rank runs after the last round (a receiver's).
    pub converts_after: Vec<StridedConvert>,
}

/// One rank's plan: its program, its views (which check each call's buffers) and its planner.
/// Computed once at creation and immutable after, so shareable across threads; the export is
/// computed on first use, since only transports other than NCCL need it.
pub struct Plan {
    rank: u32,
    planner: Planner,
    program: Arc<RankProgram>,
    /// The single-buffer call's program where some of its receives land in place (its views
    /// sit back to back at their offsets), if it differs from `program`.
    placed: Option<Arc<RankProgram>>,
    views: RankViews,
    /// Each tensor's (source, destination) dtype.
    dtypes: Vec<(DType, DType)>,
    export: OnceLock<Export>,
}

impl Plan {
    /// Plans `rank`'s part of resharding `tensors` under `config`, within `staging`, for a
    /// transport with `limits`. Every rank passes the same tensors (but for its own offsets)
    /// and config; nothing is communicated. Errors name the field (`tensors[2].src: …`) or
    /// the limit and what to change.
    pub fn new(
        tensors: Vec<PlanTensor>,
        rank: u32,
        config: Config,
        staging: StagingLimit,
        limits: &dyn Limits,
    ) -> Result<Plan> {
        let n = tensors.len();
        let (mut specs, mut conversions) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut offsets, mut scale_offsets) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut names = Vec::with_capacity(n);
        for t in tensors {
            offsets.push((t.src_offset, t.dst_offset));
            scale_offsets.push(t.scale_offset);
            names.push(t.name);
            conversions.push(t.conversion);
            specs.push(t.spec);
        }
        let dtypes = specs
            .iter()
            .zip(&conversions)
            .map(|(s, c)| (s.dtype, c.as_ref().map_or(s.dtype, |c| c.dtype)))
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
        let sequential = planner.rank_program_sequential(rank)?;
        // A single-buffer call's views sit at the offsets: where they do not overlap, its
        // receives may land in place; the per-tensor call's views may sit anywhere.
        let placed = match views
            .dst_ranges()
            .and_then(|dst| receive_in_place(&sequential, &dst))
        {
            Some(placed) => Some(Arc::new(within(placed, rank, staging, limits)?)),
            None => None,
        };
        let program = Arc::new(within(sequential, rank, staging, limits)?);
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
        Ok(Plan {
            rank,
            planner,
            program,
            placed,
            views,
            dtypes,
            export: OnceLock::new(),
        })
    }

    /// [`Plan::new`] for the survivors of a failure: `failed` (ascending) are the ranks that
    /// are gone, in the numbering of `tensors` and `config`; the plan is for the communicator
    /// `ncclCommShrink` makes without them, on which `rank` is this survivor's rank (its old
    /// one less the failed ranks below it). Every survivor passes the same list. A tensor part
    /// a surviving destination needs that no survivor holds is refused alike on every rank.
    pub fn survivors(
        tensors: Vec<PlanTensor>,
        failed: &[u32],
        rank: u32,
        config: Config,
        staging: StagingLimit,
        limits: &dyn Limits,
    ) -> Result<Plan> {
        let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
        let conversions: Vec<Option<Conversion>> =
            tensors.iter().map(|t| t.conversion.clone()).collect();
        let (specs, conversions, config) =
            crate::plan::survivors(&specs, &conversions, &config, failed)?;
        let tensors = tensors
            .into_iter()
            .zip(specs.into_iter().zip(conversions))
            .map(|(t, (spec, conversion))| PlanTensor {
                spec,
                conversion,
                ..t
            })
            .collect();
        Plan::new(tensors, rank, config, staging, limits)
    }

    /// The rank this plan is for (its rank in the communicator that runs it).
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The config's mode (a plan is groupable iff made in [`Mode::Groupable`]).
    pub fn mode(&self) -> Mode {
        self.planner.config().mode
    }

    /// The planner of every rank's plan (the same on every rank).
    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// What the rank runs on every per-tensor call (`ncclReshardMulti`), and on every
    /// single-buffer call unless [`Plan::placed`] says otherwise.
    pub fn program(&self) -> &Arc<RankProgram> {
        &self.program
    }

    /// What the rank runs on a single-buffer call (`ncclReshard`) when it differs from
    /// [`Plan::program`]: the same messages, some receives landing in place in the views the
    /// tensors' destination offsets put back to back (docs/executor.md, "Receiving in place").
    pub fn placed(&self) -> Option<&Arc<RankProgram>> {
        self.placed.as_ref()
    }

    /// This rank's views and the rules a call's buffers must follow.
    pub fn views(&self) -> &RankViews {
        &self.views
    }

    /// Tensors of the plan.
    pub fn ntensors(&self) -> usize {
        self.dtypes.len()
    }

    /// Destination views of a call: the tensors', then their scales'.
    pub fn ndestinations(&self) -> usize {
        self.views.tensors().len()
    }

    /// Each tensor's (source, destination) dtype.
    pub fn dtypes(&self) -> &[(DType, DType)] {
        &self.dtypes
    }

    /// The rank's part of the plan as data, computed on first use.
    pub fn export(&self) -> Result<&Export> {
        if let Some(export) = self.export.get() {
            return Ok(export);
        }
        let blocks = self.planner.rank_blocks(self.rank)?;
        let mut transfers = self.planner.transfers(&blocks);
        transfers.sort_by_key(|t| (t.round, t.block, t.offset));
        let (converts_before, converts_after) = self
            .planner
            .conversion_steps(self.rank, &blocks, &transfers);
        // Another thread may have set it meanwhile: both computed the same.
        let _ = self.export.set(Export {
            blocks,
            transfers,
            converts_before,
            converts_after,
        });
        Ok(self.export.get().expect("set above"))
    }
}

// Plans are shared across threads.
const _: fn() = || {
    fn is<T: Send + Sync>() {}
    is::<Plan>();
};
