//! Simulated engine prefix cache: an LRU of chained token-block hashes.
//!
//! The prompt is cut into blocks of `block_tokens` tokens; the hash of block `i` depends on the
//! hashes of all blocks before it (a chain), exactly like the block hashes of a paged KV cache.
//! A request's cached tokens are `block_tokens` × the number of its leading blocks present.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Chain hashes of the full blocks of `tokens` (a trailing partial block is not hashed).
/// `seed` separates caches of different models.
pub fn block_hashes<T: AsRef<str>>(seed: &str, tokens: &[T], block_tokens: u32) -> Vec<u64> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut prev = {
        let mut h = DefaultHasher::new();
        seed.hash(&mut h);
        h.finish()
    };
    tokens
        .chunks_exact(block_tokens as usize)
        .map(|block| {
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            for t in block {
                t.as_ref().hash(&mut h);
            }
            prev = h.finish();
            prev
        })
        .collect()
}

/// LRU set of block hashes bounded by a capacity in blocks.
#[derive(Debug, Default)]
pub struct PrefixCache {
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of leading blocks of `hashes` present in the cache (no LRU update).
    pub fn leading_hits(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamp_of.contains_key(h))
            .count()
    }

    /// Insert (or refresh) every block, most recent last, then evict least recently used
    /// blocks until at most `capacity_blocks` remain.
    pub fn insert(&mut self, hashes: &[u64], capacity_blocks: usize) {
        for &h in hashes {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(h, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, h);
        }
        self.evict_to(capacity_blocks);
    }

    /// Evict least recently used blocks until at most `capacity_blocks` remain.
    pub fn evict_to(&mut self, capacity_blocks: usize) {
        while self.stamp_of.len() > capacity_blocks {
            match self.by_stamp.pop_first() {
                Some((_, h)) => {
                    self.stamp_of.remove(&h);
                }
                None => break,
            }
        }
    }

    /// Blocks currently cached.
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<&str> {
        s.split_whitespace().collect()
    }

    #[test]
    fn chain_hash_depends_on_prefix() {
        let a = block_hashes("m", &words("a b c d e f"), 2);
        let b = block_hashes("m", &words("x y c d e f"), 2);
        assert_eq!(a.len(), 3);
        assert_ne!(a[1], b[1], "block 1 must depend on block 0");
        let c = block_hashes("m", &words("a b c d e f g"), 2);
        assert_eq!(a, c, "partial trailing block is not hashed");
        let d = block_hashes("other", &words("a b c d e f"), 2);
        assert_ne!(a[0], d[0]);
        assert!(block_hashes("m", &words("a b"), 0).is_empty());
    }

    #[test]
    fn leading_hits_and_lru() {
        let mut c = PrefixCache::new();
        let a = block_hashes("m", &words("1 2 3 4 5 6 7 8"), 2); // 4 blocks
        c.insert(&a, 6);
        assert_eq!(c.leading_hits(&a), 4);
        let ext = block_hashes("m", &words("1 2 3 4 5 6 7 8 9 10"), 2);
        assert_eq!(c.leading_hits(&ext), 4);
        let b = block_hashes("m", &words("a b c d e f"), 2); // 3 blocks -> evicts 1 oldest
        c.insert(&b, 6);
        assert_eq!(c.len(), 6);
        assert_eq!(c.leading_hits(&a), 0, "first block of a was evicted");
        assert_eq!(c.leading_hits(&b), 3);
        // Refresh makes a block recent.
        c.insert(&b[..1], 6);
        c.insert(&block_hashes("z", &words("q w e r t y u i"), 2), 6);
        assert_eq!(c.leading_hits(&b), 1);
        c.evict_to(0);
        assert!(c.is_empty());
    }
}
