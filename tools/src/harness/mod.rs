//! Harnesses of the fuzz targets (docs/robustness.md).
//!
//! Each harness takes the fuzzer's bytes, drives the library and panics when a documented
//! promise is broken. The binaries in `fuzz/fuzz_targets/` only hand libFuzzer's input to
//! them; the library's `tests/fuzz_regressions.rs` calls the same functions to replay the seed
//! corpora and saved reproducers under plain `cargo test`, so both builds run one code path.

pub mod case_file;
pub mod plan_create;
