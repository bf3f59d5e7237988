#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bt_sampling bt_sampling_default(void)
{
    bt_sampling s = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 0};
    return s;
}

bt_status bt_sampling_check(const bt_sampling *sp)
{
    if (!(sp->temperature >= 0.0f) || sp->temperature > 100.0f)
        return bt_fail(BT_ERR_INVALID, "temperature must be between 0 and 100");
    if (sp->top_k < 0) return bt_fail(BT_ERR_INVALID, "top_k must be >= 0");
    if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f)) return bt_fail(BT_ERR_INVALID, "top_p must be in (0, 1]");
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f)) return bt_fail(BT_ERR_INVALID, "min_p must be in [0, 1]");
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

static int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

float bt_logprob(const float *logits, int32_t n_vocab, int32_t id)
{
    float mx = logits[argmax(logits, n_vocab)];
    double sum = 0;
    for (int32_t i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - mx);
    return (float)((double)logits[id] - mx - log(sum));
}

/* Candidates sorted by logit descending, ties by id ascending (a total order: deterministic). */
typedef struct cand {
    float logit;
    int32_t id;
} cand;

static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t bt_sample(const bt_sampling *sp, const float *logits, int32_t n_vocab, int64_t position, float *scratch,
                  float *logprob)
{
    int32_t id;
    if (sp->temperature <= 0.0f) {
        id = argmax(logits, n_vocab);
    } else if (sp->top_k == 0 && sp->top_p >= 1.0f && sp->min_p <= 0.0f) {
        /* no truncation: sample the full distribution in id order, no sort needed */
        float inv_t = 1.0f / sp->temperature;
        double mx = (double)logits[argmax(logits, n_vocab)] * inv_t, total = 0;
        for (int32_t i = 0; i < n_vocab; i++) {
            scratch[i] = (float)exp((double)logits[i] * inv_t - mx);
            total += scratch[i];
        }
        double r = bt_rng_uniform(sp->seed, position) * total, acc = 0;
        id = n_vocab - 1;
        for (int32_t i = 0; i < n_vocab; i++) {
            acc += scratch[i];
            if (r < acc) {
                id = i;
                break;
            }
        }
    } else {
        cand *c = (cand *)scratch; /* 2 * n_vocab floats hold n_vocab (float, int32) pairs */
        for (int32_t i = 0; i < n_vocab; i++) {
            c[i].logit = logits[i] / sp->temperature;
            c[i].id = i;
        }
        int32_t n = n_vocab;
        qsort(c, (size_t)n, sizeof *c, cand_cmp);
        if (sp->top_k > 0 && sp->top_k < n) n = sp->top_k;
        double mx = c[0].logit, total = 0;
        for (int32_t i = 0; i < n; i++) total += exp((double)c[i].logit - mx);
        if (sp->min_p > 0.0f) {
            /* keep tokens whose probability is at least min_p times the top token's */
            double cut = log((double)sp->min_p);
            int32_t k = 1;
            while (k < n && (double)c[k].logit - mx >= cut) k++;
            n = k;
        }
        if (sp->top_p < 1.0f) {
            double acc = 0;
            int32_t k = 0;
            while (k < n) {
                acc += exp((double)c[k].logit - mx) / total;
                k++;
                if (acc >= sp->top_p) break;
            }
            n = k;
        }
        double kept = 0;
        for (int32_t i = 0; i < n; i++) kept += exp((double)c[i].logit - mx);
        double r = bt_rng_uniform(sp->seed, position) * kept, acc = 0;
        id = c[n - 1].id;
        for (int32_t i = 0; i < n; i++) {
            acc += exp((double)c[i].logit - mx);
            if (r < acc) {
                id = c[i].id;
                break;
            }
        }
    }
    if (logprob) *logprob = bt_logprob(logits, n_vocab, id);
    return id;
}
