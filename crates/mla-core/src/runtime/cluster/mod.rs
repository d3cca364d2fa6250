//! Several nodes serving one model: the TCP rendezvous at `--dist-init-addr` (`rendezvous`), the
//! framed messages the nodes exchange afterwards (`wire`), and a host collective over TCP for
//! the CPU reference backend's ranks on several nodes (`tcp_collective`). On GPUs NCCL carries the
//! tensors; these carry the plans, the answers and the bootstrap.

pub mod rendezvous;
pub mod tcp_collective;
pub mod wire;

pub use rendezvous::{follow, lead, Hello, NodeLink};
