/* What the router's grammar tests share: whether a grammar (engine/grammar.h) accepts a whole document. */
#ifndef BATON_TESTS_ROUTER_GRAMMAR_ACCEPTS_H
#define BATON_TESTS_ROUTER_GRAMMAR_ACCEPTS_H

#include <stdint.h>
#include <string.h>

#include "engine/grammar.h"

/* 1 when g accepts doc as a complete sentence; 0 when it rejects it, stops short, or the state cannot be made. */
static inline int grammar_accepts(const bt_grammar *g, const char *doc)
{
    bt_gstate a = {0}, tmp = {0};
    if (bt_grammar_start(g, &a)) return 0;
    int r = bt_grammar_advance(g, &a, (const uint8_t *)doc, strlen(doc), &tmp) == 1 && a.accepting;
    bt_gstate_free(&a);
    bt_gstate_free(&tmp);
    return r;
}

#endif
