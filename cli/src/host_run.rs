//! A refit run on this host (`refit`, `bench --exec`): every rank a thread of the host
//! executor, sources filled and destinations verified the way `ncclreshard check` does it
//! (`ncclreshard_tools::check`); and the gather+broadcast baseline emulated on the same memory.

use crate::commands::refit_setup;
use crate::out;
use crate::work;
use crate::Failure;
use ncclreshard::layout::{row_major_strides, RankView, Side};
use ncclreshard::plan::{Buffer, CopyDim, Loc, StridedCopy};
use ncclreshard::quant::Conversion;
use ncclreshard::transport::host::{copy_block, execute, RankBuffers};
use ncclreshard::{Config, IndexRuns, RankProgram, TensorSpec};
use ncclreshard_tools::check::{
    destination_view_bytes, expected_conversion, rank_buffers, verify_converted_view,
    verify_destination_view, verify_scale_view, MAX_CHECK_BYTES,
};
use std::collections::HashSet;
use std::time::Duration;

/// A reshard executed on the host, before verification.
pub struct Executed {
    /// Every rank of the plan, ascending; `programs` and `buffers` follow this order.
    pub ranks: Vec<u32>,
    pub programs: Vec<RankProgram>,
    pub buffers: Vec<RankBuffers>,
    pub plan: Duration,
    pub fill: Duration,
    pub execute: Duration,
}

/// Plans every rank of `tensors` (converted on the way by `conversions`, one per tensor), fills
/// their buffers and runs the host executor. `Ok(None)`:
/// the executor failed, which is a failed refit (the message is on stderr), not bad input.
/// A run needing more than `check`'s host memory limit is refused up front.
pub fn plan_fill_execute(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    config: Config,
) -> Result<Option<Executed>, Failure> {
    let needed = refit_setup::host_bytes(tensors);
    if needed > MAX_CHECK_BYTES {
        return Err(Failure::Input(format!(
            "the host run needs {} for all ranks' views (at most {} allowed); raise --scale",
            out::bytes(needed),
            out::bytes(MAX_CHECK_BYTES)
        )));
    }
    let planner = refit_setup::planner(tensors, conversions, config)?;
    let ranks = planner.ranks();
    let (programs, plan) =
        refit_setup::plan_all(&planner, refit_setup::Views::Separate, "planning ranks")?;
    let (mut buffers, fill) = fill(tensors, conversions, &ranks)?;
    let execute = match run_reshard(&programs, &mut buffers) {
        Ok(took) => took,
        Err(message) => {
            eprintln!("ncclreshard: {message}");
            return Ok(None);
        }
    };
    Ok(Some(Executed {
        ranks,
        programs,
        buffers,
        plan,
        fill,
        execute,
    }))
}

/// Every rank's buffers (in `ranks` order), as `check` fills them: sources with each
/// element's value (meaningful floats for converted tensors), destinations and scale views
/// with sentinels.
pub fn fill(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    ranks: &[u32],
) -> Result<(Vec<RankBuffers>, Duration), Failure> {
    let (buffers, took) = work::track("filling source views", ranks.len(), |done| {
        work::map(ranks, done, |&rank| {
            rank_buffers(tensors, Some(conversions), rank)
        })
    });
    let buffers = buffers
        .into_iter()
        .collect::<ncclreshard::Result<Vec<_>>>()
        .map_err(|e| Failure::Input(format!("preparing host buffers: {e}")))?;
    Ok((buffers, took))
}

/// Fresh destination buffers (sentinels), as [`fill`] makes them, for a second run.
pub fn fresh_destinations(
    tensors: &[TensorSpec],
    ranks: &[u32],
) -> Result<Vec<Vec<Vec<u8>>>, Failure> {
    ranks
        .iter()
        .map(|&rank| {
            tensors
                .iter()
                .map(|spec| Ok(destination_view_bytes(spec, rank)?.unwrap_or_default()))
                .collect::<ncclreshard::Result<Vec<_>>>()
        })
        .collect::<ncclreshard::Result<Vec<_>>>()
        .map_err(|e| Failure::Input(format!("preparing host buffers: {e}")))
}

/// Runs every rank's program on the host executor (one thread per rank); the wall time. An
/// error means the programs did not fit together: the refit failed, it is not bad input.
fn run_reshard(programs: &[RankProgram], buffers: &mut [RankBuffers]) -> Result<Duration, String> {
    let label = format!("executing {} ranks as threads", programs.len());
    let (result, took) = work::track(&label, 0, |_| execute(programs, buffers));
    result.map_err(|e| format!("the host executor failed: {e}"))?;
    Ok(took)
}

/// What verifying every destination view found.
pub struct Verified {
    pub elements: u64,
    /// Tensors (of those checked) with a wrong byte.
    pub bad_tensors: usize,
    /// The first few failures, each naming the tensor and rank.
    pub failures: Vec<String>,
    pub took: Duration,
}

/// How many failure messages [`verify`] keeps.
const MAX_FAILURES: usize = 10;

/// Checks every destination view of every tensor on every rank of its destination mesh; a
/// converted tensor's views and scale views against the reference quantizer's conversion of
/// the whole tensor.
pub fn verify(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    ranks: &[u32],
    buffers: &[RankBuffers],
) -> Verified {
    // A scaled tensor's scale view follows the tensors' views, in tensor order.
    let mut next_slot = tensors.len();
    let indexed: Vec<(usize, &TensorSpec, Option<usize>)> = tensors
        .iter()
        .enumerate()
        .map(|(t, spec)| {
            let slot = conversions[t].as_ref().filter(|c| c.is_scaled()).map(|_| {
                next_slot += 1;
                next_slot - 1
            });
            (t, spec, slot)
        })
        .collect();
    let (results, took) = work::track("verifying tensors", tensors.len(), |done| {
        work::map(&indexed, done, |&(t, spec, slot)| {
            let mut elements = 0u64;
            let mut failures = Vec::new();
            let conversion = conversions[t].as_ref();
            let expected = conversion.map(|c| expected_conversion(spec, c, t as u32));
            let mut holders: Vec<u32> = spec.dst.mesh.live_ranks().collect();
            if let Some(layout) = conversion.and_then(|c| c.scale_layout(spec)) {
                holders.extend(layout.mesh.live_ranks());
                holders.sort_unstable();
                holders.dedup();
            }
            for rank in holders {
                let memory = ranks.binary_search(&rank).ok().map(|i| &buffers[i]);
                let Some(memory) = memory else {
                    failures.push(format!("tensor {t} rank {rank}: no buffers"));
                    continue;
                };
                let got = |i: usize| memory.dst.get(i).map_or(&[][..], Vec::as_slice);
                let result = match (conversion, &expected) {
                    (Some(c), Some(e)) => verify_converted_view(spec, c, e, t as u32, rank, got(t))
                        .and_then(|n| {
                            Ok(n + match slot {
                                Some(s) => verify_scale_view(spec, c, e, t as u32, rank, got(s))?,
                                None => 0,
                            })
                        }),
                    _ if spec.dst.mesh.ranks().contains(&rank) => {
                        verify_destination_view(spec, t as u32, rank, got(t))
                    }
                    _ => Ok(0),
                };
                match result {
                    Ok(n) => elements += n,
                    Err(e) => failures.push(e.to_string()),
                }
            }
            (elements, failures)
        })
    });
    let mut verified = Verified {
        elements: 0,
        bad_tensors: 0,
        failures: Vec::new(),
        took,
    };
    for (elements, failures) in results {
        verified.elements += elements;
        verified.bad_tensors += usize::from(!failures.is_empty());
        let room = MAX_FAILURES.saturating_sub(verified.failures.len());
        verified.failures.extend(failures.into_iter().take(room));
    }
    verified
}

/// Bytes the gather+broadcast baseline moves between ranks, counted like a reshard's sends
/// (a rank's own data costs nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BaselineBytes {
    /// Shards that travel to the root (the smallest source rank) to assemble each tensor.
    pub gather: u64,
    /// The whole tensor, once to every destination rank other than the root.
    pub broadcast: u64,
}

impl BaselineBytes {
    pub fn total(&self) -> u64 {
        self.gather + self.broadcast
    }
}

/// How the baseline moves one tensor: which rank sends each distinct source shard to the
/// root, and who receives the whole tensor.
struct Route {
    root: u32,
    /// (holder, its view of the shard): one per distinct non-empty shard, the root's own
    /// shard held by the root.
    shards: Vec<(u32, RankView)>,
    bytes: BaselineBytes,
}

fn route(spec: &TensorSpec) -> Route {
    let elem = u64::from(spec.elem_size());
    let root = spec.src.mesh.sorted_ranks().next().unwrap_or(0);
    let mut holders: Vec<u32> = spec.src.mesh.live_ranks().collect();
    // The root first, so a shard it holds is never fetched from a replica.
    holders.sort_by_key(|&r| (r != root, r));
    let mut seen: HashSet<Vec<IndexRuns>> = HashSet::new();
    let mut shards = Vec::new();
    let mut bytes = BaselineBytes::default();
    for holder in holders {
        let Some(view) = spec.rank_view(Side::Src, holder) else {
            continue;
        };
        if view.indices.iter().any(IndexRuns::is_empty) || !seen.insert(view.indices.clone()) {
            continue;
        }
        if holder != root {
            bytes.gather += view.view.elements() * elem;
        }
        shards.push((holder, view));
    }
    let full = spec.shape.iter().product::<u64>() * elem;
    let receivers = spec.dst.mesh.live_ranks().filter(|&r| r != root).count() as u64;
    bytes.broadcast = full * receivers;
    Route {
        root,
        shards,
        bytes,
    }
}

/// The baseline's bytes for `tensors`, without moving any.
pub fn baseline_bytes(tensors: &[TensorSpec]) -> BaselineBytes {
    tensors.iter().fold(BaselineBytes::default(), |acc, spec| {
        let b = route(spec).bytes;
        BaselineBytes {
            gather: acc.gather + b.gather,
            broadcast: acc.broadcast + b.broadcast,
        }
    })
}

/// The block copies between a rank's local view and the dense row-major global tensor: one
/// per combination of index runs (`to_global`: local → global, else global → local). Offsets
/// are relative to the buffers' starts.
fn box_copies(spec: &TensorSpec, rank_view: &RankView, to_global: bool) -> Vec<StridedCopy> {
    let RankView { indices, view } = rank_view;
    if indices.iter().any(IndexRuns::is_empty) {
        return Vec::new();
    }
    let elem = u64::from(spec.elem_size());
    let global: Vec<u64> = row_major_strides(&spec.shape)
        .iter()
        .map(|s| s * elem)
        .collect();
    let local = view.byte_strides();
    let mut copies = Vec::new();
    let mut pick = vec![0usize; indices.len()];
    loop {
        let runs: Vec<_> = indices
            .iter()
            .zip(&pick)
            .map(|(r, &k)| r.runs()[k])
            .collect();
        let global_at: u64 = runs.iter().zip(&global).map(|(r, s)| r.start * s).sum();
        let local_at: u64 = runs.iter().zip(&local).map(|(r, s)| r.pos * s).sum();
        let dims: Vec<CopyDim> = (0..runs.len())
            .map(|d| {
                let (g, l) = (global[d], local[d]);
                let (src_stride, dst_stride) = if to_global { (l, g) } else { (g, l) };
                CopyDim {
                    count: runs[d].len(),
                    src_stride,
                    dst_stride,
                }
            })
            .collect();
        let (src_at, dst_at) = if to_global {
            (local_at, global_at)
        } else {
            (global_at, local_at)
        };
        let loc = |buffer, offset| Loc {
            buffer,
            tensor: 0,
            offset,
        };
        copies.push(StridedCopy::new(
            loc(Buffer::Src, src_at),
            loc(Buffer::Dst, dst_at),
            elem,
            &dims,
        ));
        // Odometer over the runs of every dim, last dim fastest.
        let mut d = indices.len();
        loop {
            if d == 0 {
                return copies;
            }
            d -= 1;
            pick[d] += 1;
            if pick[d] < indices[d].runs().len() {
                break;
            }
            pick[d] = 0;
        }
    }
}

fn run_copy(copy: &StridedCopy, src: &[u8], dst: &mut [u8]) {
    copy_block(
        copy,
        &src[copy.src.offset as usize..],
        &mut dst[copy.dst.offset as usize..],
    );
}

/// Emulates gather+broadcast on the host: per tensor, the root assembles the whole tensor
/// from one copy of every source shard (`sources[i]` are rank `ranks[i]`'s buffers), then
/// every destination rank receives the whole tensor into a buffer of its own and slices its
/// view out of it into `destinations[i][t]`. Destination ranks run on all cores. Returns the
/// bytes moved between ranks (as [`baseline_bytes`]) and the wall time.
pub fn run_baseline(
    tensors: &[TensorSpec],
    ranks: &[u32],
    sources: &[RankBuffers],
    destinations: &mut [Vec<Vec<u8>>],
) -> Result<(BaselineBytes, Duration), Failure> {
    let threads = work::threads();
    let (result, took) = work::track("gather+broadcast on the host", tensors.len(), |done| {
        let mut full: Vec<u8> = Vec::new();
        let mut received: Vec<Vec<u8>> = vec![Vec::new(); threads];
        let mut bytes = BaselineBytes::default();
        for (t, spec) in tensors.iter().enumerate() {
            let route = route(spec);
            bytes.gather += route.bytes.gather;
            bytes.broadcast += route.bytes.broadcast;
            let elem = u64::from(spec.elem_size());
            let len = (spec.shape.iter().product::<u64>() * elem) as usize;
            full.clear();
            full.resize(len, 0);
            for (holder, view) in &route.shards {
                let i = ranks.binary_search(holder).map_err(|_| {
                    Failure::Input(format!("tensor {t}: source rank {holder} has no buffers"))
                })?;
                for copy in box_copies(spec, view, true) {
                    run_copy(&copy, &sources[i].src[t], &mut full);
                }
            }
            // Each destination rank's buffer for this tensor, ranks in ascending order.
            let mut targets: Vec<(u32, &mut Vec<u8>)> = ranks
                .iter()
                .zip(destinations.iter_mut())
                .filter(|(rank, _)| spec.dst.mesh.contains(**rank))
                .map(|(&rank, tensors)| (rank, &mut tensors[t]))
                .collect();
            let per_thread = targets.len().div_ceil(threads).max(1);
            let full = &full;
            std::thread::scope(|scope| {
                for (chunk, scratch) in targets.chunks_mut(per_thread).zip(received.iter_mut()) {
                    scope.spawn(move || {
                        for (rank, dst) in chunk.iter_mut() {
                            // The broadcast delivers the whole tensor (the root already has
                            // it); the rank then slices its view out.
                            let whole: &[u8] = if *rank == route.root {
                                full
                            } else {
                                scratch.clear();
                                scratch.extend_from_slice(full);
                                scratch
                            };
                            let Some(view) = spec.rank_view(Side::Dst, *rank) else {
                                continue;
                            };
                            for copy in box_copies(spec, &view, false) {
                                run_copy(&copy, whole, dst);
                            }
                        }
                    });
                }
            });
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(bytes)
    });
    Ok((result?, took))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclreshard::{DType, Layout, Mesh, Placement};

    fn spec(
        src: (Vec<u64>, u32, Vec<Placement>),
        dst: (Vec<u64>, u32, Vec<Placement>),
    ) -> TensorSpec {
        TensorSpec {
            shape: vec![6, 4],
            dtype: DType::Float32,
            src: Layout::new(Mesh::contiguous(src.0, src.1).unwrap(), src.2),
            dst: Layout::new(Mesh::contiguous(dst.0, dst.1).unwrap(), dst.2),
        }
    }

    #[test]
    fn baseline_bytes_count_what_leaves_a_rank() {
        // Two TP ranks hold halves (48 bytes each); the root (rank 0) fetches the other half,
        // then sends the whole 96-byte tensor to each of three inference ranks.
        let split = spec(
            (vec![2], 0, vec![Placement::Shard(0)]),
            (vec![3], 2, vec![Placement::Shard(1)]),
        );
        assert_eq!(
            baseline_bytes(&[split]),
            BaselineBytes {
                gather: 48,
                broadcast: 3 * 96
            }
        );
        // Replicated over two data-parallel ranks: one copy of the other half is fetched;
        // colocated, the root keeps its whole tensor and sends it to the three others.
        let replicated = spec(
            (
                vec![2, 2],
                0,
                vec![Placement::Replicate, Placement::Shard(1)],
            ),
            (vec![4], 0, vec![Placement::Replicate]),
        );
        assert_eq!(
            baseline_bytes(&[replicated]),
            BaselineBytes {
                gather: 48,
                broadcast: 3 * 96
            }
        );
    }

    #[test]
    fn host_baseline_delivers_every_destination_view() {
        let tensors = vec![spec(
            (
                vec![2, 2],
                0,
                vec![Placement::Shard(0), Placement::Shard(1)],
            ),
            (vec![3], 4, vec![Placement::Shard(0)]),
        )];
        let ranks: Vec<u32> = (0..7).collect();
        let (sources, _) = fill(&tensors, &vec![None; tensors.len()], &ranks).unwrap();
        let mut destinations = fresh_destinations(&tensors, &ranks).unwrap();
        let (bytes, _) = run_baseline(&tensors, &ranks, &sources, &mut destinations).unwrap();
        assert_eq!(bytes, baseline_bytes(&tensors));
        for (i, &rank) in ranks.iter().enumerate() {
            verify_destination_view(&tensors[0], 0, rank, &destinations[i][0]).unwrap();
        }
    }
}
