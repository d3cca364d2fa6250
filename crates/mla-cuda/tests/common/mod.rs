//! Helpers shared by the GPU tests: random data, bf16 rounding, device uploads, error metrics,
//! where the repository's fixtures are when the test binary runs on another machine, and the
//! parameter structs of the launches that several test files make.
#![allow(dead_code)]

use half::bf16;
use mla_core::model::weights::TensorSpec;
use mla_core::step::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind, StepPlan};
use mla_core::ModelConfig;
use mla_core::SplitMix64;
use mla_core::{CheckpointError, DummyWeights, Fp8Tensor, WeightSource};
use mla_cuda::gpu::{DSlice, DeviceBuffer};
use mla_cuda::model::StepMeta;
use mla_cuda::ops::{
    AbsorbQ, DecodeAttention, LatentCacheSlice, MoeRouting, RopeCache, TileM, FP8_BLOCK, LATENT, NOPE, V_HEAD,
};
use mla_cuda::Device;
use std::path::PathBuf;

pub mod hf;

pub fn device() -> Device {
    Device::new(0).expect("these tests need an NVIDIA GPU with libcuda and cuBLAS on the library path")
}

pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::new(seed))
    }
    /// Uniform in [-a, a).
    pub fn uniform(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| ((self.0.next_f64() * 2.0 - 1.0) * a as f64) as f32).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// Rounds through bf16, so host references see exactly what the device holds.
pub fn round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn up_bf16(v: &[f32]) -> DeviceBuffer<bf16> {
    DeviceBuffer::from_host(&to_bf16(v)).unwrap()
}

pub fn up<T: Copy>(v: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_host(v).unwrap()
}

pub fn down_bf16(s: DSlice<bf16>) -> Vec<f32> {
    mla_cuda::gpu::download_slice(s).unwrap().iter().map(|x| x.to_f32()).collect()
}

pub fn down<T: Copy + Default>(s: DSlice<T>) -> Vec<T> {
    mla_cuda::gpu::download_slice(s).unwrap()
}

/// ‖a − b‖ / ‖b‖; NaN anywhere fails.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    assert!(a.iter().all(|x| x.is_finite()), "device output holds NaN or inf");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Repository root: `MLA_REPO_ROOT`, else the checkout this binary was built in, else the
/// current directory (the device machine runs tests from its copy of the repository root).
pub fn repo_root() -> PathBuf {
    if let Ok(p) = std::env::var("MLA_REPO_ROOT") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if built.join("tests/fixtures").is_dir() {
        return built;
    }
    std::env::current_dir().unwrap()
}

pub fn config(name: &str) -> ModelConfig {
    ModelConfig::from_file(&repo_root().join("configs").join(name)).unwrap()
}

/// The `real_dims` fixture: a checkpoint with the published MLA dims and HF's logits for it.
pub fn real_dims_dir() -> PathBuf {
    repo_root().join("tests/fixtures/real_dims")
}

/// Distinct random physical blocks for `n` sequences needing `blocks[i]` blocks each.
pub fn scattered_tables(rng: &mut Rng, blocks: &[usize], total: usize) -> Vec<Vec<u32>> {
    let mut ids: Vec<u32> = (0..total as u32).collect();
    rng.shuffle(&mut ids);
    let mut at = 0;
    blocks
        .iter()
        .map(|&b| {
            let t = ids[at..at + b].to_vec();
            at += b;
            t
        })
        .collect()
}

/// One sequence of a step plan.
pub fn seq(
    id: u64,
    tokens: &[u32],
    ctx: usize,
    table: &[u32],
    logits: LogitsRequest,
    sample: Option<SampleRequest>,
) -> SeqStep {
    SeqStep {
        fork: None,
        seq_id: id,
        tokens: tokens.to_vec(),
        context_len: ctx,
        block_table: table.to_vec(),
        logits,
        sample,
        mtp: None,
    }
}

/// A bf16-exact kv_b_proj for `heads` heads, [heads * (NOPE + V_HEAD), LATENT]: uniform entries of
/// variance 1 / LATENT, so a product with a latent row keeps that row's scale.
pub fn random_kv_b(rng: &mut Rng, heads: usize) -> Vec<f32> {
    round(&rng.uniform(heads * (NOPE + V_HEAD) * LATENT, 3f32.sqrt() / (LATENT as f32).sqrt()))
}

/// What a decode-attention launch reads: absorbed queries, the latent cache, its block tables
/// and the sequence lengths. `params` adds a split count and the outputs.
pub struct DecodeCase<'a> {
    pub batch: usize,
    pub heads: usize,
    pub q: DSlice<'a, bf16>,
    pub cache: LatentCacheSlice<'a>,
    pub block_tables: DSlice<'a, i32>,
    pub bt_stride: DSlice<'a, i32>,
    pub seq_lens: DSlice<'a, i32>,
    pub scale: f32,
}

impl<'a> DecodeCase<'a> {
    /// Tables, table stride and lengths from the words of a decode step's metadata, uploaded
    /// whole to `words`.
    pub fn from_meta(
        meta: &StepMeta,
        words: &'a DeviceBuffer<i32>,
        heads: usize,
        q: DSlice<'a, bf16>,
        cache: impl Into<LatentCacheSlice<'a>>,
        scale: f32,
    ) -> Self {
        let d = meta.decode().expect("a decode step's metadata");
        let w = words.slice();
        DecodeCase {
            batch: meta.seqs,
            heads,
            q,
            cache: cache.into(),
            block_tables: w.tail(d.block_tables.off),
            bt_stride: d.bt_stride.on(w),
            seq_lens: d.seq_lens.on(w),
            scale,
        }
    }

    pub fn params<'o>(&self, num_splits: usize, out: &'o DecodeOutputs) -> DecodeAttention<'o>
    where
        'a: 'o,
    {
        DecodeAttention {
            batch: self.batch,
            heads: self.heads,
            q: self.q,
            cache: self.cache,
            block_tables: self.block_tables,
            bt_stride: self.bt_stride,
            seq_lens: self.seq_lens,
            num_splits,
            out: out.o_lat.slice(),
            part_o: out.part_o.slice(),
            part_lse: out.part_lse.slice(),
            scale: self.scale,
        }
    }
}

/// Where decode attention writes: o_lat, and the per-split partial outputs and log-sum-exps.
pub struct DecodeOutputs {
    pub o_lat: DeviceBuffer<bf16>,
    pub part_o: DeviceBuffer<f32>,
    pub part_lse: DeviceBuffer<f32>,
}

impl DecodeOutputs {
    /// Room for `batch` sequences of `heads` heads in up to `splits` splits, all NaN.
    pub fn poisoned(batch: usize, heads: usize, splits: usize) -> Self {
        DecodeOutputs {
            o_lat: DeviceBuffer::from_host(&vec![bf16::NAN; batch * heads * LATENT]).unwrap(),
            part_o: DeviceBuffer::from_host(&vec![f32::NAN; batch * splits * heads * LATENT]).unwrap(),
            part_lse: DeviceBuffer::from_host(&vec![f32::NAN; batch * splits * heads]).unwrap(),
        }
    }

    /// Sets every output to NaN again, so whatever the next launch leaves unwritten shows.
    pub fn poison(&self) {
        self.o_lat.upload(&vec![bf16::NAN; self.o_lat.len()]).unwrap();
        self.part_o.upload(&vec![f32::NAN; self.part_o.len()]).unwrap();
        self.part_lse.upload(&vec![f32::NAN; self.part_lse.len()]).unwrap();
    }
}

/// The buffers of one `rope_cache` launch on a model's shape. `params` lays them out packed:
/// kv_a rows of `kv_lora_rank + rope_dim`, q rows of `heads * q_head_dim` (q_pe rotated in
/// place), and the rotated q_pe also copied into the `q_abs` rows after their latent part.
pub struct RopeCase<'a> {
    pub cfg: &'a ModelConfig,
    pub tokens: usize,
    pub kva: DSlice<'a, bf16>,
    pub kv_norm_w: DSlice<'a, bf16>,
    pub q: DSlice<'a, bf16>,
    pub q_abs: DSlice<'a, bf16>,
    pub positions: DSlice<'a, i32>,
    pub slots: DSlice<'a, i32>,
    pub inv_freq: DSlice<'a, f32>,
    pub cache: LatentCacheSlice<'a>,
}

impl<'a> RopeCase<'a> {
    /// With `absorb_kv_b` (kv_b_proj), the same launch also writes the absorbed queries into the
    /// latent part of the `q_abs` rows.
    pub fn params(&self, absorb_kv_b: Option<DSlice<'a, bf16>>) -> RopeCache<'a> {
        let cfg = self.cfg;
        let (heads, r, p) = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let lat = r + p;
        RopeCache {
            tokens: self.tokens,
            heads,
            nope: cfg.qk_nope_head_dim,
            kv_lora_rank: r,
            rope_dim: p,
            kva: self.kva,
            kva_stride: lat,
            kv_norm_w: self.kv_norm_w,
            q: self.q,
            q_stride: heads * cfg.q_head_dim(),
            q_pe_out: Some((self.q_abs.tail(r), heads * lat, lat)),
            positions: self.positions,
            slots: self.slots,
            inv_freq: self.inv_freq,
            attn_factor: cfg.rope_attention_factor() as f32,
            eps: cfg.rms_norm_eps as f32,
            cache: self.cache,
            absorb: absorb_kv_b.map(|kv_b| AbsorbQ {
                kv_b,
                v_dim: cfg.v_head_dim,
                q_abs: self.q_abs,
                row_stride: heads * lat,
                head_stride: lat,
            }),
        }
    }
}

/// mla-core's dummy weights, optionally rounded to bf16 (so the f32 CPU reference and the bf16
/// CUDA backend can compute with identical weights).
pub struct Dummy {
    pub inner: DummyWeights,
    pub bf16: bool,
}

impl WeightSource for Dummy {
    fn describe(&self) -> String {
        format!("{}{}", self.inner.describe(), if self.bf16 { " rounded to bf16" } else { "" })
    }
    fn read_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, CheckpointError> {
        let v = self.inner.read_f32(spec)?;
        Ok(if self.bf16 { round(&v) } else { v })
    }
    fn read_fp8(&self, _spec: &TensorSpec) -> Result<Option<Fp8Tensor>, CheckpointError> {
        Ok(None)
    }
}

/// Random e4m3 bytes, avoiding the two NaN codes.
pub fn fp8_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| loop {
            let b = rng.below(256) as u8;
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect()
}

/// Device buffers of one routing, owned by a test.
pub struct RoutingBufs {
    pub ids: DeviceBuffer<i32>,
    pub w: DeviceBuffer<f32>,
    pub off: DeviceBuffer<i32>,
    pub perm: DeviceBuffer<i32>,
    pub inv: DeviceBuffer<i32>,
    pub te: DeviceBuffer<i32>,
    pub tr0: DeviceBuffer<i32>,
    pub trs: DeviceBuffer<i32>,
    pub nt: DeviceBuffer<i32>,
}

impl RoutingBufs {
    pub fn new(t: usize, e: usize, top: usize) -> Self {
        let a = t * top;
        let tiles = MoeRouting::max_tiles(a, e, TileM::Rows16);
        let i = |n| DeviceBuffer::<i32>::alloc(n).unwrap();
        RoutingBufs {
            ids: i(a),
            w: DeviceBuffer::alloc(a).unwrap(),
            off: i(e + 1),
            perm: i(a),
            inv: i(a),
            te: i(tiles),
            tr0: i(tiles),
            trs: i(tiles),
            nt: i(1),
        }
    }
    pub fn routing(&self, t: usize, e: usize, top: usize) -> MoeRouting<'_> {
        self.routing_tiles(t, e, top, TileM::Rows64)
    }
    pub fn routing_tiles(&self, t: usize, e: usize, top: usize, tile: TileM) -> MoeRouting<'_> {
        MoeRouting {
            tokens: t,
            tile,
            experts: e,
            top_k: top,
            topk_ids: self.ids.slice(),
            topk_w: self.w.slice(),
            expert_off: self.off.slice(),
            perm_src: self.perm.slice(),
            inv_row: self.inv.slice(),
            tile_expert: self.te.slice(),
            tile_row0: self.tr0.slice(),
            tile_rows: self.trs.slice(),
            num_tiles: self.nt.slice(),
        }
    }
}

/// Random block-FP8 scales, 10^[-3, 1): four decades, never all ones.
pub fn fp8_scales(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.uniform(n, 2.0).iter().map(|u| 10f32.powf(u - 1.0)).collect()
}

/// A random block-FP8 stack of `count` `[rows, cols]` matrices as DeepSeek-V3 checkpoints store
/// them: e4m3 bytes (no NaN codes) and one scale per 128x128 block of each matrix.
pub struct Fp8Stack {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Fp8Stack {
    pub fn random(rng: &mut Rng, count: usize, rows: usize, cols: usize) -> Self {
        let [gr, gc] = mla_core::model::fp8::scale_grid(rows, cols, [FP8_BLOCK, FP8_BLOCK]);
        Fp8Stack {
            count,
            rows,
            cols,
            bytes: fp8_bytes(rng, count * rows * cols),
            scales: fp8_scales(rng, count * gr * gc),
        }
    }

    fn grid(&self) -> [usize; 2] {
        mla_core::model::fp8::scale_grid(self.rows, self.cols, [FP8_BLOCK, FP8_BLOCK])
    }

    /// Dequantized on the host as a loader would: f32(float(e4m3) · scale), matrix by matrix.
    pub fn dequant_f32(&self) -> Vec<f32> {
        let ([gr, gc], n) = (self.grid(), self.rows * self.cols);
        (0..self.count)
            .flat_map(|m| {
                let s = &self.scales[m * gr * gc..(m + 1) * gr * gc];
                mla_core::model::fp8::dequantize_block_fp8(
                    &self.bytes[m * n..(m + 1) * n],
                    self.rows,
                    self.cols,
                    s,
                    [FP8_BLOCK, FP8_BLOCK],
                )
            })
            .collect()
    }

    /// The exact values float(e4m3) · scale, in f64.
    pub fn exact_f64(&self) -> Vec<f64> {
        let [gr, gc] = self.grid();
        let (r, c) = (self.rows, self.cols);
        self.bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                let (m, rr, cc) = (i / (r * c), i / c % r, i % c);
                let s = self.scales[(m * gr + rr / FP8_BLOCK) * gc + cc / FP8_BLOCK];
                mla_core::model::fp8::fp8_e4m3_to_f32(b) as f64 * s as f64
            })
            .collect()
    }

    /// The same bytes read with every block taking the scale of the next block along both axes
    /// (cyclically): what a kernel indexing the scale grid wrongly would compute.
    pub fn with_shifted_scales(&self) -> Self {
        let [gr, gc] = self.grid();
        let scales = (0..self.count * gr * gc)
            .map(|i| {
                let (m, rb, kb) = (i / (gr * gc), i / gc % gr, i % gc);
                self.scales[(m * gr + (rb + 1) % gr) * gc + (kb + 1) % gc]
            })
            .collect();
        Fp8Stack { bytes: self.bytes.clone(), scales, ..*self }
    }

    /// Device copies of the bytes and the scales.
    pub fn upload(&self) -> (DeviceBuffer<u8>, DeviceBuffer<f32>) {
        (up(&self.bytes), up(&self.scales))
    }
}

/// A ragged prefill in two chunks over two sequences, then `decode` two-sequence decode steps.
pub fn ragged_plans(decode: u32) -> Vec<StepPlan> {
    let tables = [vec![9u32, 2, 14], vec![5u32, 11]];
    let prompts: [Vec<u32>; 2] =
        [(0..90).map(|i| (i * 37 + 5) % 512).collect(), (0..37).map(|i| (i * 53 + 1) % 512).collect()];
    let mut plans = vec![
        StepPlan {
            kind: StepKind::Prefill,
            seqs: vec![seq(0, &prompts[0][..50], 0, &tables[0], LogitsRequest::All, None)],
        },
        StepPlan {
            kind: StepKind::Prefill,
            seqs: vec![
                seq(0, &prompts[0][50..], 50, &tables[0], LogitsRequest::All, None),
                seq(1, &prompts[1], 0, &tables[1], LogitsRequest::All, None),
            ],
        },
    ];
    for j in 0..decode {
        plans.push(StepPlan {
            kind: StepKind::Decode,
            seqs: vec![
                seq(0, &[7 + j], 90 + j as usize, &tables[0], LogitsRequest::Last, None),
                seq(1, &[100 + 3 * j], 37 + j as usize, &tables[1], LogitsRequest::Last, None),
            ],
        });
    }
    plans
}
