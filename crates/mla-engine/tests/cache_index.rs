//! The router's view of a rank's prefix cache (`CacheIndex`) against the cache itself: after
//! every step of a random run of allocations, registrations and releases (evictions among
//! them), the index finds exactly the prefix `BlockManager::probe` finds, for every chain.

use mla_core::{CacheLayout, SplitMix64};
use mla_engine::block_manager::{BlockManager, BlockTable};
use mla_engine::cache_index::CacheIndex;
use mla_engine::prefix_hash::{BlockHash, PrefixHasher};

const BLOCK: usize = 4;

#[test]
fn the_index_mirrors_the_cache_through_registrations_and_evictions() {
    let (index, mut publishers) = CacheIndex::new(1);
    let pool = BlockManager::published(CacheLayout { block_size: BLOCK, num_blocks: 24 }, publishers.remove(0));
    let hasher = PrefixHasher::default();
    let mut rng = SplitMix64::new(7);
    // Chains over a few shared starts, so prompts share leading blocks as chats do.
    let starts: Vec<Vec<u32>> = (0..4).map(|s| (0..8).map(|i| s * 100 + i).collect()).collect();
    let mut chains: Vec<Vec<BlockHash>> = Vec::new();
    let mut live: Vec<(BlockTable, Vec<BlockHash>)> = Vec::new();
    let (mut evicted, mut hits) = (0, 0);
    for step in 0..600 {
        if live.len() < 4 && !rng.next_u64().is_multiple_of(3) {
            // A sequence: a shared start, a tail of its own; it takes what the cache holds and
            // registers the rest once "computed".
            let start = &starts[(rng.next_u64() % 4) as usize];
            let len = 8 + (rng.next_u64() % 17) as usize;
            let tokens: Vec<u32> =
                start.iter().copied().chain((0..len - 8).map(|_| 1000 + (rng.next_u64() % 3) as u32)).collect();
            let mut hashes = Vec::new();
            hasher.extend(&mut hashes, &tokens, tokens.len(), BLOCK);
            let found = pool.probe(&hashes).blocks;
            let mut table = pool.lookup(&hashes[..found]);
            let cached = pool.cached_blocks();
            if table.reserve(tokens.len()).is_err() {
                continue;
            }
            hits += found;
            evicted += cached - pool.cached_blocks();
            for (i, &h) in hashes.iter().enumerate().skip(found) {
                table.register(i, h);
            }
            chains.push(hashes.clone());
            live.push((table, hashes));
        } else if !live.is_empty() {
            let i = (rng.next_u64() % live.len() as u64) as usize;
            live.swap_remove(i);
        }
        for chain in &chains {
            assert_eq!(index.cached_prefixes(chain), vec![pool.probe(chain).blocks], "step {step}");
        }
        assert_eq!(index.len_of(0), pool.cached_blocks(), "step {step}");
    }
    assert!(hits > 0 && evicted > 0, "the run must reuse and evict blocks (hits {hits}, evicted {evicted})");
}
