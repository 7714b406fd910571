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
    /// The bits of the step's loss's parameter (smooth L1's β, an argument of its loss kernel), 0
    /// for others.
    pub loss_param: u32,
    pub capacity: usize,
    pub batch: usize,
    pub tf32: bool,
    /// `GpuOptions::deterministic`: the cuDNN algorithms a graph runs may differ with it.
    pub deterministic: bool,
    /// The cache's number, unique in the process (`Dnn::id`): its buffers, cuBLAS and cuDNN
    /// handles and workspaces are baked into the graph, and a new cache may be given a freed
    /// cache's addresses, so addresses alone could replay a graph against freed memory.
    pub cache: u64,
    pub buffers: [sys::CUdeviceptr; 4],
    /// The model's buffers (0: none) and its dropout draw (`DevModel`), which the graph reads
    /// and writes: a model made where a freed one was may have its parameters' address only.
    pub model: [sys::CUdeviceptr; 2],
    /// The optimiser's kernel at the end of a training step's graph, the state it updates and
    /// the norm the norm's kernel ahead of it writes (0 when it does not clip by norm: no such
    /// kernel); None for graphs without an update.
    pub update: Option<(super::context::Kernel, sys::CUdeviceptr, sys::CUdeviceptr)>,
    /// The data-parallel reduction a training step's graph runs before its update
    /// (`nccl::Reduce::id`), 0 for none.
    pub reduce: u64,
}

/// Instantiated graphs, at most [`Graphs::SLOTS`]; the oldest is replaced when full.
pub(crate) struct Graphs {
    slots: Vec<(Key, Exec)>,
    next: usize,
}

pub(super) struct Exec {
    exec: sys::CUgraphExec,
    /// The graph it was instantiated from and, in it, the kernel node whose arguments are set
    /// before each replay ([`Graphs::run_updating`]) with the parameters it was captured with;
    /// null and None when there is none.
    graph: sys::CUgraph,
    update: Option<(sys::CUgraphNode, sys::CUDA_KERNEL_NODE_PARAMS)>,
}

// SAFETY: a graph exec may be launched from any thread with its context current; `Graphs` is
// used through `&mut` only.
unsafe impl Send for Exec {}

impl Drop for Exec {
    fn drop(&mut self) {
        let _exclusive = super::device_wide();
        // SAFETY: instantiated once, destroyed once; a launched exec may be destroyed while it
        // runs (the driver finishes it first). The graph is kept only for its node's handle.
        let _ = unsafe { result::graph::exec_destroy(self.exec) };
        if !self.graph.is_null() {
            // SAFETY: as above, destroyed once.
            let _ = unsafe { result::graph::destroy(self.graph) };
        }
    }
}

/// Arguments for the kernel a step's graph updates before each replay: `set(args)` with one
/// pointer to each of its parameters' values, as for a launch.
pub(crate) type SetArgs<'a> = dyn FnMut(&mut [*mut std::ffi::c_void]) -> Result<()> + 'a;

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
        self.run_updating(enabled, stream, key, None, work, |_| Ok(()))
    }

    /// [`Graphs::run`] for work whose last launch on `stream` is of `kernel` (an optimiser's)
    /// with arguments that change from one call to the next (the step number, the learning
    /// rate): a graph replayed has that kernel node's arguments set first by `args` (which
    /// gets the setter), so each replay, even one queued behind others, runs with the values
    /// given at its own call. A capture (or an eager run) takes them from `work` itself.
    pub fn run_updating(
        &mut self,
        enabled: bool,
        stream: &CudaStream,
        key: Key,
        kernel: Option<sys::CUfunction>,
        work: impl FnOnce() -> Result<()>,
        args: impl FnOnce(&mut SetArgs) -> Result<()>,
    ) -> Result<()> {
        if !enabled {
            return work();
        }
        if let Some((_, exec)) = self.slots.iter().find(|(k, _)| *k == key) {
            if exec.update.is_some() {
                args(&mut |values| exec.set_update_args(Some(values)))?;
            }
            return exec.launch(stream);
        }
        let exec = capture(stream.cu_stream(), kernel, work)?;
        exec.launch(stream)?;
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
    /// Sets the arguments of the update's node for the replays queued after this: `values`
    /// (one pointer to each argument's value, as for a launch), or with None those it was
    /// captured with. Replays already queued keep the arguments they were launched with.
    fn set_update_args(&self, values: Option<&mut [*mut std::ffi::c_void]>) -> Result<()> {
        let (node, captured) = self.update.expect("set_update_args: a graph without an update");
        let params = match values {
            Some(values) => sys::CUDA_KERNEL_NODE_PARAMS { kernelParams: values.as_mut_ptr(), ..captured },
            None => captured,
        };
        // SAFETY: a node of the graph this exec was instantiated from (alive as long as the
        // exec, with the captured arguments it owns); the same kernel, grid and block as
        // captured, and `values` its arguments (the caller's contract, as for a launch), which
        // the driver copies.
        unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, &params) }
            .result()
            .map_err(|e| driver_error("setting the optimiser's arguments in a step's graph", e))
    }

    /// Queues one replay of the graph on `stream` (of the context it was captured in).
    pub(super) fn launch(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: a live exec; the caller's stream is of its context.
        unsafe { result::graph::launch(self.exec, stream.cu_stream()) }.map_err(|e| driver_error("launching a CUDA graph", e))
    }
}

/// Captures what `work` enqueues on `stream` and instantiates it; with `update`, keeps the
/// graph and its one node that launches that kernel (an Err if there is not exactly one).
pub(super) fn capture(stream: sys::CUstream, update: Option<sys::CUfunction>, work: impl FnOnce() -> Result<()>) -> Result<Exec> {
    let shared = super::capturing();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream; the capture is always ended below, whatever `work` returns.
    unsafe { result::stream::begin_capture(stream, mode) }.map_err(|e| driver_error("starting a CUDA graph capture", e))?;
    let outcome = work();
    // SAFETY: ends the capture begun above.
    let ended = unsafe { result::stream::end_capture(stream) };
    // the capture is over: an Exec dropped below takes the lock exclusively
    drop(shared);
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
    let node = update.map(|function| update_node(graph, function)).transpose();
    // SAFETY: a graph just captured; the exec owns a copy.
    let exec = node.and_then(|node| {
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        exec.map(|exec| (exec, node)).map_err(|e| driver_error("instantiating a CUDA graph", e))
    });
    match exec {
        Ok((exec, Some(update))) => {
            let exec = Exec { exec, graph, update: Some(update) };
            // Setting the node's arguments to those it was captured with changes nothing, but
            // finds now what a replay would (an error; the driver's entry point loaded, which
            // allocates once in a process), so the first replay allocates nothing.
            exec.set_update_args(None)?;
            Ok(exec)
        }
        outcome => {
            // SAFETY: as above; not needed once instantiated without an update node.
            let _ = unsafe { result::graph::destroy(graph) };
            outcome.map(|(exec, _)| Exec { exec, graph: std::ptr::null_mut(), update: None })
        }
    }
}

/// The one kernel node of `graph` that launches `function`, with the parameters it was
/// captured with.
fn update_node(graph: sys::CUgraph, function: sys::CUfunction) -> Result<(sys::CUgraphNode, sys::CUDA_KERNEL_NODE_PARAMS)> {
    let mut n = 0usize;
    // SAFETY: a live graph; first the count.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }.result().map_err(|e| driver_error("counting graph nodes", e))?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: as above, into a buffer of `n` handles.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }.result().map_err(|e| driver_error("listing graph nodes", e))?;
    let mut found = None;
    for &node in &nodes[..n] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result().map_err(|e| driver_error("reading a node's type", e))?;
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
        }
        // SAFETY: plain data, written by the driver below.
        let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: a kernel node of the live graph.
        unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }
            .result()
            .map_err(|e| driver_error("reading a kernel node's parameters", e))?;
        if params.func == function {
            if found.is_some() {
                return Err(Error::Cuda { what: "a step's graph launches its optimiser's kernel twice".into() });
            }
            found = Some((node, params));
        }
    }
    found.ok_or_else(|| Error::Cuda { what: "a step's graph has no node of its optimiser's kernel".into() })
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
