//! One layer's FFN on the device: a dense SiLU MLP or DeepSeekMoE (router, grouped expert GEMMs
//! in bf16 or W8A8, shared experts), run through the rank's mode (`parallel`), which gathers and
//! reduces the rows around it.

use super::forward::{rows, CudaModel};
use super::moe_small::{self, MoeSmallIo};
use super::parallel::{FfnIo, FfnRows};
use super::weights::{FfnWeights, MlpWeights, MoeWeights};
use crate::device::Device;
use crate::gpu::DSlice;
use crate::ops::{GroupedGateUp, GroupedGemm, GroupedInput, MoeGemvRouter, NormDelta, Strided};
use half::bf16;

impl CudaModel {
    /// One layer's FFN (dense MLP or MoE) over the step's `t` rows, with the collectives of the
    /// rank's mode around it; returns what to add to the residual. `rows` lays out DP
    /// attention's gathered rows.
    pub(super) fn ffn(&self, dev: &Device, ffn: &FfnWeights, t: usize, rows: FfnRows) -> anyhow::Result<NormDelta<'_>> {
        let ws = &self.ws;
        let io = FfnIo { h: ws.h.slice(), out: ws.ffn_out.slice(), rows: t, hidden: self.cfg.hidden_size };
        self.mode.ffn(dev, io, rows, |x, n, out| match ffn {
            FfnWeights::Dense(mlp) => self.mlp(dev, mlp, x, n, out),
            FfnWeights::Moe(moe) => self.moe(dev, moe, x, n, out),
        })
    }

    /// A SiLU MLP over `t` rows of `x` into `out`.
    fn mlp(&self, dev: &Device, w: &MlpWeights, x: DSlice<bf16>, t: usize, out: DSlice<bf16>) -> anyhow::Result<()> {
        let hidden = self.cfg.hidden_size;
        let inter = w.down.inp;
        let ws = &self.ws;
        let x = Strided::new(x, hidden);
        self.linears.linear(dev, &w.gate_up.proj(), x, t, rows(&ws.gate_up, 2 * inter))?;
        dev.k.elementwise.silu_mul(dev.stream(), ws.gate_up.slice(), ws.act.slice(), t, inter)?;
        self.linears.linear(dev, &w.down.proj(), rows(&ws.act, inter), t, Strided::new(out, hidden))?;
        Ok(())
    }

    /// DeepSeekMoE over `t` rows of `x` into `out`: routed experts plus the shared ones.
    fn moe(&self, dev: &Device, w: &MoeWeights, x: DSlice<bf16>, t: usize, out: DSlice<bf16>) -> anyhow::Result<()> {
        let (s, k) = (dev.stream(), &dev.k);
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let ws = &self.ws;
        let mb = ws.moe.as_ref().expect("MoE buffers exist when a layer is MoE");
        let fp8 = w.gate_up.mats().is_fp8();
        // W8A8 where its scratch exists (FP8 experts on Hopper, `fp8_w8a8` on).
        let fp8_act = mb.fp8_act.as_ref().filter(|_| fp8);
        let tile =
            k.grouped_gemm.tile_for_mats(t, cfg.num_experts_per_tok, cfg.n_routed_experts, fp8, fp8_act.is_some());
        let r = mb.routing(t, cfg, tile);
        let (e, im) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        // Router logits (f32, as HF), then the top-k, on either path.
        if k.moe_gemv.routes(t, hidden) {
            let p = MoeGemvRouter {
                tokens: t,
                experts: e,
                hidden,
                x,
                router: w.router.slice(),
                logits: mb.router_logits.slice(),
            };
            k.moe_gemv.router(s, &p)?;
        } else {
            k.elementwise.bf16_to_f32(s, x.sub(0, t * hidden), mb.h_f32.slice(), t * hidden)?;
            dev.blas.linear_f32(w.router.slice(), e, hidden, mb.h_f32.slice(), t, mb.router_logits.slice())?;
        }
        k.moe.route(s, mb.router_logits.slice(), w.bias.as_ref().map(|b| b.slice()), &r, &self.route)?;
        if moe_small::takes(cfg, w, t, k.moe_gemv.max_tokens()) {
            let io = MoeSmallIo {
                tokens: t,
                x,
                routing: &r,
                act: mb.grouped_act.slice(),
                act_shared: mb.grouped_gate_up.slice(),
                out,
            };
            return moe_small::experts(dev, cfg, w, &io);
        }
        k.moe.align(s, &r)?;
        let rows = r.rows();
        // The expert inputs, grouped by expert: gathered in bf16, or gathered and quantized in
        // one pass for W8A8 (whose tile map `tile_for_mats` made the wgmma one).
        let (gate_up_in, down_in) = match fp8_act {
            Some(q) => {
                k.fp8_convert.quantize_act_gather(
                    s,
                    Strided::new(x, hidden),
                    r.perm_src,
                    rows,
                    hidden,
                    &q.gate_up_input(),
                )?;
                (GroupedInput::Fp8(q.gate_up_input()), GroupedInput::Fp8(q.down_input()))
            }
            None => {
                k.elementwise.gather_rows(s, x, r.perm_src, mb.grouped_x.slice(), rows, hidden)?;
                (mb.grouped_x.slice().into(), mb.grouped_act.slice().into())
            }
        };
        let gate_up = GroupedGateUp {
            a: gate_up_in,
            w: w.gate_up.mats(),
            gate_up: mb.grouped_gate_up.slice(),
            act: mb.grouped_act.slice(),
            inter: im,
            k: hidden,
        };
        k.grouped_gemm.gate_up_act(s, &gate_up, &r)?;
        if let Some(q) = fp8_act {
            k.fp8_convert.quantize_act(s, Strided::new(mb.grouped_act.slice(), im), rows, im, &q.down_input())?;
        }
        let down = GroupedGemm { a: down_in, w: w.down.mats(), c: mb.grouped_y.slice(), n: hidden, k: im };
        k.grouped_gemm.gemm(s, &down, &r)?;
        let shared = match &w.shared {
            Some(sh) => {
                self.mlp(dev, sh, x, t, mb.shared_out.slice())?;
                Some(mb.shared_out.slice())
            }
            None => None,
        };
        k.moe.combine(s, mb.grouped_y.slice(), &r, shared, out, hidden)?;
        Ok(())
    }
}
