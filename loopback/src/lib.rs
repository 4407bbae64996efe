//! A test-only NCCL stand-in that runs the ranks of a communicator as threads of one process on
//! one GPU (or any devices), which NCCL refuses: each rank's `ncclSend`/`ncclRecv` are matched
//! with its peer's in issue order, the bytes move by a copy kernel of its own (`copy`) on one of
//! the two ranks' streams, and stream memory operations (`cuStreamWaitValue32_v2` and
//! `cuStreamWriteValue32_v2` on flags in pinned host memory) order them as NCCL's kernels
//! would: a copy starts once both streams have reached their group, and no stream passes a
//! group before all its copies are done. It loads the CUDA driver at run time, so it runs on a real driver and on the emulator
//! (emu/) alike, and it is captured into CUDA graphs like any stream work.
//!
//! It is never linked into libncclreshard: scripts/build-loopback.sh installs it as
//! `libnccl.so.2` for tests (loopback/README.md: what it emulates, how strictly, what not).
//! Layout: `api` (the C entry points), `group` (groups and issuing), `exchange` (matching and
//! the rendezvous protocol), `comm` (communicators, cliques, revoke), `flags` (the pinned flag
//! pool), `copy` (the copy kernel), `cuda` (the driver), `watchdog` (hang reports), `report`
//! (results, texts, aborts).
#![allow(clippy::missing_safety_doc)]

pub mod api;
pub mod comm;
pub mod copy;
pub mod cuda;
pub mod exchange;
pub mod flags;
pub mod group;
pub mod report;
pub mod watchdog;

pub use api::*;
