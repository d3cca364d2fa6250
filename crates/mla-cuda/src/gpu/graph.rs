//! CUDA graph capture of work queued on our stream, and replay.

use super::{Check, Result};
use cudarc::driver::{result, sys};

pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

/// A node of a captured `Graph` (valid as long as the graph).
#[derive(Debug, Clone, Copy)]
pub struct GraphNode(sys::CUgraphNode);

impl Graph {
    /// Captures everything `record` queues on `stream` (nothing runs during capture), then
    /// instantiates it. `record` must not synchronise or allocate.
    pub fn capture<F>(stream: sys::CUstream, record: F) -> anyhow::Result<Self>
    where
        F: FnOnce() -> anyhow::Result<()>,
    {
        // SAFETY: `stream` is the caller's live, non-default stream; the capture ends below whatever
        // `record` does.
        unsafe { result::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .ctx("beginning graph capture")?;
        let recorded = record();
        // End the capture whatever happened, so the stream is usable again.
        // SAFETY: the capture begun above is still open on this thread.
        let graph = unsafe { result::stream::end_capture(stream) }.ctx("ending graph capture");
        recorded?;
        let graph = graph?;
        // SAFETY: `graph` is the complete graph the capture returned; both are destroyed in Drop.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .ctx("instantiating the graph")?;
        Ok(Graph { graph, exec })
    }

    /// The captured graph's kernel nodes that launch `func`.
    pub fn kernel_nodes(&self, func: sys::CUfunction) -> Result<Vec<GraphNode>> {
        let mut n = 0usize;
        // SAFETY: a null node array asks only for the count.
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n) }
            .result()
            .ctx("counting graph nodes")?;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` has room for the `n` nodes the graph holds.
        unsafe { sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut n) }.result().ctx("listing graph nodes")?;
        nodes.truncate(n);
        let mut found = Vec::new();
        for node in nodes {
            let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` belongs to the live graph; `ty` outlives the call.
            unsafe { sys::cuGraphNodeGetType(node, &mut ty) }.result().ctx("reading a graph node's type")?;
            if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                continue;
            }
            // SAFETY: a kernel node of the live graph; the parameters are plain data (all-zero is a
            // valid value to be overwritten) and only `func` is read.
            let mut params: sys::CUDA_KERNEL_NODE_PARAMS_v2 = unsafe { std::mem::zeroed() };
            // SAFETY: as above; `params` outlives the call. A node whose parameters cannot be read
            // (a library's kernel launched some other way) is not ours.
            let read = unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }.result();
            if read.is_ok() && params.func == func {
                found.push(GraphNode(node));
            }
        }
        Ok(found)
    }

    /// Enables or disables `node` (of this graph) for the launches queued from now on; a disabled
    /// node does nothing, and the nodes after it wait as before.
    pub fn set_enabled(&self, node: GraphNode, on: bool) -> Result<()> {
        // SAFETY: `node` was found in `graph`, from which `exec` was instantiated, and is never
        // removed from it.
        unsafe { sys::cuGraphNodeSetEnabled(self.exec, node.0, on as std::ffi::c_uint) }
            .result()
            .ctx("enabling or disabling a graph node")
    }

    pub fn launch(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: `exec` lives until Drop; the graph only reads and writes buffers its owner keeps alive
        // (CudaModel holds them as long as its DecodeGraphs).
        unsafe { result::graph::launch(self.exec, stream) }.ctx("launching the graph")
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: each handle is destroyed once, here.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
