/* Speculative decoding (DESIGN 5.5): proposers of draft tokens behind one small interface, and the rule that picks
 * how many drafts a sequence gets in a step. The scheduler verifies drafts inside its continuous batch: a sequence's
 * last token and its k drafts are k+1 rows of the step, each row is sampled exactly as plain decoding would sample
 * it (same logits bits, same (seed, position) draw), and drafts are kept while they equal those draws. Output is
 * therefore bit-identical with and without speculation, whatever the proposer proposes.
 *
 * Proposers:
 *  - ngram: prompt lookup. The sequence's last n tokens (n from ngram_max down to ngram_min) are looked up in an
 *    index of every earlier n-gram of its prompt and output; the tokens that followed the most recent match are the
 *    drafts. The index grows with the sequence (one entry per token and n), nothing is recomputed.
 *  - draft: a smaller model with the target's vocabulary, run in the same process on its own KV pool and batch
 *    (engine/spec_draft.c).
 *  - self: the target's own first L layers, final norm and LM head (early exit), run like a draft model over the
 *    target's weights (no memory for weights).
 *
 * Threads: a proposer is used by the one engine thread of its scheduler. */
#ifndef BATON_ENGINE_SPEC_H
#define BATON_ENGINE_SPEC_H

#include <stdint.h>

#include "common/status.h"
#include "engine/sampler.h"

#define BT_SPEC_K_LIMIT 16 /* most drafts per sequence per step any configuration may ask for */
/* Default most drafts per step: n-gram lookup on tools/workloads/input-grounded.jsonl at batch 1 kept 3.3 drafts per
 * verification with 8 against 2.3 with 4 (1.92x against 1.53x decode tok/s in the same session); adaptive k keeps
 * k low wherever drafts are not kept. */
#define BT_SPEC_K_DEFAULT 8

typedef enum bt_spec_kind {
    BT_SPEC_NONE = 0,
    BT_SPEC_NGRAM,
    BT_SPEC_DRAFT, /* draft model from a GGUF file */
    BT_SPEC_SELF,  /* the target's first self_layers layers */
} bt_spec_kind;

typedef struct bt_spec_config {
    bt_spec_kind kind;
    int32_t k_max;          /* most drafts per sequence per step, 1..BT_SPEC_K_LIMIT (default BT_SPEC_K_DEFAULT) */
    int32_t ngram_min;      /* shortest n-gram matched (default 1: a single-token match's drafts are kept only
                             * ~25% of the time, but where rows are nearly free they still pay; their own
                             * acceptance estimate (class 1) keeps them from lowering the longer matches') */
    int32_t ngram_max;      /* longest, tried first (default 4) */
    char draft_path[1024];  /* BT_SPEC_DRAFT: the draft model's GGUF */
    int32_t self_layers;    /* BT_SPEC_SELF: layers 0..self_layers-1 of the target */
    int profile;            /* the draft's forward pass logs time per op kind (BATON_PROFILE, read at the edge) */
} bt_spec_config;

/* Defaults: none, k_max BT_SPEC_K_DEFAULT, n-grams 1..4. Can't fail. */
bt_spec_config bt_spec_config_default(void);

/* Parses a --spec value into c (other fields kept): "none", "ngram", "ngram:MIN-MAX" (n-gram lengths), "draft:PATH",
 * "self:L" (L >= 1).
 * BT_ERR_INVALID with a message that quotes the value and lists the accepted forms. */
bt_status bt_spec_parse(const char *text, bt_spec_config *c);

/* "none", "ngram", "draft", "self": the proposer label of metrics. */
const char *bt_spec_kind_name(bt_spec_kind k);

/* One sequence's request for drafts in a step (filled by the scheduler; drafts and n_drafts by the proposer). */
typedef struct bt_spec_item {
    void *state;                    /* the proposer's state of this sequence (seq_open) */
    const int32_t *tokens;          /* [n_tokens] prompt then accepted output */
    int32_t n_tokens;
    const bt_sampler_seq *sampler;  /* the sequence's sampler: draft models draw with the same (seed, position) */
    int32_t k;                      /* drafts wanted, 1..BT_SPEC_K_LIMIT */
    int32_t drafts[BT_SPEC_K_LIMIT]; /* out: proposals for positions n_tokens, n_tokens + 1, ... */
    int32_t n_drafts;               /* out: 0..k */
    int32_t cls;                    /* out: which acceptance estimate these drafts count in (0..BT_SPEC_CLASSES-1) */
} bt_spec_item;

/* Acceptance estimates a sequence keeps: drafts of class 1 come from weak evidence (the n-gram proposer's
 * single-token matches: kept about a quarter as often as longer matches' drafts), so their misses do not lower the
 * estimate that prices the strong ones (class 0: every other draft). */
#define BT_SPEC_CLASSES 2

typedef struct bt_proposer bt_proposer;

typedef struct bt_proposer_ops {
    const char *name; /* metrics label */
    /* Per-sequence state, NULL allowed as a valid state. Errors: BT_ERR_NOMEM (the sequence then runs without
     * speculation). */
    bt_status (*seq_open)(bt_proposer *p, void **state);
    void (*seq_close)(bt_proposer *p, void *state); /* NULL state allowed */
    /* Fills drafts for items[n]. Can't fail: a proposer that cannot propose (no match, its own memory full) returns
     * 0 drafts for that item. Items name distinct states. */
    void (*propose)(bt_proposer *p, bt_spec_item *items, int32_t n);
    void (*destroy)(bt_proposer *p);
    /* Optional (NULL: free): seconds one round of drafting (one more draft for every sequence) has recently taken,
     * measured by the proposer; the adaptive-k rule adds it to the cost of a draft. */
    double (*round_cost)(bt_proposer *p);
} bt_proposer_ops;

struct bt_proposer {
    const bt_proposer_ops *ops;
    void *ctx;
};

/* The n-gram (prompt lookup) proposer for n-grams of ngram_min..ngram_max tokens (1 <= min <= max <= 8). Drafts
 * from a 1-token match are class 1, all others class 0. BT_ERR_INVALID, BT_ERR_NOMEM. */
bt_status bt_spec_ngram_create(int32_t ngram_min, int32_t ngram_max, bt_proposer **out);

/* The proposer cfg asks for (*out = NULL for BT_SPEC_NONE). Draft and self proposers run on be (the target's
 * backend, which must outlive them) with a draft KV pool of kv_tokens positions, for up to max_seqs sequences per
 * step. Errors name the file or the setting: BT_ERR_INVALID (self:L with L >= the model's layers; a draft model
 * whose vocabulary differs from target's, both named with their fingerprints), those of bt_model_load,
 * BT_ERR_NOMEM. */
struct bt_model;
struct bt_backend;
bt_status bt_spec_create(const bt_spec_config *cfg, const struct bt_model *target, struct bt_backend *be,
                         int32_t kv_tokens, int32_t max_seqs, bt_proposer **out);

/* Destroys any proposer; NULL allowed. */
static inline void bt_proposer_destroy(bt_proposer *p)
{
    if (p) p->ops->destroy(p);
}

/* ---- how many drafts (adaptive k) ----
 * Each sequence keeps, for each draft position i, a running estimate alpha_i of the chance that draft i is accepted
 * once drafts 1..i-1 were (recent steps weigh more; a position with little evidence takes the estimate of the one
 * before it). Copying runs make later drafts likelier than the first, which one rate for all positions would miss.
 * Draft i is then accepted with probability alpha_1 * ... * alpha_i. A step costs about
 * fixed + per_row * rows (the scheduler's fitted step-time model of decode steps). Draft i of a sequence (i = 1..k)
 * costs one more row, plus its share of the proposer's round of drafting (a draft model's forward pass), and yields
 * a token with probability P_i = alpha_1 * ... * alpha_i; it is worth it when that beats the tokens per second the
 * step already makes: P_i > (per_row * n_decode + round) / (fixed + per_row * rows). Large, compute-bound batches thus stop
 * drafting by themselves, and a proposer that keeps missing drives k to 0. Such a sequence probes with one draft
 * after 16 idle steps while the threshold is below 0.5, and waits twice as long after each probe that missed (up to
 * 512 steps). A new sequence starts from what the scheduler's earlier sequences learnt of the proposer, so a draft
 * model that is never right stops costing anything once that is known. Decode-only steps with a proposer that costs
 * nothing to ask (n-gram) are priced by measured step times instead (bt_spec_plan below); the threshold serves steps
 * with prompt chunks and the draft-model proposers. */
typedef struct bt_spec_stats {
    float hits[BT_SPEC_K_LIMIT];  /* decayed counts per draft position: kept */
    float tries[BT_SPEC_K_LIMIT]; /* and tried with every earlier draft kept */
    int32_t idle_steps;     /* steps since the sequence last drafted (probe schedule) */
    int32_t probe_every;    /* idle steps before a probe: 16, doubled by each missed probe */
} bt_spec_stats;

/* The starting estimate: alpha 0.5 from one hit in two tries. */
void bt_spec_stats_init(bt_spec_stats *st);

/* A new sequence's starting estimate from a proposer-wide one: its alpha at each position, with the weight of at
 * most two tries per position (its own verifications soon dominate). */
void bt_spec_stats_init_from(bt_spec_stats *st, const bt_spec_stats *global);

/* The proposer-wide estimate (one per scheduler): starts at alpha 0.5 with the weight of 10 tries and forgets more
 * slowly than a sequence's (about the last 20 verifications of any sequence count). */
void bt_spec_global_init(bt_spec_stats *g);
void bt_spec_global_update(bt_spec_stats *g, int32_t n_drafts, int32_t n_accepted);

/* alpha of draft position i (0-based): the chance draft i + 1 is kept once the drafts before it were. */
float bt_spec_alpha_at(const bt_spec_stats *st, int32_t i);

/* The first position's alpha: how often a sequence's first draft is kept. */
float bt_spec_alpha(const bt_spec_stats *st);

/* Records a verification: n_drafts proposed, n_accepted of them kept (a rejection counts a try unless every draft
 * was kept). */
void bt_spec_stats_update(bt_spec_stats *st, int32_t n_drafts, int32_t n_accepted);

/* The cost threshold above for a step: a draft at position i pays when P_i > (draft_row * n_decode + round) / T,
 * T = fixed + per_row * rows the step without drafts (n_decode decoding sequences, rows rows in all), draft_row
 * what one more row of a sequence that already has one costs, round the proposer's cost of a drafting round; all
 * in seconds. 0 while nothing is known of the costs (draft freely, bounded by the 0.1 floor of bt_spec_choose_k). */
double bt_spec_threshold(double fixed, double per_row, double draft_row, double round, int32_t n_decode, int32_t rows);

/* The drafting check: the cost model behind the threshold can be wrong (a fitted row cost that misses lanes,
 * sampling, a machine's noise), so the scheduler also compares what it gets. Per size of decode-only step (1 .. 16
 * sequences each, then 17-31, 32-63, 64-127, 128 and more), averages of the seconds per emitted token (the whole
 * step: proposing, the forward pass, sampling and verifying) of steps without drafts and of steps with drafts.
 * - Up to BT_SPEC_CURVE_SEQS sequences (where only a proposer that costs a round, a draft model, uses the
 *   threshold) each drafting step that was slower per token than the plain ones raises the size's factor on the
 *   threshold (x1.1, at most BT_SPEC_CHECK_MAX), each faster one lowers it (/1.05, down to 1), and plain steps let it
 *   decay toward 1 so that drafting is retried.
 * - Above that (batches that turn compute-bound, where the fitted row cost priced drafts too low: at 9-16 sequences
 *   drafting steps were 11% slower per token here) the check decides the step: the faster kind of step is taken,
 *   plain while drafting is unmeasured, and one step in BT_SPEC_CHECK_ALTERNATE of the size is the other kind so
 *   that both stay measured. */
#define BT_SPEC_CHECK_SIZES 20
#define BT_SPEC_CHECK_MAX 16.0
#define BT_SPEC_CHECK_ALTERNATE 16
typedef struct bt_spec_check {
    double plain_spt[BT_SPEC_CHECK_SIZES], draft_spt[BT_SPEC_CHECK_SIZES], factor[BT_SPEC_CHECK_SIZES];
    uint32_t turn[BT_SPEC_CHECK_SIZES]; /* steps of the size the check decided since the last alternate one */
} bt_spec_check;

void bt_spec_check_init(bt_spec_check *c);

/* A decode-only step of n_seqs sequences that carried n_drafts drafts, kept n_accepted of them, took t seconds. */
void bt_spec_check_add(bt_spec_check *c, int32_t n_seqs, int32_t n_drafts, int64_t n_accepted, double t);

/* The threshold factor (>= 1) for a step of n_seqs sequences (1 above BT_SPEC_CURVE_SEQS). */
double bt_spec_check_factor(const bt_spec_check *c, int32_t n_seqs);

/* Whether a decode-only step of n_seqs > BT_SPEC_CURVE_SEQS sequences may draft (1) or is a plain step (0): the
 * faster kind per emitted token, and every BT_SPEC_CHECK_ALTERNATE-th call of the size the other kind. A kind not
 * measured yet is slower: such steps are plain until drafting ones were measured faster (a bench of a few dozen
 * such steps drafts in about 1 of 16 there; a node that serves long learns where it pays). 1 for smaller steps (the
 * plan or the threshold decides). */
int bt_spec_check_may_draft(bt_spec_check *c, int32_t n_seqs);

/* Whether drafting steps of n_seqs > BT_SPEC_CURVE_SEQS sequences were measured faster per emitted token than plain
 * ones (1 for smaller steps). Steps that also carry prompt chunks draft for that many decoding sequences only then:
 * with 16 sequences and requests arriving, drafts riding on prompt chunks cost 7-10% of the throughput here. */
int bt_spec_check_pays(const bt_spec_check *c, int32_t n_seqs);

/* ---- the step-cost curve and the plan of a decode-only step ----
 * A step's time is not linear in its rows: the GEMM works in tiles of rows (a step of 9 rows costs a tile more than
 * one of 8), and before the kernels prefetched at every row count one of 4 rows cost less than one of 1. A fitted
 * fixed + per_row * rows misprices drafts both ways, so small decode-only steps are priced from measurements: for each
 * number of sequences (1..BT_SPEC_CURVE_SEQS) and each number of extra rows (drafts, 0..BT_SPEC_CURVE_EXTRA), the
 * seconds such steps took (forward pass and sampling). A machine's noise only ever adds time, and an estimate hit
 * by it would keep that size from being chosen again, so an entry counts once it has two samples (the faster one),
 * and then follows a faster step quickly (weight 0.3) and a slower one slowly (0.05, at most twice the estimate). */
/* Up to 8 sequences: at 16 the entries (up to 128 draft rows each) were too many to measure, the fitted model priced
 * the unseen ones low, and exploring them cost 0.93x against the threshold rule's 0.97x (3 alternated rounds). */
#define BT_SPEC_CURVE_SEQS 8
#define BT_SPEC_CURVE_EXTRA 128
typedef struct bt_spec_curve {
    float t[BT_SPEC_CURVE_SEQS][BT_SPEC_CURVE_EXTRA + 1];   /* seconds */
    uint8_t n[BT_SPEC_CURVE_SEQS][BT_SPEC_CURVE_EXTRA + 1]; /* samples, up to 2: the entry counts from 2 */
} bt_spec_curve;

void bt_spec_curve_init(bt_spec_curve *c);

/* A decode-only step of n_seqs sequences and n_extra draft rows took t seconds (ignored outside the table). */
void bt_spec_curve_add(bt_spec_curve *c, int32_t n_seqs, int32_t n_extra, double t);

/* Estimated seconds of a decode-only step of n_seqs sequences (1..BT_SPEC_CURVE_SEQS) with each of 0..max_extra
 * extra rows, into cost[max_extra + 1]: the measured time, else the nearest measured smaller step's plus, for each
 * further row, the slope between the two nearest measured smaller steps (per_row with only one), kept within
 * [per_row / 4, per_row], else fixed + per_row * rows (the fitted model). Can't fail. */
void bt_spec_curve_costs(const bt_spec_curve *c, int32_t n_seqs, int32_t max_extra, double fixed, double per_row,
                         double *cost);

/* One sequence of a decode-only step that may draft: its acceptance estimate and how many drafts it has. */
typedef struct bt_spec_cand {
    bt_spec_stats *st; /* probe schedule updated */
    int32_t avail;     /* drafts on offer, 0..BT_SPEC_K_LIMIT */
    int32_t k;         /* out: drafts to verify, 0..avail */
} bt_spec_cand;

/* The plan of a decode-only step of n_seqs sequences: the drafts that maximize expected tokens per second,
 * (n_seqs + sum of the chosen drafts' P_i) / cost[rows], where draft i of a sequence yields a token with probability
 * P_i = alpha_1 * ... * alpha_i (bt_spec_stats) and cost[e] (e = 0..max_extra) is the step's time with e draft rows
 * (bt_spec_curve_costs). Drafts are taken in order of P, so a sequence's drafts are a prefix; none with P below
 * BT_SPEC_MIN_THRESHOLD. A sequence that has not drafted for its probe interval gets one draft when a row costs less
 * than half its share of the step. Sets every cand[i].k and returns the draft rows in all. Can't fail. */
int32_t bt_spec_plan(bt_spec_cand *cand, int32_t n_cand, int32_t n_seqs, const double *cost, int32_t max_extra);

/* Never draft a position accepted less than 1 time in 10, even when rows look free (steps with prompt chunks, and
 * the plan: a step with more rows measured faster than one with fewer is often noise, so a draft that is almost
 * never kept would cost the proposer's and the verifier's time for nothing). Probes are the exception. */
#define BT_SPEC_MIN_THRESHOLD 0.1

/* The drafts to ask for: the largest k <= k_max with P_k > max(threshold, 0.1) (0 when none), except that a
 * sequence that has not drafted for probe_every steps probes with 1 when may_probe and threshold < 0.5. The caller
 * forbids probes where one costs more than a row (a draft model would first have to catch up on the sequence).
 * Updates st->idle_steps. */
int32_t bt_spec_choose_k(bt_spec_stats *st, int32_t k_max, double threshold, int may_probe);

#endif
