//! Replays the fuzz targets' seed corpora and saved reproducers through the targets' own
//! harnesses (`ncclreshard_tools::harness`, which the fuzz binaries call too), under plain
//! `cargo test` with no fuzzing flags. The seeds keep the decoders honest: if a change to the
//! library or to a decoder stops them from reaching a plan, these tests fail. See
//! docs/robustness.md.

use ncclreshard_tools::harness::{case_file, plan_create};

use std::path::{Path, PathBuf};

/// Every file in `fuzz/<dir>` (none when the folder does not exist), sorted by name.
fn inputs(dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(dir);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("readable folder entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// Runs `run` on each input, naming the input when it panics.
fn replay<T>(files: &[(PathBuf, Vec<u8>)], run: impl Fn(&[u8]) -> T) -> Vec<T> {
    files
        .iter()
        .map(|(path, bytes)| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(bytes)))
                .unwrap_or_else(|_| panic!("{} fails its harness (see above)", path.display()))
        })
        .collect()
}

#[test]
fn plan_create_seeds_reach_plans_transfers_and_local_shapes() {
    let seeds = inputs("corpus/plan_create");
    assert!(seeds.len() >= 8, "the plan_create seed corpus is missing");
    let outcomes = replay(&seeds, plan_create::run);
    let planned = outcomes.iter().filter(|o| o.planned).count();
    // Most seeds are valid reshards; a few carry one hostile field each and must be refused.
    assert!(
        planned * 2 > seeds.len(),
        "{planned} of {} seeds planned",
        seeds.len()
    );
    assert!(planned < seeds.len(), "no hostile seed was refused");
    assert!(outcomes.iter().any(|o| o.transfers > 1));
    assert!(outcomes.iter().any(|o| o.local_shapes > 1));
}

#[test]
fn case_file_seeds_parse_plan_and_check() {
    let seeds = inputs("corpus/case_file");
    assert!(seeds.len() >= 3, "the case_file seed corpus is missing");
    let outcomes = replay(&seeds, case_file::run);
    for ((path, _), outcome) in seeds.iter().zip(&outcomes) {
        assert!(
            outcome.cases > 0 && outcome.planned > 0,
            "{}: {outcome:?}",
            path.display()
        );
    }
    assert!(outcomes.iter().any(|o| o.checked > 0));
}

/// Every saved reproducer (`fuzz/regressions/<target>/<file>`), each replayed by its own test
/// below; a file there that is not listed fails `every_reproducer_has_a_test`.
const REPRODUCERS: [&str; 12] = [
    "plan_create/zero-dim-beside-huge-dims",
    "case_file/zero-dim-beside-huge-dims.json",
    "plan_create/huge-view-strides",
    "plan_create/sender-strides-past-2p63",
    "plan_create/bytes-sent-past-2p64",
    "plan_create/groupable-messages-per-rank",
    "plan_create/quantized-plan-transfers",
    "plan_create/conversion-tables-past-the-bound",
    "plan_create/scale-blocks-past-the-plans-tensors",
    "plan_create/zero-dim-conversion",
    "plan_create/failed-rank-far-past-the-meshes",
    "plan_create/pre-0.4-transfers-of-a-converting-plan",
];

fn reproducer(name: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    vec![(path, bytes)]
}

#[test]
fn every_reproducer_has_a_test() {
    for target in ["plan_create", "case_file"] {
        for (path, _) in inputs(&format!("regressions/{target}")) {
            let name = format!(
                "{target}/{}",
                path.file_name().unwrap_or_default().to_string_lossy()
            );
            assert!(
                REPRODUCERS.contains(&name.as_str()),
                "fuzz/regressions/{name} has no test in tests/fuzz_regressions.rs"
            );
        }
    }
}

/// A converting plan whose transfers are asked for with a 0.3-sized `ncclReshardTransfer_t`
/// (no dtype fields): the library refuses it, as documented, and the harness took that for a
/// wrong refusal (CI's seed-1 fuzz run, 2026-12-01).
#[test]
fn pre_0_4_transfer_structs_are_refused_for_a_converting_plan() {
    let outcomes = replay(
        &reproducer("plan_create/pre-0.4-transfers-of-a-converting-plan"),
        plan_create::run,
    );
    assert!(outcomes[0].planned, "{:?}", outcomes[0]);
}

/// A tensor of shape [0, 2^63 - 1, 3] (no elements, so accepted) on a 2-rank Shard(0) layout:
/// its dense local strides are 3 × (2^63 - 1), past 64 bits.
#[test]
fn zero_element_tensor_with_huge_dims_is_planned_or_refused() {
    replay(
        &reproducer("plan_create/zero-dim-beside-huge-dims"),
        plan_create::run,
    );
}

/// The same tensor as a case file: `Planner` and `check` reached the same overflow through the
/// Rust API (`ncclreshard check` panicked on it in a debug build).
#[test]
fn zero_element_case_with_huge_dims_is_planned_or_refused() {
    replay(
        &reproducer("case_file/zero-dim-beside-huge-dims.json"),
        case_file::run,
    );
}

/// A [1, 3] float64 tensor whose source layout gives element strides [2^62, 1]: the byte
/// stride of dim 0 is 2^65, although the view's extent (24 bytes) was accepted because dim 0
/// holds one element.
#[test]
fn huge_stride_on_a_single_element_dim_is_planned_or_refused() {
    replay(
        &reproducer("plan_create/huge-view-strides"),
        plan_create::run,
    );
}

/// A [2, 4] int8 tensor whose source view (one rank, Replicate) has strides [1, 2^62]: its
/// extent, 3 × 2^62 + 2 bytes, fits 64 bits but not the 63 offsets allow. The sender (rank 0)
/// refused the plan; the receiver (rank 1, planned here) did not check the sender's view and
/// overflowed merging the copy's dims (2^62 × 4).
#[test]
fn sender_view_past_2p63_is_planned_or_refused() {
    replay(
        &reproducer("plan_create/sender-strides-past-2p63"),
        plan_create::run,
    );
}

/// A 2^62-byte int8 tensor replicated from rank 0 to ranks 1–4: each tensor is within the
/// 2^63-byte limit, but rank 0 sends 2^64 bytes in all.
#[test]
fn plan_info_byte_totals_do_not_overflow() {
    replay(
        &reproducer("plan_create/bytes-sent-past-2p64"),
        plan_create::run,
    );
}

/// A 1 MiB int8 tensor replicated from rank 0 to 32 ranks whose destination views are strided
/// (element stride 2), in groupable mode: every element needs its own 1-byte message, 2^20 per
/// pair (within the per-pair limit) and 2^25 for rank 0, whose plan took over 2 GiB and 12 s
/// to build. No groupable plan can do with fewer messages, so rank 0 must refuse it (it does
/// since a85d9c4).
#[test]
fn groupable_plan_with_too_many_messages_per_rank_is_refused() {
    let outcomes = replay(
        &reproducer("plan_create/groupable-messages-per-rank"),
        plan_create::run,
    );
    assert!(!outcomes[0].planned, "{:?}", outcomes[0]);
}

/// Random inputs reach the conversion fields (`dstDtype`, `quant`, `scaleOffset`, decoded
/// last) and every library promise holds for them: plan creation, queries, transfers.
#[test]
fn random_inputs_with_conversions_keep_every_promise() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut planned, mut converting) = (0, 0);
    for _ in 0..3000 {
        let len = 32 + (next() % 480) as usize;
        // Mostly small bytes (typical values), some large ones (rare branches, hostile values).
        let data: Vec<u8> = (0..len)
            .map(|_| {
                let r = next();
                if r % 4 == 0 {
                    (r >> 8) as u8
                } else {
                    ((r >> 8) % 16) as u8
                }
            })
            .collect();
        let outcome = plan_create::run(&data);
        planned += usize::from(outcome.planned);
        converting += usize::from(outcome.converts);
    }
    assert!(
        planned > 0 && converting > 0,
        "{planned} planned, {converting} converting"
    );
}

/// A plan that quantizes (block scales in FP32): its export holds convert transfers (kind 3,
/// `bytes` = values then scales) and scale blocks (a tensor index past the tensors', moved as
/// bytes), which the harness's transfer check did not know.
#[test]
fn quantized_plans_export_convert_and_scale_transfers() {
    replay(
        &reproducer("plan_create/quantized-plan-transfers"),
        plan_create::run,
    );
}

/// A plan whose conversions have very many narrow segments (found by the CI fuzz run as an
/// out-of-memory: plan creation built the kernel's whole conversion tile list, 12 GB, to size
/// its scratch): now sized arithmetically and refused past `MAX_CONVERT_TILES`.
#[test]
fn conversion_tables_past_the_bound_are_refused_without_building_them() {
    replay(
        &reproducer("plan_create/conversion-tables-past-the-bound"),
        plan_create::run,
    );
}

/// Scale blocks are numbered after the plan's tensors, which may be fewer than the harness
/// described: the harness took such a block for a tensor's (its transfer check's mistake).
#[test]
fn scale_blocks_are_told_by_their_view_not_their_index() {
    replay(
        &reproducer("plan_create/scale-blocks-past-the-plans-tensors"),
        plan_create::run,
    );
}

/// A 0-d tensor converted (one element, no dims): the kernel's conversion tables took its
/// last dim (`n - 1` of 0 dims). Its box is now one dim of one element.
#[test]
fn a_zero_dim_conversion_is_one_element() {
    replay(
        &reproducer("plan_create/zero-dim-conversion"),
        plan_create::run,
    );
}

/// A survivors' plan (config.failedRanks [682557695, 6, 1]) with `ranksPerNode` 2 over meshes
/// of ranks 0-1: the survivors' topology was a node table up to the largest failed rank, 682
/// million entries (libFuzzer: out of memory, then a timeout); it is now sized by the list.
#[test]
fn a_failed_rank_far_past_the_meshes_costs_nothing() {
    replay(
        &reproducer("plan_create/failed-rank-far-past-the-meshes"),
        plan_create::run,
    );
}
