#include "engine/sampler.h"

#include "engine/constraint.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Below this temperature sampling is argmax (vLLM's _SAMPLING_EPS): 1 / T would overflow the float arithmetic. */
#define GREEDY_EPS 1e-5f

bt_sampling bt_sampling_default(void)
{
    bt_sampling s;
    memset(&s, 0, sizeof s);
    s.temperature = 0.0f;
    s.top_p = 1.0f;
    s.repetition_penalty = 1.0f;
    s.n = 1;
    return s;
}

bt_status bt_sampling_check(const bt_sampling *sp)
{
    if (!(sp->temperature >= 0.0f && sp->temperature <= 100.0f))
        return bt_fail(BT_ERR_INVALID, "temperature must be between 0 and 100");
    if (sp->top_k < 0) return bt_fail(BT_ERR_INVALID, "top_k must be >= 0");
    if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f)) return bt_fail(BT_ERR_INVALID, "top_p must be in (0, 1]");
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f)) return bt_fail(BT_ERR_INVALID, "min_p must be in [0, 1]");
    if (!(sp->repetition_penalty > 0.0f && sp->repetition_penalty <= 10.0f))
        return bt_fail(BT_ERR_INVALID, "repetition_penalty must be in (0, 10]");
    if (!(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        return bt_fail(BT_ERR_INVALID, "frequency_penalty must be in [-2, 2]");
    if (!(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        return bt_fail(BT_ERR_INVALID, "presence_penalty must be in [-2, 2]");
    if (sp->n_logit_bias < 0 || sp->n_logit_bias > BT_MAX_LOGIT_BIAS)
        return bt_fail(BT_ERR_INVALID, "logit_bias may hold at most %d entries", BT_MAX_LOGIT_BIAS);
    for (int32_t i = 0; i < sp->n_logit_bias; i++) {
        const bt_logit_bias *b = &sp->logit_bias[i];
        if (b->id < 0) return bt_fail(BT_ERR_INVALID, "logit_bias: token id %d is negative", (int)b->id);
        if (!(b->bias >= -100.0f && b->bias <= 100.0f))
            return bt_fail(BT_ERR_INVALID, "logit_bias: bias of token %d must be in [-100, 100]", (int)b->id);
        for (int32_t j = 0; j < i; j++)
            if (sp->logit_bias[j].id == b->id)
                return bt_fail(BT_ERR_INVALID, "logit_bias: token id %d appears twice", (int)b->id);
    }
    if (sp->top_logprobs < 0 || sp->top_logprobs > BT_MAX_TOP_LOGPROBS)
        return bt_fail(BT_ERR_INVALID, "top_logprobs must be in [0, %d]", BT_MAX_TOP_LOGPROBS);
    if (sp->top_logprobs > 0 && !sp->logprobs)
        return bt_fail(BT_ERR_INVALID, "top_logprobs needs logprobs to be enabled");
    if (sp->n < 1 || sp->n > BT_MAX_N) return bt_fail(BT_ERR_INVALID, "n must be in [1, %d]", BT_MAX_N);
    if (sp->max_tokens < 0) return bt_fail(BT_ERR_INVALID, "max_tokens must be >= 0");
    if (sp->n_stop_ids < 0 || sp->n_stop_ids > BT_MAX_STOP_IDS)
        return bt_fail(BT_ERR_INVALID, "stop_token_ids may hold at most %d ids", BT_MAX_STOP_IDS);
    for (int32_t i = 0; i < sp->n_stop_ids; i++)
        if (sp->stop_ids[i] < 0)
            return bt_fail(BT_ERR_INVALID, "stop_token_ids: token id %d is negative", (int)sp->stop_ids[i]);
    return BT_OK;
}

bt_status bt_sampling_check_vocab(const bt_sampling *sp, int32_t n_vocab)
{
    bt_status st = bt_sampling_check(sp);
    if (st) return st;
    for (int32_t i = 0; i < sp->n_logit_bias; i++)
        if (sp->logit_bias[i].id >= n_vocab)
            return bt_fail(BT_ERR_INVALID, "logit_bias: token id %d is out of range (vocabulary of %d)",
                           (int)sp->logit_bias[i].id, (int)n_vocab);
    for (int32_t i = 0; i < sp->n_stop_ids; i++)
        if (sp->stop_ids[i] >= n_vocab)
            return bt_fail(BT_ERR_INVALID, "stop_token_ids: token id %d is out of range (vocabulary of %d)",
                           (int)sp->stop_ids[i], (int)n_vocab);
    return BT_OK;
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double bt_rng_uniform(uint64_t seed, int64_t position)
{
    uint64_t z = mix64(seed + 0x9E3779B97F4A7C15ull) ^ mix64((uint64_t)position * 0xD1B54A32D192ED03ull + 1);
    return (double)(mix64(z) >> 11) * 0x1p-53;
}

double bt_rng_uniform_stream(uint64_t seed, int32_t stream, int64_t position)
{
    if (stream == 0) return bt_rng_uniform(seed, position);
    uint64_t sub = mix64(seed ^ mix64((uint64_t)(uint32_t)stream * 0xA0761D6478BD642Full + 0xE7037ED1A0B428DBull));
    return bt_rng_uniform(sub, position);
}

/* ---- per-sequence history ---- */

typedef struct pen_entry {
    int32_t id;
    int32_t n_out;     /* occurrences among generated tokens */
    int32_t in_prompt; /* 1 when the prompt holds the token (tracked only for the repetition penalty) */
} pen_entry;

struct bt_sampler_seq {
    bt_sampling sp;
    int32_t n_vocab;
    int32_t index; /* sample index: the RNG stream */
    int32_t n_eos;
    int32_t eos[BT_MAX_EOS];
    int32_t *gen; /* [cap_gen] generated tokens, n_gen used */
    int32_t n_gen, cap_gen;
    int track;        /* any penalty set: keep the entries below */
    pen_entry *ent;   /* [n_slot / 2] distinct tokens seen, n_ent used */
    int32_t n_ent;
    int32_t *slot;    /* [n_slot] open addressing, index into ent or -1 */
    uint32_t n_slot;  /* power of two, 0 before the first insert */
    bt_constraint *con; /* optional grammar constraint, shared by the samples of a request (one reference each) */
    int32_t *cst;       /* [cap_gen + 1] constraint state before each generated token; cst[n_gen] is the current */
    uint64_t *mask;     /* [ceil(n_vocab / 64)] allowed tokens of state mask_state: a memo, so const callers fill it */
    int32_t mask_state; /* -1: mask holds nothing */
};

static uint32_t slot_hash(int32_t id, uint32_t mask)
{
    uint32_t h = (uint32_t)id * 0x9E3779B1u;
    return (h ^ (h >> 15)) & mask;
}

static int32_t ent_find(const bt_sampler_seq *s, int32_t id)
{
    if (!s->n_slot) return -1;
    uint32_t mask = s->n_slot - 1;
    for (uint32_t h = slot_hash(id, mask);; h = (h + 1) & mask) {
        int32_t e = s->slot[h];
        if (e < 0) return -1;
        if (s->ent[e].id == id) return e;
    }
}

static bt_status ent_grow(bt_sampler_seq *s)
{
    uint32_t n_slot = s->n_slot ? s->n_slot * 2 : 64;
    int32_t *slot = malloc(sizeof *slot * n_slot);
    pen_entry *ent = realloc(s->ent, sizeof *ent * (n_slot / 2));
    if (!slot || !ent) {
        free(slot);
        if (ent) s->ent = ent;
        return bt_fail(BT_ERR_NOMEM, "sampler: out of memory for the token history");
    }
    s->ent = ent;
    for (uint32_t i = 0; i < n_slot; i++) slot[i] = -1;
    for (int32_t e = 0; e < s->n_ent; e++) {
        uint32_t h = slot_hash(ent[e].id, n_slot - 1);
        while (slot[h] >= 0) h = (h + 1) & (n_slot - 1);
        slot[h] = e;
    }
    free(s->slot);
    s->slot = slot;
    s->n_slot = n_slot;
    return BT_OK;
}

/* Index of id's entry, inserting a zeroed one when absent. */
static bt_status ent_get(bt_sampler_seq *s, int32_t id, int32_t *out)
{
    int32_t e = ent_find(s, id);
    if (e < 0) {
        if ((uint32_t)(s->n_ent + 1) > s->n_slot / 2) {
            bt_status st = ent_grow(s);
            if (st) return st;
        }
        uint32_t mask = s->n_slot - 1, h = slot_hash(id, mask);
        while (s->slot[h] >= 0) h = (h + 1) & mask;
        e = s->n_ent++;
        s->slot[h] = e;
        s->ent[e] = (pen_entry){.id = id, .n_out = 0, .in_prompt = 0};
    }
    *out = e;
    return BT_OK;
}

bt_status bt_sampler_seq_create(const bt_sampling *sp, int32_t n_vocab, const int32_t *prompt, int32_t n_prompt,
                                const int32_t *eos, int32_t n_eos, int32_t sample_index, bt_sampler_seq **out)
{
    if (n_vocab < 1) return bt_fail(BT_ERR_INVALID, "sampler: vocabulary size %d", (int)n_vocab);
    bt_status st = bt_sampling_check_vocab(sp, n_vocab);
    if (st) return st;
    if (sample_index < 0 || sample_index >= sp->n)
        return bt_fail(BT_ERR_INVALID, "sampler: sample index %d outside [0, n = %d)", (int)sample_index, (int)sp->n);
    if (n_eos < 0 || n_eos > BT_MAX_EOS)
        return bt_fail(BT_ERR_INVALID, "sampler: at most %d end-of-sequence ids", BT_MAX_EOS);
    for (int32_t i = 0; i < n_eos; i++)
        if (eos[i] < 0 || eos[i] >= n_vocab)
            return bt_fail(BT_ERR_INVALID, "sampler: end-of-sequence id %d out of range", (int)eos[i]);
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= n_vocab)
            return bt_fail(BT_ERR_INVALID, "sampler: prompt token %d out of range", (int)prompt[i]);

    bt_sampler_seq *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "sampler: out of memory");
    s->sp = *sp;
    s->n_vocab = n_vocab;
    s->index = sample_index;
    s->mask_state = -1;
    s->n_eos = n_eos;
    if (n_eos) memcpy(s->eos, eos, sizeof *eos * (size_t)n_eos);
    s->track = sp->repetition_penalty != 1.0f || sp->frequency_penalty != 0.0f || sp->presence_penalty != 0.0f;
    if (s->track && sp->repetition_penalty != 1.0f) {
        for (int32_t i = 0; i < n_prompt; i++) {
            int32_t e;
            st = ent_get(s, prompt[i], &e);
            if (st) goto fail;
            s->ent[e].in_prompt = 1;
        }
    }
    *out = s;
    return BT_OK;
fail:
    bt_sampler_seq_free(s);
    return st;
}

bt_status bt_sampler_seq_fork(const bt_sampler_seq *src, int32_t sample_index, bt_sampler_seq **out)
{
    if (sample_index < 0 || sample_index >= src->sp.n)
        return bt_fail(BT_ERR_INVALID, "sampler: sample index %d outside [0, n = %d)", (int)sample_index,
                       (int)src->sp.n);
    bt_sampler_seq *s = malloc(sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "sampler: out of memory");
    *s = *src;
    s->index = sample_index;
    s->gen = NULL;
    s->ent = NULL;
    s->slot = NULL;
    s->cst = NULL;
    s->mask = NULL;
    s->mask_state = -1;
    if (src->con) {
        bt_constraint_ref(src->con);
        s->cst = malloc(sizeof *s->cst * ((size_t)src->cap_gen + 1));
        s->mask = malloc(sizeof *s->mask * (((size_t)src->n_vocab + 63) / 64));
        if (!s->cst || !s->mask) {
            bt_sampler_seq_free(s);
            return bt_fail(BT_ERR_NOMEM, "sampler: out of memory");
        }
        memcpy(s->cst, src->cst, sizeof *s->cst * ((size_t)src->n_gen + 1));
    }
    if (src->cap_gen) s->gen = malloc(sizeof *s->gen * (size_t)src->cap_gen);
    if (src->n_slot) {
        s->ent = malloc(sizeof *s->ent * (src->n_slot / 2));
        s->slot = malloc(sizeof *s->slot * src->n_slot);
    }
    if ((src->cap_gen && !s->gen) || (src->n_slot && (!s->ent || !s->slot))) {
        bt_sampler_seq_free(s);
        return bt_fail(BT_ERR_NOMEM, "sampler: out of memory");
    }
    if (src->n_gen) memcpy(s->gen, src->gen, sizeof *s->gen * (size_t)src->n_gen);
    if (src->n_slot) {
        if (src->n_ent) memcpy(s->ent, src->ent, sizeof *s->ent * (size_t)src->n_ent);
        memcpy(s->slot, src->slot, sizeof *s->slot * src->n_slot);
    }
    *out = s;
    return BT_OK;
}

void bt_sampler_seq_free(bt_sampler_seq *s)
{
    if (!s) return;
    free(s->gen);
    free(s->ent);
    free(s->slot);
    free(s->cst);
    free(s->mask);
    bt_constraint_unref(s->con);
    free(s);
}

const bt_sampling *bt_sampler_seq_params(const bt_sampler_seq *s) { return &s->sp; }

int32_t bt_sampler_seq_n_generated(const bt_sampler_seq *s) { return s->n_gen; }

int32_t bt_sampler_seq_index(const bt_sampler_seq *s) { return s->index; }

int32_t bt_sampler_seq_remaining(const bt_sampler_seq *s)
{
    if (!s->sp.max_tokens) return INT32_MAX;
    return s->n_gen >= s->sp.max_tokens ? 0 : s->sp.max_tokens - s->n_gen;
}

static int is_eos(const bt_sampler_seq *s, int32_t token)
{
    for (int32_t i = 0; i < s->n_eos; i++)
        if (s->eos[i] == token) return 1;
    return 0;
}

bt_status bt_sampler_seq_set_constraint(bt_sampler_seq *s, bt_constraint *c)
{
    if (s->con || s->n_gen)
        return bt_fail(BT_ERR_INVALID, "sampler: a constraint must be set once, before the first token");
    if (bt_constraint_n_vocab(c) != s->n_vocab)
        return bt_fail(BT_ERR_INVALID, "sampler: constraint vocabulary of %d tokens, model of %d",
                       (int)bt_constraint_n_vocab(c), (int)s->n_vocab);
    s->cst = malloc(sizeof *s->cst * ((size_t)s->cap_gen + 1));
    s->mask = malloc(sizeof *s->mask * (((size_t)s->n_vocab + 63) / 64));
    if (!s->cst || !s->mask) {
        free(s->cst);
        free(s->mask);
        s->cst = NULL;
        s->mask = NULL;
        return bt_fail(BT_ERR_NOMEM, "sampler: out of memory");
    }
    s->cst[0] = bt_constraint_start();
    s->con = bt_constraint_ref(c);
    s->mask_state = -1;
    return BT_OK;
}

bt_status bt_sampler_seq_constraint_feed(bt_sampler_seq *s, const int32_t *tokens, int32_t n)
{
    if (!s->con || s->n_gen) return bt_fail(BT_ERR_INVALID, "sampler: no constraint to feed, or tokens accepted");
    int32_t state = s->cst[0];
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= s->n_vocab)
            return bt_fail(BT_ERR_INVALID, "sampler: token %d out of range", (int)tokens[i]);
        bt_status st = bt_constraint_next(s->con, state, tokens[i], &state);
        if (st) return st;
    }
    s->cst[0] = state;
    s->mask_state = -1;
    return BT_OK;
}

int bt_sampler_seq_constraint_accepting(const bt_sampler_seq *s)
{
    return !s->con || bt_constraint_accepting(s->con, s->cst[s->n_gen]);
}

bt_status bt_sampler_seq_accept(bt_sampler_seq *s, int32_t token, bt_finish *finish)
{
    if (token < 0 || token >= s->n_vocab)
        return bt_fail(BT_ERR_INVALID, "sampler: accepted token %d out of range", (int)token);
    if (s->n_gen == s->cap_gen) {
        int32_t cap = s->cap_gen ? s->cap_gen * 2 : 64;
        int32_t *gen = realloc(s->gen, sizeof *gen * (size_t)cap);
        if (!gen) return bt_fail(BT_ERR_NOMEM, "sampler: out of memory for the token history");
        s->gen = gen;
        if (s->con) {
            int32_t *cst = realloc(s->cst, sizeof *cst * ((size_t)cap + 1));
            if (!cst) return bt_fail(BT_ERR_NOMEM, "sampler: out of memory for the token history");
            s->cst = cst;
        }
        s->cap_gen = cap;
    }
    int32_t next_state = 0;
    if (s->con) {
        int32_t cur = s->cst[s->n_gen];
        if (is_eos(s, token)) {
            next_state = cur; /* it ends the sequence; the mask allowed it only where the grammar accepts */
        } else {
            bt_status st = bt_constraint_next(s->con, cur, token, &next_state);
            if (st) return st;
        }
    }
    if (s->track) {
        int32_t e;
        bt_status st = ent_get(s, token, &e);
        if (st) return st;
        s->ent[e].n_out++;
    }
    s->gen[s->n_gen++] = token;
    if (s->con) s->cst[s->n_gen] = next_state;
    if (finish) {
        bt_finish f = BT_FINISH_NONE;
        for (int32_t i = 0; i < s->sp.n_stop_ids && !f; i++)
            if (s->sp.stop_ids[i] == token) f = BT_FINISH_STOP;
        for (int32_t i = 0; i < s->n_eos && !f && !s->sp.ignore_eos; i++)
            if (s->eos[i] == token) f = BT_FINISH_STOP;
        if (!f && s->con && bt_constraint_final(s->con, next_state)) f = BT_FINISH_STOP; /* nothing may follow */
        if (!f && s->sp.max_tokens && s->n_gen >= s->sp.max_tokens) f = BT_FINISH_LENGTH;
        *finish = f;
    }
    return BT_OK;
}

bt_status bt_sampler_seq_rollback(bt_sampler_seq *s, int32_t n)
{
    if (n < 0 || n > s->n_gen)
        return bt_fail(BT_ERR_INVALID, "sampler: cannot roll back %d of %d tokens", (int)n, (int)s->n_gen);
    for (int32_t i = 0; i < n; i++) {
        int32_t token = s->gen[--s->n_gen];
        if (s->track) s->ent[ent_find(s, token)].n_out--; /* the entry exists: accept made it */
    }
    return BT_OK;
}

/* ---- the sampling passes ---- */

/* The caller's float scratch is reused as ids and block sums: may_alias keeps that defined even when the scratch
 * is a declared float array. */
typedef int32_t alias_i32 __attribute__((may_alias));
typedef double alias_f64 __attribute__((may_alias));

/* Vector helpers written with GCC vector extensions (no ISA intrinsics): 4 floats per operation, which every
 * 64-bit target has (SSE2, NEON). The scalar tails perform the same IEEE float operations as the vector
 * bodies (baton_engine builds with -ffp-contract=off), so a token's weight does not depend on where it falls. */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef double v2d __attribute__((vector_size(16)));

static inline v4f load4(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial; within 1.4 ulp on [-87, 0]);
 * 0 below -87 (where 2^n would be denormal) and for NaN. */
#define EXP_LO (-87.0f)
#define EXP_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer kept in the low mantissa bits */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_neg(float x)
{
    if (!(x >= EXP_LO)) return 0.0f;
    float t = x * EXP_LOG2E + EXP_MAGIC;
    int32_t ti, magic_bits, bits;
    float magic = EXP_MAGIC, scale;
    memcpy(&ti, &t, sizeof ti);
    memcpy(&magic_bits, &magic, sizeof magic_bits);
    float fn = t - EXP_MAGIC;
    float r = x - fn * EXP_C1;
    r = r - fn * EXP_C2;
    float r2 = r * r;
    float y = EXP_P0 * r + EXP_P1;
    y = y * r + EXP_P2;
    y = y * r + EXP_P3;
    y = y * r + EXP_P4;
    y = y * r + EXP_P5;
    y = y * r2 + r + 1.0f;
    bits = (ti - magic_bits + 127) * (1 << 23);
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

static inline v4f exp_neg4(v4f x)
{
    const v4f zero = {0};
    v4i ok = x >= zero + EXP_LO;
    x = (v4f)((v4i)x & ok); /* NaN and underflow lanes compute exp(0), then are masked to 0 */
    v4f t = x * EXP_LOG2E + EXP_MAGIC;
    float magic = EXP_MAGIC;
    int32_t magic_bits;
    memcpy(&magic_bits, &magic, sizeof magic_bits);
    v4f fn = t - EXP_MAGIC;
    v4f r = x - fn * EXP_C1;
    r = r - fn * EXP_C2;
    v4f r2 = r * r;
    v4f y = EXP_P0 * r + EXP_P1;
    y = y * r + EXP_P2;
    y = y * r + EXP_P3;
    y = y * r + EXP_P4;
    y = y * r + EXP_P5;
    y = y * r2 + r + 1.0f;
    v4i bits = ((v4i)t - magic_bits + 127) * (1 << 23);
    y = y * (v4f)bits;
    return (v4f)((v4i)y & ok);
}

/* acc[0] += lanes 0-1 of y, acc[1] += lanes 2-3, widened to double (two 16-byte chains, kept in registers). */
static inline void acc_add4(v4f y, v2d acc[2])
{
    v2d lo = {y[0], y[1]}, hi = {y[2], y[3]};
    acc[0] += lo;
    acc[1] += hi;
}

#define EXP_BLOCK 64 /* elements per block sum */

/* w[i] = exp((l[i] - m) * inv_t) where that exponent is >= lcut, else 0. w may be NULL (sum only) or alias l.
 * bsum (optional): the sum of each EXP_BLOCK-element block. Returns the total, summed block by block in order. */
static double exp_fill(const float *l, int32_t n, float m, float inv_t, float lcut, float *w, alias_f64 *bsum)
{
    double total = 0;
    const v4f zero = {0};
    for (int32_t b0 = 0; b0 < n; b0 += EXP_BLOCK) {
        int32_t b1 = b0 + EXP_BLOCK < n ? b0 + EXP_BLOCK : n, i = b0;
        v2d acc[2] = {{0, 0}, {0, 0}};
        for (; i + 4 <= b1; i += 4) {
            v4f x = (load4(l + i) - m) * inv_t;
            v4f y = exp_neg4(x);
            y = (v4f)((v4i)y & (x >= zero + lcut));
            if (w) memcpy(w + i, &y, sizeof y);
            acc_add4(y, acc);
        }
        double bs = (acc[0][0] + acc[0][1]) + (acc[1][0] + acc[1][1]);
        for (; i < b1; i++) {
            float x = (l[i] - m) * inv_t;
            float y = x >= lcut ? exp_neg(x) : 0.0f;
            if (w) w[i] = y;
            bs += y;
        }
        if (bsum) bsum[b0 / EXP_BLOCK] = bs;
        total += bs;
    }
    return total;
}

/* x where it is larger, else acc: a NaN in x never enters (acc starts at -inf, so it never holds one) */
static inline v4f max_keep4(v4f acc, v4f x)
{
#ifdef __SSE2__ /* maxps returns its second operand when either is NaN */
    return (v4f)_mm_max_ps((__m128)x, (__m128)acc);
#else
    v4i gt = x > acc;
    return (v4f)(((v4i)x & gt) | ((v4i)acc & ~gt));
#endif
}

/* Index of the largest value, lowest index on ties; NaN is never the maximum, and a NaN first (or nothing above
 * -inf) gives 0. One pass keeps each block's maximum on 4 independent chains, then only the first block holding
 * the overall maximum is searched for it: about one read of the logits, where a 4-lane max pass and then a scalar
 * search from id 0 read them ~1.5 times, one float per cycle in the search (Gemma 3's 262,144 logits: ~0.35 ms a
 * sequence, 4.5 of a 33 ms step at 16 sequences). */
#define ARGMAX_BLOCK 2048
static int32_t argmax(const float *x, int32_t n)
{
    if (n <= 0 || x[0] != x[0]) return 0;
    float best = -INFINITY;
    int32_t at = -1;
    const v4f ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (int32_t b0 = 0; b0 < n; b0 += ARGMAX_BLOCK) {
        int32_t b1 = b0 + ARGMAX_BLOCK < n ? b0 + ARGMAX_BLOCK : n, i = b0;
        v4f m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
        for (; i + 16 <= b1; i += 16) {
            m0 = max_keep4(m0, load4(x + i));
            m1 = max_keep4(m1, load4(x + i + 4));
            m2 = max_keep4(m2, load4(x + i + 8));
            m3 = max_keep4(m3, load4(x + i + 12));
        }
        m0 = max_keep4(max_keep4(m0, m1), max_keep4(m2, m3));
        float bm = -INFINITY;
        for (int j = 0; j < 4; j++) bm = m0[j] > bm ? m0[j] : bm;
        for (; i < b1; i++) bm = x[i] > bm ? x[i] : bm;
        if (bm > best) { /* strictly: the first block with the maximum keeps it */
            best = bm;
            at = b0;
        }
    }
    if (at < 0) return 0;
    for (int32_t i = at;; i++)
        if (x[i] == best) return i;
}

/* Fills s->mask for the current constraint state (a memo of bt_constraint_mask, hence the cast) and allows the
 * end-of-sequence ids where the grammar accepts, or where nothing else is allowed (a dead end left by a grammar
 * limit: the sequence then ends). Returns the mask, or NULL when not even that allows a token. */
static const uint64_t *current_mask(const bt_sampler_seq *cs)
{
    bt_sampler_seq *s = (bt_sampler_seq *)cs;
    int32_t state = s->cst[s->n_gen];
    size_t words = ((size_t)s->n_vocab + 63) / 64;
    if (s->mask_state != state) {
        bt_constraint_mask(s->con, state, s->mask); /* out of memory: nothing but the end is allowed */
        uint64_t any = 0;
        for (size_t w = 0; w < words; w++) any |= s->mask[w];
        if ((bt_constraint_accepting(s->con, state) && !s->sp.ignore_eos) || !any)
            for (int32_t i = 0; i < s->n_eos; i++) s->mask[s->eos[i] >> 6] |= 1ull << (s->eos[i] & 63);
        any = 0;
        for (size_t w = 0; w < words; w++) any |= s->mask[w];
        s->mask_state = any ? state : -2;
    }
    return s->mask_state == -2 ? NULL : s->mask;
}

/* buf[n] = logits with the tokens the constraint forbids at -inf. 0 when there is no usable mask. */
static int apply_mask(const bt_sampler_seq *s, const float *logits, float *buf)
{
    const uint64_t *m = current_mask(s);
    if (!m) return 0;
    const int32_t n = s->n_vocab;
    int32_t i = 0;
    for (; i + 64 <= n; i += 64) { /* masks are mostly runs of all-allowed or all-forbidden words */
        uint64_t w = m[i >> 6];
        if (w == ~0ull) {
            memcpy(buf + i, logits + i, 64 * sizeof *buf);
        } else if (!w) {
            for (int j = 0; j < 64; j++) buf[i + j] = -INFINITY;
        } else {
            for (int j = 0; j < 64; j++) buf[i + j] = ((w >> j) & 1) ? logits[i + j] : -INFINITY;
        }
    }
    for (; i < n; i++) buf[i] = ((m[i >> 6] >> (i & 63)) & 1) ? logits[i] : -INFINITY;
    return 1;
}

/* Returns the logits after bias and penalties: `logits` itself when nothing applies, else a copy in buf[n]. */
static const float *patch_logits(const bt_sampling *sp, const bt_sampler_seq *s, const float *logits, int32_t n,
                                 float *buf)
{
    int pen = s && s->track && s->n_ent > 0;
    if (s && s->con && apply_mask(s, logits, buf)) {
        /* masked into buf */
    } else {
        if (!sp->n_logit_bias && !pen) return logits;
        memcpy(buf, logits, sizeof *buf * (size_t)n);
    }
    for (int32_t i = 0; i < sp->n_logit_bias; i++) {
        int32_t id = sp->logit_bias[i].id;
        if (id >= 0 && id < n) buf[id] += sp->logit_bias[i].bias;
    }
    if (pen) {
        const float r = sp->repetition_penalty, f = sp->frequency_penalty, p = sp->presence_penalty;
        for (int32_t e = 0; e < s->n_ent; e++) {
            const pen_entry *pe = &s->ent[e];
            float v = buf[pe->id];
            if (r != 1.0f && (pe->in_prompt || pe->n_out > 0)) v = v > 0.0f ? v / r : v * r;
            v -= f * (float)pe->n_out;
            v -= p * (float)(pe->n_out > 0);
            buf[pe->id] = v;
        }
    }
    return buf;
}

/* The kept set with its unnormalised weights w[id] = exp((l[id] - max) / T). Dense form (list == NULL): every id
 * in id order, w[id] = 0 for dropped ids, optional block sums. List form: the kept ids in draw order. */
typedef struct dist {
    int32_t greedy;      /* >= 0: the answer is this id, nothing else is set */
    const float *w;      /* [n] */
    const alias_f64 *bsum;  /* dense form: [ceil(n / EXP_BLOCK)] block sums, or NULL */
    const alias_i32 *list; /* [n_list] or NULL */
    int32_t n_list;
    double total;        /* sum of kept weights, accumulated as the draw accumulates them */
} dist;

/* Orders ids by key descending, ties by id ascending: a total order, so selections are deterministic. */
static inline int key_above(const float *key, int32_t a, int32_t b)
{
    return key[a] > key[b] || (key[a] == key[b] && a < b);
}

static inline void swap_id(alias_i32 *a, alias_i32 *b)
{
    int32_t t = *a;
    *a = *b;
    *b = t;
}

/* Min-heap (root = least by key_above) over ids. */
static void minheap_down(alias_i32 *h, int32_t n, int32_t i, const float *key)
{
    for (;;) {
        int32_t l = 2 * i + 1, m = i;
        if (l < n && key_above(key, h[m], h[l])) m = l;
        if (l + 1 < n && key_above(key, h[m], h[l + 1])) m = l + 1;
        if (m == i) return;
        swap_id(&h[i], &h[m]);
        i = m;
    }
}

static void minheap_up(alias_i32 *h, int32_t i, const float *key)
{
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (!key_above(key, h[p], h[i])) return;
        swap_id(&h[i], &h[p]);
        i = p;
    }
}

/* Sorts ids[0, n) most likely first (heap sort: O(n log n) whatever the input). */
static void sort_ids(alias_i32 *ids, int32_t n, const float *key)
{
    for (int32_t i = n / 2 - 1; i >= 0; i--) minheap_down(ids, n, i, key);
    for (int32_t e = n; e > 1; e--) { /* the least goes last */
        swap_id(&ids[0], &ids[e - 1]);
        minheap_down(ids, e - 1, 0, key);
    }
}

/* Reorders ids[0, c) so that its prefix is the nucleus: the fewest most likely ids (by key_above on w) whose
 * weights reach `need`. Weighted quickselect, O(c) expected; a range that recurses too deep is sorted instead.
 * Returns the prefix length (c when the candidates fall short by rounding). */
static int32_t nucleus_select(alias_i32 *ids, int32_t c, const float *w, double need)
{
    int32_t lo = 0, hi = c; /* ids[0, lo) are in the nucleus; it ends inside ids[lo, hi) */
    double got = 0;
    int depth = 0;
    while (hi - lo > 32 && depth++ < 64) {
        int32_t a = lo, b = lo + (hi - lo) / 2, d = hi - 1; /* median of three as pivot, moved to hi - 1 */
        if (key_above(w, ids[b], ids[a])) swap_id(&ids[a], &ids[b]);
        if (key_above(w, ids[d], ids[b])) swap_id(&ids[b], &ids[d]);
        if (key_above(w, ids[b], ids[a])) swap_id(&ids[a], &ids[b]);
        swap_id(&ids[b], &ids[d]);
        const int32_t pv = ids[d];
        const float wp = w[pv];
        int32_t store = lo;
        double part[4] = {0, 0, 0, 0}; /* four chains: the adds are the loop's critical path */
        for (int32_t i = lo; i < d; i++) { /* branchless Lomuto: [lo, store) above the pivot, [store, i) not */
            int32_t v = ids[i];
            float wv = w[v];
            int up = (wv > wp) | ((wv == wp) & (v < pv));
            ids[i] = ids[store];
            ids[store] = v;
            part[i & 3] += up ? wv : 0.0f;
            store += up;
        }
        double above = (part[0] + part[1]) + (part[2] + part[3]);
        swap_id(&ids[store], &ids[d]);
        if (got + above >= need) {
            hi = store;
        } else if (got + above + w[pv] >= need) {
            return store + 1;
        } else {
            got += above + w[pv];
            lo = store + 1;
        }
    }
    sort_ids(ids + lo, hi - lo, w);
    while (lo < hi && got < need) got += w[ids[lo++]];
    return lo;
}

/* Nucleus search by histogram above this many candidates: buckets are the top 11 bits of a non-negative float
 * (exponent and 3 mantissa bits), which order like the floats themselves. */
#define NUC_RADIX_MIN 1024
#define NUC_BUCKETS 2048u

static inline uint32_t w_bucket(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u >> 20;
}

/* Builds the distribution from patched logits l[n]. Scratch use: w = scratch[0, n) (may alias l: each l[i] is read
 * before w[i] is written), ids or block sums in scratch[n, 2n). */
static void build_dist(const bt_sampling *sp, const float *l, int32_t n, float *scratch, dist *d)
{
    int32_t amax = argmax(l, n);
    memset(d, 0, sizeof *d);
    d->greedy = -1;
    if (sp->temperature < GREEDY_EPS || sp->top_k == 1 || n == 1) {
        d->greedy = amax;
        return;
    }
    const float m = l[amax], inv_t = 1.0f / sp->temperature;
    const float lcut = sp->min_p > 0.0f ? logf(sp->min_p) : -INFINITY; /* kept iff (l - m) / T >= log(min_p) */
    float *w = scratch;
    alias_i32 *ids = (alias_i32 *)(scratch + n);
    d->w = w;

    if (sp->top_k > 0 && sp->top_k < n) {
        /* top-k by a size-k min-heap: one pass, O(n) when most ids lose to the root at once */
        const int32_t k = sp->top_k;
        int32_t c = 0;
        float root = -INFINITY; /* the heap's least logit once it is full: most ids fail this one test */
        for (int32_t i = 0; i < n; i++) {
            const float li = l[i];
            if (c == k && !(li > root)) continue; /* equal keys lose too: i is a higher id than the root */
            if (!((li - m) * inv_t >= lcut)) continue;
            if (c < k) {
                ids[c] = i;
                minheap_up(ids, c++, l);
            } else {
                ids[0] = i;
                minheap_down(ids, c, 0, l);
            }
            if (c == k) root = l[ids[0]];
        }
        for (int32_t e = c; e > 1; e--) { /* heap sort: most likely first */
            swap_id(&ids[0], &ids[e - 1]);
            minheap_down(ids, e - 1, 0, l);
        }
        double total = 0;
        for (int32_t j = 0; j < c; j++) {
            int32_t id = ids[j];
            w[id] = exp_neg((l[id] - m) * inv_t);
            total += w[id];
        }
        int32_t kept = c;
        if (sp->top_p < 1.0f) {
            double target = (double)sp->top_p * total, acc = 0;
            kept = 0;
            while (kept < c && acc < target) acc += w[ids[kept++]];
            total = acc;
        }
        d->list = ids;
        d->n_list = kept;
        d->total = total;
        return;
    }

    if (sp->top_p < 1.0f) {
        /* Candidates are ids with w >= tau. Kept ids below tau weigh < n * tau = (1 - top_p) * total / 2 in all,
         * so the candidates alone pass top_p: the nucleus lies inside them, found by a weighted quickselect. */
        double total = exp_fill(l, n, m, inv_t, lcut, w, NULL);
        const float tau = (float)((1.0 - sp->top_p) * total * 0.5 / n);
        int32_t c = 0;
        for (int32_t i = 0; i < n; i++) {
            ids[c] = i;
            c += w[i] > 0.0f && w[i] >= tau;
        }
        const double need = (double)sp->top_p * total;
        int32_t k;
        if (c > NUC_RADIX_MIN) {
            /* many candidates (a flat distribution): a mass histogram over the weights' top bits finds the bucket
             * where the nucleus ends; ids above it are in, and only that bucket's ids need selecting */
            double mass[NUC_BUCKETS]; /* 16 KiB of stack */
            memset(mass, 0, sizeof mass);
            for (int32_t j = 0; j < c; j++) mass[w_bucket(w[ids[j]])] += w[ids[j]];
            double got = 0;
            uint32_t b = NUC_BUCKETS - 1;
            for (; b > 0 && got + mass[b] < need; b--) got += mass[b];
            int32_t above = 0, at;
            for (int32_t j = 0; j < c; j++) { /* branchless: ids in buckets above b to the front */
                int32_t v = ids[j];
                ids[j] = ids[above];
                ids[above] = v;
                above += w_bucket(w[v]) > b;
            }
            at = above;
            for (int32_t j = above; j < c; j++) { /* then bucket b's */
                int32_t v = ids[j];
                ids[j] = ids[at];
                ids[at] = v;
                at += w_bucket(w[v]) == b;
            }
            k = above + nucleus_select(ids + above, at - above, w, need - got);
        } else {
            k = nucleus_select(ids, c, w, need);
        }
        double kept = 0;
        for (int32_t j = 0; j < k; j++) kept += w[ids[j]];
        d->list = ids;
        d->n_list = k;
        d->total = kept;
        return;
    }

    /* no top-k / top-p: draw in id order over all (min-p: kept) ids, located through block sums */
    alias_f64 *bsum = NULL;
    if (n >= 4 * EXP_BLOCK) /* aligned doubles inside scratch[n, 2n) */
        bsum = (alias_f64 *)(((uintptr_t)(scratch + n) + sizeof(double) - 1) & ~(uintptr_t)(sizeof(double) - 1));
    d->bsum = bsum;
    d->total = exp_fill(l, n, m, inv_t, lcut, w, bsum);
}

static int32_t dist_draw(const dist *d, int32_t n, double u)
{
    if (d->greedy >= 0) return d->greedy;
    double r = u * d->total, acc = 0;
    if (d->list) {
        for (int32_t j = 0; j < d->n_list; j++) {
            acc += d->w[d->list[j]];
            if (r < acc) return d->list[j];
        }
        return d->list[d->n_list - 1]; /* r rounded up to the total */
    }
    int32_t i = 0, end = n, last = -1;
    if (d->bsum) {
        int32_t nb = (n + EXP_BLOCK - 1) / EXP_BLOCK, b = 0;
        for (; b < nb; b++) { /* the block holding r */
            if (r < acc + d->bsum[b]) break;
            acc += d->bsum[b];
        }
        if (b == nb) { /* r rounded up to the total: the last kept id */
            for (b = nb - 1; b > 0 && d->bsum[b] <= 0; b--) {}
            r = INFINITY;
        }
        i = b * EXP_BLOCK;
        end = i + EXP_BLOCK < n ? i + EXP_BLOCK : n;
    }
    for (; i < end; i++) {
        if (d->w[i] == 0.0f) continue;
        acc += d->w[i];
        last = i;
        if (r < acc) return i;
    }
    return last >= 0 ? last : 0;
}

/* log-sum-exp of the raw logits. */
static double raw_lse(const float *x, int32_t n, float *max_out)
{
    float m = x[argmax(x, n)];
    double sum = exp_fill(x, n, m, 1.0f, -INFINITY, NULL, NULL);
    if (max_out) *max_out = m;
    return (double)m + log(sum);
}

float bt_logprob(const float *logits, int32_t n_vocab, int32_t id)
{
    return (float)((double)logits[id] - raw_lse(logits, n_vocab, NULL));
}

/* Chosen token's logprob and rank and the n_top most likely tokens, all from the raw logits. */
static void raw_logprobs(const float *x, int32_t n, int32_t chosen, int32_t n_top, bt_sample_out *out)
{
    const double lse = raw_lse(x, n, NULL);
    const float xc = x[chosen];
    int32_t above = 0, c = 0;
    int32_t heap[BT_MAX_TOP_LOGPROBS];
    for (int32_t i = 0; i < n; i++) {
        above += x[i] > xc || (x[i] == xc && i < chosen);
        if (c < n_top) {
            heap[c] = i;
            minheap_up(heap, c++, x);
        } else if (n_top && x[i] > x[heap[0]]) {
            heap[0] = i;
            minheap_down(heap, c, 0, x);
        }
    }
    for (int32_t e = c; e > 1; e--) {
        swap_id(&heap[0], &heap[e - 1]);
        minheap_down(heap, e - 1, 0, x);
    }
    out->logprob = (float)((double)xc - lse);
    out->rank = above + 1;
    out->n_top = c;
    for (int32_t j = 0; j < c; j++) {
        out->top[j].id = heap[j];
        out->top[j].logprob = (float)((double)x[heap[j]] - lse);
    }
}

static int32_t sample_core(const bt_sampling *sp, const bt_sampler_seq *s, const float *logits, int32_t n,
                           int32_t stream, int64_t position, float *scratch)
{
    const float *l = patch_logits(sp, s, logits, n, scratch);
    dist d;
    build_dist(sp, l, n, scratch, &d);
    if (d.greedy >= 0) return d.greedy;
    return dist_draw(&d, n, bt_rng_uniform_stream(sp->seed, stream, position));
}

int32_t bt_sample(const bt_sampling *sp, const float *logits, int32_t n_vocab, int64_t position, float *scratch,
                  float *logprob)
{
    int32_t id = sample_core(sp, NULL, logits, n_vocab, 0, position, scratch);
    if (logprob) *logprob = bt_logprob(logits, n_vocab, id);
    return id;
}

int32_t bt_sampler_sample(const bt_sampler_seq *s, const float *logits, int64_t position, float *scratch,
                          bt_sample_out *out)
{
    int32_t id = sample_core(&s->sp, s, logits, s->n_vocab, s->index, position, scratch);
    if (out) {
        memset(out, 0, sizeof *out);
        out->id = id;
        if (s->sp.logprobs) {
            /* a constrained sequence reports the masked distribution: scratch is free again after the draw */
            const float *x = s->con && apply_mask(s, logits, scratch) ? scratch : logits;
            raw_logprobs(x, s->n_vocab, id, s->sp.top_logprobs, out);
            while (out->n_top > 0 && out->top[out->n_top - 1].logprob == -INFINITY) out->n_top--;
        }
    }
    return id;
}

void bt_sampler_probs(const bt_sampler_seq *s, const float *logits, float *scratch, float *probs)
{
    const int32_t n = s->n_vocab;
    const float *l = patch_logits(&s->sp, s, logits, n, scratch);
    dist d;
    build_dist(&s->sp, l, n, scratch, &d);
    if (d.greedy >= 0 || d.list) memset(probs, 0, sizeof *probs * (size_t)n);
    if (d.greedy >= 0) {
        probs[d.greedy] = 1.0f;
    } else if (d.list) {
        for (int32_t j = 0; j < d.n_list; j++) probs[d.list[j]] = (float)(d.w[d.list[j]] / d.total);
    } else {
        for (int32_t i = 0; i < n; i++) probs[i] = (float)(d.w[i] / d.total);
    }
}
