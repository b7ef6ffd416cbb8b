//! Subnormal floats flushed to zero while the engine computes.
//!
//! A multiply-add whose operand or result is subnormal takes a microcode assist on x86 (about a
//! hundred times the cost of one that is not), and activations do underflow: SiLU of a large
//! negative gate is one. So every thread that computes a forward (the caller, for the forward's
//! duration, and the pool's workers, for their life) runs with the MXCSR's flush-to-zero and
//! denormals-are-zero bits set. Every path computes under the same mode, so results stay
//! identical across instruction sets, batch shapes, threads and splits; a value below 1.2e-38
//! read as zero moves no log-probability.

/// The MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = 0x8040;

#[cfg(target_arch = "x86_64")]
fn csr() -> u32 {
    let mut v = 0u32;
    // SAFETY: `stmxcsr` stores the 4-byte MXCSR at the address given, a local u32.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags)) };
    v
}

#[cfg(target_arch = "x86_64")]
fn set_csr(v: u32) {
    // SAFETY: `ldmxcsr` loads the MXCSR from a local u32; the value differs from the current one
    // only in the FTZ and DAZ bits (or restores a value read before), which no code here relies
    // on being clear.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly)) };
}

/// Sets the mode on this thread until the value is dropped, then restores what was there.
pub(crate) struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushSubnormals {
    pub(crate) fn on() -> FlushSubnormals {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = csr();
            set_csr(saved | FTZ_DAZ);
            FlushSubnormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushSubnormals {}
    }

    /// Sets the mode on this thread for good (a pool worker's whole life).
    pub(crate) fn forever() {
        std::mem::forget(FlushSubnormals::on());
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        set_csr(self.saved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a * b`, computed where it is written: black boxes around the operands and the result
    /// keep the compiler from moving the multiply across a change of mode.
    fn product(a: f32, b: f32) -> f32 {
        std::hint::black_box(std::hint::black_box(a) * std::hint::black_box(b))
    }

    #[test]
    fn subnormal_products_flush_inside_the_guard_only() {
        // 1e-40: a subnormal.
        let before = product(1e-20, 1e-20);
        assert!(before > 0.0 && before < f32::MIN_POSITIVE);
        {
            let _on = FlushSubnormals::on();
            #[cfg(target_arch = "x86_64")]
            assert_eq!(product(1e-20, 1e-20), 0.0);
        }
        assert_eq!(product(1e-20, 1e-20).to_bits(), before.to_bits());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_thread_of_a_forward_flushes() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let pool = crate::backend::cpu::pool::ThreadPool::new(3);
        let _on = FlushSubnormals::on();
        let flushed = AtomicUsize::new(0);
        // Items one at a time, each taking a while, so the workers wake and take some.
        pool.run(300, 1, &|items| {
            for _ in items {
                let t = std::time::Instant::now();
                while t.elapsed() < std::time::Duration::from_micros(50) {
                    std::hint::spin_loop();
                }
                if product(1e-20, 1e-20) == 0.0 {
                    flushed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        assert_eq!(flushed.load(Ordering::Relaxed), 300);
    }
}
