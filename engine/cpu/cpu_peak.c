/* The integer dot-product rate of this CPU, for compute rooflines (baton bench --concurrency): how many
 * multiply-accumulates per second one thread, or every thread of a pool at once, gets from the instruction the
 * quantized matmul kernels are built on, with enough independent chains to hide its latency and no memory traffic. */
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "engine/cpu/cpu_kernels.h"

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Enough chains to cover the instruction's latency at its full rate: on an Intel Xeon (Emerald Rapids, 2026-12-05)
 * vpdpwssd zmm takes ~6 cycles and issues 2 a cycle, so 8 chains measured 4.0 G instructions/s against 5.9 with 16
 * or 24 (the VEX form on ymm: 4.7 with 8, 6.0 with 12). The 8-chain loop this file had understated that host's
 * compute roofline by a third. The chains are fixed registers the asm clobbers (16 "+" operands would exceed the 30
 * an asm may have): zmm16-31 (AVX-512), ymm2-13 (the 16-register VEX forms), v16-31 (NEON); their values do not
 * matter, only that each instruction depends on the previous one of its chain. */
#define R4(ins, w, p, a, b, c, d)                                                                               \
    ins " " w ", " w ", " p a "\n\t" ins " " w ", " w ", " p b "\n\t" ins " " w ", " w ", " p c "\n\t" ins " " w    \
        ", " w ", " p d "\n\t"

#if defined(__x86_64__)
#define ZMM16(ins)                                                                                             \
    R4(ins, "%0", "%%zmm", "16", "17", "18", "19") R4(ins, "%0", "%%zmm", "20", "21", "22", "23")                  \
        R4(ins, "%0", "%%zmm", "24", "25", "26", "27") R4(ins, "%0", "%%zmm", "28", "29", "30", "31")
#define ZMM16_CLOBBERS                                                                                         \
    "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",        \
        "xmm28", "xmm29", "xmm30", "xmm31"
#define YMM12(ins)                                                                                             \
    R4(ins, "%0", "%%ymm", "2", "3", "4", "5") R4(ins, "%0", "%%ymm", "6", "7", "8", "9")                          \
        R4(ins, "%0", "%%ymm", "10", "11", "12", "13")
#define YMM12_CLOBBERS                                                                                         \
    "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"

/* name(bytes, iters): vpdpbusd (bytes) or vpdpwssd on the chains of ON (clobbering CLOB, zeroed by ZERO after), its
 * sources a vector of type V (target T, operand constraint C, PRE before the mnemonic): instructions per second.
 * AVX-512 on 16 zmm chains, 32 MACs per vpdpwssd and 64 per vpdpbusd; AVX-VNNI (the VEX forms) on 12 ymm chains, 16
 * and 32 */
#define VNNI_RATE_FN(name, T, V, SET1, C, PRE, ON, NCH, CLOB, ZERO)                                                  \
    __attribute__((target(T))) static double name(int bytes, long iters)                                       \
    {                                                                                                          \
        const V w = SET1(0x01010101);                                                                          \
        double t0 = mono_s();                                                                                  \
        if (bytes)                                                                                             \
            for (long it = 0; it < iters; it++) __asm__ volatile(ON(PRE "vpdpbusd") : : C(w) : CLOB);          \
        else                                                                                                   \
            for (long it = 0; it < iters; it++) __asm__ volatile(ON(PRE "vpdpwssd") : : C(w) : CLOB);          \
        double r = (double)iters * NCH / (mono_s() - t0);                                                      \
    __asm__ volatile(ZERO : : : CLOB); /* no dirty upper halves left in the chain registers */                 \
    return r;                                                                                                  \
    }

#define Z4(a, b, c, d)                                                                                         \
    "vpxord %%zmm" a ", %%zmm" a ", %%zmm" a "\n\tvpxord %%zmm" b ", %%zmm" b ", %%zmm" b "\n\tvpxord %%zmm" c      \
    ", %%zmm" c ", %%zmm" c "\n\tvpxord %%zmm" d ", %%zmm" d ", %%zmm" d "\n\t"
#define ZMM16_ZERO                                                                                             \
    Z4("16", "17", "18", "19") Z4("20", "21", "22", "23") Z4("24", "25", "26", "27") Z4("28", "29", "30", "31")

VNNI_RATE_FN(vnni_rate, "avx512f,avx512vnni", __m512i, _mm512_set1_epi32, "v", "", ZMM16, 16, ZMM16_CLOBBERS,
             ZMM16_ZERO)
VNNI_RATE_FN(avx_vnni_rate, "avx2,avxvnni", __m256i, _mm256_set1_epi32, "x", "%{vex%} ", YMM12, 12, YMM12_CLOBBERS,
             "vzeroupper")

/* name(iters): MUL (a product of the constant W with itself into a temporary) then ADD (into one of 8 ymm chains: the
 * chains run through the 1-cycle add, so 8 cover its latency), 8 of each an iteration: MUL instructions per second */
#define AVX2_RATE_FN(name, MUL, ADD, W)                                                                        \
    __attribute__((target("avx2"))) static double name(long iters)                                             \
    {                                                                                                          \
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, t0v, t1v; \
        const __m256i w = _mm256_set1_epi32(W);                                                                \
        double t0 = mono_s();                                                                                  \
        for (long it = 0; it < iters; it++)                                                                    \
            __asm__ volatile(MUL " %10, %10, %8\n\t" ADD " %8, %0, %0\n\t" MUL " %10, %10, %9\n\t" ADD " %9, %1, %1\n\t" \
                             MUL " %10, %10, %8\n\t" ADD " %8, %2, %2\n\t" MUL " %10, %10, %9\n\t" ADD " %9, %3, %3\n\t" \
                             MUL " %10, %10, %8\n\t" ADD " %8, %4, %4\n\t" MUL " %10, %10, %9\n\t" ADD " %9, %5, %5\n\t" \
                             MUL " %10, %10, %8\n\t" ADD " %8, %6, %6\n\t" MUL " %10, %10, %9\n\t" ADD " %9, %7, %7"     \
                             : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),      \
                               "=&x"(t0v), "=&x"(t1v)                                                          \
                             : "x"(w));                                                                        \
        return (double)iters * 8 / (mono_s() - t0);                                                            \
    }

/* vpmaddwd + vpaddd: 16 MACs of 16-bit pairs per ymm */
AVX2_RATE_FN(avx2_rate, "vpmaddwd", "vpaddd", 0x00010001)
/* vpmaddubsw + vpaddw: 32 MACs of byte pairs per ymm, summed in int16 as the 8-bit nibble kernels do
 * (cpu_avx2_gemm.c's dot8_nib_rows) */
AVX2_RATE_FN(avx2_rate8, "vpmaddubsw", "vpaddw", 0x01010101)

#elif defined(__aarch64__)
/* ins on v16-v31 with both sources operand 0, arranged ta (accumulator) and tw (sources); smlal / smlal2 alternate */
#define N1(ins, ta, tw, r) ins " v" r "." ta ", %0." tw ", %0." tw "\n\t"
#define N2(i0, i1, ta, t0, t1, a, b) N1(i0, ta, t0, a) N1(i1, ta, t1, b)
#define V16(i0, i1, ta, t0, t1)                                                                                \
    N2(i0, i1, ta, t0, t1, "16", "17") N2(i0, i1, ta, t0, t1, "18", "19") N2(i0, i1, ta, t0, t1, "20", "21")      \
        N2(i0, i1, ta, t0, t1, "22", "23") N2(i0, i1, ta, t0, t1, "24", "25") N2(i0, i1, ta, t0, t1, "26", "27")  \
            N2(i0, i1, ta, t0, t1, "28", "29") N2(i0, i1, ta, t0, t1, "30", "31")
#define V16_CLOBBERS                                                                                           \
    "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28", "v29", "v30", "v31"

/* sdot (16 MACs of bytes per 128-bit register) or smlal + smlal2 (8 MACs of 16-bit halves, the 16-bit path) on 16
 * chains (a core with 4 vector pipes and a 3-cycle sdot needs 12 in flight): instructions per second */
__attribute__((target("arch=armv8.2-a+dotprod"))) static double neon_rate(int bytes, long iters)
{
    const __attribute__((vector_size(16))) int w = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
    double t0 = mono_s();
    if (bytes)
        for (long it = 0; it < iters; it++)
            __asm__ volatile(V16("sdot", "sdot", "4s", "16b", "16b") : : "w"(w) : V16_CLOBBERS);
    else
        for (long it = 0; it < iters; it++)
            __asm__ volatile(V16("smlal", "smlal2", "4s", "4h", "8h") : : "w"(w) : V16_CLOBBERS);
    return (double)iters * 16 / (mono_s() - t0);
}

/* smmla (a 2x8 by 8x2 int8 product: 32 MACs) on 16 chains: instructions per second */
__attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) static double i8mm_rate(long iters)
{
    const __attribute__((vector_size(16))) int w = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
    double t0 = mono_s();
    for (long it = 0; it < iters; it++)
        __asm__ volatile(V16("smmla", "smmla", "4s", "16b", "16b") : : "w"(w) : V16_CLOBBERS);
    return (double)iters * 16 / (mono_s() - t0);
}
#endif

/* One run of isa's rate loop on this thread (~1 ms): multiply-accumulates per second, 0 where isa cannot run */
static double dot_run(bt_cpu_isa isa, int act_bits)
{
    int bytes = act_bits == 8;
    double r = 0;
    (void)bytes;
#if defined(__x86_64__)
    if (isa == BT_CPU_ISA_AVX512 && bt_cpu_isa_supported(BT_CPU_ISA_AVX512))
        r = vnni_rate(bytes, 250 * 1000) * (bytes ? 64 : 32);
    else if (isa == BT_CPU_ISA_AVX2 && bt_cpu_isa_supported(BT_CPU_ISA_AVX2))
        r = bytes ? avx2_rate8(250 * 1000) * 32 : avx2_rate(250 * 1000) * 16;
    else if (isa == BT_CPU_ISA_AVX2_VNNI && bt_cpu_isa_supported(BT_CPU_ISA_AVX2_VNNI))
        r = avx_vnni_rate(bytes, 250 * 1000) * (bytes ? 32 : 16);
#elif defined(__aarch64__)
    if (isa == BT_CPU_ISA_NEON && bt_cpu_isa_supported(BT_CPU_ISA_NEON))
        r = neon_rate(bytes, 250 * 1000) * (bytes ? 16 : 4);
    else if (isa == BT_CPU_ISA_NEON_I8MM && bt_cpu_isa_supported(BT_CPU_ISA_NEON_I8MM))
        r = i8mm_rate(250 * 1000) * (bytes ? 32 : 16); /* 16-bit: smmla + usmmla per 32 MACs */
#endif
    return r;
}

/* Runs of each measurement. Best of 16 runs of ~1 ms, each after a 1 ms sleep, ~35 ms in all: other processes and the
 * hypervisor share the cores, and 5 back-to-back runs once all fell inside one disturbed stretch (a CI run's compute
 * roofline came out at 1/7 of this host's, below the decode rate it then measured). A thread that has just slept is
 * woken ahead of a busy neighbour, so each run starts on a fresh time slice. */
#define RATE_RUNS 16

static void nap_1ms(void)
{
    struct timespec nap = {0, 1000 * 1000};
    nanosleep(&nap, NULL);
}

double bt_cpu_dot_macs_rate(bt_cpu_isa isa, int act_bits)
{
    double best = 0;
    for (int rep = 0; rep < RATE_RUNS; rep++) {
        nap_1ms();
        double r = dot_run(isa, act_bits);
        best = r > best ? r : best;
    }
    return best;
}

/* How long a run's threads wait at the start line for each other before each starts anyway */
#define LINE_WAIT_S 0.05

typedef struct rate_span {
    double t0, t1, macs; /* this thread's loop: start, end, multiply-accumulates */
} rate_span;

typedef struct rate_job {
    bt_cpu_isa isa;
    int act_bits;
    _Atomic int arrived;
    rate_span span[]; /* per thread */
} rate_job;

static void rate_task(void *ctx, int ith, int nth)
{
    rate_job *j = ctx;
    nap_1ms();
    atomic_fetch_add(&j->arrived, 1);
    const double w0 = mono_s();
    for (long spins = 1; atomic_load(&j->arrived) < nth; spins++) {
        if (spins % 1024) continue;
        if (mono_s() - w0 > LINE_WAIT_S) break;
        sched_yield(); /* a thread still to come may need this CPU (more threads than CPUs) */
    }
    rate_span *sp = &j->span[ith];
    sp->t0 = mono_s();
    const double r = dot_run(j->isa, j->act_bits);
    sp->t1 = mono_s();
    sp->macs = r * (sp->t1 - sp->t0);
}

double bt_cpu_dot_macs_rate_all(bt_pool *pool, bt_cpu_isa isa, int act_bits)
{
    const int nth = pool ? bt_pool_size(pool) : 1;
    if (nth == 1) return bt_cpu_dot_macs_rate(isa, act_bits);
    rate_job *j = malloc(sizeof *j + sizeof(rate_span) * (size_t)nth);
    if (!j) return 0;
    double best = 0;
    for (int rep = 0; rep < RATE_RUNS; rep++) {
        atomic_store(&j->arrived, 0);
        j->isa = isa, j->act_bits = act_bits;
        bt_pool_run(pool, rate_task, j);
        /* every thread's work over the span from the first start to the last end: threads that did not run at once
         * (one came late, or the CPUs took them in turns) count as what they are, not as their solo rates summed */
        double t0 = j->span[0].t0, t1 = j->span[0].t1, macs = 0;
        for (int i = 0; i < nth; i++) {
            t0 = j->span[i].t0 < t0 ? j->span[i].t0 : t0;
            t1 = j->span[i].t1 > t1 ? j->span[i].t1 : t1;
            macs += j->span[i].macs;
        }
        const double r = t1 > t0 ? macs / (t1 - t0) : 0;
        best = r > best ? r : best;
    }
    free(j);
    return best;
}
