//! CUDA graph capture of work queued on our stream, and replay.

use super::{Check, Result};
use cudarc::driver::{result, sys};

pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

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
