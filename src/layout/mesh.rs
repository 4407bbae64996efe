//! Device meshes: an N-D array of communicator ranks, row-major, like torch's `DeviceMesh`.

use crate::error::{Error, Result};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The most mesh axes a layout may have (docs/design.md §2).
pub const MAX_MESH_AXES: usize = 8;
/// The most ranks a mesh may hold: far beyond any cluster, and small enough that a descriptor
/// can never make the planner allocate without bound.
pub const MAX_MESH_RANKS: u64 = 1 << 20;

/// An N-D array of distinct communicator ranks in row-major order (last axis fastest). A
/// position may be a hole ([`Mesh::HOLE`]): its rank is gone (a survivors' plan), so the shard
/// it would hold is held only by its replicas elsewhere in the mesh, if any.
///
/// Immutable and cheap to clone: clones share one rank table, so the thousands of tensors of
/// a model that sit on one mesh hold it once. Hashing a mesh costs the same for 8 ranks as for
/// 8192 (a digest of the table is kept), and so does comparing clones (by address) or meshes
/// whose digests differ; two equal meshes built separately compare their tables.
#[derive(Clone)]
pub struct Mesh {
    table: Arc<Table>,
}

struct Table {
    shape: Vec<u64>,
    ranks: Vec<u32>,
    /// `(rank, row-major index)` sorted by rank, for coordinate lookups in O(log n); holes are
    /// not in it.
    by_rank: Vec<(u32, u32)>,
    /// A hash of `shape` and `ranks`: equal meshes have equal digests.
    digest: u64,
}

impl PartialEq for Mesh {
    fn eq(&self, other: &Mesh) -> bool {
        Arc::ptr_eq(&self.table, &other.table)
            || (self.table.digest == other.table.digest
                && self.table.shape == other.table.shape
                && self.table.ranks == other.table.ranks)
    }
}

impl Eq for Mesh {}

impl Hash for Mesh {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The digest is a function of what equality compares.
        state.write_u64(self.table.digest);
    }
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mesh")
            .field("shape", &self.table.shape)
            .field("ranks", &self.table.ranks)
            .finish()
    }
}

/// FNV-1a over the shape and the rank table, 64 bits at a time.
fn table_digest(shape: &[u64], ranks: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    eat(shape.len() as u64);
    shape.iter().for_each(|&n| eat(n));
    ranks.iter().for_each(|&r| eat(u64::from(r)));
    h
}

impl Mesh {
    /// The rank table's entry for a position whose rank is gone (`-1` in the C API, `null` in
    /// case files).
    pub const HOLE: u32 = u32::MAX;

    /// A mesh over an explicit rank table (any order, any ranks, no duplicates; holes,
    /// [`Mesh::HOLE`], allowed anywhere).
    pub fn new(shape: Vec<u64>, ranks: Vec<u32>) -> Result<Mesh> {
        if shape.is_empty() || shape.len() > MAX_MESH_AXES {
            return Err(Error::invalid_argument(format!(
                "mesh has {} axes; a mesh needs 1 to {MAX_MESH_AXES}",
                shape.len()
            )));
        }
        if let Some(axis) = shape.iter().position(|&n| n == 0) {
            return Err(Error::invalid_argument(format!(
                "mesh axis {axis} has size 0; every mesh axis needs at least one rank"
            )));
        }
        let size = shape.iter().try_fold(1u64, |acc, &n| acc.checked_mul(n));
        if !matches!(size, Some(s) if s <= MAX_MESH_RANKS) {
            return Err(Error::invalid_argument(format!(
                "mesh shape {shape:?} holds more ranks than the {MAX_MESH_RANKS} a rank table may hold"
            )));
        }
        if size != Some(ranks.len() as u64) {
            return Err(Error::invalid_argument(format!(
                "mesh shape {shape:?} holds {} ranks but the rank table has {}",
                size.map_or_else(|| "more than 2^64".to_string(), |s| s.to_string()),
                ranks.len()
            )));
        }
        if ranks.len() > i32::MAX as usize {
            return Err(Error::invalid_argument(
                "mesh has more ranks than NCCL can address",
            ));
        }
        let mut by_rank: Vec<(u32, u32)> = ranks
            .iter()
            .enumerate()
            .filter(|&(_, &r)| r != Mesh::HOLE)
            .map(|(i, &r)| (r, i as u32))
            .collect();
        by_rank.sort_unstable();
        if let Some(w) = by_rank.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid_argument(format!(
                "rank {} appears twice in the mesh (positions {} and {}); a rank may hold one place",
                w[0].0, w[0].1, w[1].1
            )));
        }
        let digest = table_digest(&shape, &ranks);
        Ok(Mesh {
            table: Arc::new(Table {
                shape,
                ranks,
                by_rank,
                digest,
            }),
        })
    }

    /// A mesh over the contiguous ranks `first_rank, first_rank + 1, …` (`init_device_mesh`).
    pub fn contiguous(shape: Vec<u64>, first_rank: u32) -> Result<Mesh> {
        let size = shape
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n))
            .unwrap_or(u64::MAX);
        if size > MAX_MESH_RANKS {
            return Err(Error::invalid_argument(format!(
                "mesh shape {shape:?} holds more ranks than the {MAX_MESH_RANKS} a rank table may hold"
            )));
        }
        let last = u64::from(first_rank).checked_add(size);
        match last {
            Some(last) if size <= i32::MAX as u64 && last <= i32::MAX as u64 + 1 => {
                Mesh::new(shape, (first_rank..last as u32).collect())
            }
            _ => Err(Error::invalid_argument(format!(
                "mesh shape {shape:?} from first rank {first_rank} exceeds NCCL's rank range"
            ))),
        }
    }

    /// Whether both meshes are one rank table (not only equal ones).
    #[cfg(test)]
    pub(crate) fn shares_table(&self, other: &Mesh) -> bool {
        Arc::ptr_eq(&self.table, &other.table)
    }

    /// The number of ranks along each mesh axis (each at least 1).
    pub fn shape(&self) -> &[u64] {
        &self.table.shape
    }

    /// The number of mesh axes (1 to [`MAX_MESH_AXES`]).
    pub fn ndim(&self) -> usize {
        self.table.shape.len()
    }

    /// The rank table in row-major order, holes ([`Mesh::HOLE`]) included.
    pub fn ranks(&self) -> &[u32] {
        &self.table.ranks
    }

    /// The ranks that are there (not holes), in row-major order.
    pub fn live_ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.table
            .ranks
            .iter()
            .copied()
            .filter(|&r| r != Mesh::HOLE)
    }

    /// Whether some position is a hole.
    pub fn has_holes(&self) -> bool {
        self.table.by_rank.len() < self.table.ranks.len()
    }

    /// The number of ranks in the mesh: the product of its shape.
    pub fn size(&self) -> usize {
        self.table.ranks.len()
    }

    /// Ranks sorted ascending (holes left out).
    pub fn sorted_ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.by_rank.iter().map(|&(r, _)| r)
    }

    /// Whether communicator rank `rank` is in the mesh.
    pub fn contains(&self, rank: u32) -> bool {
        self.index_of(rank).is_some()
    }

    /// Row-major position of `rank` in the mesh.
    pub fn index_of(&self, rank: u32) -> Option<usize> {
        let by_rank = &self.table.by_rank;
        // Ranks are distinct and sorted: in a mesh of consecutive ranks, `rank` sits at its
        // distance from the first (checked), without a search.
        let guess = rank.wrapping_sub(by_rank.first()?.0) as usize;
        if let Some(&(r, i)) = by_rank.get(guess) {
            if r == rank {
                return Some(i as usize);
            }
        }
        by_rank
            .binary_search_by_key(&rank, |&(r, _)| r)
            .ok()
            .map(|i| by_rank[i].1 as usize)
    }

    /// Coordinate of `rank` (one entry per mesh axis).
    pub fn coord_of(&self, rank: u32) -> Option<Vec<u64>> {
        self.index_of(rank).map(|i| self.coord_at(i))
    }

    /// Coordinate of the row-major position `index`.
    pub fn coord_at(&self, mut index: usize) -> Vec<u64> {
        let shape = self.shape();
        let mut coord = vec![0; shape.len()];
        for axis in (0..shape.len()).rev() {
            let n = shape[axis] as usize;
            coord[axis] = (index % n) as u64;
            index /= n;
        }
        coord
    }

    /// The rank at a coordinate ([`Mesh::HOLE`] where it is gone).
    pub fn rank_at(&self, coord: &[u64]) -> u32 {
        let index = coord
            .iter()
            .zip(self.shape())
            .fold(0u64, |acc, (&c, &n)| acc * n + c);
        self.table.ranks[index as usize]
    }
}
