//! The planner: tensors + config + rank → that rank's [`RankProgram`] (docs/design.md §4–§5).
//! This file is only the index; planning starts at [`Planner`] (`planner.rs`) and walks down:
//!
//! - `planner.rs`: [`Planner`], the public planner: the core, the conversions, then the overlap
//!   pass on every program;
//! - `core.rs`: the core planner for tensors that arrive as they are: units (overlapping
//!   shards) → assignments (`assign.rs`) → blocks (`blocks.rs`) → transfers by round
//!   (`rounds.rs`) → messages (`messages.rs`) → the program (`program.rs`);
//! - `quantize.rs`: tensors that arrive in another dtype, planned as inner tensors of a core of
//!   their own, with conversion steps before and after the rounds;
//! - `barrier.rs`: the senders' barrier, which keeps a node's sending-only ranks in step;
//! - `overlap.rs`: late unpacks, which may run beside the next round (`bytesets.rs`: which
//!   strided reads and writes may share a byte);
//! - `survivors.rs`: the descriptors of the survivors of a failure (holes, renumbering) and
//!   the refusal when no survivor holds data a survivor needs;
//! - `steps.rs`: the steps a program is made of ([`StridedCopy`], [`StridedConvert`]) and the
//!   locations they address; `config.rs`, `fingerprint.rs`, `loads.rs`: what plans depend on.

mod assign;
mod barrier;
mod blocks;
mod bytesets;
mod config;
mod core;
mod fingerprint;
mod fxhash;
mod in_place;
mod loads;
mod messages;
mod overlap;
mod planner;
mod program;
mod quantize;
mod rounds;
mod steps;
mod survivors;

pub use assign::Assignment;
pub use blocks::Block;
pub use config::{
    Config, Mode, Topology, AUTO_BARRIER_MIN_SENDERS, AUTO_MESSAGES_PER_RANK,
    GROUPABLE_MAX_MESSAGES_PER_RANK, MAX_ROUNDS,
};
pub use in_place::DstRange;
pub use planner::Planner;
pub use program::{ExecMode, Message, RankProgram, Round, RoundSpan, ViewAfter};
pub use rounds::Transfer;
pub use steps::{Buffer, ConvertDim, CopyDim, Loc, StridedConvert, StridedCopy};
pub use survivors::survivors;

pub(crate) use config::DEFAULT_SPLIT_MIN_BYTES;
pub(crate) use in_place::receive_in_place;
pub(crate) use overlap::overlap_unpacks;
pub(crate) use quantize::{region_of, WorkRegion};
