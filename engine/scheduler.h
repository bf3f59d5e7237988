/* Continuous-batching scheduler (DESIGN 5.4): one engine thread runs steps; each step admits waiting requests while
 * KV blocks and the token budget allow, mixes chunked prefill with the running decodes in one ragged batch, runs
 * the forward pass, samples, emits tokens, and finishes requests at once. Requests are served by priority, then in
 * arrival order; deadlines are honoured; abort works at any time. When the KV pool runs out, the most recently
 * admitted request of the lowest priority is preempted and later recomputed (its output is unaffected: logits are
 * batch-invariant and sampling is keyed by (seed, position)).
 *
 * Threads: bt_sched_submit, bt_sched_abort and bt_sched_get_stats may be called from any thread (they only touch
 * a mutex-protected inbox or snapshot). Emit callbacks run on the engine thread: they must be quick and must not
 * call back into the scheduler except bt_sched_abort. bt_sched_step is for callers that drive the scheduler
 * themselves (tests, offline benchmarks) instead of bt_sched_start. */
#ifndef BATON_ENGINE_SCHEDULER_H
#define BATON_ENGINE_SCHEDULER_H

#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/spec.h"

/* The scheduler's defaults, used wherever a caller leaves a setting at 0 (nodes, CLI, benchmarks). */
#define BT_SCHED_DEFAULT_KV_MEM ((size_t)256 << 20)
#define BT_SCHED_DEFAULT_BATCH_TOKENS 512
#define BT_SCHED_DEFAULT_MAX_RUNNING 256
#define BT_SCHED_MAX_CONTEXT 8192 /* default context: the model's, at most this */

/* The default context for m: its training context, at most BT_SCHED_MAX_CONTEXT. */
static inline int32_t bt_sched_default_context(const bt_model *m)
{
    return m->hp.n_ctx_train > 0 && m->hp.n_ctx_train < BT_SCHED_MAX_CONTEXT ? m->hp.n_ctx_train : BT_SCHED_MAX_CONTEXT;
}

typedef struct bt_sched_config {
    size_t kv_mem;             /* bytes for the KV pool (default BT_SCHED_DEFAULT_KV_MEM, 256 MiB) */
    void *kv_memory;           /* optional: the pool lives in these kv_mem bytes (memory registered with UCX);
                                * the caller keeps ownership and frees it after bt_sched_destroy */
    bt_kv_dtype kv_dtype;      /* default f16 */
    int32_t max_batch_tokens;  /* token budget of one step (default 512) */
    int32_t max_running;       /* most sequences running at once (default 256) */
    int32_t max_context;       /* most positions per sequence (default: the model's, at most 8192) */
    int disable_prefix_cache;
    const int32_t *eog_ids;    /* [n_eog] tokens that end generation (EOS, EOT ...); copied */
    int32_t n_eog;
    bt_proposer *proposer;     /* optional speculative decoding (engine/spec.h); not owned, must outlive the
                                * scheduler and is used only on its engine thread */
    int32_t spec_k_max;        /* most drafts per sequence per step, 1..BT_SPEC_K_LIMIT (default BT_SPEC_K_DEFAULT) */
    int spec_fixed_k;          /* 1: always ask for spec_k_max drafts (no adaptive k, no cost rule): for tests and
                                * for measuring what drafting costs */
    int profile;               /* the forward pass logs time per op kind (BATON_PROFILE, read at the edge) */
    /* Models with sliding-window layers (Gemma 3): by default those layers have their own block space and a
     * sequence holds their KV only for the window of its next position (engine/kv_groups.h). 1: they share the
     * global block tables and keep every position (as before; for comparisons). */
    int kv_full_local;
    /* Optional step trace (BATON_STEP_TRACE, opened at the edge; borrowed, written only on the engine thread, never
     * closed here): one line per step that computed something, BT_SCHED_TRACE_FIELDS, times from bt_sched_now. */
    FILE *step_trace;
} bt_sched_config;

/* The step trace's columns: the step's start (s), its wall time, the forward pass's, and the time since the
 * previous step ended (ms); tokens and sequences in the batch; 1 when every row decodes (drafts included); drafts;
 * and the positions the batch attends to (the sum of each sequence's context after the step). */
#define BT_SCHED_TRACE_FIELDS "t_s step_ms forward_ms gap_ms tokens seqs decode_only drafts context"

/* KV export (prefill nodes, DESIGN 2 step 5): hooks called on the engine thread with the request's emit user. */
typedef struct bt_kv_export {
    /* In the step that computes the request's last prompt token, before its forward pass: the blocks holding the
     * prompt, in prompt order (n_blocks = ceil(n_prompt / 16)), and with a local block space (bt_sched_kv_window
     * > 0) the sliding-window layers' blocks, local_blocks[n_blocks], whose entries before that step's window are
     * -1 (NULL otherwise). Return 0 to get layer() calls in that step. */
    int (*begin)(void *user, const int32_t *blocks, int32_t n_blocks, const int32_t *local_blocks);
    /* After that step wrote layer `layer`'s K/V: every prompt position of the layer is then in the pool. Quick. */
    void (*layer)(void *user, int32_t layer);
} bt_kv_export;

/* Remote prefill (decode nodes, DESIGN 2 step 4). */
typedef struct bt_remote_prefill {
    /* At admission, once blocks for the whole prompt are reserved (the n_cached leading tokens came from the prefix
     * cache and are already computed): return 0 when a remote prefill was started; the request then keeps its
     * blocks and computes nothing until bt_sched_remote_done. Nonzero: it prefills locally. Must not block.
     * With a local block space (bt_sched_kv_window > 0), local_blocks[n_blocks] are the sliding-window layers'
     * blocks and only entries local_first.. need their KV (the window before the first generated position, less
     * what the prefix cache supplied); the others are released unwritten when the prefill succeeds. Without one,
     * local_blocks is NULL and local_first 0. */
    int (*start)(void *user, uint64_t req_id, const int32_t *blocks, int32_t n_blocks, int32_t n_cached,
                 const int32_t *local_blocks, int32_t local_first);
} bt_remote_prefill;

typedef struct bt_req_params {
    bt_sampling sampling;        /* incl. max_tokens (0 = up to the context limit), stop_ids, ignore_eos, logprobs */
    int32_t sample_index;        /* this request is sample sample_index of sampling.n: n > 1 samples of one prompt
                                  * are n requests with indices 0..n-1, each its own RNG stream (their full prompt
                                  * blocks are shared through the prefix cache) */
    int32_t priority;            /* smaller is served first; default 0 */
    double deadline;             /* CLOCK_MONOTONIC seconds (bt_sched_now()); 0 = none */
    const bt_kv_export *kv_export;       /* optional; must outlive the request */
    const bt_remote_prefill *remote;     /* optional; must outlive the request */
    int hold_kv;                 /* keep the request's blocks after its last event until bt_sched_release_kv (a
                                  * prefill node's transfer may still read them) */
    int no_spec;                 /* 1: never verify drafts for this request (its output is the same either way) */
    /* Non-NULL: an embedding request. Its prompt is computed (every token: no prefix-cache reuse) and nothing is
     * generated; the mean of its tokens' final hidden states (after the output norm), L2-normalized, is written
     * here (n_embd floats, the caller's, written before the last event) and it ends with BT_END_STOP and no token.
     * The sum runs in double in token order, so the vector does not depend on chunking or batching. Sampling
     * settings are ignored except for validation; no remote prefill, KV export or hold_kv. */
    float *embedding;
    bt_constraint *constraint;   /* optional grammar (engine/constraint.h) over the model's vocabulary: borrowed,
                                  * bt_sched_submit takes its own reference; drafts that break it are rejected */
    int32_t constraint_prefix;   /* the prompt's last tokens that were generated under the constraint already (a
                                  * migrated request): the grammar starts after them */
} bt_req_params;

/* Defaults: greedy, max_tokens 16, priority 0, no deadline. */
bt_req_params bt_req_params_default(void);

typedef enum bt_end_reason {
    BT_END_NONE = 0,  /* more tokens follow */
    BT_END_STOP,      /* an end-of-generation or stop token (it is this event's token) */
    BT_END_LENGTH,    /* max_tokens or the context limit reached */
    BT_END_ABORT,     /* bt_sched_abort; no token */
    BT_END_TIMEOUT,   /* the deadline passed; no token */
    BT_END_ERROR,     /* the step failed for this request; no token; see the event's error */
} bt_end_reason;

typedef struct bt_sched_event {
    uint64_t req_id;
    int32_t token;     /* the generated token, or -1 when the event carries none */
    float logprob;     /* log-softmax of the raw logits at token */
    int32_t index;     /* 0-based index of token among the generated ones */
    bt_end_reason finish;  /* != BT_END_NONE on the request's last event */
    int32_t n_prompt;  /* prompt tokens */
    int32_t n_cached;  /* prompt tokens served from the prefix cache at (last) admission */
    bt_status error;   /* BT_END_ERROR only */
    const bt_sample_out *detail; /* token events: rank and top logprobs when sampling.logprobs; valid in the call */
    double queue_s;    /* seconds from submit to the first admission (0 while never admitted) */
} bt_sched_event;

typedef void (*bt_sched_emit_fn)(void *user, const bt_sched_event *ev);

typedef struct bt_sched_stats {
    int32_t waiting, running;
    int32_t kv_blocks_total, kv_blocks_used, kv_blocks_cached;
    int32_t kv_local_blocks_used, kv_local_blocks_cached; /* the sliding-window layers' space (0 without one) */
    int64_t kv_bytes_used;   /* KV bytes held by used blocks: global blocks x their layers + local blocks x theirs */
    int64_t kv_bytes_peak;   /* the most kv_bytes_used seen at the end of a step */
    int64_t kv_tokens_used;  /* positions held by running sequences (KV utilisation = this / (used * 16)) */
    uint64_t steps, prompt_tokens, computed_prompt_tokens, generated_tokens, preemptions;
    uint64_t prefix_query_tokens, prefix_hit_tokens;
    uint64_t finished, aborted, timed_out;
    uint64_t remote_prefills, remote_fallbacks; /* remote prefills started / ended in local prefill */
    int32_t kv_blocks_parked;   /* blocks kept after the last event (hold_kv, or a remote write still possible) */
    /* Step-time model fitted over recent steps (least squares, exponentially weighted): a step of n tokens takes
     * step_fixed_s + n * step_token_s. 1 / step_token_s is the marginal prefill rate; step_fixed_s + step_token_s
     * a lone decode step. 0 until measured. */
    double step_fixed_s, step_token_s;
    double decode_fixed_s, decode_row_s; /* the same fit over steps of decode rows only (drafts included) */
    /* Speculative decoding: verifications (a sequence's step that carried drafts), drafts proposed and accepted,
     * verifications by accepted drafts, and for the last step that considered drafting: the cost threshold and
     * the mean of the drafting sequences' acceptance estimates and of the k they asked for (bt_spec_choose_k). */
    uint64_t spec_verifications, spec_proposed, spec_accepted;
    uint64_t decode_seq_steps, decode_tokens; /* decoding sequences' steps (verifications included), their tokens */
    uint64_t spec_accepted_hist[BT_SPEC_K_LIMIT + 1];
    double spec_threshold, spec_alpha, spec_k;
    /* the same three summed over every step that considered drafting, and those steps */
    double spec_threshold_sum, spec_alpha_sum, spec_k_sum;
    uint64_t spec_considered_steps;
    uint64_t spec_planned_steps; /* of those, decode-only steps planned on the measured cost curve (no threshold) */
    /* decode-only steps of more than BT_SPEC_CURVE_SEQS sequences that the drafting check decided (bt_spec_check),
     * and those it made plain steps */
    uint64_t spec_checked_steps, spec_checked_plain_steps;
} bt_sched_stats;

typedef struct bt_sched bt_sched;

/* Creates a scheduler over model m and backend be (both must outlive it). Zero config fields take defaults.
 * Errors: BT_ERR_INVALID (config), BT_ERR_NOMEM, and those of the pool, block manager and forward pass. */
bt_status bt_sched_create(const bt_model *m, bt_backend *be, const bt_sched_config *cfg, bt_sched **out);

/* Stops the engine thread if running; every request still queued or running gets an ABORT event. NULL allowed. */
void bt_sched_destroy(bt_sched *s);

/* Queues a request (prompt copied). emit receives every event of it, last one with finish set. Never blocks on
 * the engine. Errors, with nothing queued: BT_ERR_INVALID (empty prompt, token id out of range, bad params),
 * BT_ERR_EXHAUSTED (prompt + max_tokens exceed the context limit or could never fit in the KV pool). */
bt_status bt_sched_submit(bt_sched *s, const int32_t *prompt, int32_t n_prompt, const bt_req_params *p,
                          bt_sched_emit_fn emit, void *user, uint64_t *req_id);

/* Asks for req_id to end with an ABORT event (unless it finishes first). Unknown ids are ignored. Can't fail. */
void bt_sched_abort(bt_sched *s, uint64_t req_id);

/* Ends the remote prefill of req_id (any thread; applied at the next step). st == BT_OK: every prompt position is
 * now in the request's blocks and `token` (sampled remotely, with its details in *so, may be NULL) is its first
 * generated token: it is accepted and emitted as if sampled here, and decoding continues. Otherwise the request
 * prefills locally from where its prefix-cache hit ended. A request that was aborted or timed out while waiting
 * kept its blocks (a late write could still land in them): this call releases them. Unknown ids are ignored. */
void bt_sched_remote_done(bt_sched *s, uint64_t req_id, bt_status st, int32_t token, const bt_sample_out *so);

/* Releases the blocks a hold_kv request kept after its last event (any thread; applied at the next step).
 * Unknown ids are ignored. */
void bt_sched_release_kv(bt_sched *s, uint64_t req_id);

/* Runs one step on the calling thread (when no engine thread runs). Returns the number of tokens the step
 * computed (0 when there was nothing to do), or a negative bt_status when the forward pass failed (the requests
 * in that step finish with BT_END_ERROR). */
int bt_sched_step(bt_sched *s);

/* 1 when nothing is waiting or running (nor queued in the inbox). */
int bt_sched_idle(bt_sched *s);

/* Runs one token through the whole model outside any request, before bt_sched_start: the backend's first-use work
 * (the CPU backend packs every matrix for the tiled GEMM, which is seconds for large models) then happens at start-up
 * instead of in the first request's time to first token. Takes one KV block and gives it back; counts no step, token
 * or request, adds nothing to the prefix cache or the step-time fits, and forgets its op times (BATON_PROFILE).
 * BT_ERR_INVALID once the engine thread runs; the forward pass's error. */
bt_status bt_sched_warmup(bt_sched *s);

/* Starts / stops the engine thread, which steps while there is work and sleeps otherwise. */
bt_status bt_sched_start(bt_sched *s);
void bt_sched_stop(bt_sched *s);

/* Checks the scheduler's invariants between steps (the block manager's bt_bm_check, and every running request's
 * KV: computed <= length <= tokens, no draft left over). For tests; engine thread only. BT_ERR_INTERNAL naming
 * what is wrong. */
bt_status bt_sched_check(bt_sched *s);

/* A snapshot taken at the end of the last step. Can't fail. */
void bt_sched_get_stats(bt_sched *s, bt_sched_stats *st);

/* The speculation plan's step-time estimates for n_seqs sequences with 0..max_extra draft rows, in seconds, into
 * cost[max_extra + 1] (bt_spec_curve_costs over what this scheduler measured). The engine thread's state: call it
 * from the thread that steps, or when none runs. Can't fail. */
void bt_sched_spec_costs(const bt_sched *s, int32_t n_seqs, int32_t max_extra, double *cost);

/* The KV pool (layout, base, block count), for registering it with kvtransfer and for tests. Its blocks belong to
 * the engine thread: read or write them only as the kv_export / remote hooks allow. */
const bt_kv_pool *bt_sched_kv_pool(const bt_sched *s);

/* The sliding-window layers' window when they have their own block space (engine/kv_groups.h; then kv_export and
 * remote prefill hand over two block lists), else 0. Can't fail. */
int32_t bt_sched_kv_window(const bt_sched *s);

/* Seconds on the monotonic clock deadlines use. */
double bt_sched_now(void);

#endif
