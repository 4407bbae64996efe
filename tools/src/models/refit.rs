//! Refit layouts: every parameter's training layout (source) and inference layout
//! (destination) as [`TensorSpec`]s.

use super::config::ModelConfig;
use super::inventory::{inventory, ExpertStorage, Param, Proj, Role};
use super::spec::{InferSpec, TrainSpec};
use ncclreshard::error::{Error, Result};
use ncclreshard::layout::{DType, Layout, Mesh, Placement, Side, TensorSpec};
use std::collections::hash_map::{Entry, HashMap};
use std::ops::Range;
use std::sync::Arc;

/// Choices of a refit besides the model and the two parallel specs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RefitOptions {
    /// Element type of every parameter whose checkpoint type is not fixed (FP8 weights,
    /// `float32` scales and router biases keep theirs).
    pub dtype: DType,
    /// Inference runs on the training ranks (`0..`) instead of the ranks after them.
    pub colocated: bool,
    /// Per-expert or stacked routed experts (ignored for a listing given as [`Param`]s, which
    /// already says).
    pub experts: ExpertStorage,
}

impl Default for RefitOptions {
    fn default() -> Self {
        RefitOptions {
            dtype: DType::Bfloat16,
            colocated: false,
            experts: ExpertStorage::Stacked,
        }
    }
}

/// Where a destination view sits inside an inference engine's fused parameter.
///
/// The fused buffer is the concatenation of `members` (indices into [`Refit::tensors`], in
/// order) along `dim` of their local views on one rank; members not on that rank take no
/// space. [`Refit::fused_offset_bytes`] turns this into the byte offset a caller adds to the
/// fused buffer's local pointer to get the view's `recvbuff`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedView {
    /// The engine's parameter (`model.layers.3.self_attn.qkv_proj.weight`,
    /// `…mlp.gate_up_proj.weight`, `…self_attn.fused_qkv_a_proj.weight`,
    /// `…mlp.experts.w13_weight`, `…mlp.experts.w2_weight`, `…_weight_scale_inv`).
    pub buffer: Arc<str>,
    pub dim: usize,
    pub members: Arc<[u32]>,
    /// This tensor's index in `members`.
    pub position: usize,
}

/// The tensors of one refit, ready for [`Planner::new`](ncclreshard::Planner::new).
///
/// Plain data: `names[i]`, `tensors[i]` and `fused[i]` describe parameter `i` of the
/// inventory (checkpoint order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refit {
    pub train_ranks: Range<u32>,
    pub infer_ranks: Range<u32>,
    pub names: Vec<String>,
    pub tensors: Vec<TensorSpec>,
    /// The fused inference parameter each destination view belongs to, if any.
    pub fused: Vec<Option<FusedView>>,
}

impl Refit {
    /// Ranks the refit spans (`max(train end, infer end)`).
    pub fn world(&self) -> u32 {
        self.train_ranks.end.max(self.infer_ranks.end)
    }

    /// Bytes of one full copy of every tensor.
    pub fn bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<u64>() * u64::from(t.elem_size()))
            .sum()
    }

    /// Byte offset of tensor `tensor`'s destination view inside its fused buffer on `rank`:
    /// the bytes the members before it occupy there along [`FusedView::dim`] (their local
    /// extent along that dim times this view's stride). `None` when the tensor is not fused
    /// or `rank` holds no part of it. A caller passes `fused_base + offset` as the tensor's
    /// receive buffer; the view's strides (dense, or the `w13` strides) do the rest.
    pub fn fused_offset_bytes(&self, tensor: usize, rank: u32) -> Option<u64> {
        let fused = self.fused.get(tensor)?.as_ref()?;
        let spec = &self.tensors[tensor];
        let stride = spec.rank_view(Side::Dst, rank)?.view.byte_strides()[fused.dim];
        let before: u64 = fused.members[..fused.position]
            .iter()
            .filter_map(|&m| {
                let member = self.tensors[m as usize].rank_view(Side::Dst, rank)?;
                Some(member.local_shape()[fused.dim])
            })
            .sum();
        Some(before * stride)
    }
}

/// The refit of `config`'s parameters ([`inventory`] with `options.experts`) from `train` to
/// `infer`; see [`refit_params`].
pub fn refit(
    config: &ModelConfig,
    train: &TrainSpec,
    infer: &InferSpec,
    options: &RefitOptions,
) -> Result<Refit> {
    config.validate()?;
    refit_params(&inventory(config, options.experts), train, infer, options)
}

/// The refit of an explicit parameter listing (a `*.model.json` tensor list, say).
///
/// Training (Megatron-LM): ranks `0..T` in Megatron order; layers split over pipeline stages
/// as evenly as possible with the first stages taking the remainder; the embedding on the first
/// stage, the final norm and lm_head on the last. Dense parameters of stage `s` live on that
/// stage's ranks as mesh `[dp, cp, tp]` with `[Replicate, Replicate, Shard(d)]` (`d` from
/// [`Role::tp_dim`]; replicated roles and row-parallel biases `Replicate`). Routed experts use
/// the stage's ranks as `[edp, ep, etp]`: stacked `[E, out, in]` is `[Replicate, Shard(0),
/// Shard(1 or 2)]` (etp cuts the intermediate dim); a per-expert tensor lives on the ranks of
/// the ep coordinate owning it (torch's chunk rule over experts) as `[edp, etp]`,
/// `[Replicate, Shard(0 or 1)]`. With FSDP2 (`fsdp > 1`) the stage's ranks are `[dp/fsdp,
/// fsdp·cp, tp]` (torchtitan shards over data × context ranks) with `[Replicate, Shard(0),
/// tp placement]`, and `StridedShard(0, tp)` on the FSDP axis when tp also shards dim 0 —
/// torch's FSDP2 + TP layout; experts are then tensor-parallel like dense weights.
///
/// Inference (vLLM / SGLang): ranks `T..T+I` (or `0..I` colocated) as mesh `[dp, tp]` with
/// `[Replicate, Shard(d)]`; replicated roles `[Replicate, Replicate]`. q/k/v, gate/up (dense
/// and shared expert) and MLA's `q_a`/`kv_a` are dense views into fused buffers (see
/// [`FusedView`]). Stacked experts: without EP, `[Replicate, Shard(1)]` for gate/up and
/// `[Replicate, Shard(2)]` for down; with EP, `Shard(0)` over the flat mesh of all `tp·dp`
/// ranks and no TP. Stacked gate and up are strided views of `w13 [E_local, 2·I_local, H]`:
/// strides `[2·I_local·H, H, 1]`, where `I_local` is the largest local intermediate extent
/// (`ceil(I/tp)`, or `I` with EP). Per-expert tensors are dense views of one expert's slot: on
/// the one owning rank with EP, `[Replicate, Shard(0 or 1)]` over `[dp, tp]` without.
///
/// Errors: invalid specs (the message names the key), more ranks than NCCL addresses, or an
/// expert tensor without its 2 (per-expert) or 3 (stacked) dims. The layouts are valid for
/// every shape; sizes too large for byte offsets are left to [`TensorSpec::validate`] (which
/// [`Planner::new`](ncclreshard::Planner::new) runs).
pub fn refit_params(
    params: &[Param],
    train: &TrainSpec,
    infer: &InferSpec,
    options: &RefitOptions,
) -> Result<Refit> {
    let train = TrainSpec::new(
        train.tp,
        train.cp,
        train.pp,
        Some(train.dp),
        train.ep,
        train.etp,
        train.fsdp,
    )?;
    let infer = InferSpec::new(infer.tp, infer.dp, infer.expert_parallel)?;
    let train_world = train.world();
    let infer_base = if options.colocated { 0 } else { train_world };
    infer_base
        .checked_add(infer.world())
        .filter(|&end| end <= i32::MAX as u32)
        .ok_or_else(|| {
            Error::invalid_argument("training + inference ranks exceed NCCL's rank range")
        })?;

    let num_layers = params
        .iter()
        .filter_map(|p| p.layer)
        .max()
        .map_or(0, |l| u64::from(l) + 1);
    // Routed experts per layer, for per-expert ownership.
    let mut experts_in_layer: HashMap<u32, u64> = HashMap::new();
    for p in params {
        // The expert layouts shard fixed dims; other roles shard a dim only when it exists.
        let rank = match p.role {
            Role::Expert { .. } => 2,
            Role::Experts(_) => 3,
            _ => p.shape.len(),
        };
        if p.shape.len() != rank {
            return Err(Error::invalid_argument(format!(
                "parameter {:?} ({}) has shape {:?}; it needs {rank} dims",
                p.name, p.role, p.shape
            )));
        }
        if let (Role::Expert { index, .. }, Some(layer)) = (p.role, p.layer) {
            let n = experts_in_layer.entry(layer).or_insert(0);
            *n = (*n).max(u64::from(index) + 1);
        }
    }

    let mut trainer = TrainLayouts::new(train, num_layers)?;
    let mut engine = InferLayouts::new(infer, infer_base)?;
    let fused = fused_views(params);

    let mut tensors = Vec::with_capacity(params.len());
    for (i, p) in params.iter().enumerate() {
        let context = || format!("parameter {:?}", p.name);
        let experts = p.layer.and_then(|l| experts_in_layer.get(&l).copied());
        let src = trainer
            .layout(p, experts)
            .map_err(|e| e.context(context()))?;
        let strided = fused[i].is_some() && matches!(p.role, Role::Experts(Proj::Gate | Proj::Up));
        let dst = engine
            .layout(p, experts, strided)
            .map_err(|e| e.context(context()))?;
        tensors.push(TensorSpec {
            shape: p.shape.clone(),
            dtype: p.dtype.unwrap_or(options.dtype),
            src,
            dst,
        });
    }
    Ok(Refit {
        train_ranks: 0..train_world,
        infer_ranks: infer_base..infer_base + infer.world(),
        names: params.iter().map(|p| p.name.clone()).collect(),
        tensors,
        fused,
    })
}

/// The placement that shards dim `dim` of an `ndim`-dim tensor, or `Replicate` when the dim
/// does not exist (a row-parallel layer's bias).
fn shard_if(dim: Option<usize>, ndim: usize) -> Placement {
    match dim {
        Some(d) if d < ndim => Placement::Shard(d),
        _ => Placement::Replicate,
    }
}

/// The dim tensor parallelism shards in an expert tensor when experts are tensor-parallel:
/// the intermediate dim (gate/up rows, down columns), one further in for stacked experts.
fn expert_tp_dim(role: Role) -> usize {
    match role {
        Role::Expert { proj, .. } => usize::from(proj == Proj::Down),
        Role::Experts(proj) => 1 + usize::from(proj == Proj::Down),
        _ => unreachable!("only routed expert roles have an expert TP dim"),
    }
}

/// Which expert-parallel coordinate owns expert `index` of `count` over `parts` (torch's chunk
/// rule, as `Shard(0)` of the stacked tensor would place it).
fn expert_owner(index: u64, count: u64, parts: u32) -> u64 {
    let chunk = count.div_ceil(u64::from(parts)).max(1);
    index / chunk
}

fn layer_experts(p: &Param, experts: Option<u64>) -> Result<u64> {
    match (p.role, experts) {
        (Role::Expert { index, .. }, Some(n)) if u64::from(index) < n => Ok(n),
        _ => Err(Error::internal(
            "per-expert tensor without a layer expert count",
        )),
    }
}

/// Training meshes, built once per stage and cloned into each layout.
struct TrainLayouts {
    spec: TrainSpec,
    /// First layer of every stage, plus the layer count at the end.
    stage_starts: Vec<u64>,
    dense: Vec<Mesh>,
    experts: Vec<Mesh>,
    per_expert: HashMap<(u32, u64), Mesh>,
}

impl TrainLayouts {
    fn new(spec: TrainSpec, num_layers: u64) -> Result<TrainLayouts> {
        let pp = u64::from(spec.pp);
        let (base, extra) = (num_layers / pp, num_layers % pp);
        let mut stage_starts = vec![0u64];
        for s in 0..pp {
            let last = *stage_starts.last().expect("non-empty");
            stage_starts.push(last + base + u64::from(s < extra));
        }
        let (tp, cp, dp) = (u64::from(spec.tp), u64::from(spec.cp), u64::from(spec.dp));
        let fsdp = u64::from(spec.fsdp);
        let dense_shape = if spec.fsdp > 1 {
            vec![dp / fsdp, fsdp * cp, tp]
        } else {
            vec![dp, cp, tp]
        };
        let expert_shape = vec![
            u64::from(spec.expert_dp()),
            u64::from(spec.ep),
            u64::from(spec.etp),
        ];
        let mut dense = Vec::new();
        let mut experts = Vec::new();
        for s in 0..spec.pp {
            let first = s * spec.stage_size();
            dense.push(Mesh::contiguous(dense_shape.clone(), first)?);
            experts.push(Mesh::contiguous(expert_shape.clone(), first)?);
        }
        Ok(TrainLayouts {
            spec,
            stage_starts,
            dense,
            experts,
            per_expert: HashMap::new(),
        })
    }

    fn stage(&self, p: &Param) -> u32 {
        match (p.layer, p.role) {
            (Some(layer), _) => {
                // The last stage whose first layer is at or before `layer`.
                let layer = u64::from(layer);
                let after = self.stage_starts[1..].partition_point(|&start| start <= layer);
                (after as u32).min(self.spec.pp - 1)
            }
            (None, Role::Embedding) => 0,
            (None, _) => self.spec.pp - 1,
        }
    }

    /// A dense-style layout on the stage's mesh, tensor parallelism cutting `tp_dim`.
    fn dense_layout(&self, stage: u32, tp_dim: Option<usize>, ndim: usize) -> Layout {
        let tp = shard_if(tp_dim, ndim);
        let mesh = self.dense[stage as usize].clone();
        if self.spec.fsdp > 1 {
            let fsdp = match tp {
                Placement::Shard(0) if self.spec.tp > 1 => Placement::StridedShard {
                    dim: 0,
                    split_factor: u64::from(self.spec.tp),
                },
                _ => shard_if(Some(0), ndim),
            };
            Layout::new(mesh, vec![Placement::Replicate, fsdp, tp])
        } else {
            Layout::new(mesh, vec![Placement::Replicate, Placement::Replicate, tp])
        }
    }

    fn layout(&mut self, p: &Param, experts: Option<u64>) -> Result<Layout> {
        let stage = self.stage(p);
        let ndim = p.shape.len();
        if !p.role.is_routed_expert() {
            return Ok(self.dense_layout(stage, p.role.tp_dim(), ndim));
        }
        if self.spec.fsdp > 1 {
            return Ok(self.dense_layout(stage, Some(expert_tp_dim(p.role)), ndim));
        }
        let etp = Placement::Shard(expert_tp_dim(p.role));
        if let Role::Experts(_) = p.role {
            return Ok(Layout::new(
                self.experts[stage as usize].clone(),
                vec![Placement::Replicate, Placement::Shard(0), etp],
            ));
        }
        let Role::Expert { index, .. } = p.role else {
            unreachable!("routed expert roles are Expert or Experts")
        };
        let owner = expert_owner(u64::from(index), layer_experts(p, experts)?, self.spec.ep);
        let mesh = match self.per_expert.entry((stage, owner)) {
            Entry::Occupied(mesh) => mesh.get().clone(),
            Entry::Vacant(slot) => {
                // The stage's ranks with ep coordinate `owner`, as [edp, etp].
                let stage_mesh = &self.experts[stage as usize];
                let (edp, etp_size) = (u64::from(self.spec.expert_dp()), u64::from(self.spec.etp));
                let ranks = (0..edp)
                    .flat_map(|x| (0..etp_size).map(move |y| stage_mesh.rank_at(&[x, owner, y])))
                    .collect();
                slot.insert(Mesh::new(vec![edp, etp_size], ranks)?).clone()
            }
        };
        Ok(Layout::new(mesh, vec![Placement::Replicate, etp]))
    }
}

/// Inference meshes, built once and cloned into each layout.
struct InferLayouts {
    spec: InferSpec,
    base: u32,
    dense: Mesh,
    flat: Mesh,
    single: HashMap<u32, Mesh>,
}

impl InferLayouts {
    fn new(spec: InferSpec, base: u32) -> Result<InferLayouts> {
        Ok(InferLayouts {
            spec,
            base,
            dense: Mesh::contiguous(vec![u64::from(spec.dp), u64::from(spec.tp)], base)?,
            flat: Mesh::contiguous(vec![u64::from(spec.world())], base)?,
            single: HashMap::new(),
        })
    }

    /// `strided`: the tensor is one half of a stacked `w13` and needs the fused view strides.
    fn layout(&mut self, p: &Param, experts: Option<u64>, strided: bool) -> Result<Layout> {
        let ndim = p.shape.len();
        let replicate = Placement::Replicate;
        if !p.role.is_routed_expert() {
            return Ok(Layout::new(
                self.dense.clone(),
                vec![replicate, shard_if(p.role.tp_dim(), ndim)],
            ));
        }
        let tp_dim = expert_tp_dim(p.role);
        match (p.role, self.spec.expert_parallel) {
            (Role::Experts(_), ep) => {
                let mut layout = if ep {
                    Layout::new(self.flat.clone(), vec![Placement::Shard(0)])
                } else {
                    Layout::new(
                        self.dense.clone(),
                        vec![replicate, Placement::Shard(tp_dim)],
                    )
                };
                if strided {
                    // One half of w13 [E_local, 2·I_local, H]: the rows of this half in each
                    // expert's slot, the other half's rows after (gate) or before (up) them.
                    let inter = if ep {
                        p.shape[1]
                    } else {
                        p.shape[1].div_ceil(u64::from(self.spec.tp))
                    };
                    let hidden = p.shape[2];
                    layout = layout.with_strides(vec![2 * inter * hidden, hidden, 1]);
                }
                Ok(layout)
            }
            (Role::Expert { index, .. }, true) => {
                let owner = expert_owner(
                    u64::from(index),
                    layer_experts(p, experts)?,
                    self.spec.world(),
                );
                let rank = self.base + owner as u32;
                let mesh = match self.single.entry(rank) {
                    Entry::Occupied(mesh) => mesh.get().clone(),
                    Entry::Vacant(slot) => slot.insert(Mesh::new(vec![1], vec![rank])?).clone(),
                };
                Ok(Layout::new(mesh, vec![replicate]))
            }
            (Role::Expert { .. }, false) => Ok(Layout::new(
                self.dense.clone(),
                vec![replicate, Placement::Shard(tp_dim)],
            )),
            _ => unreachable!("routed expert roles are Expert or Experts"),
        }
    }
}

/// `(parent module, leaf module, tensor suffix)` of an HF name:
/// `model.layers.3.self_attn.q_proj.weight` → (`model.layers.3.self_attn`, `q_proj`, `weight`).
fn split_name(name: &str) -> Option<(&str, &str, &str)> {
    let (module, suffix) = name.rsplit_once('.')?;
    let (parent, leaf) = module.rsplit_once('.')?;
    Some((parent, leaf, suffix))
}

/// The inference engine's fused buffer of `p`: (name, concat dim, members a complete group
/// needs; 0 for per-expert buffers, whose size depends on the layer).
fn fused_buffer(p: &Param) -> Option<(String, usize, usize)> {
    let (parent, _, suffix) = split_name(&p.name)?;
    let grouped = |fused: &str, need: usize| Some((format!("{parent}.{fused}.{suffix}"), 0, need));
    match p.role {
        Role::Q | Role::K | Role::V => grouped("qkv_proj", 3),
        Role::MlaQA | Role::MlaKvA => grouped("fused_qkv_a_proj", 2),
        Role::Mlp(Proj::Gate | Proj::Up) | Role::SharedExpert(Proj::Gate | Proj::Up) => {
            grouped("gate_up_proj", 2)
        }
        Role::Experts(proj) => {
            let (w, need) = if proj == Proj::Down {
                ("w2", 1)
            } else {
                ("w13", 2)
            };
            Some((format!("{parent}.{w}_{suffix}"), 1, need))
        }
        Role::Expert { proj, .. } => {
            // `parent` is `….mlp.experts.{index}`.
            let (experts, _) = parent.rsplit_once('.')?;
            let w = if proj == Proj::Down { "w2" } else { "w13" };
            Some((format!("{experts}.{w}_{suffix}"), 0, 0))
        }
        _ => None,
    }
}

/// Groups parameters into the inference engine's fused buffers, members in the engine's order
/// ([`Role`]'s order: q, k, v; gate, up; experts by index); incomplete groups (MLA's lone
/// `q_proj`, a gate without its up) stay unfused.
fn fused_views(params: &[Param]) -> Vec<Option<FusedView>> {
    let mut groups: HashMap<String, (usize, usize, Vec<u32>)> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let Some((name, dim, need)) = fused_buffer(p) else {
            continue;
        };
        let group = groups.entry(name).or_insert_with_key(|name| {
            order.push(name.clone());
            (dim, need, Vec::new())
        });
        group.2.push(i as u32);
    }
    let mut out: Vec<Option<FusedView>> = vec![None; params.len()];
    for name in order {
        let (dim, need, mut members) = groups.remove(&name).expect("every ordered group exists");
        if need != 0 && members.len() != need {
            continue;
        }
        // The engine's order (q, k, v; gate, up; experts by index), whatever order the
        // listing came in.
        members.sort_by_key(|&m| params[m as usize].role);
        let buffer: Arc<str> = Arc::from(name.as_str());
        let members: Arc<[u32]> = Arc::from(members);
        for (position, &m) in members.iter().enumerate() {
            out[m as usize] = Some(FusedView {
                buffer: Arc::clone(&buffer),
                dim,
                members: Arc::clone(&members),
                position,
            });
        }
    }
    out
}
