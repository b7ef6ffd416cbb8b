// How many integer dot instructions a core retires per cycle: the ceiling of the fast numerics'
// packed kernels, which need one vpdpwssd per 32 multiply-adds (16-bit activations), where
// llama.cpp's 8-bit activations need one vpdpbusd per 64.
//
//   cc -O2 -mavx512f benchmarks/microbench/dot-throughput.c -o /tmp/dot-throughput && /tmp/dot-throughput
//
// The clock is estimated from a chain of dependent adds (one a cycle); each figure is eight
// independent accumulators, so latency does not bound it.
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define EIGHT(x) x(0) x(1) x(2) x(3) x(4) x(5) x(6) x(7)
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", \
    "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17"
#define DPWSSD(i) "vpdpwssd 4*" #i "(%0)%{1to16%}, %%zmm20, %%zmm" #i "\n"
#define DPBUSD(i) "vpdpbusd 4*" #i "(%0)%{1to16%}, %%zmm20, %%zmm" #i "\n"
#define SPLIT(i) "vpbroadcastd 4*" #i "(%0), %%zmm1" #i "\n vpmaddwd %%zmm1" #i ", %%zmm20, %%zmm1" #i "\n" \
    "vpaddd %%zmm1" #i ", %%zmm" #i ", %%zmm" #i "\n"

int main(void) {
    static int buf[16] __attribute__((aligned(64)));
    const long n = 100000000;
    double t0 = now();
    long x = 0;
    for (long i = 0; i < 4 * n; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    double ghz = 4 * n / (now() - t0) / 1e9;
    printf("clock ~%.2f GHz\n", ghz);
    t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile(EIGHT(DPWSSD) ::"r"(buf) : CLOBBERS);
    printf("vpdpwssd zmm, broadcast operand: %.2f a cycle\n", 8 * n / (now() - t0) / 1e9 / ghz);
    t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile(EIGHT(DPBUSD) ::"r"(buf) : CLOBBERS);
    printf("vpdpbusd zmm, broadcast operand: %.2f a cycle\n", 8 * n / (now() - t0) / 1e9 / ghz);
    t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile(EIGHT(SPLIT) ::"r"(buf) : CLOBBERS);
    printf("vpbroadcastd + vpmaddwd + vpaddd (LLVM's split of a vpdpwssd): %.2f a cycle\n", 8 * n / (now() - t0) / 1e9 / ghz);
    return 0;
}
