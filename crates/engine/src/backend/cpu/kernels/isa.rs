/// The instruction set a kernel runs with, chosen once at run time.
///
/// An `Isa` is a proof that this CPU can run the set it names: the only ways to get one are
/// [`Isa::SCALAR`] (every CPU) and detection ([`Isa::detect`], [`Isa::available`],
/// [`Isa::try_from_name`]), which return only sets the CPU reports. The kernels rely on this to
/// execute AVX2 or AVX-512 instructions, so the level is a private field: safe code cannot name
/// a set the CPU lacks.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Isa(Level);

/// The sets, weakest first (the derived order is the order of strength).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// Portable code only: runs on every CPU.
    pub const SCALAR: Isa = Isa(Level::Scalar);

    /// The best set this CPU supports, lowered by `DGR_ISA=scalar|avx2` when set (for tests and
    /// benchmarks; asking for more than the CPU has gives what it has).
    pub fn detect() -> Isa {
        let best = Self::best_available();
        match std::env::var("DGR_ISA").ok().as_deref() {
            Some("scalar") => Isa::SCALAR,
            Some("avx2") if best.0 >= Level::Avx2 => Isa(Level::Avx2),
            _ => best,
        }
    }

    /// Every set this CPU can run, scalar first.
    pub fn available() -> Vec<Isa> {
        let best = Self::best_available().0;
        [Level::Scalar, Level::Avx2, Level::Avx512].into_iter().filter(|l| *l <= best).map(Isa).collect()
    }

    /// The set called `name` (as [`Isa::name`] spells it), if this CPU can run it.
    pub fn try_from_name(name: &str) -> Option<Isa> {
        Self::available().into_iter().find(|i| i.name() == name)
    }

    fn best_available() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let base = is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if base && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Isa(Level::Avx512);
            }
            if base && is_x86_feature_detected!("avx2") {
                return Isa(Level::Avx2);
            }
        }
        Isa::SCALAR
    }

    /// What the kernels dispatch on. Holding an `Isa` means this CPU supports its level.
    pub(crate) fn level(self) -> Level {
        self.0
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Debug for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_cpu_has_can_be_named() {
        let all = Isa::available();
        assert_eq!(all[0], Isa::SCALAR);
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert!(all.contains(&Isa::detect()));
        for name in ["scalar", "avx2", "avx512"] {
            let got = Isa::try_from_name(name);
            assert_eq!(got.is_some(), all.iter().any(|i| i.name() == name), "{name}");
            assert!(got.is_none_or(|i| i.name() == name));
        }
        assert_eq!(Isa::try_from_name("sse9"), None);
    }
}
