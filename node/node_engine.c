#include "node/node_engine.h"

#include "common/log.h"
#include "engine/backend_cpu.h"
#include "engine/backend_cuda.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t bt_ne_node_key(const char *node_id)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then mixed */
    for (const unsigned char *p = (const unsigned char *)node_id; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return mix64(h);
}

uint64_t bt_ne_random_seed(void)
{
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    z += 0x9e3779b97f4a7c15ull * (atomic_fetch_add(&counter, 1) + 1);
    return mix64(z);
}

/* Everything that must agree for KV bytes to mean the same on two nodes (DESIGN 5.1). */
static uint64_t layout_fingerprint(const bt_model *m, bt_kv_dtype dtype)
{
    uint64_t parts[] = {m->fingerprint, (uint64_t)dtype, BT_KV_BLOCK, (uint64_t)m->hp.n_head_kv,
                        (uint64_t)m->hp.head_dim, (uint64_t)m->hp.n_layer};
    uint64_t h = 0x6b76782d6c61796full;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) h = mix64(h ^ parts[i]);
    return h;
}

bt_status bt_ne_env_read(bt_ne_env_t *out)
{
    bt_ne_env_t e;
    memset(&e, 0, sizeof e);
    kvx_context_opts_t ko = {.data_path = KVX_PATH_AUTO};
    bt_status st;
    if ((st = bt_cpu_opts_from_env(&e.cpu)) || (st = bt_forward_profile_from_env(&e.profile)) ||
        (st = kvx_context_opts_from_env(&ko))) {
        memset(out, 0, sizeof *out);
        return st;
    }
    e.kvx_path = ko.data_path;
    const char *trace = getenv("BATON_STEP_TRACE");
    e.step_trace_dir = trace && trace[0] ? trace : NULL;
    const char *fixed = getenv("BATON_SPEC_FIXED_K");
    if (fixed && fixed[0]) {
        if (strcmp(fixed, "0") && strcmp(fixed, "1")) {
            memset(out, 0, sizeof *out);
            return bt_fail(BT_ERR_INVALID, "BATON_SPEC_FIXED_K expects 1 or 0, got '%s'", fixed);
        }
        e.spec_fixed_k = fixed[0] == '1';
    }
    *out = e;
    return BT_OK;
}

/* The model, its fingerprint and its context. */
static bt_status load_model(bt_ne_t *ne, const char *path)
{
    bt_status st = bt_model_load(path, &ne->m);
    if (st) return bt_fail(st, "cannot load model %s: %s", path, bt_last_error());
    snprintf(ne->fingerprint, sizeof ne->fingerprint, "%016" PRIx64, ne->m->fingerprint);
    ne->n_vocab = ne->m->hp.n_vocab;
    ne->max_context = bt_sched_default_context(ne->m);
    return BT_OK;
}

/* How many KV blocks --kv-mem holds, the context they allow, the batch limits and the pool's layout. */
static bt_status size_pool(bt_ne_t *ne, const bt_ne_config_t *cfg, const char *name, size_t *n_blocks_out)
{
    size_t stride = bt_kv_block_stride(&ne->m->hp, BT_KV_F16);
    ne->kv_block_bytes = stride * (size_t)ne->m->hp.n_layer;
    size_t kv_mem = cfg->kv_mem ? cfg->kv_mem : BT_SCHED_DEFAULT_KV_MEM;
    size_t n_blocks = kv_mem / ne->kv_block_bytes;
    if (n_blocks < 1 || n_blocks > KVX_MAX_BLOCKS * 64u)
        return bt_fail(BT_ERR_INVALID, "--kv-mem %zu bytes holds %zu KV blocks of %s (%zu bytes each)", kv_mem,
                       n_blocks, ne->m->name, ne->kv_block_bytes);
    /* A sequence can never outgrow the pool: clamp the context so that max_tokens 0 ("up to the context") and the
     * capacity published to the router stay servable. */
    if (n_blocks * BT_KV_BLOCK < (size_t)ne->max_context) {
        BT_INFO(name, "context limited to %zu tokens by the KV pool (%zu MiB); raise --kv-mem for %d",
                n_blocks * BT_KV_BLOCK, kv_mem >> 20, ne->max_context);
        ne->max_context = (int32_t)(n_blocks * BT_KV_BLOCK);
    }
    ne->max_running = cfg->max_running > 0 ? cfg->max_running : BT_SCHED_DEFAULT_MAX_RUNNING;
    ne->max_batch_tokens = cfg->max_batch_tokens > 0 ? cfg->max_batch_tokens : BT_SCHED_DEFAULT_BATCH_TOKENS;
    ne->layout = (kvx_layout_t){.n_layers = (uint32_t)ne->m->hp.n_layer, .n_blocks = (uint32_t)n_blocks,
                                .block_stride = stride, .fingerprint = layout_fingerprint(ne->m, BT_KV_F16)};
    *n_blocks_out = n_blocks;
    return BT_OK;
}

/* A GPU node's pool: device memory from the backend registered as UCS_MEMORY_TYPE_CUDA. A UCX that cannot move
 * CUDA memory (Debian's) leaves the node serving without KV transfer, its pool allocated by the scheduler. */
static bt_status start_kvx_cuda(bt_ne_t *ne, const char *name, size_t n_blocks, void **kv_memory)
{
    size_t bytes = n_blocks * ne->kv_block_bytes;
    ne->kv_device_mem = ne->be->ops->buf_alloc(ne->be, bytes);
    if (!ne->kv_device_mem)
        return bt_fail(BT_ERR_NOMEM, "cannot allocate a KV pool of %zu MiB on the GPU", bytes >> 20);
    bt_status st = kvx_pool_register(ne->kvx, &ne->layout, ne->kv_device_mem, KVX_MEM_CUDA, &ne->kvx_pool);
    if (st == BT_OK) {
        *kv_memory = ne->kv_device_mem;
        return BT_OK;
    }
    if (st != BT_ERR_UNSUPPORTED) return bt_fail(st, "cannot register the GPU KV pool with UCX: %s", bt_last_error());
    BT_WARN(name, "%s: serving without KV transfer (no remote prefill)", bt_last_error());
    ne->be->ops->buf_free(ne->be, ne->kv_device_mem);
    ne->kv_device_mem = NULL;
    kvx_context_destroy(ne->kvx);
    ne->kvx = NULL;
    return BT_OK;
}

/* The kvtransfer context and the KV pool registered with it (*kv_memory: its base), unless disabled. When UCX
 * cannot start the node serves without it (*kv_memory NULL: the scheduler allocates plain memory). Runs after
 * create_compute: a GPU node's pool comes from its backend. */
static bt_status start_kvx(bt_ne_t *ne, const bt_ne_config_t *cfg, const char *name, size_t n_blocks,
                           void **kv_memory)
{
    *kv_memory = NULL;
    if (cfg->disable_kvx) return BT_OK;
    /* GPU pools move by RMA puts only (kvx_push_create): the automatic path would pick host copies or messages */
    kvx_data_path_t path = cfg->env.use_cuda && cfg->env.kvx_path == KVX_PATH_AUTO ? KVX_PATH_PUT : cfg->env.kvx_path;
    kvx_context_opts_t ko = {.name = name, .data_path = path};
    bt_status st = kvx_context_create(&ko, &ne->kvx);
    if (st == BT_ERR_INVALID) return bt_fail(st, "kvtransfer: %s", bt_last_error());
    if (st != BT_OK) {
        BT_WARN(name, "kvtransfer unavailable (%s): serving without KV transfer (no remote prefill)", bt_last_error());
        ne->kvx = NULL;
        return BT_OK;
    }
    if (cfg->env.use_cuda) return start_kvx_cuda(ne, name, n_blocks, kv_memory);
    if (kvx_pool_create(ne->kvx, &ne->layout, &ne->kvx_pool) != BT_OK)
        return bt_fail(BT_ERR_NOMEM, "cannot register a KV pool of %zu MiB with UCX: %s",
                       (n_blocks * ne->kv_block_bytes) >> 20, bt_last_error());
    *kv_memory = kvx_pool_base(ne->kvx_pool);
    return BT_OK;
}

/* The vocabulary's end-of-generation ids (at most BT_NE_MAX_EOG), from the model's tokenizer. */
static bt_status read_eog(const bt_ne_t *ne, const char *path, int32_t *eog, int32_t *n_eog)
{
    tok_tokenizer *tok = NULL;
    bt_status st = tok_create(ne->m->file, &tok);
    if (st) return bt_fail(st, "cannot read the tokenizer of %s: %s", path, bt_last_error());
    *n_eog = 0;
    for (int32_t i = 0; i < tok_n_vocab(tok) && *n_eog < BT_NE_MAX_EOG; i++)
        if (tok_is_eog(tok, i)) eog[(*n_eog)++] = i;
    tok_free(tok);
    return BT_OK;
}

/* Structured output: the trie over the vocabulary's bytes and the cache of compiled grammars (DESIGN 4.4). */
static bt_status start_constraints(bt_ne_t *ne, const char *path)
{
    tok_tokenizer *tok = NULL;
    bt_status st = tok_create(ne->m->file, &tok);
    if (st) return bt_fail(st, "cannot read the tokenizer of %s: %s", path, bt_last_error());
    if (tok_n_vocab(tok) != ne->n_vocab) {
        tok_free(tok);
        return bt_fail(BT_ERR_FORMAT, "%s: the tokenizer has %d tokens, the model %d", path, tok_n_vocab(tok),
                       ne->n_vocab);
    }
    st = bt_constraint_vocab_from_tokenizer(tok, &ne->cvocab);
    tok_free(tok);
    if (!st) st = bt_constraint_cache_create(ne->cvocab, BT_NE_GRAMMAR_CACHE, &ne->ccache);
    return st;
}

int bt_ne_constraint(const bt_ne_t *ne, const char *grammar, bt_constraint **out, char *err, size_t cap)
{
    *out = NULL;
    if (!grammar || !grammar[0]) return 0;
    if (!ne->ccache) {
        snprintf(err, cap, "structured output is not available on this node");
        return -1;
    }
    if (bt_constraint_cache_get(ne->ccache, grammar, strlen(grammar), out)) {
        snprintf(err, cap, "%s", bt_last_error());
        return -1;
    }
    return 0;
}

/* The backend (cpu, or cuda with --device) and the speculative proposer (--spec; none by default). */
static bt_status create_compute(bt_ne_t *ne, const bt_ne_config_t *cfg, size_t n_blocks)
{
    bt_cpu_opts co = cfg->env.cpu;
    co.n_threads = cfg->threads;
    bt_status st = cfg->env.use_cuda ? bt_backend_cuda_create(cfg->env.cuda_device, &ne->be)
                                     : bt_backend_cpu_create(&co, &ne->be);
    if (st) return st;
    ne->spec = bt_spec_config_default();
    if (cfg->spec && cfg->spec[0] && (st = bt_spec_parse(cfg->spec, &ne->spec))) return st;
    if (cfg->spec_k_max) ne->spec.k_max = cfg->spec_k_max;
    ne->spec.profile = cfg->env.profile;
    return bt_spec_create(&ne->spec, ne->m, ne->be, (int32_t)(n_blocks * BT_KV_BLOCK), ne->max_batch_tokens,
                          &ne->proposer);
}

/* The scheduler over the pool (in kv_memory when kvtransfer registered it), warmed up, and its engine thread. */
static bt_status start_scheduler(bt_ne_t *ne, const bt_ne_config_t *cfg, const char *name, size_t n_blocks,
                                 void *kv_memory, const int32_t *eog, int32_t n_eog)
{
    bt_sched_config sc = {0};
    sc.proposer = ne->proposer;
    sc.spec_k_max = ne->spec.k_max;
    sc.spec_fixed_k = ne->spec_fixed_k = cfg->env.spec_fixed_k;
    sc.kv_mem = n_blocks * ne->kv_block_bytes;
    sc.kv_memory = kv_memory;
    sc.max_batch_tokens = ne->max_batch_tokens;
    sc.max_running = ne->max_running;
    sc.max_context = ne->max_context;
    sc.eog_ids = eog;
    sc.n_eog = n_eog;
    sc.profile = cfg->env.profile;
    if (cfg->env.step_trace_dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s-%ld.steps", cfg->env.step_trace_dir, name, (long)getpid());
        if (!(ne->step_trace = fopen(path, "w")))
            return bt_fail(BT_ERR_IO, "BATON_STEP_TRACE: cannot create %s: %s", path, strerror(errno));
        setvbuf(ne->step_trace, NULL, _IOLBF, 0); /* whole lines, whatever ends the process */
        fprintf(ne->step_trace, "# %s\n", BT_SCHED_TRACE_FIELDS);
        sc.step_trace = ne->step_trace;
        BT_INFO(name, "step trace: %s", path);
    }
    bt_status st = bt_sched_create(ne->m, ne->be, &sc, &ne->sched);
    if (st) return bt_fail(st, "cannot create the scheduler: %s", bt_last_error());
    ne->kv_blocks_total = bt_sched_kv_pool(ne->sched)->n_blocks;
    ne->kv_window = bt_sched_kv_window(ne->sched);
    if (ne->kv_window > 0) {
        ne->kv_layer_group = malloc((size_t)ne->m->hp.n_layer);
        if (!ne->kv_layer_group) return bt_fail(BT_ERR_NOMEM, "out of memory for the KV layer map");
        for (int32_t l = 0; l < ne->m->hp.n_layer; l++) ne->kv_layer_group[l] = ne->m->layers[l].window > 0;
    }
    double t0 = bt_sched_now();
    if ((st = bt_sched_warmup(ne->sched))) return bt_fail(st, "engine warm-up failed: %s", bt_last_error());
    BT_INFO(name, "engine warmed up in %.0f ms (one token through every layer: weights packed, tables built)",
            (bt_sched_now() - t0) * 1e3);
    return bt_sched_start(ne->sched);
}

bt_status bt_ne_create(const bt_ne_config_t *cfg, bt_ne_t **out)
{
    if (!cfg || !cfg->model_path) return bt_fail(BT_ERR_INVALID, "node engine: a model path is required");
    const char *name = cfg->name ? cfg->name : "node";
    bt_ne_t *ne = calloc(1, sizeof *ne);
    if (!ne) return bt_fail(BT_ERR_NOMEM, "out of memory creating the %s engine", name);
    pthread_mutex_init(&ne->load_mu, NULL);
    size_t n_blocks = 0;
    void *kv_memory = NULL;
    int32_t eog[BT_NE_MAX_EOG], n_eog = 0;
    bt_status st;
    if ((st = load_model(ne, cfg->model_path)) || (st = size_pool(ne, cfg, name, &n_blocks)) ||
        (st = create_compute(ne, cfg, n_blocks)) ||
        (st = start_kvx(ne, cfg, name, n_blocks, &kv_memory)) || (st = read_eog(ne, cfg->model_path, eog, &n_eog)) ||
        (st = start_constraints(ne, cfg->model_path)) ||
        (st = start_scheduler(ne, cfg, name, n_blocks, kv_memory, eog, n_eog))) {
        bt_ne_destroy(ne);
        return st;
    }
    ne->load_t = bt_sched_now();
    *out = ne;
    return BT_OK;
}

void bt_ne_destroy(bt_ne_t *ne)
{
    if (!ne) return;
    bt_sched_destroy(ne->sched); /* aborts what is left */
    if (ne->step_trace) fclose(ne->step_trace);
    bt_constraint_cache_free(ne->ccache); /* after the requests that held its grammars */
    bt_constraint_vocab_free(ne->cvocab);
    bt_proposer_destroy(ne->proposer);
    if (ne->kvx_pool && kvx_pool_destroy(ne->kvx_pool) != BT_OK)
        BT_WARN("node", "KV pool still in use at shutdown: %s", bt_last_error());
    kvx_context_destroy(ne->kvx);
    if (ne->kv_device_mem) ne->be->ops->buf_free(ne->be, ne->kv_device_mem);
    bt_backend_destroy(ne->be);
    bt_model_free(ne->m);
    free(ne->kv_layer_group);
    pthread_mutex_destroy(&ne->load_mu);
    free(ne);
}

bt_status bt_ne_node_info(const bt_ne_t *ne, mbr_role role, mbr_node_info_t *info)
{
    snprintf(info->model, sizeof info->model, "%s", ne->fingerprint);
    info->role = role;
    info->kv_blocks_total = ne->kv_blocks_total;
    info->kv_block_tokens = BT_KV_BLOCK;
    info->max_running = ne->max_running;
    info->max_context = ne->max_context;
    if (ne->kvx_pool) {
        size_t len;
        const void *d = kvx_pool_descriptor(ne->kvx_pool, &len);
        info->ucx_desc = malloc(len);
        if (!info->ucx_desc) return bt_fail(BT_ERR_NOMEM, "out of memory copying the KV pool descriptor");
        memcpy(info->ucx_desc, d, len);
        info->ucx_desc_len = len;
    }
    return BT_OK;
}

void bt_ne_summary(const bt_ne_t *ne, char *buf, size_t cap)
{
    char kmax[24] = "", kinds[512];
    if (ne->proposer) snprintf(kmax, sizeof kmax, "%d%s", ne->spec.k_max, ne->spec_fixed_k ? " (fixed)" : "");
    bt_backend_cpu_describe(ne->be, ne->m, kinds, sizeof kinds);
    snprintf(buf, cap,
             "model %s (fingerprint %s, %d layers, vocab %d) | cpu %s, %d threads, %d-bit activations, matmuls %s | "
             "KV %lld blocks x %d tokens (%.0f MiB f16, %s) | batch %d tokens, %d running, context %d | "
             "speculation %s%s%s",
             ne->m->name, ne->fingerprint, ne->m->hp.n_layer, ne->n_vocab, bt_backend_cpu_isa(ne->be),
             bt_backend_cpu_threads(ne->be), bt_backend_cpu_act_bits(ne->be), kinds, (long long)ne->kv_blocks_total,
             BT_KV_BLOCK, (double)ne->kv_block_bytes * (double)ne->kv_blocks_total / (1024.0 * 1024.0),
             ne->kvx_pool ? "registered with UCX" : "no kvtransfer", ne->max_batch_tokens, ne->max_running,
             ne->max_context, bt_spec_kind_name(ne->spec.kind), ne->proposer ? ", k up to " : "", kmax);
}

bt_status bt_ne_register_metrics(bt_ne_t *ne, metrics_registry_t *reg)
{
    static const struct {
        metrics_std_t id;
        size_t off;
    } gauges[] = {
        {METRICS_STD_RUNNING_SEQUENCES, offsetof(bt_ne_t, g_running)},
        {METRICS_STD_WAITING_REQUESTS, offsetof(bt_ne_t, g_waiting)},
        {METRICS_STD_KV_BLOCKS_USED, offsetof(bt_ne_t, g_kv_used)},
        {METRICS_STD_KV_BLOCKS_CAPACITY, offsetof(bt_ne_t, g_kv_capacity)},
    };
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++) {
        bt_status st = metrics_std_gauge(reg, gauges[i].id, (metrics_gauge_t **)((char *)ne + gauges[i].off));
        if (st) return st;
    }
    metrics_gauge_set(ne->g_kv_capacity, (double)ne->kv_blocks_total);
    bt_status st = metrics_gauge_register(reg, "baton_kv_bytes_used",
                                          "Bytes of KV cache held by sequences: used global blocks times the layers "
                                          "they hold, plus the sliding-window layers' used blocks times theirs.",
                                          &ne->g_kv_bytes);
    if (st) return st;
    st = metrics_counter_register(reg, "baton_preemptions_total",
                                            "Running sequences sent back to wait (and recompute later) because the KV "
                                            "pool ran out.",
                                            &ne->c_preemptions);
    if (st) return st;
    if (!ne->proposer) return BT_OK;
    const char *lv[1] = {bt_spec_kind_name(ne->spec.kind)};
    metrics_family_t *f;
    if ((st = metrics_std_register(reg, METRICS_STD_SPEC_PROPOSED, &f)) ||
        (st = metrics_family_counter(f, lv, &ne->c_spec_proposed)))
        return st;
    if ((st = metrics_std_register(reg, METRICS_STD_SPEC_ACCEPTED, &f)) ||
        (st = metrics_family_counter(f, lv, &ne->c_spec_accepted)))
        return st;
    if ((st = metrics_std_register(reg, METRICS_STD_SPEC_ACCEPTED_LENGTH, &f)) ||
        (st = metrics_family_histogram(f, lv, &ne->h_spec_accepted)))
        return st;
    return BT_OK;
}

/* Moves the scheduler's preemption and speculation counters into the metrics (deltas since the last call; under
 * load_mu). */
static void counters_update(bt_ne_t *ne, const bt_sched_stats *st)
{
    if (ne->c_preemptions && st->preemptions > ne->load_preemptions)
        metrics_counter_add(ne->c_preemptions, st->preemptions - ne->load_preemptions);
    ne->load_preemptions = st->preemptions;
    if (!ne->c_spec_proposed) return;
    if (st->spec_proposed > ne->load_spec_proposed)
        metrics_counter_add(ne->c_spec_proposed, st->spec_proposed - ne->load_spec_proposed);
    if (st->spec_accepted > ne->load_spec_accepted)
        metrics_counter_add(ne->c_spec_accepted, st->spec_accepted - ne->load_spec_accepted);
    ne->load_spec_proposed = st->spec_proposed;
    ne->load_spec_accepted = st->spec_accepted;
    for (int i = 0; i <= BT_SPEC_K_LIMIT; i++) {
        for (uint64_t n = ne->load_spec_hist[i]; n < st->spec_accepted_hist[i]; n++)
            metrics_histogram_observe(ne->h_spec_accepted, i);
        ne->load_spec_hist[i] = st->spec_accepted_hist[i];
    }
}

#define NE_RATE_MIN_BUSY_S 1.0

static double ewma(double old, double v) { return old > 0 ? 0.7 * old + 0.3 * v : v; }

void bt_ne_load(bt_ne_t *ne, mbr_load_report_t *out, bt_sched_stats *st)
{
    bt_sched_get_stats(ne->sched, st);
    pthread_mutex_lock(&ne->load_mu);
    double now = bt_sched_now(), dt = now - ne->load_t;
    if (dt > 0) {
        /* The prefill rate and step time come from the scheduler's step-time fit (marginal cost per token, fixed
         * cost per step), not from tokens per wall second, which would measure the offered load instead. */
        if (st->step_token_s > 0) ne->prefill_rate = 1.0 / st->step_token_s;
        if (st->step_fixed_s + st->step_token_s > 0) ne->step_s = st->step_fixed_s + st->step_token_s;
        /* decode: tokens per busy wall second (an idle node keeps its last figure), over at least
         * NE_RATE_MIN_BUSY_S: a step of many sequences emits all their tokens at once and can outlast the 100 ms
         * sample, so a rate per sample overstated it (1,200 tok/s reported for 180 delivered, 125 sequences) */
        int busy = st->generated_tokens > ne->load_generated || st->running > 0;
        if (busy) {
            ne->busy_s += dt;
            ne->busy_tokens += (double)(st->generated_tokens - ne->load_generated);
        }
        /* ... or over a whole busy period that ended sooner */
        if (ne->busy_tokens > 0 && (ne->busy_s >= NE_RATE_MIN_BUSY_S || !busy)) {
            ne->decode_rate = ewma(ne->decode_rate, ne->busy_tokens / ne->busy_s);
            ne->busy_s = ne->busy_tokens = 0;
        }
        if (st->decode_seq_steps > ne->load_dsteps)
            ne->tokens_per_step = ewma(ne->tokens_per_step, (double)(st->decode_tokens - ne->load_dtokens) /
                                                                (double)(st->decode_seq_steps - ne->load_dsteps));
        ne->load_dsteps = st->decode_seq_steps;
        ne->load_dtokens = st->decode_tokens;
        ne->load_computed = st->computed_prompt_tokens;
        ne->load_generated = st->generated_tokens;
        ne->load_steps = st->steps;
        ne->load_t = now;
    }
    out->prefill_tok_s = ne->prefill_rate;
    out->decode_tok_s = ne->decode_rate;
    out->step_s = ne->step_s;
    out->step_fixed_s = st->step_fixed_s > 0 ? st->step_fixed_s : 0;
    out->step_token_s = st->step_token_s > 0 ? st->step_token_s : 0;
    out->decode_fixed_s = st->decode_fixed_s > 0 ? st->decode_fixed_s : 0;
    out->decode_row_s = st->decode_row_s > 0 ? st->decode_row_s : 0;
    out->tokens_per_step = ne->tokens_per_step;
    counters_update(ne, st);
    pthread_mutex_unlock(&ne->load_mu);
    metrics_gauge_set(ne->g_running, st->running);
    metrics_gauge_set(ne->g_waiting, st->waiting);
    metrics_gauge_set(ne->g_kv_used, st->kv_blocks_used);
    if (ne->g_kv_bytes) metrics_gauge_set(ne->g_kv_bytes, (double)st->kv_bytes_used);
    metrics_gauge_set(ne->g_kv_capacity, st->kv_blocks_total);
    out->running_seqs = st->running;
    out->kv_blocks_total = st->kv_blocks_total;
    out->kv_blocks_free = st->kv_blocks_total - st->kv_blocks_used;
}

int bt_ne_sampling_from_proto(const bt_ne_t *ne, const Baton__V1__SamplingParams *p, int logprobs,
                              uint32_t top_logprobs, uint32_t sample_index, uint64_t seed_or_random, bt_sampling *sp,
                              char *err, size_t cap)
{
    if (p) {
        if (p->temperature_opt_case == BATON__V1__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE)
            sp->temperature = p->temperature;
        if (p->top_p_opt_case == BATON__V1__SAMPLING_PARAMS__TOP_P_OPT_TOP_P) sp->top_p = p->top_p;
        if (p->top_k_opt_case == BATON__V1__SAMPLING_PARAMS__TOP_K_OPT_TOP_K) sp->top_k = p->top_k;
        if (p->min_p_opt_case == BATON__V1__SAMPLING_PARAMS__MIN_P_OPT_MIN_P) sp->min_p = p->min_p;
        if (p->repetition_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__REPETITION_PENALTY_OPT_REPETITION_PENALTY)
            sp->repetition_penalty = p->repetition_penalty;
        if (p->presence_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__PRESENCE_PENALTY_OPT_PRESENCE_PENALTY)
            sp->presence_penalty = p->presence_penalty;
        if (p->frequency_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__FREQUENCY_PENALTY_OPT_FREQUENCY_PENALTY)
            sp->frequency_penalty = p->frequency_penalty;
        if (p->n_logit_bias > BT_MAX_LOGIT_BIAS) {
            snprintf(err, cap, "sampling.logit_bias has %zu entries (at most %d)", p->n_logit_bias,
                     BT_MAX_LOGIT_BIAS);
            return -1;
        }
        for (size_t i = 0; i < p->n_logit_bias; i++) {
            const Baton__V1__LogitBias *e = p->logit_bias[i];
            if (e->token_id < 0 || e->token_id >= ne->n_vocab) {
                snprintf(err, cap, "sampling.logit_bias[%zu].token_id = %d is outside the vocabulary [0, %d)", i,
                         e->token_id, ne->n_vocab);
                return -1;
            }
            sp->logit_bias[i] = (bt_logit_bias){.id = e->token_id, .bias = e->bias};
        }
        sp->n_logit_bias = (int32_t)p->n_logit_bias;
    }
    sp->seed = p && p->seed_opt_case == BATON__V1__SAMPLING_PARAMS__SEED_OPT_SEED ? p->seed : seed_or_random;
    /* sample i of an n > 1 fan-out: its own RNG stream of the same seed */
    if (sample_index > (uint32_t)BT_MAX_N - 1) {
        snprintf(err, cap, "sample_index %u is out of range (at most %d)", sample_index, BT_MAX_N - 1);
        return -1;
    }
    sp->n = (int32_t)sample_index + 1;
    sp->logprobs = logprobs;
    if (top_logprobs > BT_MAX_TOP_LOGPROBS) {
        snprintf(err, cap, "top_logprobs is %u (at most %d)", top_logprobs, BT_MAX_TOP_LOGPROBS);
        return -1;
    }
    sp->top_logprobs = (int32_t)top_logprobs;
    if (bt_sampling_check_vocab(sp, ne->n_vocab) != BT_OK) {
        snprintf(err, cap, "%s", bt_last_error());
        return -1;
    }
    return 0;
}
