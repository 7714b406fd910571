//! CUDA graphs: a step's launches captured once and replayed with one `cuGraphLaunch`.
//!
//! A captured graph bakes in every device pointer and every size it was captured with, so a
//! [`Graphs`] store keys each graph by exactly those: the buffers' addresses and the batch.
//! Capture allocates (in the driver, and a slot in the store); replay allocates nothing.

use super::driver_error;
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaStream};

/// What a graph was captured from: the kind of work, the batch, the cache and the addresses of
/// the other buffers it touches. Two calls with equal keys launch exactly the same kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    pub kind: u8,
    pub capacity: usize,
    pub batch: usize,
    pub tf32: bool,
    /// The cache's number, unique in the process (`Dnn::id`): its buffers, cuBLAS and cuDNN
    /// handles and workspaces are baked into the graph, and a new cache may be given a freed
    /// cache's addresses, so addresses alone could replay a graph against freed memory.
    pub cache: u64,
    pub buffers: [sys::CUdeviceptr; 4],
}

/// Instantiated graphs, at most [`Graphs::SLOTS`]; the oldest is replaced when full.
pub(crate) struct Graphs {
    slots: Vec<(Key, Exec)>,
    next: usize,
}

pub(super) struct Exec(sys::CUgraphExec);

// SAFETY: a graph exec may be launched from any thread with its context current; `Graphs` is
// used through `&mut` only.
unsafe impl Send for Exec {}

impl Drop for Exec {
    fn drop(&mut self) {
        let _exclusive = super::device_wide();
        // SAFETY: instantiated once, destroyed once; a launched exec may be destroyed while it
        // runs (the driver finishes it first).
        let _ = unsafe { result::graph::exec_destroy(self.0) };
    }
}

impl Graphs {
    /// Batch sizes (or buffer sets) a store keeps captured at once: a training loop uses one or
    /// two (the full batch and the last, partial one), twice over when its batches come from
    /// the host (one graph per staging buffer), evaluation one or two more.
    pub const SLOTS: usize = 8;

    pub fn new() -> Graphs {
        Graphs { slots: Vec::with_capacity(Self::SLOTS), next: 0 }
    }

    /// Runs `work` on `stream`: replays its graph for `key` if captured, else captures `work`
    /// and replays that. With `enabled` false, runs `work` directly (eager launches, for
    /// debugging). `work` must only enqueue on `stream` (no host synchronisation, allocation or
    /// copy from pageable memory), and must enqueue the same work for the same key.
    pub fn run(&mut self, enabled: bool, stream: &CudaStream, key: Key, work: impl FnOnce() -> Result<()>) -> Result<()> {
        if !enabled {
            return work();
        }
        let cu_stream = stream.cu_stream();
        if let Some((_, exec)) = self.slots.iter().find(|(k, _)| *k == key) {
            // SAFETY: a live exec of this stream's context.
            return unsafe { result::graph::launch(exec.0, cu_stream) }.map_err(|e| driver_error("launching a CUDA graph", e));
        }
        let exec = capture(cu_stream, work)?;
        // SAFETY: as above.
        unsafe { result::graph::launch(exec.0, cu_stream) }.map_err(|e| driver_error("launching a CUDA graph", e))?;
        if self.slots.len() < Self::SLOTS {
            self.slots.push((key, exec));
        } else {
            self.slots[self.next] = (key, exec);
            self.next = (self.next + 1) % Self::SLOTS;
        }
        Ok(())
    }
}

impl Exec {
    /// Queues one replay of the graph on `stream` (of the context it was captured in).
    pub(super) fn launch(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live exec; the caller's stream is of its context.
        unsafe { result::graph::launch(self.0, stream.cu_stream()) }.map_err(|e| driver_error("launching a CUDA graph", e))
    }
}

/// Captures what `work` enqueues on `stream` and instantiates it.
pub(super) fn capture(stream: sys::CUstream, work: impl FnOnce() -> Result<()>) -> Result<Exec> {
    let _shared = super::capturing();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream; the capture is always ended below, whatever `work` returns.
    unsafe { result::stream::begin_capture(stream, mode) }.map_err(|e| driver_error("starting a CUDA graph capture", e))?;
    let outcome = work();
    // SAFETY: ends the capture begun above.
    let ended = unsafe { result::stream::end_capture(stream) };
    let graph = match (outcome, ended) {
        (Ok(()), Ok(graph)) if !graph.is_null() => graph,
        (outcome, ended) => {
            if let Ok(graph) = ended.as_ref().copied() {
                if !graph.is_null() {
                    // SAFETY: the graph this capture produced, destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
            outcome?;
            return Err(match ended {
                Err(e) => driver_error("capturing a CUDA graph", e),
                Ok(_) => Error::Cuda { what: "capturing a CUDA graph gave no graph".into() },
            });
        }
    };
    #[cfg(test)]
    count_allocation_nodes(graph);
    // SAFETY: a graph just captured; the exec owns a copy, so the graph is destroyed after.
    let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
    // SAFETY: as above.
    let _ = unsafe { result::graph::destroy(graph) };
    exec.map(Exec).map_err(|e| driver_error("instantiating a CUDA graph", e))
}

#[cfg(test)]
thread_local! {
    /// Allocation and free nodes in the graphs this thread captured (tests only: a step graph
    /// should have none; cuBLAS adds them when it is left on its own workspace pool).
    pub(crate) static ALLOCATION_NODES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
fn count_allocation_nodes(graph: sys::CUgraph) {
    use sys::CUgraphNodeType::{CU_GRAPH_NODE_TYPE_MEM_ALLOC, CU_GRAPH_NODE_TYPE_MEM_FREE};
    let mut n = 0usize;
    // SAFETY: a live graph; first the count, then that many handles.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }.result().expect("counting graph nodes");
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: as above, into a buffer of `n` handles.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }.result().expect("listing graph nodes");
    let allocations = nodes
        .iter()
        .filter(|&&node| {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL;
            // SAFETY: a node of the live graph.
            unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result().expect("reading a node's type");
            kind == CU_GRAPH_NODE_TYPE_MEM_ALLOC || kind == CU_GRAPH_NODE_TYPE_MEM_FREE
        })
        .count();
    ALLOCATION_NODES.with(|c| c.set(c.get() + allocations));
}
