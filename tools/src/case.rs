//! Case files: JSON descriptions of reshards that `check`, `layout` and `plan` read.
//!
//! A file holds one case or a JSON array of cases. A case is either one tensor
//! (`{"name"?, "shape", "dtype", "src", "dst", "dst_dtype"?, "quant"?, "config"?}`) or a
//! multi-tensor plan
//! (`{"name"?, "tensors": [<tensor without config>…], "config"?}`). A side is
//! `{"mesh", "ranks" | "first_rank", "placements", "strides"?}`; a tensor that converts on the
//! way (docs/quantization.md) names its destination dtype in `dst_dtype` and its scaling in
//! `quant`: `{"scheme": "none" | "per_tensor" | "per_channel" | "block", "block"?: [rows,
//! cols] (default [128, 128]), "scale_format"?: "float32" | "e8m0", "scale_inverse"?: bool,
//! "scale_layout"?: <side>}`; a config is
//! `{"mode"?, "ranks_per_node" | "node_of_rank", "split_min_bytes"?, "rounds"?, "relay"?,
//! "sender_barrier"?, "failed_ranks"?}`; a case without a mode is meant to run under every mode. A rank table's
//! `null` entry is a position whose rank is gone (docs/resilience.md); `failed_ranks` makes the
//! case the survivors' plan: those ranks become holes and the others are renumbered as
//! `ncclCommShrink` renumbers them, so the case holds what the survivors plan with.
//!
//! The JSON is walked by hand rather than through derived deserializers so that every error,
//! type mismatches included, names the file, the case and the key path
//! (`cases/x.json: case 2 ("tp2-to-tp1"): src.placements[1]: …`). Unknown keys are errors.

use ncclreshard::quant::{Conversion, ScaleFormat, Scheme};
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, TensorSpec, Topology};
use serde_json::{Map, Value};
use std::path::Path;

/// One tensor of a case.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: Option<String>,
    pub spec: TensorSpec,
    /// What the tensor becomes on its way (`dst_dtype`, `quant`), if it converts.
    pub conversion: Option<Conversion>,
}

/// One reshard plan read from a case file.
#[derive(Clone, Debug)]
pub struct Case {
    /// The case's `name`, or `<file>#<index>` (`<file>` for a single-case file) when unnamed.
    pub name: String,
    /// Whether the case came as `{"tensors": […]}` (output keeps that shape).
    pub multi: bool,
    pub tensors: Vec<Tensor>,
    /// `None` when the case gives no mode: it is meant to run under every mode.
    pub mode: Option<Mode>,
    /// The config with `mode` set to the case's mode, or to the default when it gives none.
    pub config: Config,
    /// `config.failed_ranks`, ascending: the tensors and config above are already the
    /// survivors' (renumbered, with holes).
    pub failed: Vec<u32>,
}

impl Case {
    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors.iter().map(|t| t.spec.clone()).collect()
    }

    /// Each tensor's conversion (`None`: it arrives as it is), in tensor order.
    pub fn conversions(&self) -> Vec<Option<Conversion>> {
        self.tensors.iter().map(|t| t.conversion.clone()).collect()
    }

    /// The configs to run: the case's own, or one per mode when it gives none (with the mode
    /// as a name suffix; not groupable when a tensor converts, which that mode cannot do).
    pub fn variants(&self) -> Vec<(String, Config)> {
        let converts = self.tensors.iter().any(|t| t.conversion.is_some());
        match self.mode {
            Some(_) => vec![(self.name.clone(), self.config.clone())],
            None => [Mode::Groupable, Mode::Staged, Mode::Auto]
                .into_iter()
                .filter(|&mode| !(converts && mode == Mode::Groupable))
                .map(|mode| {
                    (
                        format!("{}[{}]", self.name, mode.name()),
                        Config {
                            mode,
                            ..self.config.clone()
                        },
                    )
                })
                .collect(),
        }
    }
}

/// What one case file holds.
#[derive(Clone, Debug)]
pub struct CaseFile {
    /// Whether the file is a JSON array of cases (output keeps that shape).
    pub is_array: bool,
    pub cases: Vec<Case>,
}

/// Reads and validates a case file; the error names the path, the case and the key.
pub fn load(path: &Path) -> Result<CaseFile, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    parse(&text, &shown.to_string())
}

/// Parses the text of a case file called `file` (used in messages and default names).
pub fn parse(text: &str, file: &str) -> Result<CaseFile, String> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("{file}: malformed JSON: {e}"))?;
    match &value {
        Value::Array(items) => {
            if items.is_empty() {
                return Err(format!("{file}: the array holds no cases"));
            }
            let cases = items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let where_ = match item.get("name").and_then(Value::as_str) {
                        Some(name) => format!("{file}: case {i} ({name:?})"),
                        None => format!("{file}: case {i}"),
                    };
                    parse_case(item, &format!("{file}#{i}")).map_err(|e| format!("{where_}: {e}"))
                })
                .collect::<Result<Vec<Case>, _>>()?;
            // Names identify cases in `check` output and `--case`: they must be unique.
            for (i, case) in cases.iter().enumerate() {
                if let Some(j) = cases[..i].iter().position(|c| c.name == case.name) {
                    return Err(format!(
                        "{file}: case {i} ({:?}): name: case {j} has the same name; names must be unique",
                        case.name
                    ));
                }
            }
            Ok(CaseFile {
                is_array: true,
                cases,
            })
        }
        Value::Object(_) => {
            let where_ = match value.get("name").and_then(Value::as_str) {
                Some(name) => format!("{file}: case {name:?}"),
                None => file.to_string(),
            };
            let case = parse_case(&value, file).map_err(|e| format!("{where_}: {e}"))?;
            Ok(CaseFile {
                is_array: false,
                cases: vec![case],
            })
        }
        other => Err(format!(
            "{file}: expected a case object or an array of cases, got {}",
            describe(other)
        )),
    }
}

/// A problem at a key path inside a case (`src.placements[1]`); empty path for the case itself.
struct KeyError {
    key: String,
    message: String,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

type Parsed<T> = Result<T, KeyError>;

fn fail<T>(key: &str, message: impl Into<String>) -> Parsed<T> {
    Err(KeyError {
        key: key.to_string(),
        message: message.into(),
    })
}

/// `prefix.key`, or `key` at the top.
fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// The object at `key`, after checking that it has only `allowed` keys.
fn object<'a>(value: &'a Value, key: &str, allowed: &[&str]) -> Parsed<&'a Map<String, Value>> {
    let Value::Object(map) = value else {
        return fail(key, format!("expected an object, got {}", describe(value)));
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        let allowed = allowed
            .iter()
            .map(|k| format!("{k:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        return fail(
            &join(key, unknown),
            format!("unknown key; expected one of {allowed}"),
        );
    }
    Ok(map)
}

fn required<'a>(map: &'a Map<String, Value>, prefix: &str, key: &str) -> Parsed<&'a Value> {
    map.get(key).ok_or_else(|| KeyError {
        key: join(prefix, key),
        message: "missing; this key is required".to_string(),
    })
}

fn u64_of(value: &Value, key: &str) -> Parsed<u64> {
    value.as_u64().map_or_else(
        || {
            fail(
                key,
                format!("expected a non-negative integer, got {}", describe(value)),
            )
        },
        Ok,
    )
}

fn u32_of(value: &Value, key: &str) -> Parsed<u32> {
    let n = u64_of(value, key)?;
    u32::try_from(n).or_else(|_| fail(key, format!("{n} does not fit in 32 bits")))
}

fn str_of<'a>(value: &'a Value, key: &str) -> Parsed<&'a str> {
    value.as_str().map_or_else(
        || fail(key, format!("expected a string, got {}", describe(value))),
        Ok,
    )
}

fn list_of<T>(
    value: &Value,
    key: &str,
    item: impl Fn(&Value, &str) -> Parsed<T>,
) -> Parsed<Vec<T>> {
    let Value::Array(items) = value else {
        return fail(key, format!("expected an array, got {}", describe(value)));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| item(v, &format!("{key}[{i}]")))
        .collect()
}

fn optional_name(map: &Map<String, Value>, prefix: &str) -> Parsed<Option<String>> {
    map.get("name")
        .map(|v| str_of(v, &join(prefix, "name")).map(str::to_string))
        .transpose()
}

/// The keys each object of a case file may have (every other key is an error).
pub const TENSOR_KEYS: [&str; 7] = ["name", "shape", "dtype", "src", "dst", "dst_dtype", "quant"];
pub const QUANT_KEYS: [&str; 5] = [
    "scheme",
    "block",
    "scale_format",
    "scale_inverse",
    "scale_layout",
];
pub const SIDE_KEYS: [&str; 5] = ["mesh", "ranks", "first_rank", "placements", "strides"];
pub const CONFIG_KEYS: [&str; 8] = [
    "mode",
    "ranks_per_node",
    "node_of_rank",
    "split_min_bytes",
    "rounds",
    "relay",
    "sender_barrier",
    "failed_ranks",
];

fn parse_case(value: &Value, default_name: &str) -> Result<Case, String> {
    let multi = value.get("tensors").is_some();
    let allowed: Vec<&str> = if multi {
        vec!["name", "tensors", "config"]
    } else {
        TENSOR_KEYS.iter().copied().chain(["config"]).collect()
    };
    let map = object(value, "", &allowed).map_err(|e| e.to_string())?;
    let name = optional_name(map, "").map_err(|e| e.to_string())?;
    let tensors = if multi {
        let list = required(map, "", "tensors").map_err(|e| e.to_string())?;
        let Value::Array(items) = list else {
            return Err(format!(
                "tensors: expected an array, got {}",
                describe(list)
            ));
        };
        if items.is_empty() {
            return Err("tensors: the list is empty; a plan needs at least one tensor".to_string());
        }
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let key = format!("tensors[{i}]");
                let tensor = parse_tensor(item, &key, &TENSOR_KEYS).map_err(|e| e.to_string())?;
                validate(&tensor).map_err(|e| format!("{key}: {e}"))?;
                Ok(tensor)
            })
            .collect::<Result<Vec<_>, String>>()?
    } else {
        let tensor = parse_tensor(value, "", &allowed).map_err(|e| e.to_string())?;
        validate(&tensor)?;
        vec![tensor]
    };
    let (mode, mut config, failed) = match map.get("config") {
        Some(v) => parse_config(v).map_err(|e| e.to_string())?,
        None => (None, Config::default(), Vec::new()),
    };
    if let Some(mode) = mode {
        config.mode = mode;
    }
    config.validate().map_err(|e| e.to_string())?;
    let (tensors, config) = if failed.is_empty() {
        (tensors, config)
    } else {
        let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
        let conversions: Vec<Option<Conversion>> =
            tensors.iter().map(|t| t.conversion.clone()).collect();
        let (specs, conversions, config) =
            ncclreshard::plan::survivors(&specs, &conversions, &config, &failed)
                .map_err(|e| format!("config.failed_ranks: {e}"))?;
        let tensors = tensors
            .into_iter()
            .zip(specs.into_iter().zip(conversions))
            .map(|(t, (spec, conversion))| Tensor {
                spec,
                conversion,
                ..t
            })
            .collect();
        (tensors, config)
    };
    Ok(Case {
        name: name.unwrap_or_else(|| default_name.to_string()),
        multi,
        tensors,
        mode,
        config,
        failed,
    })
}

/// The tensor's own checks and its conversion's.
fn validate(tensor: &Tensor) -> Result<(), String> {
    tensor.spec.validate().map_err(|e| e.to_string())?;
    if let Some(c) = &tensor.conversion {
        c.validate(&tensor.spec).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn parse_dtype(value: &Value, key: &str) -> Parsed<DType> {
    let name = str_of(value, key)?;
    DType::from_name(name).map_or_else(
        || {
            let known: Vec<&str> = DType::ALL.iter().map(|d| d.torch_name()).collect();
            fail(
                key,
                format!(
                    "unknown dtype {name:?}; expected one of {}",
                    known.join(", ")
                ),
            )
        },
        Ok,
    )
}

/// `dst_dtype` and `quant` of a tensor with source dtype `dtype`: `None` when neither is
/// given or `dst_dtype` is the source's and there is no `quant`.
fn parse_conversion(
    map: &Map<String, Value>,
    prefix: &str,
    dtype: DType,
) -> Parsed<Option<Conversion>> {
    let dst_key = join(prefix, "dst_dtype");
    let quant_key = join(prefix, "quant");
    let target = map
        .get("dst_dtype")
        .map(|v| parse_dtype(v, &dst_key))
        .transpose()?;
    let Some(quant) = map.get("quant") else {
        return Ok(target.filter(|&t| t != dtype).map(Conversion::cast));
    };
    let Some(target) = target else {
        return fail(
            &quant_key,
            "quant needs dst_dtype (float8_e4m3fn or float8_e5m2)",
        );
    };
    let q = object(quant, &quant_key, &QUANT_KEYS)?;
    let scheme_key = join(&quant_key, "scheme");
    let scheme_name = str_of(required(q, &quant_key, "scheme")?, &scheme_key)?;
    let scheme = match scheme_name {
        "none" => Scheme::None,
        "per_tensor" => Scheme::PerTensor,
        "per_channel" => Scheme::PerChannel,
        "block" => {
            let block_key = join(&quant_key, "block");
            let (rows, cols) = match q.get("block") {
                None => (128, 128),
                Some(v) => match list_of(v, &block_key, u64_of)?.as_slice() {
                    &[rows, cols] => (rows, cols),
                    other => {
                        return fail(
                            &block_key,
                            format!("expected [rows, cols], got {} numbers", other.len()),
                        )
                    }
                },
            };
            Scheme::Block { rows, cols }
        }
        other => {
            return fail(
                &scheme_key,
                format!(
                    "unknown scheme {other:?}; expected none, per_tensor, per_channel or block"
                ),
            )
        }
    };
    if q.contains_key("block") && !matches!(scheme, Scheme::Block { .. }) {
        return fail(
            &join(&quant_key, "block"),
            format!("only the block scheme has blocks, not {scheme_name}"),
        );
    }
    let format_key = join(&quant_key, "scale_format");
    let scale_format = match q.get("scale_format") {
        None => ScaleFormat::Float32,
        Some(v) => {
            let name = str_of(v, &format_key)?;
            ScaleFormat::from_name(name).map_or_else(
                || {
                    fail(
                        &format_key,
                        format!("unknown scale format {name:?}; expected float32 or e8m0"),
                    )
                },
                Ok,
            )?
        }
    };
    let inverse_key = join(&quant_key, "scale_inverse");
    let scale_inverse = match q.get("scale_inverse") {
        None => false,
        Some(v) => v
            .as_bool()
            .map_or_else(|| fail(&inverse_key, "expected true or false"), Ok)?,
    };
    let scale_layout = q
        .get("scale_layout")
        .map(|v| parse_side(v, &join(&quant_key, "scale_layout")))
        .transpose()?;
    Ok(Some(Conversion {
        dtype: target,
        scheme,
        scale_format,
        scale_inverse,
        scale_layout,
    }))
}

/// A tensor object whose keys may be `allowed` (the tensor keys, plus `config` for a
/// single-tensor case).
fn parse_tensor(value: &Value, prefix: &str, allowed: &[&str]) -> Parsed<Tensor> {
    let map = object(value, prefix, allowed)?;
    let name = optional_name(map, prefix)?;
    let shape_key = join(prefix, "shape");
    let shape = list_of(required(map, prefix, "shape")?, &shape_key, u64_of)?;
    let dtype_key = join(prefix, "dtype");
    let dtype = parse_dtype(required(map, prefix, "dtype")?, &dtype_key)?;
    let src = parse_side(required(map, prefix, "src")?, &join(prefix, "src"))?;
    let dst = parse_side(required(map, prefix, "dst")?, &join(prefix, "dst"))?;
    let conversion = parse_conversion(map, prefix, dtype)?;
    Ok(Tensor {
        name,
        spec: TensorSpec {
            shape,
            dtype,
            src,
            dst,
        },
        conversion,
    })
}

fn parse_side(value: &Value, key: &str) -> Parsed<Layout> {
    let map = object(value, key, &SIDE_KEYS)?;
    let mesh_key = join(key, "mesh");
    let shape = list_of(required(map, key, "mesh")?, &mesh_key, u64_of)?;
    let ranks_key = join(key, "ranks");
    let first_key = join(key, "first_rank");
    let mesh = match (map.get("ranks"), map.get("first_rank")) {
        (Some(_), Some(_)) => {
            return fail(&first_key, "give either ranks or first_rank, not both");
        }
        (Some(ranks), None) => {
            // `null`: a position whose rank is gone.
            let ranks = list_of(ranks, &ranks_key, |v, k| {
                if v.is_null() {
                    Ok(Mesh::HOLE)
                } else {
                    u32_of(v, k)
                }
            })?;
            Mesh::new(shape, ranks).or_else(|e| fail(&ranks_key, e.message))?
        }
        (None, first) => {
            let first = first
                .map(|v| u32_of(v, &first_key))
                .transpose()?
                .unwrap_or(0);
            Mesh::contiguous(shape, first).or_else(|e| fail(&mesh_key, e.message))?
        }
    };
    let placements_key = join(key, "placements");
    let placements = list_of(
        required(map, key, "placements")?,
        &placements_key,
        |v, k| Placement::parse(str_of(v, k)?).or_else(|e| fail(k, e.message)),
    )?;
    let mut layout = Layout::new(mesh, placements);
    if let Some(strides) = map.get("strides") {
        layout = layout.with_strides(list_of(strides, &join(key, "strides"), u64_of)?);
    }
    Ok(layout)
}

fn parse_config(value: &Value) -> Parsed<(Option<Mode>, Config, Vec<u32>)> {
    let map = object(value, "config", &CONFIG_KEYS)?;
    let mode = map
        .get("mode")
        .map(|v| {
            let text = str_of(v, "config.mode")?;
            Mode::parse(text).or_else(|e| fail("config.mode", e.message))
        })
        .transpose()?;
    let topology = match (map.get("ranks_per_node"), map.get("node_of_rank")) {
        (Some(_), Some(_)) => {
            return fail(
                "config.node_of_rank",
                "give either ranks_per_node or node_of_rank, not both",
            );
        }
        (Some(n), None) => Topology::RanksPerNode(u32_of(n, "config.ranks_per_node")?),
        (None, Some(table)) => Topology::NodeTable(list_of(table, "config.node_of_rank", u32_of)?),
        (None, None) => Topology::Unknown,
    };
    let mut config = Config {
        topology,
        ..Default::default()
    };
    if let Some(v) = map.get("split_min_bytes") {
        config.split_min_bytes = u64_of(v, "config.split_min_bytes")?;
    }
    if let Some(v) = map.get("rounds") {
        config.rounds = u32_of(v, "config.rounds")?;
    }
    if let Some(v) = map.get("relay") {
        config.relay = v
            .as_bool()
            .map_or_else(|| fail("config.relay", "expected true or false"), Ok)?;
    }
    if let Some(v) = map.get("sender_barrier") {
        config.sender_barrier = Some(v.as_bool().map_or_else(
            || fail("config.sender_barrier", "expected true or false"),
            Ok,
        )?);
    }
    let mut failed = match map.get("failed_ranks") {
        Some(v) => list_of(v, "config.failed_ranks", u32_of)?,
        None => Vec::new(),
    };
    failed.sort_unstable();
    if let Some(w) = failed.windows(2).find(|w| w[0] == w[1]) {
        return fail(
            "config.failed_ranks",
            format!("rank {} is listed twice", w[0]),
        );
    }
    Ok((mode, config, failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIDE: &str = r#"{"mesh": [2], "placements": ["Shard(0)"]}"#;

    fn case(body: &str) -> String {
        format!(
            r#"[{{"name": "a", "shape": [4, 2], "dtype": "float32", "src": {SIDE}, "dst": {body}}}]"#
        )
    }

    #[test]
    fn reads_a_case_and_defaults() {
        let file = parse(
            &case(r#"{"mesh": [1, 2], "first_rank": 2, "placements": ["R", "S(1)"]}"#),
            "f.json",
        )
        .unwrap();
        assert!(file.is_array);
        let case = &file.cases[0];
        assert_eq!(case.name, "a");
        assert_eq!(case.mode, None);
        assert_eq!(case.variants().len(), 3);
        assert_eq!(case.tensors[0].spec.dst.mesh.ranks(), [2, 3]);
        assert_eq!(case.tensors[0].spec.src.mesh.ranks(), [0, 1]);
    }

    #[test]
    fn errors_name_file_case_and_key() {
        let err = |text: &str| parse(text, "f.json").unwrap_err();
        let e = err(&case(r#"{"mesh": [2], "placements": ["R", "Shard(x)"]}"#));
        assert!(
            e.starts_with("f.json: case 0 (\"a\"): dst.placements[1]: "),
            "{e}"
        );
        let e = err(&case(r#"{"mesh": [2], "placements": ["R"], "colour": 1}"#));
        assert!(e.contains("dst.colour: unknown key"), "{e}");
        let e = err(&case(
            r#"{"mesh": [2, 2], "ranks": [0, 1, 2], "placements": ["R", "R"]}"#,
        ));
        assert!(
            e.contains("dst.ranks: mesh shape [2, 2] holds 4 ranks"),
            "{e}"
        );
        let e = err(&case(r#"{"mesh": [2], "placements": ["R", "R"]}"#));
        assert!(
            e.contains("case 0 (\"a\"): dst: placements has 2 entries"),
            "{e}"
        );
        let e = err(&format!(
            "[{0}, {0}]",
            case(r#"{"mesh": [2], "placements": ["R"]}"#).trim_matches(['[', ']'])
        ));
        assert!(
            e.contains("case 1 (\"a\"): name: case 0 has the same name"),
            "{e}"
        );
        let e = err(r#"{"tensors": [{"shape": [2, -1]}]}"#);
        assert!(
            e.contains("f.json: tensors[0].shape[1]: expected a non-negative integer"),
            "{e}"
        );
        let e = err(r#"{"tensors": [], "config": {"mode": "fast"}}"#);
        assert!(e.contains("tensors: the list is empty"), "{e}");
        assert!(err("[1, 2").starts_with("f.json: malformed JSON"));
    }

    #[test]
    fn reads_conversions_and_names_their_keys() {
        let tensor = |extra: &str| {
            format!(
                r#"{{"name": "q", "shape": [256, 256], "dtype": "bfloat16", "src": {SIDE}, "dst": {SIDE}{extra}}}"#
            )
        };
        let file = parse(
            &tensor(r#", "dst_dtype": "float8_e4m3fn", "quant": {"scheme": "block", "scale_inverse": true}"#),
            "f.json",
        )
        .unwrap();
        let case = &file.cases[0];
        let c = case.conversions()[0].clone().unwrap();
        assert_eq!(c.dtype, DType::Float8E4M3);
        assert_eq!(
            c.scheme,
            Scheme::Block {
                rows: 128,
                cols: 128
            }
        );
        assert!(c.scale_inverse);
        assert_eq!(c.scale_format, ScaleFormat::Float32);
        // No groupable variant: it cannot convert.
        assert_eq!(case.variants().len(), 2);
        // dst_dtype equal to dtype without quant is no conversion.
        let file = parse(&tensor(r#", "dst_dtype": "bfloat16""#), "f.json").unwrap();
        assert!(file.cases[0].conversions()[0].is_none());

        let err = |extra: &str| parse(&tensor(extra), "f.json").unwrap_err();
        let e = err(r#", "quant": {"scheme": "block"}"#);
        assert!(e.contains("quant: quant needs dst_dtype"), "{e}");
        let e = err(r#", "dst_dtype": "float8_e4m3fn", "quant": {"scheme": "blocky"}"#);
        assert!(e.contains("quant.scheme: unknown scheme"), "{e}");
        let e =
            err(r#", "dst_dtype": "float8_e4m3fn", "quant": {"scheme": "block", "block": [1]}"#);
        assert!(e.contains("quant.block: expected [rows, cols]"), "{e}");
        let e = err(
            r#", "dst_dtype": "float8_e4m3fn", "quant": {"scheme": "block", "scale_format": "e4m3"}"#,
        );
        assert!(
            e.contains("quant.scale_format: unknown scale format"),
            "{e}"
        );
        let e = err(r#", "dst_dtype": "float8_e4m3fn", "quant": {"scheme": "block", "colour": 1}"#);
        assert!(e.contains("quant.colour: unknown key"), "{e}");
        let e = err(r#", "dst_dtype": "int8""#);
        assert!(e.contains("int8"), "{e}");
    }
}
