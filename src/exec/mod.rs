//! What every transport shares (docs/design.md §4): the plan object and the policies of plan
//! creation ([`Plan`]), the contract about a call's buffers ([`buffers`]), and the one walk of a
//! rank's program that every transport runs ([`schedule`]). The transports themselves are in
//! `crate::transport`.

pub mod buffers;
mod plan;
pub mod schedule;

pub use plan::{
    rank_program, rank_program_placed, Export, Limits, NoLimits, Plan, PlanTensor, StagingLimit,
};
