//! The prefix cache's names for a prompt: a hash chain over its full blocks of tokens, which the
//! driver computes and sends in `OpenSession.prefix_blocks` (and `Close.prefix_blocks`), and
//! which each worker salts with its stage and the tenant before it looks anything up.

use crate::ProtoError;
use sha2::{Digest, Sha256};

/// Tokens per prefix-cache block; only full blocks are named or cached.
pub const PREFIX_BLOCK: usize = 16;

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
    fn too_many_or_malformed_hashes_are_refused() {
        let ok = prefix_chain_bytes(&[1; 64]);
        assert_eq!(check_prefix_blocks(&ok, 64).unwrap().len(), 4);
        assert!(matches!(check_prefix_blocks(&ok, 63), Err(ProtoError::BadInput(_))));
        let mut bad = ok.clone();
        bad[2].pop();
        assert!(matches!(check_prefix_blocks(&bad, 64), Err(ProtoError::BadInput(_))));
    }
}
