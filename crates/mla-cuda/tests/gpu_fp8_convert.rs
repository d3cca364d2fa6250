//! The device's block-FP8 quantizer and dequantizer (`ops::Fp8ConvertKernels`) bit for bit
//! against mla-core's host functions, which the CPU reference reads its FP8 weights through: the
//! quantizer must give the same bytes and scales (or the GPU would compute a different model than
//! the CPU reference under `--quantization fp8`), the dequantizer the same bf16 as rounding the
//! host's f32 dequantization. Weights with partial blocks in both dimensions, block magnitudes
//! over six decades, exact zeros, an all-zero block and values that land on e4m3 subnormals.
//!
//! Run on a GPU machine: `cargo test -p mla-cuda --test gpu_fp8_convert -- --ignored`.

mod common;

use common::*;
use half::bf16;
use mla_core::model::fp8::{quantize_block_fp8, scale_grid, DEEPSEEK_BLOCK};
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{Fp8Linear, FP8_BLOCK};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_quantizer_and_dequantizer_match_mla_core_bit_for_bit() {
    let dev = device();
    let mut rng = Rng::new(41);
    for (n, k) in [(576, 7168), (300, 208), (128, 128), (1, 16), (2112, 1536)] {
        let [gr, gc] = scale_grid(n, k, DEEPSEEK_BLOCK);
        // Each 128x128 block gets its own magnitude, 10^[-4, 2); block (0, 0) is all zeros and a
        // few values per block are exact zeros or 1e-5 of the block magnitude (e4m3 subnormals).
        let mags: Vec<f32> = rng.uniform(gr * gc, 3.0).iter().map(|u| 10f32.powf(u - 1.0)).collect();
        let u = rng.uniform(n * k, 1.0);
        let w: Vec<f32> = (0..n * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let b = (r / FP8_BLOCK) * gc + c / FP8_BLOCK;
                match (b, i % 97) {
                    (0, _) if gr * gc > 1 => 0.0,
                    (_, 0) => 0.0,
                    (_, 1) => mags[b] * 1e-5,
                    _ => mags[b] * u[i],
                }
            })
            .collect();
        let w = round(&w);
        let want = quantize_block_fp8(&w, n, k, DEEPSEEK_BLOCK);
        let wd = up_bf16(&w);
        let (qd, sd) = (up(&vec![0xffu8; n * k]), up(&vec![f32::NAN; gr * gc]));
        let lin = Fp8Linear { w: qd.slice(), scale_inv: sd.slice(), out: n, inp: k };
        dev.k.fp8_convert.quantize(dev.stream(), wd.slice(), &lin).unwrap();
        let back: DeviceBuffer<bf16> = up_bf16(&vec![f32::NAN; n * k]);
        dev.k.fp8_convert.dequantize(dev.stream(), &lin, back.slice()).unwrap();
        dev.gpu.sync().unwrap();
        let (bytes, scales) = (down(qd.slice()), down(sd.slice()));
        let scale_diff = scales.iter().zip(&want.scale_inv).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let byte_diff = bytes.iter().zip(&want.data).filter(|(a, b)| a != b).count();
        let back = down_bf16(back.slice());
        let host_back = round(&want.dequantize());
        let back_diff = back.iter().zip(&host_back).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        println!("[{n}, {k}]: {scale_diff} scales, {byte_diff} bytes, {back_diff} dequantized values differ");
        assert_eq!(scale_diff, 0, "[{n}, {k}]: scales differ from mla-core's");
        assert_eq!(byte_diff, 0, "[{n}, {k}]: e4m3 bytes differ from mla-core's");
        assert_eq!(back_diff, 0, "[{n}, {k}]: dequantized bf16 differs from the host's");
        // The test can fail: the subnormal and zero cases are really there.
        assert!(want.data.iter().any(|&b| b & 0x7f != 0 && b & 0x78 == 0), "[{n}, {k}]: no subnormal codes drawn");
    }
}
