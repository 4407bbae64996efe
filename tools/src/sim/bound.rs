//! The physical lower bound of a reshard: bytes that must cross each boundary ÷ its bandwidth.

use super::Cluster;
use ncclreshard::layout::{next_index, DimPiece, Layout, TensorSpec};
use ncclreshard::quant::Conversion;
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Which boundary a bound is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BoundKind {
    /// Bytes an NVLink domain (a node on DGX) needs that no source view inside it holds,
    /// over the NIC ingress of its participating GPUs.
    DomainIngress,
    /// Bytes held (on the source side) only inside a set of domains and needed outside it,
    /// once (forwarding between destination domains is allowed), over the set's NIC egress.
    /// The sets tried are those that hold some overlap (a node; a pipeline stage spanning two
    /// nodes…).
    DomainEgress,
    /// Bytes a GPU needs that its own source view does not hold, over its NVLink + NIC
    /// ingress.
    GpuIngress,
    /// Bytes held by exactly one GPU that some other GPU needs, over its NVLink + NIC egress.
    GpuEgress,
    /// Like [`BoundKind::DomainEgress`], but once per destination domain outside the set that
    /// needs the bytes: the bound of *direct* plans, where every byte a domain receives comes
    /// from a source domain (no forwarding between destination domains).
    DirectEgress,
}

/// One bound: `bytes` must cross a boundary of `bandwidth` bytes per second at `subject`
/// (the first domain for domain bounds, a rank for GPU bounds).
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    pub kind: BoundKind,
    pub subject: u32,
    /// Every domain inside the boundary (domain bounds; empty for GPU bounds).
    pub domains: Vec<u32>,
    pub bytes: u64,
    pub bandwidth: f64,
    pub time_s: f64,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            BoundKind::DomainIngress => "NVLink domain ingress",
            BoundKind::DomainEgress => "NVLink domain egress",
            BoundKind::GpuIngress => "GPU ingress",
            BoundKind::GpuEgress => "GPU egress",
            BoundKind::DirectEgress => "NVLink domain egress, direct plans",
        };
        let subject = match (self.kind, self.domains.as_slice()) {
            (BoundKind::GpuIngress | BoundKind::GpuEgress, _) => format!("rank {}", self.subject),
            (_, [] | [_]) => format!("domain {}", self.subject),
            (_, many) => format!(
                "domains {}",
                many.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join("+")
            ),
        };
        write!(
            f,
            "{what} ({subject}): {:.1} GB over {:.0} GB/s = {:.3} s",
            self.bytes as f64 / 1e9,
            self.bandwidth / 1e9,
            self.time_s
        )
    }
}

/// The floor under any plan: the largest of the bounds below.
#[derive(Clone, Debug, PartialEq)]
pub struct LowerBound {
    /// The physical floor: the largest of the domain ingress, domain egress (forwarding
    /// allowed), GPU ingress and GPU egress bounds.
    pub time_s: f64,
    /// The bound that sets `time_s`.
    pub binding: Bound,
    /// The floor of direct plans (no forwarding between destination domains): the largest of
    /// the bounds including [`BoundKind::DirectEgress`]. At least `time_s`.
    pub direct_time_s: f64,
    pub direct_binding: Bound,
    /// The worst subject of every kind, in [`BoundKind`] order.
    pub bounds: Vec<Bound>,
}

/// Computes the lower bound of moving `tensors` on `cluster`.
///
/// Works on shards, never elements: per tensor dim, the source and destination layouts' dim
/// pieces are intersected into runs keyed by (source piece, destination piece); the Cartesian
/// product over dims gives every (source shard, destination shard) overlap with its bytes, its
/// holders (source replicas) and its consumers (destination replicas). Each bound only counts
/// bytes that must cross its boundary in any plan, so each is valid on its own:
///
/// - domain ingress: an overlap needed by some rank of a domain and held by no source rank of
///   that domain must enter it at least once, through the NICs of its participating GPUs;
/// - domain egress: an overlap whose holders all sit inside a set of domains must leave the set
///   at least once if a domain outside it needs it (a destination domain may forward it to
///   the others); the sets tried are the holder sets that occur, so data replicated over a
///   pipeline stage's nodes is bounded by the stage's NICs together;
/// - direct egress (the floor of direct plans only): the same, once per domain outside the
///   set that needs it;
/// - GPU ingress / egress: a consumer not holding the bytes receives them once; bytes held by
///   a single GPU and needed elsewhere leave it at least once (NVLink or NIC).
///
/// Local reshaping inside a GPU (copies, packs) and latency are not counted.
pub fn lower_bound(tensors: &[TensorSpec], cluster: &Cluster) -> LowerBound {
    lower_bound_converted(tensors, &[], cluster)
}

/// [`lower_bound`] of tensors that arrive converted (`conversions[t]` for tensor `t`; missing
/// or `None`: as it is). A converted element may cross a link in either dtype — senders convert,
/// or receivers do — so each counts at the smaller of its two sizes: the bytes after sender-side
/// conversion when that shrinks it (BF16 → FP8), before receiver-side conversion when that
/// grows it. Scales are left out (a plan whose receivers quantize sends none), which keeps the
/// bound below every plan.
pub fn lower_bound_converted(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    cluster: &Cluster,
) -> LowerBound {
    // Participating GPUs per domain (ranks may be sparse: maps, not rank-indexed vectors).
    let mut participants: Vec<u32> = tensors
        .iter()
        .flat_map(|t| t.src.mesh.ranks().iter().chain(t.dst.mesh.ranks()))
        .copied()
        .collect();
    participants.sort_unstable();
    participants.dedup();
    let mut domain_gpus: BTreeMap<u32, u32> = BTreeMap::new();
    for &r in &participants {
        *domain_gpus.entry(cluster.domain(r)).or_insert(0) += 1;
    }

    let mut acc = Accumulator::default();
    for (t, spec) in tensors.iter().enumerate() {
        let converted = conversions.get(t).and_then(Option::as_ref);
        let elem = converted.map_or(spec.elem_size(), |c| spec.elem_size().min(c.dtype.size()));
        overlaps(spec, u64::from(elem), |bytes, holders, consumers| {
            acc.add(cluster, bytes, holders, consumers)
        });
    }

    let gpu_bw = |rank: u32| -> f64 {
        if domain_gpus[&cluster.domain(rank)] > 1 {
            cluster.nic_bw + cluster.nvlink_bw
        } else {
            cluster.nic_bw
        }
    };
    let domains_bw = |set: &[u32]| -> f64 {
        let gpus: u32 = set
            .iter()
            .map(|d| domain_gpus.get(d).copied().unwrap_or(0))
            .sum();
        f64::from(gpus.max(1)) * cluster.nic_bw
    };
    let bound =
        |kind: BoundKind, subject: u32, domains: Vec<u32>, bytes: u64, bandwidth: f64| Bound {
            kind,
            subject,
            domains,
            bytes,
            bandwidth,
            time_s: bytes as f64 / bandwidth,
        };
    // The worst of several candidates; ties go to the first.
    let worst = |kind: BoundKind, candidates: Vec<Bound>| -> Bound {
        candidates
            .into_iter()
            .reduce(|best, b| if b.time_s > best.time_s { b } else { best })
            .unwrap_or_else(|| bound(kind, 0, Vec::new(), 0, cluster.nic_bw))
    };
    let per_gpu = |kind: BoundKind, bytes: &BTreeMap<u32, u64>| -> Bound {
        worst(
            kind,
            bytes
                .iter()
                .map(|(&r, &b)| bound(kind, r, Vec::new(), b, gpu_bw(r)))
                .collect(),
        )
    };
    let ingress = worst(
        BoundKind::DomainIngress,
        acc.domain_in
            .iter()
            .map(|(&d, &b)| bound(BoundKind::DomainIngress, d, vec![d], b, domains_bw(&[d])))
            .collect(),
    );
    let egress = worst(
        BoundKind::DomainEgress,
        acc.egress_bounds(BoundKind::DomainEgress, &domains_bw),
    );
    let direct = worst(
        BoundKind::DirectEgress,
        acc.egress_bounds(BoundKind::DirectEgress, &domains_bw),
    );
    let bounds = vec![
        ingress,
        egress,
        per_gpu(BoundKind::GpuIngress, &acc.gpu_in),
        per_gpu(BoundKind::GpuEgress, &acc.gpu_out),
        direct,
    ];
    let binding = worst(BoundKind::DomainIngress, bounds[..4].to_vec());
    let direct_binding = worst(BoundKind::DomainIngress, bounds.clone());
    LowerBound {
        time_s: binding.time_s,
        binding,
        direct_time_s: direct_binding.time_s,
        direct_binding,
        bounds,
    }
}

/// Bytes crossing each boundary, keyed by domain or rank.
#[derive(Default)]
struct Accumulator {
    domain_in: BTreeMap<u32, u64>,
    /// Bytes per (holder domains, consumer domains), both sorted.
    by_domains: HashMap<(Vec<u32>, Vec<u32>), u64>,
    gpu_in: BTreeMap<u32, u64>,
    gpu_out: BTreeMap<u32, u64>,
}

impl Accumulator {
    fn add(&mut self, cluster: &Cluster, bytes: u64, holders: &[u32], consumers: &[u32]) {
        let domains_of = |ranks: &[u32]| {
            let mut out: Vec<u32> = ranks.iter().map(|&r| cluster.domain(r)).collect();
            out.sort_unstable();
            out.dedup();
            out
        };
        let held = domains_of(holders);
        let needed = domains_of(consumers);
        for &d in &needed {
            if held.binary_search(&d).is_err() {
                *self.domain_in.entry(d).or_insert(0) += bytes;
            }
        }
        if !held.is_empty() {
            *self.by_domains.entry((held, needed)).or_insert(0) += bytes;
        }
        let mut needed_elsewhere = false;
        for &c in consumers {
            if !holders.contains(&c) {
                *self.gpu_in.entry(c).or_insert(0) += bytes;
                needed_elsewhere = true;
            }
        }
        if let [only] = holders {
            if needed_elsewhere {
                *self.gpu_out.entry(*only).or_insert(0) += bytes;
            }
        }
    }

    /// For every holder set K that occurs: bytes held only inside K and needed outside it —
    /// once (`DomainEgress`) or once per domain outside K needing them (`DirectEgress`).
    fn egress_bounds(&self, kind: BoundKind, bandwidth: &dyn Fn(&[u32]) -> f64) -> Vec<Bound> {
        let mut sets: Vec<&Vec<u32>> = self.by_domains.keys().map(|(held, _)| held).collect();
        sets.sort_unstable();
        sets.dedup();
        sets.into_iter()
            .map(|set| {
                let bytes: u64 = self
                    .by_domains
                    .iter()
                    .filter(|((held, _), _)| is_subset(held, set))
                    .map(|((_, needed), &b)| {
                        let outside = needed
                            .iter()
                            .filter(|d| set.binary_search(d).is_err())
                            .count() as u64;
                        if kind == BoundKind::DirectEgress {
                            b * outside
                        } else {
                            b * outside.min(1)
                        }
                    })
                    .sum();
                let bw = bandwidth(set);
                Bound {
                    kind,
                    subject: set[0],
                    domains: set.clone(),
                    bytes,
                    bandwidth: bw,
                    time_s: bytes as f64 / bw,
                }
            })
            .collect()
    }
}

/// True when sorted `a` ⊆ sorted `b`.
fn is_subset(a: &[u32], b: &[u32]) -> bool {
    a.iter().all(|x| b.binary_search(x).is_ok())
}

/// Per dim: (source piece, destination piece, indices in both) with the summed length.
fn dim_overlaps(src: &[DimPiece], dst: &[DimPiece]) -> Vec<(usize, usize, u64)> {
    let runs = |pieces: &[DimPiece]| {
        let mut out: Vec<(u64, u64, usize)> = pieces
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.indices.runs().iter().map(move |r| (r.start, r.end, i)))
            .collect();
        out.sort_unstable();
        out
    };
    let (a, b) = (runs(src), runs(dst));
    let mut sums: HashMap<(usize, usize), u64> = HashMap::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let start = a[i].0.max(b[j].0);
        let end = a[i].1.min(b[j].1);
        if end > start {
            *sums.entry((a[i].2, b[j].2)).or_insert(0) += end - start;
        }
        if a[i].1 <= b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    let mut out: Vec<(usize, usize, u64)> = sums.into_iter().map(|((s, d), n)| (s, d, n)).collect();
    out.sort_unstable();
    out
}

/// Calls `sink(bytes, holders, consumers)` for every non-empty overlap of a source shard and a
/// destination shard of `spec`, counting `elem` bytes per element.
pub(crate) fn overlaps(spec: &TensorSpec, elem: u64, mut sink: impl FnMut(u64, &[u32], &[u32])) {
    let ndim = spec.shape.len();
    let src_pieces: Vec<Vec<DimPiece>> = (0..ndim)
        .map(|d| spec.src.dim_pieces(&spec.shape, d))
        .collect();
    let dst_pieces: Vec<Vec<DimPiece>> = (0..ndim)
        .map(|d| spec.dst.dim_pieces(&spec.shape, d))
        .collect();
    let per_dim: Vec<Vec<(usize, usize, u64)>> = (0..ndim)
        .map(|d| dim_overlaps(&src_pieces[d], &dst_pieces[d]))
        .collect();
    if per_dim.iter().any(Vec::is_empty) {
        return;
    }
    let mut src_cache: HashMap<Vec<usize>, Vec<u32>> = HashMap::new();
    let mut dst_cache: HashMap<Vec<usize>, Vec<u32>> = HashMap::new();
    let replicas = |layout: &Layout, pieces: &[Vec<DimPiece>], choice: &[usize]| -> Vec<u32> {
        let coords: Vec<&[u64]> = choice
            .iter()
            .enumerate()
            .map(|(d, &p)| pieces[d][p].coords.as_slice())
            .collect();
        layout.replicas(&coords)
    };
    let mut choice = vec![0usize; ndim];
    loop {
        let src_key: Vec<usize> = (0..ndim).map(|d| per_dim[d][choice[d]].0).collect();
        let dst_key: Vec<usize> = (0..ndim).map(|d| per_dim[d][choice[d]].1).collect();
        let bytes = (0..ndim).map(|d| per_dim[d][choice[d]].2).product::<u64>() * elem;
        let holders = src_cache
            .entry(src_key)
            .or_insert_with_key(|key| replicas(&spec.src, &src_pieces, key));
        let consumers = dst_cache
            .entry(dst_key)
            .or_insert_with_key(|key| replicas(&spec.dst, &dst_pieces, key));
        sink(bytes, holders, consumers);
        if !next_index(&mut choice, |d| per_dim[d].len()) {
            return;
        }
    }
}
