//! Case files: JSON descriptions of reshards that `check`, `layout` and `plan` read.
//!
//! A file holds one case or a JSON array of cases. A case is either one tensor
//! (`{"name"?, "shape", "dtype", "src", "dst", "config"?}`) or a multi-tensor plan
//! (`{"name"?, "tensors": [<tensor without config>…], "config"?}`). A side is
//! `{"mesh", "ranks" | "first_rank", "placements", "strides"?}` and a config is
//! `{"mode"?, "ranks_per_node" | "node_of_rank", "split_min_bytes"?, "rounds"?, "relay"?}`; a
//! case without a mode
//! is meant to run under every mode.
//!
//! The JSON is walked by hand rather than through derived deserializers so that every error,
//! type mismatches included, names the file, the case and the key path
//! (`cases/x.json: case 2 ("tp2-to-tp1"): src.placements[1]: …`). Unknown keys are errors.

use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, TensorSpec, Topology};
use serde_json::{Map, Value};
use std::path::Path;

/// One tensor of a case.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: Option<String>,
    pub spec: TensorSpec,
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
}

impl Case {
    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors.iter().map(|t| t.spec.clone()).collect()
    }

    /// The configs to run: the case's own, or one per mode when it gives none (with the mode
    /// as a name suffix).
    pub fn variants(&self) -> Vec<(String, Config)> {
        match self.mode {
            Some(_) => vec![(self.name.clone(), self.config.clone())],
            None => [Mode::Groupable, Mode::Staged, Mode::Auto]
                .into_iter()
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

const TENSOR_KEYS: [&str; 5] = ["name", "shape", "dtype", "src", "dst"];
const SIDE_KEYS: [&str; 5] = ["mesh", "ranks", "first_rank", "placements", "strides"];
const CONFIG_KEYS: [&str; 6] = [
    "mode",
    "ranks_per_node",
    "node_of_rank",
    "split_min_bytes",
    "rounds",
    "relay",
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
                tensor.spec.validate().map_err(|e| format!("{key}: {e}"))?;
                Ok(tensor)
            })
            .collect::<Result<Vec<_>, String>>()?
    } else {
        let tensor = parse_tensor(value, "", &allowed).map_err(|e| e.to_string())?;
        tensor.spec.validate().map_err(|e| e.to_string())?;
        vec![tensor]
    };
    let (mode, mut config) = match map.get("config") {
        Some(v) => parse_config(v).map_err(|e| e.to_string())?,
        None => (None, Config::default()),
    };
    if let Some(mode) = mode {
        config.mode = mode;
    }
    config.validate().map_err(|e| e.to_string())?;
    Ok(Case {
        name: name.unwrap_or_else(|| default_name.to_string()),
        multi,
        tensors,
        mode,
        config,
    })
}

/// A tensor object whose keys may be `allowed` (the tensor keys, plus `config` for a
/// single-tensor case).
fn parse_tensor(value: &Value, prefix: &str, allowed: &[&str]) -> Parsed<Tensor> {
    let map = object(value, prefix, allowed)?;
    let name = optional_name(map, prefix)?;
    let shape_key = join(prefix, "shape");
    let shape = list_of(required(map, prefix, "shape")?, &shape_key, u64_of)?;
    let dtype_key = join(prefix, "dtype");
    let dtype_name = str_of(required(map, prefix, "dtype")?, &dtype_key)?;
    let dtype = DType::from_name(dtype_name).map_or_else(
        || {
            let known: Vec<&str> = DType::ALL.iter().map(|d| d.torch_name()).collect();
            fail(
                &dtype_key,
                format!(
                    "unknown dtype {dtype_name:?}; expected one of {}",
                    known.join(", ")
                ),
            )
        },
        Ok,
    )?;
    let src = parse_side(required(map, prefix, "src")?, &join(prefix, "src"))?;
    let dst = parse_side(required(map, prefix, "dst")?, &join(prefix, "dst"))?;
    Ok(Tensor {
        name,
        spec: TensorSpec {
            shape,
            dtype,
            src,
            dst,
        },
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
            let ranks = list_of(ranks, &ranks_key, u32_of)?;
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

fn parse_config(value: &Value) -> Parsed<(Option<Mode>, Config)> {
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
    Ok((mode, config))
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
}
