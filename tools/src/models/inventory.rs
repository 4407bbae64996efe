//! Every parameter of a model: HF-style name, shape, storage type and how it is parallelised.

use super::config::ModelConfig;
use ncclreshard::error::{Error, Result};
use ncclreshard::layout::DType;
use std::fmt;

/// One of a gated MLP's three projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    /// `gate_proj` (`[intermediate, hidden]`), column-parallel; vLLM's first half of `gate_up`.
    Gate,
    /// `up_proj` (`[intermediate, hidden]`), column-parallel; the second half of `gate_up`.
    Up,
    /// `down_proj` (`[hidden, intermediate]`), row-parallel.
    Down,
}

impl Proj {
    pub fn name(self) -> &'static str {
        match self {
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }
}

/// What a parameter is, which decides how tensor, expert and pipeline parallelism cut it.
///
/// The declaration order is the order inference engines concatenate fused parts in (q, k, v;
/// `q_a`, `kv_a`; gate, up; routed experts by index), which [`FusedView`](super::FusedView)
/// relies on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// `model.embed_tokens`: vocab-parallel (rows sharded), first pipeline stage.
    Embedding,
    /// `lm_head`: vocab-parallel (rows sharded), last pipeline stage.
    LmHead,
    /// Any RMSNorm weight (layer norms, `q_norm`/`k_norm`, MLA's `q_a`/`kv_a` layernorms, the
    /// final `model.norm`): replicated.
    Norm,
    /// `self_attn.q_proj` / `k_proj` / `v_proj`: column-parallel; inference engines fuse them
    /// into `qkv_proj` when all three exist (MLA without `q_lora_rank` has a lone `q_proj`).
    Q,
    K,
    V,
    /// `self_attn.o_proj`: row-parallel (its bias, if any, replicated).
    O,
    /// MLA down-projections `q_a_proj` / `kv_a_proj_with_mqa`: replicated (Megatron's
    /// duplicated linears; vLLM's replicated `fused_qkv_a_proj`).
    MlaQA,
    MlaKvA,
    /// MLA up-projections `q_b_proj` / `kv_b_proj`: column-parallel.
    MlaQB,
    MlaKvB,
    /// Dense MLP projection (`mlp.gate_proj` …).
    Mlp(Proj),
    /// DeepSeek shared-expert projection (`mlp.shared_experts.gate_proj` …): a dense MLP,
    /// tensor-parallel like [`Role::Mlp`].
    SharedExpert(Proj),
    /// The MoE router `mlp.gate.weight` `[experts, hidden]` (or Qwen2-MoE's
    /// `shared_expert_gate`): replicated.
    Router,
    /// `mlp.gate.e_score_correction_bias` `[experts]`: replicated.
    RouterBias,
    /// One routed expert's projection, `mlp.experts.{index}.{proj}`: `[out, in]`.
    Expert {
        index: u32,
        proj: Proj,
    },
    /// All routed experts of a layer stacked, `mlp.experts.{proj}.weight`: `[experts, out, in]`.
    Experts(Proj),
}

impl Role {
    /// The dim tensor parallelism shards for a non-expert weight: 0 column- and
    /// vocab-parallel, 1 row-parallel, `None` replicated. Expert roles return `None`; their
    /// sharding depends on expert parallelism.
    pub fn tp_dim(self) -> Option<usize> {
        match self {
            Role::Embedding
            | Role::LmHead
            | Role::Q
            | Role::K
            | Role::V
            | Role::MlaQB
            | Role::MlaKvB
            | Role::Mlp(Proj::Gate | Proj::Up)
            | Role::SharedExpert(Proj::Gate | Proj::Up) => Some(0),
            Role::O | Role::Mlp(Proj::Down) | Role::SharedExpert(Proj::Down) => Some(1),
            Role::Norm
            | Role::MlaQA
            | Role::MlaKvA
            | Role::Router
            | Role::RouterBias
            | Role::Expert { .. }
            | Role::Experts(_) => None,
        }
    }

    /// Whether this is a routed expert's parameter (per-expert or stacked).
    pub fn is_routed_expert(self) -> bool {
        matches!(self, Role::Expert { .. } | Role::Experts(_))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Embedding => f.write_str("embedding"),
            Role::LmHead => f.write_str("lm_head"),
            Role::Norm => f.write_str("norm"),
            Role::Q => f.write_str("q"),
            Role::K => f.write_str("k"),
            Role::V => f.write_str("v"),
            Role::O => f.write_str("o"),
            Role::MlaQA => f.write_str("mla q_a"),
            Role::MlaKvA => f.write_str("mla kv_a"),
            Role::MlaQB => f.write_str("mla q_b"),
            Role::MlaKvB => f.write_str("mla kv_b"),
            Role::Mlp(p) => write!(f, "mlp {}", p.name()),
            Role::SharedExpert(p) => write!(f, "shared expert {}", p.name()),
            Role::Router => f.write_str("router"),
            Role::RouterBias => f.write_str("router bias"),
            Role::Expert { index, proj } => write!(f, "expert {index} {}", proj.name()),
            Role::Experts(p) => write!(f, "stacked experts {}", p.name()),
        }
    }
}

/// Which tensor of a module a parameter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Weight,
    Bias,
    /// A block-FP8 weight's `weight_scale_inv`; sharded like its weight, not counted as a
    /// model parameter.
    Scale,
}

/// How routed experts are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ExpertStorage {
    /// One tensor per expert and projection, HF checkpoint style:
    /// `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` (`[out, in]`).
    PerExpert,
    /// One tensor per layer and projection, experts stacked on a leading dim:
    /// `model.layers.{l}.mlp.experts.{gate,up,down}_proj.weight` (`[experts, out, in]`; FP8
    /// scales `…_proj.weight_scale_inv`). Inference engines hold gate and up together in
    /// `experts.w13_weight` (`[experts, 2·intermediate, hidden]`) and down as `w2_weight`.
    #[default]
    Stacked,
}

/// One parameter of a model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    /// HF checkpoint name (`model.layers.3.mlp.experts.17.gate_proj.weight`).
    pub name: String,
    pub shape: Vec<u64>,
    pub role: Role,
    pub kind: Kind,
    /// Decoder layer; `None` for the embedding, final norm and lm_head.
    pub layer: Option<u32>,
    /// The storage type when fixed by the checkpoint (FP8 weights, `float32` scales and router
    /// bias); `None` means the refit's dtype.
    pub dtype: Option<DType>,
}

impl Param {
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of the parameter when stored as `dtype` unless its own dtype is fixed.
    pub fn bytes(&self, dtype: DType) -> u64 {
        self.elements() * u64::from(self.dtype.unwrap_or(dtype).size())
    }

    /// Classifies a parameter by its HF name (DeepSeek, Qwen2/3, Llama naming; stacked experts
    /// as [`ExpertStorage::Stacked`] names them). Used for tensor listings such as M2N's
    /// `*.model.json`. Errors name the tensor when its role cannot be told from the name.
    pub fn from_name(name: &str, shape: Vec<u64>, dtype: Option<DType>) -> Result<Param> {
        let unknown = || {
            Error::invalid_argument(format!(
                "tensor {name:?}: cannot tell from its name how it is parallelised"
            ))
        };
        let param = |role, kind, layer| Param {
            name: name.to_string(),
            shape: shape.clone(),
            role,
            kind,
            layer,
            dtype,
        };
        match name {
            "model.embed_tokens.weight" => return Ok(param(Role::Embedding, Kind::Weight, None)),
            "lm_head.weight" => return Ok(param(Role::LmHead, Kind::Weight, None)),
            "model.norm.weight" => return Ok(param(Role::Norm, Kind::Weight, None)),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
        let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
        let layer: u32 = layer.parse().map_err(|_| unknown())?;
        if rest == "mlp.gate.e_score_correction_bias" {
            return Ok(param(Role::RouterBias, Kind::Bias, Some(layer)));
        }
        let (module, kind) = if let Some(m) = rest.strip_suffix(".weight_scale_inv") {
            (m, Kind::Scale)
        } else if let Some(m) = rest.strip_suffix(".weight") {
            (m, Kind::Weight)
        } else if let Some(m) = rest.strip_suffix(".bias") {
            (m, Kind::Bias)
        } else {
            return Err(unknown());
        };
        let proj = |p: &str| match p {
            "gate_proj" => Some(Proj::Gate),
            "up_proj" => Some(Proj::Up),
            "down_proj" => Some(Proj::Down),
            _ => None,
        };
        let role = match module {
            "input_layernorm"
            | "post_attention_layernorm"
            | "self_attn.q_norm"
            | "self_attn.k_norm"
            | "self_attn.q_a_layernorm"
            | "self_attn.kv_a_layernorm" => Role::Norm,
            "self_attn.q_proj" => Role::Q,
            "self_attn.k_proj" => Role::K,
            "self_attn.v_proj" => Role::V,
            "self_attn.o_proj" => Role::O,
            "self_attn.q_a_proj" => Role::MlaQA,
            "self_attn.q_b_proj" => Role::MlaQB,
            "self_attn.kv_a_proj_with_mqa" => Role::MlaKvA,
            "self_attn.kv_b_proj" => Role::MlaKvB,
            "mlp.gate" | "mlp.shared_expert_gate" => Role::Router,
            other => {
                let mlp = other.strip_prefix("mlp.").ok_or_else(unknown)?;
                if let Some(p) = mlp.strip_prefix("shared_experts.") {
                    Role::SharedExpert(proj(p).ok_or_else(unknown)?)
                } else if let Some(p) = mlp.strip_prefix("shared_expert.") {
                    Role::SharedExpert(proj(p).ok_or_else(unknown)?)
                } else if let Some(e) = mlp.strip_prefix("experts.") {
                    match e.split_once('.') {
                        Some((index, p)) => Role::Expert {
                            index: index.parse().map_err(|_| unknown())?,
                            proj: proj(p).ok_or_else(unknown)?,
                        },
                        None => {
                            if shape.len() != 3 {
                                return Err(Error::invalid_argument(format!(
                                    "tensor {name:?}: stacked experts need a [experts, out, in] shape, got {shape:?}"
                                )));
                            }
                            Role::Experts(proj(e).ok_or_else(unknown)?)
                        }
                    }
                } else {
                    Role::Mlp(proj(mlp).ok_or_else(unknown)?)
                }
            }
        };
        Ok(param(role, kind, Some(layer)))
    }
}

/// Model parameters in `params` (elements of weights and biases; FP8 scales excluded).
pub fn count_parameters(params: &[Param]) -> u64 {
    params
        .iter()
        .filter(|p| p.kind != Kind::Scale)
        .map(Param::elements)
        .sum()
}

/// Appends parameters in checkpoint order.
struct Builder<'a> {
    config: &'a ModelConfig,
    params: Vec<Param>,
}

impl Builder<'_> {
    fn push(&mut self, name: String, shape: Vec<u64>, role: Role, kind: Kind, layer: Option<u32>) {
        self.push_typed(name, shape, role, kind, layer, None);
    }

    fn push_typed(
        &mut self,
        name: String,
        shape: Vec<u64>,
        role: Role,
        kind: Kind,
        layer: Option<u32>,
        dtype: Option<DType>,
    ) {
        self.params.push(Param {
            name,
            shape,
            role,
            kind,
            layer,
            dtype,
        });
    }

    /// A decoder-layer linear `{module}.weight` of `[.., out, in]` (leading dims for stacked
    /// experts), block-FP8 with its `weight_scale_inv` when the checkpoint is.
    fn linear(&mut self, module: &str, lead: &[u64], out: u64, input: u64, role: Role, layer: u32) {
        let mut shape = lead.to_vec();
        shape.extend([out, input]);
        match self.config.fp8_block {
            None => self.push(
                format!("{module}.weight"),
                shape,
                role,
                Kind::Weight,
                Some(layer),
            ),
            Some([b0, b1]) => {
                self.push_typed(
                    format!("{module}.weight"),
                    shape,
                    role,
                    Kind::Weight,
                    Some(layer),
                    Some(DType::Float8E4M3),
                );
                let mut scale = lead.to_vec();
                scale.extend([out.div_ceil(b0), input.div_ceil(b1)]);
                self.push_typed(
                    format!("{module}.weight_scale_inv"),
                    scale,
                    role,
                    Kind::Scale,
                    Some(layer),
                    Some(DType::Float32),
                );
            }
        }
    }

    fn norm(&mut self, module: &str, size: u64, layer: Option<u32>) {
        self.push(
            format!("{module}.weight"),
            vec![size],
            Role::Norm,
            Kind::Weight,
            layer,
        );
    }

    fn attention(&mut self, p: &str, layer: u32) {
        let c = self.config;
        let h = c.hidden_size;
        match &c.mla {
            Some(mla) => {
                let qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
                match mla.q_lora_rank {
                    Some(rank) => {
                        self.linear(&format!("{p}.q_a_proj"), &[], rank, h, Role::MlaQA, layer);
                        self.norm(&format!("{p}.q_a_layernorm"), rank, Some(layer));
                        self.linear(
                            &format!("{p}.q_b_proj"),
                            &[],
                            c.num_heads * qk_head,
                            rank,
                            Role::MlaQB,
                            layer,
                        );
                    }
                    None => self.linear(
                        &format!("{p}.q_proj"),
                        &[],
                        c.num_heads * qk_head,
                        h,
                        Role::Q,
                        layer,
                    ),
                }
                self.linear(
                    &format!("{p}.kv_a_proj_with_mqa"),
                    &[],
                    mla.kv_lora_rank + mla.qk_rope_head_dim,
                    h,
                    Role::MlaKvA,
                    layer,
                );
                self.norm(
                    &format!("{p}.kv_a_layernorm"),
                    mla.kv_lora_rank,
                    Some(layer),
                );
                self.linear(
                    &format!("{p}.kv_b_proj"),
                    &[],
                    c.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                    mla.kv_lora_rank,
                    Role::MlaKvB,
                    layer,
                );
                self.linear(
                    &format!("{p}.o_proj"),
                    &[],
                    h,
                    c.num_heads * mla.v_head_dim,
                    Role::O,
                    layer,
                );
            }
            None => {
                let q = c.num_heads * c.head_dim;
                let kv = c.num_kv_heads * c.head_dim;
                for (name, rows, role, norm) in [
                    ("q", q, Role::Q, "q_norm"),
                    ("k", kv, Role::K, "k_norm"),
                    ("v", kv, Role::V, ""),
                ] {
                    let module = format!("{p}.{name}_proj");
                    self.linear(&module, &[], rows, h, role, layer);
                    if c.attention_bias {
                        self.push(
                            format!("{module}.bias"),
                            vec![rows],
                            role,
                            Kind::Bias,
                            Some(layer),
                        );
                    }
                    if c.qk_norm && !norm.is_empty() {
                        self.norm(&format!("{p}.{norm}"), c.head_dim, Some(layer));
                    }
                }
                self.linear(&format!("{p}.o_proj"), &[], h, q, Role::O, layer);
            }
        }
    }

    /// A gated MLP's three projections under `p` with intermediate size `inter`.
    fn gated_mlp(
        &mut self,
        p: &str,
        lead: &[u64],
        inter: u64,
        role: impl Fn(Proj) -> Role,
        layer: u32,
    ) {
        let h = self.config.hidden_size;
        for proj in [Proj::Gate, Proj::Up, Proj::Down] {
            let (out, input) = if proj == Proj::Down {
                (h, inter)
            } else {
                (inter, h)
            };
            self.linear(
                &format!("{p}.{}", proj.name()),
                lead,
                out,
                input,
                role(proj),
                layer,
            );
        }
    }

    fn layer(&mut self, layer: u32, storage: ExpertStorage) {
        let c = self.config;
        let h = c.hidden_size;
        let p = format!("model.layers.{layer}");
        self.norm(&format!("{p}.input_layernorm"), h, Some(layer));
        if !c.mlp_only {
            self.attention(&format!("{p}.self_attn"), layer);
        }
        self.norm(&format!("{p}.post_attention_layernorm"), h, Some(layer));
        let moe = match &c.moe {
            Some(moe) if c.is_moe_layer(u64::from(layer)) => moe,
            _ => {
                self.gated_mlp(
                    &format!("{p}.mlp"),
                    &[],
                    c.intermediate_size,
                    Role::Mlp,
                    layer,
                );
                return;
            }
        };
        let inter = moe.moe_intermediate_size;
        match storage {
            ExpertStorage::PerExpert => {
                for e in 0..moe.num_experts {
                    let index = u32::try_from(e).expect("expert count fits u32");
                    self.gated_mlp(
                        &format!("{p}.mlp.experts.{e}"),
                        &[],
                        inter,
                        |proj| Role::Expert { index, proj },
                        layer,
                    );
                }
            }
            ExpertStorage::Stacked => self.gated_mlp(
                &format!("{p}.mlp.experts"),
                &[moe.num_experts],
                inter,
                Role::Experts,
                layer,
            ),
        }
        self.push(
            format!("{p}.mlp.gate.weight"),
            vec![moe.num_experts, h],
            Role::Router,
            Kind::Weight,
            Some(layer),
        );
        if moe.router_bias {
            self.push_typed(
                format!("{p}.mlp.gate.e_score_correction_bias"),
                vec![moe.num_experts],
                Role::RouterBias,
                Kind::Bias,
                Some(layer),
                Some(DType::Float32),
            );
        }
        if moe.shared_experts > 0 {
            self.gated_mlp(
                &format!("{p}.mlp.shared_experts"),
                &[],
                moe.shared_experts * inter,
                Role::SharedExpert,
                layer,
            );
        }
    }
}

/// Every parameter of `config` in checkpoint order: `model.embed_tokens`, then per layer its
/// norms, attention and MLP (routed experts, router, shared experts), then `model.norm` and
/// `lm_head` (absent when tied). DeepSeek-V3's multi-token-prediction layer is not part of the
/// inventory.
///
/// Parameter totals (weights and biases, [`count_parameters`]) of the presets, next to the
/// published sizes:
///
/// | preset | total | published |
/// |---|---|---|
/// | `deepseek-v3` | 671,026,419,200 | 671B (685B on the Hub includes the 14B MTP layer) |
/// | `kimi-k2` | 1,026,408,232,448 | 1T total, 32B activated |
/// | `qwen3-235b-a22b` | 235,093,634,560 | 235B |
/// | `qwen3-32b` | 32,762,123,264 | 32.8B |
/// | `llama-3.1-70b` | 70,553,706,496 | 70.6B |
///
/// Each total rounds to the published figure, so the inventories hold no extra or missing
/// tensor a published count would reveal. DeepSeek-V3's routed experts are 58 × 256 × 3 ×
/// 7168 × 2048 = 653,908,770,816 and the rest 17,117,648,384 (the router bias
/// `e_score_correction_bias`, 58 × 256, included). Kimi-K2's are 60 × 384 × 3 × 7168 × 2048
/// = 1,014,686,023,680; with experts stored per expert its inventory has 69,975 tensors.
pub fn inventory(config: &ModelConfig, storage: ExpertStorage) -> Vec<Param> {
    let mut b = Builder {
        config,
        params: Vec::new(),
    };
    let c = config;
    if !c.mlp_only {
        b.push(
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, c.hidden_size],
            Role::Embedding,
            Kind::Weight,
            None,
        );
    }
    for layer in 0..c.num_layers {
        b.layer(u32::try_from(layer).expect("layer count fits u32"), storage);
    }
    if !c.mlp_only {
        b.norm("model.norm", c.hidden_size, None);
        if !c.tie_word_embeddings {
            b.push(
                "lm_head.weight".to_string(),
                vec![c.vocab_size, c.hidden_size],
                Role::LmHead,
                Kind::Weight,
                None,
            );
        }
    }
    b.params
}
