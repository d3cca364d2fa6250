//! Model weights in device memory (bf16; the router and the noaux_tc bias in f32, as HF computes
//! routing in f32), laid out for the kernels: gate and up projections fused into one `[2I, H]`
//! matrix, routed experts stacked into `[E, 2I, H]` and `[E, H, I]` for the grouped GEMM.
//!
//! Two ways in: from any `WeightSource` (checkpoint, fp8 dequantized to bf16 on the host as it is
//! read, or mla-core's dummy weights), or `--load-format dummy`, which draws random values on the
//! device itself with the same per-role distributions as mla-core's `DummyWeights` (a different
//! random stream: device dummy weights are for shapes and speed, not for comparisons).

use crate::gpu::{DSlice, DeviceBuffer};
use crate::ops::{Kernels, Linear, Normal};
use anyhow::Context;
use cudarc::driver::sys::CUstream;
use half::bf16;
use mla_core::config::{ModelConfig, TopkMethod};
use mla_core::dummy::{dummy_distribution, DummyWeights};
use mla_core::weights::{FfnSpec, MlpSpec, ModelSpec, QuerySpec, TensorSpec};
use mla_core::{RankLayout, WeightSource};
use std::collections::HashMap;

/// A bf16 matrix `[out, inp]`.
pub struct Mat {
    pub buf: DeviceBuffer<bf16>,
    pub out: usize,
    pub inp: usize,
}

impl Mat {
    fn alloc(out: usize, inp: usize) -> anyhow::Result<Self> {
        Ok(Mat { buf: DeviceBuffer::alloc(out * inp)?, out, inp })
    }

    pub fn lin(&self) -> Linear<'_> {
        Linear::new(self.buf.slice(), self.out, self.inp)
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

pub struct MoeWeights {
    pub router: DeviceBuffer<f32>,
    pub bias: Option<DeviceBuffer<f32>>,
    /// [E, 2I, H]
    pub gate_up: DeviceBuffer<bf16>,
    /// [E, H, I]
    pub down: DeviceBuffer<bf16>,
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
}

impl DeviceWeights {
    pub fn output_projection(&self) -> Linear<'_> {
        self.lm_head.as_ref().unwrap_or(&self.embed).lin()
    }

    /// Bytes of device memory the weights occupy.
    pub fn bytes(&self) -> usize {
        let mut n = self.embed.buf.bytes() + self.norm.bytes() + self.lm_head.as_ref().map_or(0, |m| m.buf.bytes());
        for l in &self.layers {
            n += l.input_norm.bytes()
                + l.kv_a.buf.bytes()
                + l.kv_a_norm.bytes()
                + l.kv_b.buf.bytes()
                + l.o_proj.buf.bytes()
                + l.post_norm.bytes();
            n += match &l.query {
                QueryWeights::Direct(m) => m.buf.bytes(),
                QueryWeights::LowRank { a, a_norm, b } => a.buf.bytes() + a_norm.bytes() + b.buf.bytes(),
            };
            let mlp = |m: &MlpWeights| m.gate_up.buf.bytes() + m.down.buf.bytes();
            n += match &l.ffn {
                FfnWeights::Dense(m) => mlp(m),
                FfnWeights::Moe(m) => {
                    m.router.bytes()
                        + m.bias.as_ref().map_or(0, |b| b.bytes())
                        + m.gate_up.bytes()
                        + m.down.bytes()
                        + m.shared.as_ref().map_or(0, mlp)
                }
            };
        }
        n
    }

    /// Allocates (uninitialised) device memory for every tensor of `cfg`.
    fn alloc(cfg: &ModelConfig) -> anyhow::Result<Self> {
        let h = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let mlp = |inter: usize| -> anyhow::Result<MlpWeights> {
            Ok(MlpWeights { gate_up: Mat::alloc(2 * inter, h)?, down: Mat::alloc(h, inter)? })
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let query = match cfg.q_lora_rank {
                None => QueryWeights::Direct(Mat::alloc(heads * cfg.q_head_dim(), h)?),
                Some(r) => QueryWeights::LowRank {
                    a: Mat::alloc(r, h)?,
                    a_norm: DeviceBuffer::alloc(r)?,
                    b: Mat::alloc(heads * cfg.q_head_dim(), r)?,
                },
            };
            let ffn = if cfg.is_moe_layer(i) {
                let (e, im) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
                FfnWeights::Moe(MoeWeights {
                    router: DeviceBuffer::alloc(e * h)?,
                    bias: if cfg.topk_method == TopkMethod::NoauxTc { Some(DeviceBuffer::alloc(e)?) } else { None },
                    gate_up: DeviceBuffer::alloc(e * 2 * im * h)?,
                    down: DeviceBuffer::alloc(e * h * im)?,
                    shared: if cfg.n_shared_experts > 0 {
                        Some(mlp(cfg.shared_expert_intermediate_size())?)
                    } else {
                        None
                    },
                })
            } else {
                FfnWeights::Dense(mlp(cfg.intermediate_size)?)
            };
            layers.push(LayerWeights {
                input_norm: DeviceBuffer::alloc(h)?,
                query,
                kv_a: Mat::alloc(cfg.kv_cache_dim(), h)?,
                kv_a_norm: DeviceBuffer::alloc(cfg.kv_lora_rank)?,
                kv_b: Mat::alloc(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)?,
                o_proj: Mat::alloc(h, heads * cfg.v_head_dim)?,
                post_norm: DeviceBuffer::alloc(h)?,
                ffn,
            });
        }
        Ok(DeviceWeights {
            embed: Mat::alloc(cfg.vocab_size, h)?,
            layers,
            norm: DeviceBuffer::alloc(h)?,
            lm_head: if cfg.tie_word_embeddings { None } else { Some(Mat::alloc(cfg.vocab_size, h)?) },
        })
    }

    /// Where each tensor of the spec lives on the device.
    fn destinations<'a>(&'a self, spec: &'a ModelSpec) -> Vec<(&'a TensorSpec, Dest<'a>)> {
        let mut out: Vec<(&TensorSpec, Dest)> = vec![(&spec.embed_tokens, Dest::Bf16(self.embed.buf.slice()))];
        let mlp = |out: &mut Vec<(&'a TensorSpec, Dest<'a>)>,
                   s: &'a MlpSpec,
                   gate_up: DSlice<'a, bf16>,
                   down: DSlice<'a, bf16>| {
            let half = gate_up.len / 2;
            out.push((&s.gate_proj, Dest::Bf16(gate_up.sub(0, half))));
            out.push((&s.up_proj, Dest::Bf16(gate_up.sub(half, half))));
            out.push((&s.down_proj, Dest::Bf16(down)));
        };
        for (ls, lw) in spec.layers.iter().zip(&self.layers) {
            out.push((&ls.input_layernorm, Dest::Bf16(lw.input_norm.slice())));
            match (&ls.self_attn.query, &lw.query) {
                (QuerySpec::Direct { q_proj }, QueryWeights::Direct(m)) => {
                    out.push((q_proj, Dest::Bf16(m.buf.slice())))
                }
                (QuerySpec::LowRank { q_a_proj, q_a_layernorm, q_b_proj }, QueryWeights::LowRank { a, a_norm, b }) => {
                    out.push((q_a_proj, Dest::Bf16(a.buf.slice())));
                    out.push((q_a_layernorm, Dest::Bf16(a_norm.slice())));
                    out.push((q_b_proj, Dest::Bf16(b.buf.slice())));
                }
                _ => unreachable!("weights allocated from the same config as the spec"),
            }
            let a = &ls.self_attn;
            out.push((&a.kv_a_proj_with_mqa, Dest::Bf16(lw.kv_a.buf.slice())));
            out.push((&a.kv_a_layernorm, Dest::Bf16(lw.kv_a_norm.slice())));
            out.push((&a.kv_b_proj, Dest::Bf16(lw.kv_b.buf.slice())));
            out.push((&a.o_proj, Dest::Bf16(lw.o_proj.buf.slice())));
            out.push((&ls.post_attention_layernorm, Dest::Bf16(lw.post_norm.slice())));
            match (&ls.mlp, &lw.ffn) {
                (FfnSpec::Dense(s), FfnWeights::Dense(w)) => {
                    mlp(&mut out, s, w.gate_up.buf.slice(), w.down.buf.slice())
                }
                (FfnSpec::Moe(s), FfnWeights::Moe(w)) => {
                    out.push((&s.gate, Dest::F32(w.router.slice())));
                    if let (Some(bs), Some(bw)) = (&s.e_score_correction_bias, &w.bias) {
                        out.push((bs, Dest::F32(bw.slice())));
                    }
                    let n = s.experts.len();
                    let (gu, dn) = (w.gate_up.len() / n, w.down.len() / n);
                    for (e, es) in s.experts.iter().enumerate() {
                        mlp(&mut out, es, w.gate_up.sub(e * gu, gu), w.down.sub(e * dn, dn));
                    }
                    if let (Some(ss), Some(sw)) = (&s.shared_experts, &w.shared) {
                        mlp(&mut out, ss, sw.gate_up.buf.slice(), sw.down.buf.slice());
                    }
                }
                _ => unreachable!("weights allocated from the same config as the spec"),
            }
        }
        out.push((&spec.norm, Dest::Bf16(self.norm.slice())));
        if let (Some(s), Some(m)) = (&spec.lm_head, &self.lm_head) {
            out.push((s, Dest::Bf16(m.buf.slice())));
        }
        out
    }

    /// Reads every tensor from `src` (converted to bf16 on the host) into device memory.
    pub fn load(cfg: &ModelConfig, src: &dyn WeightSource) -> anyhow::Result<Self> {
        Self::load_rank(cfg, src, RankLayout::SINGLE)
    }

    /// Rank `layout`'s share of `cfg`'s weights (`RankLayout::shard` of each tensor), laid out
    /// for its own config (`RankLayout::local_config`).
    pub fn load_rank(cfg: &ModelConfig, src: &dyn WeightSource, layout: RankLayout) -> anyhow::Result<Self> {
        let local = layout.local_config(cfg);
        let w = Self::alloc(&local)?;
        let (full_spec, local_spec) = (ModelSpec::new(cfg), ModelSpec::new(&local));
        let full: HashMap<&str, &TensorSpec> = full_spec.tensors().into_iter().map(|t| (t.name.as_str(), t)).collect();
        let dests = w.destinations(&local_spec);
        let bar = mla_core::weight_source::LoadProgress::new(dests.len(), "loading weights to the GPU");
        for (t, d) in &dests {
            let f = full[t.name.as_str()];
            let part = layout.shard(f);
            let n: usize = part.shape(&f.shape).iter().product();
            anyhow::ensure!(n == d.len(), "{}: {n} elements in this rank's share, device slot {}", t.name, d.len());
            match *d {
                Dest::Bf16(s) => {
                    let bits = src.read_bf16_bits_shard(f, &part).with_context(|| format!("reading {}", t.name))?;
                    upload(s.cast::<u16>(), &bits)?;
                }
                Dest::F32(s) => {
                    let v = src.read_f32_shard(f, &part).with_context(|| format!("reading {}", t.name))?;
                    upload(s, &v)?;
                }
            }
            bar.inc();
        }
        bar.finish();
        Ok(w)
    }

    /// Random weights drawn on the device (`--load-format dummy`), for `cfg` as given (a rank
    /// passes its own local config: its shares are drawn like whole tensors of their shape, so a
    /// rank's dummy weights are not a cut of one model's, which nothing compares them with).
    pub fn dummy(cfg: &ModelConfig, k: &Kernels, stream: CUstream, seed: u64) -> anyhow::Result<Self> {
        let w = Self::alloc(cfg)?;
        let spec = ModelSpec::new(cfg);
        let source = DummyWeights::new(seed);
        for (t, d) in w.destinations(&spec) {
            let (mean, std) = dummy_distribution(t);
            let dist = Normal { mean, std, seed: source.tensor_seed(&t.name) };
            match d {
                Dest::Bf16(s) => k.elementwise.fill_normal_bf16(stream, s, dist)?,
                Dest::F32(s) => k.elementwise.fill_normal_f32(stream, s, dist)?,
            }
        }
        Ok(w)
    }
}

#[derive(Clone, Copy)]
enum Dest<'a> {
    Bf16(DSlice<'a, bf16>),
    F32(DSlice<'a, f32>),
}

impl Dest<'_> {
    fn len(&self) -> usize {
        match self {
            Dest::Bf16(s) => s.len,
            Dest::F32(s) => s.len,
        }
    }
}

fn upload<T>(dst: DSlice<T>, data: &[T]) -> anyhow::Result<()> {
    anyhow::ensure!(dst.len == data.len(), "upload of {} elements into {}", data.len(), dst.len);
    // SAFETY: the lengths are equal (checked above), so the copy stays inside `dst`.
    unsafe { cudarc::driver::result::memcpy_htod_sync(dst.ptr, data) }
        .map_err(|e| anyhow::anyhow!("copying weights to the device: {e:?}"))
}
