//! JSON front end of `ncclreshard_tools::models`: HuggingFace `config.json` files, NCCL M2N
//! `*.model.json` tensor listings and M2N `system_configs/*.json`.
//!
//! The library reads hyper-parameters through a getter ([`ModelConfig::from_hf`]) and takes
//! listings as [`Param`]s, so it needs no JSON parser; this module supplies both. Errors are
//! strings that name the file and the key, for `Failure::Input`.

use ncclreshard::DType;
use ncclreshard_tools::models::{
    inventory, refit, refit_params, ExpertStorage, HfValue, InferSpec, M2nSide, ModelConfig, Param,
    Refit, RefitOptions, TrainSpec, PRESETS,
};
use serde_json::{Map, Value};
use std::path::Path;

/// A model named on the command line: hyper-parameters, or an explicit tensor listing.
#[derive(Clone, Debug)]
pub enum Model {
    /// A preset or a HuggingFace `config.json`.
    Config(ModelConfig),
    /// An M2N `*.model.json` listing; its expert storage is whatever the listing holds.
    Listing { name: String, params: Vec<Param> },
}

impl Model {
    pub fn name(&self) -> &str {
        match self {
            Model::Config(config) => &config.name,
            Model::Listing { name, .. } => name,
        }
    }

    /// Every parameter (`storage` applies to configs only).
    pub fn params(&self, storage: ExpertStorage) -> Vec<Param> {
        match self {
            Model::Config(config) => inventory(config, storage),
            Model::Listing { params, .. } => params.clone(),
        }
    }

    /// The model with widths divided by `factor` ([`ModelConfig::scaled`]); a listing has
    /// fixed shapes and only accepts 1.
    pub fn scaled(&self, factor: u64) -> Result<Model, String> {
        match self {
            Model::Config(config) => config
                .scaled(factor)
                .map(Model::Config)
                .map_err(|e| e.to_string()),
            Model::Listing { name, .. } if factor != 1 => Err(format!(
                "{name}: a tensor listing has fixed shapes and cannot be scaled; use a preset or config.json"
            )),
            listing => Ok(listing.clone()),
        }
    }

    pub fn refit(
        &self,
        train: &TrainSpec,
        infer: &InferSpec,
        options: &RefitOptions,
    ) -> Result<Refit, String> {
        match self {
            Model::Config(config) => refit(config, train, infer, options),
            Model::Listing { params, .. } => refit_params(params, train, infer, options),
        }
        .map_err(|e| format!("{}: {e}", self.name()))
    }
}

/// A preset name (see [`PRESETS`]) or the path of a `config.json` / `*.model.json` file.
pub fn load_model(arg: &str) -> Result<Model, String> {
    if PRESETS.contains(&arg) {
        return ModelConfig::preset(arg)
            .map(Model::Config)
            .map_err(|e| e.to_string());
    }
    let path = Path::new(arg);
    if !path.exists() {
        return Err(format!(
            "model {arg:?} is neither a known model ({}) nor a file",
            PRESETS.join(", ")
        ));
    }
    let text = read(path)?;
    let name = path
        .file_name()
        .map_or_else(|| arg.to_string(), |n| n.to_string_lossy().into_owned());
    parse_model(&text, &name)
}

/// Parses a model file called `file`: a `config.json` (it has `hidden_size`, possibly under
/// `text_config`) or a tensor listing (every value an object with `shape`).
pub fn parse_model(text: &str, file: &str) -> Result<Model, String> {
    let value = parse_json(text, file)?;
    let Value::Object(map) = &value else {
        return Err(format!("{file}: expected a JSON object"));
    };
    let is_config = map.contains_key("hidden_size")
        || map
            .get("text_config")
            .is_some_and(|t| t.get("hidden_size").is_some());
    if is_config {
        return config_from_hf(&value)
            .map(Model::Config)
            .map_err(|e| format!("{file}: {e}"));
    }
    if !map.is_empty() && map.values().all(|v| v.get("shape").is_some()) {
        let name = file
            .strip_suffix(".model.json")
            .or_else(|| file.strip_suffix(".json"))
            .unwrap_or(file)
            .to_string();
        return params_from_listing(map, file).map(|params| Model::Listing { name, params });
    }
    Err(format!(
        "{file}: neither a HuggingFace config.json (no \"hidden_size\") nor a tensor listing (name → {{\"shape\", \"dtype\"}})"
    ))
}

/// A HuggingFace `config.json` value as a [`ModelConfig`]. Dotted keys reach into nested
/// objects; a key missing at the top level is looked up in `text_config` (multimodal configs
/// keep the language model's fields there).
pub fn config_from_hf(value: &Value) -> Result<ModelConfig, String> {
    let lookup = |root: &Value, key: &str| -> Option<HfValue> {
        key.split('.')
            .try_fold(root, |v, part| v.get(part))
            .map(hf_value)
    };
    ModelConfig::from_hf(|key| {
        lookup(value, key).or_else(|| value.get("text_config").and_then(|t| lookup(t, key)))
    })
    .map_err(|e| e.to_string())
}

fn hf_value(value: &Value) -> HfValue {
    match value {
        Value::Null => HfValue::Null,
        Value::Bool(b) => HfValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => HfValue::Int(i),
            None => HfValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => HfValue::Str(s.clone()),
        Value::Array(items) => HfValue::List(items.iter().map(hf_value).collect()),
        // No field the library reads is an object; say what it is rather than guess.
        Value::Object(_) => HfValue::Str("<object>".to_string()),
    }
}

/// safetensors dtype names (as M2N listings write them) → `(dtype, fixed)`. 16-bit floats
/// follow the refit's `--dtype`; every other type is the checkpoint's own (FP8 weights,
/// float32 scales and biases) and is kept.
fn listing_dtype(name: &str) -> Option<(DType, bool)> {
    let dtype = match name {
        "BF16" => return Some((DType::Bfloat16, false)),
        "F16" => return Some((DType::Float16, false)),
        "F32" => DType::Float32,
        "F64" => DType::Float64,
        "F8_E4M3" => DType::Float8E4M3,
        "F8_E5M2" => DType::Float8E5M2,
        "I8" => DType::Int8,
        "U8" => DType::Uint8,
        "I32" => DType::Int32,
        "U32" => DType::Uint32,
        "I64" => DType::Int64,
        "U64" => DType::Uint64,
        other => DType::from_name(other)?,
    };
    Some((dtype, true))
}

fn params_from_listing(map: &Map<String, Value>, file: &str) -> Result<Vec<Param>, String> {
    map.iter()
        .map(|(name, entry)| {
            let at = |key: &str, message: String| format!("{file}: {name}.{key}: {message}");
            let shape = match entry.get("shape") {
                Some(Value::Array(dims)) => dims
                    .iter()
                    .map(|d| {
                        d.as_u64()
                            .ok_or_else(|| at("shape", format!("{d} is not a size")))
                    })
                    .collect::<Result<Vec<u64>, String>>()?,
                _ => return Err(at("shape", "expected an array of sizes".to_string())),
            };
            let dtype = match entry.get("dtype") {
                None => None,
                Some(Value::String(s)) => match listing_dtype(s) {
                    Some((dtype, true)) => Some(dtype),
                    Some((_, false)) => None,
                    None => return Err(at("dtype", format!("unknown dtype {s:?}"))),
                },
                Some(other) => return Err(at("dtype", format!("{other} is not a dtype name"))),
            };
            Param::from_name(name, shape, dtype).map_err(|e| format!("{file}: {e}"))
        })
        .collect()
}

/// The training and inference specs of an M2N `system_configs/*.json` file.
pub fn load_system(path: &Path) -> Result<(TrainSpec, InferSpec), String> {
    let text = read(path)?;
    parse_system(&text, &path.display().to_string())
}

/// Parses an M2N system config (`{"train": {...}, "generation": {...}}` with `num_gpus` and
/// `*_size` keys); see [`TrainSpec::from_m2n`] for how `dp` is derived.
pub fn parse_system(text: &str, file: &str) -> Result<(TrainSpec, InferSpec), String> {
    let value = parse_json(text, file)?;
    let side = |key: &str| -> Result<M2nSide, String> {
        let object = value
            .get(key)
            .and_then(Value::as_object)
            .ok_or_else(|| format!("{file}: {key}: missing or not an object"))?;
        let size = |field: &str, default: Option<u32>| -> Result<u32, String> {
            match object.get(field) {
                None => default.ok_or_else(|| format!("{file}: {key}.{field}: missing")),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("{file}: {key}.{field}: {v} is not a size")),
            }
        };
        Ok(M2nSide {
            num_gpus: size("num_gpus", None)?,
            tp_size: size("tp_size", Some(1))?,
            cp_size: size("cp_size", Some(1))?,
            ep_size: size("ep_size", Some(1))?,
            pp_size: size("pp_size", Some(1))?,
            fsdp_size: size("fsdp_size", Some(1))?,
            dp_size: size("dp_size", Some(1))?,
        })
    };
    let train = TrainSpec::from_m2n(&side("train")?).map_err(|e| format!("{file}: {e}"))?;
    let infer = InferSpec::from_m2n(&side("generation")?).map_err(|e| format!("{file}: {e}"))?;
    Ok((train, infer))
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))
}

fn parse_json(text: &str, file: &str) -> Result<Value, String> {
    serde_json::from_str(text).map_err(|e| format!("{file}: malformed JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclreshard_tools::models::count_parameters;
    use std::path::PathBuf;

    fn m2n() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/tests/data/m2n-configs")
    }

    #[test]
    fn every_m2n_system_config_becomes_specs() {
        let dir = m2n().join("system_configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let (train, infer) = load_system(&path).unwrap();
            let value: Value = serde_json::from_str(&read(&path).unwrap()).unwrap();
            assert_eq!(
                u64::from(train.world()),
                value["train"]["num_gpus"],
                "{path:?}"
            );
            assert_eq!(
                u64::from(infer.world()),
                value["generation"]["num_gpus"],
                "{path:?}"
            );
            seen += 1;
        }
        assert_eq!(seen, 9);
        let (train, infer) =
            load_system(&dir.join("qwen235b-TP2CP2PP4EP16-128gpus-gb200.json")).unwrap();
        assert_eq!(train, TrainSpec::parse("tp2,cp2,pp4,ep16").unwrap());
        assert_eq!(infer, InferSpec::parse("tp8,dp8").unwrap());
    }

    #[test]
    fn m2n_listings_load_as_their_presets() {
        for (file, preset) in [
            ("dsv3-toy.model.json", "dsv3-toy"),
            ("qwen3-32b.model.json", "qwen3-32b"),
        ] {
            let path = m2n().join("model_configs").join(file);
            let model = load_model(path.to_str().unwrap()).unwrap();
            let Model::Listing { name, params } = &model else {
                panic!("{file} is a listing")
            };
            assert_eq!(name, preset);
            let mut got: Vec<Param> = params.clone();
            let mut want = inventory(
                &ModelConfig::preset(preset).unwrap(),
                ExpertStorage::PerExpert,
            );
            got.sort_by(|a, b| a.name.cmp(&b.name));
            want.sort_by(|a, b| a.name.cmp(&b.name));
            assert_eq!(got, want, "{file}");
        }
    }

    #[test]
    fn hf_config_json_is_read_with_nested_keys() {
        let text = r#"{
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": false,
            "rope_scaling": {"factor": 40, "type": "yarn"}, "rms_norm_eps": 1e-06,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                    "quant_method": "fp8", "weight_block_size": [128, 128]}
        }"#;
        let Model::Config(config) = parse_model(text, "config.json").unwrap() else {
            panic!("a config")
        };
        assert_eq!(config.fp8_block, Some([128, 128]));
        let params = inventory(&config, ExpertStorage::Stacked);
        assert_eq!(count_parameters(&params), 671_026_419_200);

        let nested = r#"{"model_type": "x", "text_config": {"hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 100}}"#;
        assert!(parse_model(nested, "config.json").is_ok());
        let err = parse_model(r#"{"hidden_size": 64}"#, "c.json").unwrap_err();
        assert!(
            err.starts_with("c.json: ") && err.contains("num_hidden_layers"),
            "{err}"
        );
        let err = parse_model(r#"{"a": 1}"#, "c.json").unwrap_err();
        assert!(err.contains("neither"), "{err}");
    }

    #[test]
    fn model_arguments() {
        assert!(matches!(load_model("qwen3-32b"), Ok(Model::Config(_))));
        let err = load_model("gpt-9").unwrap_err();
        assert!(err.contains("deepseek-v3"), "{err}");
        let listing = parse_model(
            r#"{"model.layers.0.mlp.experts.0.up_proj.weight": {"shape": [4, 8], "dtype": "F8_E4M3"},
                "model.layers.0.input_layernorm.weight": {"shape": [8], "dtype": "BF16"}}"#,
            "toy.model.json",
        )
        .unwrap();
        assert_eq!(listing.name(), "toy");
        assert!(listing.scaled(2).is_err());
        let params = listing.params(ExpertStorage::Stacked);
        assert_eq!(params[1].dtype, Some(DType::Float8E4M3));
        assert_eq!(params[0].dtype, None);
        let err = parse_model(
            r#"{"model.layers.0.foo.weight": {"shape": [4]}}"#,
            "bad.model.json",
        )
        .unwrap_err();
        assert!(err.contains("model.layers.0.foo.weight"), "{err}");
    }
}
