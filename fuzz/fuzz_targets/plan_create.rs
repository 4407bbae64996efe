//! Fuzzes the C API's plan entry points (see `ncclreshard_fuzz::plan_create`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ncclreshard_fuzz::plan_create::run(data);
});
