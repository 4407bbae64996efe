//! `ncclreshard layout`: every rank's local shard on both sides of each case.

use super::{load_one, per_file, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::layout::Side;
use ncclreshard::{Mesh, TensorSpec};
use ncclreshard_tools::case::{Case, Tensor};
use serde::Serialize;

pub const COMMAND: Command = Command {
    name: "layout",
    help: HELP,
    options: &[flag("json"), value("case")],
    run,
};

const HELP: &str = r#"Show every rank's local shard on the source and destination side

Usage: ncclreshard layout [OPTIONS] FILE

For each case and each side, lists every rank of the mesh in row-major order with its mesh
coordinate, local shape and, per tensor dim, the global index runs it holds ([start, end)).

Options:
  --json       JSON output: {"src": [RANK...], "dst": [RANK...]} per case,
               {"tensors": [{"src", "dst"}...]} for multi-tensor cases, an array of those for
               a file holding an array; RANK = {"rank", "coord", "shape", "indices":
               [[[start, end], ...] per dim]} (plus "strides" for strided views)
  --case NAME  Only the case with this name (or index in the file)
  -h, --help   Show this help
"#;

#[derive(Serialize)]
struct RankShard {
    rank: u32,
    coord: Vec<u64>,
    shape: Vec<u64>,
    indices: Vec<Vec<[u64; 2]>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strides: Option<Vec<u64>>,
}

#[derive(Serialize)]
struct Sides {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    src: Vec<RankShard>,
    dst: Vec<RankShard>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum CaseLayout {
    Single(Sides),
    Multi { name: String, tensors: Vec<Sides> },
}

fn shards(spec: &TensorSpec, side: Side) -> Vec<RankShard> {
    let layout = spec.layout(side);
    let mesh = &layout.mesh;
    (0..mesh.size())
        .filter(|&i| mesh.ranks()[i] != Mesh::HOLE)
        .map(|i| {
            let rank = mesh.ranks()[i];
            let view = spec
                .rank_view(side, rank)
                .expect("every rank of a mesh has a view");
            RankShard {
                rank,
                shape: view.local_shape().to_vec(),
                indices: view
                    .indices
                    .iter()
                    .map(|runs| runs.runs().iter().map(|r| [r.start, r.end]).collect())
                    .collect(),
                coord: mesh.coord_at(i),
                strides: layout.strides.clone(),
            }
        })
        .collect()
}

fn sides(tensor: &Tensor, name: Option<String>) -> Sides {
    Sides {
        name,
        src: shards(&tensor.spec, Side::Src),
        dst: shards(&tensor.spec, Side::Dst),
    }
}

fn case_layout(case: &Case) -> CaseLayout {
    if case.multi {
        CaseLayout::Multi {
            name: case.name.clone(),
            tensors: case
                .tensors
                .iter()
                .map(|t| sides(t, t.name.clone()))
                .collect(),
        }
    } else {
        CaseLayout::Single(sides(&case.tensors[0], Some(case.name.clone())))
    }
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let file = load_one(parsed, "layout")?;
    if parsed.flag("json") {
        out::print(&per_file(
            &file,
            file.cases.iter().map(case_layout).collect(),
        ));
        return Ok(0);
    }
    let mut text = String::new();
    for case in &file.cases {
        text += &format!("case {}\n", case.name);
        for (t, tensor) in case.tensors.iter().enumerate() {
            let spec = &tensor.spec;
            if case.multi {
                let name = tensor
                    .name
                    .as_deref()
                    .map(|n| format!(" {n}"))
                    .unwrap_or_default();
                text += &format!("  tensor {t}{name}:");
            } else {
                text += " ";
            }
            text += &format!(" shape {:?} {}\n", spec.shape, spec.dtype);
            for (name, side) in [("src", Side::Src), ("dst", Side::Dst)] {
                text += &side_table(name, spec, side);
            }
        }
    }
    out::print(&text);
    Ok(0)
}

/// At most this many runs per dim are printed; longer lists are elided with a count.
const MAX_RUNS_SHOWN: usize = 6;

fn side_table(name: &str, spec: &TensorSpec, side: Side) -> String {
    let layout = spec.layout(side);
    let placements: Vec<String> = layout.placements.iter().map(|p| p.to_string()).collect();
    let mut text = format!(
        "    {name}: mesh {:?} ranks {} placements [{}]{}\n",
        layout.mesh.shape(),
        out::ranks(layout.mesh.ranks()),
        placements.join(", "),
        layout
            .strides
            .as_ref()
            .map(|s| format!(" strides {s:?}"))
            .unwrap_or_default()
    );
    let rows: Vec<[String; 4]> = shards(spec, side)
        .into_iter()
        .map(|s| {
            let dims: Vec<String> = s
                .indices
                .iter()
                .map(|runs| {
                    let mut shown: Vec<String> = runs
                        .iter()
                        .take(MAX_RUNS_SHOWN)
                        .map(|[a, b]| format!("[{a},{b})"))
                        .collect();
                    if runs.len() > MAX_RUNS_SHOWN {
                        shown.push(format!("…({} runs)", runs.len()));
                    }
                    if shown.is_empty() {
                        "∅".to_string()
                    } else {
                        shown.join("+")
                    }
                })
                .collect();
            [
                s.rank.to_string(),
                format!("{:?}", s.coord),
                format!("{:?}", s.shape),
                if dims.is_empty() {
                    "(scalar)".to_string()
                } else {
                    dims.join(" × ")
                },
            ]
        })
        .collect();
    let header = ["rank", "coord", "local shape", "indices"].map(String::from);
    let widths: Vec<usize> = (0..3)
        .map(|c| {
            rows.iter()
                .chain([&header])
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in [&header].into_iter().chain(&rows) {
        text += &format!(
            "      {:>w0$}  {:<w1$}  {:<w2$}  {}\n",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    }
    text
}
