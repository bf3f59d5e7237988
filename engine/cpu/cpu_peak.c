/* The integer dot-product rate of this CPU, for compute rooflines (baton bench --concurrency): how many
 * multiply-accumulates per second one thread gets from the instruction the quantized matmul kernels are built on,
 * with enough independent chains to hide its latency and no memory traffic. */
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "engine/cpu/cpu_kernels.h"

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#if defined(__x86_64__) || defined(__i386__)
#define CHAINS "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7)
/* the instruction ins on each of the 8 chains, its sources both operand 8 */
#define ON_CHAINS(ins)                                                                                         \
    ins " %8, %8, %0\n\t" ins " %8, %8, %1\n\t" ins " %8, %8, %2\n\t" ins " %8, %8, %3\n\t" ins " %8, %8, %4\n\t" \
        ins " %8, %8, %5\n\t" ins " %8, %8, %6\n\t" ins " %8, %8, %7"

/* name(bytes, iters): vpdpbusd (bytes) or vpdpwssd on 8 chains of vector type V (target T, operand constraint C,
 * PRE before the mnemonic): instructions per second */
#define VNNI_RATE_FN(name, T, V, ZERO, SET1, C, PRE)                                                            \
    __attribute__((target(T))) static double name(int bytes, long iters)                                       \
    {                                                                                                          \
        V a0 = ZERO, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;                             \
        const V w = SET1(0x01010101);                                                                          \
        double t0 = mono_s();                                                                                  \
        if (bytes)                                                                                             \
            for (long it = 0; it < iters; it++) __asm__ volatile(ON_CHAINS(PRE "vpdpbusd") : CHAINS : C(w));    \
        else                                                                                                   \
            for (long it = 0; it < iters; it++) __asm__ volatile(ON_CHAINS(PRE "vpdpwssd") : CHAINS : C(w));    \
        return (double)iters * 8 / (mono_s() - t0);                                                            \
    }

/* AVX-512: 32 MACs per zmm vpdpwssd, 64 per vpdpbusd; AVX-VNNI (the VEX forms on ymm): 16 and 32 */
VNNI_RATE_FN(vnni_rate, "avx512f,avx512vnni", __m512i, _mm512_setzero_si512(), _mm512_set1_epi32, "v", "")
VNNI_RATE_FN(avx_vnni_rate, "avx2,avxvnni", __m256i, _mm256_setzero_si256(), _mm256_set1_epi32, "x", "%{vex%} ")

/* vpmaddwd + vpaddd (16 MACs of 16-bit pairs per ymm) on 8 ymm chains: vpmaddwd per second */
__attribute__((target("avx2"))) static double avx2_rate(long iters)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, t0v, t1v;
    const __m256i w = _mm256_set1_epi32(0x00010001);
    double t0 = mono_s();
    for (long it = 0; it < iters; it++)
        __asm__ volatile("vpmaddwd %10, %10, %8\n\tvpaddd %8, %0, %0\n\tvpmaddwd %10, %10, %9\n\tvpaddd %9, %1, %1\n\t"
                         "vpmaddwd %10, %10, %8\n\tvpaddd %8, %2, %2\n\tvpmaddwd %10, %10, %9\n\tvpaddd %9, %3, %3\n\t"
                         "vpmaddwd %10, %10, %8\n\tvpaddd %8, %4, %4\n\tvpmaddwd %10, %10, %9\n\tvpaddd %9, %5, %5\n\t"
                         "vpmaddwd %10, %10, %8\n\tvpaddd %8, %6, %6\n\tvpmaddwd %10, %10, %9\n\tvpaddd %9, %7, %7"
                         : CHAINS, "=&x"(t0v), "=&x"(t1v)
                         : "x"(w));
    return (double)iters * 8 / (mono_s() - t0);
}

#elif defined(__aarch64__)
#define CHAINS "+w"(a0), "+w"(a1), "+w"(a2), "+w"(a3), "+w"(a4), "+w"(a5), "+w"(a6), "+w"(a7)

/* sdot (16 MACs of bytes per 128-bit register) or smlal + smlal2 (8 MACs of 16-bit halves, the 16-bit path) on 8
 * chains: instructions per second */
__attribute__((target("arch=armv8.2-a+dotprod"))) static double neon_rate(int bytes, long iters)
{
    __attribute__((vector_size(16))) int a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __attribute__((vector_size(16))) int w = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
    double t0 = mono_s();
    if (bytes)
        for (long it = 0; it < iters; it++)
            __asm__ volatile("sdot %0.4s, %8.16b, %8.16b\n\tsdot %1.4s, %8.16b, %8.16b\n\t"
                             "sdot %2.4s, %8.16b, %8.16b\n\tsdot %3.4s, %8.16b, %8.16b\n\t"
                             "sdot %4.4s, %8.16b, %8.16b\n\tsdot %5.4s, %8.16b, %8.16b\n\t"
                             "sdot %6.4s, %8.16b, %8.16b\n\tsdot %7.4s, %8.16b, %8.16b"
                             : CHAINS
                             : "w"(w));
    else
        for (long it = 0; it < iters; it++)
            __asm__ volatile("smlal %0.4s, %8.4h, %8.4h\n\tsmlal2 %1.4s, %8.8h, %8.8h\n\t"
                             "smlal %2.4s, %8.4h, %8.4h\n\tsmlal2 %3.4s, %8.8h, %8.8h\n\t"
                             "smlal %4.4s, %8.4h, %8.4h\n\tsmlal2 %5.4s, %8.8h, %8.8h\n\t"
                             "smlal %6.4s, %8.4h, %8.4h\n\tsmlal2 %7.4s, %8.8h, %8.8h"
                             : CHAINS
                             : "w"(w));
    return (double)iters * 8 / (mono_s() - t0);
}

/* smmla (a 2x8 by 8x2 int8 product: 32 MACs) on 8 chains: instructions per second */
__attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) static double i8mm_rate(long iters)
{
    __attribute__((vector_size(16))) int a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __attribute__((vector_size(16))) int w = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
    double t0 = mono_s();
    for (long it = 0; it < iters; it++)
        __asm__ volatile("smmla %0.4s, %8.16b, %8.16b\n\tsmmla %1.4s, %8.16b, %8.16b\n\t"
                         "smmla %2.4s, %8.16b, %8.16b\n\tsmmla %3.4s, %8.16b, %8.16b\n\t"
                         "smmla %4.4s, %8.16b, %8.16b\n\tsmmla %5.4s, %8.16b, %8.16b\n\t"
                         "smmla %6.4s, %8.16b, %8.16b\n\tsmmla %7.4s, %8.16b, %8.16b"
                         : CHAINS
                         : "w"(w));
    return (double)iters * 8 / (mono_s() - t0);
}
#endif

double bt_cpu_dot_macs_rate(bt_cpu_isa isa, int act_bits)
{
    int bytes = act_bits == 8;
    double best = 0;
    (void)bytes;
    /* Best of 16 runs of ~1 ms, each after a 1 ms sleep, ~35 ms in all: other processes and the hypervisor share the
     * cores, and 5 back-to-back runs once all fell inside one disturbed stretch (a CI run's compute roofline came
     * out at 1/7 of this host's, below the decode rate it then measured). A thread that has just slept is woken ahead
     * of a busy neighbour, so each run starts on a fresh time slice. */
    for (int rep = 0; rep < 16; rep++) {
        struct timespec nap = {0, 1000 * 1000};
        nanosleep(&nap, NULL);
        double r = 0;
#if defined(__x86_64__) || defined(__i386__)
        if (isa == BT_CPU_ISA_AVX512 && bt_cpu_isa_supported(BT_CPU_ISA_AVX512))
            r = vnni_rate(bytes, 250 * 1000) * (bytes ? 64 : 32);
        else if (isa == BT_CPU_ISA_AVX2 && bt_cpu_isa_supported(BT_CPU_ISA_AVX2))
            r = avx2_rate(250 * 1000) * 16;
        else if (isa == BT_CPU_ISA_AVX2_VNNI && bt_cpu_isa_supported(BT_CPU_ISA_AVX2_VNNI))
            r = avx_vnni_rate(bytes, 250 * 1000) * (bytes ? 32 : 16);
#elif defined(__aarch64__)
        if (isa == BT_CPU_ISA_NEON && bt_cpu_isa_supported(BT_CPU_ISA_NEON))
            r = neon_rate(bytes, 250 * 1000) * (bytes ? 16 : 4);
        else if (isa == BT_CPU_ISA_NEON_I8MM && bt_cpu_isa_supported(BT_CPU_ISA_NEON_I8MM))
            r = i8mm_rate(250 * 1000) * (bytes ? 32 : 16); /* 16-bit: smmla + usmmla per 32 MACs */
#endif
        best = r > best ? r : best;
    }
    return best;
}
