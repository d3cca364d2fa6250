//! One copy of a model over several ranks (tensor parallel or DP attention), whatever the ranks
//! are: threads of this process with their own device (`StepThread`s of a backend's rank
//! worker), and, when the group spans nodes, the ranks of other processes reached over TCP
//! (`RemoteNode`, answered there by `serve_node`). `GroupBackend` is the engine's view of it: it
//! checks every plan before any rank starts, hands each rank its share, collects the answers
//! with a watchdog, and turns any rank's failure into a `FatalBackendError` after aborting the
//! others, so no rank is left waiting in a collective for one that will never come.
//!
//! The CPU reference backend and the CUDA backend both build on it; they supply the rank worker
//! (what one rank does with a `NodeStep`) and how to abort its collectives.

mod collect;
mod group_backend;
mod node;

pub use group_backend::{GroupBackend, GroupParts};
pub use node::{serve_node, FromNode, NodeReady, NodeStep, RemoteNode, ToNode};

/// Aborts one rank's collectives from any thread, so a rank blocked in one (its peer died)
/// returns with an error; a no-op where the collective fails on its own.
pub type Aborter = std::sync::Arc<dyn Fn() + Send + Sync>;
