/* Grammar constraints over a tokenizer's vocabulary: which tokens may come next (issue 23 item 3).
 *
 * A bt_constraint_vocab is a trie over every token's bytes (built once per model, immutable, shared). A
 * bt_constraint is one compiled grammar bound to a vocabulary; the recognizer states its sequences reach are
 * interned as small ids, and the allowed-token mask of a state is computed once (a depth-first walk of the trie
 * that steps the recognizer byte by byte and skips every subtree whose prefix is dead) and cached, so repeated
 * states (inside a string, between digits) cost a lookup. Sequences keep only a state id per accepted token, so
 * fork and rollback are copies of ints.
 *
 * End-of-sequence tokens are not in the masks: the sampler allows them when bt_constraint_accepting is true.
 * Control tokens (and tokens with no bytes) are never allowed by bytes.
 * Thread-safety: a bt_constraint is shared by the samples of a request and may be used from any thread (a mutex
 * guards the state table and the cache); the reference count is atomic. */
#ifndef BATON_ENGINE_CONSTRAINT_H
#define BATON_ENGINE_CONSTRAINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"

#define BT_CONSTRAINT_MAX_STATES 200000      /* interned states per constraint */
#define BT_CONSTRAINT_MASK_WORK (1u << 20)   /* recognizer work (expansions, comparisons) one mask may take:
                                              * ~70x what a typical schema's costliest mask takes */
#define BT_CONSTRAINT_CACHE_BYTES (16u << 20) /* masks (and, apart, transition tables) per constraint; emptied past this */

typedef struct bt_constraint_vocab bt_constraint_vocab;
typedef struct bt_constraint bt_constraint;

/* Builds the trie over n_vocab tokens whose bytes are piece[i][len[i]]; tokens with skip[i] != 0 (optional) or no
 * bytes are never allowed. BT_ERR_NOMEM; *out set on success. */
bt_status bt_constraint_vocab_create(int32_t n_vocab, const char *const *piece, const size_t *len,
                                     const uint8_t *skip, bt_constraint_vocab **out);

/* The trie of a tokenizer's vocabulary (decoded pieces; control and unused tokens skipped). BT_ERR_NOMEM. */
bt_status bt_constraint_vocab_from_tokenizer(const tok_tokenizer *t, bt_constraint_vocab **out);

/* NULL is allowed. Every constraint made from v must be freed first. */
void bt_constraint_vocab_free(bt_constraint_vocab *v);

int32_t bt_constraint_vocab_n(const bt_constraint_vocab *v);

/* Compiles grammar text (engine/grammar.h) against v (borrowed: it must outlive the constraint). The reference
 * count starts at 1. BT_ERR_INVALID naming the grammar error (a client's 400), BT_ERR_NOMEM. */
bt_status bt_constraint_create(const char *grammar, size_t len, const bt_constraint_vocab *v, bt_constraint **out);

/* Takes a reference (returns c). */
bt_constraint *bt_constraint_ref(bt_constraint *c);

/* Drops a reference; the last one frees c. NULL is allowed. */
void bt_constraint_unref(bt_constraint *c);

int32_t bt_constraint_n_vocab(const bt_constraint *c);

/* The state before any token: always 0. */
static inline int32_t bt_constraint_start(void) { return 0; }

/* The tokens allowed in `state`, as bits (token i = bit i % 64 of word i / 64, ceil(n_vocab / 64) words), written
 * into out_words. BT_ERR_EXHAUSTED when computing it took more than BT_CONSTRAINT_MASK_WORK (a grammar so ambiguous
 * that a user could stall the engine with it; logged), BT_ERR_NOMEM: out_words then allows nothing. */
bt_status bt_constraint_mask(bt_constraint *c, int32_t state, uint64_t *out_words);

/* The state after `token` from `state`. BT_ERR_INVALID when the grammar does not allow the token there,
 * BT_ERR_EXHAUSTED past BT_CONSTRAINT_MAX_STATES, BT_ERR_NOMEM. */
bt_status bt_constraint_next(bt_constraint *c, int32_t state, int32_t token, int32_t *out);

/* Whether the bytes so far form a sentence of the grammar. */
int bt_constraint_accepting(bt_constraint *c, int32_t state);

/* Whether no byte can follow (accepting or a dead end after a limit dropped paths). */
int bt_constraint_final(bt_constraint *c, int32_t state);

/* Counters for benchmarks: masks computed (cache misses) and served from the cache. */
void bt_constraint_counters(bt_constraint *c, uint64_t *computed, uint64_t *cached);

/* ---- compiled constraints shared by grammar text (a node keeps one: requests with the same schema then share
 * states and masks, so a mask is computed once per state for all of them) ---- */

typedef struct bt_constraint_cache bt_constraint_cache;

/* An LRU of at most `capacity` compiled constraints over v (borrowed). BT_ERR_NOMEM. */
bt_status bt_constraint_cache_create(const bt_constraint_vocab *v, int capacity, bt_constraint_cache **out);

/* Drops the cache's references (constraints still held by requests live on). NULL is allowed. */
void bt_constraint_cache_free(bt_constraint_cache *cc);

/* A new reference to the constraint of grammar[len] (compiled on first use). Errors as bt_constraint_create.
 * Thread-safe; compiles under the cache's lock (grammars compile in well under a millisecond). */
bt_status bt_constraint_cache_get(bt_constraint_cache *cc, const char *grammar, size_t len, bt_constraint **out);

#endif
