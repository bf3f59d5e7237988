/* `baton bench-grammar`: what a grammar constraint costs per decode step (issue 23 item 3). A batch of sequences
 * samples from random logits over the model's real vocabulary, with and without the grammar; the difference per
 * step is the constraint's overhead (mask lookup or computation, masking the row, advancing the recognizer). Masks
 * computed (cache misses) are timed apart from the ones served by the cache. No forward pass runs: compare the
 * per-step overhead with `baton bench`'s decode step at the same batch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/paths.h"
#include "engine/constraint.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "tools/commands.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    while (1) {
        if (n + 4096 > cap) {
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap);
            if (!nb) break;
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        if (!r) break;
        n += r;
    }
    fclose(f);
    *len = n;
    return buf;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: baton bench-grammar --grammar FILE [--model PATH] [--batch N] [--steps N] [--shared]\n"
            "  --grammar FILE  GBNF grammar (e.g. tools/workloads/grammar_person.gbnf)\n"
            "  --model PATH    GGUF whose vocabulary to use (default: $BATON_MODEL or the cached default model)\n"
            "  --batch N       sequences per step (default 16)\n"
            "  --steps N       decode steps (default 400)\n"
            "  --docs FILE     one sample output per line: sequences are teacher-forced through them (the mask is\n"
            "                  still computed and sampled from each step; each document must be a sentence of the\n"
            "                  grammar), so the states visited are those of realistic output; default: random logits\n"
            "  --shared        one constraint (and mask cache) for all sequences, as requests with the same schema\n"
            "                  would share one; default: one per sequence\n");
}

typedef struct seqs {
    bt_sampler_seq **s;
    bt_constraint **c;
    int64_t *pos;
    int32_t *doc; /* document each sequence follows (--docs) */
} seqs;

/* Tokenizes each non-empty line of the file at path. */
static int load_docs(const tok_tokenizer *t, const char *path, tok_ids **out, int *n_out)
{
    size_t len;
    char *text = read_file(path, &len);
    if (!text) return -1;
    int n = 0, cap = 0;
    tok_ids *docs = NULL;
    for (size_t a = 0; a < len;) {
        size_t b = a;
        while (b < len && text[b] != '\n') b++;
        if (b > a) {
            if (n == cap) {
                cap = cap ? cap * 2 : 16;
                tok_ids *nd = realloc(docs, sizeof *nd * (size_t)cap);
                if (!nd) break;
                docs = nd;
            }
            memset(&docs[n], 0, sizeof docs[n]);
            if (tok_encode(t, text + a, b - a, 0, &docs[n])) break;
            n++;
        }
        a = b + 1;
    }
    free(text);
    *out = docs;
    *n_out = n;
    return n ? 0 : -1;
}

int cmd_bench_grammar(int argc, char **argv)
{
    const char *gpath = NULL, *mpath = NULL, *dpath = NULL;
    int batch = 16, steps = 400, shared = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--grammar") && i + 1 < argc) gpath = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) mpath = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--docs") && i + 1 < argc) dpath = argv[++i];
        else if (!strcmp(argv[i], "--shared")) shared = 1;
        else {
            usage();
            return 2;
        }
    }
    if (!gpath || batch < 1 || steps < 1) {
        usage();
        return 2;
    }
    char mbuf[1024];
    if (!mpath) {
        if (bt_default_model_path(mbuf, sizeof mbuf)) {
            fprintf(stderr, "bench-grammar: %s\n", bt_last_error());
            return 1;
        }
        mpath = mbuf;
    }
    size_t glen = 0;
    char *gtext = read_file(gpath, &glen);
    if (!gtext) {
        fprintf(stderr, "bench-grammar: cannot read %s\n", gpath);
        return 1;
    }
    tok_tokenizer *t = NULL;
    bt_constraint_vocab *v = NULL;
    bt_constraint *one = NULL;
    seqs sq = {0};
    bt_sampler_seq **plain = NULL;
    float *logits = NULL, *scratch = NULL;
    tok_ids *docs = NULL;
    int n_docs = 0, next_doc = 0;
    uint64_t bad_docs = 0;
    int rc = 1;
    if (tok_load(mpath, &t)) {
        fprintf(stderr, "bench-grammar: %s\n", bt_last_error());
        free(gtext);
        return 1;
    }
    double t0 = now_s();
    if (bt_constraint_vocab_from_tokenizer(t, &v)) goto out;
    double t_trie = now_s() - t0;
    const int32_t V = tok_n_vocab(t);
    int32_t eos = tok_eos(t);
    printf("vocabulary %d tokens, trie built in %.1f ms\n", V, t_trie * 1e3);

    sq.s = calloc((size_t)batch, sizeof(bt_sampler_seq *));
    sq.c = calloc((size_t)batch, sizeof(bt_constraint *));
    sq.pos = calloc((size_t)batch, sizeof(int64_t));
    sq.doc = calloc((size_t)batch, sizeof(int32_t));
    if (dpath && load_docs(t, dpath, &docs, &n_docs)) {
        fprintf(stderr, "bench-grammar: cannot read documents from %s\n", dpath);
        goto out;
    }
    plain = calloc((size_t)batch, sizeof *plain);
    logits = malloc(sizeof(float) * (size_t)V * (size_t)batch);
    scratch = malloc(sizeof(float) * (size_t)bt_sampler_scratch_floats(V));
    if (!sq.s || !sq.c || !sq.pos || !plain || !logits || !scratch) goto out;
    bt_sampling sp = bt_sampling_default();
    sp.temperature = 1.0f;
    t0 = now_s();
    if (bt_constraint_create(gtext, glen, v, &one)) goto out;
    printf("grammar %s compiled in %.2f ms\n", gpath, (now_s() - t0) * 1e3);

    uint64_t rs = 42;
    double t_plain = 0, t_con = 0, t_miss = 0;
    uint64_t n_miss = 0, n_hit = 0, finished = 0, tokens = 0, bytes = 0;
    for (int b = 0; b < batch; b++) {
        sp.seed = (uint64_t)b;
        if (bt_sampler_seq_create(&sp, V, NULL, 0, &eos, 1, 0, &plain[b])) goto out;
    }
    for (int step = 0; step < steps; step++) {
        for (size_t i = 0; i < (size_t)V * (size_t)batch; i++) /* logits roughly like a model's: a few strong */
            logits[i] = (float)((double)(splitmix(&rs) >> 11) * 0x1p-53 * 8.0 - 4.0);
        double a = now_s();
        for (int b = 0; b < batch; b++) {
            int32_t tok = bt_sampler_sample(plain[b], logits + (size_t)b * (size_t)V, step, scratch, NULL);
            bt_sampler_seq_accept(plain[b], tok, NULL);
        }
        t_plain += now_s() - a;
        for (int b = 0; b < batch; b++) {
            if (!sq.s[b]) {
                sp.seed = 1000 + finished + (uint64_t)b;
                if (!shared && bt_constraint_create(gtext, glen, v, &sq.c[b])) goto out;
                if (shared) sq.c[b] = bt_constraint_ref(one);
                if (bt_sampler_seq_create(&sp, V, NULL, 0, &eos, 1, 0, &sq.s[b]) ||
                    bt_sampler_seq_set_constraint(sq.s[b], sq.c[b]))
                    goto out;
                sq.pos[b] = 0;
                if (docs) sq.doc[b] = next_doc++ % n_docs;
            }
            uint64_t c0, h0, c1, h1;
            bt_constraint_counters(sq.c[b], &c0, &h0);
            a = now_s();
            int32_t tok = bt_sampler_sample(sq.s[b], logits + (size_t)b * (size_t)V, sq.pos[b], scratch, NULL);
            if (docs) {
                const tok_ids *d = &docs[sq.doc[b]];
                tok = sq.pos[b] < (int64_t)d->n ? d->ids[sq.pos[b]] : eos;
            }
            sq.pos[b]++;
            bt_finish f = BT_FINISH_NONE;
            bt_status st = bt_sampler_seq_accept(sq.s[b], tok, &f);
            if (docs && tok == eos && !st && !bt_sampler_seq_constraint_accepting(sq.s[b])) st = BT_ERR_INVALID;
            double dt = now_s() - a;
            t_con += dt;
            bt_constraint_counters(sq.c[b], &c1, &h1);
            if (c1 > c0) {
                n_miss++;
                t_miss += dt;
            } else {
                n_hit++;
            }
            tokens++;
            size_t pl = 0;
            if (tok != eos) tok_token_piece(t, tok, &pl);
            bytes += pl;
            if (st || f != BT_FINISH_NONE || sq.pos[b] >= 512) {
                if (st && bad_docs++ < 3)
                    fprintf(stderr, "bench-grammar: document %d is not a sentence of the grammar (token %lld: %s)\n",
                            docs ? sq.doc[b] : -1, (long long)sq.pos[b] - 1, bt_last_error());
                finished++;
                bt_sampler_seq_free(sq.s[b]);
                bt_constraint_unref(sq.c[b]);
                sq.s[b] = NULL;
                sq.c[b] = NULL;
            }
        }
    }
    printf("batch %d, %d steps, %llu tokens (%.1f bytes each), %llu sequences finished, %s constraint\n", batch,
           steps, (unsigned long long)tokens, tokens ? (double)bytes / (double)tokens : 0.0,
           (unsigned long long)finished, shared ? "one shared" : "one per sequence");
    printf("sampling per step, unconstrained: %.3f ms\n", t_plain / steps * 1e3);
    printf("sampling per step, constrained:   %.3f ms (overhead %.3f ms per step of %d)\n", t_con / steps * 1e3,
           (t_con - t_plain) / steps * 1e3, batch);
    printf("masks computed: %llu (%.1f%% of sampled tokens), %.3f ms each incl. sampling; served from cache: %llu\n",
           (unsigned long long)n_miss, tokens ? 100.0 * (double)n_miss / (double)tokens : 0.0,
           n_miss ? t_miss / (double)n_miss * 1e3 : 0.0, (unsigned long long)n_hit);
    if (bad_docs) printf("%llu documents left the grammar\n", (unsigned long long)bad_docs);
    rc = 0;
out:
    if (rc) fprintf(stderr, "bench-grammar: %s\n", bt_last_error());
    for (int b = 0; sq.s && b < batch; b++) {
        bt_sampler_seq_free(sq.s[b]);
        bt_constraint_unref(sq.c[b]);
        if (plain) bt_sampler_seq_free(plain[b]);
    }
    bt_constraint_unref(one);
    free(sq.s);
    free(sq.c);
    free(sq.pos);
    free(sq.doc);
    for (int i = 0; i < n_docs; i++) tok_ids_free(&docs[i]);
    free(docs);
    free(plain);
    free(logits);
    free(scratch);
    bt_constraint_vocab_free(v);
    tok_free(t);
    free(gtext);
    return rc;
}
