//! MoE routing, device-side grouping, grouped expert GEMM and combine.

use super::{ensure_len, grid_for, Kernels};
use crate::gpu::{Arg, DSlice};
use cudarc::driver::sys::CUstream;
use half::bf16;

/// Rows per grouped-GEMM tile of the kernel variants: 64 for prefill and 16 for decode batches
/// (mma.sync, kernels/grouped_gemm.cu), 128 for the wgmma kernels that replace the 64-row one on
/// sm_90 (kernels/grouped_gemm_sm90.cu).
pub const GROUPED_TILE_M: usize = 64;
pub const GROUPED_TILE_M_SMALL: usize = 16;
pub const GROUPED_TILE_M_SM90: usize = 128;

/// Dynamic shared memory of the wgmma grouped GEMMs: 4 stages x (A [128 x 64] + W [256 x 64]) bf16
/// (6 stages of W [128 x 64] for the 128-row items: the same bytes) plus 1024 bytes of alignment
/// slack and 128 for the full/empty mbarriers of the ring (kernels/grouped_gemm_sm90.cu).
pub const GROUPED_SM90_SMEM_BYTES: usize = 4 * (128 + 256) * 64 * 2 + 1024 + 128;

/// How the wgmma grouped GEMMs split and schedule their work: `item_rows` weight rows per work
/// item (256, or 128: twice the items, so a decode step's weight stream spreads evenly over the
/// SMs), and a `persistent` grid of one block per SM whose producer warpgroup runs across items
/// (the next item's loads fly during an epilogue) or one block per worst-case item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sm90Schedule {
    pub item_rows: usize,
    pub persistent: bool,
}

impl Sm90Schedule {
    /// Every schedule the kernels support (tests and benchmarks run each).
    pub const ALL: [Sm90Schedule; 4] = [
        Sm90Schedule { item_rows: 256, persistent: false },
        Sm90Schedule { item_rows: 256, persistent: true },
        Sm90Schedule { item_rows: 128, persistent: false },
        Sm90Schedule { item_rows: 128, persistent: true },
    ];
}

/// Threads per block of the wgmma grouped GEMMs: a producer warpgroup that loads and two
/// warpgroups that multiply (kernels/grouped_gemm_sm90.cu).
const SM90_THREADS: u32 = 384;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMethod {
    Greedy = 0,
    GroupLimited = 1,
    NoauxTc = 2,
}

/// Device buffers of one MoE routing: sized for `max_tokens` tokens.
pub struct MoeRouting {
    pub tokens: usize,
    /// Rows per tile: GROUPED_TILE_M, GROUPED_TILE_M_SMALL or GROUPED_TILE_M_SM90 (picks the GEMM
    /// variant; `Kernels::moe_tile_m` chooses).
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

    /// The tile height for a batch: small tiles when experts get few rows each (decode),
    /// `large_tile_m` otherwise.
    pub fn pick_tile_m(tokens: usize, top_k: usize, experts: usize, large_tile_m: usize) -> usize {
        if tokens * top_k <= GROUPED_TILE_M_SMALL * experts {
            GROUPED_TILE_M_SMALL
        } else {
            large_tile_m
        }
    }
}

impl Kernels {
    /// The grouped-GEMM tile height for a batch on this GPU: 16-row mma.sync tiles when experts
    /// get at most 16 rows on average, otherwise the wgmma kernel's 128-row tiles on sm_90 and
    /// mma.sync's 64-row tiles elsewhere.
    pub fn moe_tile_m(&self, tokens: usize, top_k: usize, experts: usize) -> usize {
        MoeRouting::pick_tile_m(
            tokens,
            top_k,
            experts,
            if self.moe_wgmma { GROUPED_TILE_M_SM90 } else { GROUPED_TILE_M },
        )
    }

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
        anyhow::ensure!(
            r.top_k <= 32 && n_group <= 32 && r.experts.is_multiple_of(n_group.max(1)),
            "router: top_k {} / n_group {n_group} unsupported",
            r.top_k
        );
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
        anyhow::ensure!(
            [GROUPED_TILE_M, GROUPED_TILE_M_SMALL, GROUPED_TILE_M_SM90].contains(&r.tile_m),
            "tile height {} has no GEMM variant",
            r.tile_m
        );
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
    pub fn moe_gather(
        &self,
        s: CUstream,
        x: DSlice<bf16>,
        r: &MoeRouting,
        grouped: DSlice<bf16>,
        hidden: usize,
    ) -> anyhow::Result<()> {
        let rows = r.tokens * r.top_k;
        anyhow::ensure!(hidden.is_multiple_of(8), "hidden size {hidden} is not a multiple of 8");
        ensure_len!(x, r.tokens * hidden, "MoE input");
        ensure_len!(grouped, rows * hidden, "grouped rows");
        self.moe_gather.launch(
            s,
            (grid_for(self, rows * hidden / 8, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(r.perm_src.ptr),
                Arg::Ptr(grouped.ptr),
                Arg::I32(rows as i32),
                Arg::I32(hidden as i32),
            ],
        )?;
        Ok(())
    }

    /// The wgmma kernels' schedule for this routing (H200, docs/cuda-notes.md runs M1-M3 and
    /// G1-G2): when the experts get at most 64 rows on average (decode-sized, memory-bound)
    /// 128-row items on a persistent grid; otherwise (prefill-sized, compute-bound) 256-row
    /// items, one block each.
    pub fn moe_sm90_schedule(&self, r: &MoeRouting) -> Sm90Schedule {
        if r.tokens * r.top_k <= 64 * r.experts {
            Sm90Schedule { item_rows: 128, persistent: true }
        } else {
            Sm90Schedule { item_rows: 256, persistent: false }
        }
    }

    /// C[rows of e] = A[rows of e] · W[e]ᵀ over all experts, W [experts, n, k].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped_gemm(
        &self,
        s: CUstream,
        a: DSlice<bf16>,
        w: DSlice<bf16>,
        c: DSlice<bf16>,
        n: usize,
        k: usize,
        r: &MoeRouting,
    ) -> anyhow::Result<()> {
        self.moe_grouped_gemm_with(s, a, w, c, n, k, r, self.moe_sm90_schedule(r))
    }

    /// `moe_grouped_gemm` with the wgmma kernels' schedule chosen (tests and benchmarks).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped_gemm_with(
        &self,
        s: CUstream,
        a: DSlice<bf16>,
        w: DSlice<bf16>,
        c: DSlice<bf16>,
        n: usize,
        k: usize,
        r: &MoeRouting,
        sched: Sm90Schedule,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            n.is_multiple_of(8) && k.is_multiple_of(8) && n > 0 && k > 0,
            "grouped GEMM needs N and K positive multiples of 8, got N={n} K={k}"
        );
        let rows = r.tokens * r.top_k;
        ensure_len!(a, rows * k, "grouped GEMM input");
        ensure_len!(w, r.experts * n * k, "expert weights");
        ensure_len!(c, rows * n, "grouped GEMM output");
        let tiles = MoeRouting::max_tiles(rows, r.experts, r.tile_m) as u32;
        match r.tile_m {
            GROUPED_TILE_M_SMALL => self.launch_grouped(
                s,
                &self.moe_grouped_gemm_small,
                ((n.div_ceil(64)) as u32, tiles),
                128,
                0,
                a,
                w,
                c,
                n,
                k,
                r,
            ),
            GROUPED_TILE_M => self.launch_grouped(
                s,
                &self.moe_grouped_gemm,
                ((n.div_ceil(128)) as u32, tiles),
                128,
                0,
                a,
                w,
                c,
                n,
                k,
                r,
            ),
            _ => {
                let kernel = self.sm90_kernel(r, sched.item_rows, false)?;
                self.launch_grouped(
                    s,
                    kernel,
                    (self.sm90_grid(r, n.div_ceil(sched.item_rows), sched.persistent), 1),
                    SM90_THREADS,
                    GROUPED_SM90_SMEM_BYTES,
                    a,
                    w,
                    c,
                    n,
                    k,
                    r,
                )
            }
        }
    }

    /// act[rows of e] = silu(A · gate[e]ᵀ) · (A · up[e]ᵀ) over all experts, W [experts, 2·inter, k]
    /// (gate rows then up rows). With 128-row tiles one wgmma kernel computes it with SiLU·mul in
    /// its epilogue; otherwise the grouped GEMM writes [rows, 2·inter] into `gate_up` and
    /// silu_mul reduces it (`gate_up` is unused on the fused path).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_act(
        &self,
        s: CUstream,
        a: DSlice<bf16>,
        w: DSlice<bf16>,
        gate_up: DSlice<bf16>,
        act: DSlice<bf16>,
        inter: usize,
        k: usize,
        r: &MoeRouting,
    ) -> anyhow::Result<()> {
        self.moe_gate_up_act_with(s, a, w, gate_up, act, inter, k, r, self.moe_sm90_schedule(r))
    }

    /// `moe_gate_up_act` with the wgmma kernels' schedule chosen (tests and benchmarks).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_act_with(
        &self,
        s: CUstream,
        a: DSlice<bf16>,
        w: DSlice<bf16>,
        gate_up: DSlice<bf16>,
        act: DSlice<bf16>,
        inter: usize,
        k: usize,
        r: &MoeRouting,
        sched: Sm90Schedule,
    ) -> anyhow::Result<()> {
        let rows = r.tokens * r.top_k;
        if r.tile_m != GROUPED_TILE_M_SM90 {
            self.moe_grouped_gemm(s, a, w, gate_up, 2 * inter, k, r)?;
            return self.silu_mul(s, gate_up, act, rows, inter);
        }
        anyhow::ensure!(
            inter.is_multiple_of(8) && k.is_multiple_of(8) && inter > 0 && k > 0,
            "grouped GEMM needs the width and K positive multiples of 8, got {inter} and K={k}"
        );
        ensure_len!(a, rows * k, "grouped GEMM input");
        ensure_len!(w, r.experts * 2 * inter * k, "expert gate/up weights");
        ensure_len!(act, rows * inter, "expert activations");
        let kernel = self.sm90_kernel(r, sched.item_rows, true)?;
        // An item covers item_rows / 2 gate rows and as many up rows: that many act columns.
        self.launch_grouped(
            s,
            kernel,
            (self.sm90_grid(r, inter.div_ceil(sched.item_rows / 2), sched.persistent), 1),
            SM90_THREADS,
            GROUPED_SM90_SMEM_BYTES,
            a,
            w,
            act,
            inter,
            k,
            r,
        )
    }

    fn sm90_kernel(&self, r: &MoeRouting, item_rows: usize, silu: bool) -> anyhow::Result<&crate::gpu::Kernel> {
        anyhow::ensure!(
            self.moe_wgmma,
            "the wgmma grouped GEMM (tiles of {} rows) needs compute capability 9.0",
            r.tile_m
        );
        Ok(match (item_rows, silu) {
            (256, false) => &self.moe_grouped_gemm_sm90,
            (256, true) => &self.moe_grouped_gemm_silu_sm90,
            (128, false) => &self.moe_grouped_gemm_sm90_n128,
            (128, true) => &self.moe_grouped_gemm_silu_sm90_n128,
            _ => anyhow::bail!("the wgmma grouped GEMM has items of 256 or 128 weight rows, not {item_rows}"),
        })
    }

    /// Grid of the wgmma kernels: one block per worst-case item, or persistent, one block per SM
    /// (the kernels loop over their items either way; blocks past the device's item count exit).
    fn sm90_grid(&self, r: &MoeRouting, col_blocks: usize, persistent: bool) -> u32 {
        let items = MoeRouting::max_tiles(r.tokens * r.top_k, r.experts, r.tile_m) * col_blocks;
        if persistent {
            items.clamp(1, self.sm_count) as u32
        } else {
            items.max(1) as u32
        }
    }

    /// One launch of a grouped-GEMM kernel (the tile map and its count are read on the device).
    #[allow(clippy::too_many_arguments)]
    fn launch_grouped(
        &self,
        s: CUstream,
        kernel: &crate::gpu::Kernel,
        grid: (u32, u32),
        threads: u32,
        smem: usize,
        a: DSlice<bf16>,
        w: DSlice<bf16>,
        c: DSlice<bf16>,
        n: usize,
        k: usize,
        r: &MoeRouting,
    ) -> anyhow::Result<()> {
        kernel.launch(
            s,
            (grid.0, grid.1, 1),
            threads,
            smem as u32,
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
    pub fn moe_combine(
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

impl Kernels {
    /// out[i] = x[idx[i]] for `rows` rows of `width` bf16 values (width % 8 == 0).
    pub fn gather_rows(
        &self,
        s: CUstream,
        x: DSlice<bf16>,
        idx: DSlice<i32>,
        out: DSlice<bf16>,
        rows: usize,
        width: usize,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(width.is_multiple_of(8), "row width {width} is not a multiple of 8");
        ensure_len!(idx, rows, "row indices");
        ensure_len!(out, rows * width, "gathered rows");
        self.moe_gather.launch(
            s,
            (grid_for(self, rows * width / 8, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(x.ptr), Arg::Ptr(idx.ptr), Arg::Ptr(out.ptr), Arg::I32(rows as i32), Arg::I32(width as i32)],
        )?;
        Ok(())
    }
}
