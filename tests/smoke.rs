use ncclreshard::check::check;
use ncclreshard::*;

fn layout(shape: &[u64], ranks: &[u32], placements: &[&str]) -> Layout {
    Layout::new(
        Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
        placements.iter().map(|p| Placement::parse(p).unwrap()).collect(),
    )
}

#[test]
fn smoke() {
    for mode in [Mode::Groupable, Mode::Staged, Mode::Auto] {
        let config = Config { mode, ..Default::default() };
        let cases = vec![
            TensorSpec { shape: vec![6, 10], dtype: DType::Float32, src: layout(&[2], &[0, 1], &["Shard(1)"]), dst: layout(&[1], &[2], &["Replicate"]) },
            TensorSpec { shape: vec![6, 10], dtype: DType::Bfloat16, src: layout(&[2], &[0, 1], &["Shard(0)"]), dst: layout(&[3], &[1, 2, 3], &["Shard(1)"]) },
            TensorSpec { shape: vec![8, 3], dtype: DType::Int8, src: layout(&[2, 2], &[0, 1, 2, 3], &["StridedShard(0,2)", "Shard(0)"]), dst: layout(&[2,2], &[3, 2, 1, 0], &["Replicate", "Shard(1)"]) },
            TensorSpec { shape: vec![], dtype: DType::Float64, src: layout(&[2], &[0, 1], &["Replicate"]), dst: layout(&[4], &[0, 1, 2, 3], &["Replicate"]) },
        ];
        for t in &cases {
            let r = check(std::slice::from_ref(t), &config).unwrap_or_else(|e| panic!("{mode:?} {t:?}: {e}"));
            eprintln!("{mode:?}: {r:?}");
        }
        let r = check(&cases, &config).unwrap();
        eprintln!("{mode:?} all: {r:?}");
    }
}
