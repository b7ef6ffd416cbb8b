//! The prefix cache's names for a prompt: a hash chain over its full blocks of tokens, which the
//! driver computes and sends in `OpenSession.prefix_blocks` (and `Close.prefix_blocks`), and
//! which each worker salts with its stage and the tenant before it looks anything up.

//!
//! For routing, a block is named without the stage: its *route digest* mixes the chain hash with
//! the tenant alone, so the tracker can match what a request's prompt starts with against what
//! each worker reports holding (`Heartbeat.prefix`) without knowing the stages' salts.

use crate::{PrefixProbe, ProtoError};
use sha2::{Digest, Sha256};

/// Tokens per prefix-cache block; only full blocks are named or cached.
pub const PREFIX_BLOCK: usize = 16;
/// Prompt blocks a route request names at most.
pub const MAX_PREFIX_PROBES: usize = 64;
/// Of these, the first blocks always named: short shared prefixes (system prompts) end here.
const DENSE_PROBES: u32 = 32;
/// Route digests a heartbeat carries at most (8 KiB).
pub const MAX_HELD_DIGESTS: usize = 1024;

/// The chain hashes of `tokens`' full blocks: c_0 = SHA-256("dgr-prefix"),
/// c_i = SHA-256(c_{i-1} || block i's tokens as u32 little-endian), one per block (c_1..).
/// So a block's hash names every token before it too.
pub fn prefix_chain(tokens: &[u32]) -> Vec<[u8; 32]> {
    let mut c: [u8; 32] = Sha256::digest(b"dgr-prefix").into();
    tokens
        .chunks_exact(PREFIX_BLOCK)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(c);
            for t in block {
                h.update(t.to_le_bytes());
            }
            c = h.finalize().into();
            c
        })
        .collect()
}

/// The chain hashes as the wire carries them.
pub fn prefix_chain_bytes(tokens: &[u32]) -> Vec<Vec<u8>> {
    prefix_chain(tokens).into_iter().map(|c| c.to_vec()).collect()
}

/// Checks chain hashes from the wire for a session of `max_positions`: at most one per full block
/// it can hold, each 32 bytes.
pub fn check_prefix_blocks(blocks: &[Vec<u8>], max_positions: u64) -> Result<Vec<[u8; 32]>, ProtoError> {
    let most = max_positions as usize / PREFIX_BLOCK;
    if blocks.len() > most {
        return Err(ProtoError::BadInput(format!(
            "{} prefix blocks for a session of {max_positions} positions (at most {most})",
            blocks.len()
        )));
    }
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            <[u8; 32]>::try_from(b.as_slice()).map_err(|_| ProtoError::BadInput(format!("prefix block {i} is {} bytes, not 32", b.len())))
        })
        .collect()
}

/// What a tenant mixes into its blocks' route digests: 64 bits of SHA-256("dgr-route" ‖ tenant).
pub fn tenant_mask(tenant: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(b"dgr-route");
    h.update((tenant.len() as u64).to_le_bytes());
    h.update(tenant.as_bytes());
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 of 32 bytes"))
}

/// A block's route digest: its chain hash's first 64 bits (already uniform) under the tenant's
/// mask. Equal for the same tenant and prefix on every stage; a hint, never a cache key.
pub fn route_digest(mask: u64, chain: &[u8; 32]) -> u64 {
    chain_word(chain) ^ mask
}

fn chain_word(chain: &[u8; 32]) -> u64 {
    u64::from_le_bytes(chain[..8].try_into().expect("8 of 32 bytes"))
}

/// The blocks of a prompt's chain a route request names: all of them up to `MAX_PREFIX_PROBES`;
/// past that the first `DENSE_PROBES` (where short shared prefixes end) and the rest spread
/// evenly up to the last block, so a match anywhere is found to within n/32 blocks.
pub fn prefix_probes(chain: &[[u8; 32]]) -> Vec<PrefixProbe> {
    let n = chain.len() as u32;
    let probe = |blocks: u32| PrefixProbe { blocks, chain: chain_word(&chain[blocks as usize - 1]) };
    if n as usize <= MAX_PREFIX_PROBES {
        return (1..=n).map(probe).collect();
    }
    let spread = MAX_PREFIX_PROBES as u32 - DENSE_PROBES;
    let rest = u64::from(n - DENSE_PROBES);
    let tail = (1..=u64::from(spread)).map(|k| DENSE_PROBES + (k * rest).div_ceil(u64::from(spread)) as u32);
    (1..=DENSE_PROBES).chain(tail).map(probe).collect()
}

/// Checks a route request's probes: at most `MAX_PREFIX_PROBES`, blocks from 1, ascending.
pub fn check_prefix_probes(probes: &[PrefixProbe]) -> Result<(), ProtoError> {
    if probes.len() > MAX_PREFIX_PROBES {
        return Err(ProtoError::BadInput(format!("{} prefix probes (at most {MAX_PREFIX_PROBES})", probes.len())));
    }
    let ascending = probes.first().is_none_or(|p| p.blocks >= 1) && probes.windows(2).all(|w| w[0].blocks < w[1].blocks);
    if !ascending {
        return Err(ProtoError::BadInput("prefix probes must name blocks from 1, ascending".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_hash_names_its_whole_prefix_and_only_full_blocks_count() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[3] = 99;
        let (ca, cb) = (prefix_chain(&a), prefix_chain(&b));
        assert_eq!(ca.len(), 2, "40 tokens hold two full blocks");
        assert!(ca[0] != cb[0] && ca[1] != cb[1], "a change in block 0 changes every later hash");
        assert_eq!(prefix_chain(&a[..32]), ca, "the tail past the last full block is not named");
        assert!(prefix_chain(&a[..15]).is_empty());
    }

    #[test]
    fn probes_name_every_block_of_a_short_prompt_and_a_spread_of_a_long_one() {
        for blocks in [0usize, 1, 5, 64, 65, 100, 1000, 5000] {
            let tokens: Vec<u32> = (0..(blocks * PREFIX_BLOCK) as u32).collect();
            let chain = prefix_chain(&tokens);
            let probes = prefix_probes(&chain);
            check_prefix_probes(&probes).unwrap();
            assert_eq!(probes.len(), blocks.min(MAX_PREFIX_PROBES), "{blocks}");
            let named: Vec<u32> = probes.iter().map(|p| p.blocks).collect();
            // The dense head, then every block or a spread ending at the last.
            assert!(named.iter().take(32).enumerate().all(|(i, &b)| b == i as u32 + 1), "{blocks}: {named:?}");
            assert_eq!(named.last().copied().unwrap_or(0), blocks as u32);
            let widest = named.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(1) as usize;
            assert!(widest <= 1 + blocks / 32, "{blocks}: gaps of {widest}");
            for p in &probes {
                assert_eq!(route_digest(tenant_mask("t"), &chain[p.blocks as usize - 1]), p.chain ^ tenant_mask("t"));
            }
        }
        assert_ne!(tenant_mask(""), tenant_mask("a"));
        let probe = |blocks| PrefixProbe { blocks, chain: 0 };
        for bad in [vec![probe(0)], vec![probe(2), probe(2)], vec![probe(3), probe(1)], (1..=65).map(probe).collect()] {
            assert!(matches!(check_prefix_probes(&bad), Err(ProtoError::BadInput(_))), "{bad:?}");
        }
    }

    #[test]
    fn too_many_or_malformed_hashes_are_refused() {
        let ok = prefix_chain_bytes(&[1; 64]);
        assert_eq!(check_prefix_blocks(&ok, 64).unwrap().len(), 4);
        assert!(matches!(check_prefix_blocks(&ok, 63), Err(ProtoError::BadInput(_))));
        let mut bad = ok.clone();
        bad[2].pop();
        assert!(matches!(check_prefix_blocks(&bad, 64), Err(ProtoError::BadInput(_))));
    }
}
