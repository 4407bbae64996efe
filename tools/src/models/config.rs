//! Model hyper-parameters: the public presets, HuggingFace `config.json` fields, scaling.

use ncclreshard::error::{Error, Result};

/// Mixture-of-experts hyper-parameters (DeepSeek / Qwen3-MoE style: routed experts with the
/// HF names `mlp.experts.{e}.{gate,up,down}_proj`, optional DeepSeek-style shared experts).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub num_experts: u64,
    /// Intermediate size of one routed expert.
    pub moe_intermediate_size: u64,
    /// Layers `0..first_k_dense_layers` have a dense MLP; every later layer is MoE.
    pub first_k_dense_layers: u64,
    /// DeepSeek's `n_shared_experts`: one shared MLP of intermediate size
    /// `shared_experts × moe_intermediate_size` (`mlp.shared_experts.*`); 0 for none.
    pub shared_experts: u64,
    /// The router carries `mlp.gate.e_score_correction_bias` (DeepSeek-V3's `noaux_tc`).
    pub router_bias: bool,
}

/// Multi-head latent attention (DeepSeek-V2/V3) hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MlaConfig {
    /// `None`: queries come from a full `q_proj` instead of `q_a_proj`/`q_b_proj`.
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// A decoder-only transformer's shape, enough to list every parameter
/// ([`inventory`](super::inventory)).
///
/// Build one from a preset ([`ModelConfig::preset`]), from HuggingFace `config.json` fields
/// ([`ModelConfig::from_hf`]) or field by field. Plain data: no invariants beyond what
/// [`ModelConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelConfig {
    /// A label for output (`deepseek-v3`, the HF `model_type`, …).
    pub name: String,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    /// Intermediate size of the dense MLP layers (unused when every layer is MoE).
    pub intermediate_size: u64,
    pub vocab_size: u64,
    /// `lm_head` shares `embed_tokens`' weight, so the checkpoint has no `lm_head.weight`.
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm on queries and keys (`self_attn.q_norm` / `k_norm`, Qwen3).
    pub qk_norm: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
    pub moe: Option<MoeConfig>,
    pub mla: Option<MlaConfig>,
    /// Block-wise FP8 checkpoint (DeepSeek-V3's `quantization_config.weight_block_size`): every
    /// linear weight inside the decoder layers except the router is `float8_e4m3fn` with a
    /// `float32` `weight_scale_inv` of `[ceil(out/b0), ceil(in/b1)]`.
    pub fp8_block: Option<[u64; 2]>,
    /// Layers hold only their two norms and the MLP/MoE block — no attention, no embeddings,
    /// final norm or lm_head. M2N's `dsv3-toy` benchmark model is such a layer.
    pub mlp_only: bool,
}

/// The names [`ModelConfig::preset`] knows.
pub const PRESETS: [&str; 6] = [
    "deepseek-v3",
    "kimi-k2",
    "qwen3-235b-a22b",
    "qwen3-32b",
    "llama-3.1-70b",
    "dsv3-toy",
];

/// A value of a HuggingFace `config.json` field, as [`ModelConfig::from_hf`] reads it.
#[derive(Clone, Debug, PartialEq)]
pub enum HfValue {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<HfValue>),
}

impl HfValue {
    fn describe(&self) -> String {
        match self {
            HfValue::Null => "null".into(),
            HfValue::Bool(b) => b.to_string(),
            HfValue::Int(i) => i.to_string(),
            HfValue::Float(f) => f.to_string(),
            HfValue::Str(s) => format!("{s:?}"),
            HfValue::List(items) => format!("a list of {} items", items.len()),
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match *self {
            HfValue::Int(i) => u64::try_from(i).ok(),
            HfValue::Float(f) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => Some(f as u64),
            _ => None,
        }
    }
}

/// Reads typed fields through the caller's getter; every error names the key.
struct Fields<F> {
    get: F,
}

impl<F: Fn(&str) -> Option<HfValue>> Fields<F> {
    /// The value of `key`, `None` when missing or `null`.
    fn value(&self, key: &str) -> Option<HfValue> {
        (self.get)(key).filter(|v| *v != HfValue::Null)
    }

    fn bad(key: &str, value: &HfValue, want: &str) -> Error {
        Error::invalid_argument(format!(
            "config key {key:?} is {}; expected {want}",
            value.describe()
        ))
    }

    fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.value(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| Self::bad(key, &v, "a non-negative integer"))
            })
            .transpose()
    }

    fn positive(&self, key: &str) -> Result<u64> {
        match self.opt_u64(key)? {
            Some(0) => Err(Error::invalid_argument(format!(
                "config key {key:?} is 0; it must be at least 1"
            ))),
            Some(n) => Ok(n),
            None => Err(Error::invalid_argument(format!(
                "config key {key:?} is missing"
            ))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.value(key)
            .map(|v| match v {
                HfValue::Bool(b) => Ok(b),
                other => Err(Self::bad(key, &other, "true or false")),
            })
            .transpose()
    }

    fn opt_str(&self, key: &str) -> Result<Option<String>> {
        self.value(key)
            .map(|v| match v {
                HfValue::Str(s) => Ok(s),
                other => Err(Self::bad(key, &other, "a string")),
            })
            .transpose()
    }
}

impl ModelConfig {
    /// A public model by name (see [`PRESETS`]). Hyper-parameters are those of the models'
    /// published `config.json` files; DeepSeek-V3 excludes its multi-token-prediction layer,
    /// and DeepSeek-V3 and Kimi-K2 are listed in the training dtype (their checkpoints are
    /// block-FP8; no scales here).
    ///
    /// `kimi-k2` is Moonshot AI's Kimi-K2 (`moonshotai/Kimi-K2-Instruct`, `model_type`
    /// `kimi_k2`, architecture `DeepseekV3ForCausalLM`): DeepSeek-V3's layout — 61 layers,
    /// hidden 7168, MLA with `q_lora_rank` 1536, `kv_lora_rank` 512, head dims 128 + 64 and
    /// v 128, dense MLP intermediate 18432, expert intermediate 2048, one shared expert, the
    /// `noaux_tc` router bias — with 64 attention heads (DeepSeek-V3: 128), 384 routed
    /// experts (256), one dense first layer (`first_k_dense_replace` 1; DeepSeek-V3: 3),
    /// a 163,840-token vocabulary (129,280), untied embeddings and no MTP layer
    /// (`num_nextn_predict_layers` 0).
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let dense = |name: &str| ModelConfig {
            name: name.to_string(),
            hidden_size: 0,
            num_layers: 0,
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 128,
            intermediate_size: 0,
            vocab_size: 0,
            tie_word_embeddings: false,
            qk_norm: false,
            attention_bias: false,
            moe: None,
            mla: None,
            fp8_block: None,
            mlp_only: false,
        };
        let deepseek_v3 = || ModelConfig {
            hidden_size: 7168,
            num_layers: 61,
            num_heads: 128,
            num_kv_heads: 128,
            intermediate_size: 18432,
            vocab_size: 129280,
            moe: Some(MoeConfig {
                num_experts: 256,
                moe_intermediate_size: 2048,
                first_k_dense_layers: 3,
                shared_experts: 1,
                router_bias: true,
            }),
            mla: Some(MlaConfig {
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            }),
            ..dense(name)
        };
        let config = match name {
            "deepseek-v3" => deepseek_v3(),
            "kimi-k2" => ModelConfig {
                num_heads: 64,
                num_kv_heads: 64,
                vocab_size: 163840,
                moe: Some(MoeConfig {
                    num_experts: 384,
                    moe_intermediate_size: 2048,
                    first_k_dense_layers: 1,
                    shared_experts: 1,
                    router_bias: true,
                }),
                ..deepseek_v3()
            },
            "dsv3-toy" => ModelConfig {
                num_layers: 1,
                moe: Some(MoeConfig {
                    first_k_dense_layers: 0,
                    ..deepseek_v3().moe.expect("deepseek-v3 is MoE")
                }),
                fp8_block: Some([128, 128]),
                mlp_only: true,
                ..deepseek_v3()
            },
            "qwen3-235b-a22b" => ModelConfig {
                hidden_size: 4096,
                num_layers: 94,
                num_heads: 64,
                num_kv_heads: 4,
                intermediate_size: 12288,
                vocab_size: 151936,
                qk_norm: true,
                moe: Some(MoeConfig {
                    num_experts: 128,
                    moe_intermediate_size: 1536,
                    first_k_dense_layers: 0,
                    shared_experts: 0,
                    router_bias: false,
                }),
                ..dense(name)
            },
            "qwen3-32b" => ModelConfig {
                hidden_size: 5120,
                num_layers: 64,
                num_heads: 64,
                num_kv_heads: 8,
                intermediate_size: 25600,
                vocab_size: 151936,
                qk_norm: true,
                ..dense(name)
            },
            "llama-3.1-70b" => ModelConfig {
                hidden_size: 8192,
                num_layers: 80,
                num_heads: 64,
                num_kv_heads: 8,
                intermediate_size: 28672,
                vocab_size: 128256,
                ..dense(name)
            },
            other => {
                return Err(Error::invalid_argument(format!(
                    "unknown model {other:?}; known models: {}",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(config)
    }

    /// Reads the hyper-parameters of a HuggingFace `config.json` through `get`, which returns a
    /// field's value by key (`None` when absent). Nested fields are asked for with dotted keys
    /// (`quantization_config.weight_block_size`), so the library needs no JSON parser; the
    /// CLI's `models_json` adapter provides the getter.
    ///
    /// Understood: Llama/Qwen2/Qwen3 dense models (`qk_norm` for `model_type` `qwen3*`, q/k/v
    /// biases from `attention_bias` or `model_type` `qwen2*`), Qwen3-MoE (`num_experts`,
    /// `moe_intermediate_size`, every layer sparse) and DeepSeek-V2/V3 (`n_routed_experts`,
    /// `first_k_dense_replace`, `n_shared_experts`, `topk_method: noaux_tc`, MLA ranks, block
    /// FP8 `quantization_config`). A missing `tie_word_embeddings` means untied (the default
    /// of these model classes). Errors name the missing or invalid key, and layouts this
    /// module cannot express (sparse-step MoE, Qwen2-MoE shared experts, other quantizations)
    /// are errors rather than silently wrong inventories.
    pub fn from_hf<F>(get: F) -> Result<ModelConfig>
    where
        F: Fn(&str) -> Option<HfValue>,
    {
        let f = Fields { get };
        let model_type = f.opt_str("model_type")?.unwrap_or_default();
        let hidden_size = f.positive("hidden_size")?;
        let num_layers = f.positive("num_hidden_layers")?;
        let num_heads = f.positive("num_attention_heads")?;
        let num_kv_heads = match f.opt_u64("num_key_value_heads")? {
            Some(0) => {
                return Err(Error::invalid_argument(
                    "config key \"num_key_value_heads\" is 0; it must be at least 1",
                ))
            }
            Some(n) => n,
            None => num_heads,
        };
        let head_dim = match f.opt_u64("head_dim")? {
            Some(0) => {
                return Err(Error::invalid_argument(
                    "config key \"head_dim\" is 0; it must be at least 1",
                ))
            }
            Some(n) => n,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(Error::invalid_argument(format!(
                    "config key \"head_dim\" is missing and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
                )))
            }
        };
        let vocab_size = f.positive("vocab_size")?;
        let tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(false);
        let qwen3 = model_type.starts_with("qwen3");
        let qk_norm = f.opt_bool("qk_norm")?.unwrap_or(qwen3);
        let attention_bias = f
            .opt_bool("attention_bias")?
            .unwrap_or(model_type.starts_with("qwen2"));

        if f.opt_u64("num_local_experts")?.is_some_and(|n| n > 0) {
            return Err(Error::invalid_argument(
                "config key \"num_local_experts\": Mixtral-style experts (block_sparse_moe.experts.N.w1/w2/w3) are not supported",
            ));
        }
        let experts = match f.opt_u64("n_routed_experts")? {
            Some(n) => Some(("n_routed_experts", n)),
            None => f.opt_u64("num_experts")?.map(|n| ("num_experts", n)),
        };
        let moe = match experts {
            None | Some((_, 0)) => None,
            Some((_, num_experts)) => {
                if let Some(step) = f.opt_u64("decoder_sparse_step")? {
                    if step != 1 {
                        return Err(Error::invalid_argument(format!(
                            "config key \"decoder_sparse_step\" is {step}; only 1 (every layer sparse after the dense ones) is supported"
                        )));
                    }
                }
                if let Some(freq) = f.opt_u64("moe_layer_freq")? {
                    if freq != 1 {
                        return Err(Error::invalid_argument(format!(
                            "config key \"moe_layer_freq\" is {freq}; only 1 is supported"
                        )));
                    }
                }
                match f.value("mlp_only_layers") {
                    None => {}
                    Some(HfValue::List(items)) if items.is_empty() => {}
                    Some(other) => {
                        return Err(Error::invalid_argument(format!(
                            "config key \"mlp_only_layers\" is {}; only an empty list is supported",
                            other.describe()
                        )))
                    }
                }
                if let Some(n) = f.opt_u64("shared_expert_intermediate_size")? {
                    if n > 0 {
                        return Err(Error::invalid_argument(
                            "config key \"shared_expert_intermediate_size\": Qwen2-MoE-style shared experts are not supported",
                        ));
                    }
                }
                let topk_method = f.opt_str("topk_method")?;
                Some(MoeConfig {
                    num_experts,
                    moe_intermediate_size: f.positive("moe_intermediate_size")?,
                    first_k_dense_layers: f.opt_u64("first_k_dense_replace")?.unwrap_or(0),
                    shared_experts: f.opt_u64("n_shared_experts")?.unwrap_or(0),
                    router_bias: topk_method.as_deref() == Some("noaux_tc"),
                })
            }
        };
        let dense_layers = moe
            .as_ref()
            .map_or(num_layers, |m| m.first_k_dense_layers.min(num_layers));
        let intermediate_size = if dense_layers > 0 {
            f.positive("intermediate_size")?
        } else {
            f.opt_u64("intermediate_size")?.unwrap_or(0)
        };

        let mla = match f.opt_u64("kv_lora_rank")? {
            None => None,
            Some(kv_lora_rank) => Some(MlaConfig {
                q_lora_rank: f.opt_u64("q_lora_rank")?.filter(|&r| r > 0),
                kv_lora_rank,
                qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
                qk_rope_head_dim: f.positive("qk_rope_head_dim")?,
                v_head_dim: f.positive("v_head_dim")?,
            }),
        };

        let fp8_block = match f.opt_str("quantization_config.quant_method")? {
            None => None,
            Some(method) if method == "fp8" => {
                let key = "quantization_config.weight_block_size";
                match f.value(key) {
                    Some(HfValue::List(items)) => match items.as_slice() {
                        [a, b] => match (a.as_u64(), b.as_u64()) {
                            (Some(a), Some(b)) if a > 0 && b > 0 => Some([a, b]),
                            _ => {
                                return Err(Fields::<F>::bad(
                                    key,
                                    &HfValue::List(items.clone()),
                                    "two positive integers",
                                ))
                            }
                        },
                        _ => {
                            return Err(Fields::<F>::bad(
                                key,
                                &HfValue::List(items.clone()),
                                "two positive integers",
                            ))
                        }
                    },
                    Some(other) => return Err(Fields::<F>::bad(key, &other, "[rows, cols]")),
                    None => {
                        return Err(Error::invalid_argument(format!(
                            "config key {key:?} is missing; only block-wise fp8 is supported"
                        )))
                    }
                }
            }
            Some(method) => {
                return Err(Error::invalid_argument(format!(
                    "config key \"quantization_config.quant_method\" is {method:?}; only \"fp8\" (block-wise) is supported"
                )))
            }
        };

        let config = ModelConfig {
            name: if model_type.is_empty() {
                "custom".to_string()
            } else {
                model_type
            },
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            tie_word_embeddings,
            qk_norm,
            attention_bias,
            moe,
            mla,
            fp8_block,
            mlp_only: false,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that every size a parameter shape uses is non-zero.
    pub fn validate(&self) -> Result<()> {
        let mut sizes: Vec<(&str, u64)> = vec![
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
        ];
        if !self.mlp_only {
            sizes.push(("vocab_size", self.vocab_size));
            sizes.push(("num_heads", self.num_heads));
            match &self.mla {
                Some(mla) => {
                    sizes.push(("mla.kv_lora_rank", mla.kv_lora_rank));
                    sizes.push(("mla.qk_nope_head_dim", mla.qk_nope_head_dim));
                    sizes.push(("mla.qk_rope_head_dim", mla.qk_rope_head_dim));
                    sizes.push(("mla.v_head_dim", mla.v_head_dim));
                    if let Some(rank) = mla.q_lora_rank {
                        sizes.push(("mla.q_lora_rank", rank));
                    }
                }
                None => {
                    sizes.push(("num_kv_heads", self.num_kv_heads));
                    sizes.push(("head_dim", self.head_dim));
                }
            }
        }
        if self.dense_layers() > 0 {
            sizes.push(("intermediate_size", self.intermediate_size));
        }
        if let Some(moe) = &self.moe {
            sizes.push(("moe.num_experts", moe.num_experts));
            sizes.push(("moe.moe_intermediate_size", moe.moe_intermediate_size));
        }
        if let Some([a, b]) = self.fp8_block {
            sizes.push(("fp8_block[0]", a));
            sizes.push(("fp8_block[1]", b));
        }
        match sizes.iter().find(|(_, n)| *n == 0) {
            Some((field, _)) => Err(Error::invalid_argument(format!(
                "model {}: {field} is 0; it must be at least 1",
                self.name
            ))),
            None => Ok(()),
        }
    }

    /// Whether decoder layer `layer` has an MoE block (else a dense MLP).
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| layer >= m.first_k_dense_layers)
    }

    /// How many layers have a dense MLP.
    pub fn dense_layers(&self) -> u64 {
        self.moe.as_ref().map_or(self.num_layers, |m| {
            m.first_k_dense_layers.min(self.num_layers)
        })
    }

    /// The same architecture with every width divided by `factor` (rounded up, at least 1):
    /// hidden, intermediate and expert intermediate sizes, vocabulary, experts, heads, KV heads
    /// and MLA ranks. Layer count, head dims and the FP8 block stay, so the inventory keeps its
    /// names and structure while bytes shrink by about `factor²` — what the host-executed refit
    /// demo and tests use.
    pub fn scaled(&self, factor: u64) -> Result<ModelConfig> {
        if factor == 0 {
            return Err(Error::invalid_argument(
                "scale factor is 0; it must be at least 1",
            ));
        }
        let div = |n: u64| if n == 0 { 0 } else { n.div_ceil(factor).max(1) };
        let num_heads = div(self.num_heads);
        Ok(ModelConfig {
            name: if factor == 1 {
                self.name.clone()
            } else {
                format!("{}/{factor}", self.name)
            },
            hidden_size: div(self.hidden_size),
            num_heads,
            num_kv_heads: div(self.num_kv_heads).min(num_heads),
            intermediate_size: div(self.intermediate_size),
            vocab_size: div(self.vocab_size),
            moe: self.moe.as_ref().map(|m| MoeConfig {
                num_experts: div(m.num_experts),
                moe_intermediate_size: div(m.moe_intermediate_size),
                ..m.clone()
            }),
            mla: self.mla.as_ref().map(|m| MlaConfig {
                q_lora_rank: m.q_lora_rank.map(div),
                kv_lora_rank: div(m.kv_lora_rank),
                ..m.clone()
            }),
            ..self.clone()
        })
    }
}
