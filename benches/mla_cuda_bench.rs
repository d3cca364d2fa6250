//! First performance figures of the CUDA backend on the DeepSeek-V2-Lite shape (16 heads,
//! kv_lora 512 + rope 64, page 64), written as JSON and compared with DESIGN.md's yardsticks:
//! - decode attention (absorbed MQA over the paged cache, split-KV + combine): kernel time and
//!   effective bandwidth of both kernels at batch 1, 2, 4, 8, 16, 32, 64, 128, 256, context 4096, and at
//!   batch 1-4 the attention + absorb_o tail with and without the fused combine + absorb_o;
//! - prefill attention (causal, qk 192 / v 128): TFLOP/s for 4 x 4096 and 1 x 4096 tokens;
//! - MoE expert GEMMs (gate/up + SiLU·mul + down over the device tile map) on the V2-Lite shape
//!   at 4096 tokens (prefill) and 256 (decode B=256): TFLOP/s and expert-weight bandwidth, every
//!   tile height the GPU has, outputs cross-checked;
//! - one full decode step (dummy weights, context 4096) at batch 1 and 64, eager and replayed
//!   from a CUDA graph.
//!
//! Build here: `cargo bench -p mla-cuda --bench mla_cuda_bench --no-run`; run on the GPU machine:
//! `mla_cuda_bench --out bench.json [--only decode_attention,prefill_attention,moe_experts,decode_step]`.

use half::bf16;
use mla_core::plan::{LogitsRequest, SampleRequest, SeqStep, StepKind, StepPlan};
use mla_core::{ModelConfig, SamplingParams};
use mla_cuda::gpu::{DeviceBuffer, Event};
use mla_cuda::model::{CudaModel, DeviceWeights, Limits, MetaLimits, ModelOptions, StepMeta};
use mla_cuda::ops::*;
use mla_cuda::Device;
use serde_json::{json, Value};

const HEADS: usize = 16;
const CTX: usize = 4096;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let out = arg("--out").unwrap_or_else(|| "bench.json".into());
    let only = arg("--only").unwrap_or_else(|| "decode_attention,prefill_attention,moe_experts,decode_step".into());
    let config = arg("--config").unwrap_or_else(|| "configs/deepseek-v2-lite.json".into());
    let dev = Device::new(0)?;
    let info = dev.gpu.info.clone();
    println!("{} ({} SMs, sm_{}{})", info.name, info.sm_count, info.compute_capability.0, info.compute_capability.1);
    let mut results = serde_json::Map::new();
    if only.contains("decode_attention") {
        results.insert("decode_attention".into(), bench_decode_attention(&dev)?);
    }
    if only.contains("prefill_attention") {
        results.insert("prefill_attention".into(), bench_prefill_attention(&dev)?);
    }
    if only.contains("moe_experts") {
        results.insert("moe_experts".into(), bench_moe_experts(&dev)?);
    }
    if only.contains("profile_step") {
        // For `ncu --profile-from-start off`: one eager decode step at B=1 and one at B=64.
        let cfg = ModelConfig::from_file(std::path::Path::new(&config))?;
        profile_steps(dev, cfg)?;
        return Ok(());
    }
    if only.contains("decode_step") {
        let cfg = ModelConfig::from_file(std::path::Path::new(&config))?;
        results.insert("decode_step".into(), bench_decode_step(dev, cfg)?);
    }
    let report = json!({
        "gpu": info.name,
        "sm_count": info.sm_count,
        "date_utc": today(),
        "command": args.join(" "),
        "git_commit": std::env::var("MLA_GIT_COMMIT").unwrap_or_default(),
        "results": results,
        "yardsticks_design_md": {
            "device_to_device_copy_TBps": 4.26,
            "flashinfer_mla_decode_b1_ctx4096_us": 29.0,
            "flashinfer_mla_decode_TBps": {"b32": 2.70, "b128": 3.81, "b256": 4.06},
            "prefill_attention_4x4096_TFLOPs": {"torch_sdpa": 563.0, "flashinfer_fa3": 650.0},
            "hf_transformers_v2_lite_decode_tok_s": {"b1": 14.0, "b32": 299.0, "b128": 471.0},
            "physical_decode_limit_v2_lite_ctx4k_tok_s": {"b1": 950.0, "b256": 19300.0}
        }
    });
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {out}");
    Ok(())
}

/// Median of `reps` timings (ms) of `iters` back-to-back runs of `f`, per run.
fn time_ms(
    dev: &Device,
    iters: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for i in 0..3 {
        f(i)?;
    }
    dev.gpu.sync()?;
    let mut ts = Vec::with_capacity(reps);
    for r in 0..reps {
        let (a, b) = (Event::new()?, Event::new()?);
        a.record(dev.stream())?;
        for i in 0..iters {
            f(r * iters + i)?;
        }
        b.record(dev.stream())?;
        ts.push(a.elapsed_ms(&b)? as f64 / iters as f64);
    }
    ts.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(ts[reps / 2])
}

fn fill(dev: &Device, n: usize, std: f32, seed: u64) -> anyhow::Result<DeviceBuffer<bf16>> {
    let b = DeviceBuffer::<bf16>::alloc(n)?;
    dev.k.fill_normal_bf16(dev.stream(), b.slice(), Normal { mean: 0.0, std, seed })?;
    Ok(b)
}

/// Both decode kernels at each batch (the dispatch picks `DecodeKernel::for_batch`); for batches
/// up to 4 also the whole attention tail in its two forms: `decode_attention` (kernel + merge) +
/// cuBLAS `absorb_o`, against `decode_attention_partials` + `decode_combine_absorb_o`.
fn bench_decode_attention(dev: &Device) -> anyhow::Result<Value> {
    let lat = LATENT + ROPE;
    let kvw = HEADS * (NOPE + V_HEAD);
    let kv_b_w = fill(dev, kvw * LATENT, 0.04, 3)?;
    let kv_b = Linear::new(kv_b_w.slice(), kvw, LATENT);
    let mut rows = vec![];
    for batch in [1usize, 2, 4, 8, 16, 32, 64, 128, 256] {
        let pages = CTX / PAGE_SIZE;
        let set_bytes = batch * pages * PAGE_SIZE * lat * 2;
        // Several block-table sets over disjoint cache regions, rotated so that the L2 (60 MB)
        // never holds the next launch's pages.
        let sets = (256usize << 20).div_ceil(set_bytes).max(2);
        let blocks = sets * batch * pages;
        let cache = fill(dev, blocks * PAGE_SIZE * lat, 1.0, 1)?;
        let mut tables: Vec<i32> = (0..blocks as i32).collect();
        // Scatter pages (a fixed permutation) like a real block manager would.
        for i in (1..tables.len()).rev() {
            let j = (i * 2_654_435_761) % (i + 1);
            tables.swap(i, j);
        }
        let d_tables = DeviceBuffer::from_host(&tables)?;
        let stride = DeviceBuffer::from_host(&[pages as i32])?;
        let lens = DeviceBuffer::from_host(&vec![CTX as i32; batch])?;
        let q = fill(dev, batch * HEADS * lat, 1.0, 2)?;
        let out = DeviceBuffer::<bf16>::alloc(batch * HEADS * LATENT)?;
        let attn_out = DeviceBuffer::<bf16>::alloc(batch * HEADS * V_HEAD)?;
        let splits = dev.k.decode_splits(batch, HEADS, pages);
        let part_o = DeviceBuffer::<f32>::alloc(batch * splits * HEADS * LATENT)?;
        let part_lse = DeviceBuffer::<f32>::alloc(batch * splits * HEADS)?;
        let params = |i: usize| DecodeAttention {
            batch,
            heads: HEADS,
            q: q.slice(),
            cache: cache.slice(),
            block_tables: d_tables.tail((i % sets) * batch * pages),
            bt_stride: stride.slice(),
            seq_lens: lens.slice(),
            num_splits: splits,
            out: out.slice(),
            part_o: part_o.slice(),
            part_lse: part_lse.slice(),
            scale: 0.1147,
        };
        let bytes = (batch * CTX * lat * 2 + batch * HEADS * (lat + LATENT) * 2) as f64;
        for which in DecodeKernel::ALL {
            let ms = time_ms(dev, 20, 15, |i| dev.k.decode_attention_with(dev.stream(), &params(i), which))?;
            let tbps = bytes / (ms * 1e-3) / 1e12;
            let chosen = which == DecodeKernel::for_batch(batch);
            println!(
                "decode attention {which:?} B={batch:<4} ctx {CTX}: {:8.1} us  {tbps:.2} TB/s  ({splits} splits){}",
                ms * 1e3,
                if chosen { "  (dispatched)" } else { "" }
            );
            rows.push(json!({"kernel": format!("{which:?}"), "dispatched": chosen, "batch": batch, "context": CTX, "heads": HEADS, "splits": splits, "time_us": ms * 1e3, "bytes": bytes, "effective_TBps": tbps}));
        }
        if batch <= COMBINE_ABSORB_MAX_BATCH {
            let two = time_ms(dev, 20, 15, |i| {
                dev.k.decode_attention(dev.stream(), &params(i))?;
                dev.blas.absorb_o(&kv_b, HEADS, out.slice(), batch, attn_out.slice())
            })?;
            let fused = time_ms(dev, 20, 15, |i| {
                dev.k.decode_attention_partials(dev.stream(), &params(i))?;
                dev.k.decode_combine_absorb_o(
                    dev.stream(),
                    part_o.slice(),
                    part_lse.slice(),
                    HEADS,
                    splits,
                    batch,
                    &kv_b,
                    attn_out.slice(),
                )
            })?;
            println!("decode attention + absorb_o B={batch}: two launches after the kernel {:6.1} us, fused combine+absorb_o {:6.1} us", two * 1e3, fused * 1e3);
            rows.push(json!({"tail": "decode_attention+absorb_o", "batch": batch, "context": CTX, "heads": HEADS, "splits": splits, "time_us": two * 1e3}));
            rows.push(json!({"tail": "decode_attention_partials+decode_combine_absorb_o", "batch": batch, "context": CTX, "heads": HEADS, "splits": splits, "time_us": fused * 1e3}));
        }
    }
    Ok(json!(rows))
}

fn bench_prefill_attention(dev: &Device) -> anyhow::Result<Value> {
    // 4 x 4096 is the kernel target's shape; 1 x 4096 is the engine's one-prompt prefill (4x
    // fewer blocks, so the last wave weighs more).
    let mut rows = Vec::new();
    for (seqs, len) in [(4usize, 4096usize), (1, 4096)] {
        rows.extend(bench_prefill_shape(dev, seqs, len)?);
    }
    Ok(json!(rows))
}

fn bench_prefill_shape(dev: &Device, seqs: usize, len: usize) -> anyhow::Result<Vec<Value>> {
    let t = seqs * len;
    let (qd, lat, kvw) = (NOPE + ROPE, LATENT + ROPE, HEADS * (NOPE + V_HEAD));
    let plan = StepPlan {
        kind: StepKind::Prefill,
        seqs: (0..seqs)
            .map(|i| SeqStep {
                seq_id: i as u64,
                tokens: vec![0; len],
                context_len: 0,
                block_table: ((i * len / PAGE_SIZE) as u32..((i + 1) * len / PAGE_SIZE) as u32).collect(),
                logits: LogitsRequest::None,
                sample: None,
            })
            .collect(),
    };
    let lim = MetaLimits {
        max_tokens: t,
        max_seqs: seqs,
        max_logit_rows: seqs,
        max_kv_chunk: t,
        max_blocks_per_seq: len / PAGE_SIZE,
        vocab: 512,
    };
    let meta = StepMeta::build(&plan, &lim)?;
    let d_meta = DeviceBuffer::from_host(&meta.words)?;
    let q = fill(dev, t * HEADS * qd, 1.0, 3)?;
    let latent = fill(dev, t * lat, 1.0, 4)?;
    let kv_b = fill(dev, kvw * LATENT, 0.044, 5)?;
    let kv = DeviceBuffer::<bf16>::alloc(t * kvw)?;
    let out = DeviceBuffer::<bf16>::alloc(t * HEADS * V_HEAD)?;
    let state_o = DeviceBuffer::<f32>::alloc(1)?;
    let state_ml = DeviceBuffer::<f32>::alloc(1)?;
    let lin = Linear::new(kv_b.slice(), kvw, LATENT);
    let p = &meta.passes[0];
    let m = |o: usize, n: usize| d_meta.sub(o, n);
    let decompress_ms = time_ms(dev, 5, 7, |_| dev.blas.linear(&lin, latent.slice(), lat, t, kv.slice(), kvw))?;
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
        tiles: meta.tiles,
        tile_seq: m(meta.tile_seq, meta.tiles),
        tile_q0: m(meta.tile_q0, meta.tiles),
        seqs,
        cu_q: m(meta.cu_q, seqs + 1),
        q_pos0: m(meta.q_pos0, seqs),
        k_row0: m(p.k_row0, seqs),
        k_pos0: m(p.k_pos0, seqs),
        k_len: m(p.k_len, seqs),
        scale: 0.1147,
        pass: PrefillPass { load_state: false, last: true },
    };
    // Causal FLOPs: per query i, (i + 1) keys x heads x (192 + 128) x 2.
    let flops = seqs as f64 * HEADS as f64 * ((qd + V_HEAD) * 2) as f64 * (len as f64 * (len as f64 + 1.0) / 2.0);
    let kernels = PrefillKernel::available(&dev.k);
    let mut rows = Vec::new();
    let mut outputs: Vec<Vec<f32>> = Vec::new();
    for which in kernels {
        dev.gpu.sync()?;
        out.upload(&vec![bf16::NAN; t * HEADS * V_HEAD])?; // every element must be rewritten
        let ms = time_ms(dev, 5, 7, |_| dev.k.prefill_attention_with(dev.stream(), &attn, which))?;
        let tflops = flops / (ms * 1e-3) / 1e12;
        println!("prefill attention {which:?} {seqs}x{len}: {ms:.3} ms  {tflops:.0} TFLOP/s (kv_b decompression GEMM {decompress_ms:.3} ms)");
        dev.gpu.sync()?;
        outputs.push(out.download()?.iter().map(|x| x.to_f32()).collect());
        rows.push(json!({"kernel": format!("{which:?}"), "seqs": seqs, "len": len, "heads": HEADS, "time_ms": ms, "flops": flops, "TFLOPs": tflops, "kv_decompress_gemm_ms": decompress_ms}));
    }
    // Both kernels compute the same function: their outputs on this problem must agree to bf16
    // rounding (the CPU-reference checks live in tests/gpu_kernels.rs; this covers 4096-row causal).
    for b in &outputs[1..] {
        let a = &outputs[0];
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        let finite = b.iter().all(|x| x.is_finite());
        println!("prefill attention: wgmma vs mma.sync output rel diff {rel:.2e}, all finite: {finite}");
        anyhow::ensure!(
            finite && rel < 1e-2,
            "wgmma and mma.sync prefill attention disagree: rel {rel}, finite {finite}"
        );
    }
    Ok(rows)
}

/// V2-Lite's routed experts (hidden 2048, moe_intermediate 1408, 64 experts, top-6) over random
/// routing: gate/up GEMM + SiLU·mul, then down, for each tile height this GPU has.
fn bench_moe_experts(dev: &Device) -> anyhow::Result<Value> {
    let (h, im, e, top) = (2048usize, 1408usize, 64usize, 6usize);
    let (s, k) = (dev.stream(), &dev.k);
    let w_gu = fill(dev, e * 2 * im * h, 0.02, 11)?;
    let w_down = fill(dev, e * h * im, 0.02, 12)?;
    let weight_bytes = ((e * 2 * im * h + e * h * im) * 2) as f64;
    let mut rows_json = vec![];
    for tokens in [4096usize, 256] {
        let a = tokens * top;
        // Uniform random top-6 of 64 per token (distinct), from a fixed LCG.
        let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ tokens as u64;
        let mut ids = Vec::with_capacity(a);
        for _ in 0..tokens {
            let mut chosen: Vec<i32> = vec![];
            while chosen.len() < top {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let x = ((state >> 33) % e as u64) as i32;
                if !chosen.contains(&x) {
                    chosen.push(x);
                }
            }
            ids.extend(chosen);
        }
        let i32s = |n: usize| DeviceBuffer::<i32>::alloc(n);
        let tiles = MoeRouting::max_tiles(a, e, GROUPED_TILE_M_SMALL);
        let (d_ids, off, perm, inv, te, tr0, trs, nt) = (
            DeviceBuffer::from_host(&ids)?,
            i32s(e + 1)?,
            i32s(a)?,
            i32s(a)?,
            i32s(tiles)?,
            i32s(tiles)?,
            i32s(tiles)?,
            i32s(1)?,
        );
        let w = DeviceBuffer::<f32>::alloc(a)?;
        let x = fill(dev, a * h, 1.0, 13)?;
        let gu = DeviceBuffer::<bf16>::alloc(a * 2 * im)?;
        let act = DeviceBuffer::<bf16>::alloc(a * im)?;
        let y = DeviceBuffer::<bf16>::alloc(a * h)?;
        let mut variants = vec![(GROUPED_TILE_M, Sm90Schedule::ALL[0])];
        if k.moe_wgmma {
            variants.extend(Sm90Schedule::ALL.map(|sc| (GROUPED_TILE_M_SM90, sc)));
        }
        let default_tile = k.moe_tile_m(tokens, top, e);
        let flops = 2.0 * a as f64 * (2 * im * h + h * im) as f64;
        let mut outputs: Vec<Vec<f32>> = vec![];
        for (tile_m, sched) in variants {
            let r = MoeRouting {
                tokens,
                tile_m,
                experts: e,
                top_k: top,
                topk_ids: d_ids.slice(),
                topk_w: w.slice(),
                expert_off: off.slice(),
                perm_src: perm.slice(),
                inv_row: inv.slice(),
                tile_expert: te.slice(),
                tile_row0: tr0.slice(),
                tile_rows: trs.slice(),
                num_tiles: nt.slice(),
            };
            k.moe_align(s, &r)?;
            dev.gpu.sync()?;
            y.upload(&vec![bf16::NAN; a * h])?;
            let default = tile_m == default_tile && (tile_m != GROUPED_TILE_M_SM90 || sched == k.moe_sm90_schedule(&r));
            let gate_up_ms = time_ms(dev, 5, 9, |_| {
                k.moe_gate_up_act_with(s, x.slice(), w_gu.slice(), gu.slice(), act.slice(), im, h, &r, sched)
            })?;
            let down_ms = time_ms(dev, 5, 9, |_| {
                k.moe_grouped_gemm_with(s, act.slice(), w_down.slice(), y.slice(), h, im, &r, sched)
            })?;
            let ms = gate_up_ms + down_ms;
            let (tflops, tbps) = (flops / (ms * 1e-3) / 1e12, weight_bytes / (ms * 1e-3) / 1e12);
            println!("MoE experts {tokens} tokens, tiles of {tile_m}{}{}: gate/up+silu {gate_up_ms:.3} ms + down {down_ms:.3} ms = {ms:.3} ms, {tflops:.0} TFLOP/s, weights at {tbps:.2} TB/s", if tile_m == GROUPED_TILE_M_SM90 { format!(", items of {} rows, {}", sched.item_rows, if sched.persistent { "persistent" } else { "one block per item" }) } else { String::new() }, if default { " (default)" } else { "" });
            dev.gpu.sync()?;
            outputs.push(y.download()?.iter().map(|v| v.to_f32()).collect());
            rows_json.push(json!({"tokens": tokens, "assignments": a, "tile_m": tile_m, "wgmma_item_rows": if tile_m == GROUPED_TILE_M_SM90 { sched.item_rows } else { 0 }, "wgmma_persistent": tile_m == GROUPED_TILE_M_SM90 && sched.persistent, "default": default, "gate_up_silu_ms": gate_up_ms, "down_ms": down_ms, "time_ms": ms, "flops": flops, "TFLOPs": tflops, "expert_weight_bytes": weight_bytes, "weight_TBps": tbps}));
        }
        // Same function whatever the tiles (the CPU-reference checks are in tests/gpu_kernels.rs).
        for b in &outputs[1..] {
            let a0 = &outputs[0];
            let num: f64 = a0.iter().zip(b).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
            let den: f64 = a0.iter().map(|p| (*p as f64).powi(2)).sum();
            let rel = (num / den).sqrt();
            let finite = b.iter().all(|v| v.is_finite());
            println!("MoE experts {tokens} tokens: wgmma vs mma.sync output rel diff {rel:.2e}, all finite: {finite}");
            anyhow::ensure!(finite && rel < 1e-2, "grouped GEMM variants disagree: rel {rel}, finite {finite}");
        }
    }
    Ok(
        json!({"shape": "deepseek-v2-lite routed experts: hidden 2048, moe_intermediate 1408, 64 experts, top-6, uniform random routing", "rows": rows_json}),
    )
}

fn decode_plan(batch: usize, j: usize, vocab: usize) -> StepPlan {
    let pages = CTX / PAGE_SIZE;
    StepPlan {
        kind: StepKind::Decode,
        seqs: (0..batch)
            .map(|i| SeqStep {
                seq_id: i as u64,
                tokens: vec![(17 * i + j) as u32 % vocab as u32],
                context_len: CTX - 1,
                block_table: ((i * (pages + 1)) as u32..((i + 1) * (pages + 1)) as u32).collect(),
                logits: LogitsRequest::None,
                sample: Some(SampleRequest {
                    params: SamplingParams::greedy(),
                    seed: i as u64,
                    top_logprobs: None,
                    penalty: None,
                }),
            })
            .collect(),
    }
}

fn decode_model(dev: &Device, cfg: &ModelConfig, max_b: usize) -> anyhow::Result<CudaModel> {
    let weights = DeviceWeights::dummy(cfg, &dev.k, dev.stream(), 11)?;
    let pages = CTX / PAGE_SIZE;
    let opts = ModelOptions {
        limits: Limits { max_tokens: 256, max_seqs: max_b, max_logit_rows: max_b, max_kv_chunk: 16384 },
        gpu_memory_utilization: 0.9,
        num_blocks: Some(max_b * (pages + 1)),
        max_model_len: CTX + 64,
    };
    let model = CudaModel::new(dev, cfg.clone(), weights, &opts)?;
    // A cache full of random latents stands in for 4096 prefilled tokens per sequence.
    dev.k.fill_normal_bf16(dev.stream(), model.cache.slice(), Normal { mean: 0.0, std: 1.0, seed: 12 })?;
    dev.gpu.sync()?;
    Ok(model)
}

fn profile_steps(dev: Device, cfg: ModelConfig) -> anyhow::Result<()> {
    let mut model = decode_model(&dev, &cfg, 64)?;
    for b in [1, 64] {
        for j in 0..3 {
            model.step(&dev, &decode_plan(b, j, cfg.vocab_size))?;
        }
    }
    // SAFETY: plain driver calls on the current context; they only toggle profiling.
    unsafe { cudarc::driver::sys::cuProfilerStart() };
    for b in [1, 64] {
        model.step(&dev, &decode_plan(b, 9, cfg.vocab_size))?;
    }
    // SAFETY: as cuProfilerStart above.
    unsafe { cudarc::driver::sys::cuProfilerStop() };
    Ok(())
}

fn bench_decode_step(dev: Device, cfg: ModelConfig) -> anyhow::Result<Value> {
    let t0 = std::time::Instant::now();
    let mut model = decode_model(&dev, &cfg, 64)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut rows = vec![];
    for batch in [1usize, 64] {
        let plan = |j: usize| decode_plan(batch, j, cfg.vocab_size);
        for j in 0..3 {
            model.step(&dev, &plan(j))?;
        }
        let n = 20;
        let t = std::time::Instant::now();
        for j in 0..n {
            model.step(&dev, &plan(j))?;
        }
        let eager_ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        let (graph, _) = model.capture_decode(&dev, &plan(0))?;
        for j in 0..3 {
            model.replay_decode(&dev, &graph, &plan(j))?;
        }
        let t = std::time::Instant::now();
        for j in 0..n {
            model.replay_decode(&dev, &graph, &plan(j))?;
        }
        let graph_ms = t.elapsed().as_secs_f64() * 1e3 / n as f64;
        let tok_s = batch as f64 / (graph_ms * 1e-3);
        println!(
            "decode step B={batch:<3} ctx {CTX}: eager {eager_ms:.2} ms, graph {graph_ms:.2} ms = {tok_s:.0} tok/s"
        );
        rows.push(json!({"batch": batch, "context": CTX, "eager_ms": eager_ms, "graph_ms": graph_ms, "graph_splits": graph.splits, "tokens_per_s_graph": tok_s, "tokens_per_s_eager": batch as f64 / (eager_ms * 1e-3)}));
    }
    Ok(
        json!({"model": "deepseek-v2-lite shape, dummy weights drawn on the device", "dummy_weights_and_cache_fill_s": load_s, "weights_GiB": model.weights.bytes() as f64 / (1u64 << 30) as f64, "steps": rows}),
    )
}

/// Today's UTC date as YYYY-MM-DD (days-to-civil conversion, no date crate needed).
fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
