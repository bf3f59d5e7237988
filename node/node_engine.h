/* What the engine-running node roles (baton-prefill, baton-decode) share on top of node/node.h: the model, the CPU
 * backend and the scheduler, whose KV pool lives in memory registered with kvtransfer (DESIGN 5.1, 6) so that
 * prefill nodes can write into decode nodes' pools; the sampling parameters of the internal protocol; the measured
 * rates published in load reports. Part of baton_node, which links the engine, kvtransfer and the protos. */
#ifndef BATON_NODE_NODE_ENGINE_H
#define BATON_NODE_NODE_ENGINE_H

#include "baton/v1/generate.pb-c.h"
#include "common/membership.h"
#include "common/metrics.h"
#include "common/status.h"
#include "engine/backend.h"
#include "engine/backend_cpu.h"
#include "engine/constraint.h"
#include "engine/model.h"
#include "engine/scheduler.h"
#include "kvtransfer/kvx.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#define BT_NE_MAX_EOG 16

/* The engine host's environment switches, the ones without a flag (README: environment variables). Read once at
 * the process's edge (bt_node_main) by bt_ne_env_read and passed down; nothing below reads the environment. All
 * zero = every default. */
typedef struct bt_ne_env {
    bt_cpu_opts cpu;           /* BATON_CPU_ISA, BATON_ACT_BITS, BATON_CPU_REPACK, BATON_CPU_LANES (n_threads unused) */
    int profile;               /* BATON_PROFILE */
    const char *step_trace_dir; /* BATON_STEP_TRACE: the scheduler's step trace goes to DIR/NAME-PID.steps; NULL = none */
    int spec_fixed_k;          /* BATON_SPEC_FIXED_K=1: every sequence drafts k-max tokens whenever its proposer has
                                * them (no adaptive k, no cost rule); for tests and measurements */
    kvx_data_path_t kvx_path;  /* BATON_KVX_DATA_PATH */
    int use_cuda, cuda_device; /* the node's --device (copied by bt_node_main from its flags): 0 = the CPU */
} bt_ne_env_t;

/* Fills *out from the environment. BT_ERR_INVALID / BT_ERR_UNSUPPORTED with one line naming the variable and the
 * values it takes; *out is then all defaults. Can't block. */
bt_status bt_ne_env_read(bt_ne_env_t *out);

typedef struct bt_ne_config {
    const char *model_path;   /* GGUF file; required */
    const char *name;         /* "decode" / "prefill": logs and the UCX worker name */
    int threads;              /* compute threads, 0 = all CPUs */
    size_t kv_mem;            /* KV pool bytes, 0 = BT_SCHED_DEFAULT_KV_MEM */
    int32_t max_batch_tokens; /* 0 = 512 */
    int32_t max_running;      /* 0 = 256 */
    int disable_kvx;          /* 1: no kvtransfer (plain memory pool, no remote prefill) */
    const char *spec;         /* speculative decoding, bt_spec_parse syntax; NULL or "" = none */
    int32_t spec_k_max;       /* 0 = the engine's default (8) */
    bt_ne_env_t env;          /* the environment switches, read at the edge; zero = defaults */
} bt_ne_config_t;

typedef struct bt_ne {
    bt_model *m;
    bt_backend *be;
    bt_sched *sched;
    kvx_context_t *kvx;      /* NULL when kvtransfer is off or UCX could not start */
    kvx_pool_t *kvx_pool;    /* the scheduler's KV pool, registered (NULL with kvx) */
    void *kv_device_mem;     /* --device cuda: the registered pool's GPU memory (the backend's buffer), else NULL */
    kvx_layout_t layout;     /* the KV layout (fingerprint included) */
    char fingerprint[17];    /* model fingerprint as 16 lower-case hex digits */
    int32_t n_vocab, max_context, max_running, max_batch_tokens;
    int64_t kv_blocks_total;
    size_t kv_block_bytes;   /* one block, all layers */
    /* [n_layer] 1: a sliding-window layer with its own block space (its KV moves as the handoff's second list,
     * engine/kv_groups.h); NULL when the scheduler has no such space */
    uint8_t *kv_layer_group;
    FILE *step_trace;        /* BATON_STEP_TRACE's file, NULL without one */
    int32_t kv_window;       /* that space's window in tokens, 0 without it */

    metrics_gauge_t *g_running, *g_waiting, *g_kv_used, *g_kv_capacity; /* set by bt_ne_register_metrics */
    metrics_gauge_t *g_kv_bytes;  /* baton_kv_bytes_used: bytes of KV held (the sliding-window space's at its size) */
    bt_spec_config spec;     /* what --spec asked for */
    bt_proposer *proposer;   /* NULL without speculation */
    int spec_fixed_k;        /* BATON_SPEC_FIXED_K: k-max drafts every step, no adaptive k */
    metrics_counter_t *c_spec_proposed, *c_spec_accepted; /* labelled with the proposer; NULL without speculation */
    metrics_histogram_t *h_spec_accepted;                 /* accepted drafts per verification */
    uint64_t load_spec_proposed, load_spec_accepted, load_spec_hist[BT_SPEC_K_LIMIT + 1];
    metrics_counter_t *c_preemptions; /* baton_preemptions_total */
    uint64_t load_preemptions;

    pthread_mutex_t load_mu; /* the rate sampler's memory */
    double load_t, busy_t0;
    uint64_t load_computed, load_generated, load_steps;
    double prefill_rate, decode_rate, step_s, tokens_per_step;
    double busy_s, busy_tokens; /* decode rate: busy wall time and tokens since the rate was last updated */
    uint64_t load_dsteps, load_dtokens;
    bt_constraint_vocab *cvocab;  /* structured output: the vocabulary's byte trie */
    bt_constraint_cache *ccache;  /* and the compiled grammars, shared by requests with the same grammar */
} bt_ne_t;

#define BT_NE_GRAMMAR_CACHE 16 /* compiled grammars a node keeps */

/* A reference to the compiled constraint of a request's grammar (*out = NULL for "" / NULL: unconstrained); the
 * caller drops it with bt_constraint_unref after bt_sched_submit. -1 with err set when the grammar is invalid (an
 * INVALID_ARGUMENT for the caller). Thread-safe. */
int bt_ne_constraint(const bt_ne_t *ne, const char *grammar, bt_constraint **out, char *err, size_t cap);

/* Loads the model, creates the backend, the kvtransfer context and pool (unless disabled; when UCX cannot start
 * the node serves without it and says so in the log) and the scheduler, and starts its engine thread. Errors name
 * the file or the setting; *out is set only on success. */
bt_status bt_ne_create(const bt_ne_config_t *cfg, bt_ne_t **out);

/* Stops the engine (aborting what is left), then frees the scheduler, the pool, the context, the model. NULL ok. */
void bt_ne_destroy(bt_ne_t *ne);

/* Fills model fingerprint, capacity and the kvtransfer descriptor (copied) into info. BT_ERR_NOMEM. */
bt_status bt_ne_node_info(const bt_ne_t *ne, mbr_role role, mbr_node_info_t *info);

/* One line for the start-up log. */
void bt_ne_summary(const bt_ne_t *ne, char *buf, size_t cap);

/* Registers the engine's gauges (running sequences, waiting requests, KV blocks used and capacity, DESIGN 10) and,
 * with speculation, its counters of proposed and accepted drafts and the histogram of accepted drafts per
 * verification (labelled proposer="ngram"|"draft"|"self") in reg; bt_ne_load keeps them current. Errors of the
 * registry. */
bt_status bt_ne_register_metrics(bt_ne_t *ne, metrics_registry_t *reg);

/* Fills measured rates (prefill and decode tok/s, mean step seconds) from the scheduler's counters: EWMA over
 * intervals that did work, so an idle node keeps its last measured speed; updates the engine's gauges. Thread-safe. *st
 * receives the stats. */
void bt_ne_load(bt_ne_t *ne, mbr_load_report_t *out, bt_sched_stats *st);

/* 64-bit key of a node id for kvtransfer's peer cache. */
uint64_t bt_ne_node_key(const char *node_id);

/* Converts the protocol's sampling parameters into sp (which holds the defaults on entry): validates ranges and
 * token ids against the vocabulary. seed_or_random is used when p has no seed. Returns 0, or -1 with a message
 * for the client in err. */
int bt_ne_sampling_from_proto(const bt_ne_t *ne, const Baton__V1__SamplingParams *p, int logprobs,
                              uint32_t top_logprobs, uint32_t sample_index, uint64_t seed_or_random, bt_sampling *sp,
                              char *err, size_t cap);

/* A fresh random seed for requests that name none. Thread-safe. */
uint64_t bt_ne_random_seed(void);

#endif
