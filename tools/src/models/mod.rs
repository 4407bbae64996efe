//! Model inventories and the parallel layouts of an RL weight refit (docs/design.md §6).
//!
//! Three steps, all pure data:
//!
//! 1. [`ModelConfig`]: public hyper-parameters — a preset ([`ModelConfig::preset`],
//!    [`PRESETS`]), HuggingFace `config.json` fields ([`ModelConfig::from_hf`], with the JSON
//!    read by the CLI), or a smaller copy for host runs ([`ModelConfig::scaled`]).
//! 2. [`inventory`]: every parameter with its HF name, shape, fixed dtype (if any) and
//!    [`Role`]; routed experts per expert or stacked ([`ExpertStorage`]). A tensor listing
//!    (M2N's `*.model.json`) becomes the same [`Param`]s through [`Param::from_name`].
//! 3. [`refit`] / [`refit_params`]: a training spec ([`TrainSpec`], Megatron `tp,cp,pp,dp,ep,etp`
//!    or FSDP2 `fsdp`) and an inference spec ([`InferSpec`], vLLM/SGLang `tp,dp,ep`) give
//!    every parameter's source and destination [`Layout`](ncclreshard::Layout) as a
//!    [`TensorSpec`](ncclreshard::TensorSpec), ready for the planner.
//!
//! # Fused inference buffers and byte offsets
//!
//! Inference engines keep q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj`, MLA's
//! `q_a`/`kv_a` in `fused_qkv_a_proj` and routed experts in `w13`/`w2`. A refit writes each
//! checkpoint tensor straight into its part of the fused buffer: the destination layout is the
//! part's view (dense, or for stacked gate/up the strided `w13` view), and the view's start is
//! the fused buffer's local pointer plus [`Refit::fused_offset_bytes`] — the local extent of
//! the parts before it along the concatenation dim times the view's stride there. Example:
//! with TP 4, `k_proj` of Llama-3.1-70B starts `(8192/4)·8192` elements into the rank's
//! `qkv_proj`; `up_proj` of stacked experts starts `I_local·H` elements into `w13`.
//! Per-expert tensors sit in their expert's slot of `w13`/`w2` (the members before them on
//! that rank are the earlier local experts). The training side is described as separate dense
//! tensors in HF layout: a trainer whose parameters are fused differently (Megatron's
//! interleaved `linear_qkv`) converts or describes its own views.
//!
//! Layouts use DTensor's chunk rule throughout, also for vocab and expert splits; an engine
//! that splits unevenly another way (vLLM pads vocab to a multiple of 64) must describe its
//! own shards. All of this is deterministic: every rank computes the same [`Refit`].

mod config;
mod infer_dtype;
mod inventory;
mod refit;
mod spec;

pub use config::{HfValue, MlaConfig, ModelConfig, MoeConfig, PRESETS};
pub use infer_dtype::{infer_conversions, InferDtype};
pub use inventory::{count_parameters, inventory, ExpertStorage, Kind, Param, Proj, Role};
pub use refit::{refit, refit_params, FusedView, Refit, RefitOptions};
pub use spec::{InferSpec, M2nSide, TrainSpec};

#[cfg(test)]
mod tests;
