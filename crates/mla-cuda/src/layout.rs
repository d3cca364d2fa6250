//! The backends of a parallel layout on this process's GPUs: one per replica (`--dp`), each a
//! `CudaBackend` on one GPU or a `CudaGroupBackend` over `--tp` GPUs (tensor parallel or DP
//! attention) joined by NCCL. Replica i holds GPUs `i·tp .. (i+1)·tp` from `opts.device`.

use crate::collective::NcclConnector;
use crate::cuda_backend::CudaBackend;
use crate::group::GroupOptions;
use crate::options::{CudaOptions, WeightsFrom};
use mla_core::{Backend, ModelConfig, Parallel};
use std::sync::Arc;
use std::time::Duration;

pub fn backends_for(
    cfg: &ModelConfig,
    weights: &WeightsFrom,
    opts: &CudaOptions,
    parallel: Parallel,
    watchdog: Duration,
) -> anyhow::Result<Vec<Box<dyn Backend>>> {
    parallel.check(cfg)?;
    crate::model::check_supported(cfg)?;
    let need = opts.device + parallel.devices();
    let visible = crate::visible_gpus();
    // One device: CudaBackend's own error says why it cannot be opened.
    if parallel.devices() > 1 && need > visible {
        anyhow::bail!(
            "the layout needs {} GPUs (--tp {} x --dp {}) but {visible} are visible (CUDA_VISIBLE_DEVICES selects them)",
            parallel.devices(),
            parallel.tp,
            parallel.replicas
        );
    }
    if parallel.tp > 1 {
        tracing::info!("{}", crate::gpu::nccl::describe()?);
    }
    let mut backends: Vec<Box<dyn Backend>> = Vec::with_capacity(parallel.replicas);
    for replica in 0..parallel.replicas {
        let opts = CudaOptions { device: opts.device + replica * parallel.tp, ..opts.clone() };
        backends.push(if parallel.tp == 1 {
            Box::new(CudaBackend::new(cfg.clone(), weights.clone(), opts)?)
        } else {
            let group = GroupOptions {
                world: parallel.tp,
                dp_attention: parallel.dp_attention,
                watchdog,
                connector: Arc::new(NcclConnector::new()?),
            };
            Box::new(crate::group::local_group(cfg.clone(), weights.clone(), opts, group)?)
        });
    }
    Ok(backends)
}
