/// The instruction set a kernel runs with, chosen once at run time.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// The best set this CPU supports, lowered by `DGR_ISA=scalar|avx2` when set (for tests and
    /// benchmarks; asking for more than the CPU has gives what it has).
    pub fn detect() -> Isa {
        let best = Self::best_available();
        match std::env::var("DGR_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") if best != Isa::Scalar => Isa::Avx2,
            _ => best,
        }
    }

    /// Every set this CPU can run, scalar first.
    pub fn available() -> Vec<Isa> {
        let best = Self::best_available();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| *i <= best).collect()
    }

    fn best_available() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let base = is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if base && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Isa::Avx512;
            }
            if base && is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl PartialOrd for Isa {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some((*self as u8).cmp(&(*other as u8)))
    }
}
