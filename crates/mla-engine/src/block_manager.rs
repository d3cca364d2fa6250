//! Bookkeeping of the paged latent KV cache: which of the backend's `num_blocks` blocks of
//! `block_size` tokens are free, how many sequences share each one, and which blocks a sequence
//! uses (its `BlockTable`). Plain data; the backend owns the memory itself.
//!
//! Ownership is RAII: a `BlockTable` holds one reference on each of its blocks and gives them
//! back when dropped, so finishing, aborting, failing or preempting a sequence cannot leak blocks
//! as long as its table is dropped or `release`d.

use mla_core::CacheLayout;
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
    /// Free block ids; popped from the end, so a fresh pool hands out 0, 1, 2, ...
    free: Vec<u32>,
    /// References per block; a block is on the free list exactly when its count is 0.
    refs: Vec<u32>,
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
        assert!(layout.block_size > 0, "block_size must be positive");
        assert!(layout.num_blocks <= u32::MAX as usize, "block ids are u32");
        let pool = Pool { free: (0..layout.num_blocks as u32).rev().collect(), refs: vec![0; layout.num_blocks] };
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

    pub fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }

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
        if pool.free.len() < needed {
            return Err(OutOfBlocks { needed, free: pool.free.len() });
        }
        for _ in 0..needed {
            let b = pool.free.pop().expect("checked above");
            debug_assert_eq!(pool.refs[b as usize], 0, "block {b} on the free list is referenced");
            pool.refs[b as usize] = 1;
            self.blocks.push(b);
        }
        Ok(())
    }

    /// A new table whose first `num_blocks` blocks are this table's, each gaining a reference.
    /// The caller must never write positions inside shared blocks (see the scheduler's prefix
    /// rule), because the other owners read them.
    pub fn share_prefix(&self, num_blocks: usize) -> BlockTable {
        assert!(num_blocks <= self.blocks.len(), "cannot share {num_blocks} of {} blocks", self.blocks.len());
        let shared = self.blocks[..num_blocks].to_vec();
        let mut pool = self.manager.lock();
        for &b in &shared {
            pool.refs[b as usize] += 1;
        }
        BlockTable { manager: self.manager.clone(), blocks: shared }
    }

    /// Drops every reference; blocks nobody else holds go back to the free list.
    pub fn release(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        let mut pool = self.manager.lock();
        for b in self.blocks.drain(..) {
            let r = &mut pool.refs[b as usize];
            assert!(*r > 0, "block {b} released more often than referenced");
            *r -= 1;
            if *r == 0 {
                pool.free.push(b);
            }
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.release();
    }
}
