//! MoE routing, device-side grouping, grouped expert GEMM and combine.

use super::{ensure_len, grid_for, Kernels};
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Rows per grouped-GEMM tile of the two kernel variants (kernels/grouped_gemm.cu): 64 for
/// prefill, 16 for decode batches.
pub const GROUPED_TILE_M: usize = 64;
pub const GROUPED_TILE_M_SMALL: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMethod {
    Greedy = 0,
    GroupLimited = 1,
    NoauxTc = 2,
}

/// Device buffers of one MoE routing: sized for `max_tokens` tokens.
pub struct MoeRouting {
    pub tokens: usize,
    /// Rows per tile: GROUPED_TILE_M or GROUPED_TILE_M_SMALL (picks the GEMM variant).
    pub tile_m: usize,
    pub experts: usize,
    pub top_k: usize,
    pub topk_ids: DSlice<i32>,
    pub topk_w: DSlice<f32>,
    pub expert_off: DSlice<i32>,
    pub perm_src: DSlice<i32>,
    pub inv_row: DSlice<i32>,
    pub tile_expert: DSlice<i32>,
    pub tile_row0: DSlice<i32>,
    pub tile_rows: DSlice<i32>,
    pub num_tiles: DSlice<i32>,
}

impl MoeRouting {
    /// Upper bound on grouped-GEMM tiles of `tile_m` rows for `assignments` rows over `experts`.
    pub fn max_tiles(assignments: usize, experts: usize, tile_m: usize) -> usize {
        assignments.div_ceil(tile_m) + experts.min(assignments)
    }

    /// The tile height for a batch: small tiles when experts get few rows each (decode).
    pub fn pick_tile_m(tokens: usize, top_k: usize, experts: usize) -> usize {
        if tokens * top_k <= GROUPED_TILE_M_SMALL * experts {
            GROUPED_TILE_M_SMALL
        } else {
            GROUPED_TILE_M
        }
    }
}

impl Kernels {
    /// Router top-k from f32 logits [tokens, experts].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        s: CUstream,
        logits: DSlice<f32>,
        bias: Option<DSlice<f32>>,
        r: &MoeRouting,
        method: RouteMethod,
        n_group: usize,
        topk_group: usize,
        norm_topk: bool,
        routed_scale: f32,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(r.experts <= 256, "{} routed experts: the router kernel handles at most 256", r.experts);
        anyhow::ensure!(r.top_k <= 32 && n_group <= 32 && r.experts % n_group.max(1) == 0, "router: top_k {} / n_group {n_group} unsupported", r.top_k);
        ensure_len!(logits, r.tokens * r.experts, "router logits");
        ensure_len!(r.topk_ids, r.tokens * r.top_k, "top-k ids");
        ensure_len!(r.topk_w, r.tokens * r.top_k, "top-k weights");
        if method == RouteMethod::NoauxTc {
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
        self.moe_route.launch(
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
                Arg::I32(n_group.max(1) as i32),
                Arg::I32(topk_group.max(1) as i32),
                Arg::I32(method as i32),
                Arg::I32(norm_topk as i32),
                Arg::F32(routed_scale),
                Arg::Ptr(r.topk_ids.ptr),
                Arg::Ptr(r.topk_w.ptr),
            ],
        )?;
        Ok(())
    }

    /// Groups the routed assignments by expert and builds the tile map.
    pub fn moe_align(&self, s: CUstream, r: &MoeRouting) -> anyhow::Result<()> {
        let a = r.tokens * r.top_k;
        anyhow::ensure!(r.experts <= 1024, "moe_align handles at most 1024 experts");
        ensure_len!(r.expert_off, r.experts + 1, "expert offsets");
        ensure_len!(r.perm_src, a, "grouped row sources");
        ensure_len!(r.inv_row, a, "assignment rows");
        anyhow::ensure!(r.tile_m == GROUPED_TILE_M || r.tile_m == GROUPED_TILE_M_SMALL, "tile height {} has no GEMM variant", r.tile_m);
        let tiles = MoeRouting::max_tiles(a, r.experts, r.tile_m);
        for (b, n) in [(r.tile_expert, "tile experts"), (r.tile_row0, "tile rows"), (r.tile_rows, "tile sizes")] {
            ensure_len!(b, tiles, n);
        }
        ensure_len!(r.num_tiles, 1, "tile count");
        self.moe_align.launch(
            s,
            (1, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(r.topk_ids.ptr),
                Arg::I32(a as i32),
                Arg::I32(r.top_k as i32),
                Arg::I32(r.experts as i32),
                Arg::I32(r.tile_m as i32),
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

    /// grouped[row] = x[perm_src[row]] for every assignment row.
    pub fn moe_gather(&self, s: CUstream, x: DSlice<bf16>, r: &MoeRouting, grouped: DSlice<bf16>, hidden: usize) -> anyhow::Result<()> {
        let rows = r.tokens * r.top_k;
        anyhow::ensure!(hidden % 8 == 0, "hidden size {hidden} is not a multiple of 8");
        ensure_len!(x, r.tokens * hidden, "MoE input");
        ensure_len!(grouped, rows * hidden, "grouped rows");
        self.moe_gather.launch(
            s,
            (grid_for(self, rows * hidden / 8, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(x.ptr), Arg::Ptr(r.perm_src.ptr), Arg::Ptr(grouped.ptr), Arg::I32(rows as i32), Arg::I32(hidden as i32)],
        )?;
        Ok(())
    }

    /// C[rows of e] = A[rows of e] · W[e]ᵀ over all experts, W [experts, n, k].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped_gemm(&self, s: CUstream, a: DSlice<bf16>, w: DSlice<bf16>, c: DSlice<bf16>, n: usize, k: usize, r: &MoeRouting) -> anyhow::Result<()> {
        anyhow::ensure!(n % 8 == 0 && k % 8 == 0 && n > 0 && k > 0, "grouped GEMM needs N and K positive multiples of 8, got N={n} K={k}");
        let rows = r.tokens * r.top_k;
        ensure_len!(a, rows * k, "grouped GEMM input");
        ensure_len!(w, r.experts * n * k, "expert weights");
        ensure_len!(c, rows * n, "grouped GEMM output");
        let tiles = MoeRouting::max_tiles(rows, r.experts, r.tile_m);
        let (kernel, tile_n) = if r.tile_m == GROUPED_TILE_M_SMALL { (&self.moe_grouped_gemm_small, 64) } else { (&self.moe_grouped_gemm, 128) };
        kernel.launch(
            s,
            (n.div_ceil(tile_n) as u32, tiles as u32, 1),
            128,
            0,
            &[
                Arg::Ptr(a.ptr),
                Arg::Ptr(w.ptr),
                Arg::Ptr(c.ptr),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::Ptr(r.tile_expert.ptr),
                Arg::Ptr(r.tile_row0.ptr),
                Arg::Ptr(r.tile_rows.ptr),
                Arg::Ptr(r.num_tiles.ptr),
            ],
        )?;
        Ok(())
    }

    /// out[t] = Σ_j w[t, j] · y[inv_row[t, j]] (+ shared[t]).
    pub fn moe_combine(&self, s: CUstream, y: DSlice<bf16>, r: &MoeRouting, shared: Option<DSlice<bf16>>, out: DSlice<bf16>, hidden: usize) -> anyhow::Result<()> {
        anyhow::ensure!(hidden % 2 == 0 && r.top_k <= 32, "moe_combine needs an even hidden size and top_k <= 32");
        ensure_len!(y, r.tokens * r.top_k * hidden, "expert outputs");
        ensure_len!(out, r.tokens * hidden, "MoE output");
        let shared_ptr = match shared {
            Some(sh) => {
                ensure_len!(sh, r.tokens * hidden, "shared-expert output");
                sh.ptr
            }
            None => 0,
        };
        self.moe_combine.launch(
            s,
            (r.tokens as u32, hidden.div_ceil(512) as u32, 1),
            256,
            0,
            &[Arg::Ptr(y.ptr), Arg::Ptr(r.inv_row.ptr), Arg::Ptr(r.topk_w.ptr), Arg::Ptr(shared_ptr), Arg::Ptr(out.ptr), Arg::I32(r.top_k as i32), Arg::I32(hidden as i32)],
        )?;
        Ok(())
    }
}

impl Kernels {
    /// out[i] = x[idx[i]] for `rows` rows of `width` bf16 values (width % 8 == 0).
    pub fn gather_rows(&self, s: CUstream, x: DSlice<bf16>, idx: DSlice<i32>, out: DSlice<bf16>, rows: usize, width: usize) -> anyhow::Result<()> {
        anyhow::ensure!(width % 8 == 0, "row width {width} is not a multiple of 8");
        ensure_len!(idx, rows, "row indices");
        ensure_len!(out, rows * width, "gathered rows");
        self.moe_gather.launch(s, (grid_for(self, rows * width / 8, 256), 1, 1), 256, 0, &[Arg::Ptr(x.ptr), Arg::Ptr(idx.ptr), Arg::Ptr(out.ptr), Arg::I32(rows as i32), Arg::I32(width as i32)])?;
        Ok(())
    }
}
