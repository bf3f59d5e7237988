/* Constraint tests (engine/constraint.c and the sampler's use of it): masks against a brute-force check of every
 * token from random reachable states, cache hits, constrained sampling whose outputs always parse, masked logprobs,
 * EOS only where the grammar accepts, finish when nothing may follow, fork and rollback. */
#include "engine/constraint.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"
#include "test_util.h"

static const char *PIECES[] = {
    "<eos>", "{", "}", "\"", "a", "ab", "b", ":", ",", " ", "1", "12", "{\"", "\":", "a\"", "\"}", "}}", "x", "\n",
    "\xc3", "\xa9", "\xc3\xa9", "é\"", "[", "]", "true", "tr", "ue", "null", " \"", "2", "-", "0", "00", "", "{\"a\":",
};
#define NV ((int32_t)(sizeof PIECES / sizeof *PIECES))
#define EOS 0

static const char *JSONISH =
    "root ::= \"{\" ws ( pair (\",\" ws pair)* )? \"}\"\n"
    "pair ::= str \":\" ws val ws\n"
    "val  ::= str | num | \"true\" | \"null\" | \"[\" ws (val (\",\" ws val)*)? \"]\" | root\n"
    "str  ::= \"\\\"\" [^\"\\\\]* \"\\\"\"\n"
    "num  ::= \"-\"? ([1-9] [0-9]{0,3} | \"0\")\n"
    "ws   ::= \" \"?\n";

static uint64_t rng = 0xC0115EEDull;

static bt_constraint_vocab *mkvocab(void)
{
    size_t len[NV];
    uint8_t skip[NV] = {0};
    for (int32_t i = 0; i < NV; i++) len[i] = strlen(PIECES[i]);
    skip[EOS] = 1;
    bt_constraint_vocab *v = NULL;
    if (bt_constraint_vocab_create(NV, PIECES, len, skip, &v) != BT_OK) {
        fprintf(stderr, "vocab: %s\n", bt_last_error());
        exit(1);
    }
    return v;
}

static int allowed_brute(const bt_grammar *g, const bt_gstate *st, int32_t tok)
{
    if (tok == EOS || !*PIECES[tok]) return 0;
    bt_gstate a = {0}, tmp = {0};
    bt_gstate_copy(&a, st);
    int r = bt_grammar_advance(g, &a, (const uint8_t *)PIECES[tok], strlen(PIECES[tok]), &tmp);
    bt_gstate_free(&a);
    bt_gstate_free(&tmp);
    return r == 1;
}

static void test_mask_vs_brute(void)
{
    bt_constraint_vocab *v = mkvocab();
    bt_constraint *c = NULL;
    REQUIRE(bt_constraint_create(JSONISH, strlen(JSONISH), v, &c) == BT_OK);
    bt_grammar *g = NULL;
    REQUIRE(bt_grammar_parse(JSONISH, strlen(JSONISH), &g) == BT_OK);
    uint64_t m[(NV + 63) / 64];
    for (int walk = 0; walk < 200; walk++) {
        int32_t state = bt_constraint_start();
        bt_gstate ref = {0}, tmp = {0};
        REQUIRE(bt_grammar_start(g, &ref) == BT_OK);
        for (int step = 0; step < 30; step++) {
            REQUIRE(bt_constraint_mask(c, state, m) == BT_OK);
            int32_t ok[NV], n_ok = 0;
            for (int32_t t = 0; t < NV; t++) {
                int in = (int)((m[t >> 6] >> (t & 63)) & 1);
                int want = allowed_brute(g, &ref, t);
                CHECK_MSG(in == want, "walk %d step %d token %d ('%s'): mask %d, brute force %d", walk, step, t,
                          PIECES[t], in, want);
                if (in) ok[n_ok++] = t;
            }
            CHECK(bt_constraint_accepting(c, state) == ref.accepting);
            if (!n_ok) break;
            int32_t t = ok[test_rand_next(&rng) % (uint64_t)n_ok];
            int32_t next;
            REQUIRE(bt_constraint_next(c, state, t, &next) == BT_OK);
            REQUIRE(bt_grammar_advance(g, &ref, (const uint8_t *)PIECES[t], strlen(PIECES[t]), &tmp) == 1);
            state = next;
        }
        bt_gstate_free(&ref);
        bt_gstate_free(&tmp);
    }
    int32_t dummy;
    CHECK(bt_constraint_next(c, bt_constraint_start(), 2, &dummy) == BT_ERR_INVALID); /* "}" first */
    uint64_t computed, cached;
    bt_constraint_counters(c, &computed, &cached);
    CHECK(cached > computed); /* states repeat */
    printf("    masks computed %llu, from the cache %llu\n", (unsigned long long)computed, (unsigned long long)cached);
    bt_grammar_free(g);
    bt_constraint_unref(c);
    bt_constraint_vocab_free(v);
}

static void fill_logits(float *l)
{
    for (int32_t i = 0; i < NV; i++) l[i] = (float)((double)(test_rand_next(&rng) >> 11) * 0x1p-53 * 6.0 - 3.0);
}

/* Generates with the sampler until it finishes; returns the text and whether it finished by stop. */
static int generate(bt_sampler_seq *s, char *text, size_t cap, int *n_tokens)
{
    float l[NV], scratch[2 * NV];
    size_t n = 0;
    text[0] = 0;
    for (int i = 0; i < 200; i++) {
        fill_logits(l);
        bt_sample_out out;
        int32_t t = bt_sampler_sample(s, l, 10 + i, scratch, &out);
        bt_finish f;
        if (bt_sampler_seq_accept(s, t, &f) != BT_OK) return -1;
        if (t != EOS) {
            size_t k = strlen(PIECES[t]);
            if (n + k + 1 > cap) return -1;
            memcpy(text + n, PIECES[t], k);
            text[n += k] = 0;
        }
        *n_tokens = i + 1;
        if (f == BT_FINISH_STOP) return 1;
        if (f == BT_FINISH_LENGTH) return 0;
    }
    return 0;
}

static int parses(const char *grammar, const char *text)
{
    bt_grammar *g = NULL;
    if (bt_grammar_parse(grammar, strlen(grammar), &g)) return 0;
    bt_gstate a = {0}, tmp = {0};
    bt_grammar_start(g, &a);
    int r = bt_grammar_advance(g, &a, (const uint8_t *)text, strlen(text), &tmp) == 1 && a.accepting;
    bt_gstate_free(&a);
    bt_gstate_free(&tmp);
    bt_grammar_free(g);
    return r;
}

static void test_sampling_parses(void)
{
    bt_constraint_vocab *v = mkvocab();
    bt_constraint *c = NULL;
    REQUIRE(bt_constraint_create(JSONISH, strlen(JSONISH), v, &c) == BT_OK);
    int32_t eos = EOS;
    int stopped = 0;
    for (int k = 0; k < 100; k++) {
        bt_sampling sp = bt_sampling_default();
        sp.temperature = 1.0f;
        sp.seed = (uint64_t)k;
        sp.max_tokens = 150;
        sp.logprobs = true;
        sp.top_logprobs = 5;
        bt_sampler_seq *s = NULL;
        REQUIRE(bt_sampler_seq_create(&sp, NV, NULL, 0, &eos, 1, 0, &s) == BT_OK);
        REQUIRE(bt_sampler_seq_set_constraint(s, c) == BT_OK);
        CHECK(bt_sampler_seq_set_constraint(s, c) == BT_ERR_INVALID);
        char text[4096];
        int n_tok = 0;
        int r = generate(s, text, sizeof text, &n_tok);
        CHECK(r >= 0);
        if (r == 1) {
            stopped++;
            CHECK_MSG(parses(JSONISH, text), "output does not parse: '%s'", text);
        }
        bt_sampler_seq_free(s);
    }
    CHECK(stopped > 50);
    printf("    %d of 100 finished by stop, all parse\n", stopped);
    bt_constraint_unref(c);
    bt_constraint_vocab_free(v);
}

static void test_logprobs_and_eos(void)
{
    bt_constraint_vocab *v = mkvocab();
    const char *gr = "root ::= \"ab\" | \"a\"";
    bt_constraint *c = NULL;
    REQUIRE(bt_constraint_create(gr, strlen(gr), v, &c) == BT_OK);
    int32_t eos = EOS;
    bt_sampling sp = bt_sampling_default();
    sp.logprobs = true;
    sp.top_logprobs = 5;
    bt_sampler_seq *s = NULL;
    REQUIRE(bt_sampler_seq_create(&sp, NV, NULL, 0, &eos, 1, 0, &s) == BT_OK);
    REQUIRE(bt_sampler_seq_set_constraint(s, c) == BT_OK);
    float l[NV], scratch[2 * NV], probs[NV];
    for (int32_t i = 0; i < NV; i++) l[i] = 0.0f;
    l[EOS] = 10.0f; /* the model wants to stop, the grammar does not allow it yet */
    bt_sample_out out;
    int32_t t = bt_sampler_sample(s, l, 0, scratch, &out);
    CHECK(t == 4 || t == 5); /* "a" or "ab": equal logits, lowest id */
    CHECK(t == 4);
    CHECK(out.n_top == 2);
    CHECK(fabsf(out.logprob - logf(0.5f)) < 1e-5f);
    bt_sampler_probs(s, l, scratch, probs);
    CHECK(probs[4] == 1.0f && probs[EOS] == 0.0f);
    bt_finish f;
    REQUIRE(bt_sampler_seq_accept(s, t, &f) == BT_OK);
    CHECK(f == BT_FINISH_NONE && bt_sampler_seq_constraint_accepting(s));
    t = bt_sampler_sample(s, l, 1, scratch, &out); /* "a" accepted: EOS allowed now, and "b" */
    CHECK(t == EOS);
    CHECK(out.n_top == 2);
    bt_sampler_seq *fk = NULL;
    REQUIRE(bt_sampler_seq_fork(s, 0, &fk) == BT_OK);
    REQUIRE(bt_sampler_seq_accept(fk, 6, &f) == BT_OK); /* "b": "ab" can go no further: stop */
    CHECK(f == BT_FINISH_STOP);
    CHECK(bt_sampler_seq_accept(s, 2, &f) == BT_ERR_INVALID); /* "}" is not allowed */
    REQUIRE(bt_sampler_seq_rollback(s, 1) == BT_OK);
    t = bt_sampler_sample(s, l, 0, scratch, &out);
    CHECK(t == 4); /* back at the start: EOS forbidden again */
    bt_sampler_seq_free(fk);
    bt_sampler_seq_free(s);
    bt_constraint_unref(c);
    bt_constraint_vocab_free(v);
}

static void test_errors(void)
{
    bt_constraint_vocab *v = mkvocab();
    bt_constraint *c = NULL;
    CHECK(bt_constraint_create("root ::= x", 10, v, &c) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "never defined") != NULL);
    bt_constraint_vocab_free(v);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    RUN(test_mask_vs_brute);
    RUN(test_sampling_parses);
    RUN(test_logprobs_and_eos);
    RUN(test_errors);
    return test_summary();
}
