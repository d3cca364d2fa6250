//! Content hashes of full KV cache blocks, for automatic prefix caching. A block's hash covers
//! its tokens and, chained in, the hash of the block before it, so equal hashes mean equal
//! prefixes up to and including the block. Nothing else changes a block's latent KV in this
//! server: one model per process, no adapters, no multimodal inputs, and positions are implied
//! by the chain.
//!
//! 128 bits from two SipHash-1-3 instances with random keys drawn at start: a client cannot
//! aim a collision at a key it does not know, and by chance one is about as likely as 2^-64
//! among millions of blocks.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

pub type BlockHash = u128;

/// The keyed hash function of a prefix cache. The ranks of one engine share it (cloning keeps
/// the keys), so the router looks one chain of a prompt's hashes up in all of them.
#[derive(Debug, Clone)]
pub struct PrefixHasher {
    keys: [RandomState; 2],
}

impl Default for PrefixHasher {
    fn default() -> Self {
        PrefixHasher { keys: [RandomState::new(), RandomState::new()] }
    }
}

impl PrefixHasher {
    /// The hash of a block holding `tokens` after a prefix whose last block hashed to `parent`.
    pub fn block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let [mut lo, mut hi] = self.keys.each_ref().map(RandomState::build_hasher);
        for h in [&mut lo, &mut hi] {
            h.write_u128(parent.unwrap_or(0));
            h.write_u8(u8::from(parent.is_some()));
            h.write_usize(tokens.len());
        }
        // The tokens go in as bytes, many at a time: SipHash then runs a round per 8 bytes
        // instead of paying a call per token, which made a 128k-token prompt cost 1.3 ms.
        let mut bytes = [0u8; 256];
        for chunk in tokens.chunks(bytes.len() / 4) {
            for (b, t) in bytes.chunks_exact_mut(4).zip(chunk) {
                b.copy_from_slice(&t.to_le_bytes());
            }
            lo.write(&bytes[..chunk.len() * 4]);
            hi.write(&bytes[..chunk.len() * 4]);
        }
        (u128::from(lo.finish()) << 64) | u128::from(hi.finish())
    }

    /// Extends `hashes` (the hashes of the leading full blocks of `tokens`, possibly none yet)
    /// to every full block of `tokens[..upto]`.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], upto: usize, block_size: usize) {
        let full = upto.min(tokens.len()) / block_size;
        while hashes.len() < full {
            let i = hashes.len();
            let h = self.block(hashes.last().copied(), &tokens[i * block_size..(i + 1) * block_size]);
            hashes.push(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_hash_equal_and_the_chain_separates_equal_blocks() {
        let h = PrefixHasher::default();
        let a: Vec<u32> = (0..12).collect();
        let mut b = a.clone();
        b[1] = 99;
        let (mut ha, mut hb) = (vec![], vec![]);
        h.extend(&mut ha, &a, 12, 4);
        h.extend(&mut hb, &b, 12, 4);
        assert_eq!(ha.len(), 3);
        // Blocks 1 and 2 hold the same tokens in both, but their prefixes differ.
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        let mut again = vec![];
        h.extend(&mut again, &a, 9, 4);
        assert_eq!(again, ha[..2]);
        // A block of the same tokens at the start is not the same as after a prefix.
        assert_ne!(h.block(None, &a[4..8]), ha[1]);
        // The byte encoding keeps token boundaries and lengths apart.
        assert_ne!(h.block(None, &[1, 0]), h.block(None, &[1]));
        assert_ne!(h.block(None, &[0x0102_0304]), h.block(None, &[0x0304, 0x0102]));
        let long: Vec<u32> = (0..100).collect();
        assert_ne!(h.block(None, &long), h.block(None, &long[..99]));
        // Another scheduler's keys give other hashes.
        assert_ne!(PrefixHasher::default().block(None, &a[..4]), ha[0]);
    }
}
