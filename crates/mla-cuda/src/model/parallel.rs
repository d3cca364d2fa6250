//! How one rank's forward pass meets the other ranks of its group. Each mode owns its
//! collective's buffers and issues its collectives; the forward pass only asks it what to add to
//! the residual after attention (`attention_output`) and runs the FFN through it (`ffn`).
//!
//! - `Single`: the whole model on one device, no collective.
//! - `TensorParallel`: every rank runs the same rows with its share of the heads and FFN widths;
//!   the bf16 partial outputs of attention and FFN are widened and all-reduced in f32.
//! - `DpAttention`: the whole attention for the rank's own rows; before each FFN every rank's
//!   normed rows are all-gathered, the FFN runs with the rank's share of the widths over all of
//!   them, and a reduce-scatter returns the sums for the rank's own rows (in f32 for graph
//!   steps, in bf16 for eager ones: `PACKED_REDUCE_ENV`).
//!
//! Every rank of a group issues the same collectives in the same order with the same sizes,
//! idle DP-attention ranks included (`CudaModel::queue_idle`): a rank that skipped one would
//! leave the others waiting in it.
//!
//! This is the only module of the CUDA backend that calls a collective: the step's, and at
//! start the first collectives of a new communicator (`RankLink::joined`) and the agreements
//! on the step budget and the KV cache size (`min_over_ranks`).

use super::workspace::Limits;
use crate::device::Device;
use crate::gpu::nccl::NcclComm;
use crate::gpu::{DSlice, DeviceBuffer};
use crate::ops::NormDelta;
use half::bf16;

/// The collective a rank joined, before its buffers exist (the worker connects it; the memory
/// planner uses it to agree with the other ranks, then `RankMode::new` gives it its buffers).
pub enum RankLink {
    Single,
    TensorParallel(NcclComm),
    DpAttention(NcclComm),
}

impl RankLink {
    /// The link of a rank that joined a group over `comm`. NCCL sets up its buffers at a
    /// communicator's first collectives: each kind runs once here, so the memory they take is
    /// gone before the memory plan sizes the KV cache.
    pub fn joined(dev: &Device, comm: NcclComm, dp_attention: bool) -> anyhow::Result<RankLink> {
        warm_up(dev, &comm)?;
        Ok(if dp_attention { RankLink::DpAttention(comm) } else { RankLink::TensorParallel(comm) })
    }

    /// The smallest `value` over the group's ranks (`value` itself on one device).
    pub fn min_over_ranks(&self, dev: &Device, value: usize) -> anyhow::Result<usize> {
        self.comm().map_or(Ok(value), |comm| min_over(dev, comm, value))
    }

    pub fn comm(&self) -> Option<&NcclComm> {
        match self {
            RankLink::Single => None,
            RankLink::TensorParallel(c) | RankLink::DpAttention(c) => Some(c),
        }
    }

    /// Bytes of the buffers `RankMode::new` allocates for steps within `limits`, so the memory
    /// planner can count them before it sizes the KV cache from what is left.
    pub fn buffer_bytes(&self, limits: &Limits, hidden: usize) -> usize {
        let (t, f) = (limits.max_tokens, limits.ffn_rows);
        let (b16, b32) = (std::mem::size_of::<bf16>(), std::mem::size_of::<f32>());
        match self {
            RankLink::Single => 0,
            // delta_f32, ffn_f32
            RankLink::TensorParallel(_) => 2 * t * hidden * b32,
            // h_all, ffn_all, ffn_all_f32, ffn_f32
            RankLink::DpAttention(_) => f * hidden * (2 * b16 + b32) + t * hidden * b32,
        }
    }

    /// Ranks whose rows the FFN runs over together (`mla_core::StepLimits::gathered_ranks`).
    pub fn gathered_ranks(&self) -> usize {
        match self {
            RankLink::DpAttention(c) => c.world(),
            _ => 1,
        }
    }
}

/// A rank's mode with its buffers.
pub enum RankMode {
    Single,
    TensorParallel(TensorParallel),
    DpAttention(DpAttention),
}

/// Tensor parallel: the f32 sums of the ranks' attention and FFN partial outputs.
pub struct TensorParallel {
    comm: NcclComm,
    delta_f32: DeviceBuffer<f32>,
    ffn_f32: DeviceBuffer<f32>,
}

/// DP attention: every rank's normed rows gathered for the FFN, the FFN's partial output over
/// all of them (bf16 and widened), and this rank's rows of the reduced sum.
pub struct DpAttention {
    comm: NcclComm,
    h_all: DeviceBuffer<bf16>,
    ffn_all: DeviceBuffer<bf16>,
    ffn_all_f32: DeviceBuffer<f32>,
    ffn_f32: DeviceBuffer<f32>,
    /// Reduce eager steps' FFN outputs in bf16 (`PACKED_REDUCE_ENV`; the default).
    bf16_packed_reduce: bool,
}

/// The FFN outputs of eager DP-attention steps (prefill and mixed steps, whose rows are packed)
/// are reduced in bf16: half the bytes of the step's largest collective for one more bf16
/// rounding per peer, as vLLM and SGLang reduce in the model's dtype. Measured on H100s
/// (runs Q1, Q2, 2026-11-27), V2-Lite serving 1024/256: +2% output tok/s on two GPUs, +11% on
/// four (29,342 against 26,363 with f32); the HF fixtures' greedy outputs through the server
/// under DP attention stayed equal to HF's. Graph steps keep f32 (small and latency-bound, bytes do not matter there).
/// `MLA_DPA_PACKED_REDUCE=f32` restores f32 for A/B runs; anything but `f32` or `bf16` is refused.
pub const PACKED_REDUCE_ENV: &str = "MLA_DPA_PACKED_REDUCE";

fn bf16_packed_reduce() -> anyhow::Result<bool> {
    match std::env::var(PACKED_REDUCE_ENV).as_deref() {
        Ok("f32") => Ok(false),
        Err(_) | Ok("bf16") => Ok(true),
        Ok(other) => anyhow::bail!("{PACKED_REDUCE_ENV}={other}: expected f32 or bf16"),
    }
}

/// How a DP-attention step's FFN collectives lay out the ranks' rows.
#[derive(Debug, Clone, Copy)]
pub enum FfnRows<'a> {
    /// Every rank sends this many rows (its own, then padding): graph replays, whose collective
    /// sizes are fixed at capture.
    Padded(usize),
    /// Rank r sends `counts[r]` rows, packed without padding: eager steps, where ranks may feed
    /// very different numbers of tokens (one prefills while another decodes).
    Packed(&'a [usize]),
}

/// What the FFN of one layer reads and writes on this rank: its normed input rows and the
/// bf16 output the single-device path adds to the residual.
pub struct FfnIo<'a> {
    pub h: DSlice<'a, bf16>,
    pub out: DSlice<'a, bf16>,
    /// This rank's rows.
    pub rows: usize,
    pub hidden: usize,
}

impl RankMode {
    /// `link` with the buffers its collectives need for steps within `limits`.
    /// (`RankLink::buffer_bytes` counts what this allocates: keep the two alike.)
    pub fn new(link: RankLink, limits: &Limits, hidden: usize) -> anyhow::Result<Self> {
        let (t, f) = (limits.max_tokens, limits.ffn_rows);
        Ok(match link {
            RankLink::Single => RankMode::Single,
            RankLink::TensorParallel(comm) => RankMode::TensorParallel(TensorParallel {
                comm,
                delta_f32: DeviceBuffer::alloc(t * hidden)?,
                ffn_f32: DeviceBuffer::alloc(t * hidden)?,
            }),
            RankLink::DpAttention(comm) => RankMode::DpAttention(DpAttention {
                comm,
                h_all: DeviceBuffer::alloc(f * hidden)?,
                ffn_all: DeviceBuffer::alloc(f * hidden)?,
                ffn_all_f32: DeviceBuffer::alloc(f * hidden)?,
                ffn_f32: DeviceBuffer::alloc(t * hidden)?,
                bf16_packed_reduce: bf16_packed_reduce()?,
            }),
        })
    }

    /// The smallest `value` over the group's ranks (`value` itself on one device).
    pub fn min_over_ranks(&self, dev: &Device, value: usize) -> anyhow::Result<usize> {
        self.comm().map_or(Ok(value), |comm| min_over(dev, comm, value))
    }

    pub fn comm(&self) -> Option<&NcclComm> {
        match self {
            RankMode::Single => None,
            RankMode::TensorParallel(m) => Some(&m.comm),
            RankMode::DpAttention(m) => Some(&m.comm),
        }
    }

    pub fn is_dp_attention(&self) -> bool {
        matches!(self, RankMode::DpAttention(_))
    }

    /// What attention adds to the residual: this rank's bf16 `delta`, or under tensor
    /// parallelism the f32 sum of every rank's partial `delta` over `t` rows.
    pub fn attention_output<'a>(
        &'a self,
        dev: &Device,
        delta: DSlice<'a, bf16>,
        t: usize,
        hidden: usize,
    ) -> anyhow::Result<NormDelta<'a>> {
        match self {
            RankMode::TensorParallel(tp) => tp.all_reduce(dev, delta, &tp.delta_f32, t * hidden),
            RankMode::Single | RankMode::DpAttention(_) => Ok(NormDelta::Bf16(delta)),
        }
    }

    /// One layer's FFN with the collectives around it: `run(x, rows, out)` computes this rank's
    /// share of the FFN over `rows` rows of `x`. Returns what to add to the residual.
    pub fn ffn<'a>(
        &'a self,
        dev: &Device,
        io: FfnIo<'a>,
        rows: FfnRows,
        run: impl FnOnce(DSlice<bf16>, usize, DSlice<bf16>) -> anyhow::Result<()>,
    ) -> anyhow::Result<NormDelta<'a>> {
        match self {
            RankMode::Single => {
                run(io.h, io.rows, io.out)?;
                Ok(NormDelta::Bf16(io.out))
            }
            RankMode::TensorParallel(tp) => {
                run(io.h, io.rows, io.out)?;
                tp.all_reduce(dev, io.out, &tp.ffn_f32, io.rows * io.hidden)
            }
            RankMode::DpAttention(dpa) => dpa.ffn(dev, io, rows, run),
        }
    }
}

impl TensorParallel {
    /// `sum = Σ_ranks f32(partial)` over `n` values, in `sum`'s buffer.
    fn all_reduce<'a>(
        &self,
        dev: &Device,
        partial: DSlice<bf16>,
        sum: &'a DeviceBuffer<f32>,
        n: usize,
    ) -> anyhow::Result<NormDelta<'a>> {
        let sum = sum.sub(0, n);
        dev.k.elementwise.bf16_to_f32(dev.stream(), partial.sub(0, n), sum, n)?;
        self.comm.all_reduce_sum_f32(sum, dev.stream())?;
        Ok(NormDelta::F32(sum))
    }
}

impl DpAttention {
    fn ffn<'a>(
        &'a self,
        dev: &Device,
        io: FfnIo<'a>,
        rows: FfnRows,
        run: impl FnOnce(DSlice<bf16>, usize, DSlice<bf16>) -> anyhow::Result<()>,
    ) -> anyhow::Result<NormDelta<'a>> {
        let (s, comm, hidden) = (dev.stream(), &self.comm, io.hidden);
        let (rank, world) = (comm.rank(), comm.world());
        // Elements each rank sends: padded to one size, or its own rows packed.
        let elems: Vec<usize> = match rows {
            FfnRows::Padded(r) => vec![r * hidden; world],
            FfnRows::Packed(counts) => counts.iter().map(|c| c * hidden).collect(),
        };
        let (mine, all) = (elems[rank], elems.iter().sum::<usize>());
        let (h_all, ffn_all, ffn_all_f32) =
            (self.h_all.sub(0, all), self.ffn_all.sub(0, all), self.ffn_all_f32.sub(0, all));
        let ffn_f32 = self.ffn_f32.sub(0, mine);
        match rows {
            FfnRows::Padded(_) => comm.all_gather_bf16(io.h.sub(0, mine), h_all, s)?,
            FfnRows::Packed(_) => comm.all_gather_v_bf16(io.h.sub(0, mine), h_all, &elems, s)?,
        }
        run(h_all, all / hidden, ffn_all)?;
        if self.bf16_packed_reduce && matches!(rows, FfnRows::Packed(_)) {
            // The sums land in this rank's rows of the gathered output, which nothing reads again.
            let mine_bf16 = ffn_all.sub(elems[..rank].iter().sum(), mine);
            comm.reduce_scatter_v_sum(ffn_all, mine_bf16, &elems, s)?;
            return Ok(NormDelta::Bf16(mine_bf16));
        }
        dev.k.elementwise.bf16_to_f32(s, ffn_all, ffn_all_f32, all)?;
        match rows {
            FfnRows::Padded(_) => comm.reduce_scatter_sum_f32(ffn_all_f32, ffn_f32, s)?,
            FfnRows::Packed(_) => comm.reduce_scatter_v_sum(ffn_all_f32, ffn_f32, &elems, s)?,
        }
        Ok(NormDelta::F32(ffn_f32))
    }
}

/// The smallest `value` over the ranks of `comm` (an NCCL min all-reduce, waited for).
fn min_over(dev: &Device, comm: &NcclComm, value: usize) -> anyhow::Result<usize> {
    // f32 holds the counts exactly (up to 2^24: blocks and token budgets are far below).
    let buf = DeviceBuffer::from_host(&[value as f32])?;
    comm.all_reduce_min_f32(buf.slice(), dev.stream())?;
    dev.gpu.sync()?;
    Ok(buf.download()?[0] as usize)
}

/// One small collective of each kind the forward pass issues, waited for.
fn warm_up(dev: &Device, comm: &NcclComm) -> anyhow::Result<()> {
    let world = comm.world();
    // Separate input and output buffers: NCCL's in-place forms need rank-dependent offsets.
    let (f_all, f_one) = (DeviceBuffer::<f32>::alloc_zeroed(world * 256)?, DeviceBuffer::<f32>::alloc_zeroed(256)?);
    let (b_all, b_one) = (DeviceBuffer::<bf16>::alloc_zeroed(world * 256)?, DeviceBuffer::<bf16>::alloc_zeroed(256)?);
    let s = dev.stream();
    comm.all_reduce_sum_f32(f_one.slice(), s)?;
    comm.all_gather_bf16(b_one.slice(), b_all.slice(), s)?;
    comm.reduce_scatter_sum_f32(f_all.slice(), f_one.slice(), s)?;
    dev.gpu.sync()?;
    Ok(())
}
