//! The residual add + RMSNorm of every decoder layer (twice per layer), one CTA per row against
//! a row over a cluster of CTAs (`add_rmsnorm_as`), at V2-Lite's and V3's hidden sizes and 1 to
//! 256 rows: launched back to back as a step launches them, so each figure is a launch's cost
//! in a stream of kernels. The inputs stay in L2 (a decode step's residual does too).

use super::timing::{fill, time_ms};
use half::bf16;
use mla_cuda::gpu::DeviceBuffer;
use mla_cuda::ops::{AddRmsNorm, NormDelta};
use mla_cuda::Device;
use serde_json::{json, Value};

const HIDDEN: [usize; 2] = [2048, 7168];
const ROWS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 256];

pub fn run(dev: &Device) -> anyhow::Result<Value> {
    let mut out = vec![];
    for hidden in HIDDEN {
        let rows_max = ROWS[ROWS.len() - 1];
        let residual = DeviceBuffer::<f32>::alloc(rows_max * hidden)?;
        residual.upload_at(0, &vec![0f32; rows_max * hidden])?;
        let delta = fill(dev, rows_max * hidden, 1e-3, 3)?;
        let weight = fill(dev, hidden, 1.0, 4)?;
        let normed = DeviceBuffer::<bf16>::alloc(rows_max * hidden)?;
        for rows in ROWS {
            let norm = AddRmsNorm {
                residual: residual.sub(0, rows * hidden),
                delta: NormDelta::Bf16(delta.sub(0, rows * hidden)),
                weight: weight.slice(),
                out: normed.sub(0, rows * hidden),
                rows,
                hidden,
                eps: 1e-6,
            };
            let mut us = [0.0; 2];
            for (i, split) in [false, true].into_iter().enumerate() {
                us[i] = 1e3 * time_ms(dev, 200, 5, |_| dev.k.elementwise.add_rmsnorm_as(dev.stream(), &norm, split))?;
            }
            println!(
                "add_rmsnorm {rows:>3} x {hidden}: one CTA per row {:6.2} us, split over 8 {:6.2} us (default: {})",
                us[0],
                us[1],
                if dev.k.elementwise.splits_norm(rows, hidden) { "split" } else { "one CTA" }
            );
            out.push(json!({"hidden": hidden, "rows": rows, "row_us": us[0], "split_us": us[1],
                "default_split": dev.k.elementwise.splits_norm(rows, hidden)}));
        }
    }
    Ok(json!({ "add_rmsnorm": out }))
}
