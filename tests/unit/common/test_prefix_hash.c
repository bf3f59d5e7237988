/* tests common/prefix_hash.c: SipHash-2-4-128 against the reference vectors, the block hash against its byte-level
 * definition, frozen known answers, chaining, fingerprints and the prompt helper. */
#include <stdio.h>
#include <string.h>

#include "common/prefix_hash.h"
#include "test_util.h"

/* vectors_sip128 of the reference distribution (github.com/veorq/SipHash vectors.h): key 00..0f, message
 * 00..len-1, for len 0..63; each string is the 16 output bytes in order. */
static const char *const sip128_vectors[64] = {
    "a3817f04ba25a8e66df67214c7550293", "da87c1d86b99af44347659119b22fc45",
    "8177228da4a45dc7fca38bdef60affe4", "9c70b60c5267a94e5f33b6b02985ed51",
    "f88164c12d9c8faf7d0f6e7c7bcd5579", "1368875980776f8854527a07690e9627",
    "14eeca338b208613485ea0308fd7a15e", "a1f1ebbed8dbc153c0b84aa61ff08239",
    "3b62a9ba6258f5610f83e264f31497b4", "264499060ad9baabc47f8b02bb6d71ed",
    "00110dc378146956c95447d3f3d0fbba", "0151c568386b6677a2b4dc6f81e5dc18",
    "d626b266905ef35882634df68532c125", "9869e247e9c08b10d029934fc4b952f7",
    "31fcefac66d7de9c7ec7485fe4494902", "5493e99933b0a8117e08ec0f97cfc3d9",
    "6ee2a4ca67b054bbfd3315bf85230577", "473d06e8738db89854c066c47ae47740",
    "a426e5e423bf4885294da481feaef723", "78017731cf65fab074d5208952512eb1",
    "9e25fc833f2290733e9344a5e83839eb", "568e495abe525a218a2214cd3e071d12",
    "4a29b54552d16b9a469c10528eff0aae", "c9d184ddd5a9f5e0cf8ce29a9abf691c",
    "2db479ae78bd50d8882a8a178a6132ad", "8ece5f042d5e447b5051b9eacb8d8f6f",
    "9c0b53b4b3c307e87eaee08678141f66", "abf248af69a6eae4bfd3eb2f129eeb94",
    "0664da1668574b88b935f3027358aef4", "aa4b9dc4bf337de90cd4fd3c467c6ab7",
    "ea5c7f471faf6bde2b1ad7d4686d2287", "2939b0183223fafc1723de4f52c43d35",
    "7c3956ca5eeafc3e363e9d556546eb68", "77c6077146f01c32b6b69d5f4ea9ffcf",
    "37a6986cb8847edf0925f0f1309b54de", "a705f0e69da9a8f907241a2e923c8cc8",
    "3dc47d1f29c448461e9e76ed904f6711", "0d62bf01e6fc0e1a0d3c4751c5d3692b",
    "8c03468bca7c669ee4fd5e084bbee7b5", "528a5bb93baf2c9c4473cce5d0d22bd9",
    "df6a301e95c95dad97ae0cc8c6913bd8", "801189902c857f39e73591285e70b6db",
    "e617346ac9c231bb3650ae34ccca0c5b", "27d93437efb721aa401821dcec5adf89",
    "89237d9ded9c5e78d8b1c9b166cc7342", "4a6d8091bf5e7d651189fa94a250b14c",
    "0e33f96055e7ae893ffc0e3dcf492902", "e61c432b720b19d18ec8d84bdc63151b",
    "f7e5aef549f782cf379055a608269b16", "438d030fd0b7a54fa837f2ad201a6403",
    "a590d3ee4fbf04e3247e0d27f286423f", "5fe2c1a172fe93c4b15cd37caef9f538",
    "2c97325cbd06b36eb2133dd08b3a017c", "92c814227a6bca949ff0659f002ad39e",
    "dce850110bd8328cfbd50841d6911d87", "67f14984c7da791248e32bb5922583da",
    "1938f2cf72d54ee97e94166fa91d2a36", "74481e9646ed49fe0f6224301604698e",
    "57fca5de98a9d6d8006438d0583d8a1d", "9fecde1cefdc1cbed4763674d9575359",
    "e3040c00eb28f15366ca73cbd872e740", "7697009a6a831dfecca91c5993670f7a",
    "5853542321f567a005d547a4f04759bd", "5150d1772f50834a503e069a973fbd7c",
};

static void hex_bytes(const uint8_t *b, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

static void test_siphash_reference_vectors(void)
{
    uint8_t key[16], msg[64], out[16];
    char hex[33];
    for (int i = 0; i < 16; i++) key[i] = (uint8_t)i;
    for (int i = 0; i < 64; i++) msg[i] = (uint8_t)i;
    for (int len = 0; len < 64; len++) {
        bt_siphash24_128(key, msg, (size_t)len, out);
        hex_bytes(out, 16, hex);
        CHECK_MSG(strcmp(hex, sip128_vectors[len]) == 0, "len %d: got %s want %s", len, hex, sip128_vectors[len]);
    }
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The header's definition, built byte by byte. */
static bt_prefix_hash block_by_definition(bt_prefix_hash prev, const int32_t *tok, uint64_t fp)
{
    uint8_t key[16], msg[80], out[16];
    put_le(key, fp, 8);
    memcpy(key + 8, "baton-pc", 8);
    put_le(msg, prev.lo, 8);
    put_le(msg + 8, prev.hi, 8);
    for (int i = 0; i < 16; i++) put_le(msg + 16 + 4 * i, (uint32_t)tok[i], 4);
    bt_siphash24_128(key, msg, sizeof msg, out);
    bt_prefix_hash h = {0, 0};
    for (int i = 7; i >= 0; i--) {
        h.lo = (h.lo << 8) | out[i];
        h.hi = (h.hi << 8) | out[8 + i];
    }
    return h;
}

static void test_block_matches_definition(void)
{
    uint64_t seed = 7;
    for (int iter = 0; iter < 2000; iter++) {
        int32_t tok[16];
        for (int i = 0; i < 16; i++) tok[i] = (int32_t)(uint32_t)test_rand_next(&seed);
        bt_prefix_hash prev = {test_rand_next(&seed), test_rand_next(&seed)};
        if (iter % 3 == 0) prev = BT_PREFIX_HASH_ROOT;
        uint64_t fp = test_rand_next(&seed);
        CHECK(bt_prefix_hash_eq(bt_prefix_hash_block(prev, tok, fp), block_by_definition(prev, tok, fp)));
    }
}

/* Frozen answers, also computed by an independent Python rendering of the header's definition. A change here
 * breaks every router's prefix index: define a new version in the header instead. */
static void test_known_answers(void)
{
    int32_t tok[48];
    for (int i = 0; i < 48; i++) tok[i] = i;
    bt_prefix_hash h[3];
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 48, 0x0123456789abcdefULL, h) == 3);
    CHECK(h[0].lo == 0xe3c17b89ea5ed772ULL && h[0].hi == 0xf8dea2e31639b6f2ULL);
    CHECK(h[1].lo == 0x749e4a3b21244e08ULL && h[1].hi == 0xdc9452395718e484ULL);
    CHECK(h[2].lo == 0x8129485cf5b1ab24ULL && h[2].hi == 0x779023c80f33d9acULL);

    int32_t zeros[16] = {0};
    bt_prefix_hash z = bt_prefix_hash_block(BT_PREFIX_HASH_ROOT, zeros, 0);
    CHECK(z.lo == 0xa753513a9026f393ULL && z.hi == 0x4b58677804fa4e85ULL);

    int32_t big[16];
    for (int i = 0; i < 16; i++) big[i] = 49152 + i * 1000;
    bt_prefix_hash b = bt_prefix_hash_block(BT_PREFIX_HASH_ROOT, big, 0xfeedface00c0ffeeULL);
    CHECK(b.lo == 0xd8b5d1be2768ed6cULL && b.hi == 0xaabc6699c7d20981ULL);

    int32_t neg[16];
    for (int i = 0; i < 16; i++) neg[i] = -1; /* taken as uint32 0xffffffff */
    bt_prefix_hash n = bt_prefix_hash_block(BT_PREFIX_HASH_ROOT, neg, 1);
    CHECK(n.lo == 0xf655fa820fec3894ULL && n.hi == 0x88af8317c07a7c65ULL);
}

static void test_chaining(void)
{
    enum { NB = 12 };
    int32_t tok[NB * 16], alt[NB * 16];
    uint64_t seed = 99;
    bt_prefix_hash ha[NB], hb[NB];
    for (int trial = 0; trial < 200; trial++) {
        for (int i = 0; i < NB * 16; i++) tok[i] = (int32_t)(test_rand_next(&seed) % 50000);
        int pos = (int)(test_rand_next(&seed) % (NB * 16));
        memcpy(alt, tok, sizeof tok);
        alt[pos] = (alt[pos] + 1 + (int32_t)(test_rand_next(&seed) % 1000)) % 50000;
        bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, NB * 16, 42, ha);
        bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, alt, NB * 16, 42, hb);
        for (int j = 0; j < NB; j++) {
            if (j < pos / 16)
                CHECK(bt_prefix_hash_eq(ha[j], hb[j]));
            else
                CHECK_MSG(ha[j].lo != hb[j].lo && ha[j].hi != hb[j].hi, "trial %d block %d (changed position %d)",
                          trial, j, pos);
        }
    }
    /* The same block content at different depths hashes differently. */
    int32_t rep[32];
    for (int i = 0; i < 32; i++) rep[i] = i % 16;
    bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, rep, 32, 42, ha);
    CHECK(!bt_prefix_hash_eq(ha[0], ha[1]));
}

static void test_fingerprints_differ(void)
{
    int32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = 1000 + i;
    bt_prefix_hash a[4], b[4], c[4];
    bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 64, 0x1111, a);
    bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 64, 0x1112, b);
    bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 64, 0x1111ULL << 32, c);
    for (int j = 0; j < 4; j++) {
        CHECK(!bt_prefix_hash_eq(a[j], b[j]));
        CHECK(!bt_prefix_hash_eq(a[j], c[j]));
        CHECK(!bt_prefix_hash_eq(b[j], c[j]));
    }
}

static void test_blocks_helper(void)
{
    int32_t tok[100];
    for (int i = 0; i < 100; i++) tok[i] = i * 7;
    bt_prefix_hash whole[6], part[6];
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 100, 5, whole) == 6); /* 4 trailing tokens ignored */
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 15, 5, part) == 0);
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 0, 5, part) == 0);
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, -3, 5, part) == 0);
    /* Continuing a chain from block 1's hash equals hashing the whole prompt. */
    CHECK(bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, tok, 32, 5, part) == 2);
    CHECK(bt_prefix_hash_blocks(part[1], tok + 32, 68, 5, part + 2) == 4);
    for (int j = 0; j < 6; j++) CHECK(bt_prefix_hash_eq(whole[j], part[j]));
    bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
    for (int j = 0; j < 6; j++) {
        prev = bt_prefix_hash_block(prev, tok + 16 * j, 5);
        CHECK(bt_prefix_hash_eq(prev, whole[j]));
    }
}

static void test_hex(void)
{
    char s[33];
    bt_prefix_hash_hex((bt_prefix_hash){.lo = 0x0123456789abcdefULL, .hi = 0xfedcba9876543210ULL}, s);
    CHECK(strcmp(s, "fedcba98765432100123456789abcdef") == 0);
    bt_prefix_hash_hex(BT_PREFIX_HASH_ROOT, s);
    CHECK(strcmp(s, "00000000000000000000000000000000") == 0);
}

/* Well mixed: flipping one input bit flips each output bit about half the time. */
static void test_avalanche(void)
{
    enum { SAMPLES = 400 };
    uint64_t seed = 3;
    int worst_bit = -1;
    double worst = 0;
    for (int bit = 0; bit < 16 * 32; bit += 3) { /* a spread of token bits */
        int flips[128] = {0};
        for (int s = 0; s < SAMPLES; s++) {
            int32_t tok[16];
            for (int i = 0; i < 16; i++) tok[i] = (int32_t)(uint32_t)test_rand_next(&seed);
            bt_prefix_hash a = bt_prefix_hash_block(BT_PREFIX_HASH_ROOT, tok, 77);
            tok[bit / 32] = (int32_t)((uint32_t)tok[bit / 32] ^ (1u << (bit % 32)));
            bt_prefix_hash b = bt_prefix_hash_block(BT_PREFIX_HASH_ROOT, tok, 77);
            uint64_t dlo = a.lo ^ b.lo, dhi = a.hi ^ b.hi;
            for (int o = 0; o < 64; o++) {
                flips[o] += (int)((dlo >> o) & 1);
                flips[64 + o] += (int)((dhi >> o) & 1);
            }
        }
        for (int o = 0; o < 128; o++) {
            double dev = (double)flips[o] / SAMPLES - 0.5;
            if (dev < 0) dev = -dev;
            if (dev > worst) {
                worst = dev;
                worst_bit = bit;
            }
        }
    }
    /* 400 samples give sd 0.025; the worst of ~22k cells stays under 0.15 for a sound hash */
    CHECK_MSG(worst < 0.15, "worst bias %.3f at input bit %d", worst, worst_bit);
}

int main(void)
{
    RUN(test_siphash_reference_vectors);
    RUN(test_block_matches_definition);
    RUN(test_known_answers);
    RUN(test_chaining);
    RUN(test_fingerprints_differ);
    RUN(test_blocks_helper);
    RUN(test_hex);
    RUN(test_avalanche);
    return test_summary();
}
