//! kernels/grouped_gemm.cu and grouped_gemm_sm90.cu: the expert GEMMs over rows grouped by expert
//! (`MoeKernels::align`'s tile map), in three kernel families chosen by the tile height: mma.sync
//! tiles of 16 rows (decode-sized batches) or 64 rows, and on sm_90 warp-specialised wgmma kernels
//! of 128 rows, with SiLU·mul fused into the gate/up GEMM. Every family also takes block-FP8
//! expert weights (dequantized to bf16 as they are staged into shared memory, W8A16); the wgmma
//! family also computes in FP8 (W8A8: e4m3 activations quantized per row and 128 columns by
//! `Fp8ConvertKernels::quantize_act`, 128-row items).

use super::dims::{GROUPED_SM90_FP8_SMEM_BYTES, GROUPED_SM90_SMEM_BYTES, GROUPED_SM90_THREADS};
use super::expert_mats::ExpertMats;
use super::fp8_gemm::Fp8Act;
use super::linear::FP8_BLOCK;
use super::moe::{MoeRouting, TileM};
use super::{ensure_len, ensure_smem, grid_for};
use crate::gpu::{Arg, DSlice, GpuInfo, Kernel, Modules};
use cudarc::driver::sys::CUstream;
use half::bf16;

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

    /// The W8A8 kernels' schedules (128-row items only: two f32 accumulator sets of 256 columns
    /// would not fit a thread's registers).
    pub const W8A8: [Sm90Schedule; 2] =
        [Sm90Schedule { item_rows: 128, persistent: false }, Sm90Schedule { item_rows: 128, persistent: true }];

    /// The schedule for a routing (H200, docs/runs/2026-11-22.md runs M1-M3 and G1-G2): when the
    /// experts get at most 64 rows on average (decode-sized, memory-bound) 128-row items on a
    /// persistent grid; otherwise (prefill-sized, compute-bound) 256-row items, one block each.
    /// W8A8 (`fp8_act`) always takes 128-row items on a persistent grid, which beat one block
    /// per item at every size measured (V2-Lite's experts at 256 / 1024 / 4096 tokens: 0.270 /
    /// 0.334 / 0.965 ms against 0.316 / 0.384 / 1.065; H100, run F11 in docs/runs/2026-11-26.md).
    pub fn for_routing(r: &MoeRouting, fp8_act: bool) -> Sm90Schedule {
        let small = r.rows() <= 64 * r.experts;
        Sm90Schedule { item_rows: if small || fp8_act { 128 } else { 256 }, persistent: small || fp8_act }
    }
}

/// The activations of a grouped GEMM: bf16, or e4m3 with their per-row, per-128-column scales
/// (W8A8; the weights must then be block-FP8 and the tiles 128 rows).
#[derive(Clone, Copy)]
pub enum GroupedInput<'a> {
    Bf16(DSlice<'a, bf16>),
    Fp8(Fp8Act<'a>),
}

impl<'a> From<DSlice<'a, bf16>> for GroupedInput<'a> {
    fn from(a: DSlice<'a, bf16>) -> Self {
        GroupedInput::Bf16(a)
    }
}

impl GroupedInput<'_> {
    pub fn is_fp8(&self) -> bool {
        matches!(self, GroupedInput::Fp8(_))
    }

    /// The kernels' leading arguments for `rows` rows of width `k`, after checking the sizes.
    fn args(&self, rows: usize, k: usize) -> anyhow::Result<Vec<Arg>> {
        Ok(match self {
            GroupedInput::Bf16(a) => {
                ensure_len!(*a, rows * k, "grouped GEMM input");
                vec![Arg::Ptr(a.ptr)]
            }
            GroupedInput::Fp8(a) => {
                ensure_len!(a.q, rows * k, "grouped GEMM FP8 input");
                anyhow::ensure!(
                    a.scale_ld >= rows,
                    "grouped GEMM FP8 input: scales for {} rows, {rows} rows",
                    a.scale_ld
                );
                ensure_len!(a.scales, k.div_ceil(FP8_BLOCK) * a.scale_ld, "grouped GEMM FP8 input scales");
                vec![Arg::Ptr(a.q.ptr), Arg::Ptr(a.scales.ptr), Arg::I32(a.scale_ld as i32)]
            }
        })
    }
}

/// `c[rows of e] = a[rows of e] · w[e]ᵀ` over every expert, w `[experts, n, k]`.
pub struct GroupedGemm<'a> {
    pub a: GroupedInput<'a>,
    pub w: ExpertMats<'a>,
    pub c: DSlice<'a, bf16>,
    pub n: usize,
    pub k: usize,
}

/// `act[rows of e] = silu(a · gate[e]ᵀ) · (a · up[e]ᵀ)` over every expert, w `[experts, 2·inter, k]`
/// (gate rows then up rows). `gate_up` `[rows, 2·inter]` is scratch for the unfused tile sizes.
/// Block-FP8 weights need `inter % 128 == 0` (the gate and up scale grids then stack exactly).
pub struct GroupedGateUp<'a> {
    pub a: GroupedInput<'a>,
    pub w: ExpertMats<'a>,
    pub gate_up: DSlice<'a, bf16>,
    pub act: DSlice<'a, bf16>,
    pub inter: usize,
    pub k: usize,
}

pub struct GroupedGemmKernels {
    rows16: Kernel,
    rows64: Kernel,
    /// The same two on block-FP8 weights.
    rows16_fp8: Kernel,
    rows64_fp8: Kernel,
    /// The four wgmma kernels (256- and 128-row items, plain and SiLU-fused), sm_90a only, on
    /// bf16 and on block-FP8 weights, and the W8A8 pair (128-row items, plain and SiLU-fused).
    wgmma: Option<[Sm90Kernels; 2]>,
    w8a8: Option<[Kernel; 2]>,
    /// elementwise.cu's silu_mul: the second half of the gate/up path when SiLU is not fused.
    silu_mul: Kernel,
    sm_count: usize,
}

struct Sm90Kernels {
    items256: Kernel,
    items256_silu: Kernel,
    items128: Kernel,
    items128_silu: Kernel,
}

impl GroupedGemmKernels {
    pub fn load(m: &Modules, info: &GpuInfo) -> anyhow::Result<Self> {
        // Like the wgmma attention kernel, these exist only in the sm_90a cubin.
        let (wgmma, w8a8) = if info.compute_capability == (9, 0) {
            ensure_smem(info, GROUPED_SM90_SMEM_BYTES, "the wgmma grouped GEMM")?;
            ensure_smem(info, GROUPED_SM90_FP8_SMEM_BYTES, "the wgmma grouped GEMM on FP8 weights")?;
            // A kernel of grouped_gemm_sm90.cu, allowed `smem` bytes of dynamic shared memory.
            let kernel = |name: &'static str, smem: usize| -> anyhow::Result<Kernel> {
                let k = m.kernel("grouped_gemm_sm90", name)?;
                k.set_max_dynamic_smem(smem)?;
                Ok(k)
            };
            let family = |[a, b, c, d]: [&'static str; 4], smem: usize| -> anyhow::Result<Sm90Kernels> {
                let k = |name| kernel(name, smem);
                Ok(Sm90Kernels { items256: k(a)?, items256_silu: k(b)?, items128: k(c)?, items128_silu: k(d)? })
            };
            let bf16 = [
                "moe_grouped_gemm_sm90",
                "moe_grouped_gemm_silu_sm90",
                "moe_grouped_gemm_sm90_n128",
                "moe_grouped_gemm_silu_sm90_n128",
            ];
            let fp8 = [
                "moe_grouped_gemm_sm90_fp8",
                "moe_grouped_gemm_silu_sm90_fp8",
                "moe_grouped_gemm_sm90_n128_fp8",
                "moe_grouped_gemm_silu_sm90_n128_fp8",
            ];
            let w8a8 = [
                kernel("moe_grouped_gemm_sm90_n128_w8a8", GROUPED_SM90_SMEM_BYTES)?,
                kernel("moe_grouped_gemm_silu_sm90_n128_w8a8", GROUPED_SM90_SMEM_BYTES)?,
            ];
            (Some([family(bf16, GROUPED_SM90_SMEM_BYTES)?, family(fp8, GROUPED_SM90_FP8_SMEM_BYTES)?]), Some(w8a8))
        } else {
            (None, None)
        };
        Ok(GroupedGemmKernels {
            rows16: m.kernel("grouped_gemm", "moe_grouped_gemm_small")?,
            rows64: m.kernel("grouped_gemm", "moe_grouped_gemm")?,
            rows16_fp8: m.kernel("grouped_gemm", "moe_grouped_gemm_small_fp8")?,
            rows64_fp8: m.kernel("grouped_gemm", "moe_grouped_gemm_fp8")?,
            wgmma,
            w8a8,
            silu_mul: m.kernel("elementwise", "silu_mul")?,
            sm_count: info.sm_count,
        })
    }

    /// The tile heights this GPU runs (tests and benchmarks run each).
    pub fn available(&self) -> Vec<TileM> {
        TileM::ALL.into_iter().filter(|&t| t != TileM::Rows128 || self.wgmma.is_some()).collect()
    }

    /// The tile heights this GPU runs on block-FP8 weights (every family has FP8 kernels).
    pub fn available_fp8(&self) -> Vec<TileM> {
        self.available()
    }

    /// Whether this GPU has the W8A8 kernels (sm_90a).
    pub fn has_w8a8(&self) -> bool {
        self.w8a8.is_some()
    }

    /// The tile height for a batch on this GPU: 16-row tiles when experts get at most 16 rows on
    /// average, otherwise the wgmma kernel's 128-row tiles on sm_90 and 64-row tiles elsewhere.
    pub fn tile_for(&self, tokens: usize, top_k: usize, experts: usize) -> TileM {
        TileM::pick(tokens, top_k, experts, if self.wgmma.is_some() { TileM::Rows128 } else { TileM::Rows64 })
    }

    /// `tile_for` for weights in a given format (`fp8`: block-FP8; `w8a8`: their activations
    /// quantized too). The W8A16 wgmma kernels convert each weight slice through registers with
    /// one raw slice in flight, and lose to the 64-row mma.sync ones while experts get at most 64
    /// rows each (V2-Lite's experts at 256 tokens: 0.455 ms against 0.531 to 0.584 ms; H100, run F25
    /// in docs/runs/2026-11-26.md), so W8A16 takes 64-row tiles there and the wgmma kernels only
    /// for prefill-sized batches (1.71 ms against 2.80 ms at 4096 tokens). W8A8 copies its operands
    /// as stored and takes the wgmma tiles at every size: at 64 tokens (6 rows per expert) 0.211
    /// ms against 0.358 ms for the 16-row W8A16 tiles and 0.420 ms for bf16 (H100, run F14).
    pub fn tile_for_mats(&self, tokens: usize, top_k: usize, experts: usize, fp8: bool, w8a8: bool) -> TileM {
        if fp8 && w8a8 && self.w8a8.is_some() {
            return TileM::Rows128;
        }
        let tile = self.tile_for(tokens, top_k, experts);
        if fp8 && tile == TileM::Rows128 && tokens * top_k <= 64 * experts {
            return TileM::Rows64;
        }
        tile
    }

    pub fn gemm(&self, s: CUstream, p: &GroupedGemm, r: &MoeRouting) -> anyhow::Result<()> {
        self.gemm_with(s, p, r, Sm90Schedule::for_routing(r, p.a.is_fp8()))
    }

    /// `gemm` with the wgmma kernels' schedule chosen (tests and benchmarks).
    pub fn gemm_with(&self, s: CUstream, p: &GroupedGemm, r: &MoeRouting, sched: Sm90Schedule) -> anyhow::Result<()> {
        let (n, k) = (p.n, p.k);
        anyhow::ensure!(
            n.is_multiple_of(8) && k.is_multiple_of(8) && n > 0 && k > 0,
            "grouped GEMM needs N and K positive multiples of 8, got N={n} K={k}"
        );
        let rows = r.rows();
        ensure_len!(p.c, rows * n, "grouped GEMM output");
        let tiles = MoeRouting::max_tiles(rows, r.experts, r.tile) as u32;
        let fp8 = p.w.is_fp8();
        if p.a.is_fp8() {
            let kernel = self.w8a8_kernel(p, r, sched, false)?;
            return Launch {
                kernel,
                grid: (self.sm90_grid(r, n.div_ceil(sched.item_rows), sched.persistent), 1),
                threads: GROUPED_SM90_THREADS as u32,
                smem: GROUPED_SM90_SMEM_BYTES,
            }
            .run_rows(s, p, r, n);
        }
        let launch = match r.tile {
            TileM::Rows16 => Launch {
                kernel: if fp8 { &self.rows16_fp8 } else { &self.rows16 },
                grid: (n.div_ceil(64) as u32, tiles),
                threads: 128,
                smem: 0,
            },
            TileM::Rows64 => Launch {
                kernel: if fp8 { &self.rows64_fp8 } else { &self.rows64 },
                grid: (n.div_ceil(128) as u32, tiles),
                threads: 128,
                smem: 0,
            },
            TileM::Rows128 => Launch {
                kernel: self.sm90_kernel(sched.item_rows, false, fp8)?,
                grid: (self.sm90_grid(r, n.div_ceil(sched.item_rows), sched.persistent), 1),
                threads: GROUPED_SM90_THREADS as u32,
                smem: sm90_smem(fp8),
            },
        };
        launch.run_rows(s, p, r, n)
    }

    /// The gate/up GEMM with SiLU·mul: one wgmma kernel with SiLU·mul in its epilogue on 128-row
    /// tiles; otherwise the grouped GEMM writes `gate_up` and silu_mul reduces it into `act`.
    pub fn gate_up_act(&self, s: CUstream, p: &GroupedGateUp, r: &MoeRouting) -> anyhow::Result<()> {
        self.gate_up_act_with(s, p, r, Sm90Schedule::for_routing(r, p.a.is_fp8()))
    }

    /// `gate_up_act` with the wgmma kernels' schedule chosen (tests and benchmarks).
    pub fn gate_up_act_with(
        &self,
        s: CUstream,
        p: &GroupedGateUp,
        r: &MoeRouting,
        sched: Sm90Schedule,
    ) -> anyhow::Result<()> {
        let (inter, k, rows) = (p.inter, p.k, r.rows());
        anyhow::ensure!(
            !p.w.is_fp8() || inter.is_multiple_of(FP8_BLOCK),
            "grouped gate/up on block-FP8 weights needs an intermediate size that is a multiple of {FP8_BLOCK}, got \
             {inter} (the gate and up scale grids would not stack)"
        );
        if r.tile != TileM::Rows128 {
            self.gemm(s, &GroupedGemm { a: p.a, w: p.w, c: p.gate_up, n: 2 * inter, k }, r)?;
            ensure_len!(p.act, rows * inter, "silu_mul output");
            let total = rows * inter;
            self.silu_mul.launch(
                s,
                (grid_for(self.sm_count, total, 256), 1, 1),
                256,
                0,
                &[Arg::Ptr(p.gate_up.ptr), Arg::Ptr(p.act.ptr), Arg::I32(inter as i32), Arg::I64(total as i64)],
            )?;
            return Ok(());
        }
        anyhow::ensure!(
            inter.is_multiple_of(8) && k.is_multiple_of(8) && inter > 0 && k > 0,
            "grouped GEMM needs the width and K positive multiples of 8, got {inter} and K={k}"
        );
        ensure_len!(p.act, rows * inter, "expert activations");
        let gemm = GroupedGemm { a: p.a, w: p.w, c: p.act, n: inter, k };
        let (kernel, smem) = if p.a.is_fp8() {
            (self.w8a8_kernel(&gemm, r, sched, true)?, GROUPED_SM90_SMEM_BYTES)
        } else {
            (self.sm90_kernel(sched.item_rows, true, p.w.is_fp8())?, sm90_smem(p.w.is_fp8()))
        };
        // An item covers item_rows / 2 gate rows and as many up rows: that many act columns.
        Launch {
            kernel,
            grid: (self.sm90_grid(r, inter.div_ceil(sched.item_rows / 2), sched.persistent), 1),
            threads: GROUPED_SM90_THREADS as u32,
            smem,
        }
        .run_rows(s, &gemm, r, 2 * inter)
    }

    /// The W8A8 kernel for `p` (FP8 activations), after checking what it needs: FP8 weights,
    /// the wgmma tile map (128-row tiles), 128-row items and K a multiple of 16 (16-byte copies).
    fn w8a8_kernel(&self, p: &GroupedGemm, r: &MoeRouting, sched: Sm90Schedule, silu: bool) -> anyhow::Result<&Kernel> {
        let [plain, fused] =
            self.w8a8.as_ref().ok_or_else(|| anyhow::anyhow!("the W8A8 grouped GEMM needs compute capability 9.0"))?;
        anyhow::ensure!(p.w.is_fp8(), "W8A8 grouped GEMM: FP8 activations need block-FP8 weights");
        anyhow::ensure!(
            r.tile == TileM::Rows128,
            "W8A8 grouped GEMM: needs 128-row tiles, the routing has {:?}",
            r.tile
        );
        anyhow::ensure!(sched.item_rows == 128, "W8A8 grouped GEMM: items of 128 weight rows, not {}", sched.item_rows);
        anyhow::ensure!(p.k.is_multiple_of(16), "W8A8 grouped GEMM: K must be a multiple of 16, got {}", p.k);
        Ok(if silu { fused } else { plain })
    }

    fn sm90_kernel(&self, item_rows: usize, silu: bool, fp8: bool) -> anyhow::Result<&Kernel> {
        let k = &self.wgmma.as_ref().ok_or_else(|| {
            anyhow::anyhow!("the wgmma grouped GEMM (tiles of 128 rows) needs compute capability 9.0")
        })?[fp8 as usize];
        Ok(match (item_rows, silu) {
            (256, false) => &k.items256,
            (256, true) => &k.items256_silu,
            (128, false) => &k.items128,
            (128, true) => &k.items128_silu,
            _ => anyhow::bail!("the wgmma grouped GEMM has items of 256 or 128 weight rows, not {item_rows}"),
        })
    }

    /// Grid of the wgmma kernels: one block per worst-case item, or persistent, one block per SM
    /// (the kernels loop over their items either way; blocks past the device's item count exit).
    fn sm90_grid(&self, r: &MoeRouting, col_blocks: usize, persistent: bool) -> u32 {
        let items = MoeRouting::max_tiles(r.rows(), r.experts, r.tile) * col_blocks;
        if persistent {
            items.clamp(1, self.sm_count) as u32
        } else {
            items.max(1) as u32
        }
    }
}

/// Dynamic shared memory of the wgmma kernels on bf16 or block-FP8 weights.
fn sm90_smem(fp8: bool) -> usize {
    if fp8 {
        GROUPED_SM90_FP8_SMEM_BYTES
    } else {
        GROUPED_SM90_SMEM_BYTES
    }
}

/// One launch of a grouped-GEMM kernel (the tile map and its count are read on the device).
struct Launch<'k> {
    kernel: &'k Kernel,
    grid: (u32, u32),
    threads: u32,
    smem: usize,
}

impl Launch<'_> {
    /// `p.c` gets `p.n` columns per row (the activation's width for the SiLU-fused kernels);
    /// every expert's weight has `w_rows` rows of `p.k` (checked here, with its block scales).
    fn run_rows(&self, s: CUstream, p: &GroupedGemm, r: &MoeRouting, w_rows: usize) -> anyhow::Result<()> {
        let mut args = p.a.args(r.rows(), p.k)?;
        args.extend(p.w.args("expert weights", r.experts, w_rows, p.k)?);
        args.extend([
            Arg::Ptr(p.c.ptr),
            Arg::I32(p.n as i32),
            Arg::I32(p.k as i32),
            Arg::Ptr(r.tile_expert.ptr),
            Arg::Ptr(r.tile_row0.ptr),
            Arg::Ptr(r.tile_rows.ptr),
            Arg::Ptr(r.num_tiles.ptr),
        ]);
        self.kernel.launch(s, (self.grid.0, self.grid.1, 1), self.threads, self.smem as u32, &args)?;
        Ok(())
    }
}
