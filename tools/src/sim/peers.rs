//! The other ways of moving the weights, on the same cluster model: NeMo RL's `nccl_reshard`
//! refit (NCCL M2N for the feed-forward tensors, its packed broadcast for the rest), and the
//! costs around a refit that every method pays.

use super::baseline::{gather_broadcast_with, BaselineParams};
use super::m2n::{m2n, M2nParams, Schedule};
use super::{Cluster, Phase, SimReport};
use ncclreshard::layout::TensorSpec;

/// Work of the RL framework and the inference engine around any refit, whatever moves the
/// bytes: orchestrating the workers (Ray calls into every inference worker) and the engine's
/// post-processing of loaded weights (vLLM's `process_weights_after_loading`). Not
/// published; set from one measurement (NeMo RL's Qwen3-30B refit, where it is most of the
/// time: docs/simulator.md §4) and charged to every method or to none.
pub const ENGINE_POSTPROCESS_S: f64 = 0.70;

/// True for the tensors NeMo RL's hybrid refit sends through NCCL M2N: the feed-forward
/// projections (routed experts, shared experts, dense MLP; with their FP8 scales).
pub fn is_feed_forward(name: &str) -> bool {
    name.contains(".mlp.") && name.contains("_proj.")
}

/// NeMo RL's `nccl_reshard` refit: the feed-forward tensors through NCCL M2N (hierarchical,
/// node-aware, the PACK transport, one communicator over all ranks, one call per tensor, in
/// checkpoint order), the other tensors (and any M2N cannot move) through NeMo RL's packed
/// gather + broadcast (`baseline`) on their own communicator. One pass over the checkpoint feeds both, so the
/// two streams overlap: the refit takes as long as the longer one. Without
/// [`ENGINE_POSTPROCESS_S`].
pub fn nemo_rl_reshard(
    names: &[String],
    tensors: &[TensorSpec],
    cluster: &Cluster,
    params: &M2nParams,
    baseline: &BaselineParams,
) -> SimReport {
    let (mut ffn_names, mut ffn, mut rest) = (Vec::new(), Vec::new(), Vec::new());
    for (name, spec) in names.iter().zip(tensors) {
        if is_feed_forward(name) {
            ffn_names.push(name.clone());
            ffn.push(spec.clone());
        } else {
            rest.push(spec.clone());
        }
    }
    let params = M2nParams {
        pack: true,
        ..params.clone()
    };
    let reshard = m2n(
        &ffn_names,
        &ffn,
        cluster,
        &params,
        Schedule::OneCommunicator,
    );
    let broadcast = gather_broadcast_with(&rest, cluster, baseline);
    let time_s = reshard.sim.time_s.max(broadcast.time_s);
    SimReport {
        time_s,
        bytes_total: reshard.sim.bytes_total + broadcast.bytes_total,
        bytes_offnode: reshard.sim.bytes_offnode + broadcast.bytes_offnode,
        bytes_local: 0,
        messages_total: reshard.sim.messages_total + broadcast.messages_total,
        messages_max_per_rank: reshard.sim.messages_max_per_rank + broadcast.messages_max_per_rank,
        messages_mean_per_rank: reshard.sim.messages_mean_per_rank
            + broadcast.messages_mean_per_rank,
        bytes_max_per_rank: broadcast.bytes_max_per_rank,
        busiest_link: reshard.sim.busiest_link.clone(),
        nic_bytes: Vec::new(),
        phases: vec![
            Phase {
                name: "m2n",
                seconds: reshard.sim.time_s,
            },
            Phase {
                name: "broadcast",
                seconds: broadcast.time_s,
            },
        ],
        p90_s: time_s,
        trials: 0,
        setup_s: 0.0,
        memory: None,
        critical: None,
        rounds: None,
    }
}
