/* CPU kernel layer: run-time ISA selection, per-ISA op tables, and the quantized matmul the forward pass calls.
 *
 * Quantized weight types take activations quantized per block to 16 bits (default: integer dots within ~2e-5 of
 * sum |w * x| of the float result) or to 8 bits (faster, up to ~3e-3), chosen per matmul by act_bits.
 * Every op has a scalar reference (cpu_quants.h); the AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL, VNNI) tables on
 * x86-64 and the NEON (+dot product) table on aarch64 fill the same slots with SIMD kernels. Integer parts of
 * quantized dot products are exact in every path; only the float accumulation order differs between ISAs (tests
 * bound the difference by 1e-5 of sum |w * x|; measured <= 2e-7; K-quants with 16-bit activations sum exactly in
 * int64 and agree bit for bit; the NEON quantized kernels keep the reference's float order and agree bit for bit).
 * Within one ISA, an output element is always computed by the same code with the same reduction order, whatever
 * the batch size, its position in the batch or the thread count (batch invariance, DESIGN 4.3); results of
 * different ISAs differ, so one process (and every node that must agree with it) uses one ISA. */
#ifndef BATON_ENGINE_CPU_KERNELS_H
#define BATON_ENGINE_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/cpu/cpu_pool.h"
#include "engine/cpu/cpu_quants.h"

typedef enum bt_cpu_isa {
    BT_CPU_ISA_SCALAR = 0,
    BT_CPU_ISA_AVX2 = 1,      /* AVX2 + FMA + F16C */
    BT_CPU_ISA_AVX2_VNNI = 2, /* the AVX2 set + AVX-VNNI (VEX vpdpbusd/vpdpwssd) for the tiled GEMM: no AVX-512 needed
                               * (Intel Xeon 6 E-core / Sierra Forest, Alder Lake and later, AMD Zen 4 and later) */
    BT_CPU_ISA_AVX512 = 3,    /* AVX2 set + AVX-512 F/BW/VL/VNNI */
    BT_CPU_ISA_NEON = 4,      /* aarch64 Advanced SIMD + the Armv8.2 dot product (sdot/udot) */
    BT_CPU_ISA_NEON_I8MM = 5, /* the NEON set + the int8 matrix multiply (smmla/usmmla) for the tiled GEMM */
    BT_CPU_ISA_COUNT = 6,     /* within an architecture a higher value is a larger set, preferred when present */
} bt_cpu_isa;

/* Most activation rows one dot_rows call handles (the weight block is decoded once for all of them). */
#define BT_CPU_MAX_NR 4

/* Dot products of one weight row (n elements of the table's type) with nr (1..BT_CPU_MAX_NR) activation rows
 * in the type's activation format: out[r * out_stride] = dot(w_row, act + r * act_stride bytes).
 * For each r the arithmetic is identical to nr == 1. Can't fail. */
typedef void (*bt_cpu_dot_rows_fn)(int64_t n, const void *w_row, const void *act, size_t act_stride, int nr,
                                   float *out, size_t out_stride);

/* Weights packed for the tiled GEMM. bt_cpu_pack copies a weight matrix into groups of BT_CPU_PACK_ROWS output
 * rows whose blocks are interleaved by 4-code words, so that one 512-bit VNNI instruction multiplies 4 codes of
 * all 16 rows by 4 broadcast activation codes: no horizontal sums, and each weight block is decoded once for up to
 * bt_cpu_gemm_nr activation rows. Per output element the arithmetic is fixed: acc = 0, then per block an exact
 * integer dot isum, acc = fma((float)isum, d_w * d_a, acc) and, for types with a min, acc = fma(m_w, ds_a, acc)
 * (one accumulator: the min term cancels most of the code term block by block). It depends on nothing but that
 * element's weight row and activation row, so a packed matmul is batch-invariant; it differs from the unpacked
 * kernels only in float rounding (same error bounds). The layout depends on act_bits, so a packing serves one
 * precision. */
#define BT_CPU_PACK_ROWS 16

/* Activation rows every ISA's bt_cpu_gemm_fn takes in one call: each decoded code vector serves 8 rows, one integer
 * chain each (at 16 rows on Zen 4: ~80% of the vpdpwssd rate with the weights in cache, vs ~78% for 4 rows). An ISA
 * whose kernels take more sets bt_cpu_ops.gemm_nr (at most BT_CPU_GEMM_NR_MAX). */
#define BT_CPU_GEMM_NR 8
#define BT_CPU_GEMM_NR_MAX 16

typedef struct bt_cpu_packed {
    uint32_t wtype;     /* the layout and kernel: bt_cpu_pack_layout of the packed matrix's type */
    int act_bits;       /* 8 or 16: the precision the layout is for */
    int planes;         /* 1: the ISA's 16-bit variant with a high-bit plane (bt_cpu_ops.gemm16_planes) */
    int plane_nib;      /* 1: its high-bit plane is in nibble-vector order (bt_cpu_ops.plane_nibbles), 0: word order */
    int64_t n_in, n_out;
    size_t group_bytes; /* bytes per group of BT_CPU_PACK_ROWS rows, a multiple of 64 */
    void *data;         /* [ceil(n_out / 16)][group_bytes], 64-byte aligned; rows past n_out are zero */
    int owns_data;      /* data was allocated by bt_cpu_pack (bt_cpu_packed_free frees it), not given to it */
} bt_cpu_packed;

/* Group `group` (one 16-row group of a bt_cpu_packed, n input elements) times nr (1..bt_cpu_gemm_nr) activation
 * rows: out[r * out_stride + j] for rows j < n_valid (1..16) of the group. next: NULL, or a group the caller reads
 * soon, prefetched block by block (at 16 rows the weights stream from memory; with the hardware prefetcher alone
 * the kernel waited a fifth of its time). Can't fail. */
typedef void (*bt_cpu_gemm_fn)(int64_t n, const void *group, const void *act, size_t act_stride, int nr,
                               float *out, size_t out_stride, int n_valid, const void *next);

/* Attention reads the KV cache in its own dtype (or an exact f32 copy the caller made of f16 rows); a block of one kv
 * head holds nk <= BT_CPU_ATTN_BLOCK rows of n elements for K and V each, rows contiguous. */
#define BT_CPU_ATTN_BLOCK 16
/* query rows of one attn_block_rows call */
#define BT_CPU_ATTN_ROWS 16

typedef enum bt_cpu_kv_type {
    BT_CPU_KV_F32 = 0,
    BT_CPU_KV_F16 = 1,
    BT_CPU_KV_U8 = 2, /* value = fmaf(scale, (float)code, min), code an unsigned byte, one fp16 (scale, min) a row */
} bt_cpu_kv_type;

typedef struct bt_cpu_kv_rows {
    bt_cpu_kv_type type;
    const void *k, *v;                /* [nk][n] elements of type */
    const uint16_t *k_sm, *v_sm; /* U8 only: [nk][2] fp16 (scale, min) */
    /* Optional (NULL: none): K and V rows of a block read later, pf_bytes each, which a kernel may prefetch while
     * it works on this one, spread over its loops. A hint: results never depend on it. */
    const void *pf_k, *pf_v;
    size_t pf_bytes;
} bt_cpu_kv_rows;

/* exp(x) as every ISA computes it (Cephes-style polynomial, fmaf, within 2 ulp of expf): 0 below -86.5, +inf above
 * 88, NaN for NaN. The SIMD versions give the same bits. */
float bt_cpu_expf(float x);

/* attn_block_rows' definition: attn_block (the scalar reference) on each row in turn; the hints are ignored.
 * Outside the slot's contract (n above 256, nk or nr outside 1..16) it does nothing. */
void bt_cpu_attn_block_rows_ref(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint);

/* Puts query row `row` (n elements) into lane r (0..BT_CPU_ATTN_ROWS - 1) of an attn_block_rows chunk qt. */
void bt_cpu_attn_rows_put(int64_t n, int r, const float *row, float *qt);

typedef struct bt_cpu_ops {
    bt_cpu_isa isa;
    const char *name; /* "scalar", "avx2", "avx2-vnni", "avx512", "neon", "neon-i8mm" */
    /* activation quantizers: y[n / 32] and y[n / 256]; output bytes equal the scalar reference's */
    void (*quantize_q8_32)(int64_t n, const float *x, bt_block_q8_32 *y);
    void (*quantize_q8_256)(int64_t n, const float *x, bt_block_q8_256 *y);
    void (*quantize_q16_32)(int64_t n, const float *x, bt_block_q16_32 *y);
    void (*quantize_q16_256)(int64_t n, const float *x, bt_block_q16_256 *y);
    /* row conversions (bit-identical to the inline scalar functions of cpu_fp16.h) */
    void (*fp16_to_f32)(int64_t n, const uint16_t *x, float *y);
    void (*f32_to_fp16)(int64_t n, const float *x, uint16_t *y);
    void (*bf16_to_f32)(int64_t n, const uint16_t *x, float *y);
    void (*f32_to_bf16)(int64_t n, const float *x, uint16_t *y);
    /* per weight type; NULL for types without kernels. dot_rows: float types and 8-bit activations (Q8_32,
     * Q8_256); dot_rows16: quantized types with 16-bit activations (Q16_32, Q16_256). */
    bt_cpu_dot_rows_fn dot_rows[BT_TYPE_COUNT];
    bt_cpu_dot_rows_fn dot_rows16[BT_TYPE_COUNT];
    /* attention inner loops, bit-identical in every ISA (each product and sum rounded on its own, fixed order):
     * out[j] = dot8(q, k + j * k_stride) * scale for j < nk, where dot8 sums n (a multiple of 8) products in 8
     * lanes (lane i % 8) and adds the lanes as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
    void (*attn_scores)(int64_t n, const float *q, const float *k, size_t k_stride, int64_t nk, float scale,
                        float *out);
    /* acc[i] += w[j] * v[j * v_stride + i] for i < n, j = 0, 1, .. nv - 1 in that order */
    void (*attn_accum)(int64_t n, const float *w, const float *v, size_t v_stride, int64_t nv, float *acc);
    /* One online-softmax step of attention, bit-identical in every ISA: nq query rows q[nq][n] (n a multiple of 8,
     * at most 256) against the nk (1..BT_CPU_ATTN_BLOCK) keys and values of kv, K/V read in their dtype (no
     * converted copy). Per query h, with K_j, V_j the dequantized rows (f16 converted exactly, U8 as above):
     *   s_j = tree16(x) * scale, x[t] = q[t] * K_j[t] for t < min(n, 16) (other lanes 0), then
     *         x[i % 16] = fmaf(q[i], K_j[i], x[i % 16]) for i = 16 .. n - 1; tree16(x): b_t = x_t + x_{t+8} (t < 8),
     *         c_t = b_t + b_{t+4} (t < 4), d_t = c_t + c_{t+2} (t < 2), result d_0 + d_1
     *   mn = max(m[h], max_j s_j), c = bt_cpu_expf(m[h] - mn), w_j = bt_cpu_expf(s_j - mn) (0 for j >= nk)
     *   l[h] = fmaf(l[h], c, tree16(w)), acc[h][i] = acc[h][i] * c, then fmaf(w_j, V_j[i], .) for j ascending
     *   m[h] = mn.
     * Start from m = -inf, l = 0, acc = 0; the result is acc / l. Can't fail. */
    void (*attn_block)(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk, float *m,
                       float *l, float *acc);
    int attn_prefetches; /* attn_block prefetches kv->pf_k / pf_v (otherwise the caller should) */
    /* attn_block for nr (1..BT_CPU_ATTN_ROWS) query rows that all see the same nk keys (a prompt chunk's queries
     * past the block), each row its own m, l and acc row with the bits attn_block gives it, against an f32 block:
     * k and v [nk][n], n a multiple of 16 and at most 256. qt holds the rows transposed, qt[BT_CPU_ATTN_ROWS * i + r]
     * element i of row r (lanes r >= nr are read and their results dropped). The rows sit in vector lanes, so the
     * running max, exp and the tree16 of the weights run on all rows at once, with no horizontal step. hint: NULL,
     * or the prefetch hints of bt_cpu_kv_rows (pf_k, pf_v, pf_bytes; its other fields unused), which a kernel of an
     * ISA with attn_prefetches requests over its loops. NULL where an ISA has none: the caller then runs attn_block
     * per query. Can't fail. */
    void (*attn_block_rows)(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v, int nk,
                            float *m, float *l, float *acc, const bt_cpu_kv_rows *hint);
    /* out[i] = x[i] * scale * w[i], scale = (float)(1 / sqrt(ss / n + eps)) where ss sums the exact double
     * squares in 8 lanes (lane i % 8, ascending i), added as (l0 + l4) + (l2 + l6) ... i.e. b_t = l_t + l_{t+4},
     * c_t = b_t + b_{t+2}, ss = c_0 + c_1; out may equal x; bit-identical in every ISA */
    void (*rmsnorm)(int64_t n, const float *x, const float *w, float eps, float *out);
    /* out[i] = g[i] / (1 + bt_cpu_expf(-g[i])) * u[i]; out may alias g or u; bit-identical in every ISA */
    void (*swiglu)(int64_t n, const float *g, const float *u, float *out);
    /* out[i] = x / (1 + bt_cpu_expf(z)) * u[i], x = g[i], z = fmaf((x * x) * A, x, x) * K (A = 0.044715,
     * K = -2 sqrt(2/pi)): gelu_tanh(x) * u[i], since 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y)); out may alias g or u;
     * bit-identical in every ISA */
    void (*geglu)(int64_t n, const float *g, const float *u, float *out);
    /* per weight type, NULL where none: tiled kernels over packed weights (bt_cpu_pack) with 8-bit (gemm8)
     * or 16-bit (gemm16) activations */
    bt_cpu_gemm_fn gemm8[BT_TYPE_COUNT];
    bt_cpu_gemm_fn gemm16[BT_TYPE_COUNT];
    /* bit t set: at 16 bits this ISA's kernel of layout t reads the fifth bits from a high-bit plane where the
     * portable layout has byte codes (Q5_K on AVX-512, whose mask registers add a plane word to an operand in one
     * instruction; AVX2 and NEON spend more expanding it than its smaller reads save). Q5_0 and Q5_1 always have one. */
    unsigned gemm16_planes;
    /* 1: the high-bit planes this ISA's kernels read are in nibble-vector order (AVX2: a shift, an and and an or put
     * each fifth bit at bit 4 of its code byte), 0: in word order (a plane word is one operand vector's lane mask:
     * AVX-512, NEON, the reference's default); cpu_gemm.c */
    int plane_nibbles;
    /* most activation rows one gemm8 / gemm16 call takes: 0 for BT_CPU_GEMM_NR; AVX-512 16 (32 registers hold 16
     * chains); AVX2 16 in passes of 4 (the Q5 plane layouts' later passes read the operands the first unpacked) */
    int gemm_nr;
    /* most rows a matmul hands one call on an AMD CPU, where that is fewer than gemm_nr (0: gemm_nr everywhere);
     * bt_cpu_gemm_tile */
    int gemm_tile_amd;
} bt_cpu_ops;

/* Name of isa ("scalar", "avx2", "avx2-vnni", "avx512", "neon", "neon-i8mm"). */
const char *bt_cpu_isa_name(bt_cpu_isa isa);

/* True when this build has isa's kernels: scalar everywhere, AVX2 and AVX-512 in an x86-64 build, NEON in an
 * aarch64 one. An ISA of another architecture is not "missing" on this host, just not applicable. */
int bt_cpu_isa_built(bt_cpu_isa isa);

/* True when this build has isa and this CPU (and OS) can run it: x86 __builtin_cpu_supports plus CPUID for F16C;
 * aarch64 the kernel's hwcaps (AT_HWCAP: ASIMD and ASIMDDP). */
int bt_cpu_isa_supported(bt_cpu_isa isa);

/* True on an x86 CPU whose CPUID vendor is AMD ("AuthenticAMD"); false elsewhere. Read once and cached. */
int bt_cpu_vendor_amd(void);

/* Multiply-accumulates per second one thread gets from the integer dot instruction the quantized matmuls of isa use
 * at act_bits (AVX-512: vpdpwssd, 32 per instruction, or vpdpbusd at 8 bits, 64; AVX2: vpmaddwd, 16, or at 8 bits
 * vpmaddubsw summed in int16, 32; AVX2 + AVX-VNNI:
 * the VEX vpdpwssd, 16, or vpdpbusd at 8 bits, 32; NEON: smlal, 4, or sdot at 8 bits, 16; NEON + i8mm: smmla, 32,
 * or smmla + usmmla at 16 bits, 16 per instruction), measured here in about 10 ms with no memory traffic: the
 * compute roofline of a matmul.
 * 0 for scalar or an ISA this CPU lacks. */
double bt_cpu_dot_macs_rate(bt_cpu_isa isa, int act_bits);

/* The same instruction's rate on every thread of pool at once (NULL or one thread: bt_cpu_dot_macs_rate): each
 * thread runs the loop after a common start, and a run's rate is all threads' multiply-accumulates over the span from
 * the first start to the last end, best of 16 runs. Threads that share a core (SMT siblings, or virtual CPUs the
 * hypervisor places on one) share its vector units, so this is not n times one thread's rate: on a 2-vCPU AMD EPYC
 * Zen 3 guest 2 threads measured 1.7-2.0x one. The compute roofline of a matmul on the pool. Blocks for about 40 ms
 * and runs the pool meanwhile (not from inside a pool task, nor concurrently with another run on it). 0 for scalar
 * or an ISA this CPU lacks, or when the run's record cannot be allocated. */
double bt_cpu_dot_macs_rate_all(bt_pool *pool, bt_cpu_isa isa, int act_bits);

/* The process's edge only (a main, a CLI command, a test's setup): *want = the ISA that BATON_CPU_ISA names, -1
 * when it is unset or empty. BT_ERR_INVALID for an unknown name, BT_ERR_UNSUPPORTED when this CPU cannot run it
 * (the message names the variable); *want is then -1. */
bt_status bt_cpu_isa_env(int *want);

/* The ISA to use: want (a bt_cpu_isa) when >= 0, else the best this CPU supports. Reads CPUID, not the
 * environment; keep the result in the engine struct. BT_ERR_UNSUPPORTED when want cannot run here. */
bt_status bt_cpu_isa_select(int want, bt_cpu_isa *out);

/* The op table of isa (static, never freed), or NULL when isa is out of range or not built (bt_cpu_isa_built).
 * Slots of an ISA without a special kernel for a type hold the next lower ISA's kernel. */
const bt_cpu_ops *bt_cpu_ops_get(bt_cpu_isa isa);

/* The dot_rows kernel of ops for weight type t with act_bits-bit activations (0 means 16), NULL if none. */
bt_cpu_dot_rows_fn bt_cpu_dot_rows_get(const bt_cpu_ops *ops, uint32_t t, int act_bits);

/* Dot of one weight row with one activation row in the format bt_cpu_act_format(t, act_bits), through ops (see
 * bt_cpu_dot_rows_fn). Returns 0 for types without kernels. */
float bt_cpu_vec_dot(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const void *w_row,
                     const void *act_row);

/* Quantizes (or, for float weight types, copies) one activation row x[n] into the format weight type t needs at
 * precision act_bits (0 means 16); dst holds bt_cpu_act_row_bytes(t, act_bits, n) bytes. Can't fail for
 * supported t and act_bits and n a multiple of the block. */
void bt_cpu_prepare_act_row(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const float *x, void *dst);

/* The packed layout (and tiled kernel) weight type t is packed into for act_bits (0 means 16): itself for Q4_0,
 * Q4_1, Q4_K, Q5_1, Q5_K, Q6_K and Q8_0; for Q5_0 itself (nibbles and a high-bit plane) at 16 bits and Q8_0 at 8,
 * its values d * (q - 16) being exactly Q8_0 codes q - 16 with the same d; BT_TYPE_COUNT when none. */
uint32_t bt_cpu_pack_layout(uint32_t t, int act_bits);

/* 1 when ops packs type t at act_bits with a high-bit plane in nibble-vector order (bt_cpu_ops.plane_nibbles). */
int bt_cpu_pack_plane_nibbles(const bt_cpu_ops *ops, uint32_t t, int act_bits);

/* True when ops has a tiled kernel for weight type t at act_bits (0 means 16), i.e. bt_cpu_pack can serve it. */
int bt_cpu_pack_supported(const bt_cpu_ops *ops, uint32_t t, int act_bits);

/* Most activation rows one of ops' tiled kernels (either width) takes: BT_CPU_GEMM_NR, or gemm_nr. ops must not be
 * NULL. */
int bt_cpu_gemm_nr(const bt_cpu_ops *ops);

/* Most activation rows the matmul hands one tiled kernel call on this CPU (bt_cpu_matmul_compute cuts a group's
 * rows into near-equal tiles of at most this many): bt_cpu_gemm_nr, or gemm_tile_amd on an AMD CPU where set. The
 * bits never depend on it (each kernel gives every nr the same). */
int bt_cpu_gemm_tile(const bt_cpu_ops *ops);

/* Bytes bt_cpu_pack allocates for an n_out x n_in matrix of type t at act_bits for the kernels of ops (NULL: the
 * portable layouts, as without gemm16_planes); 0 when t has no packed layout. */
size_t bt_cpu_pack_bytes(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n_in, int64_t n_out);

/* Packs w[n_out][row bytes] (type t) for act_bits (0 means 16) and the kernels of ops (NULL: the portable layouts)
 * into out, splitting the work over pool (NULL: this thread). out->data is allocated here and freed by
 * bt_cpu_packed_free; out is set only on success.
 * BT_ERR_UNSUPPORTED when t has no packed layout, BT_ERR_INVALID for bad shapes, BT_ERR_NOMEM. Blocks. */
bt_status bt_cpu_pack(const bt_cpu_ops *ops, bt_pool *pool, uint32_t t, int act_bits, int64_t n_in, int64_t n_out,
                      const void *w, bt_cpu_packed *out);

/* bt_cpu_pack into mem (64-byte aligned, bt_cpu_pack_bytes long), which stays the caller's: bt_cpu_packed_free then
 * only clears out. Same errors, except BT_ERR_INVALID for a NULL or misaligned mem instead of BT_ERR_NOMEM. */
bt_status bt_cpu_pack_into(const bt_cpu_ops *ops, bt_pool *pool, uint32_t t, int act_bits, int64_t n_in,
                           int64_t n_out, const void *w, void *mem, bt_cpu_packed *out);

/* Frees p->data when bt_cpu_pack allocated it, and clears p; NULL or an empty p is a no-op. */
void bt_cpu_packed_free(bt_cpu_packed *p);

/* Scalar reference of bt_cpu_gemm_fn over p (any layout bt_cpu_pack makes): the same arithmetic, element by
 * element, so SIMD kernels must match it bit for bit. */
void bt_cpu_gemm_packed_ref(const bt_cpu_packed *p, int64_t group, const void *act, size_t act_stride, int nr,
                            float *out, size_t out_stride, int n_valid);

/* Where the next matmul run's packed weights start. When the run streams one slice per thread (few activation
 * rows), the last group of slice i prefetches the first group of slice i there, so that matmul does not start with
 * a wait on memory (the next run's threads mostly take the same slice numbers). Only addresses are computed from it and
 * prefetches never fault, so a stale hint costs a useless prefetch and never changes a result. */
typedef struct bt_cpu_next_hint {
    const void *data;   /* bt_cpu_packed.data, NULL: no hint */
    int64_t n_groups;   /* its 16-row groups */
    size_t group_bytes; /* bt_cpu_packed.group_bytes */
} bt_cpu_next_hint;

/* out[n_rows][n_out] = x[n_rows][n_in] * W^T, W = w[n_out][n_in] in GGUF type wtype (rows contiguous). */
typedef struct bt_cpu_matmul {
    const bt_cpu_ops *ops;
    uint32_t wtype;
    int64_t n_in, n_out, n_rows;
    const void *w;      /* [n_out][bt_cpu_row_bytes(wtype, n_in)] */
    const float *x;     /* [n_rows][n_in] */
    void *xq;           /* scratch [n_rows][bt_cpu_act_row_bytes(wtype, act_bits, n_in)]; unused (may be NULL) for
                         * F32/F16/BF16 */
    float *out;         /* [n_rows][out_stride] */
    int64_t out_stride; /* floats between output rows; 0 means n_out */
    int act_bits;       /* activation precision for quantized weights: 16, 8, or 0 meaning 16 */
    const bt_cpu_packed *wp; /* optional: w packed for this wtype, act_bits and shape; when set, the product
                              * runs on the tiled kernel (w is then unused) */
    bt_cpu_next_hint then;   /* optional (zero: none): the packed weights the next matmul run will read */
} bt_cpu_matmul;

/* Validates mm (type supported, n_in a multiple of the block, pointers present, act_bits 0, 8 or 16, wp when set
 * matching the matmul and having a kernel in ops).
 * BT_ERR_UNSUPPORTED for a weight type without kernels, BT_ERR_INVALID for bad shapes or act_bits. */
bt_status bt_cpu_matmul_check(const bt_cpu_matmul *mm);

/* Phase 1: quantizes activation rows ith, ith + nth, ... into mm->xq. No-op for float weight types. */
void bt_cpu_matmul_quantize(const bt_cpu_matmul *mm, int ith, int nth);

/* Phase 2 (after phase 1 finished on every thread): computes output columns [n_out*ith/nth, n_out*(ith+1)/nth)
 * for every activation row (with wp: the columns of 16-row groups [n_groups*ith/nth, n_groups*(ith+1)/nth)). */
void bt_cpu_matmul_compute(const bt_cpu_matmul *mm, int ith, int nth);

/* Several matmuls reading the same activations (q/k/v or gate/up projections): mms[0..n_mm) must share ops,
 * wtype, act_bits (0 and 16 count as equal), n_in, n_rows, x and xq. Quantizes x once and computes every output in
 * a single pool run; each output is bit-identical to what bt_cpu_matmul_run gives for that matmul alone.
 * BT_ERR_INVALID if they differ. Blocks. */
bt_status bt_cpu_matmul_run_multi(bt_pool *pool, const bt_cpu_matmul *mms, int n_mm);

/* Checks mm, then runs both phases on pool (or on the calling thread when pool is NULL), each split into a few
 * tasks per thread. Blocks until done. */
bt_status bt_cpu_matmul_run(bt_pool *pool, const bt_cpu_matmul *mm);

#endif
