/* Helper for tests/integration/test_json_schema_corpus.py: compiles each schema of a corpus (a JSON array of
 * {"name", "schema"}) with router/json_schema.c, then writes N outputs per schema drawn token by token over a real
 * tokenizer's vocabulary through the engine's constraint (engine/constraint.h): random choices among the allowed
 * tokens, closing characters favoured after a while so outputs end. One JSON line per schema:
 * {"name", "outputs": [...], "unfinished": k} or {"name", "error", "status"}.
 * usage: schema_gen_tool MODEL.gguf CORPUS.json N [SEED] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/constraint.h"
#include "engine/tokenizer.h"
#include "router/json_schema.h"

static uint64_t next_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double urand(uint64_t *s) { return (double)(next_rand(s) >> 11) * 0x1p-53; }

/* One output: 1 finished (accepting), 0 ran out of steps, -1 error. */
static int draw(bt_constraint *c, const tok_tokenizer *t, uint64_t *rs, char *out, size_t cap, double *w,
                uint64_t *mask)
{
    int32_t V = tok_n_vocab(t), state = bt_constraint_start();
    size_t n = 0;
    out[0] = 0;
    for (int step = 0; step < 600; step++) {
        if (bt_constraint_mask(c, state, mask)) return -1;
        int acc = bt_constraint_accepting(c, state);
        double total = 0;
        for (int32_t i = 0; i < V; i++) {
            w[i] = 0;
            if (!((mask[i >> 6] >> (i & 63)) & 1)) continue;
            size_t len;
            const char *p = tok_token_piece(t, i, &len);
            double x = urand(rs);
            if (step > 6 && (memchr(p, '"', len) || memchr(p, '}', len) || memchr(p, ']', len))) x *= 200.0;
            w[i] = x;
            total += x;
        }
        if (acc && (total == 0 || urand(rs) < 0.5)) return 1;
        if (total == 0) return -1;
        double u = urand(rs) * total;
        int32_t pick = -1;
        for (int32_t i = 0; i < V; i++)
            if (w[i] > 0) {
                pick = i;
                if ((u -= w[i]) <= 0) break;
            }
        size_t len;
        const char *p = tok_token_piece(t, pick, &len);
        if (n + len + 1 > cap) return 0;
        memcpy(out + n, p, len);
        out[n += len] = 0;
        if (bt_constraint_next(c, state, pick, &state)) return -1;
    }
    return bt_constraint_accepting(c, state) ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf CORPUS.json N [SEED]\n", argv[0]);
        return 2;
    }
    int n_out = atoi(argv[3]);
    uint64_t rs = argc > 4 ? strtoull(argv[4], NULL, 10) : 1;
    tok_tokenizer *t = NULL;
    bt_constraint_vocab *v = NULL;
    if (tok_load(argv[1], &t) || bt_constraint_vocab_from_tokenizer(t, &v)) {
        fprintf(stderr, "%s\n", bt_last_error());
        return 1;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) return 1;
    static char text[1 << 20];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    cJSON *corpus = cJSON_Parse(text);
    if (!cJSON_IsArray(corpus)) return 1;
    int32_t V = tok_n_vocab(t);
    double *w = malloc(sizeof *w * (size_t)V);
    uint64_t *mask = malloc(sizeof *mask * (((size_t)V + 63) / 64));
    static char out[65536];
    for (const cJSON *e = corpus->child; e; e = e->next) {
        const cJSON *name = cJSON_GetObjectItem(e, "name"), *schema = cJSON_GetObjectItem(e, "schema");
        cJSON *line = cJSON_CreateObject();
        cJSON_AddStringToObject(line, "name", cJSON_IsString(name) ? name->valuestring : "?");
        char *grammar = NULL;
        bt_constraint *c = NULL;
        bt_status st = rtr_json_schema_grammar(schema, &grammar);
        if (!st) st = bt_constraint_create(grammar, strlen(grammar), v, &c);
        if (st) {
            cJSON_AddStringToObject(line, "error", bt_last_error());
            cJSON_AddStringToObject(line, "status", bt_status_str(st));
        } else {
            cJSON *outs = cJSON_AddArrayToObject(line, "outputs");
            int unfinished = 0, errors = 0;
            for (int k = 0; k < n_out; k++) {
                int r = draw(c, t, &rs, out, sizeof out, w, mask);
                if (r == 1) cJSON_AddItemToArray(outs, cJSON_CreateString(out));
                else if (r == 0) unfinished++;
                else errors++;
            }
            cJSON_AddNumberToObject(line, "unfinished", unfinished);
            cJSON_AddNumberToObject(line, "errors", errors);
        }
        char *s = cJSON_PrintUnformatted(line);
        printf("%s\n", s);
        fflush(stdout);
        free(s);
        cJSON_Delete(line);
        free(grammar);
        bt_constraint_unref(c);
    }
    cJSON_Delete(corpus);
    free(w);
    free(mask);
    bt_constraint_vocab_free(v);
    tok_free(t);
    return 0;
}
