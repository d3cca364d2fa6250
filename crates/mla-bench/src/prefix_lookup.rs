//! `mla-bench prefix-lookup`: what the prefix router costs the thread that submits a request:
//! hashing the prompt's blocks (the chain every rank's cache is keyed by) and looking the chain
//! up in every rank's `CacheIndex`, after catching up on the changes the ranks made since the
//! last lookup. The router does exactly this and then compares a few numbers per rank.
//!
//! Each rank's index holds `--cached-blocks` random hashes; rank 0 also holds the whole prompt's
//! chain and rank 1 its first half, so the walk is as long as it gets. Before every lookup each
//! rank publishes `--pending` changes (half registrations, half evictions), as a rank that
//! prefilled and evicted a long prompt between two lookups would.

use mla_core::SplitMix64;
use mla_engine::cache_index::{CacheIndex, CachePublisher};
use mla_engine::prefix_hash::PrefixHasher;
use serde_json::json;
use std::time::Instant;

pub struct PrefixLookupArgs {
    pub prompt_tokens: usize,
    pub ranks: usize,
    pub block_size: usize,
    pub cached_blocks: usize,
    pub pending: usize,
    pub reps: usize,
}

pub fn run(a: &PrefixLookupArgs) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(a.ranks >= 2 && a.block_size > 0 && a.reps > 0, "needs 2+ ranks, a block size and a repetition");
    let mut rng = SplitMix64::new(1);
    let prompt: Vec<u32> = (0..a.prompt_tokens).map(|_| (rng.next_u64() % 129_280) as u32).collect();
    let hasher = PrefixHasher::default();
    let usable = a.prompt_tokens.saturating_sub(1) / a.block_size * a.block_size;
    let mut chain = Vec::new();
    hasher.extend(&mut chain, &prompt, usable, a.block_size);
    let (index, publishers) = CacheIndex::new(a.ranks);
    for (r, p) in publishers.iter().enumerate() {
        (0..a.cached_blocks).for_each(|_| p.cached(u128::from(rng.next_u64()) << 64 | u128::from(rng.next_u64())));
        let held = match r {
            0 => chain.len(),
            1 => chain.len() / 2,
            _ => 0,
        };
        chain[..held].iter().for_each(|&h| p.cached(h));
    }
    index.cached_prefixes(&[]);
    let (mut hash_ms, mut lookup_ms) = (Vec::new(), Vec::new());
    let mut found = Vec::new();
    for _ in 0..a.reps {
        churn(&publishers, a.pending, &mut rng);
        let t = Instant::now();
        let mut hashes = Vec::new();
        hasher.extend(&mut hashes, &prompt, usable, a.block_size);
        let hashed = t.elapsed();
        found = index.cached_prefixes(&hashes);
        hash_ms.push(hashed.as_secs_f64() * 1e3);
        lookup_ms.push((t.elapsed() - hashed).as_secs_f64() * 1e3);
    }
    anyhow::ensure!(found[0] == chain.len() && found[1] == chain.len() / 2, "the lookup found {found:?}");
    let total: Vec<f64> = hash_ms.iter().zip(&lookup_ms).map(|(h, l)| h + l).collect();
    eprintln!(
        "prefix lookup, {} tokens ({} blocks) over {} ranks of {} cached blocks, {} changes pending per rank: \
         hash median {:.3} ms, lookup median {:.3} ms, total median {:.3} ms (p90 {:.3})",
        a.prompt_tokens,
        chain.len(),
        a.ranks,
        a.cached_blocks,
        a.pending,
        median(&hash_ms),
        median(&lookup_ms),
        median(&total),
        quantile(&total, 0.9)
    );
    Ok(json!({
        "prompt_tokens": a.prompt_tokens,
        "blocks": chain.len(),
        "ranks": a.ranks,
        "block_size": a.block_size,
        "cached_blocks_per_rank": a.cached_blocks,
        "pending_changes_per_rank": a.pending,
        "reps": a.reps,
        "hash_ms": {"median": median(&hash_ms), "p90": quantile(&hash_ms, 0.9)},
        "lookup_ms": {"median": median(&lookup_ms), "p90": quantile(&lookup_ms, 0.9)},
        "total_ms": {"median": median(&total), "p90": quantile(&total, 0.9), "max": quantile(&total, 1.0)},
    }))
}

/// `pending` changes on every rank: new blocks registered, then as many of them evicted, so the
/// caches keep their size from one lookup to the next.
fn churn(publishers: &[CachePublisher], pending: usize, rng: &mut SplitMix64) {
    for p in publishers {
        let fresh: Vec<u128> =
            (0..pending / 2).map(|_| u128::from(rng.next_u64()) << 64 | u128::from(rng.next_u64())).collect();
        fresh.iter().for_each(|&h| p.cached(h));
        fresh.iter().for_each(|&h| p.evicted(h));
    }
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}
