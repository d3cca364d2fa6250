//! Serving one model from several nodes (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`,
//! SGLang's flags). Node 0 runs the engine and the HTTP server and holds ranks `0 .. L` of the
//! group (L = tp / nnodes); node R holds ranks `R·L .. (R+1)·L` on its GPUs `0 .. L` and serves
//! them for node 0 (`mla_core::runtime::group::serve_node`), never HTTP. The nodes meet at the
//! rendezvous (`mla_core::runtime::cluster`), which checks that they were started alike; node 0 then hands
//! out the bootstrap (the NCCL unique id; on the CPU, the address of its collective hub). NCCL
//! carries the tensors, the rendezvous link the plans and answers.

use crate::cli::{Args, Device};
use crate::model_source::{ModelSource, WeightOrigin};
use anyhow::Context;
use mla_core::runtime::cluster::rendezvous::{self, Hello, PROTOCOL};
use mla_core::runtime::cluster::tcp_collective::{start_hub, TcpRank};
use mla_core::runtime::collective::Collective;
use mla_core::runtime::group::{serve_node, FromNode, GroupBackend, NodeReady, RemoteNode};
use mla_core::{Backend, CacheLayout, KvCacheDtype, Parallel, StepLimits};
use mla_cuda::collective::NcclConnector;
use mla_cuda::gpu::nccl::NcclId;
use mla_cuda::group::{GroupOptions, LocalRanks};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything both ends need about this node's share.
struct Plan {
    parallel: Parallel,
    per_node: usize,
    addr: String,
    hello: Hello,
    timeout: Duration,
    watchdog: Duration,
    /// The steps' limits from the flags (CPU ranks keep them; GPU ranks may shrink them).
    step_limits: StepLimits,
    /// What the ranks' latent caches store (the same on every node: it is part of `layout`).
    kv_cache_dtype: KvCacheDtype,
    /// Whether the ranks load the MTP layer for speculative decoding (part of `layout` too).
    mtp: bool,
}

impl Plan {
    fn new(args: &Args, source: &ModelSource, device: Device, cache: Option<CacheLayout>) -> anyhow::Result<Self> {
        let parallel = args.parallel()?;
        let addr = args.dist_init_addr.clone().context("--nnodes above 1 needs --dist-init-addr")?;
        // Everything that must match on every node: the layout, what sizes the ranks' buffers
        // and caches, and the model (not its path, which may differ between machines).
        let layout = format!(
            "{} --tp {}{}{} on {device:?}; max_num_seqs {}, max_num_batched_tokens {}, max_model_len {:?}, cache {cache:?} of {}",
            if args.nnodes > 1 { format!("--nnodes {}", args.nnodes) } else { String::new() },
            parallel.tp,
            if parallel.dp_attention { " --enable-dp-attention" } else { "" },
            // Every rank loads the MTP layer and makes the same passes, or none does.
            match args.speculative.request()? {
                Some(r) => format!(" with {} MTP draft tokens", r.draft_tokens),
                None => String::new(),
            },
            args.max_num_seqs,
            args.max_num_batched_tokens(),
            args.max_model_len,
            args.kv_cache_dtype()?.name(),
        );
        let c = &source.config;
        let weights = match &source.weights {
            WeightOrigin::Checkpoint(_) => "checkpoint".to_string(),
            WeightOrigin::Dummy { seed } => format!("dummy weights (seed {seed})"),
        };
        let model = format!(
            "{:?} with {} layers, hidden {}, {} heads, {} experts, vocab {}, {weights}",
            c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.n_routed_experts, c.vocab_size
        );
        let hello = Hello { protocol: PROTOCOL, node_rank: args.node_rank, nnodes: args.nnodes, layout, model };
        Ok(Plan {
            parallel,
            per_node: parallel.tp / args.nnodes,
            addr,
            hello,
            timeout: Duration::from_secs_f64(args.dist_timeout),
            watchdog: args.watchdog(),
            step_limits: args.step_limits(&parallel)?.0,
            kv_cache_dtype: args.kv_cache_dtype()?,
            mtp: args.speculative.request()?.is_some(),
        })
    }

    fn my_ranks(&self) -> Range<usize> {
        let first = self.hello.node_rank * self.per_node;
        first..first + self.per_node
    }

    fn group(&self, connector: Arc<NcclConnector>) -> GroupOptions {
        GroupOptions {
            world: self.parallel.tp,
            dp_attention: self.parallel.dp_attention,
            watchdog: self.watchdog,
            connector,
        }
    }
}

/// CPU ranks `ranks` connected to the collective hub at `hub`.
fn cpu_ranks(
    source: &ModelSource,
    p: &Plan,
    hub: std::net::SocketAddr,
    cache: CacheLayout,
) -> anyhow::Result<Vec<mla_core::runtime::step_thread::StepThread<mla_cpu::group::CpuRankWorker>>> {
    let world = p.parallel.tp;
    let comms = p
        .my_ranks()
        .map(|r| TcpRank::connect(hub, r, world, p.watchdog).map(|c| Box::new(c) as Box<dyn Collective + Send>))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let kv_dtype = p.kv_cache_dtype;
    mla_cpu::group::start_ranks(
        &source.config,
        source.host_weights()?,
        p.parallel,
        p.my_ranks(),
        comms,
        cache,
        kv_dtype,
        // Part of the layout every node checked at the rendezvous.
        p.mtp,
    )
}

/// Node 0: meets the other nodes, starts its ranks alongside theirs and returns the group as
/// one backend. `cache` is the CPU cache of each rank (on GPUs the ranks size it).
pub fn start_as_node0(
    args: &Args,
    source: &ModelSource,
    device: Device,
    cuda: mla_cuda::CudaOptions,
    cache: Option<CacheLayout>,
) -> anyhow::Result<Box<dyn Backend>> {
    let p = Plan::new(args, source, device, cache)?;
    match device {
        Device::Cuda => {
            tracing::info!("{}", mla_cuda::gpu::nccl::describe()?);
            let id = NcclId::new()?;
            let links = rendezvous::lead(&p.addr, &p.hello, &id.to_bytes(), p.timeout)?;
            let remotes = links.into_iter().map(RemoteNode::new).collect::<anyhow::Result<Vec<_>>>()?;
            let group = p.group(Arc::new(NcclConnector { id }));
            let (cfg, weights) = (source.config.clone(), source.cuda_weights());
            let (opts, g, ranks) = (cuda.clone(), group.clone(), p.my_ranks());
            let local = std::thread::spawn(move || mla_cuda::group::start_ranks(&cfg, &weights, &opts, &g, ranks));
            let (local, remotes) = start_with(local, remotes)?;
            for (r, ready) in &remotes {
                anyhow::ensure!(
                    ready.cache == local.ready.cache
                        && ready.graph_batches == local.ready.graph_batches
                        && ready.step_limits == local.ready.step_limits,
                    "node {} disagrees with node 0 on the KV cache, the decode graphs or the step limits",
                    r.node()
                );
            }
            let parts = mla_cuda::group::group_parts(source.config.clone(), &cuda, &group, local, remotes);
            Ok(Box::new(GroupBackend::new(parts)))
        }
        _ => {
            let cache = cache.context("the CPU cache is sized before the ranks start")?;
            let ip = rendezvous_ip(&p.addr)?;
            let hub = start_hub(ip, p.parallel.tp, p.watchdog)?;
            let links = rendezvous::lead(&p.addr, &p.hello, hub.to_string().as_bytes(), p.timeout)?;
            let mut remotes = links.into_iter().map(RemoteNode::new).collect::<anyhow::Result<Vec<_>>>()?;
            let local = cpu_ranks(source, &p, hub, cache)?;
            let mut ready = Vec::with_capacity(remotes.len());
            for r in remotes.drain(..) {
                let mut r = r;
                let x = r.wait_ready(p.timeout)?;
                anyhow::ensure!(x.cache == cache, "node {} sized its KV cache differently ({:?})", r.node(), x.cache);
                anyhow::ensure!(
                    x.step_limits == p.step_limits,
                    "node {} sized its steps differently ({:?})",
                    r.node(),
                    x.step_limits
                );
                ready.push((r, x.ranks));
            }
            let (cfg, step) = (source.config.clone(), p.step_limits);
            let parts = mla_cpu::group::group_parts(cfg, p.parallel, local, ready, cache, step, p.watchdog);
            Ok(Box::new(GroupBackend::new(parts)))
        }
    }
}

/// Waits for node 0's own ranks (starting on `local`) and every other node's, whichever fail
/// first: a node that fails before NCCL's setup ends would leave the others in it for good.
fn start_with(
    local: std::thread::JoinHandle<anyhow::Result<LocalRanks>>,
    mut remotes: Vec<RemoteNode>,
) -> anyhow::Result<(LocalRanks, Vec<(RemoteNode, NodeReady)>)> {
    let mut ready: Vec<Option<NodeReady>> = remotes.iter().map(|_| None).collect();
    let mut mine: Option<LocalRanks> = None;
    let mut local = Some(local);
    let mut last_note = Instant::now();
    loop {
        for (r, slot) in remotes.iter_mut().zip(&mut ready) {
            if slot.is_none() {
                *slot = r.try_ready(Duration::from_millis(50))?;
            }
        }
        if local.as_ref().is_some_and(|l| l.is_finished()) {
            let l = local.take().expect("checked");
            mine = Some(l.join().map_err(|_| anyhow::anyhow!("starting node 0's ranks panicked"))??);
        }
        if ready.iter().all(Option::is_some) {
            if let Some(mine) = mine {
                let ready = ready.into_iter().map(|x| x.expect("checked"));
                return Ok((mine, remotes.into_iter().zip(ready).collect()));
            }
        }
        if last_note.elapsed() > Duration::from_secs(30) {
            let waiting: Vec<usize> =
                remotes.iter().zip(&ready).filter(|(_, x)| x.is_none()).map(|(r, _)| r.node()).collect();
            let own = if mine.is_some() { "" } else { " and node 0's own" };
            tracing::info!("starting the ranks; waiting for node(s) {waiting:?}{own}");
            last_note = Instant::now();
        }
    }
}

/// The IP node 0 listens on (its `--dist-init-addr`), where the CPU collective hub listens too.
fn rendezvous_ip(addr: &str) -> anyhow::Result<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let a = addr.to_socket_addrs().with_context(|| format!("--dist-init-addr {addr}"))?.next();
    Ok(a.with_context(|| format!("--dist-init-addr {addr} resolves to no address"))?.ip())
}

/// Any node but 0: meets node 0, starts this node's ranks and serves them until node 0 stops
/// (`Ok`) or the group fails (`Err`).
pub fn serve_as_other_node(
    args: &Args,
    source: &ModelSource,
    device: Device,
    cuda: mla_cuda::CudaOptions,
    cache: Option<CacheLayout>,
) -> anyhow::Result<()> {
    let p = Plan::new(args, source, device, cache)?;
    let (mut link, bootstrap) = rendezvous::follow(&p.addr, &p.hello, p.timeout)?;
    let ranks = p.my_ranks();
    tracing::info!("node {} of {}: ranks {ranks:?} for node 0 at {}", args.node_rank, args.nnodes, p.addr);
    let first = ranks.start;
    let started: anyhow::Result<()> = (|| match device {
        Device::Cuda => {
            let id = NcclId::from_bytes(&bootstrap)?;
            let group = p.group(Arc::new(NcclConnector { id }));
            let local = mla_cuda::group::start_ranks(&source.config, &source.cuda_weights(), &cuda, &group, ranks)?;
            serve_node(link.try_clone()?, local.threads, first, local.aborters, local.ready, p.watchdog)
        }
        _ => {
            let cache = cache.context("the CPU cache is sized before the ranks start")?;
            let hub: std::net::SocketAddr =
                String::from_utf8_lossy(&bootstrap).parse().context("node 0's hub address")?;
            let threads = cpu_ranks(source, &p, hub, cache)?;
            let ready = NodeReady {
                ranks: threads.len(),
                cache,
                graph_batches: vec![],
                step_limits: p.step_limits,
                describe: "cpu".into(),
            };
            serve_node(link.try_clone()?, threads, first, vec![], ready, p.watchdog)
        }
    })();
    if let Err(e) = &started {
        // Tell node 0 why, in case the failure came before this node was ready.
        let _ = link.send(&FromNode::Failed(format!("node {}: {e:#}", args.node_rank)));
    }
    started
}
