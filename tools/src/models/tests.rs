use super::*;
use ncclreshard::layout::{DType, Placement};
use ncclreshard::plan::{Config, Planner};
use std::collections::{HashMap, HashSet};

fn preset(name: &str) -> ModelConfig {
    ModelConfig::preset(name).unwrap()
}

fn total(name: &str) -> u64 {
    count_parameters(&inventory(&preset(name), ExpertStorage::Stacked))
}

#[test]
fn preset_parameter_totals_match_the_published_sizes() {
    // Exact totals (see `inventory`'s doc for the comparison with the published numbers).
    assert_eq!(total("deepseek-v3"), 671_026_419_200);
    assert_eq!(total("kimi-k2"), 1_026_408_232_448);
    assert_eq!(total("qwen3-235b-a22b"), 235_093_634_560);
    assert_eq!(total("qwen3-32b"), 32_762_123_264);
    assert_eq!(total("llama-3.1-70b"), 70_553_706_496);
    // Per-expert storage lists the same parameters.
    for name in PRESETS {
        let per_expert = inventory(&preset(name), ExpertStorage::PerExpert);
        assert_eq!(
            count_parameters(&per_expert),
            count_parameters(&inventory(&preset(name), ExpertStorage::Stacked)),
            "{name}"
        );
    }
}

#[test]
fn deepseek_v3_routed_experts_are_653_9_billion() {
    let params = inventory(&preset("deepseek-v3"), ExpertStorage::PerExpert);
    let routed: u64 = params
        .iter()
        .filter(|p| matches!(p.role, Role::Expert { .. }))
        .map(Param::elements)
        .sum();
    assert_eq!(routed, 58 * 256 * 3 * 7168 * 2048);
    assert_eq!(routed, 653_908_770_816);
    let experts = params
        .iter()
        .filter(|p| matches!(p.role, Role::Expert { .. }))
        .count();
    assert_eq!(experts, 58 * 256 * 3);
    let names: HashSet<&str> = params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names.len(), params.len(), "names are unique");
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.2.mlp.down_proj.weight",
        "model.layers.3.mlp.experts.17.gate_proj.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.60.mlp.shared_experts.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(names.contains(name), "{name}");
    }
    assert!(!names.contains("model.layers.2.mlp.gate.weight"));
    assert!(
        !names.contains("model.layers.61.input_layernorm.weight"),
        "MTP excluded"
    );
    let kv_b = params
        .iter()
        .find(|p| p.name == "model.layers.5.self_attn.kv_b_proj.weight")
        .unwrap();
    assert_eq!(kv_b.shape, vec![128 * 256, 512]);
    assert_eq!(kv_b.role, Role::MlaKvB);
}

#[test]
fn stacked_experts_have_a_leading_expert_dim() {
    let params = inventory(&preset("qwen3-235b-a22b"), ExpertStorage::Stacked);
    let gate = params
        .iter()
        .find(|p| p.name == "model.layers.93.mlp.experts.gate_proj.weight")
        .unwrap();
    assert_eq!(gate.shape, vec![128, 1536, 4096]);
    assert_eq!(gate.role, Role::Experts(Proj::Gate));
    let down = params
        .iter()
        .find(|p| p.name == "model.layers.0.mlp.experts.down_proj.weight")
        .unwrap();
    assert_eq!(down.shape, vec![128, 4096, 1536]);
    assert!(params
        .iter()
        .any(|p| p.name == "model.layers.0.self_attn.q_norm.weight"));
}

#[test]
fn names_classify_back_to_their_roles() {
    for name in PRESETS {
        for storage in [ExpertStorage::PerExpert, ExpertStorage::Stacked] {
            for p in inventory(&preset(name), storage) {
                let back = Param::from_name(&p.name, p.shape.clone(), p.dtype).unwrap();
                assert_eq!(back, p, "{name}");
            }
        }
    }
    let err = Param::from_name("vision_tower.blocks.0.attn.weight", vec![4], None).unwrap_err();
    assert!(
        err.message.contains("vision_tower.blocks.0.attn.weight"),
        "{err}"
    );
}

#[test]
fn kimi_k2_is_deepseek_v3_with_384_experts_64_heads_and_one_dense_layer() {
    // The fields of moonshotai/Kimi-K2-Instruct's config.json that shape the inventory.
    let kimi = [
        ("model_type", HfValue::Str("kimi_k2".into())),
        ("hidden_size", int(7168)),
        ("num_hidden_layers", int(61)),
        ("num_attention_heads", int(64)),
        ("num_key_value_heads", int(64)),
        ("intermediate_size", int(18432)),
        ("moe_intermediate_size", int(2048)),
        ("n_routed_experts", int(384)),
        ("n_shared_experts", int(1)),
        ("first_k_dense_replace", int(1)),
        ("moe_layer_freq", int(1)),
        ("topk_method", HfValue::Str("noaux_tc".into())),
        ("q_lora_rank", int(1536)),
        ("kv_lora_rank", int(512)),
        ("qk_nope_head_dim", int(128)),
        ("qk_rope_head_dim", int(64)),
        ("v_head_dim", int(128)),
        ("vocab_size", int(163840)),
        ("tie_word_embeddings", HfValue::Bool(false)),
        ("attention_bias", HfValue::Bool(false)),
        ("num_nextn_predict_layers", int(0)),
    ];
    let mut want = preset("kimi-k2");
    want.name = "kimi_k2".into();
    // head_dim is unused by MLA; from_hf derives it from hidden / heads.
    want.head_dim = 7168 / 64;
    assert_eq!(ModelConfig::from_hf(hf(&kimi)).unwrap(), want);

    let params = inventory(&preset("kimi-k2"), ExpertStorage::PerExpert);
    assert_eq!(params.len(), 69_975);
    let routed: Vec<&Param> = params
        .iter()
        .filter(|p| matches!(p.role, Role::Expert { .. }))
        .collect();
    assert_eq!(routed.len(), 60 * 384 * 3);
    assert_eq!(
        routed.iter().map(|p| p.elements()).sum::<u64>(),
        60 * 384 * 3 * 7168 * 2048
    );
    let names: HashSet<&str> = params.iter().map(|p| p.name.as_str()).collect();
    for name in [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.383.down_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.60.mlp.shared_experts.gate_proj.weight",
        "lm_head.weight",
    ] {
        assert!(names.contains(name), "{name}");
    }
    assert!(!names.contains("model.layers.0.mlp.gate.weight"));
    let q_b = params
        .iter()
        .find(|p| p.name == "model.layers.0.self_attn.q_b_proj.weight")
        .unwrap();
    assert_eq!(q_b.shape, vec![64 * (128 + 64), 1536]);
}

fn hf(fields: &[(&str, HfValue)]) -> impl Fn(&str) -> Option<HfValue> {
    let map: HashMap<String, HfValue> = fields
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    move |key| map.get(key).cloned()
}

fn int(n: i64) -> HfValue {
    HfValue::Int(n)
}

#[test]
fn hf_config_fields_reproduce_the_presets() {
    let deepseek = [
        ("model_type", HfValue::Str("deepseek_v3".into())),
        ("hidden_size", int(7168)),
        ("num_hidden_layers", int(61)),
        ("num_attention_heads", int(128)),
        ("num_key_value_heads", int(128)),
        ("intermediate_size", int(18432)),
        ("moe_intermediate_size", int(2048)),
        ("n_routed_experts", int(256)),
        ("n_shared_experts", int(1)),
        ("first_k_dense_replace", int(3)),
        ("moe_layer_freq", int(1)),
        ("topk_method", HfValue::Str("noaux_tc".into())),
        ("q_lora_rank", int(1536)),
        ("kv_lora_rank", int(512)),
        ("qk_nope_head_dim", int(128)),
        ("qk_rope_head_dim", int(64)),
        ("v_head_dim", int(128)),
        ("vocab_size", int(129280)),
        ("tie_word_embeddings", HfValue::Bool(false)),
        ("attention_bias", HfValue::Bool(false)),
        ("num_nextn_predict_layers", int(1)),
        (
            "quantization_config.quant_method",
            HfValue::Str("fp8".into()),
        ),
        (
            "quantization_config.weight_block_size",
            HfValue::List(vec![int(128), int(128)]),
        ),
    ];
    let config = ModelConfig::from_hf(hf(&deepseek)).unwrap();
    let mut want = preset("deepseek-v3");
    want.name = "deepseek_v3".into();
    want.fp8_block = Some([128, 128]);
    // head_dim is unused by MLA; from_hf derives it from hidden / heads.
    want.head_dim = 7168 / 128;
    assert_eq!(config, want);
    let fp8 = inventory(&config, ExpertStorage::PerExpert);
    let scale = fp8
        .iter()
        .find(|p| p.name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
        .unwrap();
    assert_eq!(scale.shape, vec![5, 56]);
    assert_eq!(scale.dtype, Some(DType::Float32));

    let qwen3 = [
        ("model_type", HfValue::Str("qwen3".into())),
        ("hidden_size", int(5120)),
        ("num_hidden_layers", int(64)),
        ("num_attention_heads", int(64)),
        ("num_key_value_heads", int(8)),
        ("head_dim", int(128)),
        ("intermediate_size", int(25600)),
        ("vocab_size", int(151936)),
        ("tie_word_embeddings", HfValue::Bool(false)),
        ("attention_bias", HfValue::Bool(false)),
        ("rope_scaling", HfValue::Null),
    ];
    let mut want = preset("qwen3-32b");
    want.name = "qwen3".into();
    assert_eq!(ModelConfig::from_hf(hf(&qwen3)).unwrap(), want);

    let qwen3_moe = [
        ("model_type", HfValue::Str("qwen3_moe".into())),
        ("hidden_size", int(4096)),
        ("num_hidden_layers", int(94)),
        ("num_attention_heads", int(64)),
        ("num_key_value_heads", int(4)),
        ("head_dim", int(128)),
        ("intermediate_size", int(12288)),
        ("moe_intermediate_size", int(1536)),
        ("num_experts", int(128)),
        ("decoder_sparse_step", int(1)),
        ("mlp_only_layers", HfValue::List(vec![])),
        ("vocab_size", int(151936)),
        ("tie_word_embeddings", HfValue::Bool(false)),
    ];
    let mut want = preset("qwen3-235b-a22b");
    want.name = "qwen3_moe".into();
    assert_eq!(ModelConfig::from_hf(hf(&qwen3_moe)).unwrap(), want);
}

#[test]
fn hf_errors_name_the_key() {
    let base = [
        ("hidden_size", int(64)),
        ("num_hidden_layers", int(2)),
        ("num_attention_heads", int(4)),
        ("intermediate_size", int(128)),
        ("vocab_size", int(100)),
    ];
    assert!(ModelConfig::from_hf(hf(&base)).is_ok());
    let without = |key: &str| -> Vec<(&str, HfValue)> {
        base.iter().filter(|(k, _)| *k != key).cloned().collect()
    };
    for key in [
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "intermediate_size",
    ] {
        let err = ModelConfig::from_hf(hf(&without(key))).unwrap_err();
        assert!(err.message.contains(key), "{key}: {err}");
    }
    let mut bad = base.to_vec();
    bad[0] = ("hidden_size", HfValue::Str("big".into()));
    let err = ModelConfig::from_hf(hf(&bad)).unwrap_err();
    assert!(
        err.message.contains("\"hidden_size\"") && err.message.contains("big"),
        "{err}"
    );
    let mut sparse = base.to_vec();
    sparse.extend([
        ("num_experts", int(8)),
        ("moe_intermediate_size", int(32)),
        ("decoder_sparse_step", int(2)),
    ]);
    let err = ModelConfig::from_hf(hf(&sparse)).unwrap_err();
    assert!(err.message.contains("decoder_sparse_step"), "{err}");
    let mut moe = base.to_vec();
    moe.push(("num_experts", int(8)));
    let err = ModelConfig::from_hf(hf(&moe)).unwrap_err();
    assert!(err.message.contains("moe_intermediate_size"), "{err}");
    let mut quant = base.to_vec();
    quant.push((
        "quantization_config.quant_method",
        HfValue::Str("awq".into()),
    ));
    let err = ModelConfig::from_hf(hf(&quant)).unwrap_err();
    assert!(err.message.contains("quant_method"), "{err}");
    let mut mixtral = base.to_vec();
    mixtral.push(("num_local_experts", int(8)));
    let err = ModelConfig::from_hf(hf(&mixtral)).unwrap_err();
    assert!(err.message.contains("num_local_experts"), "{err}");
}

#[test]
fn spec_worlds_follow_megatrons_ep_rule() {
    let world = |s: &str| TrainSpec::parse(s).unwrap().world();
    assert_eq!(world("pp16,ep16"), 256);
    assert_eq!(world("tp2,cp2,pp4,ep16"), 64);
    assert_eq!(world("tp4,pp4,dp2"), 32);
    assert_eq!(world("tp8,ep8"), 8);
    assert_eq!(world("tp=2, pp=2"), 4);
    assert_eq!(world("ep4,etp2"), 8);
    assert_eq!(world("fsdp8,tp2"), 16);
    let spec = TrainSpec::parse("pp16,ep16").unwrap();
    assert_eq!((spec.dp, spec.expert_dp()), (16, 1));
    assert_eq!(spec.to_string(), "tp1,cp1,pp16,dp16,ep16,etp1");
    assert_eq!(TrainSpec::parse(&spec.to_string()).unwrap(), spec);
    assert_eq!(InferSpec::parse("tp32,dp8").unwrap().world(), 256);
    let ep = InferSpec::parse("tp8,dp8,ep").unwrap();
    assert!(ep.expert_parallel);
    assert_eq!(InferSpec::parse("tp8,dp8,ep64").unwrap(), ep);
    assert!(!InferSpec::parse("tp8,ep1").unwrap().expert_parallel);
}

#[test]
fn spec_errors_name_the_bad_key() {
    for (text, key) in [
        ("pp16,xp4", "xp"),
        ("tp0", "tp"),
        ("pp2,pp4", "pp"),
        ("tp2,dp3,ep4", "ep"),
        ("dp2,fsdp4", "fsdp"),
        ("fsdp4,ep2", "ep"),
        ("tp", "tp"),
        ("tpx", "tpx"),
    ] {
        let err = TrainSpec::parse(text).unwrap_err();
        assert!(err.message.contains(key), "{text}: {err}");
    }
    for (text, key) in [("tp8,dp8,ep16", "ep"), ("tp8,pp2", "pp"), ("dp", "dp")] {
        let err = InferSpec::parse(text).unwrap_err();
        assert!(err.message.contains(key), "{text}: {err}");
    }
}

#[test]
fn m2n_sizes_become_specs() {
    let side = |num_gpus, tp, cp, ep, pp, dp| M2nSide {
        num_gpus,
        tp_size: tp,
        cp_size: cp,
        ep_size: ep,
        pp_size: pp,
        fsdp_size: 1,
        dp_size: dp,
    };
    // qwen235b-TP2CP2PP4EP16-128gpus-gb200.json
    let train = TrainSpec::from_m2n(&side(64, 2, 2, 16, 4, 1)).unwrap();
    assert_eq!(train, TrainSpec::parse("tp2,cp2,pp4,ep16").unwrap());
    let infer = InferSpec::from_m2n(&side(64, 8, 1, 1, 1, 8)).unwrap();
    assert_eq!(infer, InferSpec::parse("tp8,dp8").unwrap());
    // dsv3-256gpus-gb200.json
    let train = TrainSpec::from_m2n(&side(128, 1, 1, 16, 8, 1)).unwrap();
    assert_eq!(train, TrainSpec::parse("pp8,ep16").unwrap());
    let err = TrainSpec::from_m2n(&side(30, 4, 1, 1, 4, 1)).unwrap_err();
    assert!(err.message.contains("num_gpus"), "{err}");
    let err = TrainSpec::from_m2n(&side(32, 4, 1, 1, 4, 4)).unwrap_err();
    assert!(err.message.contains("dp_size"), "{err}");
    let err = InferSpec::from_m2n(&side(16, 8, 1, 1, 2, 1)).unwrap_err();
    assert!(err.message.contains("pp_size"), "{err}");
}

fn layout_of<'a>(refit: &'a Refit, name: &str) -> &'a ncclreshard::TensorSpec {
    let i = refit.names.iter().position(|n| n == name).unwrap();
    &refit.tensors[i]
}

#[test]
fn deepseek_v3_pp16_ep16_to_tp32_dp8() {
    let config = preset("deepseek-v3");
    let train = TrainSpec::parse("pp16,ep16").unwrap();
    let infer = InferSpec::parse("tp32,dp8").unwrap();
    let refit = refit(&config, &train, &infer, &RefitOptions::default()).unwrap();
    let params = inventory(&config, ExpertStorage::Stacked);
    assert_eq!(refit.names.len(), params.len());
    assert_eq!(
        refit.names.iter().collect::<HashSet<_>>().len(),
        params.len()
    );
    assert_eq!(
        (refit.train_ranks.clone(), refit.infer_ranks.clone()),
        (0..256, 256..512)
    );
    assert_eq!(
        refit.bytes(),
        2 * 671_026_419_200 + 2 * 58 * 256,
        "bf16 + f32 router bias"
    );
    for t in &refit.tensors {
        assert!(t.src.mesh.ranks().iter().all(|&r| r < 256));
        assert!(t.dst.mesh.ranks().iter().all(|&r| (256..512).contains(&r)));
    }

    // Layers 0..=3 on stage 0 (13 stages of 4, then 3 of 3), the lm_head on stage 15.
    let embed = layout_of(&refit, "model.embed_tokens.weight");
    assert_eq!(embed.src.mesh.ranks(), (0..16).collect::<Vec<_>>());
    let head = layout_of(&refit, "lm_head.weight");
    assert_eq!(head.src.mesh.ranks(), (240..256).collect::<Vec<_>>());
    assert_eq!(
        head.dst.placements,
        vec![Placement::Replicate, Placement::Shard(0)]
    );
    let l4 = layout_of(&refit, "model.layers.4.input_layernorm.weight");
    assert_eq!(l4.src.mesh.ranks()[0], 16);
    let l52 = layout_of(&refit, "model.layers.52.input_layernorm.weight");
    assert_eq!(l52.src.mesh.ranks()[0], 13 * 16);
    let l60 = layout_of(&refit, "model.layers.60.input_layernorm.weight");
    assert_eq!(l60.src.mesh.ranks()[0], 15 * 16);

    let experts = layout_of(&refit, "model.layers.3.mlp.experts.gate_proj.weight");
    assert_eq!(experts.shape, vec![256, 2048, 7168]);
    assert_eq!(experts.src.mesh.shape(), &[1, 16, 1]);
    assert_eq!(
        experts.src.placements,
        vec![
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Shard(1)
        ]
    );
    assert_eq!(experts.dst.mesh.shape(), &[8, 32]);
    assert_eq!(
        experts.dst.placements,
        vec![Placement::Replicate, Placement::Shard(1)]
    );
    assert_eq!(experts.dst.strides, Some(vec![2 * 64 * 7168, 7168, 1]));
    let down = layout_of(&refit, "model.layers.3.mlp.experts.down_proj.weight");
    assert_eq!(
        down.dst.placements,
        vec![Placement::Replicate, Placement::Shard(2)]
    );
    assert_eq!(down.dst.strides, None);

    let q_a = layout_of(&refit, "model.layers.10.self_attn.q_a_proj.weight");
    assert_eq!(q_a.src.placements, vec![Placement::Replicate; 3]);
    assert_eq!(q_a.dst.placements, vec![Placement::Replicate; 2]);
    let o = layout_of(&refit, "model.layers.10.self_attn.o_proj.weight");
    assert_eq!(
        o.dst.placements,
        vec![Placement::Replicate, Placement::Shard(1)]
    );
    let router = layout_of(&refit, "model.layers.10.mlp.gate.weight");
    assert_eq!(router.dst.placements, vec![Placement::Replicate; 2]);
    let bias = layout_of(&refit, "model.layers.10.mlp.gate.e_score_correction_bias");
    assert_eq!(bias.dtype, DType::Float32);

    let start = std::time::Instant::now();
    let planner = Planner::new(refit.tensors.clone(), Config::default()).unwrap();
    assert_eq!(planner.ranks(), (0..512).collect::<Vec<_>>());
    eprintln!(
        "Planner::new on {} tensors: {:?}",
        refit.tensors.len(),
        start.elapsed()
    );
}

#[test]
fn deepseek_v3_per_expert_tensors_live_on_their_owner() {
    let config = preset("deepseek-v3");
    let options = RefitOptions {
        experts: ExpertStorage::PerExpert,
        ..RefitOptions::default()
    };
    let train = TrainSpec::parse("pp16,ep16").unwrap();
    let ep = InferSpec::parse("tp8,dp32,ep").unwrap();
    let spread = refit(&config, &train, &ep, &options).unwrap();
    let e17 = layout_of(&spread, "model.layers.3.mlp.experts.17.gate_proj.weight");
    // 16 experts per EP rank: expert 17 on stage 0, ep coordinate 1 = rank 1.
    assert_eq!(e17.src.mesh.ranks(), &[1]);
    // 256 inference ranks, one expert each.
    assert_eq!(e17.dst.mesh.ranks(), &[256 + 17]);
    let e255 = layout_of(&spread, "model.layers.60.mlp.experts.255.down_proj.weight");
    assert_eq!(e255.src.mesh.ranks(), &[240 + 15]);
    assert_eq!(e255.dst.mesh.ranks(), &[511]);
    let tp = refit(
        &config,
        &train,
        &InferSpec::parse("tp32,dp8").unwrap(),
        &options,
    )
    .unwrap();
    let down = layout_of(&tp, "model.layers.3.mlp.experts.17.down_proj.weight");
    assert_eq!(
        down.dst.placements,
        vec![Placement::Replicate, Placement::Shard(1)]
    );
}

#[test]
fn etp_and_fsdp_layouts() {
    let config = preset("qwen3-235b-a22b").scaled(16).unwrap();
    let infer = InferSpec::parse("tp4").unwrap();
    let etp = refit(
        &config,
        &TrainSpec::parse("tp2,ep2,etp2").unwrap(),
        &infer,
        &RefitOptions::default(),
    )
    .unwrap();
    let gate = layout_of(&etp, "model.layers.0.mlp.experts.gate_proj.weight");
    assert_eq!(gate.src.mesh.shape(), &[1, 2, 2]);
    let down = layout_of(&etp, "model.layers.0.mlp.experts.down_proj.weight");
    assert_eq!(
        down.src.placements,
        vec![
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Shard(2)
        ]
    );

    let fsdp = refit(
        &config,
        &TrainSpec::parse("dp8,fsdp4,tp2").unwrap(),
        &infer,
        &RefitOptions::default(),
    )
    .unwrap();
    let q = layout_of(&fsdp, "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(q.src.mesh.shape(), &[2, 4, 2]);
    assert_eq!(
        q.src.placements,
        vec![
            Placement::Replicate,
            Placement::StridedShard {
                dim: 0,
                split_factor: 2
            },
            Placement::Shard(0)
        ]
    );
    let o = layout_of(&fsdp, "model.layers.0.self_attn.o_proj.weight");
    assert_eq!(
        o.src.placements,
        vec![
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Shard(1)
        ]
    );
    let norm = layout_of(&fsdp, "model.norm.weight");
    assert_eq!(
        norm.src.placements,
        vec![
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Replicate
        ]
    );
}

#[test]
fn fused_offsets_follow_the_parts_before() {
    let config = preset("llama-3.1-70b");
    let refit = refit(
        &config,
        &TrainSpec::parse("tp8").unwrap(),
        &InferSpec::parse("tp4,dp2").unwrap(),
        &RefitOptions::default(),
    )
    .unwrap();
    let index = |name: &str| refit.names.iter().position(|n| n == name).unwrap();
    let (q, k, v) = (
        index("model.layers.7.self_attn.q_proj.weight"),
        index("model.layers.7.self_attn.k_proj.weight"),
        index("model.layers.7.self_attn.v_proj.weight"),
    );
    let fused = refit.fused[k].as_ref().unwrap();
    assert_eq!(&*fused.buffer, "model.layers.7.self_attn.qkv_proj.weight");
    let rank = 8 + 5;
    assert_eq!(refit.fused_offset_bytes(q, rank), Some(0));
    assert_eq!(refit.fused_offset_bytes(k, rank), Some(2048 * 8192 * 2));
    assert_eq!(
        refit.fused_offset_bytes(v, rank),
        Some((2048 + 256) * 8192 * 2)
    );
    assert_eq!(refit.fused_offset_bytes(k, 3), None, "a training-only rank");
    let up = index("model.layers.7.mlp.up_proj.weight");
    assert_eq!(
        refit.fused[up].as_ref().map(|f| &*f.buffer),
        Some("model.layers.7.mlp.gate_up_proj.weight")
    );
    assert_eq!(refit.fused_offset_bytes(up, rank), Some(7168 * 8192 * 2));
    assert!(refit.fused[index("model.layers.7.self_attn.o_proj.weight")].is_none());
}

#[test]
fn scaled_keeps_structure() {
    let big = preset("deepseek-v3");
    let small = big.scaled(64).unwrap();
    assert_eq!(small.hidden_size, 112);
    assert_eq!(small.moe.as_ref().unwrap().num_experts, 4);
    assert_eq!(small.num_layers, 61);
    assert_eq!(
        inventory(&small, ExpertStorage::Stacked).len(),
        inventory(&big, ExpertStorage::Stacked).len()
    );
    assert_eq!(big.scaled(1).unwrap(), big);
    assert!(big.scaled(0).is_err());
}

#[test]
fn listings_with_malformed_expert_shapes_are_rejected() {
    let params = vec![Param::from_name(
        "model.layers.0.mlp.experts.0.up_proj.weight",
        vec![64],
        None,
    )
    .unwrap()];
    let err = refit_params(
        &params,
        &TrainSpec::parse("ep2").unwrap(),
        &InferSpec::parse("tp2").unwrap(),
        &RefitOptions::default(),
    )
    .unwrap_err();
    assert!(
        err.message.contains("experts.0.up_proj") && err.message.contains("2 dims"),
        "{err}"
    );
    let err = Param::from_name(
        "model.layers.0.mlp.experts.up_proj.weight",
        vec![4, 4],
        None,
    )
    .unwrap_err();
    assert!(err.message.contains("[experts, out, in]"), "{err}");
}
