//! Fuzzes the C API's plan entry points (see `ncclreshard_tools::harness::plan_create`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ncclreshard_tools::harness::plan_create::run(data);
});
