/* baton-router internals (DESIGN 2, 7, 9): the modules of router/ and the state they share. Nothing here is a
 * library API: main.c builds an rtr_t from flags, runs it until a signal, and destroys it.
 *
 *   rmodel.c      tokenizer, chat template and metadata of the served model (no weights)
 *   textgen.c     incremental detokenization and stop strings with hold-back (one per choice)
 *   placement.c   cost model: local or remote prefill and on which prefill node; planner arithmetic
 *   prefix_index.c approximate per-node prefix index (which block hashes this router sent where)
 *   dispatch.c    choice of a decode node and prefill placement, Decode/Run, migration when a node dies mid-stream
 *   job.c         one client request: n choices on worker threads, usage, metrics, answering the client
 *   openai_api.c  HTTP routes (OpenAI shapes) and request validation
 *   embeddings.c  /v1/embeddings: inputs, Decode/Embed on a thread per request, the answer
 *   grpc_api.c    baton.v1.Generation over gRPC
 *   router.c      flags, start-up and shutdown */
#ifndef BATON_ROUTER_ROUTER_H
#define BATON_ROUTER_ROUTER_H

#include "common/http.h"
#include "common/membership.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "engine/chat_template.h"
#include "engine/tokenizer.h"
#include "router/planner.h"

#include "baton/v1/generate.pb-c.h"
#include "baton/v1/node.pb-c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RTR_MAX_STOP 4           /* stop strings per request (OpenAI's limit) */
#define RTR_MAX_STOP_LEN 256     /* bytes per stop string */
#define RTR_MAX_N 128            /* choices per request */
#define RTR_MAX_TOP_LOGPROBS 20
#define RTR_MAX_LOGIT_BIAS 300
#define RTR_DEFAULT_MAX_CONTEXT 8192 /* the nodes' default context cap (baton generate's too) */
#define RTR_DEFAULT_MIGRATIONS 3
#define RTR_PROMPT_BYTES_PER_TOKEN 32 /* prompt text allowed per context token (tokens average ~4 bytes) */
#define RTR_PROMPT_MIN_BYTES (64u << 10)
#define RTR_MAX_NONSTREAM_UNITS (1 << 20) /* n x max_tokens x (1 + top_logprobs) of a non-streaming answer */
#define RTR_DEFAULT_MAX_INFLIGHT 1024
/* Failure detection (dispatch.c's opening comment). The stall bound sits well above a busy step on this hardware
 * (a 512-token prefill chunk mixed into a decode step takes ~1 s on 2 CPU cores) and below the lease TTL (5 s), so
 * that a frozen node's streams move before it even leaves the membership. */
#define RTR_DEFAULT_STALL_MS 3000          /* --stall-timeout-ms */
#define RTR_STALL_STEPS 50.0               /* ... or this many of the node's own steps, when longer */
#define RTR_SILENT_STEPS 5.0               /* new work avoids a node whose decoding streams went silent this long */
#define RTR_SILENT_MIN_MS 500
#define RTR_DEFAULT_LOAD_STALE_MS 3000     /* --load-stale-ms: three missed heartbeats (nodes write every 1 s) */
#define RTR_DEFAULT_REJOIN_GRACE_MS 10000  /* --rejoin-grace-ms: two TTLs; nodes re-register within ~1 s */
#define RTR_DEFAULT_REQUEST_TIMEOUT_MS (1200 * 1000) /* --request-timeout-s: 8192 tokens at 7 tok/s still fit */

/* ---- rmodel.c ---- */

typedef struct rtr_model {
    tok_tokenizer *tok;
    chat_tmpl tmpl;
    int has_tmpl;
    char name[128];      /* the id served: a short id from the file name (rtr_model_short_id), or the operator's */
    char long_name[128]; /* general.name, or the file's base name: accepted as an alias */
    char base[128];      /* the file's base name, also accepted (with or without .gguf) */
    int32_t n_ctx;      /* prompt + generated tokens allowed */
    int64_t created;    /* unix seconds: the file's modification time */
    char fingerprint[17]; /* gguf_fingerprint as 16 lower-case hex digits, as nodes publish it */
    uint64_t fingerprint_u64; /* the same value: keys the prefix hashes (DESIGN 5.3) */
    int32_t n_layer, n_head_kv, head_dim; /* attention shape, for the KV size; 0 when the metadata lacks it */
    int32_t n_embd;     /* the hidden size (the embeddings' dimensions); 0 when the metadata lacks it */
    double kv_bytes_per_token; /* f16 K and V over every layer: n_layer * 2 * n_head_kv * head_dim * 2 bytes */
    /* tool calling (router/tool_calls.h; rtr_model_tools_init) */
    int tool_format;             /* rtr_tool_format of the parser in use */
    int tmpl_renders_tools;      /* the Jinja template's text refers to tools */
    int tmpl_renders_tool_calls; /* ... and to messages' tool_calls */
} rtr_model_t;

/* Loads what the router needs from the GGUF at path (tokenizer, chat template, names, context); max_ctx > 0
 * caps the context. Errors as gguf_open / tok_create; a missing chat template is not an error (chat requests then
 * get 400). *m is set only on success. */
bt_status rtr_model_load(const char *path, int32_t max_ctx, rtr_model_t *m);
/* Same, with chat_template (NULL: the model's) choosing the template as --chat-template builtin:NAME|FILE does;
 * a chat_template that cannot be used is an error (as chat_tmpl_init_gguf's). */
bt_status rtr_model_load_tmpl(const char *path, int32_t max_ctx, const char *chat_template, rtr_model_t *m);
/* Sets m's tool fields from its template's text (the GGUF's at path, or the chat_template FILE) and the
 * --tool-call-parser flag (NULL or "auto": detect from the text). A built-in renderer renders no tools.
 * BT_ERR_INVALID for an unknown flag value; the template's text failing to load again is BT_ERR_IO/NOT_FOUND. */
bt_status rtr_model_tools_init(rtr_model_t *m, const char *path, const char *chat_template, const char *parser);
void rtr_model_free(rtr_model_t *m);
/* 1 when name (NULL or "" = any) names this model: its id, general.name or file name. */
int rtr_model_matches(const rtr_model_t *m, const char *name);
/* The short id of a model file's base name (no directory, no .gguf): lower case, without a trailing quantization
 * tag ("SmolLM2-135M-Instruct.Q4_1" -> "smollm2-135m-instruct", "gemma-3-270m-q4_k_m" -> "gemma-3-270m"). */
void rtr_model_short_id(const char *base, char *out, size_t cap);

/* ---- textgen.c ---- */

/* Turns one choice's token ids into text: complete UTF-8 only, special tokens skipped, and text that could be the
 * start of a stop string held back until it is known not to be. */
typedef struct rtr_textgen {
    tok_stream ts;
    const char *stops[RTR_MAX_STOP]; /* borrowed; outlive the textgen */
    size_t stop_len[RTR_MAX_STOP];
    int n_stop;
    char *held;     /* decoded text not yet released */
    size_t n_held, held_cap;
    char *out;      /* what the last call released */
    size_t out_cap;
    int stopped;    /* a stop string matched: nothing more is released */
    int stop_index; /* which one (-1 none) */
} rtr_textgen_t;

void rtr_textgen_init(rtr_textgen_t *tg, const tok_tokenizer *tok, const char *const *stops, int n_stop);
void rtr_textgen_free(rtr_textgen_t *tg);
/* Feeds one token. *text and *len receive the text released now (valid until the next call). Returns 1 when a stop
 * string completed (the released text ends right before it), 0 otherwise; BT_ERR_INVALID (bad id) and
 * BT_ERR_NOMEM are negative. After a stop every call releases nothing. */
int rtr_textgen_push(rtr_textgen_t *tg, int32_t id, const char **text, size_t *len);
/* End of the choice without a stop string: releases everything held (an incomplete character as U+FFFD), up to a
 * stop string that the flushed tail completes (then stopped and stop_index are set, as by a push). */
void rtr_textgen_finish(rtr_textgen_t *tg, const char **text, size_t *len);

/* Copies s[len] to a malloc'd NUL-terminated string with invalid UTF-8 replaced by U+FFFD (for JSON and proto
 * strings). NULL on allocation failure. */
char *rtr_utf8_sanitize(const char *s, size_t len);

/* ---- placement.c ---- */

/* Local or remote prefill (DESIGN 7): a pure cost model over plain numbers taken from the membership view, so it is
 * tested without etcd. Every cost is a predicted time in seconds until the request's first token.
 *
 *   local:     own_s          = (D idle ? D.step_s : 0) + (D.queued_prefill_tokens + uncached_D) / D.rate
 *              interference_s = D.running_seqs * uncached_D / D.rate   (each running decode waits for the prefill
 *                                                                         compute mixed into its steps)
 *              cost_local     = own_s + interference_s
 *   remote P:  cost_P = P.step_s + (P.queued_prefill_tokens + uncached_P) / P.rate
 *                     + uncached_D * kv_bytes_per_token / P.kv_transfer_bytes_s + overhead
 * The cheapest P wins; remote iff cost_P < cost_local. The idle-D step term stands for the engine step the request
 * waits for before its prefill starts (a busy engine folds it into steps already counted by the rate). */

#define RTR_PLACE_DEFAULT_RATE 300.0      /* prefill tok/s when no node has measured one */
#define RTR_PLACE_DEFAULT_STEP_S 0.01     /* engine step when unmeasured */
#define RTR_PLACE_DEFAULT_XFER_BPS 1e9    /* KV push bandwidth when unmeasured: 1 GB/s */
#define RTR_PLACE_DEFAULT_OVERHEAD_MS 5.0 /* fixed cost of a remote prefill: extra RPC, UCX set-up, notify */

typedef enum rtr_prefill_mode {
    RTR_PREFILL_AUTO = 0,   /* the cost model decides */
    RTR_PREFILL_LOCAL = 1,  /* always local */
    RTR_PREFILL_REMOTE = 2, /* remote whenever a prefill node exists */
} rtr_prefill_mode;

/* "auto", "local", "remote" -> mode: BT_ERR_INVALID otherwise. */
bt_status rtr_prefill_mode_parse(const char *s, rtr_prefill_mode *out);
const char *rtr_prefill_mode_name(rtr_prefill_mode m);

/* One node as the cost model sees it. Rates of 0 mean "never measured" (see rtr_place_decide). */
typedef struct rtr_place_node {
    const char *node_id;            /* borrowed, for logs */
    int64_t queued_prefill_tokens;
    int64_t running_seqs;
    double prefill_tok_s;
    double step_s;
    double tokens_per_step;         /* decode nodes: tokens a running sequence gains per step (0 = unknown = 1) */
    double kv_transfer_bytes_s;     /* prefill nodes only */
    int64_t cached_tokens;          /* leading prompt tokens this node is believed to hold (prefix index) */
} rtr_place_node_t;

typedef struct rtr_place_input {
    int64_t prompt_tokens;          /* tokens the node prefills before the first new token (prompt + migrated) */
    rtr_place_node_t decode;
    const rtr_place_node_t *prefill; /* [n_prefill] healthy prefill nodes serving the same model */
    size_t n_prefill;
    rtr_prefill_mode mode;
    double overhead_s;              /* fixed remote overhead */
    double kv_bytes_per_token;
} rtr_place_input_t;

/* The cost of prefilling on one prefill node, with its parts (for the decision log). */
typedef struct rtr_place_cand {
    double cost_s;
    double queue_s;                 /* queued_prefill_tokens / rate */
    double compute_s;               /* uncached / rate */
    double transfer_s;              /* uncached_D KV bytes / bandwidth */
    double rate, step_s, bps;       /* the values used (defaults filled in) */
    int64_t uncached_tokens;
} rtr_place_cand_t;

typedef struct rtr_place_decision {
    int remote;                     /* 1: prefill on prefill[best] */
    int best;                       /* cheapest prefill node, -1 when none */
    double cost_local_s, local_own_s, interference_s;
    double d_rate, d_step_s;        /* D's values used (defaults filled in) */
    int64_t uncached_local;
    double ttft_s;                  /* predicted TTFT of the choice: local_own_s or cost_P */
    double best_ttft_s;             /* the lowest predicted TTFT the mode allows (admission control) */
    const char *reason;             /* static string: why this choice */
} rtr_place_decision_t;

/* Decides local vs remote for one request. cands[in->n_prefill] receives each prefill node's cost (may be NULL when
 * n_prefill is 0). Unknown rates: D's prefill rate defaults to the mean measured rate of the prefill nodes, else
 * RTR_PLACE_DEFAULT_RATE; a prefill node's to D's (same model, assumed comparable hardware); steps to
 * RTR_PLACE_DEFAULT_STEP_S; bandwidth to RTR_PLACE_DEFAULT_XFER_BPS. Pure; can't fail. */
void rtr_place_decide(const rtr_place_input_t *in, rtr_place_cand_t *cands, rtr_place_decision_t *out);

/* 1 when a request whose best predicted TTFT is ttft_s meets slo_s (slo_s <= 0: no SLO, always 1). */
int rtr_place_within_slo(double ttft_s, double slo_s);

/* Planner (DESIGN 7): replicas needed to serve demand_tok_s when one replica does rate_tok_s: ceil(demand / rate),
 * at least 1; fallback (at least 1) when the rate was never measured. Pure; can't fail. */
int rtr_planner_replicas(double demand_tok_s, double rate_tok_s, int fallback);

/* Which of n healthy prefill nodes one placement decision weighs (dispatch.c and the simulator): every one when
 * n <= max; else those that hold a prefix of the prompt (holds[i] nonzero; holds may be NULL) first, up to max, then
 * a uniform random sample of the others, drawn with the xorshift64 state *rng (advanced), so every node gets its
 * share of the work however large the cluster. Writes indices 0..n-1 to out[<= max] and returns their count;
 * scratch holds n entries. Pure but for *rng. */
#define RTR_MAX_PREFILL_CANDIDATES 64
size_t rtr_prefill_candidates(size_t n, const unsigned char *holds, size_t max, uint64_t *rng, size_t *scratch,
                              size_t *out);

/* The decode-node preference of dispatch.c's power of two choices (higher wins): KV headroom (free / total, 1 when
 * total is unknown) minus running / max_running (max_running <= 0 reads as 64). Pure, so the simulator runs it. */
double rtr_decode_score(double kv_total, double kv_free, int64_t running, double max_running);
/* Admission's queue-time prediction (see "admission" below) from its parts: pending prompt tokens, competing
 * output tokens (sum of min(rem_i, o)), and the request (n choices, n_prompt, o). Pure. */
double rtr_admit_queue_s(double pending_prompt, double compete, int n, int64_t n_prompt, int64_t o, double decode_tok_s,
                         double prefill_tok_s);
/* Admission's cluster rates: measured, reported (mean per node x nodes) or the floor, whichever is highest. Pure. */
void rtr_admit_rates(double measured_gen_tok_s, double decode_mean_tok_s, double prefill_mean_tok_s, int n_decode,
                     int n_prefill, double *decode_tok_s, double *prefill_tok_s);

/* ---- prefix_index.c ---- */

/* Approximate per-node prefix index (SGLang-style): which prompt block hashes (DecodeRunRequest.block_hashes) this
 * router sent to which node. Bounded per node by the node's KV capacity in blocks, LRU eviction; a node seen with a
 * different start time (restarted: its cache is empty) starts empty. Thread-safe (one internal lock). */
typedef struct rtr_pindex rtr_pindex_t;

/* BT_ERR_NOMEM; *out set only on success. */
bt_status rtr_pindex_create(rtr_pindex_t **out);
void rtr_pindex_destroy(rtr_pindex_t *x);
/* Number of leading hashes of h[n] the node holds (0 for an unknown node or another incarnation). No LRU touch:
 * asking is not using. Can't fail. */
size_t rtr_pindex_match(rtr_pindex_t *x, const char *node_id, int64_t started_ms, const uint64_t *h, size_t n);
/* Records that the node now holds h[n] (a prompt's chain, in prompt order), keeping at most capacity hashes
 * (capacity <= 0: RTR_PINDEX_DEFAULT_CAPACITY). Earlier blocks end up most recently used, so eviction trims chains
 * from their tails, as a node's own LRU does. Allocation failure is harmless: the node is then forgotten. */
void rtr_pindex_insert(rtr_pindex_t *x, const char *node_id, int64_t started_ms, int64_t capacity, const uint64_t *h,
                       size_t n);
/* The nodes most recently sent a chain starting with h0 (at most RTR_PINDEX_HOLDERS, as rtr_pindex_id_hash of their
 * ids and their started_ms): a hint to find likely prefix holders among many nodes without a lookup per node. It may
 * name a node that has since evicted the chain or left (check with rtr_pindex_match), and may have lost a holder.
 * Returns the count. Can't fail. */
#define RTR_PINDEX_HOLDERS 4
size_t rtr_pindex_holders(rtr_pindex_t *x, uint64_t h0, uint32_t *idh, int64_t *started);
/* The hash rtr_pindex_holders reports a node id by. */
uint32_t rtr_pindex_id_hash(const char *node_id);
/* Forgets a node (it left the view). Can't fail. */
void rtr_pindex_forget(rtr_pindex_t *x, const char *node_id);
/* Hashes held for a node (tests, logs). */
size_t rtr_pindex_size(rtr_pindex_t *x, const char *node_id);

#define RTR_PINDEX_DEFAULT_CAPACITY 4096

/* ---- dispatch.c ---- */

typedef struct rtr_dispatch rtr_dispatch_t;

typedef struct rtr_dispatch_config {
    etcd_client_t *etcd;
    const char *cluster;
    int max_migrations;      /* 0 = RTR_DEFAULT_MIGRATIONS */
    const char *fingerprint; /* only nodes serving this model (their NodeInfo.model) are used; copied */
    metrics_counter_t *migrations;
    /* placement (DESIGN 7): see placement.c */
    rtr_prefill_mode prefill_mode;
    double remote_overhead_s;
    double kv_bytes_per_token;
    uint64_t fingerprint_u64;        /* keys the prompt's block hashes */
    const char *decision_log;        /* append one JSON line per decision here; NULL = off */
    metrics_counter_t *decisions_local, *decisions_remote; /* optional */
    metrics_histogram_t *predicted_ttft;                   /* optional */
    const bt_tls_files_t *tls; /* calls to nodes: verify each against ca as its node id, present cert; NULL = insecure */
    /* failure detection and deadlines: 0 = the RTR_DEFAULT_*, < 0 = off */
    int load_stale_ms;       /* a decode node without a load report this long (while etcd answers) gets no work */
    int stall_ms;            /* a stream without a token this long, on a node silent as long, moves */
    int rejoin_grace_ms;     /* nodes whose lease vanished as etcd came back stay this long (mbr_watcher) */
    int request_timeout_ms;  /* deadline of a request's Decode/Run calls, all attempts together */
} rtr_dispatch_config_t;

/* What this router knows of one decode node's liveness, as plain numbers (dispatch.c fills it from the view and its
 * own streams). */
typedef struct rtr_liveness {
    int gone;               /* it left the membership */
    int64_t report_age_ms;  /* since its last record (load report or NodeInfo) arrived */
    int64_t confirmed_ms;   /* for how long etcd has answered (mbr_watcher_confirmed_ms): reports age only then */
    int suspect;            /* a stream of ours stalled there, and no record of it arrived since */
    int decoding;           /* streams of ours past their first token there */
    int64_t silent_ms;      /* since the last token any stream of ours got from it */
    double step_s;          /* its reported step time (0 = unknown) */
} rtr_liveness_t;

/* Why such a node should not be trusted, or NULL; a static string. Not strict (may a waiting stream stay?): gone,
 * a load report older than load_stale_ms (<= 0: never) while etcd has answered for longer, or suspect. Strict (may
 * it get new work?) adds: streams decode there and none got a token for RTR_SILENT_STEPS of its steps (at least
 * RTR_SILENT_MIN_MS) - a frozen node's first sign, enough to steer work away, not to move streams. Pure. */
const char *rtr_liveness_unfit(const rtr_liveness_t *l, int load_stale_ms, int strict);

/* A stream without a token this long has stalled: stall_ms, or RTR_STALL_STEPS of its node's step when longer
 * (a slow node is not a stuck one). Pure. */
int64_t rtr_stall_bound_ms(int stall_ms, double step_s);

bt_status rtr_dispatch_create(const rtr_dispatch_config_t *cfg, rtr_dispatch_t **out);
void rtr_dispatch_destroy(rtr_dispatch_t *d);
/* Waits for the first read of etcd (up to timeout_ms). */
bt_status rtr_dispatch_wait_synced(rtr_dispatch_t *d, int timeout_ms);
/* Decode nodes that could take a request now. */
int rtr_dispatch_n_healthy(rtr_dispatch_t *d);

/* The lowest TTFT any placement of this prompt promises now (over every healthy decode node and, as the prefill
 * mode allows, every prefill node), in seconds: what admission control compares with the SLO. No side effect.
 * BT_ERR_UNAVAILABLE when no decode node is healthy, BT_ERR_NOMEM. */
bt_status rtr_dispatch_predict_ttft(rtr_dispatch_t *d, const int32_t *prompt, size_t n_prompt, double *ttft_s);

/* What the planner reads: healthy node counts and their mean measured rates (0 when none measured). */
typedef struct rtr_cluster_rates {
    int n_prefill, n_decode;
    double prefill_tok_s;      /* mean over prefill nodes, or over decode nodes when there is no prefill node */
    double decode_tok_s;       /* mean over decode nodes */
    /* the nodes' fitted step models (mbr_load_report_t), means over the nodes that have one (0 = none yet):
     * prefill from the prefill nodes (from the decode nodes when there is none), decode from the decode nodes */
    double prefill_fixed_s, prefill_token_s, decode_fixed_s, decode_row_s;
} rtr_cluster_rates_t;
void rtr_dispatch_rates(rtr_dispatch_t *d, rtr_cluster_rates_t *out);

/* What a running choice tells dispatch, and asks. All called on the choice's thread. */
typedef struct rtr_run_ops {
    /* New tokens in order (never a duplicate, never a gap), with their logprobs when asked (lps may be NULL).
     * Return nonzero to stop the choice now (a stop string matched): the decode stream is cancelled. */
    int (*on_tokens)(void *ud, const int32_t *ids, size_t n, Baton__V1__TokenLogprob *const *lps, size_t n_lps);
    /* Nonzero when the client went away: the decode stream is cancelled. Polled about every 50 ms. */
    int (*cancelled)(void *ud);
    void *ud;
    int timeout_ms;  /* the client's own deadline, ms from now (gRPC); 0 = none. The shorter of it and --request-timeout-s holds */
} rtr_run_ops_t;

typedef struct rtr_run_result {
    Baton__V1__FinishReason finish;  /* STOP / LENGTH / ABORT; UNSPECIFIED when stopped by on_tokens */
    uint32_t cached_prompt_tokens;
    int migrations;
    bt_rpc_code code;                /* OK, or the failure that ended it */
    char message[256];
} rtr_run_result_t;

/* Decode nodes that failed one request, so that its migrations never pick them again. Grows with every
 * migration: no limit on how many it holds. Zero-initialise; free with rtr_exclude_free. */
typedef struct rtr_exclude {
    char (*ids)[MBR_NODE_ID_MAX];
    size_t n, cap;
} rtr_exclude_t;

/* Adds node_id (once). BT_ERR_NOMEM, with e unchanged. */
bt_status rtr_exclude_add(rtr_exclude_t *e, const char *node_id);
/* Whether node_id was added. Can't fail. */
int rtr_exclude_has(const rtr_exclude_t *e, const char *node_id);
/* Frees the ids and empties e. */
void rtr_exclude_free(rtr_exclude_t *e);

/* Runs one choice to its end on some decode node (prefilled there or, when the cost model says so, on a prefill
 * node named in DecodeRunRequest.prefill), migrating (prompt + tokens delivered so far) to another node
 * when one fails mid-stream, up to the migration limit; every attempt is placed afresh. req is the request to send
 * (generated_token_ids and prefill must be empty: dispatch fills them; block_hashes empty = computed here, as the
 * low 64 bits of each bt_prefix_hash). Blocks. Returns BT_OK (res->finish says how it ended, or on_tokens
 * stopped it), BT_ERR_CANCELLED (client gone), BT_ERR_UNAVAILABLE (no healthy node / all attempts failed),
 * or the mapped status of an error the node answered (res->code and res->message say which). */
bt_status rtr_dispatch_run(rtr_dispatch_t *d, const Baton__V1__DecodeRunRequest *req, const rtr_run_ops_t *ops,
                           rtr_run_result_t *res);

/* Computes embeddings on a decode node (Decode/Embed; req's model_fingerprint is filled here): the node is chosen
 * as for Run, and a node that fails (dies, restarts, sheds the call) is replaced by another, up to the migration
 * limit; nothing is streamed, so a retry simply starts over. timeout_ms (0 = none) is capped by
 * --request-timeout-s. cancelled(ud) (may be NULL) is asked every 100 ms while the node computes: when it says 1
 * the call is cancelled (the node aborts the inputs) and BT_ERR_CANCELLED returns with res->code CANCELLED.
 * Blocks. BT_OK with *out (free with protobuf_c_message_free_unpacked); else res says what the node or the router
 * answered (UNAVAILABLE: no healthy decode node). */
bt_status rtr_dispatch_embed(rtr_dispatch_t *d, const Baton__V1__DecodeEmbedRequest *req, int timeout_ms,
                             int (*cancelled)(void *), void *ud, Baton__V1__DecodeEmbedResponse **out,
                             bt_rpc_result_t *res);

/* ---- embeddings.c: POST /v1/embeddings (issue 23.5) ---- */

typedef struct rtr rtr_t;

#define RTR_EMBED_MAX_INPUTS 2048 /* inputs per request (OpenAI's limit; the nodes' DECODE_EMBED_MAX_INPUTS) */

/* A validated embeddings request: its inputs as token ids. */
typedef struct rtr_embed_req {
    tok_ids *inputs;
    size_t n;
    uint32_t tokens;    /* all inputs together */
    int base64;         /* encoding_format "base64": little-endian float32, base64-encoded */
} rtr_embed_req_t;

/* Parses an OpenAI embeddings body: "input" as a string, an array of strings, an array of token ids or an array of
 * arrays of token ids (strings are tokenized as raw text, BOS per the model file, special-token text not parsed,
 * as `baton embed` does); "encoding_format" float|base64; "dimensions" only as the model's own size; "model" and
 * "user" as for chat. A client error is 400 naming the field (*http_status), BT_ERR_NOMEM 500. *out is zeroed first
 * and owns what it holds even on error (free with rtr_embed_req_free). */
bt_status rtr_embed_parse(const rtr_model_t *m, const cJSON *body, rtr_embed_req_t *out, int *http_status);
void rtr_embed_req_free(rtr_embed_req_t *e);
/* The OpenAI answer {"object":"list","data":[{"object":"embedding","index":i,"embedding":...}],"model","usage"}
 * with floats printed to round-trip exactly (%.9g) or base64. NULL when out of memory; free the result. */
char *rtr_embed_answer_json(const char *model, const Baton__V1__DecodeEmbedResponse *resp, int base64, size_t *len);
/* Admits e (ownership moves in, even on error), defers req, and computes on a decode node on a thread of its own;
 * that thread answers: 200, or 429 (node at capacity), 503 (no decode node), 504 (deadline), 500/502. */
void rtr_embed_start_http(rtr_t *r, rtr_embed_req_t *e, http_request_t *req);
/* The same inputs from gRPC's EmbedRequest (texts or token_ids); errors as rtr_embed_parse's (all client errors are
 * BT_ERR_INVALID, INVALID_ARGUMENT), *out owned as there. */
bt_status rtr_embed_from_grpc(const rtr_model_t *m, const Baton__V1__EmbedRequest *q, rtr_embed_req_t *out);
/* As rtr_embed_start_http for a gRPC Generation/Embed call: the job answers and finishes the call (RESOURCE_EXHAUSTED,
 * UNAVAILABLE, DEADLINE_EXCEEDED, ... as the node or dispatch answered). */
void rtr_embed_start_grpc(rtr_t *r, rtr_embed_req_t *e, bt_rpc_call_t *call);

/* ---- job.c ---- */

typedef enum rtr_api {
    RTR_API_CHAT = 0,       /* HTTP /v1/chat/completions */
    RTR_API_COMPLETION = 1, /* HTTP /v1/completions */
    RTR_API_GRPC = 2,       /* gRPC Generation/Generate */
} rtr_api;


/* A validated request, ready to run: what every front end produces. Owned strings and arrays. */
typedef struct rtr_gen {
    rtr_api api;
    int stream;
    int include_usage;
    int32_t *prompt;
    size_t n_prompt;
    uint32_t max_tokens;
    int n;
    int logprobs;
    int top_logprobs;
    int ignore_eos;
    int no_spec;        /* the client opted out of speculative decoding */
    char *stops[RTR_MAX_STOP];
    int n_stop;
    int32_t *stop_ids;
    size_t n_stop_ids;
    /* sampling (has_* = given by the client) */
    float temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    int has_temperature, has_top_p, has_min_p, has_repetition_penalty, has_presence, has_frequency;
    int32_t top_k;
    int has_top_k;
    uint64_t seed;
    int has_seed;
    int n_logit_bias;
    int32_t logit_bias_ids[RTR_MAX_LOGIT_BIAS];
    float logit_bias[RTR_MAX_LOGIT_BIAS];
    char request_id[64];
    char *grammar;       /* structured output compiled to GBNF (router/json_schema.h), or NULL */
    struct rtr_tools *tools; /* the request's tools (router/tool_calls.h), or NULL; owned */
    struct rtr_adm *adm; /* admission claim (rtr_admit_gen); the job releases it */
} rtr_gen_t;

void rtr_gen_free(rtr_gen_t *g);

typedef struct rtr_job rtr_job_t;

/* Starts g (ownership moves into the job, even on error) for an HTTP request: streams SSE or defers one JSON
 * answer. Only in the route handler. On error the caller answers (bt_last_error() says why). */
bt_status rtr_job_start_http(rtr_t *r, rtr_gen_t *g, http_request_t *req);
/* Same for a gRPC Generate call: the job answers and finishes the call. */
bt_status rtr_job_start_grpc(rtr_t *r, rtr_gen_t *g, bt_rpc_call_t *call);

/* ---- admission (router.c; issues 16.5 and 17.3) ----
 * A request is admitted before its choices run, counted as n choices. It is refused (429 / RESOURCE_EXHAUSTED,
 * with a Retry-After) when the choices in flight would pass --max-inflight, or when its predicted queue time passes
 * --max-queue-s (default 30 s). The prediction treats the decode nodes as processor sharing at the cluster's
 * measured token rate R: until a new choice of o tokens is done, every choice in flight takes the smaller of its
 * remaining tokens and o, and so do the request's other n - 1 choices; every prompt not started yet is prefilled
 * first at rate P. The queue time is what that work adds to the choice's own (so an idle cluster takes any size):
 *     t = (pending prompt tokens + (n - 1) * prompt) / P + (sum_i min(rem_i, o) + (n - 1) * o) / R
 * R = max(the router's generated tokens/s over the last 5 s, the nodes' reported decode rates summed,
 * RTR_ADMIT_FLOOR_DECODE_TOK_S per decode node); P likewise with prefill rates. o = max_tokens with ignore_eos,
 * else min(max_tokens, the mean output length of recent choices). */
#define RTR_DEFAULT_MAX_QUEUE_S 30.0
#define RTR_ADMIT_FLOOR_DECODE_TOK_S 256.0  /* a cold or idle cluster's rate is unmeasured or understated */
#define RTR_ADMIT_FLOOR_PREFILL_TOK_S 1024.0
#define RTR_ADMIT_PRIOR_OUT 128             /* mean output tokens before any choice has finished */
#define RTR_ADMIT_QUICK_OUT 16              /* tokens assumed for the check made before a body is parsed */

/* One admitted request's claim on the cluster, owned by its job; the router lists it until released. */
typedef struct rtr_adm_choice {
    atomic_llong got;    /* tokens received so far */
    atomic_int started;  /* first token seen: its prompt is no longer pending */
    atomic_int ended;
} rtr_adm_choice_t;

typedef struct rtr_adm {
    int n;
    int64_t n_prompt, expect_out;
    size_t slot;         /* index in the router's list */
    rtr_adm_choice_t c[];
} rtr_adm_t;

/* The cheap check made before a request body is parsed (no work done for a request that would be refused):
 * 1 to go on; 0 with msg and *retry_after_s set. */
int rtr_admit_quick(rtr_t *r, char *msg, size_t cap, int *retry_after_s);
/* Admits a parsed request: on success *out is its claim (give it to the job). 0 with msg and *retry_after_s set
 * when it is refused (or BT_ERR_NOMEM: then msg says so and *retry_after_s is 1). */
int rtr_admit_gen(rtr_t *r, const rtr_gen_t *g, rtr_adm_t **out, char *msg, size_t cap, int *retry_after_s);
/* A choice ended after n_tokens (natural: finished by the model, counts toward the mean output length). */
void rtr_admit_choice_end(rtr_t *r, rtr_adm_t *a, int i, uint32_t n_tokens, int natural);
/* Drops the claim (every choice ended or never started). NULL is a no-op. */
void rtr_admit_release(rtr_t *r, rtr_adm_t *a);
/* Predicted queue time of a new request of n choices of o output tokens after a prompt of n_prompt. */
double rtr_admit_predict_s(rtr_t *r, int n, int64_t n_prompt, int64_t o);

/* ---- the router ---- */

typedef struct rtr_config {
    const char *model_path;
    const char *served_model_name; /* the id served for the model; NULL = the short id of its file name */
    const char *chat_template;     /* --chat-template builtin:NAME|FILE; NULL = the model's own */
    const char *tool_call_parser;  /* --tool-call-parser auto|hermes|llama3|mistral|mistral-args|none; NULL = auto */
    const char *etcd;
    const char *http_listen;  /* host:port */
    const char *grpc_listen;
    const char *const *api_keys;
    size_t n_api_keys;
    const char *cluster;
    int32_t max_context;      /* 0 = RTR_DEFAULT_MAX_CONTEXT */
    int max_migrations;
    unsigned http_threads;
    int max_inflight;               /* choices in progress at once; beyond: 429 / RESOURCE_EXHAUSTED. 0 = default */
    double max_queue_s;             /* predicted queue time bound (see admission); 0 = default, < 0 = off */
    unsigned http_max_connections;  /* 0 = HTTP_DEFAULT_MAX_CONNECTIONS */
    unsigned http_max_per_ip;       /* connections one client address may hold; 0 = default */
    unsigned http_idle_timeout_s;   /* 0 = default */
    unsigned http_read_timeout_s;   /* whole request (headers and body) must arrive within this; 0 = default */
    size_t http_max_memory;         /* request bodies + SSE buffers, bytes; 0 = default */
    const char *grpc_tls_cert;      /* PEM chain + key: TLS on the gRPC listener; NULL = insecure */
    const char *grpc_tls_key;
    const char *grpc_tls_client_ca; /* also: mTLS, clients must present a certificate signed by this CA */
    rtr_prefill_mode prefill_mode;  /* --prefill-mode */
    double remote_prefill_overhead_ms; /* fixed cost of a remote prefill in the cost model (main: 5) */
    double ttft_slo_ms;             /* > 0: refuse at once what is predicted to miss it (429 / RESOURCE_EXHAUSTED) */
    const char *decision_log;       /* JSON lines of every placement decision; NULL = off */
    /* --tls-cert/--tls-key/--tls-ca: TLS on the public gRPC listener (unless --grpc-tls-* say otherwise) and HTTPS
     * on the OpenAI API with cert + key; calls to nodes present cert and verify each node against ca (mTLS) */
    bt_tls_files_t tls;
    char etcd_user[128];            /* "" = no etcd authentication */
    char etcd_password[BT_TLS_SECRET_MAX]; /* read from --etcd-password-file */
    bt_tls_files_t etcd_tls;        /* TLS to https:// etcd endpoints */
    int load_stale_ms, stall_ms, rejoin_grace_ms, request_timeout_ms; /* as rtr_dispatch_config_t */
    double tpot_slo_ms;             /* the planner's TPOT target (p90); 0 = PLAN_DEFAULT_TPOT_S */
    const char *planner_profile;    /* --planner-profile: a `baton profile` JSON; NULL = the nodes' published fits */
    int planner_window_s;           /* --planner-window-s: a lower answer must hold this long; 0 = default */
} rtr_config_t;

#define RTR_PLANNER_WINDOW_S 30 /* the planner's demand is the token rate over this window */

struct rtr {
    rtr_config_t cfg;
    rtr_model_t model;
    metrics_registry_t *metrics;
    etcd_client_t *etcd;
    rtr_dispatch_t *dispatch;
    http_server_t *http;
    bt_rpc_server_t *grpc;
    atomic_int active_jobs;
    /* admission (router.c): claims of admitted requests, under adm_mu */
    pthread_mutex_t adm_mu;
    rtr_adm_t **adm;
    size_t n_adm, cap_adm;
    int active_choices;        /* under adm_mu */
    double mean_out;           /* under adm_mu: mean output tokens of recent choices (exponential, 1/16) */
    atomic_llong gen_rate_milli; /* generated tokens/s over the last 5 s, x1000 (planner thread) */
    atomic_llong tokens_seen;    /* tokens received from decode nodes, all requests */
    double gen_ring[6][2];       /* planner thread: (monotonic s, tokens_seen) of the last 6 ticks */
    int gen_n;
    atomic_int stopping;
    atomic_int draining;       /* probes.c: set on SIGTERM; new requests are refused, readiness is false */
    atomic_int grpc_ready;     /* probes.c: what gRPC health says now */
    atomic_ullong next_id;
    /* metrics, looked up once */
    metrics_histogram_t *ttft, *tpot, *e2e;
    metrics_family_t *requests;
    metrics_counter_t *prompt_tokens, *generation_tokens, *migrations;
    metrics_counter_t *decisions_local, *decisions_remote;
    metrics_histogram_t *predicted_ttft;
    metrics_gauge_t *planner_prefill, *planner_decode;
    metrics_gauge_t *nodes_prefill, *nodes_decode, *ready_gauge; /* probes.c */
    /* planner thread: samples the token counters once a second */
    pthread_t planner;
    int planner_started;
    pthread_mutex_t planner_mu;
    pthread_cond_t planner_cv;
    /* ring of (monotonic s, prompt tokens, tokens streamed, arrivals, choices finished, their tokens) */
    double samples[RTR_PLANNER_WINDOW_S + 1][6];
    int n_samples, next_sample;
    atomic_llong arrivals;       /* choices admitted (rtr_admit_gen: a request of n choices counts n) */
    atomic_llong finished_choices, finished_tokens; /* choices that ended naturally, and their tokens: the OSL */
    atomic_llong arrival_prompt_tokens; /* their prompt tokens, counted at admission (the usage counter moves at
                                         * the end of a request: a window would pair it with other arrivals) */
    plan_profile_t plan_file;    /* --planner-profile, when has_plan_file */
    int has_plan_file;
    plan_smooth_t smooth_prefill, smooth_decode;
    plan_profile_t node_profile; /* the last profile built from the nodes' fits (kept while a report lacks one) */
    int has_node_profile;
    char router_id[96];          /* names this router's planner record in etcd */
    double plan_etcd_retry_s;    /* monotonic: after a failed exchange, skip etcd until then (ticks stay 1 s) */
    metrics_gauge_t *g_plan_rate, *g_plan_isl, *g_plan_osl, *g_plan_ttft, *g_plan_tpot, *g_plan_routers;
};

/* ---- planner_loop.c: the planner thread's tick (the arithmetic is planner.c) ----
 * Every second: this router's window rates (choices admitted, their prompt tokens, and the output demand: admitted
 * times the mean output of the choices that finished, or admission's mean_out when none did, over
 * RTR_PLANNER_WINDOW_S) are
 * written to /baton/<cluster>/planner/<router id> (no lease: a record older than RTR_PLANNER_STALE_MS is ignored)
 * and every fresh record of the prefix is summed (plan_obs_merge), so that all routers plan on the same cluster-wide
 * load; with etcd unreachable a router plans on its own share (and tries etcd again 10 s later, so that the tick,
 * which also refreshes the probes, is not held up by etcd's timeout every second). Records older than
 * RTR_PLANNER_GC_MS (a router that died without deleting its own) are deleted by whoever reads them. The profile is --planner-profile's, else the mean
 * of the nodes' published step fits; with neither, the old throughput rule stands (rtr_planner_replicas: the node
 * counts while no rate is measured). Exports baton_planner_desired_replicas{role} and the inputs. */
#define RTR_PLANNER_STALE_MS 10000
#define RTR_PLANNER_GC_MS 300000
#define RTR_PLANNER_ETCD_RETRY_S 10.0
bt_status rtr_planner_metrics(rtr_t *r);
/* Reads --planner-profile (BT_ERR_IO / BT_ERR_FORMAT naming the file) and sets the router id. Start-up only. */
bt_status rtr_planner_init(rtr_t *r);
void rtr_planner_tick(rtr_t *r);
/* Deletes this router's record (best effort, at shutdown). */
void rtr_planner_forget(rtr_t *r);

/* Splits "host:port" into host (cap bytes) and port. BT_ERR_INVALID. */
bt_status rtr_split_hostport(const char *s, char *host, size_t cap, int *port);

/* Counts a finished request by status label ("ok", "client_error", "server_error", "cancelled", ...). */
void rtr_count_request(rtr_t *r, const char *status);

/* Admission against --ttft-slo-ms: 1 to go on; 0 when the best predicted TTFT misses the SLO, with msg[cap] naming
 * both (the caller answers 429 / RESOURCE_EXHAUSTED and counts the request "overloaded"). No SLO, no decode node
 * or a failed prediction admit: other checks answer those. */
int rtr_slo_admit(rtr_t *r, const rtr_gen_t *g, char *msg, size_t cap);

bt_status rtr_create(const rtr_config_t *cfg, rtr_t **out);
/* Starts listening (HTTP and gRPC). */
bt_status rtr_start(rtr_t *r);
/* Stops the listeners, cancels the jobs and waits for them (up to a few seconds), frees everything. */
void rtr_destroy(rtr_t *r);

/* ---- probes.c: liveness, readiness, drain ---- */

/* 1 when the router should get traffic: not draining and a decode node in the view. Can't fail. */
int rtr_ready(rtr_t *r);
/* Why rtr_ready is 0, for a 503 / UNAVAILABLE message (static string). */
const char *rtr_not_ready_reason(rtr_t *r);
/* baton_router_nodes{role} and baton_router_ready. BT_ERR_NOMEM / BT_ERR_INVALID as metrics_family_register. */
bt_status rtr_probes_metrics(rtr_t *r);
/* Brings gRPC health ("") and the probe gauges in line with the view; the planner thread calls it every second. */
void rtr_probes_tick(rtr_t *r);
/* GET /live (always 200) and GET /ready (200 or 503, JSON body). */
bt_status rtr_probes_register(rtr_t *r, http_server_t *s);
/* Stops admitting (readiness false) and blocks until no request is in flight or grace_ms passed; rtr_destroy then
 * cancels what is left. */
void rtr_drain(rtr_t *r, int grace_ms);

/* Front ends (register routes / methods). */
bt_status rtr_openai_register(rtr_t *r, http_server_t *s);
bt_status rtr_grpc_register(rtr_t *r, bt_rpc_server_t *s);

/* Request parsing (openai_api.c), exposed for unit tests: fills g from an OpenAI JSON body. On a client error
 * returns BT_ERR_INVALID with *http_status (400, 404) and bt_last_error() naming the field. */
bt_status rtr_openai_parse(const rtr_model_t *m, rtr_api api, const cJSON *body, rtr_gen_t *g, int *http_status);
/* Request parsing (grpc_api.c), exposed for unit tests: fills g from a Generation/Generate request. On a client
 * error returns BT_ERR_INVALID with bt_last_error() naming the field (the caller answers INVALID_ARGUMENT);
 * BT_ERR_NOMEM. On failure g is freed and zeroed. */
bt_status rtr_grpc_parse(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g);
/* Bytes of prompt text a request may carry: RTR_PROMPT_BYTES_PER_TOKEN per context token, at least
 * RTR_PROMPT_MIN_BYTES. */
size_t rtr_prompt_max_bytes(const rtr_model_t *m);
/* 1 when given equals key; the time taken depends only on strlen(key). */
int rtr_key_equal(const char *given, const char *key);
/* 1 when role is one both APIs accept: system, developer, user, assistant, tool. */
int rtr_chat_role_ok(const char *role);
/* Renders msgs with the model's chat template (generation prompt added) and appends the prompt's ids to *out: the
 * template's markers are special tokens, message content is plain text (a "<|im_end|>" typed by a user stays
 * characters, never a marker). Content without marker text gives exactly the ids of the rendered string.
 * BT_ERR_INVALID (roles the template rejects), BT_ERR_NOMEM; *out may hold a partial result on error. */
bt_status rtr_chat_encode(const rtr_model_t *m, const chat_msg *msgs, size_t n, tok_ids *out);
/* One chat message (OpenAI's shape) checked as /v1/chat/completions checks it: tool_call_id present for role tool,
 * tool_calls only in assistant messages and only when the template renders them, no function_call; *extra gets
 * the fields the template sees besides role and content (name, tool_call_id, tool_calls with arguments as
 * objects, reasoning_content) as JSON text, NULL when none (caller frees). BT_ERR_INVALID naming
 * 'messages[idx]...', BT_ERR_NOMEM. */
bt_status rtr_chat_message_extra(const rtr_model_t *m, const cJSON *msg, const char *role, int idx, char **extra);

/* Same, with the request's tools (a JSON array, NULL: none) that a Jinja template sees. */
bt_status rtr_chat_encode_tools(const rtr_model_t *m, const chat_msg *msgs, size_t n, const char *tools_json,
                                tok_ids *out);
/* Tokenize / Detokenize as validated and computed for the gRPC API (exposed for unit tests and fuzzers).
 * BT_ERR_INVALID naming the field, BT_ERR_NOMEM. detokenize's *text is malloc'd valid UTF-8. */
bt_status rtr_grpc_tokenize(const rtr_model_t *m, const Baton__V1__TokenizeRequest *q, tok_ids *ids);
bt_status rtr_grpc_detokenize(const rtr_model_t *m, const Baton__V1__DetokenizeRequest *q, char **text);
/* Shared final checks: prompt non-empty, prompt + max_tokens within the context (fills max_tokens when 0). */
bt_status rtr_gen_check_context(const rtr_model_t *m, rtr_gen_t *g, int max_tokens_given);
/* Shared check of a request's grammar text (structured output, a forced tool call): grammar, the output of a call
 * that returned st (NULL after an error), is parsed and its ownership moves in. BT_OK: g->grammar holds it. Else it
 * is freed and the producer's or the parser's code comes back unmapped (BT_ERR_INVALID, BT_ERR_UNSUPPORTED,
 * BT_ERR_NOMEM, ...) with bt_last_error() "'where': why"; each API maps the code to its own answer. */
bt_status rtr_gen_take_grammar(bt_status st, char *grammar, const char *where, rtr_gen_t *g);

#endif
