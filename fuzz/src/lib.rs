//! Harnesses of the fuzz targets (docs/robustness.md).
//!
//! Each harness takes the fuzzer's bytes, drives the library and panics when a documented
//! promise is broken. The binaries in `fuzz_targets/` only hand libFuzzer's input to them;
//! `tests/fuzz_regressions.rs` in the root crate includes these same files to replay the seed
//! corpora and saved reproducers under plain `cargo test`, so both builds run one code path.

pub mod case_file;
pub mod plan_create;
