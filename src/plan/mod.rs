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
//! - `overlap.rs`: late unpacks, which may run beside the next round;
//! - `steps.rs`: the steps a program is made of ([`StridedCopy`], [`StridedConvert`]) and the
//!   locations they address; `config.rs`, `fingerprint.rs`, `loads.rs`: what plans depend on.

mod assign;
mod blocks;
mod config;
mod core;
mod fingerprint;
mod fxhash;
mod loads;
mod messages;
mod overlap;
mod planner;
mod program;
mod quantize;
mod rounds;
mod steps;

pub use assign::Assignment;
pub use blocks::Block;
pub use config::{
    Config, Mode, Topology, AUTO_DIRECT_PART_FRACTION, AUTO_MAX_ROUNDS, AUTO_MESSAGES_PER_RANK,
    AUTO_STAGE_MAX_AVG_BYTES, AUTO_STAGE_MAX_MESSAGES, AUTO_STAGE_MIN_MESSAGES,
    DEFAULT_SPLIT_MIN_BYTES, GROUPABLE_MAX_MESSAGES_PER_RANK, GROUPABLE_MAX_PIECES_PER_PAIR,
    MAX_ROUNDS, ROUND_TARGET_BYTES,
};
pub use fingerprint::fingerprint;
pub use messages::STAGING_ALIGN;
pub use planner::Planner;
pub use program::{ExecMode, Message, RankProgram, Round, RoundSpan};
pub use quantize::{region, region_of, WorkRegion};
pub use rounds::Transfer;
pub use steps::{Buffer, ConvertDim, CopyDim, Loc, StridedConvert, StridedCopy};
