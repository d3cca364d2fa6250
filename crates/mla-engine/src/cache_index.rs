//! Which block hashes every attention rank's prefix cache holds, readable from any thread, so
//! that a request can be sent to the rank that holds its prefix (the router in `engine`).
//!
//! Each rank's `BlockManager` is plain data driven by its engine thread, and the router runs on
//! the threads that submit requests. A lock shared by the two would let a burst of submissions
//! delay a step, so the writer never takes one: the block manager sends each change as it makes
//! it (a block registered under a hash, a registered block evicted) down a channel, which costs
//! it no more than a push, and a lookup first applies the changes sent so far to the rank's
//! copy of the set, under a lock only readers take. The copy is exact up to the moment of the
//! lookup, evictions included, because it is the cache's own history replayed in order.
//!
//! Every rank of one engine hashes blocks with the same keys (`PrefixHasher`), so one chain of
//! a prompt's block hashes is looked up in every rank.

use crate::prefix_hash::BlockHash;
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One change to a rank's prefix cache.
#[derive(Debug, Clone, Copy)]
enum Change {
    Cached(BlockHash),
    Evicted(BlockHash),
}

/// The writing end, held by one rank's block manager.
#[derive(Debug)]
pub struct CachePublisher {
    changes: Sender<Change>,
}

impl CachePublisher {
    /// A block now holds the content hashed to `hash` and can be found by it.
    pub fn cached(&self, hash: BlockHash) {
        // Nobody reads any more once the index is gone (the engine is shutting down).
        let _ = self.changes.send(Change::Cached(hash));
    }

    /// The block registered under `hash` was taken for other content.
    pub fn evicted(&self, hash: BlockHash) {
        let _ = self.changes.send(Change::Evicted(hash));
    }
}

/// Block hashes are keyed SipHash outputs, already uniform and out of a client's reach: the set
/// uses their low bits as they are instead of hashing them again.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u128` is used by `BlockHash`; anything else still hashes, just slowly.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

type HashSetOf = HashSet<BlockHash, BuildHasherDefault<PassThrough>>;

#[derive(Debug)]
struct RankCopy {
    hashes: HashSetOf,
    changes: Receiver<Change>,
}

impl RankCopy {
    fn catch_up(&mut self) {
        while let Ok(change) = self.changes.try_recv() {
            match change {
                Change::Cached(h) => self.hashes.insert(h),
                Change::Evicted(h) => self.hashes.remove(&h),
            };
        }
    }
}

/// The reading end: every rank's cached hashes, in the engine's rank order.
#[derive(Debug)]
pub struct CacheIndex {
    ranks: Vec<Mutex<RankCopy>>,
}

impl CacheIndex {
    /// An empty index over `ranks` ranks and the publisher each rank's block manager keeps.
    pub fn new(ranks: usize) -> (CacheIndex, Vec<CachePublisher>) {
        let (copies, publishers) = (0..ranks)
            .map(|_| {
                let (tx, rx) = channel();
                (Mutex::new(RankCopy { hashes: HashSetOf::default(), changes: rx }), CachePublisher { changes: tx })
            })
            .unzip();
        (CacheIndex { ranks: copies }, publishers)
    }

    // A reader that panicked left a set that is still a set; the next reader catches it up.
    fn rank(&self, r: usize) -> MutexGuard<'_, RankCopy> {
        self.ranks[r].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// For each rank, how many leading blocks of `hashes` (a prompt's chain, in order) it holds.
    /// A chain is cached from its start or not at all, so the walk stops at a rank's first miss:
    /// the cost is the longest match plus one probe per rank.
    pub fn cached_prefixes(&self, hashes: &[BlockHash]) -> Vec<usize> {
        (0..self.ranks.len())
            .map(|r| {
                let mut copy = self.rank(r);
                copy.catch_up();
                hashes.iter().take_while(|h| copy.hashes.contains(h)).count()
            })
            .collect()
    }

    /// Hashes rank `r` holds now.
    pub fn len_of(&self, r: usize) -> usize {
        let mut copy = self.rank(r);
        copy.catch_up();
        copy.hashes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_see_every_change_in_order_and_stop_at_the_first_miss() {
        let (index, publishers) = CacheIndex::new(3);
        assert_eq!(index.cached_prefixes(&[1, 2, 3]), vec![0, 0, 0]);
        for h in [1, 2, 3] {
            publishers[1].cached(h);
        }
        publishers[2].cached(1);
        publishers[2].cached(3);
        assert_eq!(index.cached_prefixes(&[1, 2, 3]), vec![0, 3, 1]);
        // An evicted block breaks the chain there, even though later blocks are still cached.
        publishers[1].evicted(2);
        assert_eq!(index.cached_prefixes(&[1, 2, 3]), vec![0, 1, 1]);
        // Evicted, then computed again into another block: cached.
        publishers[1].evicted(1);
        publishers[1].cached(1);
        publishers[1].cached(2);
        assert_eq!(index.cached_prefixes(&[1, 2, 3]), vec![0, 3, 1]);
        assert_eq!((index.len_of(0), index.len_of(1), index.len_of(2)), (0, 3, 2));
        assert_eq!(index.cached_prefixes(&[]), vec![0, 0, 0]);
    }

    #[test]
    fn a_rank_whose_engine_stopped_keeps_what_it_had() {
        let (index, mut publishers) = CacheIndex::new(1);
        publishers[0].cached(7);
        drop(publishers.pop());
        assert_eq!(index.cached_prefixes(&[7, 8]), vec![1]);
    }
}
