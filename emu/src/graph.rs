//! Graphs made by stream capture, their executable instances and launches. A launch replays the
//! recorded work in capture order on the launch stream: kernels with the parameter values copied
//! at capture, copies, memsets, host functions, allocation and free nodes, and NCCL groups, each
//! issued anew at every launch and matched like a fresh call.

use crate::completion::Completion;
use crate::errors::{CuError, CuResult};
use crate::handles::{self, lock, Registry};
use crate::memory::{self, Allocation};
use crate::stream::{Exec, Stream, Work};
use cudarc::driver::sys::CUresult;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The recorded work of a graph, shared by the graph and its executable instances.
pub struct GraphData {
    pub nodes: Vec<Work>,
    /// Memory allocated by the graph's allocation nodes: its addresses were fixed at capture;
    /// it is released when the graph and all its instances are destroyed. Its bytes count
    /// against the device from a launch's allocation node until a trim finds it unused.
    pub owned: Vec<Arc<Allocation>>,
    /// Launches queued or running: while there are any, a trim keeps the graph's memory.
    launches: AtomicUsize,
}

impl Drop for GraphData {
    fn drop(&mut self) {
        for a in &self.owned {
            memory::release(a, "destroying the graph that allocated it");
        }
    }
}

pub struct Graph {
    pub handle: usize,
    pub data: Arc<GraphData>,
}

pub struct GraphExec {
    pub handle: usize,
    pub data: Arc<GraphData>,
    /// The previous launch: launches of one instance run one after another.
    last: Mutex<Option<Arc<Completion>>>,
}

fn graphs() -> &'static Registry<Graph> {
    static R: OnceLock<Registry<Graph>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

fn execs() -> &'static Registry<GraphExec> {
    static R: OnceLock<Registry<GraphExec>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

/// A graph from captured work.
pub fn create(nodes: Vec<Work>) -> Arc<Graph> {
    let owned = nodes
        .iter()
        .filter_map(|w| match w {
            Work::AllocReached(a) => Some(a.clone()),
            _ => None,
        })
        .collect();
    let g = Arc::new(Graph {
        handle: handles::next(),
        data: Arc::new(GraphData {
            nodes,
            owned,
            launches: AtomicUsize::new(0),
        }),
    });
    graphs().insert(g.handle, g.clone());
    g
}

pub fn get(handle: usize) -> CuResult<Arc<Graph>> {
    graphs()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))
}

pub fn destroy(handle: usize) -> CuResult<()> {
    graphs()
        .remove(handle)
        .map(|_| ())
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))
}

pub fn instantiate(graph: &Graph) -> Arc<GraphExec> {
    let e = Arc::new(GraphExec {
        handle: handles::next(),
        data: graph.data.clone(),
        last: Mutex::new(None),
    });
    execs().insert(e.handle, e.clone());
    e
}

pub fn get_exec(handle: usize) -> CuResult<Arc<GraphExec>> {
    execs()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))
}

pub fn destroy_exec(handle: usize) -> CuResult<()> {
    execs()
        .remove(handle)
        .map(|_| ())
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))
}

/// One launch's work: the graph's nodes with NCCL groups issued for this launch.
pub struct Replay {
    pub works: Vec<Work>,
    /// Keeps the graph's memory alive while the launch runs.
    pub data: Arc<GraphData>,
    /// Counted in `data.launches` (a launch of its own, not one recorded into a capture).
    tracked: bool,
}

impl Replay {
    pub fn run(&self, exec: &Exec<'_>) {
        for w in &self.works {
            w.run(exec);
            crate::completion::progress();
        }
        if self.tracked {
            self.data.launches.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// `cuDeviceGraphMemTrim`: the memory of graph allocations on `device` that no queued or running
/// launch uses goes back to the device. Returns the bytes given back.
pub fn trim(device: i32) -> u64 {
    let mut seen: Vec<*const GraphData> = Vec::new();
    let mut freed = 0;
    let datas = graphs()
        .all()
        .into_iter()
        .map(|g| g.data.clone())
        .chain(execs().all().into_iter().map(|e| e.data.clone()));
    for data in datas {
        if seen.contains(&Arc::as_ptr(&data)) {
            continue;
        }
        seen.push(Arc::as_ptr(&data));
        if data.launches.load(Ordering::Acquire) != 0 {
            continue;
        }
        for a in &data.owned {
            if a.place == memory::Place::Device(device) && memory::evict(a) {
                freed += a.size;
            }
        }
    }
    freed
}

/// `cuDeviceGetGraphMemAttribute`'s current values on `device`: (used, reserved) bytes, where
/// used is what graph allocations hold between their allocation and free nodes and reserved
/// what counts against the device.
pub fn memory_in_use(device: i32) -> (u64, u64) {
    let mut seen: Vec<*const GraphData> = Vec::new();
    let (mut used, mut reserved) = (0, 0);
    let datas = graphs()
        .all()
        .into_iter()
        .map(|g| g.data.clone())
        .chain(execs().all().into_iter().map(|e| e.data.clone()));
    for data in datas {
        if seen.contains(&Arc::as_ptr(&data)) {
            continue;
        }
        seen.push(Arc::as_ptr(&data));
        for a in data
            .owned
            .iter()
            .filter(|a| a.place == memory::Place::Device(device))
        {
            if a.is_live() {
                used += a.size;
            }
            if memory::is_resident(a) {
                reserved += a.size;
            }
        }
    }
    (used, reserved)
}

/// `cuGraphLaunch`: issues the graph's NCCL groups now (host order), and queues the replay.
pub fn launch(exec: &Arc<GraphExec>, stream: &Arc<Stream>) -> CuResult<()> {
    let mut works = Vec::with_capacity(exec.data.nodes.len());
    for w in &exec.data.nodes {
        works.push(match w {
            Work::NcclCaptured(t) => Work::Nccl(crate::nccl::ops::issue_template(t, stream)),
            other => other.clone(),
        });
    }
    let capture = stream.capture();
    let replay = Work::Graph(Arc::new(Replay {
        works,
        data: exec.data.clone(),
        tracked: capture.is_none(),
    }));
    if let Some(c) = capture {
        return crate::capture::record(&c, stream, replay);
    }
    if stream.kind == crate::stream::StreamKind::Legacy {
        crate::capture::check_legacy_use(&stream.context)?;
    }
    exec.data.launches.fetch_add(1, Ordering::AcqRel);
    let mut last = lock(&exec.last);
    let deps = last.iter().cloned().collect();
    *last = Some(stream.enqueue(replay, deps));
    Ok(())
}

/// Nodes in a graph (`cuGraphGetNodes` count).
pub fn node_count(graph: &Graph) -> usize {
    graph.data.nodes.len()
}
