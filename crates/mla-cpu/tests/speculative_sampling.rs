//! Sampled requests with speculative decoding are lossless on the CPU reference: the MTP fixture
//! (tests/fixtures/v3_mtp) through `mla_core::speculative::lossless_check` (3,000 seeded runs
//! per case; the module says what is checked and why the check has power).

use crate::common;

use mla_core::speculative::lossless_check::{exact, likely_drafts, own_drafts, Setup, Shaping};
use mla_cpu::CpuBackend;

const BLOCK_SIZE: usize = 16;

/// The MTP fixture's target (`mtp`: with its MTP layer, drafting) and its "short" prompt (5
/// tokens; tests/fixtures/README.md).
fn fixture(mtp: bool) -> (CpuBackend, Setup) {
    let (cfg, ckpt, oracles) = common::mtp_oracles("v3_mtp");
    let prompt = oracles.iter().find(|o| o.name == "short").expect("the short prompt").tokens[..5].to_vec();
    let backend = common::mtp_backend(&cfg, &ckpt, BLOCK_SIZE, 8, mtp);
    // f32 throughout: a prefill row and a verify row of one context differ in summation order
    // alone, far below a thousandth of a logit.
    (backend, Setup { prompt, table: (0..8).collect(), runs: 3000, rounding: 1e-3, shaping: None })
}

#[test]
fn sampled_drafts_leave_the_output_distribution_unchanged() {
    let (mut target, setup) = fixture(false);
    let exact = exact(&mut target, &setup);
    own_drafts(&mut fixture(true).0, &setup, &exact);
}

#[test]
fn likely_drafts_stand_often_and_leave_the_distribution_unchanged() {
    let (mut target, setup) = fixture(false);
    let exact = exact(&mut target, &setup);
    likely_drafts(&mut fixture(true).0, &setup, &exact);
}

/// The same with repetition, presence and frequency penalties and a logit bias on every draw:
/// each verify row's distribution must count the drafts before it as output.
fn shaped(mtp: bool) -> (CpuBackend, Setup) {
    let (backend, mut setup) = fixture(mtp);
    let logit_bias = vec![(setup.prompt[2], 2.0), (setup.prompt[0], -100.0), (7, 1.0)];
    setup.shaping =
        Some(Shaping { repetition_penalty: 1.4, presence_penalty: 0.5, frequency_penalty: 0.3, logit_bias });
    (backend, setup)
}

#[test]
fn sampled_drafts_of_penalised_and_biased_draws_leave_the_distribution_unchanged() {
    let (mut target, setup) = shaped(false);
    let exact = exact(&mut target, &setup);
    own_drafts(&mut shaped(true).0, &setup, &exact);
    likely_drafts(&mut shaped(true).0, &setup, &exact);
}
