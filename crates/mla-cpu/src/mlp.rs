//! The SiLU-gated MLP of dense layers, routed experts and shared experts:
//! `down(silu(gate(x)) * up(x))`.

use crate::linear::Matrix;

#[derive(Debug, Clone)]
pub struct SiluMlp {
    pub gate_proj: Matrix,
    pub up_proj: Matrix,
    pub down_proj: Matrix,
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl SiluMlp {
    /// `x [n, hidden]` -> `[n, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let gate = self.gate_proj.forward(x);
        let up = self.up_proj.forward(x);
        let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        self.down_proj.forward(&act)
    }
}
