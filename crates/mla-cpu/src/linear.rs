//! Row-major f32 matrices and `y = W x` over a batch of tokens, the only dense kernel the CPU
//! backend needs.

use rayon::prelude::*;

/// Below this many multiply-adds a matrix-vector product runs on the calling thread; rayon's
/// task overhead would dominate.
const PARALLEL_WORK: usize = 1 << 15;
/// Output rows per rayon task.
const ROW_BLOCK: usize = 32;

/// A weight `[rows, cols]` as in PyTorch's `nn.Linear`: `rows` outputs, `cols` inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data does not match [{rows}, {cols}]");
        Matrix { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// `x [n, cols]` -> `[n, rows]`: every token times `Wᵀ`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        assert_eq!(x.len() % self.cols, 0, "input is not a whole number of {}-wide rows", self.cols);
        let n = x.len() / self.cols;
        let mut out = vec![0.0; n * self.rows];
        let per_token = |(o, xt): (&mut [f32], &[f32])| self.matvec_into(xt, o);
        if n > 1 {
            out.par_chunks_mut(self.rows).zip(x.par_chunks(self.cols)).for_each(per_token);
        } else {
            out.chunks_mut(self.rows).zip(x.chunks(self.cols)).for_each(per_token);
        }
        out
    }

    /// `out = W x` for one token.
    pub fn matvec_into(&self, x: &[f32], out: &mut [f32]) {
        let block = |(b, o): (usize, &mut [f32])| {
            for (j, y) in o.iter_mut().enumerate() {
                *y = dot(self.row(b * ROW_BLOCK + j), x);
            }
        };
        if self.rows * self.cols >= PARALLEL_WORK {
            out.par_chunks_mut(ROW_BLOCK).enumerate().for_each(block);
        } else {
            out.chunks_mut(ROW_BLOCK).enumerate().for_each(block);
        }
    }
}

/// Dot product with eight independent f32 accumulators (lets the compiler vectorise; the
/// rounding differs from a sequential sum by far less than the tolerances tests use).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_matches_hand_computation_serial_and_parallel() {
        let w = Matrix::new(2, 3, vec![1.0, 2.0, 3.0, -1.0, 0.5, 0.0]);
        assert_eq!(w.forward(&[1.0, 1.0, 1.0, 2.0, 0.0, -1.0]), vec![6.0, -0.5, -1.0, -2.0]);
        // Large enough for the parallel path: identity-like weight picks entries of x.
        let (rows, cols) = (300, 200);
        let mut data = vec![0.0; rows * cols];
        for r in 0..rows {
            data[r * cols + r % cols] = 1.0;
        }
        let w = Matrix::new(rows, cols, data);
        let x: Vec<f32> = (0..2 * cols).map(|i| i as f32).collect();
        let y = w.forward(&x);
        for t in 0..2 {
            for r in 0..rows {
                assert_eq!(y[t * rows + r], x[t * cols + r % cols]);
            }
        }
    }
}
