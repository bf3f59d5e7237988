/* Packed weight layouts for the tiled GEMM (bt_cpu_pack) and the scalar reference of its kernels.
 *
 * A group holds BT_CPU_PACK_ROWS = 16 output rows (lanes). For each 32-element block of the input dimension it
 * stores the 16 fp16 scales d, for Q4_1 the 16 fp16 mins m, and the codes of all 16 rows as 64-byte vectors in
 * which dword j belongs to row j. Blocks go in units that start with 64 bytes of scales, so the code vectors stay
 * 64-byte aligned and a group is read as one sequential stream:
 *   Q4_1:       unit = 1 block:  [d: 16][m: 16] [codes: 256 bytes]
 *   Q4_0, Q8_0: unit = 2 blocks: [d of b: 16][d of b+1: 16] [codes of b][codes of b+1] (an odd last block leaves
 *               its partner's space zero)
 *   Q4_K:       one super-unit per 256-element super-block (8 blocks): [A: 16 fp32]
 *               [B: 16 fp32] (the rows' d and dmin), then per block pair [s0 of b: 16][s1 of b: 16][s0 of b+1: 16]
 *               [s1 of b+1: 16] (bytes: each row's 6-bit sub-block scale and min) [codes of b][codes of b+1]. The
 *               kernels form d = A * s0 and m = -(B * s1), both exact in fp32, so the block is a Q4_1 block with
 *               wider scales; its codes are laid out as Q4_1's (low nibble element i, high nibble element 16 + i),
 *               in Q4_1's 8-bit or 16-bit order (below).
 *               2,432 bytes per 16 rows x 256 elements, 1.06x the GGUF block's size (the fp32 d and m of every
 *               block, as this layout stored them before, made it 1.33x: 1.3x the bytes a memory-bound decode
 *               streams). Activations stay in the K-quant format: at 16 bits (bt_block_q16_256) block b is slice b
 *               of the row, laid out as a per-32 block (the super-block's d, ds = d times the slice's sum); at 8
 *               bits (bt_block_q8_256) the same with 8-bit codes.
 * Code vector k of a block (dword j = 4 bytes of row j):
 *   Q4_0 / Q4_1, 8-bit act:  bytes qs[4k .. 4k+3] (k < 4): low nibbles are elements 4k+t, high ones 16+4k+t, the
 *                            pairing vpdpbusd needs against activation dwords k and k + 4;
 *   Q4_0 / Q4_1, 16-bit act: the same bytes in the order qs[4k], qs[4k+2], qs[4k+1], qs[4k+3], so that masking
 *                            and shifting 16-bit lanes yields the int16 pairs (4k, 4k+1), (4k+2, 4k+3),
 *                            (16+4k, 17+4k), (18+4k, 19+4k) vpdpwssd needs;
 *   Q8_0, 8-bit act:         qs[4k + t] ^ 0x80 (k < 8): codes + 128 as the u8 operand, 128 * sum(a) taken off;
 *   Q8_0, 16-bit act:        16 vectors of 32 bytes, word j of vector k (k < 16) = qs[2k], qs[2k+1] of row j: one
 *                            vpmovsxbw (load and sign-extend) makes the int16 pairs vpdpwssd needs.
 * Rows past n_out are zero (zero scales: they contribute nothing and are never stored).
 *   Q5_0, Q5_1, 16-bit act: nibbles and a high-bit plane, 1.00x the GGUF blocks (352 and 384 bytes per 16 rows x 32
 *               elements; as bytes they took 544 and 576, which batch-1 decode streams). Units as Q4_0's (Q5_0: 2
 *               blocks, [d of b: 16][d of b+1: 16]) and Q4_1's (Q5_1: [d: 16][m: 16]); a block's codes are 320 bytes:
 *               the low 4 bits of each code q (0..31) as Q4_0's / Q4_1's 16-bit code vectors (256 bytes), then the
 *               plane (64 bytes) of the fifth bits: bit i of 32-bit word t is the high bit of int16 lane i (row i / 2,
 *               element bt_gl_plane_elem(t, i)) of operand vector t, in the order the 16-bit nibble kernels make
 *               them (4k + 0..3: low nibbles of code vector k masked and shifted by 8, then its high nibbles). So a
 *               word is one AVX-512 __mmask32 (a masked add of 16 to the operand).
 *               Q5_0's value d * (q - 16): its offset 16 starts the integer dot (-16 * sum(a)) as Q4_0's 8 does,
 *               so the block's isum is the one the Q8_0 layout of codes q - 16 gave: the same bits.
 *               An ISA whose plane_nibbles is set (AVX2) packs the same 64 bytes in nibble-vector order instead: the 16
 *               bytes of code vector k hold, in byte i, bit X (X = 0..3) the fifth bit of the code in byte i of nibble
 *               vector X and bit X + 4 that of byte 16 + i, where nibble vector X of the code vector is its low (X =
 *               0, 2) or high (1, 3) nibbles of rows 0-7 (X = 0, 1: its first 32 bytes) or 8-15 (its last 32), one per
 *               byte. With the 16 bytes in both 128-bit lanes and the high lane shifted right by 4, bit X of every byte
 *               is its code's fifth bit, which a 16-bit shift left by 4 - X, an and and an or put at bit 4 (3
 *               instructions per 32 codes, where the word order took 5).
 *   Q5_0, 8-bit act:  stored as a Q8_0 block (codes q - 16 and d, exactly); the Q8_0 kernels run it
 *               (bt_cpu_pack_layout).
 *   Q5_1, 8-bit act:  unit = 1 block: [d: 16][m: 16] [codes: 512 bytes], the codes q (0..31) as bytes arranged as
 *               Q8_0's 8-bit layout without the 0x80 flip (they are already valid u8 operands).
 *   Q5_K:       as Q4_K (super-units, d = A * s0 and m = -(B * s1), K-quant activations), with its codes (0..31) as
 *               bytes arranged as Q8_0's 16-bit layout (512 per block), or at 8 bits as Q5_1's 8-bit layout. An ISA
 *               whose gemm16_planes names Q5_K (AVX-512) packs them instead as Q5_1's 16-bit codes: Q4_K's nibbles and
 *               the high-bit plane, 320 code bytes per block (2,944 per 16 rows x 256 elements: 1.05x the GGUF rows,
 *               where the bytes are 1.58x, which batch-1 decode streams).
 *   Q6_K:       super-units as Q4_K's: A = the super-block's d (B unused, zero), s0 and s1
 *               the signed scales of block b's two 16-element sub-blocks, d0 = A * s0 and d1 = A * s1 (exact in
 *               fp32), the codes q - 32 (-32..31) as signed bytes arranged as Q8_0's 16-bit layout. A block has
 *               two integer dots, over elements 0..15 and 16..31 (each |isum| < 16 * 32 * 32767 < 2^24: exact), each
 *               scaled by its own d: acc = fma(isum0, d0 * d_a, acc), then acc = fma(isum1, d1 * d_a, acc). Folding
 *               the sub-block scales into the codes instead would let one block's dot pass 2^31. Activations in the
 *               K-quant format, as Q4_K's. At 8 bits the codes are q (0..63, a valid u8 operand of vpdpbusd and
 *               vpmaddubsw) arranged as Q5_1's 8-bit layout (code vectors 0..3 hold elements 0..15, 4..7 the rest),
 *               and the kernels start each half's sum at -32 * its activation sum (the slice's sum_lo and
 *               sum - sum_lo): the same integers as sum((q - 32) * a), which the reference computes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_gemm_layout.h"
#include "engine/cpu/cpu_kernels.h"

static const int pair_order[4] = {0, 2, 1, 3}; /* byte t of a 16-bit-layout dword holds code 4k + pair_order[t] */

static int norm_bits(int act_bits)
{
    return act_bits == 8 ? 8 : 16;
}

uint32_t bt_cpu_pack_layout(uint32_t t, int act_bits)
{
    switch (t) {
    case BT_TYPE_Q4_0:
    case BT_TYPE_Q4_1:
    case BT_TYPE_Q4_K:
    case BT_TYPE_Q8_0:
    case BT_TYPE_Q5_1:
    case BT_TYPE_Q5_K:
    case BT_TYPE_Q6_K: return t;
    case BT_TYPE_Q5_0: return norm_bits(act_bits) == 16 ? BT_TYPE_Q5_0 : BT_TYPE_Q8_0;
    default: return BT_TYPE_COUNT;
    }
}

/* The layout width the bt_gl helpers take: 0 at 8 bits, 1 at 16, BT_GL_PLANES in an ISA's 16-bit variant with a Q5_K
 * plane (bt_cpu_ops.gemm16_planes). */
static int layout_width(int bits, int planes)
{
    return bits == 8 ? 0 : planes ? BT_GL_PLANES : 1;
}

static int packed_width(const bt_cpu_packed *p)
{
    return layout_width(p->act_bits, p->planes);
}

/* whether layout l at act_bits takes ops' plane variant (NULL ops: the portable layouts) */
static int ops_planes(const bt_cpu_ops *ops, uint32_t l, int act_bits)
{
    return ops && norm_bits(act_bits) == 16 && l < 32 && (ops->gemm16_planes >> l & 1u);
}

/* whether layout l at act_bits has a high-bit plane in ops' nibble-vector order */
static int ops_plane_nib(const bt_cpu_ops *ops, uint32_t l, int act_bits)
{
    int bits = norm_bits(act_bits);
    return ops && ops->plane_nibbles && bt_gl_plane((int)l, layout_width(bits, ops_planes(ops, l, act_bits)));
}

int bt_cpu_pack_plane_nibbles(const bt_cpu_ops *ops, uint32_t t, int act_bits)
{
    uint32_t l = bt_cpu_pack_layout(t, act_bits);
    return l < BT_TYPE_COUNT && ops_plane_nib(ops, l, act_bits);
}

/* bytes of one block's code vectors for the 16 rows of layout t at width w (layout_width); 0 when t is not a layout */
static size_t code_bytes(uint32_t t, int w)
{
    switch (t) {
    case BT_TYPE_Q4_0:
    case BT_TYPE_Q4_1:
    case BT_TYPE_Q4_K:
    case BT_TYPE_Q8_0:
    case BT_TYPE_Q5_1:
    case BT_TYPE_Q5_K:
    case BT_TYPE_Q6_K: return bt_gl_code_bytes((int)t, w);
    case BT_TYPE_Q5_0: return w ? bt_gl_code_bytes((int)t, 1) : 0; /* 8-bit: the Q8_0 layout */
    default: return 0;
    }
}

static int has_min(uint32_t t)
{
    return t == BT_TYPE_Q4_1 || t == BT_TYPE_Q4_K || t == BT_TYPE_Q5_1 || t == BT_TYPE_Q5_K;
}

/* K-quant layouts: fp32 scales, super-units of 8 blocks (a 256-element super-block), K-quant activations */
static int is_kquant(uint32_t t)
{
    return t == BT_TYPE_Q4_K || t == BT_TYPE_Q5_K || t == BT_TYPE_Q6_K;
}

/* bytes of a unit's scales (not the K-quants): 64 (fp16 d, and m or a partner block's d) */
static size_t scale_bytes(uint32_t t)
{
    (void)t;
    return 64;
}

/* elements of the GGUF block a row is made of (the packed blocks are 32 elements whatever the type) */
static int64_t src_block_elems(uint32_t t)
{
    return is_kquant(t) ? BT_QK_K : BT_QK;
}

/* integer offset of the codes: isum = sum(code * a) - offset * sum(a) */
static int code_offset(uint32_t t, int bits)
{
    if (t == BT_TYPE_Q4_0) return 8;
    if (t == BT_TYPE_Q5_0) return 16;
    if (t == BT_TYPE_Q8_0 && bits == 8) return 128;
    return 0;
}

/* blocks per unit (see the layout above; the K-quants' super-units hold 8) */
static int unit_blocks(uint32_t t)
{
    return is_kquant(t) ? 8 : has_min(t) ? 1 : 2;
}

static size_t unit_bytes(uint32_t t, int w)
{
    if (is_kquant(t)) return bt_gl_kq_super_bytes(code_bytes(t, w));
    return scale_bytes(t) + (size_t)unit_blocks(t) * code_bytes(t, w);
}

static size_t group_bytes(uint32_t t, int w, int64_t n_in)
{
    size_t nb = (size_t)(n_in / BT_QK), u = (size_t)unit_blocks(t);
    return (nb + u - 1) / u * unit_bytes(t, w);
}

/* the 16 d of block b (m follows for Q4_1 and Q5_1; not the K-quants: kq_scales) and its code vectors */
static uint16_t *block_scales(uint32_t t, int w, uint8_t *group, int64_t b)
{
    int u = unit_blocks(t);
    return (uint16_t *)(group + (size_t)(b / u) * unit_bytes(t, w) + 32 * (size_t)(b % u));
}

static uint8_t *block_codes(uint32_t t, int w, uint8_t *group, int64_t b)
{
    if (is_kquant(t)) return (uint8_t *)bt_gl_codes(group, b, (int)t, code_bytes(t, w));
    int u = unit_blocks(t);
    return group + (size_t)(b / u) * unit_bytes(t, w) + scale_bytes(t) + (size_t)(b % u) * code_bytes(t, w);
}

/* Byte and bit of a high-bit plane (bt_gl_plane) that hold the fifth bit of element e (0..31) of row j: bit
 * 2j + (e & 1) of the 32-bit word of the operand vector holding e (bt_gl_plane_elem's inverse). */
static int plane_bit(int j, int e, int *bit)
{
    int t = 4 * ((e & 15) >> 2) + 2 * (e >> 4) + ((e >> 1) & 1), i = 2 * j + (e & 1);
    *bit = i % 8;
    return 4 * t + i / 8;
}

/* The same in nibble-vector order (bt_cpu_ops.plane_nibbles, above): element e of row j is in byte t = pair_order[e %
 * 4] of the row's dword of code vector (e % 16) / 4, in its low (e < 16) or high nibble. */
static int plane_bit_nib(int j, int e, int *bit)
{
    int t = pair_order[e & 3], p = 4 * (j & 7) + t, x = 2 * (j >> 3) + (e >> 4);
    *bit = x + 4 * (p >> 4);
    return 16 * ((e & 15) >> 2) + (p & 15);
}

/* Where packed p's plane holds the fifth bit of element e of row j. */
static int plane_pos(const bt_cpu_packed *p, int j, int e, int *bit)
{
    return p->plane_nib ? plane_bit_nib(j, e, bit) : plane_bit(j, e, bit);
}

/* Row j's weight scales of K-quant block b as the kernels form them: d = A * s0, and m = -(B * s1) (Q4_K, Q5_K) or
 * the second half's d = A * s1 (Q6_K); w: the layout width (a Q5_K plane changes its code bytes, hence where the
 * super-units start). */
static void kq_scales(uint32_t t, int w, const uint8_t *group, int64_t b, int j, float *d, float *m)
{
    const float *sup = bt_gl_kq_super(group, b, code_bytes(t, w));
    const uint8_t *s = bt_gl_kq_bytes(group, b, code_bytes(t, w));
    if (t == BT_TYPE_Q6_K) {
        *d = sup[j] * (float)(int8_t)s[j];
        *m = sup[j] * (float)(int8_t)s[BT_CPU_PACK_ROWS + j];
        return;
    }
    *d = sup[j] * (float)s[j];
    *m = -(sup[BT_CPU_PACK_ROWS + j] * (float)s[BT_CPU_PACK_ROWS + j]);
}

/* Writes row j's K-quant scales of block b: the super-block's A and B (again for each of its blocks: the same
 * values) and the block's two integer scales. */
static void kq_put_scales(uint32_t t, int w, uint8_t *group, int64_t b, int j, float a, float bm, uint8_t s0,
                          uint8_t s1)
{
    float *sup = (float *)bt_gl_kq_super(group, b, code_bytes(t, w));
    uint8_t *s = (uint8_t *)bt_gl_kq_bytes(group, b, code_bytes(t, w));
    sup[j] = a, sup[BT_CPU_PACK_ROWS + j] = bm;
    s[j] = s0, s[BT_CPU_PACK_ROWS + j] = s1;
}

int bt_cpu_gemm_nr(const bt_cpu_ops *ops)
{
    return ops->gemm_nr > 0 ? ops->gemm_nr : BT_CPU_GEMM_NR;
}

int bt_cpu_gemm_tile(const bt_cpu_ops *ops)
{
    return ops->gemm_tile_amd > 0 && bt_cpu_vendor_amd() ? ops->gemm_tile_amd : bt_cpu_gemm_nr(ops);
}

int bt_cpu_pack_supported(const bt_cpu_ops *ops, uint32_t t, int act_bits)
{
    if (act_bits != 0 && act_bits != 8 && act_bits != 16) return 0;
    t = bt_cpu_pack_layout(t, act_bits);
    if (!ops || t >= BT_TYPE_COUNT || !code_bytes(t, norm_bits(act_bits) == 16)) return 0;
    return (norm_bits(act_bits) == 8 ? ops->gemm8[t] : ops->gemm16[t]) != NULL;
}

size_t bt_cpu_pack_bytes(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n_in, int64_t n_out)
{
    uint32_t l = bt_cpu_pack_layout(t, act_bits);
    if (l >= BT_TYPE_COUNT || n_in <= 0 || n_in % src_block_elems(t) || n_out <= 0) return 0;
    int64_t ng = (n_out + BT_CPU_PACK_ROWS - 1) / BT_CPU_PACK_ROWS;
    return (size_t)ng * group_bytes(l, layout_width(norm_bits(act_bits), ops_planes(ops, l, act_bits)), n_in);
}

typedef struct pack_job {
    const bt_cpu_packed *p;
    uint32_t src_type; /* the GGUF type of w (p->wtype is its layout) */
    const uint8_t *w;  /* [n_out][row bytes] */
    size_t row_bytes;
    int64_t n_groups;
} pack_job;

/* Sub-block s of a Q4_K super-block as row j of packed Q4_K block b: its d, dmin, scale and min into the group, its
 * 32 codes as Q4_1 stores them (low nibble element i, high nibble element 16 + i) into q32. */
static void pack_q4k_block(const bt_block_q4_k *sb, int s, int j, int w, uint8_t *group, int64_t b,
                           uint8_t q32[BT_QK / 2])
{
    uint8_t sc6, m6;
    bt_q4k_scale_min(sb->scales, s, &sc6, &m6);
    kq_put_scales(BT_TYPE_Q4_K, w, group, b, j, bt_fp16_to_f32(sb->d), bt_fp16_to_f32(sb->dmin), sc6, m6);
    const uint8_t *qs = sb->qs + 32 * (s / 2); /* element l of the sub-block: low nibble (s even) or high nibble */
    const int shift = (s & 1) * 4;
    for (int i = 0; i < BT_QK / 2; i++)
        q32[i] = (uint8_t)(((qs[i] >> shift) & 15) | (((qs[16 + i] >> shift) & 15) << 4));
}

/* Sub-block s of a Q5_K super-block as row j of packed Q5_K block b: scales as Q4_K's, its 32 codes (0..31) into
 * q32. */
static void pack_q5k_block(const bt_block_q5_k *sb, int s, int j, int w, uint8_t *group, int64_t b,
                           uint8_t q32[BT_QK])
{
    uint8_t sc6, m6;
    bt_q4k_scale_min(sb->scales, s, &sc6, &m6);
    kq_put_scales(BT_TYPE_Q5_K, w, group, b, j, bt_fp16_to_f32(sb->d), bt_fp16_to_f32(sb->dmin), sc6, m6);
    const uint8_t *qs = sb->qs + 32 * (s / 2);
    const int shift = (s & 1) * 4;
    for (int l = 0; l < BT_QK; l++) q32[l] = (uint8_t)(((qs[l] >> shift) & 15) | ((sb->qh[l] >> s) & 1) << 4);
}

/* Slice s (0..7: elements 32 s .. 32 s + 31) of a Q6_K super-block as row j of packed Q6_K block b: the super-block's
 * d and the signed scales of the slice's two 16-element sub-blocks into the group, its values q - 32 into q32. */
static void pack_q6k_block(const bt_block_q6_k *sb, int s, int j, int w, uint8_t *group, int64_t b,
                           int8_t q32[BT_QK])
{
    kq_put_scales(BT_TYPE_Q6_K, w, group, b, j, bt_fp16_to_f32(sb->d), 0.0f, (uint8_t)sb->scales[2 * s],
                  (uint8_t)sb->scales[2 * s + 1]);
    for (int e = 0; e < BT_QK; e++) { /* element 32 s + e of the super-block (cpu_quants.c's q6k_value) */
        const int x = 32 * s + e, h = x / 128, sub = (x % 128) / 32, l = x % 32;
        const int lo = (sb->ql[64 * h + 32 * (sub & 1) + l] >> (4 * (sub >> 1))) & 0x0f;
        const int hi = (sb->qh[32 * h + l] >> (2 * sub)) & 3;
        q32[e] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* A Q5_0 block as the Q8_0 block of the same values: codes q - 16, the same d. */
static bt_block_q8_0 q5_0_as_q8_0(const bt_block_q5_0 *b)
{
    bt_block_q8_0 o;
    o.d = b->d;
    uint32_t qh = (uint32_t)b->qh[0] | (uint32_t)b->qh[1] << 8 | (uint32_t)b->qh[2] << 16 | (uint32_t)b->qh[3] << 24;
    for (int j = 0; j < 16; j++) {
        o.qs[j] = (int8_t)(((b->qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4) - 16);
        o.qs[j + 16] = (int8_t)(((b->qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) - 16);
    }
    return o;
}

/* The 32 codes q (0..31) of a Q5_1 block. */
static void q5_1_codes(const bt_block_q5_1 *b, uint8_t q[BT_QK])
{
    uint32_t qh = (uint32_t)b->qh[0] | (uint32_t)b->qh[1] << 8 | (uint32_t)b->qh[2] << 16 | (uint32_t)b->qh[3] << 24;
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((b->qs[j] & 0x0f) | ((qh >> j) & 1) << 4);
        q[j + 16] = (uint8_t)((b->qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

/* Writes row j (< 16) of group g from the GGUF row src (type src_type) into the packed group dst. */
static void pack_row(const bt_cpu_packed *p, uint32_t src_type, const uint8_t *src, int j, uint8_t *dst)
{
    int64_t nb = p->n_in / BT_QK;
    int bits = p->act_bits, w = packed_width(p);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *c = block_codes(p->wtype, w, dst, b) + 4 * (size_t)j;
        uint16_t *sc = block_scales(p->wtype, w, dst, b);
        const uint8_t *qs;
        uint8_t q32[BT_QK / 2];
        if (p->wtype == BT_TYPE_Q4_K) {
            pack_q4k_block((const bt_block_q4_k *)src + b / 8, (int)(b % 8), j, w, dst, b, q32);
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < 4; t++) c[64 * k + t] = q32[4 * k + (bits == 8 ? t : pair_order[t])];
            continue;
        }
        if (p->wtype == BT_TYPE_Q5_K) {
            uint8_t q[BT_QK];
            pack_q5k_block((const bt_block_q5_k *)src + b / 8, (int)(b % 8), j, w, dst, b, q);
            if (bits == 8) { /* as Q5_1's 8-bit codes */
                for (int k = 0; k < 8; k++)
                    for (int t = 0; t < 4; t++) c[64 * k + t] = q[4 * k + t];
                continue;
            }
            if (w == BT_GL_PLANES) { /* the low 4 bits as Q4_K's 16-bit nibbles, then the plane of fifth bits */
                for (int i = 0; i < BT_QK / 2; i++) q32[i] = (uint8_t)((q[i] & 15) | (q[16 + i] & 15) << 4);
                for (int k = 0; k < 4; k++)
                    for (int t = 0; t < 4; t++) c[64 * k + t] = q32[4 * k + pair_order[t]];
                uint8_t *plane = block_codes(p->wtype, w, dst, b) + 4 * 64;
                for (int e = 0; e < BT_QK; e++) {
                    int bit, at = plane_pos(p, j, e, &bit);
                    plane[at] |= (uint8_t)((q[e] >> 4) << bit);
                }
                continue;
            }
            uint8_t *c2 = block_codes(p->wtype, w, dst, b) + 2 * (size_t)j;
            for (int k = 0; k < 16; k++) c2[32 * k] = q[2 * k], c2[32 * k + 1] = q[2 * k + 1];
            continue;
        }
        if (p->wtype == BT_TYPE_Q6_K) {
            int8_t q[BT_QK];
            pack_q6k_block((const bt_block_q6_k *)src + b / 8, (int)(b % 8), j, w, dst, b, q);
            if (bits == 8) { /* q (0..63), a valid u8 operand; the kernels take 32 * sum(a) off each half */
                for (int k = 0; k < 8; k++)
                    for (int t = 0; t < 4; t++) c[64 * k + t] = (uint8_t)(q[4 * k + t] + 32);
                continue;
            }
            uint8_t *c2 = block_codes(p->wtype, w, dst, b) + 2 * (size_t)j;
            for (int k = 0; k < 16; k++) c2[32 * k] = (uint8_t)q[2 * k], c2[32 * k + 1] = (uint8_t)q[2 * k + 1];
            continue;
        }
        if (bt_gl_plane((int)p->wtype, w)) { /* Q5_0, Q5_1: nibbles as Q4_0's / Q4_1's, then the plane */
            const bt_block_q5_0 *b0 = (const bt_block_q5_0 *)src + b;
            const bt_block_q5_1 *b1 = (const bt_block_q5_1 *)src + b;
            const int min = p->wtype == BT_TYPE_Q5_1;
            const uint8_t *qh = min ? b1->qh : b0->qh;
            qs = min ? b1->qs : b0->qs;
            sc[j] = min ? b1->d : b0->d;
            if (min) sc[BT_CPU_PACK_ROWS + j] = b1->m;
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < 4; t++) c[64 * k + t] = qs[4 * k + pair_order[t]];
            uint8_t *plane = block_codes(p->wtype, w, dst, b) + 4 * 64;
            for (int e = 0; e < BT_QK; e++) {
                int bit, at = plane_pos(p, j, e, &bit);
                plane[at] |= (uint8_t)(((qh[e / 8] >> (e % 8)) & 1) << bit);
            }
            continue;
        }
        if (p->wtype == BT_TYPE_Q5_1) { /* 8-bit activations: the codes as bytes */
            const bt_block_q5_1 *blk = (const bt_block_q5_1 *)src + b;
            sc[j] = blk->d;
            sc[BT_CPU_PACK_ROWS + j] = blk->m;
            uint8_t q[BT_QK];
            q5_1_codes(blk, q);
            for (int k = 0; k < 8; k++)
                for (int t = 0; t < 4; t++) c[64 * k + t] = q[4 * k + t];
            continue;
        }
        if (p->wtype == BT_TYPE_Q8_0) {
            bt_block_q8_0 from_q5;
            const bt_block_q8_0 *blk = (const bt_block_q8_0 *)src + b;
            if (src_type == BT_TYPE_Q5_0) {
                from_q5 = q5_0_as_q8_0((const bt_block_q5_0 *)src + b);
                blk = &from_q5;
            }
            sc[j] = blk->d;
            qs = (const uint8_t *)blk->qs;
            if (bits == 16) {
                uint8_t *c2 = block_codes(p->wtype, w, dst, b) + 2 * (size_t)j;
                for (int k = 0; k < 16; k++) c2[32 * k] = qs[2 * k], c2[32 * k + 1] = qs[2 * k + 1];
                continue;
            }
            for (int k = 0; k < 8; k++)
                for (int t = 0; t < 4; t++) c[64 * k + t] = (uint8_t)(qs[4 * k + t] ^ 0x80);
            continue;
        }
        if (p->wtype == BT_TYPE_Q4_1) {
            const bt_block_q4_1 *blk = (const bt_block_q4_1 *)src + b;
            sc[j] = blk->d;
            sc[BT_CPU_PACK_ROWS + j] = blk->m;
            qs = blk->qs;
        } else {
            const bt_block_q4_0 *blk = (const bt_block_q4_0 *)src + b;
            sc[j] = blk->d;
            qs = blk->qs;
        }
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++) c[64 * k + t] = qs[4 * k + (bits == 8 ? t : pair_order[t])];
    }
}

static void pack_task(void *arg, int ith, int nth)
{
    const pack_job *job = arg;
    const bt_cpu_packed *p = job->p;
    int64_t lo = job->n_groups * ith / nth, hi = job->n_groups * (ith + 1) / nth;
    for (int64_t g = lo; g < hi; g++) {
        uint8_t *dst = (uint8_t *)p->data + (size_t)g * p->group_bytes;
        for (int j = 0; j < BT_CPU_PACK_ROWS; j++) {
            int64_t o = g * BT_CPU_PACK_ROWS + j;
            if (o < p->n_out) pack_row(p, job->src_type, job->w + (size_t)o * job->row_bytes, j, dst);
        }
    }
}

/* Checks t, act_bits and the shape; *bytes = the packed size. */
static bt_status pack_check(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n_in, int64_t n_out,
                            const void *w, size_t *bytes)
{
    if (bt_cpu_pack_layout(t, act_bits) >= BT_TYPE_COUNT)
        return bt_fail(BT_ERR_UNSUPPORTED, "pack: weight type %s has no packed layout", bt_ggml_type_name(t));
    if (act_bits != 0 && act_bits != 8 && act_bits != 16)
        return bt_fail(BT_ERR_INVALID, "pack: act_bits %d (expected 0, 8 or 16)", act_bits);
    *bytes = bt_cpu_pack_bytes(ops, t, act_bits, n_in, n_out);
    if (!*bytes || !w) return bt_fail(BT_ERR_INVALID, "pack: bad shape %lld x %lld", (long long)n_out, (long long)n_in);
    return BT_OK;
}

static void pack_fill(const bt_cpu_ops *ops, bt_pool *pool, uint32_t t, int act_bits, int64_t n_in, int64_t n_out,
                      const void *w, void *data, size_t bytes, bt_cpu_packed *out)
{
    memset(data, 0, bytes); /* padding rows and tails: zero scales, so they contribute nothing */
    uint32_t l = bt_cpu_pack_layout(t, act_bits);
    bt_cpu_packed p = {.wtype = l, .act_bits = norm_bits(act_bits), .planes = ops_planes(ops, l, act_bits),
                       .plane_nib = ops_plane_nib(ops, l, act_bits), .n_in = n_in, .n_out = n_out, .data = data};
    p.group_bytes = group_bytes(l, packed_width(&p), n_in);
    pack_job job = {.p = &p, .src_type = t, .w = w, .row_bytes = bt_cpu_row_bytes(t, n_in),
                    .n_groups = (n_out + BT_CPU_PACK_ROWS - 1) / BT_CPU_PACK_ROWS};
    int nth = pool ? bt_pool_size(pool) : 1;
    if (nth > 1 && job.n_groups >= 2 * nth)
        bt_pool_run_tasks(pool, pack_task, &job, 4 * nth);
    else
        pack_task(&job, 0, 1);
    *out = p;
}

bt_status bt_cpu_pack(const bt_cpu_ops *ops, bt_pool *pool, uint32_t t, int act_bits, int64_t n_in, int64_t n_out,
                      const void *w, bt_cpu_packed *out)
{
    size_t bytes = 0;
    bt_status st = pack_check(ops, t, act_bits, n_in, n_out, w, &bytes);
    if (st) return st;
    void *data = NULL;
    if (posix_memalign(&data, 64, bytes) != 0)
        return bt_fail(BT_ERR_NOMEM, "pack: out of memory for %zu bytes of packed weights", bytes);
    pack_fill(ops, pool, t, act_bits, n_in, n_out, w, data, bytes, out);
    out->owns_data = 1;
    return BT_OK;
}

bt_status bt_cpu_pack_into(const bt_cpu_ops *ops, bt_pool *pool, uint32_t t, int act_bits, int64_t n_in,
                           int64_t n_out, const void *w, void *mem, bt_cpu_packed *out)
{
    size_t bytes = 0;
    bt_status st = pack_check(ops, t, act_bits, n_in, n_out, w, &bytes);
    if (st) return st;
    if (!mem || (uintptr_t)mem % 64)
        return bt_fail(BT_ERR_INVALID, "pack: destination %p is not 64-byte aligned memory", mem);
    pack_fill(ops, pool, t, act_bits, n_in, n_out, w, mem, bytes, out);
    return BT_OK;
}

void bt_cpu_packed_free(bt_cpu_packed *p)
{
    if (!p) return;
    if (p->owns_data) free(p->data);
    memset(p, 0, sizeof *p);
}

/* The 32 codes of row j in block b of a packed group, as the integers the kernels multiply (Q8_0 8-bit: q + 128,
 * matching code_offset) */
static void unpack_codes(const bt_cpu_packed *p, uint8_t *group, int64_t b, int j, int32_t q[BT_QK])
{
    const int w = packed_width(p);
    const uint8_t *c = block_codes(p->wtype, w, group, b) + 4 * (size_t)j;
    /* byte codes (Q5_1's and Q5_K's are 0..31, Q6_K's -32..31 at 16 bits and 0..63 at 8) */
    const int bytes = code_bytes(p->wtype, w) == 8 * 64;
    if (bytes && p->act_bits == 16) {
        const uint8_t *c2 = block_codes(p->wtype, w, group, b) + 2 * (size_t)j;
        for (int k = 0; k < 16; k++) q[2 * k] = (int8_t)c2[32 * k], q[2 * k + 1] = (int8_t)c2[32 * k + 1];
        return;
    }
    for (int k = 0; k < (bytes ? 8 : 4); k++)
        for (int t = 0; t < 4; t++) {
            uint8_t byte = c[64 * k + t];
            int e = 4 * k + (p->act_bits == 8 ? t : pair_order[t]); /* pair_order is its own inverse */
            if (bytes) {
                /* 8-bit layout: Q8_0's q + 128, Q5_1's and Q5_K's q, Q6_K's q (its value q - 32) */
                q[e] = p->wtype == BT_TYPE_Q6_K ? byte - 32 : byte;
            } else {
                q[e] = byte & 15;
                q[e + 16] = byte >> 4;
            }
        }
    if (bt_gl_plane((int)p->wtype, w)) { /* Q5_0, Q5_1, Q5_K in a plane variant: the fifth bits */
        const uint8_t *plane = block_codes(p->wtype, w, group, b) + 4 * 64;
        for (int e = 0; e < BT_QK; e++) {
            int bit, at = plane_pos(p, j, e, &bit);
            q[e] |= ((plane[at] >> bit) & 1) << 4;
        }
    }
}

/* Block b of the activation row arow as integers a[32] with its d, d * sum and sum, in the layout's format: per-32
 * blocks (bt_block_q8_32 / bt_block_q16_32) or slice b % 8 of a K-quant super-block (bt_block_q8_256 /
 * bt_block_q16_256; d * sum = d times the slice's sum) */
static void act_block(const bt_cpu_packed *p, const char *arow, int64_t b, int32_t a[BT_QK], float *ad, float *ads,
                      int32_t *asum)
{
    const int sb = (int)(b % 8);
    if (is_kquant(p->wtype) && p->act_bits == 8) {
        const bt_block_q8_256 *k = (const bt_block_q8_256 *)arow + b / 8;
        for (int e = 0; e < BT_QK; e++) a[e] = k->s[sb].qs[e];
        *asum = k->s[sb].sum;
        *ad = k->s[0].d, *ads = k->s[0].d * (float)*asum;
    } else if (is_kquant(p->wtype)) {
        const bt_block_q16_256 *k = (const bt_block_q16_256 *)arow + b / 8;
        for (int e = 0; e < BT_QK; e++) a[e] = k->s[sb].qs[e];
        *asum = k->s[sb].sum;
        *ad = k->s[0].d, *ads = k->s[0].d * (float)*asum;
    } else if (p->act_bits == 8) {
        const bt_block_q8_32 *k = (const bt_block_q8_32 *)arow + b;
        for (int e = 0; e < BT_QK; e++) a[e] = k->qs[e];
        *ad = k->d, *ads = k->ds, *asum = k->sum;
    } else {
        const bt_block_q16_32 *k = (const bt_block_q16_32 *)arow + b;
        for (int e = 0; e < BT_QK; e++) a[e] = k->qs[e];
        *ad = k->d, *ads = k->ds, *asum = k->sum;
    }
}

void bt_cpu_gemm_packed_ref(const bt_cpu_packed *p, int64_t group, const void *act, size_t act_stride, int nr,
                            float *out, size_t out_stride, int n_valid)
{
    int64_t nb = p->n_in / BT_QK;
    uint8_t *g = (uint8_t *)p->data + (size_t)group * p->group_bytes; /* only read */
    int off = code_offset(p->wtype, p->act_bits), mins = has_min(p->wtype);
    for (int r = 0; r < nr; r++) {
        const char *arow = (const char *)act + (size_t)r * act_stride;
        for (int j = 0; j < n_valid; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t q[BT_QK], a[BT_QK], asum;
                float ad, ads;
                unpack_codes(p, g, b, j, q);
                act_block(p, arow, b, a, &ad, &ads, &asum);
                if (p->wtype == BT_TYPE_Q6_K) { /* two halves, each with its own d */
                    int64_t i0 = 0, i1 = 0;
                    for (int e = 0; e < 16; e++) i0 += (int64_t)q[e] * a[e];
                    for (int e = 16; e < BT_QK; e++) i1 += (int64_t)q[e] * a[e];
                    float d0, d1;
                    kq_scales(p->wtype, packed_width(p), g, b, j, &d0, &d1);
                    acc = fmaf((float)i0, d0 * ad, acc);
                    acc = fmaf((float)i1, d1 * ad, acc);
                    continue;
                }
                int64_t isum = 0;
                for (int e = 0; e < BT_QK; e++) isum += (int64_t)q[e] * a[e];
                isum -= (int64_t)off * asum;
                float dw, mw;
                if (is_kquant(p->wtype)) {
                    kq_scales(p->wtype, packed_width(p), g, b, j, &dw, &mw);
                } else {
                    const uint16_t *sc = block_scales(p->wtype, packed_width(p), g, b);
                    dw = bt_fp16_to_f32(sc[j]), mw = bt_fp16_to_f32(sc[BT_CPU_PACK_ROWS + j]);
                }
                acc = fmaf((float)isum, dw * ad, acc);
                if (mins) acc = fmaf(mw, ads, acc);
            }
            out[(size_t)r * out_stride + (size_t)j] = acc;
        }
    }
}
