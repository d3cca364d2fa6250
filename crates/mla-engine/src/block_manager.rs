//! Bookkeeping of the paged latent KV cache: which of the backend's `num_blocks` blocks of
//! `block_size` tokens are free, how many sequences share each one, which blocks a sequence
//! uses (its `BlockTable`), and which blocks hold a known prefix (automatic prefix caching).
//! Plain data; the backend owns the memory itself.
//!
//! Ownership is RAII: a `BlockTable` holds one reference on each of its blocks and gives them
//! back when dropped, so finishing, aborting, failing or preempting a sequence cannot leak blocks
//! as long as its table is dropped or `release`d.
//!
//! Prefix caching: a full, computed block can be registered under the hash of its content
//! (`prefix_hash`: its tokens chained from the block before). When its last reference goes, a
//! registered block is not freed but kept as *evictable*: a later sequence whose prompt starts
//! with the same blocks takes it back (`BlockManager::lookup`). Allocation takes plain free
//! blocks first, then evicts the evictable block released longest ago (LRU); a referenced block
//! is never evicted, and nobody writes into a registered block (it is full and computed, and the
//! scheduler never writes into a block it shares).

use crate::cache_index::CachePublisher;
use crate::prefix_hash::BlockHash;
use mla_core::CacheLayout;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Not enough free blocks for an allocation; nothing was allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{needed} KV cache blocks needed, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

#[derive(Debug)]
struct Pool {
    /// Unreferenced blocks with nothing worth keeping; popped from the end, so a fresh pool
    /// hands out 0, 1, 2, ...
    free: Vec<u32>,
    /// References per block. A block with no reference is on `free` or in `evictable`.
    refs: Vec<u32>,
    /// The content hash a block is registered under, if any.
    hash_of: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Unreferenced registered blocks by release time: the first is evicted first.
    evictable: BTreeMap<u64, u32>,
    /// A block's key in `evictable` while it is there.
    released_at: Vec<u64>,
    clock: u64,
    /// Tells the router's view of this cache (`cache_index`) what is registered and evicted.
    publisher: Option<CachePublisher>,
}

impl Pool {
    fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// An unreferenced block for new content: a free one, else the evictable block released
    /// longest ago, forgotten by the cache.
    fn take(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let h = self.hash_of[b as usize].take().expect("evictable blocks are registered");
                self.by_hash.remove(&h);
                if let Some(p) = &self.publisher {
                    p.evicted(h);
                }
                b
            }
        };
        debug_assert_eq!(self.refs[b as usize], 0, "block {b} handed out while referenced");
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more reference on `b`, which may be evictable.
    fn retain(&mut self, b: u32) {
        if self.refs[b as usize] == 0 {
            self.evictable.remove(&self.released_at[b as usize]);
        }
        self.refs[b as usize] += 1;
    }

    fn drop_ref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "block {b} released more often than referenced");
        *r -= 1;
        if *r > 0 {
            return;
        }
        if self.hash_of[b as usize].is_some() {
            self.released_at[b as usize] = self.clock;
            self.evictable.insert(self.clock, b);
            self.clock += 1;
        } else {
            self.free.push(b);
        }
    }
}

/// What a lookup of a prompt's block hashes would find, without taking anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedPrefix {
    /// Leading blocks found in the cache.
    pub blocks: usize,
    /// How many of those are unreferenced (taking them makes them unavailable to allocation).
    pub evictable: usize,
}

/// Shared handle on the block pool. Cloning is cheap; every clone sees the same pool.
/// A mutex rather than a `RefCell` keeps the scheduler `Send`, so it can be built on one thread
/// and driven on the engine thread; it is never contended.
#[derive(Debug, Clone)]
pub struct BlockManager {
    pool: Arc<Mutex<Pool>>,
    block_size: usize,
    num_blocks: usize,
}

impl BlockManager {
    pub fn new(layout: CacheLayout) -> Self {
        Self::build(layout, None)
    }

    /// A pool whose registrations and evictions are also sent to `publisher`, so that a
    /// `CacheIndex` on other threads knows what it caches.
    pub fn published(layout: CacheLayout, publisher: CachePublisher) -> Self {
        Self::build(layout, Some(publisher))
    }

    fn build(layout: CacheLayout, publisher: Option<CachePublisher>) -> Self {
        assert!(layout.block_size > 0, "block_size must be positive");
        assert!(layout.num_blocks <= u32::MAX as usize, "block ids are u32");
        let n = layout.num_blocks;
        let pool = Pool {
            free: (0..n as u32).rev().collect(),
            refs: vec![0; n],
            hash_of: vec![None; n],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; n],
            clock: 0,
            publisher,
        };
        BlockManager { pool: Arc::new(Mutex::new(pool)), block_size: layout.block_size, num_blocks: layout.num_blocks }
    }

    // A panic elsewhere must not turn every later `Drop` of a table into a second panic.
    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks an allocation can take: free ones and evictable cached ones.
    pub fn free_blocks(&self) -> usize {
        self.lock().available()
    }

    /// Blocks registered in the prefix cache, referenced or not.
    pub fn cached_blocks(&self) -> usize {
        self.lock().by_hash.len()
    }

    /// Blocks some sequence references.
    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free_blocks()
    }

    /// Fraction of blocks in use, 0..=1 (the `kv_usage` metric).
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        self.used_blocks() as f64 / self.num_blocks as f64
    }

    /// Blocks needed to hold positions `0 .. tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.lock().refs[block as usize]
    }

    /// An empty table drawing on this pool.
    pub fn new_table(&self) -> BlockTable {
        BlockTable { manager: self.clone(), blocks: Vec::new() }
    }

    /// How many of `hashes` (a prompt's block hashes, in order) are cached, as a prefix.
    pub fn probe(&self, hashes: &[BlockHash]) -> CachedPrefix {
        let pool = self.lock();
        let mut found = CachedPrefix { blocks: 0, evictable: 0 };
        for h in hashes {
            let Some(&b) = pool.by_hash.get(h) else { break };
            found.blocks += 1;
            found.evictable += usize::from(pool.refs[b as usize] == 0);
        }
        found
    }

    /// A table of the cached blocks that start with `hashes`, each gaining a reference (an
    /// evictable one is no longer evictable).
    pub fn lookup(&self, hashes: &[BlockHash]) -> BlockTable {
        let mut pool = self.lock();
        let mut blocks = Vec::new();
        for h in hashes {
            let Some(&b) = pool.by_hash.get(h) else { break };
            pool.retain(b);
            blocks.push(b);
        }
        BlockTable { manager: self.clone(), blocks }
    }
}

/// The blocks of one sequence, in position order; holds one reference on each.
#[derive(Debug)]
pub struct BlockTable {
    manager: BlockManager,
    blocks: Vec<u32>,
}

impl BlockTable {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn block_size(&self) -> usize {
        self.manager.block_size
    }

    /// Positions the table can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.len() * self.manager.block_size
    }

    /// Fresh blocks needed before the table holds `tokens` positions.
    pub fn missing_blocks(&self, tokens: usize) -> usize {
        self.manager.blocks_for(tokens).saturating_sub(self.blocks.len())
    }

    /// Grows the table until it holds positions `0 .. tokens`, all or nothing.
    pub fn reserve(&mut self, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = self.missing_blocks(tokens);
        if needed == 0 {
            // The common decode case (the next token lands in the last block): no pool access.
            return Ok(());
        }
        let mut pool = self.manager.lock();
        if pool.available() < needed {
            return Err(OutOfBlocks { needed, free: pool.available() });
        }
        for _ in 0..needed {
            let b = pool.take().expect("checked above");
            self.blocks.push(b);
        }
        Ok(())
    }

    /// A new table whose first `num_blocks` blocks are this table's, each gaining a reference.
    /// The caller must never write positions inside shared blocks (see the scheduler's prefix
    /// rule), because the other owners read them.
    pub fn share_prefix(&self, num_blocks: usize) -> BlockTable {
        self.share_range(0..num_blocks)
    }

    /// A new table of this table's blocks `range`, each gaining a reference (as `share_prefix`).
    pub fn share_range(&self, range: std::ops::Range<usize>) -> BlockTable {
        assert!(range.end <= self.blocks.len(), "cannot share blocks {range:?} of {}", self.blocks.len());
        let shared = self.blocks[range].to_vec();
        let mut pool = self.manager.lock();
        for &b in &shared {
            pool.retain(b);
        }
        BlockTable { manager: self.manager.clone(), blocks: shared }
    }

    /// Offers block `index` of this table to the prefix cache under `hash` (its content, which
    /// must be full and computed). Nothing happens if the block is registered already or another
    /// block holds the same content (two sequences computed it at once; this copy stays private
    /// and is freed as usual).
    pub fn register(&self, index: usize, hash: BlockHash) {
        let b = self.blocks[index];
        let mut pool = self.manager.lock();
        if pool.hash_of[b as usize].is_some() || pool.by_hash.contains_key(&hash) {
            return;
        }
        pool.hash_of[b as usize] = Some(hash);
        pool.by_hash.insert(hash, b);
        if let Some(p) = &pool.publisher {
            p.cached(hash);
        }
    }

    /// Drops every reference; blocks nobody else holds go back to the free list, or become
    /// evictable if they are cached. Last block first, so a prompt's tail is evicted before the
    /// head that other prompts are likelier to share.
    pub fn release(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        let mut pool = self.manager.lock();
        for b in self.blocks.drain(..).rev() {
            pool.drop_ref(b);
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.release();
    }
}
