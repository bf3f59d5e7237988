#include "common/prefix_hash.h"

#include <stdio.h>

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

/* "baton-pc" read as a little-endian word: the second half of every prefix-hash key. */
#define BT_PREFIX_KEY1 0x63702d6e6f746162ULL

typedef struct sip_state {
    uint64_t v0, v1, v2, v3;
} sip_state;

static inline void sip_round(sip_state *s)
{
    s->v0 += s->v1;
    s->v1 = ROTL(s->v1, 13);
    s->v1 ^= s->v0;
    s->v0 = ROTL(s->v0, 32);
    s->v2 += s->v3;
    s->v3 = ROTL(s->v3, 16);
    s->v3 ^= s->v2;
    s->v0 += s->v3;
    s->v3 = ROTL(s->v3, 21);
    s->v3 ^= s->v0;
    s->v2 += s->v1;
    s->v1 = ROTL(s->v1, 17);
    s->v1 ^= s->v2;
    s->v2 = ROTL(s->v2, 32);
}

static inline void sip_init128(sip_state *s, uint64_t k0, uint64_t k1)
{
    s->v0 = k0 ^ 0x736f6d6570736575ULL;
    s->v1 = k1 ^ 0x646f72616e646f6dULL ^ 0xee; /* 0xee: the 128-bit output variant */
    s->v2 = k0 ^ 0x6c7967656e657261ULL;
    s->v3 = k1 ^ 0x7465646279746573ULL;
}

static inline void sip_word(sip_state *s, uint64_t m)
{
    s->v3 ^= m;
    sip_round(s);
    sip_round(s);
    s->v0 ^= m;
}

/* last = the final word (length byte on top, trailing bytes below); returns both output words. */
static inline void sip_final128(sip_state *s, uint64_t last, uint64_t *lo, uint64_t *hi)
{
    sip_word(s, last);
    s->v2 ^= 0xee;
    for (int i = 0; i < 4; i++) sip_round(s);
    *lo = s->v0 ^ s->v1 ^ s->v2 ^ s->v3;
    s->v1 ^= 0xdd;
    for (int i = 0; i < 4; i++) sip_round(s);
    *hi = s->v0 ^ s->v1 ^ s->v2 ^ s->v3;
}

static inline uint64_t load_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline void store_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void bt_siphash24_128(const uint8_t key[16], const void *msg, size_t len, uint8_t out[16])
{
    const uint8_t *p = msg;
    sip_state s;
    sip_init128(&s, load_le64(key), load_le64(key + 8));
    size_t full = len & ~(size_t)7;
    for (size_t i = 0; i < full; i += 8) sip_word(&s, load_le64(p + i));
    uint64_t last = (uint64_t)(len & 0xff) << 56;
    for (size_t i = 0; i < (len & 7); i++) last |= (uint64_t)p[full + i] << (8 * i);
    uint64_t lo, hi;
    sip_final128(&s, last, &lo, &hi);
    store_le64(out, lo);
    store_le64(out + 8, hi);
}

bt_prefix_hash bt_prefix_hash_block(bt_prefix_hash prev, const int32_t tokens[BT_PREFIX_HASH_BLOCK],
                                    uint64_t fingerprint)
{
    /* The 80-byte message of the header, fed as ten little-endian words without building the bytes. */
    sip_state s;
    sip_init128(&s, fingerprint, BT_PREFIX_KEY1);
    sip_word(&s, prev.lo);
    sip_word(&s, prev.hi);
    for (int i = 0; i < BT_PREFIX_HASH_BLOCK; i += 2)
        sip_word(&s, (uint64_t)(uint32_t)tokens[i] | (uint64_t)(uint32_t)tokens[i + 1] << 32);
    bt_prefix_hash h;
    sip_final128(&s, (uint64_t)80 << 56, &h.lo, &h.hi);
    return h;
}

int32_t bt_prefix_hash_blocks(bt_prefix_hash prev, const int32_t *tokens, int32_t n_tokens, uint64_t fingerprint,
                              bt_prefix_hash *out)
{
    int32_t n = n_tokens > 0 ? n_tokens / BT_PREFIX_HASH_BLOCK : 0;
    for (int32_t i = 0; i < n; i++) {
        prev = bt_prefix_hash_block(prev, tokens + (size_t)i * BT_PREFIX_HASH_BLOCK, fingerprint);
        out[i] = prev;
    }
    return n;
}

void bt_prefix_hash_hex(bt_prefix_hash h, char out[33])
{
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.hi, (unsigned long long)h.lo);
}
