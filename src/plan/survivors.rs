//! Plans for the survivors of a failure (docs/resilience.md): the ranks that are gone become
//! holes of their meshes ([`Mesh::HOLE`]) and every other rank is renumbered as
//! `ncclCommShrink` renumbers it, so the survivors plan on the shrunk communicator with the
//! descriptors they had. A destination position that is a hole receives nothing; a source
//! shard's data comes from any of its replicas that survive; where no survivor holds a part
//! of a tensor that a surviving destination rank needs, [`check_held`] refuses the plan, the
//! same way on every rank (it depends on the descriptors alone).

use super::config::{Config, Topology};
use crate::error::{Error, Result};
use crate::layout::{next_index, IndexRuns, Layout, Mesh, TensorSpec};
use crate::quant::Conversion;
use std::collections::{HashMap, HashSet};

/// The survivors' view of rank numbers: each rank less the failed ranks below it, failed ranks
/// gone.
struct Renumbering<'a> {
    failed: &'a [u32],
}

impl Renumbering<'_> {
    fn rank(&self, rank: u32) -> u32 {
        if rank == Mesh::HOLE {
            return Mesh::HOLE;
        }
        match self.failed.binary_search(&rank) {
            Ok(_) => Mesh::HOLE,
            Err(below) => rank - below as u32,
        }
    }
}

/// The descriptors of the survivors when the ranks `failed` (ascending, no repeats) are gone:
/// every mesh with their positions as holes and every other rank renumbered, the topology
/// renumbered alike. Meshes that tensors share stay shared.
pub fn survivors(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    config: &Config,
    failed: &[u32],
) -> Result<(Vec<TensorSpec>, Vec<Option<Conversion>>, Config)> {
    if failed.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid_argument(
            "the failed ranks must be ascending and distinct",
        ));
    }
    let renumber = Renumbering { failed };
    let mut meshes: HashMap<Mesh, Mesh> = HashMap::new();
    let mut mesh_of = |mesh: &Mesh| -> Result<Mesh> {
        if let Some(done) = meshes.get(mesh) {
            return Ok(done.clone());
        }
        let ranks = mesh.ranks().iter().map(|&r| renumber.rank(r)).collect();
        let done = Mesh::new(mesh.shape().to_vec(), ranks)?;
        meshes.insert(mesh.clone(), done.clone());
        Ok(done)
    };
    let mut layout_of = |layout: &Layout| -> Result<Layout> {
        Ok(Layout {
            mesh: mesh_of(&layout.mesh)?,
            ..layout.clone()
        })
    };
    let specs = tensors
        .iter()
        .map(|t| {
            Ok(TensorSpec {
                src: layout_of(&t.src)?,
                dst: layout_of(&t.dst)?,
                ..t.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let conversions = conversions
        .iter()
        .map(|c| {
            c.as_ref()
                .map(|c| {
                    Ok(Conversion {
                        scale_layout: c.scale_layout.as_ref().map(&mut layout_of).transpose()?,
                        ..c.clone()
                    })
                })
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    // The topology of the survivors: each new rank where its old rank was (unknown stays
    // unknown), without a table as large as the world.
    let topology = match &config.topology {
        Topology::Unknown => Topology::Unknown,
        old => Topology::Survivors {
            before: Box::new(old.clone()),
            failed: failed.to_vec(),
        },
    };
    Ok((
        specs,
        conversions,
        Config {
            topology,
            ..config.clone()
        },
    ))
}

/// `[start, end)` runs of each dim, as `[0..4, 2..3∪5..6]`.
fn describe(indices: &[IndexRuns]) -> String {
    let dims: Vec<String> = indices
        .iter()
        .map(|d| {
            let runs: Vec<String> = d
                .runs()
                .iter()
                .map(|r| format!("{}..{}", r.start, r.end))
                .collect();
            runs.join("∪")
        })
        .collect();
    format!("[{}]", dims.join(", "))
}

/// Refuses tensor `t` (`spec`) when a part of it that a surviving destination rank holds is
/// held by no surviving source rank: every replica of some source shard is a hole. Only meshes
/// with holes cost anything: each hole's shard is looked at once.
pub(crate) fn check_held(spec: &TensorSpec, t: usize) -> Result<()> {
    let src = &spec.src;
    if !src.mesh.has_holes() {
        return Ok(());
    }
    let n = spec.shape.len();
    let mut seen: HashSet<Vec<Vec<u64>>> = HashSet::new();
    for (position, &rank) in src.mesh.ranks().iter().enumerate() {
        if rank != Mesh::HOLE {
            continue;
        }
        let coord = src.mesh.coord_at(position);
        let shard: Vec<Vec<u64>> = (0..n)
            .map(|d| src.shard_axes(d).iter().map(|&a| coord[a]).collect())
            .collect();
        if !seen.insert(shard.clone()) {
            continue;
        }
        let refs: Vec<&[u64]> = shard.iter().map(Vec::as_slice).collect();
        if !src.replicas(&refs).is_empty() {
            continue;
        }
        let indices = src.local_indices(&spec.shape, &coord);
        if indices.iter().any(IndexRuns::is_empty) {
            continue;
        }
        // The destination shards overlapping it, per dim: (coordinates, overlap).
        let overlaps: Vec<Vec<(Vec<u64>, IndexRuns)>> = (0..n)
            .map(|d| {
                spec.dst
                    .dim_pieces(&spec.shape, d)
                    .into_iter()
                    .filter_map(|p| {
                        let overlap = p.indices.intersect(&indices[d]);
                        (!overlap.is_empty()).then_some((p.coords, overlap))
                    })
                    .collect()
            })
            .collect();
        if overlaps.iter().any(Vec::is_empty) {
            continue;
        }
        let mut choice = vec![0usize; n];
        loop {
            let coords: Vec<&[u64]> = (0..n)
                .map(|d| overlaps[d][choice[d]].0.as_slice())
                .collect();
            if let Some(&needs) = spec.dst.replicas(&coords).first() {
                let overlap: Vec<IndexRuns> =
                    (0..n).map(|d| overlaps[d][choice[d]].1.clone()).collect();
                return Err(Error::invalid_usage(format!(
                    "tensors[{t}]: no surviving rank holds the source shard at mesh coordinate {coord:?} (global indices {}), and surviving destination rank {needs} needs part of it ({}); every survivor refuses this plan alike: a plan for the survivors needs a surviving replica of every source shard a surviving destination holds part of",
                    describe(&indices),
                    describe(&overlap)
                )));
            }
            if !next_index(&mut choice, |d| overlaps[d].len()) {
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Placement};

    fn layout(shape: &[u64], ranks: &[u32], placements: &[Placement]) -> Layout {
        Layout::new(
            Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
            placements.to_vec(),
        )
    }

    #[test]
    fn survivors_are_renumbered_as_shrink_renumbers_them() {
        // DP2 × TP2 trainers on 0-3, TP2 inference on 4-5; ranks 1 and 4 are gone.
        let spec = TensorSpec {
            shape: vec![8, 8],
            dtype: DType::Float32,
            src: layout(
                &[2, 2],
                &[0, 1, 2, 3],
                &[Placement::Replicate, Placement::Shard(0)],
            ),
            dst: layout(&[2], &[4, 5], &[Placement::Shard(1)]),
        };
        let config = Config {
            topology: Topology::RanksPerNode(2),
            ..Config::default()
        };
        let (specs, _, config) = survivors(&[spec], &[None], &config, &[1, 4]).unwrap();
        let h = Mesh::HOLE;
        assert_eq!(specs[0].src.mesh.ranks(), &[0, h, 1, 2]);
        assert_eq!(specs[0].dst.mesh.ranks(), &[h, 3]);
        // Old ranks 0, 2, 3, 5 on nodes 0, 1, 1, 2 are now 0, 1, 2, 3.
        let nodes: Vec<_> = (0..4).map(|r| config.topology.node(r)).collect();
        assert_eq!(nodes, [Some(0), Some(1), Some(1), Some(2)]);
        // Rank 1's shard has a surviving replica (new rank 2): nothing refused.
        check_held(&specs[0], 0).unwrap();
    }

    #[test]
    fn a_source_shard_no_survivor_holds_is_refused_when_a_survivor_needs_it() {
        let spec = TensorSpec {
            shape: vec![8, 4],
            dtype: DType::Float32,
            src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
            dst: layout(&[2], &[2, 3], &[Placement::Shard(0)]),
        };
        // Rank 1 (rows 4..8) is gone and rank 3 (rows 4..8) survives: refused, naming both.
        let (specs, ..) = survivors(
            std::slice::from_ref(&spec),
            &[None],
            &Config::default(),
            &[1],
        )
        .unwrap();
        let err = check_held(&specs[0], 5).unwrap_err();
        assert!(
            err.message.contains("tensors[5]")
                && err.message.contains("coordinate [1]")
                && err.message.contains("[4..8, 0..4]")
                && err.message.contains("destination rank 2 needs"),
            "{err}"
        );
        // With the rank that needed it gone too, nothing is refused.
        let (specs, ..) = survivors(&[spec], &[None], &Config::default(), &[1, 3]).unwrap();
        check_held(&specs[0], 0).unwrap();
    }

    #[test]
    fn the_survivors_topology_does_not_grow_with_rank_numbers() {
        // Ranks near u32::MAX, failed and alive: nothing is sized by them.
        let big = 3_000_000_000u32;
        let spec = TensorSpec {
            shape: vec![4, 4],
            dtype: DType::Float32,
            src: layout(&[2], &[big, big + 9], &[Placement::Shard(0)]),
            dst: layout(&[1], &[7], &[Placement::Replicate]),
        };
        let config = Config {
            topology: Topology::RanksPerNode(8),
            ..Config::default()
        };
        let failed = [5, big + 1, big + 2, 4_000_000_000];
        let (specs, _, config) = survivors(&[spec], &[None], &config, &failed).unwrap();
        assert_eq!(specs[0].src.mesh.ranks(), &[big - 1, big + 6]);
        assert_eq!(specs[0].dst.mesh.ranks(), &[6]);
        let node = |r| config.topology.node(r);
        assert_eq!(node(big - 1), Some(big / 8));
        assert_eq!(node(big + 6), Some((big + 9) / 8));
        assert_eq!(node(6), Some(7 / 8));
        // Every survivor numbered alike, against a fixed point: the old rank is the new one
        // plus the failed ranks at or below it.
        for new in (0..40).chain(big - 3..big + 12) {
            let mut old = new;
            loop {
                let next = new + failed.iter().filter(|&&f| f <= old).count() as u32;
                if next == old {
                    break;
                }
                old = next;
            }
            assert!(!failed.contains(&old));
            assert_eq!(node(new), Some(old / 8), "survivor {new}");
        }
    }
}
