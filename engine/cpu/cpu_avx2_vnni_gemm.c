/* The AVX2 tiled GEMM (cpu_avx2_gemm.c) built a second time for CPUs with AVX-VNNI but no AVX-512 (Intel Xeon 6
 * E-core, Alder Lake and later; AMD Zen 4 and later have both): the same layouts, passes and float order, with each
 * dot chain one VEX vpdpwssd (16-bit activations) or vpdpbusd (8-bit) where AVX2 needs vpmaddwd + vpaddd or
 * vpmaddubsw + vpmaddwd + vpaddd. The integer sums are the same exact integers, so every output keeps its bits. */
#define BT_AVX2_GEMM_VNNI 1
#include "engine/cpu/cpu_avx2_gemm.c"
