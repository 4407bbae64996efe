//! `ncclreshard bench-plan`: planner time for a generated many-tensor refit (synthetic
//! layouts; `ncclreshard bench --plan` times a real model refit).

use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::exec::{rank_program, StagingLimit};
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, Planner, TensorSpec, Topology};
use serde::Serialize;
use std::time::Instant;

pub const COMMAND: Command = Command {
    name: "bench-plan",
    help: HELP,
    options: &[
        value("tensors"),
        value("src-mesh"),
        value("dst-mesh"),
        value("ranks-per-node"),
        value("dtype"),
        value("shape"),
        value("mode"),
        value("rank"),
        flag("json"),
    ],
    run,
};

const HELP: &str = r#"Time the planner on N identical-layout tensors of a trainer → inference refit

Usage: ncclreshard bench-plan --src-mesh A,B --dst-mesh C,D [OPTIONS]

The source is Megatron-like, on ranks 0..S-1: mesh axis 0 shards tensor dim 0, axis 1 shards
dim 1, further axes replicate. The destination is vLLM-like, on the next D ranks: the last mesh
axis shards dim 0, the other axes replicate (DP × TP). Times Planner::new plus
rank_program for one rank, and for every rank of the plan. For a real model refit see
`ncclreshard bench --plan`.

Options:
  --tensors N          Tensors in the plan (default 1)
  --src-mesh A,B       Source mesh shape (required)
  --dst-mesh C,D       Destination mesh shape (required)
  --shape R,C          Global shape of every tensor (default 4096,4096)
  --dtype NAME         Element type, torch's name (default bfloat16)
  --ranks-per-node N   Topology: rank r is on node r / N (default 8; 0 for unknown)
  --mode MODE          groupable, staged or auto (default auto)
  --rank R             The rank timed alone (default 0)
  --json               {"plan_ms_one_rank", "plan_ms_all_ranks", "ranks", "tensors",
                        "messages_total", ...}
  -h, --help           Show this help

Example (a 1,000-tensor plan at 256 ranks):
  ncclreshard bench-plan --tensors 1000 --src-mesh 16,8 --dst-mesh 8,16
"#;

#[derive(Serialize)]
struct BenchResult {
    tensors: usize,
    ranks: usize,
    rank: u32,
    mode: &'static str,
    plan_ms_new: f64,
    plan_ms_one_rank: f64,
    plan_ms_all_ranks: f64,
    plan_ms_slowest_rank: f64,
    slowest_rank: u32,
    messages_total: u64,
    bytes_total: u64,
}

/// Source placements: axis 0 → Shard(0), axis 1 → Shard(1) (where the tensor has those dims),
/// the rest Replicate.
fn src_placements(mesh_axes: usize, tensor_dims: usize) -> Vec<Placement> {
    (0..mesh_axes)
        .map(|a| {
            if a < 2 && a < tensor_dims {
                Placement::Shard(a)
            } else {
                Placement::Replicate
            }
        })
        .collect()
}

/// Destination placements: the last axis → Shard(0) (when the tensor has a dim), the rest
/// Replicate.
fn dst_placements(mesh_axes: usize, tensor_dims: usize) -> Vec<Placement> {
    (0..mesh_axes)
        .map(|a| {
            if a + 1 == mesh_axes && tensor_dims > 0 {
                Placement::Shard(0)
            } else {
                Placement::Replicate
            }
        })
        .collect()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let bad = |e: String| usage("bench-plan", e);
    let tensors = parsed.number::<usize>("tensors").map_err(bad)?.unwrap_or(1);
    let src_mesh = parsed
        .numbers("src-mesh")
        .map_err(bad)?
        .ok_or_else(|| bad("--src-mesh is required".into()))?;
    let dst_mesh = parsed
        .numbers("dst-mesh")
        .map_err(bad)?
        .ok_or_else(|| bad("--dst-mesh is required".into()))?;
    let shape = parsed
        .numbers("shape")
        .map_err(bad)?
        .unwrap_or_else(|| vec![4096, 4096]);
    let dtype_name = parsed.value("dtype").unwrap_or("bfloat16");
    let dtype = DType::from_name(dtype_name)
        .ok_or_else(|| bad(format!("--dtype: unknown dtype {dtype_name:?}")))?;
    let ranks_per_node = parsed
        .number::<u32>("ranks-per-node")
        .map_err(bad)?
        .unwrap_or(8);
    let mode = parsed
        .value("mode")
        .map(Mode::parse)
        .transpose()
        .map_err(|e| bad(format!("--mode: {e}")))?;
    let rank = parsed.number::<u32>("rank").map_err(bad)?.unwrap_or(0);
    if tensors == 0 {
        return Err(bad("--tensors must be at least 1".into()));
    }

    let src = Mesh::contiguous(src_mesh.clone(), 0).map_err(|e| bad(format!("--src-mesh: {e}")))?;
    let dst_first = u32::try_from(src.size()).map_err(|_| bad("--src-mesh is too large".into()))?;
    let dst = Mesh::contiguous(dst_mesh.clone(), dst_first)
        .map_err(|e| bad(format!("--dst-mesh: {e}")))?;
    let spec = TensorSpec {
        shape: shape.clone(),
        dtype,
        src: Layout::new(src, src_placements(src_mesh.len(), shape.len())),
        dst: Layout::new(dst, dst_placements(dst_mesh.len(), shape.len())),
    };
    let config = Config {
        mode: mode.unwrap_or(Mode::Auto),
        topology: if ranks_per_node == 0 {
            Topology::Unknown
        } else {
            Topology::RanksPerNode(ranks_per_node)
        },
        ..Default::default()
    };
    let specs = vec![spec.clone(); tensors];

    let started = Instant::now();
    let planner = Planner::new(specs, config.clone()).map_err(|e| Failure::Input(e.to_string()))?;
    let plan_ms_new = ms(started);
    let started = Instant::now();
    rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS)
        .map_err(|e| Failure::Input(format!("rank {rank}: {e}")))?;
    let plan_ms_one_rank = plan_ms_new + ms(started);

    let ranks = planner.ranks();
    let (mut messages_total, mut bytes_total) = (0u64, 0u64);
    let (mut slowest, mut slowest_rank) = (0.0f64, 0u32);
    let started = Instant::now();
    for &r in &ranks {
        let one = Instant::now();
        let program = rank_program(&planner, r, StagingLimit::new(0), NcclTransport::LIMITS)
            .map_err(|e| Failure::Input(format!("rank {r}: {e}")))?;
        let took = ms(one);
        if took > slowest {
            (slowest, slowest_rank) = (took, r);
        }
        messages_total += program.sends.len() as u64;
        bytes_total += program.bytes_sent();
    }
    let plan_ms_all_ranks = plan_ms_new + ms(started);

    let result = BenchResult {
        tensors,
        ranks: ranks.len(),
        rank,
        mode: config.mode.name(),
        plan_ms_new,
        plan_ms_one_rank,
        plan_ms_all_ranks,
        plan_ms_slowest_rank: plan_ms_new + slowest,
        slowest_rank,
        messages_total,
        bytes_total,
    };
    if parsed.flag("json") {
        out::print(&out::json(&result));
        return Ok(0);
    }
    let placements = |l: &Layout| {
        l.placements
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    out::print(&format!(
        "bench-plan: {tensors} × {shape:?} {dtype}, mode {}, {}\n  src mesh {src_mesh:?} ranks {} [{}]\n  dst mesh {dst_mesh:?} ranks {} [{}]\n  ranks in plan           {}\n  Planner::new            {:.2} ms\n  one rank (rank {rank})      {:.2} ms (Planner::new + rank_program)\n  slowest rank ({})       {:.2} ms\n  all ranks               {:.2} ms (Planner::new + every rank_program)\n  messages total          {messages_total}\n  bytes total             {bytes_total}\n",
        config.mode.name(),
        if ranks_per_node == 0 { "topology unknown".to_string() } else { format!("{ranks_per_node} ranks per node") },
        out::ranks(spec.src.mesh.ranks()),
        placements(&spec.src),
        out::ranks(spec.dst.mesh.ranks()),
        placements(&spec.dst),
        ranks.len(),
        plan_ms_new,
        plan_ms_one_rank,
        slowest_rank,
        result.plan_ms_slowest_rank,
        plan_ms_all_ranks,
    ));
    Ok(0)
}
