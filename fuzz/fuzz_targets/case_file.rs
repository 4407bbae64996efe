//! Fuzzes the CLI's case-file parser, the planner and the host check (see
//! `ncclreshard_tools::harness::case_file`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ncclreshard_tools::harness::case_file::run(data);
});
