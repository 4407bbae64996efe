//! Every public measurement the simulator can reproduce, next to what it simulates with one
//! parameter set (`ncclreshard calibrate`). The published numbers and their sources are
//! copied here from public pages (docs/simulator.md §6 lists them).

use super::baseline::{gather_broadcast_with, BaselineParams};
use super::m2n::{m2n, M2nParams, Schedule};
use super::peers::{nemo_rl_reshard, ENGINE_POSTPROCESS_S};
use super::Cluster;
use crate::models::{refit, InferSpec, ModelConfig, MoeConfig, Refit, RefitOptions, TrainSpec};
use ncclreshard::error::Result;

/// What a measurement measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    /// NeMo RL's packed gather + broadcast refit, engine post-processing included.
    GatherBroadcast,
    /// NeMo RL's `nccl_reshard` refit (NCCL M2N + broadcast), post-processing included.
    NemoRlReshard,
    /// `reshard_model_bench`, hierarchical, node-aware (transfers only).
    M2nHierarchical,
    /// `reshard_model_bench`, direct, uniform (transfers only).
    M2nDirect,
}

/// One public measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub name: &'static str,
    pub method: Method,
    pub model: &'static str,
    pub train: &'static str,
    pub infer: &'static str,
    /// The cluster preset with overrides (`Cluster::parse`).
    pub cluster: &'static str,
    /// The published range (equal ends for a single number), seconds.
    pub low_s: f64,
    pub high_s: f64,
    pub source: &'static str,
    /// True when this row set one of the simulator's uncertain parameters (so it is a fit,
    /// not a prediction).
    pub sets: Option<&'static str>,
}

impl Measurement {
    /// The number the simulation is compared with: the middle of the published range.
    pub fn published_s(&self) -> f64 {
        0.5 * (self.low_s + self.high_s)
    }
}

const NEMO_RL_BLOG: &str =
    "NVIDIA technical blog on NeMo RL weight refit with NCCL reshard (docs/facts.md)";
const M2N_README: &str = "NVIDIA/nccl-extensions nccl_m2n/README.md, reshard_model_bench Reference Performance (--validate --no-dedup, Latency Max)";

/// The public measurements, in `ncclreshard calibrate` order.
pub const MEASUREMENTS: [Measurement; 9] = [
    Measurement {
        name: "NeMo RL gather+broadcast, DeepSeek-V3, 256+256 H100",
        method: Method::GatherBroadcast,
        model: "deepseek-v3",
        train: "pp16,ep16",
        infer: "tp32,dp8",
        cluster: "dgx-h100",
        low_s: 14.21,
        high_s: 15.52,
        source: NEMO_RL_BLOG,
        sets: None,
    },
    Measurement {
        name: "NeMo RL gather+broadcast, DeepSeek-V3, GB200 NVL72",
        method: Method::GatherBroadcast,
        model: "deepseek-v3",
        train: "pp16,ep16",
        infer: "tp32,dp8",
        cluster: "gb200-nvl72",
        low_s: 6.1,
        high_s: 6.1,
        source: NEMO_RL_BLOG,
        sets: None,
    },
    Measurement {
        name: "NeMo RL nccl_reshard (M2N), DeepSeek-V3, 256+256 H100",
        method: Method::NemoRlReshard,
        model: "deepseek-v3",
        train: "pp16,ep16",
        infer: "tp32,dp8",
        cluster: "dgx-h100",
        low_s: 2.39,
        high_s: 2.83,
        source: NEMO_RL_BLOG,
        sets: None,
    },
    Measurement {
        name: "NeMo RL nccl_reshard (M2N), DeepSeek-V3, GB200 NVL72",
        method: Method::NemoRlReshard,
        model: "deepseek-v3",
        train: "pp16,ep16",
        infer: "tp32,dp8",
        cluster: "gb200-nvl72",
        low_s: 1.93,
        high_s: 2.59,
        source: NEMO_RL_BLOG,
        sets: None,
    },
    Measurement {
        name: "NeMo RL nccl_reshard (M2N), Qwen3-30B-A3B EP8×PP2 → TP8×DP2, H100",
        method: Method::NemoRlReshard,
        model: "qwen3-30b-a3b",
        train: "pp2,ep8,dp8",
        infer: "tp8,dp2",
        cluster: "dgx-h100",
        low_s: 0.74,
        high_s: 1.00,
        source: NEMO_RL_BLOG,
        sets: Some("engine post-processing per refit"),
    },
    Measurement {
        name: "M2N reshard_model_bench hierarchical, DeepSeek-V3, 256 GB200",
        method: Method::M2nHierarchical,
        model: "deepseek-v3-fp8",
        train: "pp4,ep16,dp32",
        infer: "tp8,dp16",
        cluster: "gb200-nvl72,nvlink_domain=64",
        low_s: 1.44744,
        high_s: 1.44744,
        source: M2N_README,
        sets: Some("M2N host cost per call"),
    },
    Measurement {
        name: "M2N reshard_model_bench direct, DeepSeek-V3, 256 GB200",
        method: Method::M2nDirect,
        model: "deepseek-v3-fp8",
        train: "pp4,ep16,dp32",
        infer: "tp8,dp16",
        cluster: "gb200-nvl72,nvlink_domain=64",
        low_s: 3.83774,
        high_s: 3.83774,
        source: M2N_README,
        sets: None,
    },
    Measurement {
        name: "M2N reshard_model_bench hierarchical, Qwen3-235B, 128 GB200",
        method: Method::M2nHierarchical,
        model: "qwen3-235b-a22b",
        train: "tp2,cp2,pp4,dp4,ep16",
        infer: "tp8,dp8",
        cluster: "gb200-nvl72,nvlink_domain=64",
        low_s: 0.98875,
        high_s: 0.98875,
        source: M2N_README,
        sets: None,
    },
    Measurement {
        name: "M2N reshard_model_bench direct, Qwen3-235B, 128 GB200",
        method: Method::M2nDirect,
        model: "qwen3-235b-a22b",
        train: "tp2,cp2,pp4,dp4,ep16",
        infer: "tp8,dp8",
        cluster: "gb200-nvl72,nvlink_domain=64",
        low_s: 2.17516,
        high_s: 2.17516,
        source: M2N_README,
        sets: None,
    },
];

/// A published refit by another system, shown beside what the simulator says our plan does on
/// the same shape (`ncclreshard calibrate --compare`). Nothing is fitted to it: a comparison,
/// not a calibration row.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub name: &'static str,
    pub model: &'static str,
    pub train: &'static str,
    pub infer: &'static str,
    /// What inference stores (`--infer-dtype`).
    pub infer_dtype: &'static str,
    pub cluster: &'static str,
    pub published_s: f64,
    pub source: &'static str,
    /// How the published setup differs from the simulated one.
    pub note: &'static str,
}

/// The comparisons, in `ncclreshard calibrate --compare` order.
pub const COMPARISONS: [Comparison; 1] = [Comparison {
    name: "Perplexity RDMA writes, Kimi-K2 1T, 256 BF16 train → 128 FP8 infer",
    model: "kimi-k2",
    train: "pp16,ep16",
    infer: "tp16,dp8",
    infer_dtype: "fp8-block128",
    cluster: "dgx-h100",
    published_s: 1.3,
    source: "Perplexity blog (Sept 2025); TransferEngine paper, arXiv 2510.27656 (docs/facts.md)",
    note: "their training and inference parallelism is not published: pp16,ep16 → tp16,dp8 is our guess at 256 → 128 GPUs; RDMA writes from sender memory, H100/H200-class nodes",
}];

/// One row of `ncclreshard calibrate`.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrationRow {
    pub measurement: Measurement,
    pub published_s: f64,
    pub simulated_s: f64,
    /// `simulated_s / published_s`.
    pub ratio: f64,
}

/// Model configurations the measurements need besides the presets: DeepSeek-V3 as its
/// Hugging Face checkpoint stores it (block FP8, what M2N's `dsv3.model.json` lists) and
/// Qwen3-30B-A3B (its Hugging Face `config.json`).
pub fn model(name: &str) -> Result<ModelConfig> {
    match name {
        "deepseek-v3-fp8" => Ok(ModelConfig {
            name: name.to_string(),
            fp8_block: Some([128, 128]),
            ..ModelConfig::preset("deepseek-v3")?
        }),
        "qwen3-30b-a3b" => Ok(ModelConfig {
            name: name.to_string(),
            hidden_size: 2048,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            intermediate_size: 6144,
            moe: Some(MoeConfig {
                num_experts: 128,
                moe_intermediate_size: 768,
                first_k_dense_layers: 0,
                shared_experts: 0,
                router_bias: false,
            }),
            ..ModelConfig::preset("qwen3-235b-a22b")?
        }),
        other => ModelConfig::preset(other),
    }
}

/// The refit a measurement ran.
pub fn measurement_refit(m: &Measurement) -> Result<(Refit, Cluster)> {
    let config = model(m.model)?;
    let refit = refit(
        &config,
        &TrainSpec::parse(m.train)?,
        &InferSpec::parse(m.infer)?,
        &RefitOptions::default(),
    )?;
    Ok((refit, Cluster::parse(m.cluster)?))
}

/// Simulates one measurement with the simulator's one parameter set.
pub fn simulate_measurement(m: &Measurement) -> Result<CalibrationRow> {
    let (refit, cluster) = measurement_refit(m)?;
    let baseline = BaselineParams::nemo_rl(&cluster);
    let simulated_s = match m.method {
        Method::GatherBroadcast => {
            gather_broadcast_with(&refit.tensors, &cluster, &baseline).time_s + ENGINE_POSTPROCESS_S
        }
        Method::NemoRlReshard => {
            nemo_rl_reshard(
                &refit.names,
                &refit.tensors,
                &cluster,
                &M2nParams::hierarchical(),
                &baseline,
            )
            .time_s
                + ENGINE_POSTPROCESS_S
        }
        Method::M2nHierarchical | Method::M2nDirect => {
            let params = if m.method == Method::M2nDirect {
                M2nParams::direct()
            } else {
                M2nParams::hierarchical()
            };
            m2n(
                &refit.names,
                &refit.tensors,
                &cluster,
                &params,
                Schedule::ModelBench,
            )
            .sim
            .time_s
        }
    };
    let published_s = m.published_s();
    Ok(CalibrationRow {
        measurement: m.clone(),
        published_s,
        simulated_s,
        ratio: simulated_s / published_s,
    })
}

/// Every row of [`MEASUREMENTS`].
pub fn calibrate() -> Result<Vec<CalibrationRow>> {
    MEASUREMENTS.iter().map(simulate_measurement).collect()
}
