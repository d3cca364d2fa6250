//! Block pool bookkeeping: allocation, sharing, release, admission refusal.

use mla_core::CacheLayout;
use mla_engine::block_manager::{BlockManager, OutOfBlocks};

fn pool(num_blocks: usize) -> BlockManager {
    BlockManager::new(CacheLayout { block_size: 4, num_blocks })
}

#[test]
fn reserve_covers_positions_and_hands_out_distinct_blocks() {
    let m = pool(8);
    let mut a = m.new_table();
    a.reserve(9).unwrap(); // positions 0..9 need ceil(9/4) = 3 blocks
    assert_eq!(a.len(), 3);
    assert_eq!(a.capacity_tokens(), 12);
    a.reserve(12).unwrap(); // still fits
    assert_eq!(a.len(), 3);
    let mut b = m.new_table();
    b.reserve(13).unwrap();
    assert_eq!(b.len(), 4);
    let mut all: Vec<u32> = a.blocks().iter().chain(b.blocks()).copied().collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 7, "blocks handed out twice: {:?} {:?}", a.blocks(), b.blocks());
    assert_eq!(m.free_blocks(), 1);
    assert!((m.usage() - 7.0 / 8.0).abs() < 1e-12);
}

#[test]
fn allocation_is_all_or_nothing() {
    let m = pool(4);
    let mut a = m.new_table();
    a.reserve(10).unwrap(); // 3 blocks
    let mut b = m.new_table();
    assert_eq!(b.reserve(8), Err(OutOfBlocks { needed: 2, free: 1 }));
    assert!(b.is_empty(), "a refused allocation must not keep a partial table");
    assert_eq!(m.free_blocks(), 1);
    b.reserve(4).unwrap();
    assert_eq!(m.free_blocks(), 0);
}

#[test]
fn shared_blocks_are_freed_by_their_last_owner() {
    let m = pool(6);
    let mut prefix = m.new_table();
    prefix.reserve(8).unwrap(); // 2 blocks
    let shared: Vec<u32> = prefix.blocks().to_vec();
    let mut c0 = prefix.share_prefix(2);
    let mut c1 = prefix.share_prefix(2);
    c0.reserve(10).unwrap();
    c1.reserve(10).unwrap();
    assert_eq!(&c0.blocks()[..2], &shared[..]);
    assert_eq!(&c1.blocks()[..2], &shared[..]);
    assert_ne!(c0.blocks()[2], c1.blocks()[2], "the tails are private");
    for &b in &shared {
        assert_eq!(m.ref_count(b), 3);
    }
    assert_eq!(m.used_blocks(), 4);
    drop(prefix);
    assert_eq!(m.used_blocks(), 4, "completions still hold the prefix");
    c0.release();
    assert!(c0.is_empty());
    assert_eq!(m.used_blocks(), 3);
    for &b in &shared {
        assert_eq!(m.ref_count(b), 1);
    }
    drop(c1);
    assert_eq!(m.free_blocks(), 6);
    assert_eq!(m.usage(), 0.0);
}

#[test]
fn dropping_tables_returns_every_block() {
    let m = pool(16);
    {
        let mut tables: Vec<_> = (0..5).map(|_| m.new_table()).collect();
        for (i, t) in tables.iter_mut().enumerate() {
            t.reserve(3 * i + 1).unwrap();
        }
        let forks: Vec<_> = tables.iter().map(|t| t.share_prefix(t.len())).collect();
        assert!(m.used_blocks() > 0);
        drop(forks);
        assert!(m.used_blocks() > 0);
    }
    assert_eq!(m.free_blocks(), 16);
    // The pool is whole again: a table can take all of it.
    let mut t = m.new_table();
    t.reserve(64).unwrap();
    assert_eq!(m.free_blocks(), 0);
}
