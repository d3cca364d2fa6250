//! Causal prefill attention (qk 192, v 128) on the V2-Lite shape: TFLOP/s of every prefill kernel
//! this GPU has, for 4 x 4096 tokens (the kernel target's shape) and 1 x 4096 (the engine's
//! one-prompt prefill: 4x fewer blocks, so the last wave weighs more), outputs cross-checked.

use super::timing::{download_f32, fill, rel_diff, time_ms};
use super::HEADS;
use half::bf16;
use mla_core::step::plan::{LogitsRequest, SeqStep, StepKind, StepPlan};
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::model::{MetaLimits, StepMeta};
use mla_cuda::ops::{
    Linear, PrefillAttention, PrefillKernel, PrefillPass, Strided, LATENT, NOPE, PAGE_SIZE, ROPE, V_HEAD,
};
use mla_cuda::Device;
use serde_json::{json, Value};

/// (sequences, tokens per sequence)
const SHAPES: [(usize, usize); 2] = [(4, 4096), (1, 4096)];

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let mut rows = Vec::new();
    for (seqs, len) in SHAPES {
        rows.extend(shape(dev, seqs, len)?);
    }
    Ok(json!(rows))
}

/// The step metadata of one prefill pass over `seqs` fresh prompts of `len` tokens.
fn prefill_meta(seqs: usize, len: usize) -> anyhow::Result<StepMeta> {
    let plan = StepPlan {
        kind: StepKind::Prefill,
        seqs: (0..seqs)
            .map(|i| SeqStep {
                fork: None,
                seq_id: i as u64,
                tokens: vec![0; len],
                context_len: 0,
                block_table: ((i * len / PAGE_SIZE) as u32..((i + 1) * len / PAGE_SIZE) as u32).collect(),
                logits: LogitsRequest::None,
                sample: None,
                mtp: None,
            })
            .collect(),
    };
    let t = seqs * len;
    let lim = MetaLimits {
        max_tokens: t,
        max_seqs: seqs,
        max_logit_rows: seqs,
        max_kv_chunk: t,
        max_blocks_per_seq: len / PAGE_SIZE,
        vocab: 512,
    };
    StepMeta::build(&plan, &lim)
}

fn shape(dev: &Device, seqs: usize, len: usize) -> anyhow::Result<Vec<Value>> {
    let t = seqs * len;
    let (qd, lat, kvw) = (NOPE + ROPE, LATENT + ROPE, HEADS * (NOPE + V_HEAD));
    let meta = prefill_meta(seqs, len)?;
    let d_meta = DeviceBuffer::from_host(&meta.words)?;
    let q = fill(dev, t * HEADS * qd, 1.0, 3)?;
    let latent = fill(dev, t * lat, 1.0, 4)?;
    let kv_b = fill(dev, kvw * LATENT, 0.044, 5)?;
    let kv = DeviceBuffer::<bf16>::alloc(t * kvw)?;
    let out = DeviceBuffer::<bf16>::alloc(t * HEADS * V_HEAD)?;
    // One pass over the whole context: no running state to carry between passes.
    let state_o = DeviceBuffer::<f32>::alloc(1)?;
    let state_ml = DeviceBuffer::<f32>::alloc(1)?;
    let lin = Linear::new(kv_b.slice(), kvw, LATENT);
    let pm = meta.prefill().expect("a prefill step's metadata");
    let p = &pm.passes[0];
    let w = d_meta.slice();
    let decompress_ms = time_ms(dev, 5, 7, |_| {
        dev.blas.linear(&lin, Strided::new(latent.slice(), lat), t, Strided::new(kv.slice(), kvw))
    })?;
    let attn = PrefillAttention {
        heads: HEADS,
        q_rows: t,
        q: q.slice(),
        q_stride: HEADS * qd,
        k_rows: t,
        kv: kv.slice(),
        kv_stride: kvw,
        kpe: latent.slice().tail(LATENT),
        kpe_stride: lat,
        out: out.slice(),
        out_stride: HEADS * V_HEAD,
        state_o: state_o.slice(),
        state_ml: state_ml.slice(),
        tiles: pm.tile_seq.len,
        tile_seq: pm.tile_seq.on(w),
        tile_q0: pm.tile_q0.on(w),
        seqs,
        cu_q: pm.cu_q.on(w),
        q_pos0: pm.q_pos0.on(w),
        k_row0: p.k_row0.on(w),
        k_pos0: p.k_pos0.on(w),
        k_len: p.k_len.on(w),
        scale: 0.1147,
        pass: PrefillPass { load_state: false, last: true },
    };
    // Causal: query i sees i + 1 keys, each costing heads x (192 + 128) x 2 FLOPs.
    let flops = seqs as f64 * HEADS as f64 * ((qd + V_HEAD) * 2) as f64 * (len as f64 * (len as f64 + 1.0) / 2.0);
    let mut rows = Vec::new();
    let mut outputs: Vec<Vec<f32>> = Vec::new();
    for which in PrefillKernel::available(&dev.k.attention) {
        dev.gpu.sync()?;
        // NaN everywhere, so that an element a kernel fails to write shows in the cross-check.
        out.upload(&vec![bf16::NAN; t * HEADS * V_HEAD])?;
        let ms = time_ms(dev, 5, 7, |_| dev.k.attention.prefill_with(dev.stream(), &attn, which))?;
        let tflops = flops / (ms * 1e-3) / 1e12;
        println!(
            "prefill attention {which:?} {seqs}x{len}: {ms:.3} ms  {tflops:.0} TFLOP/s (kv_b decompression GEMM {decompress_ms:.3} ms)"
        );
        outputs.push(download_f32(dev, &out)?);
        rows.push(json!({
            "kernel": format!("{which:?}"), "seqs": seqs, "len": len, "heads": HEADS, "time_ms": ms, "flops": flops,
            "TFLOPs": tflops, "kv_decompress_gemm_ms": decompress_ms,
        }));
    }
    // The CPU-reference checks are in mla-cuda's tests/gpu_attention.rs; this adds 4096-row causal.
    for other in &outputs[1..] {
        let (rel, finite) = rel_diff(&outputs[0], other);
        println!("prefill attention: wgmma vs mma.sync output rel diff {rel:.2e}, all finite: {finite}");
        anyhow::ensure!(
            finite && rel < 1e-2,
            "wgmma and mma.sync prefill attention disagree: rel {rel}, finite {finite}"
        );
    }
    Ok(rows)
}
