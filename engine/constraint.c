#include "engine/constraint.h"

#include "common/log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Trie nodes in depth-first preorder: node i's subtree is [i, end), so a dead prefix is skipped with i = end and
 * the walk needs no child lists. Node 0 is the root (the empty prefix). */
typedef struct tnode {
    uint8_t byte;
    uint16_t depth;   /* bytes from the root */
    uint32_t end;     /* one past the last node of the subtree */
    uint32_t tok_lo, tok_hi; /* tokens whose bytes end here: ids[tok_lo .. tok_hi) */
} tnode;

struct bt_constraint_vocab {
    int32_t n_vocab;
    tnode *nodes;
    uint32_t n_nodes;
    int32_t *ids;       /* token ids in byte order */
    uint16_t max_depth;
    char **piece;       /* [n_vocab] copies of the bytes (NULL for skipped tokens) */
    uint32_t *len;
};

typedef struct cstate {
    uint32_t off, n;    /* canonical words in c->words */
    uint64_t hash;
    uint8_t accepting, final;
    uint64_t next[4];   /* bytes some stack can take */
    int32_t *trans;     /* [256] state after each byte: -1 dead, -2 not computed yet; NULL until first needed */
    uint64_t *mask;     /* cached, or NULL */
} cstate;

#define T_DEAD (-1)
#define T_UNKNOWN (-2)

struct bt_constraint {
    atomic_int refs;
    const bt_constraint_vocab *v;
    bt_grammar *g;
    pthread_mutex_t mu;
    cstate *st;         /* [n_st] interned states; state 0 is the start */
    uint32_t n_st, cap_st;
    uint32_t *words;    /* canonical stacks of every state */
    uint64_t n_words, cap_words;
    int32_t *slot;      /* [n_slot] open addressing into st, -1 empty */
    uint32_t n_slot;
    size_t cache_bytes;
    size_t trans_bytes; /* transition tables allocated; past BT_CONSTRAINT_CACHE_BYTES new states step uncached */
    uint64_t computed, cached;
    uint64_t work;      /* recognizer work since the current mask computation began */
    int32_t *walk;      /* [max_depth + 1] the state id at each trie depth of the walk */
    bt_gstate tmp, cur;
};

/* ---- vocabulary trie ---- */

typedef struct sort_ent {
    const char *p;
    uint32_t len;
    int32_t id;
} sort_ent;

/* Bytes order, a prefix before its extensions, equal pieces by id. */
static int piece_cmp(const void *a, const void *b)
{
    const sort_ent *x = a, *y = b;
    int c = memcmp(x->p, y->p, x->len < y->len ? x->len : y->len);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void bt_constraint_vocab_free(bt_constraint_vocab *v)
{
    if (!v) return;
    if (v->piece)
        for (int32_t i = 0; i < v->n_vocab; i++) free(v->piece[i]);
    free(v->piece);
    free(v->len);
    free(v->nodes);
    free(v->ids);
    free(v);
}

bt_status bt_constraint_vocab_create(int32_t n_vocab, const char *const *piece, const size_t *len,
                                     const uint8_t *skip, bt_constraint_vocab **out)
{
    if (n_vocab < 1) return bt_fail(BT_ERR_INVALID, "constraint: vocabulary of %d tokens", (int)n_vocab);
    bt_constraint_vocab *v = calloc(1, sizeof *v);
    if (!v) return bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
    v->n_vocab = n_vocab;
    v->piece = calloc((size_t)n_vocab, sizeof *v->piece);
    v->len = calloc((size_t)n_vocab, sizeof *v->len);
    v->ids = malloc(sizeof *v->ids * (size_t)n_vocab);
    uint64_t total = 1;
    if (!v->piece || !v->len || !v->ids) goto nomem;
    int32_t n_ids = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if ((skip && skip[i]) || !piece[i] || !len[i] || len[i] > 1024) continue; /* longer: never allowed */
        v->piece[i] = malloc(len[i]);
        if (!v->piece[i]) goto nomem;
        memcpy(v->piece[i], piece[i], len[i]);
        v->len[i] = (uint32_t)len[i];
        v->ids[n_ids++] = i;
        total += len[i];
    }
    sort_ent *se = malloc(sizeof *se * (size_t)(n_ids ? n_ids : 1));
    if (!se) goto nomem;
    for (int32_t k = 0; k < n_ids; k++) se[k] = (sort_ent){v->piece[v->ids[k]], v->len[v->ids[k]], v->ids[k]};
    qsort(se, (size_t)n_ids, sizeof *se, piece_cmp);
    for (int32_t k = 0; k < n_ids; k++) v->ids[k] = se[k].id;
    free(se);
    v->nodes = malloc(sizeof *v->nodes * total); /* at most one node per byte plus the root */
    if (!v->nodes) goto nomem;
    uint32_t open[1026]; /* open[d]: the node at depth d on the current path */
    uint32_t nn = 1, cur_depth = 0;
    v->nodes[0] = (tnode){0, 0, 0, 0, 0};
    open[0] = 0;
    const char *prev = NULL;
    uint32_t prev_len = 0;
    for (int32_t k = 0; k < n_ids; k++) {
        int32_t id = v->ids[k];
        const char *p = v->piece[id];
        uint32_t l = v->len[id], lcp = 0;
        while (prev && lcp < l && lcp < prev_len && p[lcp] == prev[lcp]) lcp++;
        for (; cur_depth > lcp; cur_depth--) v->nodes[open[cur_depth]].end = nn;
        for (uint32_t d = lcp + 1; d <= l; d++) {
            v->nodes[nn] = (tnode){(uint8_t)p[d - 1], (uint16_t)d, 0, 0, 0};
            open[d] = nn++;
        }
        cur_depth = l;
        tnode *t = &v->nodes[open[l]];
        if (t->tok_hi == 0) t->tok_lo = (uint32_t)k;
        t->tok_hi = (uint32_t)k + 1;
        if (l > v->max_depth) v->max_depth = (uint16_t)l;
        prev = p;
        prev_len = l;
    }
    for (; cur_depth > 0; cur_depth--) v->nodes[open[cur_depth]].end = nn;
    v->nodes[0].end = nn;
    v->n_nodes = nn;
    *out = v;
    return BT_OK;
nomem:
    bt_constraint_vocab_free(v);
    return bt_fail(BT_ERR_NOMEM, "constraint: out of memory for the vocabulary trie");
}

bt_status bt_constraint_vocab_from_tokenizer(const tok_tokenizer *t, bt_constraint_vocab **out)
{
    int32_t n = tok_n_vocab(t);
    const char **piece = calloc((size_t)n, sizeof *piece);
    size_t *len = calloc((size_t)n, sizeof *len);
    uint8_t *skip = calloc((size_t)n, 1);
    bt_status st;
    if (!piece || !len || !skip) {
        st = bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < n; i++) {
        tok_type ty = tok_token_type(t, i);
        skip[i] = ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNUSED || ty == TOK_TYPE_UNKNOWN || tok_is_eog(t, i);
        piece[i] = tok_token_piece(t, i, &len[i]);
    }
    st = bt_constraint_vocab_create(n, piece, len, skip, out);
out:
    free(piece);
    free(len);
    free(skip);
    return st;
}

int32_t bt_constraint_vocab_n(const bt_constraint_vocab *v) { return v->n_vocab; }

/* ---- states ---- */

static uint64_t words_hash(const uint32_t *w, uint32_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < n; i++) {
        h ^= w[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static bt_status slots_grow(bt_constraint *c)
{
    uint32_t n = c->n_slot ? c->n_slot * 2 : 1024;
    int32_t *s = malloc(sizeof *s * n);
    if (!s) return bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
    for (uint32_t i = 0; i < n; i++) s[i] = -1;
    for (uint32_t k = 0; k < c->n_st; k++) {
        uint32_t h = (uint32_t)c->st[k].hash & (n - 1);
        while (s[h] >= 0) h = (h + 1) & (n - 1);
        s[h] = (int32_t)k;
    }
    free(c->slot);
    c->slot = s;
    c->n_slot = n;
    return BT_OK;
}

/* The id of st's (canonical) stack set, interning it when new. Called with c->mu held. */
static bt_status intern(bt_constraint *c, bt_gstate *gs, int32_t *out)
{
    bt_status st = bt_gstate_canon(gs);
    if (st) return st;
    uint64_t h = words_hash(gs->w, gs->n);
    if ((c->n_st + 1) * 2 > c->n_slot && (st = slots_grow(c))) return st;
    uint32_t mask = c->n_slot - 1, i = (uint32_t)h & mask;
    for (; c->slot[i] >= 0; i = (i + 1) & mask) {
        const cstate *s = &c->st[c->slot[i]];
        if (s->hash == h && s->n == gs->n && !memcmp(c->words + s->off, gs->w, sizeof *gs->w * gs->n)) {
            *out = c->slot[i];
            return BT_OK;
        }
    }
    if (c->n_st >= BT_CONSTRAINT_MAX_STATES)
        return bt_fail(BT_ERR_EXHAUSTED, "constraint: more than %d grammar states", BT_CONSTRAINT_MAX_STATES);
    if (c->n_st == c->cap_st) {
        uint32_t cap = c->cap_st ? c->cap_st * 2 : 64;
        cstate *ns = realloc(c->st, sizeof *ns * cap);
        if (!ns) return bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
        c->st = ns;
        c->cap_st = cap;
    }
    if (c->n_words + gs->n > c->cap_words) {
        uint64_t cap = c->cap_words ? c->cap_words * 2 : 1024;
        while (cap < c->n_words + gs->n) cap *= 2;
        uint32_t *nw = realloc(c->words, sizeof *nw * cap);
        if (!nw) return bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
        c->words = nw;
        c->cap_words = cap;
    }
    memcpy(c->words + c->n_words, gs->w, sizeof *gs->w * gs->n);
    c->st[c->n_st] = (cstate){.off = (uint32_t)c->n_words, .n = gs->n, .hash = h, .accepting = (uint8_t)gs->accepting,
                              .final = (uint8_t)!bt_gstate_has_next(gs), .trans = NULL, .mask = NULL};
    memcpy(c->st[c->n_st].next, gs->next, sizeof gs->next);
    c->n_words += gs->n;
    c->slot[i] = (int32_t)c->n_st;
    *out = (int32_t)c->n_st++;
    return BT_OK;
}

static bt_status load(bt_constraint *c, int32_t state, bt_gstate *dst)
{
    const cstate *s = &c->st[state];
    return bt_gstate_load(c->g, dst, c->words + s->off, s->n);
}

bt_status bt_constraint_create(const char *grammar, size_t len, const bt_constraint_vocab *v, bt_constraint **out)
{
    bt_constraint *c = calloc(1, sizeof *c);
    if (!c) return bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
    atomic_init(&c->refs, 1);
    c->v = v;
    pthread_mutex_init(&c->mu, NULL);
    bt_status st = bt_grammar_parse(grammar, len, &c->g);
    if (st) goto fail;
    c->walk = malloc(sizeof *c->walk * ((size_t)v->max_depth + 1));
    if (!c->walk) {
        st = bt_fail(BT_ERR_NOMEM, "constraint: out of memory");
        goto fail;
    }
    bt_gstate s0 = {0};
    st = bt_grammar_start(c->g, &s0);
    int32_t id = -1;
    if (!st) st = intern(c, &s0, &id);
    bt_gstate_free(&s0);
    if (st) goto fail;
    *out = c;
    return BT_OK;
fail:
    c->refs = 1;
    bt_constraint_unref(c);
    return st;
}

bt_constraint *bt_constraint_ref(bt_constraint *c)
{
    atomic_fetch_add(&c->refs, 1);
    return c;
}

void bt_constraint_unref(bt_constraint *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
    for (uint32_t i = 0; i < c->n_st; i++) {
        free(c->st[i].mask);
        free(c->st[i].trans);
    }
    free(c->st);
    free(c->words);
    free(c->slot);
    free(c->walk);
    bt_gstate_free(&c->tmp);
    bt_gstate_free(&c->cur);
    bt_grammar_free(c->g);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

int32_t bt_constraint_n_vocab(const bt_constraint *c) { return c->v->n_vocab; }

/* The state after byte b from `state`, through the state's transition table (filled on first use, so the trie
 * walks of later masks are table lookups). *out = T_DEAD when no stack takes b. Called with c->mu held. */
static bt_status transition(bt_constraint *c, int32_t state, uint8_t b, int32_t *out)
{
    cstate *s = &c->st[state];
    if (s->trans && s->trans[b] != T_UNKNOWN) {
        *out = s->trans[b];
        return BT_OK;
    }
    if (!((s->next[b >> 6] >> (b & 63)) & 1)) {
        *out = T_DEAD;
        return BT_OK;
    }
    bt_status st = load(c, state, &c->cur);
    if (st) return st;
    int r = bt_grammar_step(c->g, &c->cur, b, &c->tmp);
    if (r < 0) return r;
    c->work += c->tmp.cost + 1;
    int32_t id = T_DEAD;
    if (r > 0 && (st = intern(c, &c->tmp, &id))) return st;
    s = &c->st[state]; /* intern may have moved the table */
    if (!s->trans && c->trans_bytes + 256 * sizeof(int32_t) <= BT_CONSTRAINT_CACHE_BYTES) {
        s->trans = malloc(256 * sizeof(int32_t));
        if (s->trans) {
            for (int i = 0; i < 256; i++) s->trans[i] = T_UNKNOWN;
            c->trans_bytes += 256 * sizeof(int32_t);
        }
    }
    if (s->trans) s->trans[b] = id;
    *out = id;
    return BT_OK;
}

/* The trie walk: node i is visited with walk[depth - 1] holding the state id after its parent's bytes; a byte no
 * stack can take skips the whole subtree. Called with c->mu held. */
static bt_status compute_mask(bt_constraint *c, int32_t state, uint64_t *m)
{
    const bt_constraint_vocab *v = c->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    memset(m, 0, sizeof *m * words);
    c->walk[0] = state;
    c->work = 0;
    const tnode *nodes = v->nodes;
    uint32_t i = 1;
    while (i < v->n_nodes) {
        const tnode *t = &nodes[i];
        int32_t id;
        bt_status st = transition(c, c->walk[t->depth - 1], t->byte, &id);
        if (st) return st;
        if (c->work > BT_CONSTRAINT_MASK_WORK) {
            BT_WARN("constraint", "a token mask took more than %u steps of grammar work: the grammar is too "
                    "ambiguous; the sequence ends here", BT_CONSTRAINT_MASK_WORK);
            return bt_fail(BT_ERR_EXHAUSTED, "constraint: grammar too ambiguous to compute a token mask");
        }
        if (id < 0) {
            i = t->end;
            continue;
        }
        c->walk[t->depth] = id;
        for (uint32_t k = t->tok_lo; k < t->tok_hi; k++) {
            int32_t tok = v->ids[k];
            m[tok >> 6] |= 1ull << (tok & 63);
        }
        i++;
    }
    return BT_OK;
}

bt_status bt_constraint_mask(bt_constraint *c, int32_t state, uint64_t *out_words)
{
    size_t words = ((size_t)c->v->n_vocab + 63) / 64, bytes = sizeof(uint64_t) * words;
    pthread_mutex_lock(&c->mu);
    bt_status st = BT_OK;
    if (c->st[state].mask) {
        c->cached++;
        memcpy(out_words, c->st[state].mask, bytes);
        goto out;
    }
    c->computed++;
    if (c->cache_bytes + bytes > BT_CONSTRAINT_CACHE_BYTES) {
        for (uint32_t k = 0; k < c->n_st; k++) {
            free(c->st[k].mask);
            c->st[k].mask = NULL;
        }
        c->cache_bytes = 0;
    }
    uint64_t *m = malloc(bytes);
    if (!m) {
        st = bt_fail(BT_ERR_NOMEM, "constraint: out of memory for a token mask");
        memset(out_words, 0, bytes);
        goto out;
    }
    st = compute_mask(c, state, m);
    if (st) {
        free(m);
        memset(out_words, 0, bytes);
        goto out;
    }
    memcpy(out_words, m, bytes);
    c->st[state].mask = m; /* the walk interned states: the table may have moved */
    c->cache_bytes += bytes;
out:
    pthread_mutex_unlock(&c->mu);
    return st;
}

bt_status bt_constraint_next(bt_constraint *c, int32_t state, int32_t token, int32_t *out)
{
    const bt_constraint_vocab *v = c->v;
    if (token < 0 || token >= v->n_vocab || !v->piece[token])
        return bt_fail(BT_ERR_INVALID, "constraint: token %d is not allowed by the grammar", (int)token);
    pthread_mutex_lock(&c->mu);
    bt_status st = BT_OK;
    int32_t id = state;
    for (uint32_t i = 0; i < v->len[token] && !st; i++) {
        st = transition(c, id, (uint8_t)v->piece[token][i], &id);
        if (!st && id < 0) st = bt_fail(BT_ERR_INVALID, "constraint: token %d is not allowed by the grammar", (int)token);
    }
    pthread_mutex_unlock(&c->mu);
    if (!st) *out = id;
    return st;
}

int bt_constraint_accepting(bt_constraint *c, int32_t state)
{
    pthread_mutex_lock(&c->mu);
    int a = c->st[state].accepting;
    pthread_mutex_unlock(&c->mu);
    return a;
}

int bt_constraint_final(bt_constraint *c, int32_t state)
{
    pthread_mutex_lock(&c->mu);
    int f = c->st[state].final;
    pthread_mutex_unlock(&c->mu);
    return f;
}

void bt_constraint_counters(bt_constraint *c, uint64_t *computed, uint64_t *cached)
{
    pthread_mutex_lock(&c->mu);
    *computed = c->computed;
    *cached = c->cached;
    pthread_mutex_unlock(&c->mu);
}

/* ---- cache ---- */

typedef struct cc_entry {
    char *text;
    size_t len;
    uint64_t hash, used;
    bt_constraint *c;
} cc_entry;

struct bt_constraint_cache {
    const bt_constraint_vocab *v;
    pthread_mutex_t mu;
    cc_entry *e;
    int n, cap;
    uint64_t tick;
};

bt_status bt_constraint_cache_create(const bt_constraint_vocab *v, int capacity, bt_constraint_cache **out)
{
    bt_constraint_cache *cc = calloc(1, sizeof *cc);
    if (!cc || capacity < 1 || !(cc->e = calloc((size_t)capacity, sizeof *cc->e))) {
        free(cc);
        return bt_fail(BT_ERR_NOMEM, "constraint cache: out of memory");
    }
    cc->v = v;
    cc->cap = capacity;
    pthread_mutex_init(&cc->mu, NULL);
    *out = cc;
    return BT_OK;
}

void bt_constraint_cache_free(bt_constraint_cache *cc)
{
    if (!cc) return;
    for (int i = 0; i < cc->n; i++) {
        free(cc->e[i].text);
        bt_constraint_unref(cc->e[i].c);
    }
    free(cc->e);
    pthread_mutex_destroy(&cc->mu);
    free(cc);
}

bt_status bt_constraint_cache_get(bt_constraint_cache *cc, const char *grammar, size_t len, bt_constraint **out)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)grammar[i]) * 0x100000001b3ull;
    pthread_mutex_lock(&cc->mu);
    cc->tick++;
    for (int i = 0; i < cc->n; i++)
        if (cc->e[i].hash == h && cc->e[i].len == len && !memcmp(cc->e[i].text, grammar, len)) {
            cc->e[i].used = cc->tick;
            *out = bt_constraint_ref(cc->e[i].c);
            pthread_mutex_unlock(&cc->mu);
            return BT_OK;
        }
    bt_constraint *c = NULL;
    bt_status st = bt_constraint_create(grammar, len, cc->v, &c);
    char *text = st ? NULL : malloc(len ? len : 1);
    if (!st && !text) st = bt_fail(BT_ERR_NOMEM, "constraint cache: out of memory");
    if (st) {
        bt_constraint_unref(c);
        pthread_mutex_unlock(&cc->mu);
        return st;
    }
    memcpy(text, grammar, len);
    int slot = cc->n;
    if (cc->n == cc->cap) { /* evict the least recently used */
        slot = 0;
        for (int i = 1; i < cc->n; i++)
            if (cc->e[i].used < cc->e[slot].used) slot = i;
        free(cc->e[slot].text);
        bt_constraint_unref(cc->e[slot].c);
    } else {
        cc->n++;
    }
    cc->e[slot] = (cc_entry){text, len, h, cc->tick, c};
    *out = bt_constraint_ref(c);
    pthread_mutex_unlock(&cc->mu);
    return BT_OK;
}
