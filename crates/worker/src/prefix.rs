//! The prefix cache: copies of sessions' KV in blocks of `PREFIX_BLOCK` positions, keyed by a
//! hash chain over the tokens (the driver's) salted with this stage and the tenant (ours), so a
//! session whose prompt starts like an earlier one's attaches those blocks and prefills only
//! the rest. Blocks are copied in and out, never shared with a session, so sessions stay
//! independent; they are evicted least recently used under a byte budget, leaves first (a
//! chain never has a hole), and never while a session that was told of them may still attach.
//! Each block also carries its route digest (tenant and chain, no stage), so the worker can tell
//! the trackers which prefixes it holds (`recent`).

use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// A block's name in the cache: SHA-256(stage salt || tenant || the driver's chain hash).
pub(crate) type Key = [u8; 32];

/// What makes a stage's KV bits for the same tokens differ: the model, the layers, the engine
/// (numerics and KV dtype included) and the seam's dtype (the rows it is computed from).
pub(crate) fn stage_salt(model_id: &str, layers: (u32, u32), engine: &str, seam: &str) -> Key {
    let mut h = Sha256::new();
    h.update(b"dgr-prefix-stage");
    for part in [model_id, engine, seam] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(layers.0.to_le_bytes());
    h.update(layers.1.to_le_bytes());
    h.finalize().into()
}

/// The cache keys of a chain for one stage and tenant.
pub(crate) fn keys(salt: &Key, tenant: &str, chain: &[[u8; 32]]) -> Vec<Key> {
    chain
        .iter()
        .map(|c| {
            let mut h = Sha256::new();
            h.update(salt);
            h.update((tenant.len() as u64).to_le_bytes());
            h.update(tenant.as_bytes());
            h.update(c);
            h.finalize().into()
        })
        .collect()
}

/// The route digests of a chain for one tenant (`dgr_proto::route_digest`).
pub(crate) fn route_digests(tenant: &str, chain: &[[u8; 32]]) -> Vec<u64> {
    let mask = dgr_proto::tenant_mask(tenant);
    chain.iter().map(|c| dgr_proto::route_digest(mask, c)).collect()
}

struct Entry {
    /// The block as the engine stores it (its KV dtype's bytes).
    kv: Vec<u8>,
    route: u64,
    parent: Option<Key>,
    /// Blocks above it in its chain.
    depth: u32,
    /// Blocks held whose parent this is: a block with children is not evicted.
    children: usize,
    /// Sessions told they may attach it.
    pins: usize,
    used: u64,
}

pub(crate) struct PrefixCache {
    budget: usize,
    bytes: usize,
    tick: u64,
    /// Bumped whenever what `recent` returns may have changed.
    changes: u64,
    entries: HashMap<Key, Entry>,
}

impl PrefixCache {
    /// A cache of at most `budget` bytes of blocks; 0 turns it off.
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache { budget, bytes: 0, tick: 0, changes: 0, entries: HashMap::new() }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn blocks(&self) -> usize {
        self.entries.len()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.entries.contains_key(key)
    }

    /// Pins the longest leading run of `keys` held and returns its length.
    pub fn pin(&mut self, keys: &[Key]) -> usize {
        self.tick += 1;
        let mut n = 0;
        for k in keys {
            let Some(e) = self.entries.get_mut(k) else { break };
            e.pins += 1;
            e.used = self.tick;
            n += 1;
        }
        self.changes += u64::from(n > 0);
        n
    }

    /// A count that moves whenever the blocks held or their recency order changed.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// The route digests of the `n` most recently used blocks, most recent first: parents before
    /// children on a tie (a chain used at once), so a cut keeps chains whole from their roots.
    pub fn recent(&self, n: usize) -> Vec<u64> {
        let mut all: Vec<(u64, u32, u64)> = self.entries.values().map(|e| (e.used, e.depth, e.route)).collect();
        let order = |a: &(u64, u32, u64), b: &(u64, u32, u64)| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2));
        if all.len() > n {
            all.select_nth_unstable_by(n, order);
            all.truncate(n);
        }
        all.sort_unstable_by(order);
        all.into_iter().map(|(_, _, route)| route).collect()
    }

    pub fn unpin(&mut self, keys: &[Key]) {
        for k in keys {
            if let Some(e) = self.entries.get_mut(k) {
                e.pins = e.pins.saturating_sub(1);
            }
        }
    }

    pub fn get(&self, key: &Key) -> Option<&[u8]> {
        self.entries.get(key).map(|e| e.kv.as_slice())
    }

    /// Holds `kv` under `key` (route digest `route`), a child of `parent` (None for a chain's
    /// first block), evicting older leaves to make room. Refused (false) when the parent is not
    /// held (it would leave a hole) or the room cannot be made.
    pub fn insert(&mut self, key: Key, route: u64, parent: Option<Key>, kv: Vec<u8>) -> bool {
        if self.entries.contains_key(&key) || parent.is_some_and(|p| !self.entries.contains_key(&p)) {
            return false;
        }
        let size = kv.len();
        while self.bytes + size > self.budget {
            if !self.evict_one(parent.as_ref()) {
                return false;
            }
        }
        let mut depth = 0;
        if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
            p.children += 1;
            depth = p.depth + 1;
        }
        self.tick += 1;
        self.changes += 1;
        self.bytes += size;
        self.entries.insert(key, Entry { kv, route, parent, depth, children: 0, pins: 0, used: self.tick });
        true
    }

    /// Evicts the least recently used unpinned leaf other than `keep`; false if there is none.
    fn evict_one(&mut self, keep: Option<&Key>) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(k, e)| e.children == 0 && e.pins == 0 && Some(*k) != keep)
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| *k);
        let Some(k) = victim else { return false };
        if let Some(e) = self.entries.remove(&k) {
            self.changes += 1;
            self.bytes -= e.kv.len();
            if let Some(p) = e.parent.and_then(|p| self.entries.get_mut(&p)) {
                p.children -= 1;
            }
        }
        true
    }

    #[cfg(test)]
    pub fn pinned_blocks(&self) -> usize {
        self.entries.values().filter(|e| e.pins > 0).count()
    }

    /// Every held block's parent is held: a chain has no hole.
    #[cfg(test)]
    pub fn whole(&self) -> bool {
        self.entries.values().all(|e| e.parent.is_none_or(|p| self.entries.contains_key(&p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(tag: u8, n: usize) -> Vec<Key> {
        (0..n).map(|i| [tag.wrapping_mul(31).wrapping_add(i as u8); 32]).collect()
    }

    fn fill(c: &mut PrefixCache, keys: &[Key]) -> usize {
        let mut n = 0;
        for (i, k) in keys.iter().enumerate() {
            if c.insert(*k, k[0] as u64, i.checked_sub(1).map(|j| keys[j]), vec![i as u8; 16]) {
                n += 1;
            }
        }
        n
    }

    #[test]
    fn eviction_takes_old_leaves_first_and_never_pinned_blocks() {
        // Room for 5 blocks of 16 bytes.
        let mut c = PrefixCache::new(80);
        let (a, b) = (chain(1, 3), chain(2, 3));
        assert_eq!(fill(&mut c, &a), 3);
        assert_eq!(c.pin(&a[..2]), 2);
        assert_eq!(fill(&mut c, &b), 3, "a's unpinned leaf makes room");
        assert!(!c.contains(&a[2]) && c.contains(&a[1]) && c.whole());
        // Only b's leaves may go now; a's pinned blocks stay however old.
        assert_eq!(fill(&mut c, &chain(3, 2)), 2);
        assert!(c.contains(&a[0]) && c.contains(&a[1]) && c.whole());
        assert_eq!(c.bytes(), 80);
        c.unpin(&a[..2]);
        assert_eq!(c.pin(&a), 2, "the longest held run");
        assert!(!c.insert([9; 32], 9, Some([8; 32]), vec![0; 16]), "a block whose parent is gone would be a hole");
        let keys = keys(&[0; 32], "tenant", &[[1; 32]]);
        assert_ne!(keys, super::keys(&[0; 32], "other", &[[1; 32]]), "tenants name blocks apart");
    }

    #[test]
    fn recent_lists_the_most_recently_used_blocks_first_and_changes_say_when_it_moved() {
        let mut c = PrefixCache::new(1 << 20);
        let (a, b) = (chain(1, 3), chain(2, 4));
        let before = c.changes();
        fill(&mut c, &a);
        fill(&mut c, &b);
        let digest = |k: &Key| k[0] as u64;
        assert_eq!(c.recent(100), b.iter().rev().chain(a.iter().rev()).map(digest).collect::<Vec<_>>());
        assert!(c.changes() > before);
        // Using a's chain moves it to the front, roots first (one tick for the whole run).
        let used = c.changes();
        assert_eq!(c.pin(&a), 3);
        assert!(c.changes() > used);
        let root_first = [a[0], a[1], a[2], b[3], b[2]].iter().map(digest).collect::<Vec<_>>();
        assert_eq!(c.recent(5), root_first);
        assert_eq!(c.recent(0), Vec::<u64>::new());
        let unchanged = c.changes();
        assert_eq!(c.pin(&chain(9, 2)), 0);
        assert_eq!(c.changes(), unchanged, "a miss moves nothing");
        let r = route_digests("t", &[[1; 32], [2; 32]]);
        assert_eq!(r.len(), 2);
        assert_ne!(r, route_digests("u", &[[1; 32], [2; 32]]), "tenants differ");
    }

    #[test]
    fn a_budget_too_small_for_a_block_holds_nothing() {
        let mut c = PrefixCache::new(8);
        assert_eq!(fill(&mut c, &chain(1, 2)), 0);
        assert_eq!((c.blocks(), c.bytes()), (0, 0));
    }
}
