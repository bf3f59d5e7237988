/* GBNF-style grammars and a byte-level recognizer for constrained decoding (DESIGN 4.4, issue 23 item 3).
 *
 * Syntax (llama.cpp's GBNF, which users already write):
 *   root  ::= "{" ws pair ("," ws pair)* "}"      # a rule; `root` is where matching starts
 *   pair  ::= [a-z]+ ":" [^"\\\x00-\x1f]* | "null"  # alternatives, sequences, literals, char classes
 *   ws    ::= ([ \t\n] ws)?                         # grouping, * + ? and {m} {m,} {m,n}, . (any character)
 * A rule runs until the next `name ::=`, so rules may span lines. Literals and classes take \n \r \t \\ \" \[
 * \] \- \^ \xHH \uHHHH \UHHHHHHHH escapes; classes and `.` are over Unicode code points and match their UTF-8
 * bytes (surrogates excluded); `#` starts a comment. Rule names: [A-Za-z0-9_-]+.
 *
 * Matching: a set of parse stacks (a nondeterministic pushdown recognizer) advanced one byte at a time, so UTF-8
 * needs no special handling and tokens may split characters. Grammars come from users, so: left recursion (direct
 * or through nullable rules) is rejected at parse time naming the rule; at run time a stack deeper than
 * BT_GRAMMAR_MAX_DEPTH frames or a set of more than BT_GRAMMAR_MAX_STACKS stacks drops the paths that exceed it
 * (the recognizer then accepts a subset of the language, never a superset) and sets bt_gstate.overflow; so does a
 * step that needs more than BT_GRAMMAR_MAX_EXPAND rule expansions (very ambiguous grammars).
 * Thread-safety: a bt_grammar is immutable after parsing and may be shared by any threads; a bt_gstate belongs to
 * one thread at a time. */
#ifndef BATON_ENGINE_GRAMMAR_H
#define BATON_ENGINE_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define BT_GRAMMAR_MAX_TEXT (1u << 20)    /* bytes of grammar text */
#define BT_GRAMMAR_MAX_ELEMS (1u << 20)   /* compiled elements (repetitions expand) */
#define BT_GRAMMAR_MAX_RULES 65536
#define BT_GRAMMAR_MAX_REPEAT 10000       /* m and n of {m,n} */
#define BT_GRAMMAR_MAX_NEST 128           /* nesting of parentheses */
#define BT_GRAMMAR_MAX_DEPTH 512          /* frames in one parse stack */
#define BT_GRAMMAR_MAX_STACKS 128         /* parse stacks alive at once */
#define BT_GRAMMAR_MAX_EXPAND (1u << 14)  /* rule expansions in one step */

typedef struct bt_grammar bt_grammar;

/* A recognizer state: the set of parse stacks after the bytes seen so far. Zero-initialise, then fill with
 * bt_grammar_start / bt_grammar_step / bt_gstate_copy; free with bt_gstate_free. */
typedef struct bt_gstate {
    uint32_t *w;       /* [n] the stacks, each as its frame count then its frames bottom to top */
    uint32_t n, cap;
    uint32_t n_stacks;
    int accepting;     /* an empty stack is in the set: the bytes so far are a sentence of the grammar */
    int overflow;      /* a path was dropped for exceeding a limit (see above) */
    uint64_t next[4];  /* bytes some stack can consume next (bit b of next[b / 64]) */
    uint32_t *work;    /* expansion scratch */
    uint32_t n_work, cap_work;
    uint32_t *cur;     /* the stack being expanded */
    uint32_t cap_cur;
    uint64_t cost;     /* expansions and stack comparisons of the step that made this state */
} bt_gstate;

/* Parses and compiles grammar text (len bytes, no NUL needed). BT_ERR_INVALID with "grammar: line L col C: ..."
 * for syntax errors, undefined rules, a missing root, left recursion or a limit exceeded; BT_ERR_NOMEM.
 * *out set on success; free with bt_grammar_free. */
bt_status bt_grammar_parse(const char *text, size_t len, bt_grammar **out);

/* NULL is allowed. */
void bt_grammar_free(bt_grammar *g);

/* Rules after compilation (anonymous ones for groups, repetitions and classes included). */
int32_t bt_grammar_n_rules(const bt_grammar *g);

/* dst = the state before any byte. BT_ERR_NOMEM. */
bt_status bt_grammar_start(const bt_grammar *g, bt_gstate *dst);

/* dst = src advanced by one byte (dst != src). Returns 1 when some stack survived, 0 when the byte is rejected
 * (dst then holds no stack), BT_ERR_NOMEM. */
int bt_grammar_step(const bt_grammar *g, const bt_gstate *src, uint8_t byte, bt_gstate *dst);

/* Advances st in place by bytes[n] (tmp is scratch). 1 when all were accepted, 0 when one was rejected (st is then
 * unchanged), BT_ERR_NOMEM. */
int bt_grammar_advance(const bt_grammar *g, bt_gstate *st, const uint8_t *bytes, size_t n, bt_gstate *tmp);

/* Puts st's stacks in a canonical order, so two states with the same set have the same words w[0..n). */
bt_status bt_gstate_canon(bt_gstate *st);

/* dst = src (stacks and flags, not scratch). BT_ERR_NOMEM. */
bt_status bt_gstate_copy(bt_gstate *dst, const bt_gstate *src);

/* dst = the state whose canonical words are w[n] (from another state's w after bt_gstate_canon). BT_ERR_NOMEM. */
bt_status bt_gstate_load(const bt_grammar *g, bt_gstate *dst, const uint32_t *w, uint32_t n);

/* Releases st's memory and zeroes it. */
void bt_gstate_free(bt_gstate *st);

/* Whether some stack can consume byte b next. */
static inline int bt_gstate_can(const bt_gstate *st, uint8_t b) { return (int)((st->next[b >> 6] >> (b & 63)) & 1); }

/* Whether any byte can follow. */
static inline int bt_gstate_has_next(const bt_gstate *st)
{
    return (st->next[0] | st->next[1] | st->next[2] | st->next[3]) != 0;
}

#endif
