//! Model weights in device memory, laid out for the kernels: gate and up projections fused into
//! one `[2I, H]` matrix, routed experts stacked into `[E, 2I, H]` and `[E, H, I]` for the grouped
//! GEMM. bf16, except the router and the noaux_tc bias in f32 (HF computes routing in f32) and,
//! when the config has a block-FP8 `quantization` (DeepSeek-V3/R1 checkpoints, or
//! `--quantization fp8`), the linear weights in block-FP8: e4m3 bytes with one f32 scale per
//! 128x128 block, as the checkpoint stores them (issue 12). `kv_b_proj` stays bf16 (dequantized):
//! the absorbed attention reads it as W_UK and W_UV through batched bf16 GEMMs, and it is 1.4% of
//! V3's weight bytes. A matrix the FP8 kernels cannot take (a fused gate/up whose halves do not
//! end on a 128-row block, rows not a multiple of 16 bytes) stays bf16, as does a MoE layer any of
//! whose expert matrices cannot be FP8 (routed and shared experts share the small-step kernels).
//!
//! Three ways in: from any `WeightSource` (a checkpoint, whose FP8 tensors are copied as stored;
//! bf16 tensors of an FP8 model are quantized on the device, bit-exact with mla-core's quantizer),
//! or `--load-format dummy`, which draws random values on the device itself with the same per-role
//! distributions as mla-core's `DummyWeights` (a different random stream: device dummy weights are
//! for shapes and speed, not for comparisons), quantized the same way for FP8 models.

use crate::device::Device;
use crate::gpu::{DSlice, DeviceBuffer};
use crate::ops::{fp8_lt_scale_ld, ExpertMats, Fp8Linear, Linear, Normal, Proj, FP8_BLOCK};
use anyhow::Context;
use half::bf16;
use mla_core::model::config::{ModelConfig, TopkMethod};
use mla_core::model::dummy::{dummy_distribution, DummyWeights};
use mla_core::model::fp8_source::Fp8Quantized;
use mla_core::model::parallel::Shard;
use mla_core::model::weights::{FfnSpec, LayerSpec, MlpSpec, ModelSpec, MtpSpec, QuerySpec, TensorSpec};
use mla_core::{RankLayout, WeightSource};
use std::collections::HashMap;

/// A projection's weight `[out, inp]`.
pub struct Mat {
    pub data: MatData,
    pub out: usize,
    pub inp: usize,
}

pub enum MatData {
    Bf16(DeviceBuffer<bf16>),
    /// e4m3 bytes `[out, inp]` and the scale grid `[ceil(out / 128), ceil(inp / 128)]`;
    /// `lt_scales`, when the grid's rows need padding for cuBLASLt, a copy with rows of
    /// `fp8_lt_scale_ld(inp)` (filled once the weights are loaded).
    Fp8 {
        w: DeviceBuffer<u8>,
        scale_inv: DeviceBuffer<f32>,
        lt_scales: Option<DeviceBuffer<f32>>,
    },
}

impl Mat {
    fn alloc(out: usize, inp: usize) -> anyhow::Result<Self> {
        Ok(Mat { data: MatData::Bf16(DeviceBuffer::alloc(out * inp)?), out, inp })
    }

    /// FP8 when `fp8` and the FP8 kernels take the shape (see the module doc), else bf16.
    fn alloc_maybe_fp8(out: usize, inp: usize, fp8: bool) -> anyhow::Result<Self> {
        if !(fp8 && inp.is_multiple_of(16)) {
            return Self::alloc(out, inp);
        }
        let (rows, cols) = (out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK));
        let ld = fp8_lt_scale_ld(inp);
        // Zeros in the padding: cuBLASLt reads those scales but nothing they would scale.
        let lt_scales = (ld != cols).then(|| DeviceBuffer::from_host(&vec![0f32; rows * ld])).transpose()?;
        let data = MatData::Fp8 {
            w: DeviceBuffer::alloc(out * inp)?,
            scale_inv: DeviceBuffer::alloc(rows * cols)?,
            lt_scales,
        };
        Ok(Mat { data, out, inp })
    }

    /// Copies the loaded scale grid into its padded cuBLASLt copy, if it has one.
    fn fill_lt_scales(&self) -> anyhow::Result<()> {
        let MatData::Fp8 { scale_inv, lt_scales: Some(lt), .. } = &self.data else { return Ok(()) };
        let (cols, ld) = (self.inp.div_ceil(FP8_BLOCK), fp8_lt_scale_ld(self.inp));
        for r in 0..self.out.div_ceil(FP8_BLOCK) {
            // SAFETY: row r lies inside both buffers (sizes from the same shape at allocation).
            unsafe {
                cudarc::driver::result::memcpy_dtod_sync(
                    lt.ptr() + (r * ld * 4) as u64,
                    scale_inv.ptr() + (r * cols * 4) as u64,
                    cols * 4,
                )
            }
            .map_err(|e| anyhow::anyhow!("copying FP8 scales for cuBLASLt: {e:?}"))?;
        }
        Ok(crate::gpu::wait_for_legacy_copies()?)
    }

    /// The weight for `SmallLinear`, which picks the kernel by format.
    pub fn proj(&self) -> Proj<'_> {
        match &self.data {
            MatData::Bf16(b) => Proj::Bf16(Linear::new(b.slice(), self.out, self.inp)),
            MatData::Fp8 { w, scale_inv, lt_scales } => Proj::Fp8 {
                w: Fp8Linear { w: w.slice(), scale_inv: scale_inv.slice(), out: self.out, inp: self.inp },
                lt_scales: lt_scales.as_ref().unwrap_or(scale_inv).slice(),
            },
        }
    }

    /// The bf16 weight of a matrix that is never FP8 (embedding, head, `kv_b_proj`).
    pub fn lin(&self) -> Linear<'_> {
        match &self.data {
            MatData::Bf16(b) => Linear::new(b.slice(), self.out, self.inp),
            MatData::Fp8 { .. } => unreachable!("only projections are FP8, and they are read through proj()"),
        }
    }

    pub fn is_fp8(&self) -> bool {
        matches!(self.data, MatData::Fp8 { .. })
    }

    /// This matrix as a stack of one expert (the shared experts in the MoE kernels).
    pub fn expert_mats(&self) -> ExpertMats<'_> {
        match &self.data {
            MatData::Bf16(b) => ExpertMats::Bf16(b.slice()),
            MatData::Fp8 { w, scale_inv, .. } => ExpertMats::Fp8 { w: w.slice(), scale_inv: scale_inv.slice() },
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            MatData::Bf16(b) => b.bytes(),
            MatData::Fp8 { w, scale_inv, lt_scales } => {
                w.bytes() + scale_inv.bytes() + lt_scales.as_ref().map_or(0, |b| b.bytes())
            }
        }
    }

    /// Where the loader writes rows `rows` of this matrix (a half of a fused gate/up matrix, or
    /// all of it). FP8 halves start on a scale block (the allocation rule guarantees it).
    fn dest(&self, rows: std::ops::Range<usize>) -> Dest<'_> {
        match &self.data {
            MatData::Bf16(b) => Dest::Bf16(b.sub(rows.start * self.inp, rows.len() * self.inp)),
            MatData::Fp8 { w, scale_inv, .. } => {
                let gc = self.inp.div_ceil(FP8_BLOCK);
                let g = rows.start / FP8_BLOCK..rows.end.div_ceil(FP8_BLOCK);
                Dest::Fp8(Fp8Linear {
                    w: w.sub(rows.start * self.inp, rows.len() * self.inp),
                    scale_inv: scale_inv.sub(g.start * gc, g.len() * gc),
                    out: rows.len(),
                    inp: self.inp,
                })
            }
        }
    }
}

pub enum QueryWeights {
    Direct(Mat),
    LowRank { a: Mat, a_norm: DeviceBuffer<bf16>, b: Mat },
}

/// A SiLU MLP with gate and up fused: `gate_up [2I, H]`, `down [H, I]`.
pub struct MlpWeights {
    pub gate_up: Mat,
    pub down: Mat,
}

/// One layer's routed experts stacked `[E, n, k]`, in bf16 or block-FP8 (per-expert scale grids
/// stacked the same way).
pub enum ExpertStack {
    Bf16(DeviceBuffer<bf16>),
    Fp8 { w: DeviceBuffer<u8>, scale_inv: DeviceBuffer<f32> },
}

impl ExpertStack {
    fn alloc(experts: usize, n: usize, k: usize, fp8: bool) -> anyhow::Result<Self> {
        Ok(if fp8 {
            let grid = n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK);
            ExpertStack::Fp8 {
                w: DeviceBuffer::alloc(experts * n * k)?,
                scale_inv: DeviceBuffer::alloc(experts * grid)?,
            }
        } else {
            ExpertStack::Bf16(DeviceBuffer::alloc(experts * n * k)?)
        })
    }

    pub fn mats(&self) -> ExpertMats<'_> {
        match self {
            ExpertStack::Bf16(b) => ExpertMats::Bf16(b.slice()),
            ExpertStack::Fp8 { w, scale_inv } => ExpertMats::Fp8 { w: w.slice(), scale_inv: scale_inv.slice() },
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            ExpertStack::Bf16(b) => b.bytes(),
            ExpertStack::Fp8 { w, scale_inv } => w.bytes() + scale_inv.bytes(),
        }
    }

    /// Rows `rows` of expert `e` of a stack of `[n, k]` matrices (see `Mat::dest`).
    fn dest(&self, e: usize, n: usize, k: usize, rows: std::ops::Range<usize>) -> Dest<'_> {
        match self {
            ExpertStack::Bf16(b) => Dest::Bf16(b.sub((e * n + rows.start) * k, rows.len() * k)),
            ExpertStack::Fp8 { w, scale_inv } => {
                let (gr, gc) = (n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK));
                let g = rows.start / FP8_BLOCK..rows.end.div_ceil(FP8_BLOCK);
                Dest::Fp8(Fp8Linear {
                    w: w.sub((e * n + rows.start) * k, rows.len() * k),
                    scale_inv: scale_inv.sub((e * gr + g.start) * gc, g.len() * gc),
                    out: rows.len(),
                    inp: k,
                })
            }
        }
    }
}

pub struct MoeWeights {
    pub router: DeviceBuffer<f32>,
    pub bias: Option<DeviceBuffer<f32>>,
    /// [E, 2I, H]
    pub gate_up: ExpertStack,
    /// [E, H, I]
    pub down: ExpertStack,
    pub shared: Option<MlpWeights>,
}

pub enum FfnWeights {
    Dense(MlpWeights),
    Moe(MoeWeights),
}

pub struct LayerWeights {
    pub input_norm: DeviceBuffer<bf16>,
    pub query: QueryWeights,
    pub kv_a: Mat,
    pub kv_a_norm: DeviceBuffer<bf16>,
    pub kv_b: Mat,
    pub o_proj: Mat,
    pub post_norm: DeviceBuffer<bf16>,
    pub ffn: FfnWeights,
}

pub struct DeviceWeights {
    pub embed: Mat,
    pub layers: Vec<LayerWeights>,
    pub norm: DeviceBuffer<bf16>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Mat>,
    /// The multi-token-prediction module, when speculative decoding is on.
    pub mtp: Option<MtpLayerWeights>,
}

/// The MTP module (`mla_core::MtpSpec`): `eh_proj` is kept as its two column halves, so that
/// `eh_proj · [enorm(e); hnorm(h)]` is two projections summed into the residual and the
/// concatenation never exists (docs/speculative-decoding.md).
pub struct MtpLayerWeights {
    pub enorm: DeviceBuffer<bf16>,
    pub hnorm: DeviceBuffer<bf16>,
    /// `eh_proj[:, ..hidden]`, which takes the normed embedding.
    pub eh_embed: Mat,
    /// `eh_proj[:, hidden..]`, which takes the normed hidden state.
    pub eh_hidden: Mat,
    pub layer: LayerWeights,
    pub shared_head_norm: DeviceBuffer<bf16>,
}

/// How much of the weights is block-FP8, for the startup log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Share {
    /// FP8 matrices (an expert stack counts once per expert).
    pub matrices: usize,
    /// Their bytes, scales included.
    pub bytes: usize,
    /// Elements of the largest FP8 projection outside the experts (the dequantize scratch).
    pub largest_projection: usize,
    /// Widest input of those projections (the quantized-activation scratch).
    pub widest_input: usize,
    /// MoE layers whose expert stacks are FP8 (the grouped GEMMs' W8A8 scratch).
    pub expert_layers: usize,
}

impl DeviceWeights {
    pub fn output_projection(&self) -> Linear<'_> {
        self.lm_head.as_ref().unwrap_or(&self.embed).lin()
    }

    /// The decoder layers, the MTP module's included.
    fn all_layers(&self) -> impl Iterator<Item = &LayerWeights> {
        self.layers.iter().chain(self.mtp.as_ref().map(|m| &m.layer))
    }

    /// Every projection matrix outside the expert stacks.
    fn mats(&self) -> Vec<&Mat> {
        let mut v = vec![&self.embed];
        v.extend(&self.lm_head);
        if let Some(m) = &self.mtp {
            v.extend([&m.eh_embed, &m.eh_hidden]);
        }
        for l in self.all_layers() {
            match &l.query {
                QueryWeights::Direct(m) => v.push(m),
                QueryWeights::LowRank { a, b, .. } => v.extend([a, b]),
            }
            v.extend([&l.kv_a, &l.kv_b, &l.o_proj]);
            let mlp = match &l.ffn {
                FfnWeights::Dense(m) => Some(m),
                FfnWeights::Moe(m) => m.shared.as_ref(),
            };
            if let Some(m) = mlp {
                v.extend([&m.gate_up, &m.down]);
            }
        }
        v
    }

    fn stacks(&self) -> impl Iterator<Item = &ExpertStack> {
        self.all_layers().flat_map(|l| match &l.ffn {
            FfnWeights::Moe(m) => vec![&m.gate_up, &m.down],
            FfnWeights::Dense(_) => vec![],
        })
    }

    /// Bytes of device memory the weights occupy.
    pub fn bytes(&self) -> usize {
        let mut n = self.norm.bytes();
        n += self.mats().iter().map(|m| m.bytes()).sum::<usize>();
        n += self.stacks().map(|s| s.bytes()).sum::<usize>();
        if let Some(m) = &self.mtp {
            n += m.enorm.bytes() + m.hnorm.bytes() + m.shared_head_norm.bytes();
        }
        for l in self.all_layers() {
            n += l.input_norm.bytes() + l.kv_a_norm.bytes() + l.post_norm.bytes();
            if let QueryWeights::LowRank { a_norm, .. } = &l.query {
                n += a_norm.bytes();
            }
            if let FfnWeights::Moe(m) = &l.ffn {
                n += m.router.bytes() + m.bias.as_ref().map_or(0, |b| b.bytes());
            }
        }
        n
    }

    /// Fills the padded cuBLASLt copies of the projections' scale grids.
    fn finish_fp8(&self) -> anyhow::Result<()> {
        self.mats().into_iter().try_for_each(Mat::fill_lt_scales)
    }

    /// How much is FP8 (all zero for a bf16 model).
    pub fn fp8_share(&self) -> Fp8Share {
        let mut s = Fp8Share::default();
        for m in self.mats().into_iter().filter(|m| m.is_fp8()) {
            s.matrices += 1;
            s.bytes += m.bytes();
            s.largest_projection = s.largest_projection.max(m.out * m.inp);
            s.widest_input = s.widest_input.max(m.inp);
        }
        for l in self.all_layers() {
            if let FfnWeights::Moe(m) = &l.ffn {
                if let ExpertStack::Fp8 { .. } = m.gate_up {
                    // gate, up and down of every expert (the router is [E, H]).
                    s.matrices += 3 * m.router.len() / self.norm.len();
                    s.expert_layers += 1;
                    s.bytes += m.gate_up.bytes() + m.down.bytes();
                }
            }
        }
        s
    }

    /// Allocates (uninitialised) device memory for every tensor of `cfg`, a rank's own config
    /// under `layout`. A matrix a rank holds a cut of is FP8 only when the cut falls on scale
    /// blocks (its local width along the cut a multiple of 128), so that the checkpoint's FP8
    /// blocks stay whole; V3's shares under TP8 all do.
    fn alloc(cfg: &ModelConfig, layout: RankLayout, mtp: bool) -> anyhow::Result<Self> {
        let h = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let fp8 = cfg.quantization.is_some();
        let on_blocks = |n: usize| n.is_multiple_of(FP8_BLOCK);
        let (ffn_cut, attn_cut) = (layout.world > 1, layout.world > 1 && !layout.dp_attention);
        // A fused gate/up matrix is FP8 only when its up half starts on a scale block.
        let mlp_fp8 = |inter: usize| fp8 && on_blocks(inter) && h.is_multiple_of(16);
        let mlp = |inter: usize, fp8: bool| -> anyhow::Result<MlpWeights> {
            Ok(MlpWeights {
                gate_up: Mat::alloc_maybe_fp8(2 * inter, h, fp8 && mlp_fp8(inter))?,
                down: Mat::alloc_maybe_fp8(h, inter, fp8 && (!ffn_cut || on_blocks(inter)))?,
            })
        };
        // Attention projections cut by heads under TP: q / q_b by rows, o_proj by columns.
        let attn_fp8 = |cut_dim: usize| fp8 && (!attn_cut || on_blocks(cut_dim));
        let layer = |i: usize| -> anyhow::Result<LayerWeights> {
            let query = match cfg.q_lora_rank {
                None => QueryWeights::Direct(Mat::alloc_maybe_fp8(
                    heads * cfg.q_head_dim(),
                    h,
                    attn_fp8(heads * cfg.q_head_dim()),
                )?),
                Some(r) => QueryWeights::LowRank {
                    a: Mat::alloc_maybe_fp8(r, h, fp8)?,
                    a_norm: DeviceBuffer::alloc(r)?,
                    b: Mat::alloc_maybe_fp8(heads * cfg.q_head_dim(), r, attn_fp8(heads * cfg.q_head_dim()))?,
                },
            };
            let ffn = if cfg.is_moe_layer(i) {
                let (e, im) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
                let shared_i = (cfg.n_shared_experts > 0).then(|| cfg.shared_expert_intermediate_size());
                // Routed and shared experts run in the same small-step kernels: one format.
                let layer_fp8 = mlp_fp8(im) && shared_i.is_none_or(mlp_fp8);
                FfnWeights::Moe(MoeWeights {
                    router: DeviceBuffer::alloc(e * h)?,
                    bias: if cfg.topk_method == TopkMethod::NoauxTc { Some(DeviceBuffer::alloc(e)?) } else { None },
                    gate_up: ExpertStack::alloc(e, 2 * im, h, layer_fp8)?,
                    down: ExpertStack::alloc(e, h, im, layer_fp8)?,
                    shared: shared_i.map(|si| mlp(si, layer_fp8)).transpose()?,
                })
            } else {
                FfnWeights::Dense(mlp(cfg.intermediate_size, fp8)?)
            };
            Ok(LayerWeights {
                input_norm: DeviceBuffer::alloc(h)?,
                query,
                kv_a: Mat::alloc_maybe_fp8(cfg.kv_cache_dim(), h, fp8)?,
                kv_a_norm: DeviceBuffer::alloc(cfg.kv_lora_rank)?,
                kv_b: Mat::alloc(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)?,
                o_proj: Mat::alloc_maybe_fp8(h, heads * cfg.v_head_dim, attn_fp8(heads * cfg.v_head_dim))?,
                post_norm: DeviceBuffer::alloc(h)?,
                ffn,
            })
        };
        let layers = (0..cfg.num_hidden_layers).map(layer).collect::<anyhow::Result<Vec<_>>>()?;
        // The MTP module's decoder layer is shaped as layer `num_hidden_layers` would be; its
        // eh_proj is bf16 in the published checkpoints (and kept so here).
        let mtp = mtp
            .then(|| -> anyhow::Result<MtpLayerWeights> {
                Ok(MtpLayerWeights {
                    enorm: DeviceBuffer::alloc(h)?,
                    hnorm: DeviceBuffer::alloc(h)?,
                    eh_embed: Mat::alloc(h, h)?,
                    eh_hidden: Mat::alloc(h, h)?,
                    layer: layer(cfg.num_hidden_layers)?,
                    shared_head_norm: DeviceBuffer::alloc(h)?,
                })
            })
            .transpose()?;
        Ok(DeviceWeights {
            embed: Mat::alloc(cfg.vocab_size, h)?,
            layers,
            norm: DeviceBuffer::alloc(h)?,
            lm_head: if cfg.tie_word_embeddings { None } else { Some(Mat::alloc(cfg.vocab_size, h)?) },
            mtp,
        })
    }

    /// Where each tensor of the spec (and of the MTP module's, when loaded) lives on the device.
    fn destinations<'a>(&'a self, spec: &'a ModelSpec, mtp: Option<&'a MtpSpec>) -> Vec<Placement<'a>> {
        let mut out = vec![Placement::of(&spec.embed_tokens, self.embed.dest(0..self.embed.out))];
        for (ls, lw) in spec.layers.iter().zip(&self.layers) {
            self.layer_destinations(ls, lw, &mut out);
        }
        out.push(Placement::of(&spec.norm, Dest::Bf16(self.norm.slice())));
        if let (Some(s), Some(m)) = (&spec.lm_head, &self.lm_head) {
            out.push(Placement::of(s, m.dest(0..m.out)));
        }
        if let (Some(s), Some(w)) = (mtp, &self.mtp) {
            let h = self.norm.len();
            out.push(Placement::of(&s.enorm, Dest::Bf16(w.enorm.slice())));
            out.push(Placement::of(&s.hnorm, Dest::Bf16(w.hnorm.slice())));
            // eh_proj is replicated on every rank; its halves are read apart.
            for (m, cols) in [(&w.eh_embed, 0..h), (&w.eh_hidden, h..2 * h)] {
                out.push(Placement { spec: &s.eh_proj, dest: m.dest(0..m.out), part: Some(Shard::Cols(cols)) });
            }
            self.layer_destinations(&s.layer, &w.layer, &mut out);
            out.push(Placement::of(&s.shared_head_norm, Dest::Bf16(w.shared_head_norm.slice())));
        }
        out
    }

    fn layer_destinations<'a>(&'a self, ls: &'a LayerSpec, lw: &'a LayerWeights, out: &mut Vec<Placement<'a>>) {
        let mut put = |t: &'a TensorSpec, d: Dest<'a>| out.push(Placement::of(t, d));
        let whole = |m: &'a Mat| m.dest(0..m.out);
        let mlp = |put: &mut dyn FnMut(&'a TensorSpec, Dest<'a>), s: &'a MlpSpec, w: &'a MlpWeights| {
            let half = w.gate_up.out / 2;
            put(&s.gate_proj, w.gate_up.dest(0..half));
            put(&s.up_proj, w.gate_up.dest(half..2 * half));
            put(&s.down_proj, w.down.dest(0..w.down.out));
        };
        put(&ls.input_layernorm, Dest::Bf16(lw.input_norm.slice()));
        match (&ls.self_attn.query, &lw.query) {
            (QuerySpec::Direct { q_proj }, QueryWeights::Direct(m)) => put(q_proj, whole(m)),
            (QuerySpec::LowRank { q_a_proj, q_a_layernorm, q_b_proj }, QueryWeights::LowRank { a, a_norm, b }) => {
                put(q_a_proj, whole(a));
                put(q_a_layernorm, Dest::Bf16(a_norm.slice()));
                put(q_b_proj, whole(b));
            }
            _ => unreachable!("weights allocated from the same config as the spec"),
        }
        let a = &ls.self_attn;
        put(&a.kv_a_proj_with_mqa, whole(&lw.kv_a));
        put(&a.kv_a_layernorm, Dest::Bf16(lw.kv_a_norm.slice()));
        put(&a.kv_b_proj, whole(&lw.kv_b));
        put(&a.o_proj, whole(&lw.o_proj));
        put(&ls.post_attention_layernorm, Dest::Bf16(lw.post_norm.slice()));
        match (&ls.mlp, &lw.ffn) {
            (FfnSpec::Dense(s), FfnWeights::Dense(w)) => mlp(&mut put, s, w),
            (FfnSpec::Moe(s), FfnWeights::Moe(w)) => {
                put(&s.gate, Dest::F32(w.router.slice()));
                if let (Some(bs), Some(bw)) = (&s.e_score_correction_bias, &w.bias) {
                    put(bs, Dest::F32(bw.slice()));
                }
                let h = self.norm.len();
                let im = expert_width(s);
                for (e, es) in s.experts.iter().enumerate() {
                    put(&es.gate_proj, w.gate_up.dest(e, 2 * im, h, 0..im));
                    put(&es.up_proj, w.gate_up.dest(e, 2 * im, h, im..2 * im));
                    put(&es.down_proj, w.down.dest(e, h, im, 0..h));
                }
                if let (Some(ss), Some(sw)) = (&s.shared_experts, &w.shared) {
                    mlp(&mut put, ss, sw);
                }
            }
            _ => unreachable!("weights allocated from the same config as the spec"),
        }
    }

    /// Reads every tensor from `src` (converted to bf16 on the host) into device memory.
    pub fn load(cfg: &ModelConfig, src: &dyn WeightSource, dev: &Device) -> anyhow::Result<Self> {
        Self::load_rank(cfg, src, RankLayout::SINGLE, dev)
    }

    /// Rank `layout`'s share of `cfg`'s weights (`RankLayout::shard` of each tensor), laid out
    /// for its own config (`RankLayout::local_config`). FP8 tensors are copied as stored (their
    /// shards cut on scale blocks); bf16 tensors of FP8 matrices are quantized on the device.
    pub fn load_rank(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        layout: RankLayout,
        dev: &Device,
    ) -> anyhow::Result<Self> {
        Self::load_rank_with(cfg, src, layout, dev, false)
    }

    /// `load_rank`, with the MTP module when `mtp` (an error when the model has none).
    pub fn load_rank_with(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        layout: RankLayout,
        dev: &Device,
        mtp: bool,
    ) -> anyhow::Result<Self> {
        let local = layout.local_config(cfg);
        let (full_mtp, local_mtp) = (mtp_spec(cfg, mtp)?, mtp_spec(&local, mtp)?);
        let w = Self::alloc(&local, layout, mtp)?;
        let (full_spec, local_spec) = (ModelSpec::new(cfg), ModelSpec::new(&local));
        let mut full: HashMap<&str, &TensorSpec> =
            full_spec.tensors().into_iter().map(|t| (t.name.as_str(), t)).collect();
        full.extend(full_mtp.iter().flat_map(|m| m.tensors()).map(|t| (t.name.as_str(), t)));
        let dests = w.destinations(&local_spec, local_mtp.as_ref());
        let mut staging = Staging::new(&dests)?;
        // In an FP8 model every quantizable tensor is the dequantization of its FP8 form, also
        // where the GPU keeps it in bf16 (kv_b_proj, shapes the FP8 kernels cannot take): those
        // read through Fp8Quantized (stored FP8 passes through, bf16 is quantized on the host),
        // as the CPU reference reads them.
        let quantized = cfg.quantization.map(|q| Fp8Quantized::new(src, q.block));
        let bar = mla_core::model::weight_source::LoadProgress::new(dests.len(), "loading weights to the GPU");
        for Placement { spec: t, dest: d, part } in &dests {
            let f = full[t.name.as_str()];
            let part = part.clone().unwrap_or_else(|| layout.shard(f));
            let n: usize = part.shape(&f.shape).iter().product();
            anyhow::ensure!(n == d.len(), "{}: {n} elements in this rank's share, device slot {}", t.name, d.len());
            let reading = || format!("reading {}", t.name);
            match d {
                Dest::Bf16(s) => {
                    let reader: &dyn WeightSource = match &quantized {
                        Some(q) if f.fp8_quantizable() => q,
                        _ => src,
                    };
                    let bits = reader.read_bf16_bits_shard(f, &part).with_context(reading)?;
                    upload(s.cast::<u16>(), &bits)?;
                }
                Dest::F32(s) => {
                    let v = src.read_f32_shard(f, &part).with_context(reading)?;
                    upload(*s, &v)?;
                }
                Dest::Fp8(dst) => match src.read_fp8_shard(f, &part).with_context(reading)? {
                    Some(q) => {
                        anyhow::ensure!(
                            q.block == [FP8_BLOCK, FP8_BLOCK] && q.rows == dst.out && q.cols == dst.inp,
                            "{}: FP8 [{}, {}] in {:?} blocks; the kernels take [{}, {}] in 128x128 blocks",
                            t.name,
                            q.rows,
                            q.cols,
                            q.block,
                            dst.out,
                            dst.inp
                        );
                        upload(dst.w, &q.data)?;
                        upload(dst.scale_inv, &q.scale_inv)?;
                    }
                    None => {
                        // Quantizing a shard on the device equals cutting the quantized tensor
                        // only when the cut falls on scale blocks.
                        anyhow::ensure!(
                            part.on_blocks(&f.shape, FP8_BLOCK),
                            "{}: this rank's share {part:?} does not fall on 128x128 scale blocks, so it cannot be quantized to FP8 on its own; use another --tp",
                            t.name
                        );
                        let bits = src.read_bf16_bits_shard(f, &part).with_context(reading)?;
                        let buf = staging.take(bits.len())?;
                        upload(buf.cast::<u16>(), &bits)?;
                        dev.k
                            .fp8_convert
                            .quantize(dev.stream(), buf, dst)
                            .with_context(|| format!("quantizing {}", t.name))?;
                        // The staging buffer is reused by the next tensor.
                        dev.gpu.sync()?;
                    }
                },
            }
            bar.inc();
        }
        bar.finish();
        w.finish_fp8()?;
        Ok(w)
    }

    /// Random weights drawn on the device (`--load-format dummy`), for `cfg` as given (a rank
    /// passes its own local config: its shares are drawn like whole tensors of their shape, so a
    /// rank's dummy weights are not a cut of one model's, which nothing compares them with).
    /// FP8 matrices are drawn in bf16 and quantized.
    pub fn dummy(cfg: &ModelConfig, dev: &Device, seed: u64) -> anyhow::Result<Self> {
        Self::dummy_with(cfg, dev, seed, false)
    }

    /// `dummy`, with an MTP module when `mtp` (drafts from random weights are random: for
    /// timing the machinery, not for acceptance).
    pub fn dummy_with(cfg: &ModelConfig, dev: &Device, seed: u64, mtp: bool) -> anyhow::Result<Self> {
        let (k, stream) = (&dev.k, dev.stream());
        let mtp_spec = mtp_spec(cfg, mtp)?;
        let w = Self::alloc(cfg, RankLayout::SINGLE, mtp)?;
        let spec = ModelSpec::new(cfg);
        let source = DummyWeights::new(seed);
        let dests = w.destinations(&spec, mtp_spec.as_ref());
        let mut staging = Staging::new(&dests)?;
        for Placement { spec: t, dest: d, .. } in dests {
            let (mean, std) = dummy_distribution(t);
            let dist = Normal { mean, std, seed: source.tensor_seed(&t.name) };
            match d {
                Dest::Bf16(s) => k.elementwise.fill_normal_bf16(stream, s, dist)?,
                Dest::F32(s) => k.elementwise.fill_normal_f32(stream, s, dist)?,
                Dest::Fp8(dst) => {
                    let buf = staging.take(dst.out * dst.inp)?;
                    k.elementwise.fill_normal_bf16(stream, buf, dist)?;
                    k.fp8_convert.quantize(stream, buf, &dst)?;
                }
            }
        }
        dev.gpu.sync()?;
        w.finish_fp8()?;
        Ok(w)
    }
}

/// An expert's width (moe_intermediate_size of this rank) from its spec (`down_proj` is `[H, I]`).
fn expert_width(s: &mla_core::model::weights::MoeSpec) -> usize {
    s.experts[0].down_proj.shape[1]
}

/// The MTP module of `cfg` when `wanted`; an error when it is wanted and the model has none.
fn mtp_spec(cfg: &ModelConfig, wanted: bool) -> anyhow::Result<Option<MtpSpec>> {
    if !wanted {
        return Ok(None);
    }
    MtpSpec::new(cfg)
        .map(Some)
        .ok_or_else(|| anyhow::anyhow!("the model has no multi-token-prediction layer (num_nextn_predict_layers is 0)"))
}

/// One tensor's place on the device, and the part of it to read when that is not the rank's
/// share (`RankLayout::shard`).
struct Placement<'a> {
    spec: &'a TensorSpec,
    dest: Dest<'a>,
    part: Option<Shard>,
}

impl<'a> Placement<'a> {
    fn of(spec: &'a TensorSpec, dest: Dest<'a>) -> Self {
        Placement { spec, dest, part: None }
    }
}

#[derive(Clone, Copy)]
enum Dest<'a> {
    Bf16(DSlice<'a, bf16>),
    F32(DSlice<'a, f32>),
    Fp8(Fp8Linear<'a>),
}

impl Dest<'_> {
    fn len(&self) -> usize {
        match self {
            Dest::Bf16(s) => s.len,
            Dest::F32(s) => s.len,
            Dest::Fp8(f) => f.out * f.inp,
        }
    }
}

/// One bf16 buffer as large as the largest FP8 tensor, where bf16 values wait to be quantized.
struct Staging {
    buf: DeviceBuffer<bf16>,
}

impl Staging {
    fn new(dests: &[Placement]) -> anyhow::Result<Self> {
        let fp8 = dests.iter().filter(|p| matches!(p.dest, Dest::Fp8(_)));
        let most = fp8.map(|p| p.dest.len()).max().unwrap_or(0);
        Ok(Staging { buf: DeviceBuffer::alloc(most.max(1))? })
    }

    fn take(&mut self, n: usize) -> anyhow::Result<DSlice<'_, bf16>> {
        anyhow::ensure!(n <= self.buf.len(), "staging buffer of {} values for {n}", self.buf.len());
        Ok(self.buf.sub(0, n))
    }
}

fn upload<T>(dst: DSlice<T>, data: &[T]) -> anyhow::Result<()> {
    anyhow::ensure!(dst.len == data.len(), "upload of {} elements into {}", data.len(), dst.len);
    // SAFETY: the lengths are equal (checked above), so the copy stays inside `dst`.
    unsafe { cudarc::driver::result::memcpy_htod_sync(dst.ptr, data) }
        .map_err(|e| anyhow::anyhow!("copying weights to the device: {e:?}"))?;
    // The staging buffer is read by a kernel on the model's stream right after this.
    Ok(crate::gpu::wait_for_legacy_copies()?)
}
