//! The routed-expert GEMMs of V2-Lite (hidden 2048, moe_intermediate 1408, 64 experts, top-6):
//! gate/up GEMM with SiLU·mul, then down, over the device tile map, at 4096 and 1024 tokens
//! (prefill) and 256 and 64 (decode at B=256 and 64), for every tile height and wgmma schedule this GPU has: TFLOP/s and
//! expert-weight bandwidth, outputs cross-checked; with bf16 weights and with block-FP8 ones
//! (issue 12: e4m3 + 128x128 scales, dequantized to bf16 tiles in shared memory, W8A16), and on
//! Hopper W8A8 (the activations quantized per row and 128 columns, e4m3 wgmma; the quantizer
//! passes are timed with the GEMMs they feed).

use super::timing::{download_f32, fill, rel_diff, time_ms};
use half::bf16;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{
    ExpertMats, Fp8Act, GroupedGateUp, GroupedGemm, GroupedInput, MoeRouting, Sm90Schedule, Strided, TileM,
};
use mla_cuda::Device;
use serde_json::{json, Value};

const HIDDEN: usize = 2048;
const INTERMEDIATE: usize = 1408;
const EXPERTS: usize = 64;
const TOP_K: usize = 6;

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let (h, im, e, top) = (HIDDEN, INTERMEDIATE, EXPERTS, TOP_K);
    let (s, k) = (dev.stream(), &dev.k);
    let w_gu = fill(dev, e * 2 * im * h, 0.02, 11)?;
    let w_down = fill(dev, e * h * im, 0.02, 12)?;
    let bf16_bytes = ((e * 2 * im * h + e * h * im) * 2) as f64;
    // Random e4m3 codes other than NaN, one scale per 128x128 block of each expert.
    let codes = |n: usize, seed: u64| -> Vec<u8> {
        let mut st = seed;
        (0..n)
            .map(|_| {
                st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((st >> 33) % 255) as u8 & 0xfe
            })
            .collect()
    };
    let grid = |n: usize, kk: usize| e * n.div_ceil(128) * kk.div_ceil(128);
    let q_gu = DeviceBuffer::from_host(&codes(e * 2 * im * h, 21))?;
    let q_down = DeviceBuffer::from_host(&codes(e * h * im, 22))?;
    let s_gu = DeviceBuffer::from_host(&vec![1e-3f32; grid(2 * im, h)])?;
    let s_down = DeviceBuffer::from_host(&vec![1e-3f32; grid(h, im)])?;
    let fp8_bytes = (q_gu.len() + q_down.len() + 4 * (s_gu.len() + s_down.len())) as f64;
    let mut rows = vec![];
    for tokens in [4096usize, 1024, 256, 64] {
        let a = tokens * top;
        let ids = random_routing(tokens);
        let i32s = |n: usize| DeviceBuffer::<i32>::alloc(n);
        let tiles = MoeRouting::max_tiles(a, e, TileM::Rows16);
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
        // W8A8 scratch: the quantized expert inputs and activations with their scales.
        let (x_q, x_s) = (DeviceBuffer::<u8>::alloc(a * h)?, DeviceBuffer::<f32>::alloc(h.div_ceil(128) * a)?);
        let (act_q, act_s) = (DeviceBuffer::<u8>::alloc(a * im)?, DeviceBuffer::<f32>::alloc(im.div_ceil(128) * a)?);
        let x_fp8 = Fp8Act { q: x_q.slice(), scales: x_s.slice(), scale_ld: a };
        let act_fp8 = Fp8Act { q: act_q.slice(), scales: act_s.slice(), scale_ld: a };
        let mut variants = vec![];
        // 16-row tiles where the model takes them (at most 16 rows per expert on average).
        let small = TileM::pick(tokens, top, e, TileM::Rows64) == TileM::Rows16;
        for tile in [TileM::Rows16, TileM::Rows64].into_iter().filter(|&t| small || t != TileM::Rows16) {
            variants.extend([Format::Bf16, Format::Fp8].map(|f| (tile, Sm90Schedule::ALL[0], f)));
        }
        if k.grouped_gemm.available().contains(&TileM::Rows128) {
            variants.extend(
                Sm90Schedule::ALL
                    .into_iter()
                    .flat_map(|sc| [Format::Bf16, Format::Fp8].map(|f| (TileM::Rows128, sc, f))),
            );
        }
        if k.grouped_gemm.has_w8a8() {
            variants.extend(Sm90Schedule::W8A8.map(|sc| (TileM::Rows128, sc, Format::W8a8)));
        }
        let flops = 2.0 * a as f64 * (2 * im * h + h * im) as f64;
        let mut outputs: Vec<Vec<f32>> = vec![];
        let mut outputs_fp8: Vec<Vec<f32>> = vec![];
        let mut outputs_w8a8: Vec<Vec<f32>> = vec![];
        for (tile, sched, format) in variants {
            let fp8 = format != Format::Bf16;
            let (gu_w, down_w, weight_bytes) = if fp8 {
                (
                    ExpertMats::Fp8 { w: q_gu.slice(), scale_inv: s_gu.slice() },
                    ExpertMats::Fp8 { w: q_down.slice(), scale_inv: s_down.slice() },
                    fp8_bytes,
                )
            } else {
                (ExpertMats::Bf16(w_gu.slice()), ExpertMats::Bf16(w_down.slice()), bf16_bytes)
            };
            let tile_m = tile.rows();
            let r = MoeRouting {
                tokens,
                tile,
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
            k.moe.align(s, &r)?;
            dev.gpu.sync()?;
            // NaN everywhere, so that a row the GEMMs fail to write shows in the cross-check.
            y.upload(&vec![bf16::NAN; a * h])?;
            let wgmma = tile == TileM::Rows128;
            let w8a8 = format == Format::W8a8;
            // What the MoE layer runs: the tile for these weights, W8A8 on its wgmma tiles where
            // the GPU has it, and the schedule for the routing.
            let has_w8a8 = k.grouped_gemm.has_w8a8();
            let default = tile == k.grouped_gemm.tile_for_mats(tokens, top, e, fp8, has_w8a8)
                && w8a8 == (fp8 && has_w8a8 && tile == TileM::Rows128)
                && (!wgmma || sched == Sm90Schedule::for_routing(&r, w8a8));
            let (gu_in, down_in) = if w8a8 {
                (GroupedInput::Fp8(x_fp8), GroupedInput::Fp8(act_fp8))
            } else {
                (x.slice().into(), act.slice().into())
            };
            let fc = &k.fp8_convert;
            let gate_up = GroupedGateUp { a: gu_in, w: gu_w, gate_up: gu.slice(), act: act.slice(), inter: im, k: h };
            let gate_up_ms = time_ms(dev, 5, 9, |_| {
                if w8a8 {
                    fc.quantize_act(s, Strided::new(x.slice(), h), a, h, &x_fp8)?;
                }
                k.grouped_gemm.gate_up_act_with(s, &gate_up, &r, sched)
            })?;
            let down = GroupedGemm { a: down_in, w: down_w, c: y.slice(), n: h, k: im };
            let down_ms = time_ms(dev, 5, 9, |_| {
                if w8a8 {
                    fc.quantize_act(s, Strided::new(act.slice(), im), a, im, &act_fp8)?;
                }
                k.grouped_gemm.gemm_with(s, &down, &r, sched)
            })?;
            let ms = gate_up_ms + down_ms;
            let (tflops, tbps) = (flops / (ms * 1e-3) / 1e12, weight_bytes / (ms * 1e-3) / 1e12);
            let schedule = if wgmma {
                let how = if sched.persistent { "persistent" } else { "one block per item" };
                format!(", items of {} rows, {how}", sched.item_rows)
            } else {
                String::new()
            };
            let weights = format.name();
            println!(
                "MoE experts {weights} {tokens} tokens, tiles of {tile_m}{schedule}{}: gate/up+silu {gate_up_ms:.3} ms + down {down_ms:.3} ms = {ms:.3} ms, {tflops:.0} TFLOP/s, weights at {tbps:.2} TB/s",
                if default { " (default)" } else { "" }
            );
            match format {
                Format::Bf16 => &mut outputs,
                Format::Fp8 => &mut outputs_fp8,
                Format::W8a8 => &mut outputs_w8a8,
            }
            .push(download_f32(dev, &y)?);
            rows.push(json!({
                "weights": weights, "tokens": tokens, "assignments": a, "tile_m": tile_m,
                "wgmma_item_rows": if wgmma { sched.item_rows } else { 0 },
                "wgmma_persistent": wgmma && sched.persistent, "default": default,
                "gate_up_silu_ms": gate_up_ms, "down_ms": down_ms, "time_ms": ms, "flops": flops, "TFLOPs": tflops,
                "expert_weight_bytes": weight_bytes, "weight_TBps": tbps,
            }));
        }
        // Every variant computes the same function (the CPU-reference checks are in mla-cuda's
        // tests/gpu_moe.rs and gpu_moe_fp8.rs); W8A8 against the W8A16 FP8 output, within the
        // activation quantization's error.
        let w8a8_vs_fp8 = outputs_w8a8.iter().map(|o| (o, 6e-2));
        for (weights, outs) in [("bf16", &outputs), ("fp8", &outputs_fp8)] {
            for other in &outs[1..] {
                let (rel, finite) = rel_diff(&outs[0], other);
                println!("MoE experts {weights} {tokens} tokens: tile variant vs the first, output rel diff {rel:.2e}, all finite: {finite}");
                anyhow::ensure!(finite && rel < 1e-2, "grouped GEMM variants disagree: rel {rel}, finite {finite}");
            }
        }
        for (other, bound) in w8a8_vs_fp8 {
            let (rel, finite) = rel_diff(&outputs_fp8[0], other);
            println!(
                "MoE experts w8a8 {tokens} tokens: vs fp8 (W8A16), output rel diff {rel:.2e}, all finite: {finite}"
            );
            anyhow::ensure!(finite && rel < bound, "W8A8 grouped GEMM off W8A16: rel {rel}, finite {finite}");
        }
    }
    Ok(json!({
        "shape": "deepseek-v2-lite routed experts: hidden 2048, moe_intermediate 1408, 64 experts, top-6, uniform random routing",
        "rows": rows,
    }))
}

/// How the expert GEMMs compute: bf16 weights, block-FP8 weights dequantized to bf16 tiles
/// (W8A16), or FP8 weights and activations (W8A8).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Bf16,
    Fp8,
    W8a8,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Fp8 => "fp8",
            Format::W8a8 => "w8a8",
        }
    }
}

/// `TOP_K` distinct experts per token, uniform over `EXPERTS`, from a fixed LCG seeded by the
/// token count (so every run routes alike).
fn random_routing(tokens: usize) -> Vec<i32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ tokens as u64;
    let mut ids = Vec::with_capacity(tokens * TOP_K);
    for _ in 0..tokens {
        let mut chosen: Vec<i32> = vec![];
        while chosen.len() < TOP_K {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = ((state >> 33) % EXPERTS as u64) as i32;
            if !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        ids.extend(chosen);
    }
    ids
}
