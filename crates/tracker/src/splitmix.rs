//! splitmix64: a small deterministic generator, for the layouts of the planner's tests and
//! benchmarks and of `dgr bench tracker` (never for anything that must be unpredictable).

pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In `0..n`; `n` > 0.
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n)) as u32
    }

    /// In `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A swarm worker's layers of an `n`-layer model, as the benches lay swarms out: the common
    /// splits (the whole model, a half, a quarter or an eighth) and, one time in five, a random
    /// range of 4 to 24 layers.
    pub fn layer_range(&mut self, n: u32) -> (u32, u32) {
        match self.below(5) {
            4 => {
                let start = self.below(n);
                (start, (start + 4 + self.below(21)).min(n))
            }
            k => {
                let parts = 1 << k;
                let p = self.below(parts);
                (p * n / parts, (p + 1) * n / parts)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges_are_common_splits_or_short_random_runs_inside_the_model() {
        let mut rng = SplitMix64(7);
        for n in [32, 80] {
            for _ in 0..1000 {
                let (s, e) = rng.layer_range(n);
                assert!(s < e && e <= n, "{s}..{e} of {n}");
                let split = [1, 2, 4, 8].iter().any(|&p| (e - s) == n / p && s % (n / p) == 0);
                assert!(split || (e - s <= 24 && (e - s >= 4 || e == n)), "{s}..{e} of {n}");
            }
        }
    }
}
