//! The `case_file` harness: bytes → the CLI's case-file parser → the planner → the byte-exact
//! host check.
//!
//! The parser is the one the CLI uses ([`crate::case`]). Every error must name the file (as
//! the CLI promises); a parsed case is planned for a few ranks with the library's Rust API,
//! and, when small enough to run in a moment, checked end to end on the host executor, which
//! must never report an internal error (a wrong or missing byte).

use crate::case;
use crate::check::check_with_conversions;
use ncclreshard::exec::{rank_program, StagingLimit};
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{ErrorKind, Planner};

/// The file name the parser is given (its errors must start with it).
const FILE: &str = "fuzz.json";
/// Most cases of one input that are planned.
const MAX_CASES: usize = 4;
/// Most ranks a case may have to be checked end to end.
const MAX_CHECK_RANKS: usize = 16;
/// Most bytes (all tensors, one copy) a case may have to be checked end to end.
const MAX_CHECK_BYTES: u64 = 1 << 16;
/// Most mesh positions (all layouts of a case together) a case may have to be planned.
/// Planning is linear in mesh size, about a microsecond a rank: the parser's million-rank
/// meshes are correct but slow, and would drown the search.
const MAX_PLAN_RANKS: usize = 1 << 12;

/// What one input reached, so replays can tell that the seeds still get through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Cases the parser accepted.
    pub cases: usize,
    /// Configs (a case without a mode runs under each) the planner accepted.
    pub planned: usize,
    /// Configs checked byte for byte on the host executor.
    pub checked: usize,
}

fn no_internal_error(what: &str, error: &ncclreshard::Error) {
    assert!(
        !matches!(error.kind, ErrorKind::Internal),
        "{what}: internal error: {}",
        error.message
    );
}

/// Runs one input through the parser, the planner and the host check; panics when one of them
/// breaks its promise.
pub fn run(data: &[u8]) -> Outcome {
    let mut outcome = Outcome::default();
    let Ok(text) = std::str::from_utf8(data) else {
        return outcome;
    };
    let file = match case::parse(text, FILE) {
        Ok(file) => file,
        Err(message) => {
            assert!(
                message.starts_with(FILE),
                "a parse error does not name the file: {message}"
            );
            return outcome;
        }
    };
    assert!(!file.cases.is_empty(), "a parsed file without cases");
    outcome.cases = file.cases.len();
    for case in file.cases.iter().take(MAX_CASES) {
        let specs = case.specs();
        let positions: usize = specs
            .iter()
            .map(|s| s.src.mesh.ranks().len() + s.dst.mesh.ranks().len())
            .sum();
        if positions > MAX_PLAN_RANKS {
            continue;
        }
        for (name, config) in case.variants() {
            let planner = match Planner::with_conversions(
                specs.clone(),
                case.conversions(),
                config.clone(),
            ) {
                Ok(planner) => planner,
                Err(error) => {
                    no_internal_error(&name, &error);
                    continue;
                }
            };
            outcome.planned += 1;
            let ranks = planner.ranks();
            // The first, middle and last rank, and one outside every mesh.
            let outside = ranks.last().map_or(0, |&r| r.saturating_add(1));
            let picks = [
                ranks.first().copied(),
                ranks.get(ranks.len() / 2).copied(),
                ranks.last().copied(),
                Some(outside),
            ];
            for rank in picks.into_iter().flatten() {
                let program =
                    rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS);
                if let Err(error) = program {
                    no_internal_error(&format!("{name}: rank {rank}"), &error);
                }
            }
            let bytes = specs.iter().try_fold(0u64, |acc, spec| {
                spec.shape
                    .iter()
                    .try_fold(u64::from(spec.elem_size()), |n, &d| n.checked_mul(d))
                    .and_then(|b| acc.checked_add(b))
            });
            if ranks.len() <= MAX_CHECK_RANKS && bytes.is_some_and(|b| b <= MAX_CHECK_BYTES) {
                if let Err(error) = check_with_conversions(&specs, &case.conversions(), &config) {
                    no_internal_error(&format!("{name}: check"), &error);
                } else {
                    outcome.checked += 1;
                }
            }
        }
    }
    outcome
}
