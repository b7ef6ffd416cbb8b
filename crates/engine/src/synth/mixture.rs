//! Which type each matrix of a synthetic model gets: one type for all, or llama.cpp's Q4_K_M
//! mixture as `llama_tensor_get_type` in its src/llama-quant.cpp chooses it (for models without
//! experts or a fused QKV, the only ones synth writes).

use dgr_gguf::GgmlType;

/// How the matrices' types are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mixture {
    /// Every matrix, the embedding included, is the spec's `ty`.
    #[default]
    Pure,
    /// llama.cpp's Q4_K_M: Q4_K, but Q6_K for the head (the embedding when it is the head) and
    /// for `attn_v` and `ffn_down` on the layers [`use_more_bits`] picks; a type whose block does
    /// not divide a matrix's rows falls back as llama.cpp's does. The spec's `ty` must be Q4_K.
    Q4KM,
}

/// llama.cpp's `LLAMA_FTYPE_MOSTLY_Q4_K_M`, the `general.file_type` its quantizer records.
pub(super) const Q4_K_M_FILE_TYPE: u32 = 15;

/// llama.cpp's choice of layers that get more bits: the first and last eighth, and every third
/// layer between.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    // Past the first eighth, so the subtraction cannot wrap.
    layer < n_layers / 8 || layer >= 7 * n_layers / 8 || (layer - n_layers / 8) % 3 == 2
}

/// The type Q4_K_M gives the matrix `name` (a GGUF tensor name: `blk.N.attn_v.weight`,
/// `output.weight`, ...) whose rows are `row_len` long, in a model of `n_layers` layers whose
/// head is the embedding when `tied`.
pub fn q4_k_m_type(name: &str, row_len: u64, n_layers: usize, tied: bool) -> GgmlType {
    let head = name == "output.weight" || (tied && name == "token_embd.weight");
    let layer = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|n| n.parse::<usize>().ok());
    let more_bits = |role: &str| name.ends_with(role) && layer.is_some_and(|l| use_more_bits(l, n_layers));
    let chosen = if head {
        // llama.cpp checks the head against the default type's block, then picks Q8_0 outright.
        if row_len.is_multiple_of(GgmlType::Q4_K.block_size() as u64) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q8_0
        }
    } else if more_bits(".attn_v.weight") || more_bits(".ffn_down.weight") {
        GgmlType::Q6_K
    } else {
        GgmlType::Q4_K
    };
    fallback(chosen, row_len)
}

/// llama.cpp's `tensor_type_fallback`: a 256-block type on rows it does not divide becomes the
/// 32-block type of about its size, and F16 when even that does not divide them.
fn fallback(ty: GgmlType, row_len: u64) -> GgmlType {
    if row_len.is_multiple_of(ty.block_size() as u64) {
        return ty;
    }
    let smaller = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if row_len.is_multiple_of(smaller.block_size() as u64) {
        smaller
    } else {
        GgmlType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_are_llama_cpps() {
        // 28 layers (Qwen2-7B): the first and last 3, and 3 + 3k + 2 between.
        let picked: Vec<usize> = (0..28).filter(|&l| use_more_bits(l, 28)).collect();
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        // 18 layers (gemma-3-270m's real Q4_K_M file).
        let picked: Vec<usize> = (0..18).filter(|&l| use_more_bits(l, 18)).collect();
        assert_eq!(picked, [0, 1, 4, 7, 10, 13, 15, 16, 17]);
        // Fewer than 8 layers: no first eighth, and layer 0 is not "two past" it.
        let picked: Vec<usize> = (0..4).filter(|&l| use_more_bits(l, 4)).collect();
        assert_eq!(picked, [2, 3]);
    }

    #[test]
    fn roles_heads_and_fallbacks() {
        assert_eq!(q4_k_m_type("blk.0.attn_v.weight", 3584, 28, false), GgmlType::Q6_K);
        assert_eq!(q4_k_m_type("blk.3.attn_v.weight", 3584, 28, false), GgmlType::Q4_K);
        assert_eq!(q4_k_m_type("blk.5.ffn_down.weight", 18944, 28, false), GgmlType::Q6_K);
        assert_eq!(q4_k_m_type("blk.5.ffn_up.weight", 3584, 28, false), GgmlType::Q4_K);
        assert_eq!(q4_k_m_type("blk.0.attn_q.weight", 3584, 28, false), GgmlType::Q4_K);
        assert_eq!(q4_k_m_type("output.weight", 3584, 28, false), GgmlType::Q6_K);
        assert_eq!(q4_k_m_type("token_embd.weight", 3584, 28, false), GgmlType::Q4_K);
        assert_eq!(q4_k_m_type("token_embd.weight", 3584, 28, true), GgmlType::Q6_K);
        // Rows of 640 (gemma-3-270m): no 256-block fits.
        assert_eq!(q4_k_m_type("token_embd.weight", 640, 18, true), GgmlType::Q8_0);
        assert_eq!(q4_k_m_type("blk.0.attn_v.weight", 640, 18, true), GgmlType::Q8_0);
        assert_eq!(q4_k_m_type("blk.2.attn_v.weight", 640, 18, true), GgmlType::Q5_0);
        // Rows of 48: not even a 32-block fits.
        assert_eq!(q4_k_m_type("blk.1.attn_q.weight", 48, 4, true), GgmlType::F16);
    }
}

#[cfg(test)]
mod written {
    use crate::synth::{Mixture, SynthSpec};
    use crate::Arch;
    use dgr_gguf::{GgmlType, Gguf};

    fn types(spec: &SynthSpec) -> Vec<(String, GgmlType)> {
        let g = Gguf::from_bytes(spec.to_gguf().unwrap()).unwrap();
        assert_eq!(g.get_u64("general.file_type").ok(), Some(15));
        g.tensors().iter().filter(|t| t.dims.len() == 2).map(|t| (t.name.clone(), t.ty)).collect()
    }

    #[test]
    fn a_q4_k_m_file_holds_the_mixture() {
        let spec = SynthSpec {
            layers: 8,
            hidden: 256,
            ffn: 512,
            arch: Arch::Qwen2,
            ty: GgmlType::Q4_K,
            mixture: Mixture::Q4KM,
            untied_head: true,
            ..SynthSpec::default()
        };
        // 8 layers: the first and last eighth (0 and 7), and 1 + 3k + 2 (3 and 6).
        for (name, ty) in types(&spec) {
            let more = ["blk.0.", "blk.3.", "blk.6.", "blk.7."].iter().any(|p| name.starts_with(p))
                && (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight"));
            let want = if name == "output.weight" || more { GgmlType::Q6_K } else { GgmlType::Q4_K };
            assert_eq!(ty, want, "{name}");
        }
    }

    #[test]
    fn rows_of_320_fall_back_and_a_tied_head_is_the_embedding() {
        let spec = SynthSpec { layers: 2, hidden: 320, ffn: 512, ty: GgmlType::Q4_K, mixture: Mixture::Q4KM, ..SynthSpec::default() };
        let got = types(&spec);
        assert!(!got.iter().any(|(n, _)| n == "output.weight"));
        for (name, ty) in got {
            // 2 layers: layer 1 is the last eighth; layer 0 gets no more bits.
            let want = match name.as_str() {
                "token_embd.weight" | "blk.1.attn_v.weight" => GgmlType::Q8_0,
                "blk.1.ffn_down.weight" => GgmlType::Q6_K,
                "blk.0.ffn_down.weight" => GgmlType::Q4_K,
                _ => GgmlType::Q5_0,
            };
            assert_eq!(ty, want, "{name}");
        }
    }

    #[test]
    fn the_mixture_needs_q4_k_underneath() {
        let spec = SynthSpec { mixture: Mixture::Q4KM, ..SynthSpec::default() };
        assert!(spec.to_gguf().is_err());
    }
}
