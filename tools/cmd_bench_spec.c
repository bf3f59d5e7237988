/* `baton bench --spec SPEC`: decode speed with and without speculative decoding on a workload of real prompts
 * (the JSON-lines files in tools/workloads), alternating the two in every repetition, through the continuous-batching scheduler at
 * each concurrency asked for. Checks that both runs produce the same tokens, and says why k was what it was. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/paths.h"
#include "engine/backend.h"
#include "engine/backend_cpu.h"
#include "engine/chat_template.h"
#include "engine/scheduler.h"
#include "engine/spec.h"
#include "engine/tokenizer.h"
#include "tools/bench_spec.h"
#include "tools/bench_util.h"
#include "tools/engine_env.h"
#include "tools/workload.h"

#define BS_MAX_PROMPTS 256
#define BS_MAX_REPS 50

typedef struct bs_prompt {
    char name[64];
    int32_t *ids;
    int32_t n;
} bs_prompt;

typedef struct bs_opts {
    const char *model, *workload, *json, *conc;
    bt_spec_config spec;
    long threads, reps, decode_n, requests;
    int fixed_k;
    float temperature;
    unsigned long long seed;
    cli_engine_env env; /* the environment switches, read after the options */
} bs_opts;

/* Decode-only steps by how many sequences ran in them: 1, 2-4, 5-8, 9-16, 17 and more (where speculation gains or
 * loses: the plan prices steps of up to BT_SPEC_CURVE_SEQS sequences by measured times, larger ones by the fit). */
#define BS_SIZES 5
static const int bs_size_lo[BS_SIZES] = {1, 2, 5, 9, 17};
static const char *const bs_size_name[BS_SIZES] = {"1", "2-4", "5-8", "9-16", "17+"};

static int bs_size_of(int32_t n_seqs)
{
    int b = 0;
    while (b + 1 < BS_SIZES && n_seqs >= bs_size_lo[b + 1]) b++;
    return b;
}

/* One run's figures. */
typedef struct bs_run {
    double decode_s;          /* seconds in steps that computed no prompt token */
    uint64_t decode_tokens;   /* tokens emitted in those steps */
    double all_s;             /* every step: the run's throughput, prompt work included */
    uint64_t all_tokens;
    double size_s[BS_SIZES];  /* the same by the sequences in the step (bs_size_of) */
    uint64_t size_tokens[BS_SIZES];
    uint64_t out_hash;        /* of every request's token sequence, in request order */
    bt_sched_stats st;
    double curve_ms[BT_SPEC_K_LIMIT + 2]; /* the plan's step-time estimates for conc sequences, by draft rows */
} bs_run;

typedef struct bs_track {
    uint64_t hash;   /* FNV-1a of (token, index) pairs */
    uint64_t tokens;
} bs_track;

static void bs_usage(FILE *out)
{
    fprintf(out,
            "usage: baton bench --spec ngram[:MIN-MAX]|draft:PATH|self:L [--workload FILE] [--concurrency N[,N...]]\n"
            "                   [--decode-tokens N] [--requests N] [--reps N] [--spec-k-max N] [--spec-fixed-k]\n"
            "                   [--temperature T --seed S] [--threads N] [--model PATH] [--json FILE]\n"
            "Runs every prompt of the workload (JSON lines {\"name\", \"chat\"} or {\"name\", \"prompt\"}; default\n"
            "tools/workloads/input-grounded.jsonl; tools/workloads/chat.jsonl holds open-ended chat) through the\n"
            "scheduler with at most N sequences running, once without and once with speculation per repetition\n"
            "(alternating which goes first), and reports decode tok/s (tokens emitted in steps that computed no\n"
            "prompt token, over those steps' time) as medians of --reps (default 3), the speed-up, the acceptance\n"
            "rate, the mean accepted drafts per verification, and the inputs of the adaptive-k rule. Both runs must\n"
            "produce the same tokens (the bench fails otherwise). --decode-tokens: output tokens per request\n"
            "(default 128; generation also stops at end of turn). Greedy unless --temperature is given.\n"
            "--requests N: submit N requests, the workload's prompts in turn (default: each prompt once). With\n"
            "more requests than N sequences, a finished sequence's slot is refilled at once, so the figure is the\n"
            "throughput at that concurrency; with as many as the concurrency it includes the batch draining at\n"
            "the end, where speculation leaves the slower sequences running in small steps.\n"
            "--spec-fixed-k always drafts --spec-k-max tokens (no adaptive k): what drafting alone would cost.\n");
}

static int parse_opts(int argc, char **argv, bs_opts *o)
{
    memset(o, 0, sizeof *o);
    o->spec = bt_spec_config_default();
    o->reps = 3;
    o->decode_n = 128;
    o->conc = "1";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bs_usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--spec-fixed-k")) {
            o->fixed_k = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "baton bench: unknown option or missing value: '%s'\n", a);
            return -1;
        }
        i++;
        char *end = NULL;
        errno = 0;
        if (!strcmp(a, "--spec")) {
            if (bt_spec_parse(v, &o->spec)) {
                fprintf(stderr, "baton bench: %s\n", bt_last_error());
                return -1;
            }
        } else if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--workload")) o->workload = v;
        else if (!strcmp(a, "--json")) o->json = v;
        else if (!strcmp(a, "--concurrency")) o->conc = v;
        else if (!strcmp(a, "--threads")) o->threads = strtol(v, &end, 10);
        else if (!strcmp(a, "--reps")) o->reps = strtol(v, &end, 10);
        else if (!strcmp(a, "--decode-tokens")) o->decode_n = strtol(v, &end, 10);
        else if (!strcmp(a, "--requests")) o->requests = strtol(v, &end, 10);
        else if (!strcmp(a, "--spec-k-max")) o->spec.k_max = (int32_t)strtol(v, &end, 10);
        else if (!strcmp(a, "--seed")) o->seed = strtoull(v, &end, 10);
        else if (!strcmp(a, "--temperature")) o->temperature = strtof(v, &end);
        else {
            fprintf(stderr, "baton bench: unknown option '%s' (with --spec; see baton bench --spec x --help)\n", a);
            return -1;
        }
        if (end && (end == v || *end || errno)) {
            fprintf(stderr, "baton bench: %s wants a number, not '%s'\n", a, v);
            return -1;
        }
    }
    if (o->threads < 0 || o->threads > 256 || o->reps < 1 || o->reps > BS_MAX_REPS || o->decode_n < 1 ||
        o->requests < 0 || o->requests > BS_MAX_PROMPTS ||
        o->decode_n > 4096 || o->spec.k_max < 1 || o->spec.k_max > BT_SPEC_K_LIMIT || o->temperature < 0 ||
        o->temperature > 100) {
        fprintf(stderr, "baton bench: a value is out of range (--reps 1..%d, --decode-tokens 1..4096, --requests 1..%d "
                        "or 0 for each prompt once, --spec-k-max 1..%d, --temperature 0..100)\n", BS_MAX_REPS,
                BS_MAX_PROMPTS, BT_SPEC_K_LIMIT);
        return -1;
    }
    if (o->spec.kind == BT_SPEC_NONE) {
        fprintf(stderr, "baton bench: --spec none has nothing to compare; give ngram, draft:PATH or self:L\n");
        return -1;
    }
    return 0;
}

/* Tokenizes one workload item: a chat message through the model's template, or a raw prompt with BOS rules. */
static int tokenize_item(const workload_item *it, const char *path, tok_tokenizer *tok, chat_tmpl *tmpl, bs_prompt *p)
{
    snprintf(p->name, sizeof p->name, "%s", it->name);
    char *rendered = NULL;
    const char *text = it->text;
    size_t len = strlen(text);
    if (it->chat) {
        chat_msg m = {"user", text, len, NULL};
        if (chat_tmpl_render(tmpl, &m, 1, 1, &rendered, &len)) {
            fprintf(stderr, "baton bench: %s (%s): %s\n", path, it->name, bt_last_error());
            return -1;
        }
        text = rendered;
    }
    tok_ids ids = {0};
    bt_status st = tok_encode(tok, text, len, TOK_PARSE_SPECIAL | (it->chat ? 0u : TOK_ADD_SPECIAL), &ids);
    free(rendered);
    if (st || ids.n == 0) {
        fprintf(stderr, "baton bench: %s (%s): %s\n", path, it->name, st ? bt_last_error() : "empty prompt");
        tok_ids_free(&ids);
        return -1;
    }
    p->ids = ids.ids; /* ownership moves to the prompt */
    p->n = (int32_t)ids.n;
    return 0;
}

static int load_workload(const char *path, const bt_model *m, bs_prompt *ps, int *n_out)
{
    workload_item *w = NULL;
    int n_w = 0, rc = 0, n = 0;
    if (workload_load("baton bench", path, BS_MAX_PROMPTS, &w, &n_w)) return -1;
    tok_tokenizer *tok = NULL;
    chat_tmpl tmpl;
    int have_tmpl = 0;
    if (tok_create(m->file, &tok) || chat_tmpl_init_gguf(&tmpl, m->file, NULL)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        rc = -1;
    } else {
        have_tmpl = 1;
    }
    for (int i = 0; i < n_w && !rc; i++)
        if ((rc = tokenize_item(&w[i], path, tok, &tmpl, &ps[n])) == 0) n++;
    if (have_tmpl) chat_tmpl_free(&tmpl);
    tok_free(tok);
    workload_free(w, n_w);
    *n_out = n;
    return rc;
}

static void track_emit(void *user, const bt_sched_event *ev)
{
    bs_track *t = user;
    if (ev->token < 0) return;
    t->tokens++;
    uint64_t h = t->hash ? t->hash : 0xcbf29ce484222325ull;
    h = (h ^ (uint64_t)(uint32_t)ev->token) * 0x100000001b3ull;
    t->hash = (h ^ (uint64_t)(uint32_t)ev->index) * 0x100000001b3ull;
}

/* Every prompt through one scheduler with at most conc running; speculating with pr when non-NULL. */
static int run_once(const bt_model *m, bt_backend *be, const bs_opts *o, const bs_prompt *ps, int n, int conc,
                    bt_proposer *pr, const int32_t *eog, int32_t n_eog, bs_run *out)
{
    int32_t longest = 0;
    for (int i = 0; i < n; i++) longest = ps[i].n > longest ? ps[i].n : longest;
    int32_t ctx = longest + (int32_t)o->decode_n + BT_SPEC_K_LIMIT + BT_KV_BLOCK;
    bt_sched_config cfg = {0};
    cfg.profile = o->env.profile;
    cfg.kv_mem = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer * (size_t)(conc * (ctx / BT_KV_BLOCK + 2));
    cfg.max_running = conc;
    cfg.max_context = ctx;
    cfg.disable_prefix_cache = 1; /* each run starts cold: the off and on runs do the same prompt work */
    cfg.eog_ids = eog;
    cfg.n_eog = n_eog;
    cfg.proposer = pr;
    cfg.spec_k_max = o->spec.k_max;
    cfg.spec_fixed_k = o->fixed_k;
    bt_sched *s = NULL;
    if (bt_sched_create(m, be, &cfg, &s)) return -1;
    bs_track *tr = calloc((size_t)n, sizeof *tr);
    if (!tr) {
        bt_sched_destroy(s);
        return -1;
    }
    bt_req_params p = bt_req_params_default();
    p.sampling.max_tokens = (int32_t)o->decode_n;
    p.sampling.temperature = o->temperature;
    p.sampling.seed = o->seed;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++)
        if (bt_sched_submit(s, ps[i].ids, ps[i].n, &p, track_emit, &tr[i], NULL)) rc = -1;
    memset(out, 0, sizeof *out);
    bt_sched_stats before, after;
    bt_sched_get_stats(s, &before);
    while (!rc && !bt_sched_idle(s)) {
        double t0 = bench_now_s();
        if (bt_sched_step(s) < 0) rc = -1;
        double dt = bench_now_s() - t0;
        bt_sched_get_stats(s, &after);
        out->all_s += dt;
        out->all_tokens += after.generated_tokens - before.generated_tokens;
        if (after.computed_prompt_tokens == before.computed_prompt_tokens) {
            uint64_t got = after.generated_tokens - before.generated_tokens;
            out->decode_s += dt;
            out->decode_tokens += got;
            int b = bs_size_of(before.running); /* the sequences that entered the step */
            out->size_s[b] += dt;
            out->size_tokens[b] += got;
        }
        before = after;
    }
    out->st = after;
    double cost[BT_SPEC_K_LIMIT + 2];
    bt_sched_spec_costs(s, conc, BT_SPEC_K_LIMIT + 1, cost);
    for (int e = 0; e < BT_SPEC_K_LIMIT + 2; e++) out->curve_ms[e] = cost[e] * 1e3;
    out->out_hash = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) out->out_hash = (out->out_hash ^ tr[i].hash ^ tr[i].tokens) * 0x100000001b3ull;
    free(tr);
    bt_sched_destroy(s);
    return rc;
}

/* The model's end-of-generation ids, so chat answers stop at end of turn as a server's would. */
static int32_t find_eog(const bt_model *m, int32_t *eog, int32_t cap)
{
    tok_tokenizer *tok = NULL;
    int32_t n = 0;
    if (tok_create(m->file, &tok)) return 0;
    for (int32_t i = 0; i < tok_n_vocab(tok) && n < cap; i++)
        if (tok_is_eog(tok, i)) eog[n++] = i;
    tok_free(tok);
    return n;
}

typedef struct bs_result {
    int conc;
    double off, on, ratio;       /* medians: decode tok/s without and with speculation, per-rep ratio */
    double all_off, all_on, all_ratio; /* the same over every step (output tok/s of the whole run) */
    double accept, mean_acc;     /* accepted / proposed; accepted per verification */
    double k_mean, threshold, alpha, row_ms, fixed_ms;
    double planned;              /* share of the steps that could draft priced by the measured curve */
    uint64_t checked, checked_plain; /* steps of more than BT_SPEC_CURVE_SEQS decided by the check; made plain */
    double curve_ms[BT_SPEC_K_LIMIT + 2];
    uint64_t proposed, accepted, verifications;
    double size_s[2][BS_SIZES];          /* off, on: decode-only seconds and tokens by step size, over all reps */
    uint64_t size_tokens[2][BS_SIZES];
} bs_result;

static int bench_conc(const bt_model *m, bt_backend *be, const bs_opts *o, const bs_prompt *ps, int n, int conc,
                      bt_proposer *pr, const int32_t *eog, int32_t n_eog, bs_result *res)
{
    double off[BS_MAX_REPS], on[BS_MAX_REPS], ratio[BS_MAX_REPS];
    double all_off[BS_MAX_REPS], all_on[BS_MAX_REPS], all_ratio[BS_MAX_REPS];
    memset(res, 0, sizeof *res);
    res->conc = conc;
    for (long r = 0; r < o->reps; r++) {
        bs_run a, b; /* a: without, b: with */
        for (int order = 0; order < 2; order++) {
            int spec_now = (order + (int)r) % 2; /* alternate which goes first */
            if (run_once(m, be, o, ps, n, conc, spec_now ? pr : NULL, eog, n_eog, spec_now ? &b : &a)) return -1;
        }
        if (a.out_hash != b.out_hash) {
            fprintf(stderr, "baton bench: speculation changed the output at concurrency %d (a bug: it must not)\n",
                    conc);
            return -2;
        }
        off[r] = a.decode_s > 0 ? (double)a.decode_tokens / a.decode_s : 0;
        on[r] = b.decode_s > 0 ? (double)b.decode_tokens / b.decode_s : 0;
        ratio[r] = off[r] > 0 ? on[r] / off[r] : 0;
        all_off[r] = a.all_s > 0 ? (double)a.all_tokens / a.all_s : 0;
        all_on[r] = b.all_s > 0 ? (double)b.all_tokens / b.all_s : 0;
        all_ratio[r] = all_off[r] > 0 ? all_on[r] / all_off[r] : 0;
        fprintf(stderr, "  concurrency %d rep %ld: %.1f -> %.1f decode tok/s (%.2fx)\n", conc, r + 1, off[r], on[r],
                ratio[r]);
        for (int z = 0; z < BS_SIZES; z++) {
            res->size_s[0][z] += a.size_s[z];
            res->size_s[1][z] += b.size_s[z];
            res->size_tokens[0][z] += a.size_tokens[z];
            res->size_tokens[1][z] += b.size_tokens[z];
        }
        res->proposed += b.st.spec_proposed;
        res->accepted += b.st.spec_accepted;
        res->verifications += b.st.spec_verifications;
        double nc = b.st.spec_considered_steps ? (double)b.st.spec_considered_steps : 1;
        res->k_mean = b.st.spec_k_sum / nc;
        uint64_t n_thr = b.st.spec_considered_steps - b.st.spec_planned_steps;
        res->threshold = n_thr ? b.st.spec_threshold_sum / (double)n_thr : 0;
        res->planned = (double)b.st.spec_planned_steps / nc;
        res->checked += b.st.spec_checked_steps;
        res->checked_plain += b.st.spec_checked_plain_steps;
        memcpy(res->curve_ms, b.curve_ms, sizeof res->curve_ms);
        res->alpha = b.st.spec_alpha_sum / nc;
        res->row_ms = b.st.decode_row_s * 1e3;
        res->fixed_ms = b.st.decode_fixed_s * 1e3;
    }
    res->off = bench_median(off, (int)o->reps);
    res->on = bench_median(on, (int)o->reps);
    res->ratio = bench_median(ratio, (int)o->reps);
    res->all_off = bench_median(all_off, (int)o->reps);
    res->all_on = bench_median(all_on, (int)o->reps);
    res->all_ratio = bench_median(all_ratio, (int)o->reps);
    res->accept = res->proposed ? (double)res->accepted / (double)res->proposed : 0;
    res->mean_acc = res->verifications ? (double)res->accepted / (double)res->verifications : 0;
    return 0;
}

static void print_result(const bs_result *r, int32_t k_max, FILE *jf, int first)
{
    printf("%-12d %14.1f %14.1f %9.2fx %10.1f%% %12.2f %8.2f\n", r->conc, r->off, r->on, r->ratio, 100 * r->accept,
           r->mean_acc, r->k_mean);
    printf("             k: mean %.2f of at most %d over the steps that could draft; the sequences' acceptance estimate\n"
           "             averaged %.2f. %.0f%% of those steps were decode-only and took the drafts that maximize expected\n"
           "             tokens per second under the measured step times (ms, %d sequences, by draft rows 0..%d:",
           r->k_mean, k_max, r->alpha, 100 * r->planned, r->conc, k_max + 1);
    for (int e = 0; e <= k_max + 1 && e < BT_SPEC_K_LIMIT + 2; e++) printf(" %.2f", r->curve_ms[e]);
    printf(");\n             the others (prompt chunks in the step) a draft kept with p > %.2f on average (a row %.3f ms\n"
           "             against a step's fixed %.3f ms in the fitted model, raised where drafting steps were slower)\n",
           r->threshold, r->row_ms, r->fixed_ms);
    printf("             every step (prompt chunks included): %.1f -> %.1f output tok/s (%.2fx)\n", r->all_off, r->all_on,
           r->all_ratio);
    if (r->checked)
        printf("             decode-only steps of more than %d sequences: %llu; the drafting check made %.0f%% of them plain\n"
               "             (drafting steps of their size measured slower per emitted token, or the 1 in %d that keeps\n"
               "             both kinds measured)\n",
               BT_SPEC_CURVE_SEQS, (unsigned long long)r->checked, 100.0 * (double)r->checked_plain / (double)r->checked,
               BT_SPEC_CHECK_ALTERNATE);
    /* where the speed-up came from: decode-only steps by their sequences, over every rep (their share of the
     * run's decode time without speculation; tok/s off -> on) */
    double off_all = 0;
    for (int z = 0; z < BS_SIZES; z++) off_all += r->size_s[0][z];
    printf("             by sequences in the step (share of decode time off; tok/s off -> on):");
    for (int z = 0; z < BS_SIZES; z++) {
        if (r->size_s[0][z] <= 0 || r->size_s[1][z] <= 0) continue;
        double a = (double)r->size_tokens[0][z] / r->size_s[0][z], b = (double)r->size_tokens[1][z] / r->size_s[1][z];
        printf(" %s: %.0f%%, %.0f -> %.0f (%.2fx);", bs_size_name[z], 100 * r->size_s[0][z] / off_all, a, b, b / a);
    }
    printf("\n");
    if (jf)
        fprintf(jf,
                "%s{\"concurrency\": %d, \"decode_tok_s_off\": %.2f, \"decode_tok_s_on\": %.2f, \"speedup\": %.4f, "
                "\"drafts_proposed\": %llu, \"drafts_accepted\": %llu, \"verifications\": %llu, "
                "\"acceptance_rate\": %.4f, \"mean_accepted_per_verification\": %.4f, \"k_mean\": %.3f, "
                "\"threshold\": %.4f, \"alpha\": %.4f, \"decode_row_ms\": %.4f, \"decode_fixed_ms\": %.4f, "
                "\"planned_share\": %.4f, \"checked_steps\": %llu, \"checked_plain_steps\": %llu, "
                "\"all_tok_s_off\": %.2f, \"all_tok_s_on\": %.2f, \"all_speedup\": %.4f, "
                "\"step_ms_by_draft_rows\": [",
                first ? "" : ", ", r->conc, r->off, r->on, r->ratio, (unsigned long long)r->proposed,
                (unsigned long long)r->accepted, (unsigned long long)r->verifications, r->accept, r->mean_acc,
                r->k_mean, r->threshold, r->alpha, r->row_ms, r->fixed_ms, r->planned,
                (unsigned long long)r->checked, (unsigned long long)r->checked_plain, r->all_off, r->all_on,
                r->all_ratio);
    if (jf) {
        for (int e = 0; e <= k_max + 1 && e < BT_SPEC_K_LIMIT + 2; e++) fprintf(jf, "%s%.4f", e ? ", " : "", r->curve_ms[e]);
        fprintf(jf, "], \"by_step_size\": [");
        for (int z = 0; z < BS_SIZES; z++)
            fprintf(jf, "%s{\"min_seqs\": %d, \"off_s\": %.4f, \"off_tokens\": %llu, \"on_s\": %.4f, \"on_tokens\": %llu}",
                    z ? ", " : "", bs_size_lo[z], r->size_s[0][z], (unsigned long long)r->size_tokens[0][z], r->size_s[1][z],
                    (unsigned long long)r->size_tokens[1][z]);
        fprintf(jf, "]}");
    }
}

int bench_spec_main(int argc, char **argv)
{
    bs_opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;
    if (cli_engine_env_read("bench", (int)o.threads, &o.env)) return 1;
    o.spec.profile = o.env.profile;
    char def[4096], wl[4096];
    if (!o.model) {
        if (bt_default_model_path(def, sizeof def)) {
            fprintf(stderr, "baton bench: %s\n", bt_last_error());
            return 1;
        }
        o.model = def;
    }
    if (!o.workload) {
        snprintf(wl, sizeof wl, "%s/tools/workloads/input-grounded.jsonl", BATON_SOURCE_DIR);
        o.workload = wl;
    }
    bt_model *m = NULL;
    if (bt_model_load(o.model, &m)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        return 1;
    }
    static bs_prompt ps[BS_MAX_PROMPTS];
    int n = 0, n_loaded = 0, rc = 1;
    bt_backend *be = NULL;
    bt_proposer *pr = NULL;
    FILE *jf = NULL;
    int32_t eog[16];
    int32_t n_eog = find_eog(m, eog, 16);
    int lrc = load_workload(o.workload, m, ps, &n);
    n_loaded = n;
    if (lrc) goto out;
    for (; n < o.requests; n++) ps[n] = ps[n % n_loaded]; /* shares the token ids of the loaded prompt */
    if (bt_backend_cpu_create(&o.env.cpu, &be)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        goto out;
    }
    int32_t longest = 0;
    for (int i = 0; i < n; i++) longest = ps[i].n > longest ? ps[i].n : longest;
    if (bt_spec_create(&o.spec, m, be, n * (longest + (int32_t)o.decode_n + 2 * BT_SPEC_K_LIMIT), n, &pr)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        goto out;
    }
    printf("%s | %s kernels, %d threads | workload %s: %d prompts, %d requests, up to %ld output tokens each, %s | "
           "speculation %s, k up to %d\n",
           m->name, bt_backend_cpu_isa(be), bt_backend_cpu_threads(be), o.workload, n_loaded, n, o.decode_n,
           o.temperature > 0 ? "sampled" : "greedy", bt_spec_kind_name(o.spec.kind), o.spec.k_max);
    printf("%-12s %14s %14s %10s %11s %12s %8s\n", "concurrency", "off tok/s", "on tok/s", "speed-up", "accepted",
           "acc/verify", "mean k");
    if (o.json && !(jf = fopen(o.json, "w"))) {
        fprintf(stderr, "baton bench: cannot write %s: %s\n", o.json, strerror(errno));
        goto out;
    }
    if (jf)
        fprintf(jf, "{\"model\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"workload\": \"%s\", \"prompts\": %d, "
                    "\"requests\": %d, "
                    "\"decode_tokens\": %ld, \"spec\": \"%s\", \"k_max\": %d, \"temperature\": %.3f, \"runs\": [",
                m->name, bt_backend_cpu_isa(be), bt_backend_cpu_threads(be), o.workload, n_loaded, n, o.decode_n,
                bt_spec_kind_name(o.spec.kind), o.spec.k_max, o.temperature);
    char *list = strdup(o.conc), *save = NULL;
    rc = 0;
    int first = 1;
    for (char *t = strtok_r(list, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        int c = atoi(t);
        if (c < 1 || c > 1024) {
            fprintf(stderr, "baton bench: bad concurrency '%s'\n", t);
            rc = 2;
            break;
        }
        bs_result res;
        int brc = bench_conc(m, be, &o, ps, n, c, pr, eog, n_eog, &res);
        if (brc) {
            if (brc == -1) fprintf(stderr, "baton bench: %s\n", bt_last_error());
            rc = 1;
            break;
        }
        print_result(&res, o.spec.k_max, jf, first);
        first = 0;
    }
    free(list);
    if (jf) fprintf(jf, "]}\n");
out:
    if (jf) fclose(jf);
    bt_proposer_destroy(pr);
    bt_backend_destroy(be);
    for (int i = 0; i < n_loaded; i++) free(ps[i].ids);
    bt_model_free(m);
    return rc;
}
