/* Chained block hashes for the prefix cache (DESIGN 5.3), shared by the engine's block manager and the router's
 * approximate per-node prefix index, so both must compute identical values on any machine.
 *
 * Definition (version 1; changing any of it invalidates every router's index, so don't):
 *   h_{-1} = 0 (both words)
 *   h_i    = SipHash-2-4 with 128-bit output (Aumasson & Bernstein, the reference "siphash.c" with outlen 16) of
 *            key     = fingerprint as 8 little-endian bytes || the 8 ASCII bytes "baton-pc"
 *            message = h_{i-1}.lo as 8 LE bytes || h_{i-1}.hi as 8 LE bytes
 *                      || the 16 token ids of block i, each as a uint32 in 4 LE bytes        (80 bytes in all)
 *   The reference output's 16 bytes are read back as h_i.lo = LE bytes 0..7, h_i.hi = LE bytes 8..15.
 * Only full blocks of BT_PREFIX_HASH_BLOCK tokens are hashed; a partial last block never is. The arithmetic works on
 * integers, so the host's byte order does not matter. SipHash was chosen for being well mixed, fast (~40 ns a block)
 * and specified with published test vectors; accidental collisions are ~2^-128 per pair. Its key (the fingerprint) is
 * public, so this is no defence against deliberately crafted collisions.
 * Every function here is pure: thread-safe, can't fail, no allocation. */
#ifndef BATON_COMMON_PREFIX_HASH_H
#define BATON_COMMON_PREFIX_HASH_H

#include <stddef.h>
#include <stdint.h>

#define BT_PREFIX_HASH_BLOCK 16 /* tokens per hashed block; equals the KV block size BT_KV_BLOCK */

typedef struct bt_prefix_hash {
    uint64_t lo, hi;
} bt_prefix_hash;

/* h_{-1}: the value to chain the first block of a prompt from. */
#define BT_PREFIX_HASH_ROOT ((bt_prefix_hash){0, 0})

static inline int bt_prefix_hash_eq(bt_prefix_hash a, bt_prefix_hash b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

/* h_i from h_{i-1} (prev), the 16 token ids of block i and the model fingerprint (bt_model.fingerprint). */
bt_prefix_hash bt_prefix_hash_block(bt_prefix_hash prev, const int32_t tokens[BT_PREFIX_HASH_BLOCK],
                                    uint64_t fingerprint);

/* Hashes every full block of tokens[n_tokens], chaining from prev (BT_PREFIX_HASH_ROOT for a prompt's start, or
 * the hash of the block before tokens[0] to continue a chain). Writes out[n_tokens / 16] and returns that count;
 * the trailing n_tokens % 16 tokens are ignored. */
int32_t bt_prefix_hash_blocks(bt_prefix_hash prev, const int32_t *tokens, int32_t n_tokens, uint64_t fingerprint,
                              bt_prefix_hash *out);

/* 32 lowercase hex digits plus NUL: hi then lo, most significant digit first (for logs and text protocols). */
void bt_prefix_hash_hex(bt_prefix_hash h, char out[33]);

/* The primitive: SipHash-2-4, 128-bit output, of msg[len] under key[16], written as the reference implementation
 * writes it (out[16]: first 64-bit word little-endian, then the second). Exposed for the known-answer tests. */
void bt_siphash24_128(const uint8_t key[16], const void *msg, size_t len, uint8_t out[16]);

#endif
