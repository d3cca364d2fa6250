//! `IdMap`: a `HashMap` keyed by request id with a multiplicative hash instead of SipHash. The
//! engine looks requests up several times per sequence per step; the ids are the engine's own
//! counter, so resistance to chosen keys buys nothing there.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Fibonacci hashing of one `u64`: consecutive ids spread over all bits, high ones included
/// (the table takes its control bits from the top of the hash).
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed in practice; anything else still hashes correctly.
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[cfg(test)]
mod tests {
    use super::IdMap;

    #[test]
    fn behaves_as_a_map() {
        let mut m: IdMap<u64> = IdMap::default();
        for id in 0..10_000u64 {
            m.insert(id * 3, id);
        }
        assert_eq!(m.len(), 10_000);
        assert!((0..10_000u64).all(|id| m[&(id * 3)] == id));
        assert!(!m.contains_key(&1));
        m.remove(&30);
        assert_eq!(m.get(&30), None);
    }
}
