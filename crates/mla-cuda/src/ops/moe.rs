//! kernels/moe.cu: MoE routing (top-k on the device, as HF transformers computes it), the grouping
//! of (token, slot) assignments by expert with the grouped GEMM's tile map, and the weighted
//! combine of the expert outputs. The GEMMs themselves are `grouped_gemm`'s.

use super::dims::{GROUPED_TILE_M, GROUPED_TILE_M_SM90, GROUPED_TILE_M_SMALL, MOE_ROUTE_MAX_SLOTS};
use super::ensure_len;
use crate::gpu::{Arg, DSlice, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;
use mla_core::model::config::TopkMethod;
use mla_core::ModelConfig;

/// Rows per grouped-GEMM tile; picks the kernel family and sizes the tile map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileM {
    /// mma.sync, 16 x 64 tiles: experts with few rows each (decode).
    Rows16,
    /// mma.sync, 64 x 128 tiles: prefill on GPUs without wgmma.
    Rows64,
    /// wgmma (sm_90a), 128-row tiles: prefill and large decode batches on Hopper.
    Rows128,
}

impl TileM {
    pub const ALL: [TileM; 3] = [TileM::Rows16, TileM::Rows64, TileM::Rows128];

    pub fn rows(self) -> usize {
        match self {
            TileM::Rows16 => GROUPED_TILE_M_SMALL,
            TileM::Rows64 => GROUPED_TILE_M,
            TileM::Rows128 => GROUPED_TILE_M_SM90,
        }
    }

    /// The tile height for a batch: small tiles when experts get at most 16 rows on average
    /// (decode), `large` otherwise.
    pub fn pick(tokens: usize, top_k: usize, experts: usize, large: TileM) -> TileM {
        if tokens * top_k <= GROUPED_TILE_M_SMALL * experts {
            TileM::Rows16
        } else {
            large
        }
    }
}

/// The router kernel's instances (kernels/moe.cu `moe_route_s*`): the experts a lane holds.
const ROUTE_INSTANCES: [(usize, &str); 4] =
    [(2, "moe_route_s2"), (4, "moe_route_s4"), (8, "moe_route_s8"), (16, "moe_route_s16")];

pub struct MoeKernels {
    /// One per `ROUTE_INSTANCES` entry.
    route: Vec<Kernel>,
    align: Kernel,
    combine: Kernel,
}

/// The router's selection rule; the discriminant is the kernel's `method` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMethod {
    Greedy = 0,
    GroupLimited = 1,
    NoauxTc = 2,
}

impl From<TopkMethod> for RouteMethod {
    fn from(m: TopkMethod) -> Self {
        match m {
            TopkMethod::Greedy => RouteMethod::Greedy,
            TopkMethod::GroupLimitedGreedy => RouteMethod::GroupLimited,
            TopkMethod::NoauxTc => RouteMethod::NoauxTc,
        }
    }
}

/// How a model's router picks and weighs experts (fixed per model).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteParams {
    pub method: RouteMethod,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl RouteParams {
    pub fn of(cfg: &ModelConfig) -> Self {
        RouteParams {
            method: cfg.topk_method.into(),
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.norm_topk_prob,
            routed_scaling_factor: cfg.routed_scaling_factor as f32,
        }
    }

    /// Experts one lane of the router kernel holds (kernels/moe.cu, `moe_route`): a run of
    /// 32 / n_group lanes per group when routing is group-limited, else one run of 32.
    pub fn lane_slots(&self, experts: usize) -> usize {
        let groups = if self.method != RouteMethod::Greedy && self.n_group > 1 { self.n_group } else { 1 };
        (experts / groups).div_ceil(32 / groups)
    }
}

/// Device buffers of one MoE routing, for `tokens` tokens.
pub struct MoeRouting<'a> {
    pub tokens: usize,
    /// Rows per grouped-GEMM tile: decides the tile map and which GEMM kernel runs.
    pub tile: TileM,
    pub experts: usize,
    pub top_k: usize,
    pub topk_ids: DSlice<'a, i32>,
    pub topk_w: DSlice<'a, f32>,
    pub expert_off: DSlice<'a, i32>,
    pub perm_src: DSlice<'a, i32>,
    pub inv_row: DSlice<'a, i32>,
    pub tile_expert: DSlice<'a, i32>,
    pub tile_row0: DSlice<'a, i32>,
    pub tile_rows: DSlice<'a, i32>,
    pub num_tiles: DSlice<'a, i32>,
}

impl MoeRouting<'_> {
    /// Upper bound on grouped-GEMM tiles of `tile` rows for `assignments` rows over `experts`.
    pub fn max_tiles(assignments: usize, experts: usize, tile: TileM) -> usize {
        assignments.div_ceil(tile.rows()) + experts.min(assignments)
    }

    /// Routed (token, slot) rows: the grouped GEMMs' row count.
    pub fn rows(&self) -> usize {
        self.tokens * self.top_k
    }
}

impl MoeKernels {
    pub fn load(m: &Modules) -> anyhow::Result<Self> {
        Ok(MoeKernels {
            route: ROUTE_INSTANCES.iter().map(|&(_, name)| m.kernel("moe", name)).collect::<Result<_, _>>()?,
            align: m.kernel("moe", "moe_align")?,
            combine: m.kernel("moe", "moe_combine")?,
        })
    }

    /// Router top-k from f32 logits [tokens, experts] into `r.topk_ids` / `r.topk_w`.
    pub fn route(
        &self,
        s: CUstream,
        logits: DSlice<f32>,
        bias: Option<DSlice<f32>>,
        r: &MoeRouting,
        p: &RouteParams,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(r.experts <= 256, "{} routed experts: the router kernel handles at most 256", r.experts);
        anyhow::ensure!(
            r.top_k <= 32.min(r.experts) && p.n_group <= 32 && r.experts.is_multiple_of(p.n_group.max(1)),
            "router: top_k {} / n_group {} unsupported with {} experts",
            r.top_k,
            p.n_group,
            r.experts
        );
        let slots = p.lane_slots(r.experts);
        let Some(instance) = ROUTE_INSTANCES.iter().position(|&(n, _)| n >= slots) else {
            anyhow::bail!(
                "router: {} experts in {} groups put {slots} experts on a lane, more than the kernel's {MOE_ROUTE_MAX_SLOTS}",
                r.experts,
                p.n_group
            );
        };
        ensure_len!(logits, r.tokens * r.experts, "router logits");
        ensure_len!(r.topk_ids, r.tokens * r.top_k, "top-k ids");
        ensure_len!(r.topk_w, r.tokens * r.top_k, "top-k weights");
        if p.method == RouteMethod::NoauxTc {
            anyhow::ensure!(bias.is_some(), "noaux_tc routing needs e_score_correction_bias");
        }
        let bias_ptr = match bias {
            Some(b) => {
                ensure_len!(b, r.experts, "correction bias");
                b.ptr
            }
            None => 0,
        };
        let warps_per_block = 4;
        self.route[instance].launch(
            s,
            (r.tokens.div_ceil(warps_per_block) as u32, 1, 1),
            (warps_per_block * 32) as u32,
            0,
            &[
                Arg::Ptr(logits.ptr),
                Arg::Ptr(bias_ptr),
                Arg::I32(r.tokens as i32),
                Arg::I32(r.experts as i32),
                Arg::I32(r.top_k as i32),
                Arg::I32(p.n_group.max(1) as i32),
                Arg::I32(p.topk_group.max(1) as i32),
                Arg::I32(p.method as i32),
                Arg::I32(p.norm_topk_prob as i32),
                Arg::F32(p.routed_scaling_factor),
                Arg::Ptr(r.topk_ids.ptr),
                Arg::Ptr(r.topk_w.ptr),
            ],
        )?;
        Ok(())
    }

    /// Groups the routed assignments by expert and builds the tile map.
    pub fn align(&self, s: CUstream, r: &MoeRouting) -> anyhow::Result<()> {
        let a = r.rows();
        anyhow::ensure!(r.experts <= 1024, "moe_align handles at most 1024 experts");
        ensure_len!(r.expert_off, r.experts + 1, "expert offsets");
        ensure_len!(r.perm_src, a, "grouped row sources");
        ensure_len!(r.inv_row, a, "assignment rows");
        let tiles = MoeRouting::max_tiles(a, r.experts, r.tile);
        for (b, n) in [(r.tile_expert, "tile experts"), (r.tile_row0, "tile rows"), (r.tile_rows, "tile sizes")] {
            ensure_len!(b, tiles, n);
        }
        ensure_len!(r.num_tiles, 1, "tile count");
        self.align.launch(
            s,
            (1, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(r.topk_ids.ptr),
                Arg::I32(a as i32),
                Arg::I32(r.top_k as i32),
                Arg::I32(r.experts as i32),
                Arg::I32(r.tile.rows() as i32),
                Arg::Ptr(r.expert_off.ptr),
                Arg::Ptr(r.perm_src.ptr),
                Arg::Ptr(r.inv_row.ptr),
                Arg::Ptr(r.tile_expert.ptr),
                Arg::Ptr(r.tile_row0.ptr),
                Arg::Ptr(r.tile_rows.ptr),
                Arg::Ptr(r.num_tiles.ptr),
            ],
        )?;
        Ok(())
    }

    /// `out[t] = Σ_j w[t, j] · y[inv_row[t, j]] (+ shared[t])`.
    pub fn combine(
        &self,
        s: CUstream,
        y: DSlice<bf16>,
        r: &MoeRouting,
        shared: Option<DSlice<bf16>>,
        out: DSlice<bf16>,
        hidden: usize,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            hidden.is_multiple_of(2) && r.top_k <= 32,
            "moe_combine needs an even hidden size and top_k <= 32"
        );
        ensure_len!(y, r.rows() * hidden, "expert outputs");
        ensure_len!(out, r.tokens * hidden, "MoE output");
        let shared_ptr = match shared {
            Some(sh) => {
                ensure_len!(sh, r.tokens * hidden, "shared-expert output");
                sh.ptr
            }
            None => 0,
        };
        self.combine.launch(
            s,
            (r.tokens as u32, hidden.div_ceil(512) as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(y.ptr),
                Arg::Ptr(r.inv_row.ptr),
                Arg::Ptr(r.topk_w.ptr),
                Arg::Ptr(shared_ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(r.top_k as i32),
                Arg::I32(hidden as i32),
            ],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(method: RouteMethod, n_group: usize) -> RouteParams {
        RouteParams { method, n_group, topk_group: 1, norm_topk_prob: true, routed_scaling_factor: 1.0 }
    }

    #[test]
    fn the_largest_router_instance_is_the_kernel_limit() {
        assert_eq!(ROUTE_INSTANCES.last().map(|i| i.0), Some(MOE_ROUTE_MAX_SLOTS));
        assert!(ROUTE_INSTANCES.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn router_lanes_hold_whole_groups_within_the_kernel_limit() {
        // V2-Lite, V2 and V3 as published, then the worst layout that n_group <= 32 allows.
        assert_eq!(params(RouteMethod::Greedy, 1).lane_slots(64), 2);
        assert_eq!(params(RouteMethod::GroupLimited, 8).lane_slots(160), 5);
        assert_eq!(params(RouteMethod::NoauxTc, 8).lane_slots(256), 8);
        assert_eq!(params(RouteMethod::NoauxTc, 17).lane_slots(255), 15);
        // Greedy routing ignores groups: one run of 32 lanes.
        assert_eq!(params(RouteMethod::Greedy, 8).lane_slots(256), 8);
        for n_group in 1..=32 {
            for experts in (n_group..=256).filter(|e| e % n_group == 0) {
                assert!(params(RouteMethod::NoauxTc, n_group).lane_slots(experts) <= MOE_ROUTE_MAX_SLOTS);
            }
        }
    }
}
