//! The runtime under the backends: a step's thread (`step_thread`), the collectives ranks meet in
//! without NCCL (`collective`: threads of one process; `cluster`: processes over TCP, with the
//! rendezvous of several nodes), a group of ranks as one backend (`group`), what DP-attention
//! ranks agree on before a step (`agreement`), and process matters (`fault` for the tests' rank
//! kills, `fd_limit`). Built on the step contract; the backends build on it.

pub mod agreement;
pub mod cluster;
pub mod collective;
pub mod fault;
pub mod fd_limit;
pub mod group;
pub mod step_thread;
