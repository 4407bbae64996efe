//! Plans for the survivors of a failure, on the host: with random failed ranks, a survivors'
//! plan either delivers every byte of every surviving destination view (checked from global
//! indices alone), or, exactly when the brute-force oracle finds an element that a surviving
//! destination rank holds and no surviving source rank does, is refused with the same error on
//! every survivor. Renumbering is checked against the oracle's coordinates: a survivor sits
//! where it sat, under its old rank less the failed ranks below it.

mod oracle;

use ncclreshard::exec::{Plan, PlanTensor, StagingLimit};
use ncclreshard::plan::survivors;
use ncclreshard::transport::host::execute;
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, TensorSpec, Topology};
use ncclreshard_tools::check::check;
use oracle::strategies::{layout_on, mesh, tensor_on};
use proptest::prelude::*;

/// Every rank in any of the tensors' meshes, ascending.
fn ranks_of(tensors: &[TensorSpec]) -> Vec<u32> {
    let mut ranks: Vec<u32> = tensors
        .iter()
        .flat_map(|t| [&t.src, &t.dst])
        .flat_map(oracle::mesh_ranks)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// Whether some element a surviving destination rank holds is held by no surviving source
/// rank, by asking every rank about every element.
fn orphaned(tensors: &[TensorSpec], failed: &[u32]) -> bool {
    let alive = |r: &u32| !failed.contains(r);
    tensors.iter().any(|t| {
        (0..oracle::element_count(&t.shape)).any(|linear| {
            let global = oracle::multi_index(&t.shape, linear);
            oracle::owners(&t.shape, &t.dst, &global).iter().any(alive)
                && !oracle::owners(&t.shape, &t.src, &global).iter().any(alive)
        })
    })
}

fn tensor() -> impl Strategy<Value = TensorSpec> {
    (
        prop::collection::vec(1u64..=9, 1..=3),
        mesh(2, 3, 9, 3),
        mesh(2, 3, 9, 12),
    )
        .prop_flat_map(|(shape, src_mesh, dst_mesh)| {
            let ndim = shape.len();
            tensor_on(
                shape,
                DType::Float32,
                layout_on(src_mesh, ndim),
                layout_on(dst_mesh, ndim),
            )
        })
}

fn case() -> impl Strategy<Value = (Vec<TensorSpec>, Config, Vec<u32>)> {
    (
        prop::collection::vec(tensor(), 1..=3),
        prop::sample::select(vec![Mode::Groupable, Mode::Staged, Mode::Auto]),
        prop_oneof![
            Just(Topology::Unknown),
            (1u32..=4).prop_map(Topology::RanksPerNode)
        ],
        prop::sample::select(vec![0u32, 2, 3]),
        prop::collection::vec(0u32..24, 1..=3),
    )
        .prop_map(|(tensors, mode, topology, rounds, failed)| {
            let mut failed = failed;
            failed.sort_unstable();
            failed.dedup();
            let config = Config {
                mode,
                topology,
                rounds: if mode == Mode::Groupable { 0 } else { rounds },
                split_min_bytes: 8,
                ..Config::default()
            };
            (tensors, config, failed)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn survivors_get_every_byte_they_hold_or_the_same_refusal(
        (tensors, config, failed) in case()
    ) {
        let (specs, conversions, renumbered) =
            survivors(&tensors, &vec![None; tensors.len()], &config, &failed).unwrap();
        prop_assert!(conversions.iter().all(Option::is_none));
        // Every survivor sits where it sat, renumbered as ncclCommShrink renumbers.
        for (old, new) in tensors.iter().zip(&specs) {
            for (was, now) in [(&old.src, &new.src), (&old.dst, &new.dst)] {
                for r in oracle::mesh_ranks(was) {
                    let below = failed.iter().filter(|&&f| f < r).count() as u32;
                    let here = now.mesh.coord_of(r - below);
                    if failed.contains(&r) {
                        prop_assert!(now.mesh.ranks().contains(&Mesh::HOLE));
                    } else {
                        prop_assert_eq!(here, oracle::coordinate(was, r), "rank {}", r);
                    }
                }
            }
        }
        let expect_refusal = orphaned(&tensors, &failed);
        match check(&specs, &renumbered) {
            Ok(_) => prop_assert!(!expect_refusal, "no refusal, but a survivor's data is gone"),
            Err(e) if e.message.contains("groupable mode needs more than") => {}
            Err(e) => {
                prop_assert!(expect_refusal, "refused: {}", e);
                prop_assert!(e.message.contains("no surviving rank holds"), "{}", e);
                // The same refusal on every survivor: plan creation decides it from the
                // descriptors alone.
                let survivors: Vec<u32> = ranks_of(&tensors)
                    .into_iter()
                    .filter(|r| !failed.contains(r))
                    .map(|r| r - failed.iter().filter(|&&f| f < r).count() as u32)
                    .collect();
                for &rank in survivors.iter().take(3) {
                    let refused = Plan::survivors(
                        tensors.iter().cloned().map(PlanTensor::new).collect(),
                        &failed,
                        rank,
                        config.clone(),
                        StagingLimit::new(0),
                        NcclTransport::LIMITS,
                    )
                    .err()
                    .expect("refused on every survivor");
                    prop_assert_eq!(&refused.message, &e.message);
                }
            }
        }
    }
}

fn layout(shape: &[u64], ranks: &[u32], placements: &[Placement]) -> Layout {
    Layout::new(
        Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
        placements.to_vec(),
    )
}

#[test]
fn a_dead_trainer_replica_is_replaced_by_its_twin_and_a_dead_inference_rank_gets_nothing() {
    // DP2 × TP2 trainers (0-3) → TP4 inference (4-7) replicated over DP2 (8-11); trainer 1 and
    // inference rank 9 die.
    let spec = TensorSpec {
        shape: vec![16, 12],
        dtype: DType::Bfloat16,
        src: layout(
            &[2, 2],
            &[0, 1, 2, 3],
            &[Placement::Replicate, Placement::Shard(0)],
        ),
        dst: layout(
            &[2, 4],
            &(4..12).collect::<Vec<u32>>(),
            &[Placement::Replicate, Placement::Shard(1)],
        ),
    };
    let config = Config {
        topology: Topology::RanksPerNode(4),
        ..Config::default()
    };
    let failed = [1, 9];
    let (specs, _, renumbered) =
        survivors(std::slice::from_ref(&spec), &[None], &config, &failed).unwrap();
    let report = check(&specs, &renumbered).unwrap();
    assert_eq!(report.ranks, 10);
    // The survivors' programs: old rank 3 (now 2) sends in place of rank 1; old rank 9's
    // position is a hole and nobody sends to it.
    let plan = |rank| {
        Plan::survivors(
            vec![PlanTensor::new(spec.clone())],
            &failed,
            rank,
            config.clone(),
            StagingLimit::new(0),
            NcclTransport::LIMITS,
        )
        .unwrap()
    };
    let programs: Vec<_> = (0..10).map(|r| (**plan(r).program()).clone()).collect();
    let mut buffers: Vec<_> = (0..10)
        .map(|r| ncclreshard_tools::check::rank_buffers(&specs, None, r).unwrap())
        .collect();
    execute(&programs, &mut buffers).unwrap();
    assert!(programs[2].bytes_sent() > programs[0].bytes_sent());
    assert!(programs.iter().all(|p| p.peers().iter().all(|&q| q < 10)));
    // A destination that no survivor can feed: both replicas of trainer shard 0 gone.
    let err = Plan::survivors(
        vec![PlanTensor::new(spec)],
        &[0, 2],
        0,
        config,
        StagingLimit::new(0),
        NcclTransport::LIMITS,
    )
    .err()
    .expect("refused");
    assert!(
        err.message.contains("tensors[0]") && err.message.contains("no surviving rank holds"),
        "{err}"
    );
}
