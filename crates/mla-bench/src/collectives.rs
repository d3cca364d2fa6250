//! `mla-bench collectives`: NCCL latency and bandwidth at the sizes the multi-GPU steps move, one
//! thread per GPU, each collective timed as eager launches and as the same launches replayed from
//! one CUDA graph (decode steps run from graphs, prefill steps eagerly).
//!
//! What a step moves, per layer, for `rows` tokens on a rank and the model's hidden size:
//! - tensor parallelism all-reduces the f32 residual delta twice (after the attention output
//!   projection and after the FFN): rows × hidden × 4 bytes, in place;
//! - DP attention all-gathers every rank's bf16 FFN input (rows × hidden × 2 bytes from each rank)
//!   and reduce-scatters the f32 FFN output back; graph steps pad every rank to the largest
//!   (`all_gather`, `reduce_scatter`), eager steps pack the real counts (`all_gather_v`,
//!   `reduce_scatter_v`: grouped broadcasts and reduces).
//!
//! Bandwidths follow nccl-tests: algorithm bandwidth = bytes / time, where bytes is the all-reduce
//! buffer or the gathered (scattered) whole; bus bandwidth scales it by 2(n-1)/n for all-reduce and
//! (n-1)/n for the others, so it compares with the link's speed whatever n is.

use crate::report;
use half::bf16;
use mla_cuda::gpu::nccl::{NcclComm, NcclId};
use mla_cuda::gpu::{DSlice, DeviceBuffer, Event, Gpu, Graph};
use serde::Serialize;
use serde_json::{json, Value};
use std::sync::{mpsc, Arc, Barrier};

pub struct CollectiveArgs {
    pub gpus: usize,
    pub hidden: usize,
    /// Rows (tokens) per rank, one case each.
    pub rows: Vec<usize>,
    /// Collectives per timed batch (and per captured graph).
    pub iters: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    /// TP: in place, rows × hidden f32.
    AllReduce,
    /// DP attention, graph steps: rows × hidden bf16 from every rank.
    AllGather,
    /// DP attention, graph steps: n × rows × hidden f32 in, rows × hidden out.
    ReduceScatter,
    /// DP attention, eager steps: the packed gather (one grouped broadcast per rank).
    AllGatherV,
    /// DP attention, eager steps: the packed reduce-scatter (one grouped reduce per rank).
    ReduceScatterV,
    /// The same in bf16: half the bytes, NCCL adding in bf16.
    ReduceScatterVBf16,
}

const OPS: [Op; 6] =
    [Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::AllGatherV, Op::ReduceScatterV, Op::ReduceScatterVBf16];

impl Op {
    /// Bytes of the whole the bandwidths are computed from.
    fn bytes(self, rows: usize, hidden: usize, n: usize) -> usize {
        match self {
            Op::AllReduce => rows * hidden * 4,
            Op::AllGather | Op::AllGatherV | Op::ReduceScatterVBf16 => n * rows * hidden * 2,
            Op::ReduceScatter | Op::ReduceScatterV => n * rows * hidden * 4,
        }
    }

    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }
}

/// One rank's buffers for one size: big enough for every op.
struct Buffers {
    f32_in: DeviceBuffer<f32>,
    f32_out: DeviceBuffer<f32>,
    bf16_in: DeviceBuffer<bf16>,
    bf16_out: DeviceBuffer<bf16>,
}

/// Microseconds per collective on one rank.
struct Timing {
    op: Op,
    rows: usize,
    eager_us: f64,
    graph_us: f64,
}

pub fn run(args: &CollectiveArgs) -> anyhow::Result<Value> {
    anyhow::ensure!(
        args.gpus >= 1 && args.iters >= 1 && !args.rows.is_empty(),
        "--gpus, --iters and --rows must be set"
    );
    let id = NcclId::new()?;
    let barrier = Arc::new(Barrier::new(args.gpus));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..args.gpus)
        .map(|rank| {
            let (barrier, tx, rows) = (barrier.clone(), tx.clone(), args.rows.clone());
            let (n, hidden, iters) = (args.gpus, args.hidden, args.iters);
            std::thread::spawn(move || -> anyhow::Result<String> {
                let gpu = Gpu::new(rank)?;
                let comm = NcclComm::init_rank(&id, rank, n)?;
                for &r in &rows {
                    for t in time_size(&gpu, &comm, &barrier, r, hidden, iters)? {
                        tx.send((rank, t)).ok();
                    }
                }
                Ok(gpu.info.name.clone())
            })
        })
        .collect();
    drop(tx);
    let timings: Vec<(usize, Timing)> = rx.iter().collect();
    let mut gpu_name = String::from("unknown");
    for t in threads {
        gpu_name = t.join().map_err(|_| anyhow::anyhow!("a rank thread panicked"))??;
    }
    let mut cases = Vec::new();
    eprintln!(
        "{:<16} {:>6} {:>11} {:>10} {:>10} {:>13} {:>13}",
        "op", "rows", "bytes", "eager us", "graph us", "bus GB/s eag", "bus GB/s gr"
    );
    for &rows in &args.rows {
        for op in OPS {
            // A collective ends when its slowest rank does.
            let of_case = || timings.iter().filter(|(_, t)| t.op == op && t.rows == rows).map(|(_, t)| t);
            let eager = of_case().map(|t| t.eager_us).fold(0.0, f64::max);
            let graph = of_case().map(|t| t.graph_us).fold(0.0, f64::max);
            let bytes = op.bytes(rows, args.hidden, args.gpus);
            let bus = |us: f64| bytes as f64 / (us * 1e-6) / 1e9 * op.bus_factor(args.gpus);
            eprintln!(
                "{:<16} {rows:>6} {bytes:>11} {eager:>10.1} {graph:>10.1} {:>13.1} {:>13.1}",
                format!("{op:?}"),
                bus(eager),
                bus(graph)
            );
            cases.push(json!({
                "op": op, "rows_per_rank": rows, "bytes": bytes, "eager_us": eager, "graph_us": graph,
                "bus_gbps_eager": bus(eager), "bus_gbps_graph": bus(graph),
            }));
        }
    }
    let nccl = mla_cuda::gpu::nccl::describe().unwrap_or_else(|e| format!("{e:#}"));
    let results = json!({
        "gpus": args.gpus, "hidden": args.hidden, "iters": args.iters, "nccl": nccl,
        "nvls_enable": std::env::var("NCCL_NVLS_ENABLE").ok(), "cases": cases,
    });
    Ok(report::envelope(&format!("{gpu_name} x{}", args.gpus), results))
}

fn time_size(
    gpu: &Gpu,
    comm: &NcclComm,
    barrier: &Barrier,
    rows: usize,
    hidden: usize,
    iters: usize,
) -> anyhow::Result<Vec<Timing>> {
    let (n, chunk) = (comm.world(), rows * hidden);
    let b = Buffers {
        f32_in: DeviceBuffer::alloc_zeroed(n * chunk)?,
        f32_out: DeviceBuffer::alloc_zeroed(n * chunk)?,
        bf16_in: DeviceBuffer::alloc_zeroed(chunk)?,
        bf16_out: DeviceBuffer::alloc_zeroed(n * chunk)?,
    };
    let counts = vec![chunk; n];
    let s = gpu.stream();
    let launch = |op: Op| -> anyhow::Result<()> {
        let (fin, fout, bin, bout) = (b.f32_in.slice(), b.f32_out.slice(), b.bf16_in.slice(), b.bf16_out.slice());
        let mine: DSlice<f32> = fout.sub(0, chunk);
        match op {
            Op::AllReduce => comm.all_reduce_sum_f32(fin.sub(0, chunk), s),
            Op::AllGather => comm.all_gather_bf16(bin, bout, s),
            Op::ReduceScatter => comm.reduce_scatter_sum_f32(fin, mine, s),
            Op::AllGatherV => comm.all_gather_v_bf16(bin, bout, &counts, s),
            Op::ReduceScatterV => comm.reduce_scatter_v_sum(fin, mine, &counts, s),
            Op::ReduceScatterVBf16 => comm.reduce_scatter_v_sum(bout, bin, &counts, s),
        }
    };
    let (start, end) = (Event::new()?, Event::new()?);
    let mut out = Vec::new();
    for op in OPS {
        // Eager: a warm-up, then `iters` launches between two events, every rank starting together.
        launch(op)?;
        gpu.sync()?;
        barrier.wait();
        start.record(s)?;
        for _ in 0..iters {
            launch(op)?;
        }
        end.record(s)?;
        let eager_us = start.elapsed_ms(&end)? as f64 * 1e3 / iters as f64;
        // Graph: the same launches captured once, replayed (after one warm-up replay) three times.
        let graph = Graph::capture(s, || (0..iters).try_for_each(|_| launch(op)))?;
        graph.launch(s)?;
        gpu.sync()?;
        barrier.wait();
        start.record(s)?;
        for _ in 0..3 {
            graph.launch(s)?;
        }
        end.record(s)?;
        let graph_us = start.elapsed_ms(&end)? as f64 * 1e3 / (3 * iters) as f64;
        out.push(Timing { op, rows, eager_us, graph_us });
    }
    gpu.sync()?;
    Ok(out)
}
