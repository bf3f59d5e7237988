/* Grammars come from users (issue 23): arbitrary grammar text must parse or fail cleanly, and a grammar that
 * parses must match any bytes within its limits. Input: grammar text, a 0 byte, then the bytes to match; the
 * matcher also runs through the constraint layer over a small vocabulary, and each allowed token must advance. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/constraint.h"
#include "engine/grammar.h"

static const char *const PIECES[] = {"a", "b", "{", "}", "\"", " ", "ab", "1", "\xc3\xa9", "\xc3", "\xa9", "x\"", ",",
                                     "\n", "true", "[", "]"};
#define NP ((int32_t)(sizeof PIECES / sizeof *PIECES))

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *zero = memchr(data, 0, size);
    size_t glen = zero ? (size_t)(zero - data) : size;
    const uint8_t *in = zero ? zero + 1 : data + size;
    size_t n_in = size - glen - (zero ? 1 : 0);
    if (n_in > 256) n_in = 256;
    bt_grammar *g = NULL;
    if (bt_grammar_parse((const char *)data, glen, &g)) return 0;
    bt_gstate a = {0}, b = {0};
    if (!bt_grammar_start(g, &a)) {
        for (size_t i = 0; i < n_in; i++) {
            if (bt_grammar_step(g, &a, in[i], &b) != 1) break;
            bt_gstate t = a;
            a = b;
            b = t;
        }
        bt_gstate_canon(&a);
    }
    bt_gstate_free(&a);
    bt_gstate_free(&b);
    bt_grammar_free(g);

    size_t len[NP];
    for (int32_t i = 0; i < NP; i++) len[i] = strlen(PIECES[i]);
    bt_constraint_vocab *v = NULL;
    bt_constraint *c = NULL;
    if (bt_constraint_vocab_create(NP, PIECES, len, NULL, &v)) return 0;
    if (!bt_constraint_create((const char *)data, glen, v, &c)) {
        int32_t state = bt_constraint_start();
        uint64_t m[1];
        for (size_t i = 0; i < n_in && i < 32; i++) {
            if (bt_constraint_mask(c, state, m)) break;
            int32_t pick = -1, k = in[i] % NP;
            for (int32_t j = 0; j < NP && pick < 0; j++)
                if ((m[0] >> ((k + j) % NP)) & 1) pick = (k + j) % NP;
            if (pick < 0) break;
            if (bt_constraint_next(c, state, pick, &state)) abort(); /* the mask allowed it */
        }
        bt_constraint_unref(c);
    }
    bt_constraint_vocab_free(v);
    return 0;
}
