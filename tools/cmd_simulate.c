/* `baton simulate`: flags, the profile and the workload in; tools/sim does the simulation and the report. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "router/router.h"
#include "tools/commands.h"
#include "tools/sim/sim.h"
#include "tools/workload.h"

#define SM_LINE_MAX 4096

/* The workload: a trace file (JSON lines with t, prompt_tokens, output_tokens) or a generator (bench-serve's draw). */
typedef struct sm_wl {
    FILE *trace;
    const char *path;
    int lineno;
    double last_t;
    int bad;                 /* the trace had a bad line: message printed */
    wl_draw_t draw;
    long requests;           /* generator: how many (0 = until duration) */
    long drawn;
    double duration;
    uint32_t prefix_groups;  /* generator: requests share one of this many prefixes (0 = none) */
    int32_t prefix_tokens;
    uint64_t group_rng;
} sm_wl_t;

static int trace_next(sm_wl_t *w, sim_arrival_t *a)
{
    char line[SM_LINE_MAX];
    while (fgets(line, sizeof line, w->trace)) {
        w->lineno++;
        if (line[strspn(line, " \t\r\n")] == 0) continue;
        cJSON *j = cJSON_Parse(line);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "t"), *p = cJSON_GetObjectItemCaseSensitive(j, "prompt_tokens"),
                    *o = cJSON_GetObjectItemCaseSensitive(j, "output_tokens"),
                    *g = cJSON_GetObjectItemCaseSensitive(j, "prefix_group"),
                    *gt = cJSON_GetObjectItemCaseSensitive(j, "prefix_tokens");
        int ok = cJSON_IsNumber(t) && cJSON_IsNumber(p) && cJSON_IsNumber(o) && t->valuedouble >= w->last_t &&
                 p->valuedouble >= 1 && o->valuedouble >= 1 && p->valuedouble < 1e7 && o->valuedouble < 1e7 &&
                 (!g || cJSON_IsNumber(g)) && (!gt || cJSON_IsNumber(gt));
        if (ok) {
            memset(a, 0, sizeof *a);
            a->t = w->last_t = t->valuedouble;
            a->prompt_tokens = (int32_t)p->valuedouble;
            a->output_tokens = (int32_t)o->valuedouble;
            a->prefix_group = g ? (uint32_t)g->valuedouble : 0;
            a->prefix_tokens = gt ? (int32_t)gt->valuedouble : 0;
        }
        cJSON_Delete(j);
        if (!ok) {
            fprintf(stderr, "baton simulate: %s:%d: want {\"t\": seconds (not decreasing), \"prompt_tokens\": N >= 1, "
                            "\"output_tokens\": N >= 1} (optional prefix_group, prefix_tokens)\n", w->path, w->lineno);
            w->bad = 1;
            return 1;
        }
        return 0;
    }
    return 1;
}

static int wl_next(void *ud, sim_arrival_t *a)
{
    sm_wl_t *w = ud;
    if (w->trace) return trace_next(w, a);
    if (w->requests && w->drawn >= w->requests) return 1;
    int plen, olen;
    uint64_t pseed;
    memset(a, 0, sizeof *a);
    wl_draw_next(&w->draw, &a->t, &plen, &olen, &pseed);
    if (!w->requests && a->t >= w->duration && w->drawn > 0) return 1;
    w->drawn++;
    a->prompt_tokens = plen;
    a->output_tokens = olen;
    if (w->prefix_groups) {
        a->prefix_group = 1 + (uint32_t)(wl_rng_next(&w->group_rng) % w->prefix_groups);
        a->prefix_tokens = w->prefix_tokens < plen ? w->prefix_tokens : plen;
    }
    return 0;
}

typedef struct sm_opts {
    const char *profile, *workload, *json;
    double rate, duration, prompt_mean, prompt_sd, output_mean, output_sd;
    long requests, rate_index;
    unsigned long long seed;
    long prefix_groups, prefix_tokens;
    int have_rate;
} sm_opts;

static void usage(FILE *o)
{
    fprintf(o,
            "usage: baton simulate --profile P.json --decode M [--prefill N] (--workload W | --rate R ...)\n"
            "Discrete-event simulation of a cluster: the router's own placement, prefix index, admission and\n"
            "planner code, prefill nodes with chunked prefill, decode nodes with continuous batching, KV\n"
            "transfers over each prefill node's link, node failures and migrations. Prints TTFT/TPOT/E2E\n"
            "percentiles, goodput at the SLO, utilisation per node and the planner's answer over time.\n"
            "  --profile FILE          a `baton profile` JSON (or one written by hand: see deploy/PLANNING.md)\n"
            "  --prefill N             prefill nodes (default 0: colocated, decode nodes prefill)\n"
            "  --decode M              decode nodes (at least 1)\n"
            "  --workload FILE         JSON lines: a trace, one request a line {\"t\": s, \"prompt_tokens\": N,\n"
            "                          \"output_tokens\": N[, \"prefix_group\": G, \"prefix_tokens\": N]}; or one line\n"
            "                          {\"rate\": R, \"duration_s\": S | \"requests\": N, \"prompt_tokens\": M,\n"
            "                          \"prompt_sd\": SD, \"output_tokens\": M, \"output_sd\": SD, \"seed\": S,\n"
            "                          \"rate_index\": K} drawn exactly as `baton bench-serve` draws them\n"
            "  --rate R --duration S | --requests N  --prompt-tokens M[:SD] --output-tokens M[:SD] --seed S\n"
            "                          the same generator from flags (bench-serve's flags; --rate-index K picks\n"
            "                          the draw of bench-serve's K-th rate, default 0)\n"
            "  --prefix-share G:T      generated requests share one of G prefixes of T tokens (runs the prefix index)\n"
            "  --slo-ttft-ms MS, --slo-tpot-ms MS   goodput and planner targets (default 2000, 200)\n"
            "  --prefill-mode auto|local|remote     as baton-router (default auto)\n"
            "  --max-queue-s S         admission bound as baton-router (default 30; 0 = default, -1 = off)\n"
            "  --admit-ttft-slo-ms MS  refuse requests predicted over MS, as baton-router --ttft-slo-ms\n"
            "  --transport NAME        the profile's transport for KV pushes (default its first)\n"
            "  --link-gbps G, --link-latency-us U   override the link (per prefill node)\n"
            "  --fail T:ROLE:COUNT[:REPAIR_S]       at T s, COUNT nodes of ROLE (prefill|decode) fail, back after\n"
            "                          REPAIR_S (default: never); repeatable\n"
            "  --planner-window N      ticks a lower planner answer must hold (default 60)\n"
            "  --sim-seed S            the router's random choices (default 1)\n"
            "  --json FILE             the report as JSON (\"-\" = stdout, instead of the text)\n"
            "Bad flags, an unreadable or malformed profile or workload: one error line, exit code 2.\n");
}

static int num(const char *flag, const char *v, double lo, double hi, double *out)
{
    char *e = NULL;
    errno = 0;
    double x = strtod(v, &e);
    if (!*v || *e || errno || !(x >= lo && x <= hi)) {
        fprintf(stderr, "baton simulate: %s: '%s' is not a number from %g to %g\n", flag, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int mean_sd(const char *flag, const char *v, double *mean, double *sd)
{
    char buf[64];
    snprintf(buf, sizeof buf, "%s", v);
    char *c = strchr(buf, ':');
    *sd = 0;
    if (c) {
        *c = '\0';
        if (num(flag, c + 1, 0, 1e6, sd)) return -1;
    }
    return num(flag, buf, 1, 1e6, mean);
}

static char *read_file(const char *what, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "baton simulate: cannot open the %s %s: %s\n", what, path, strerror(errno));
        return NULL;
    }
    char *buf = malloc(4 << 20);
    size_t n = buf ? fread(buf, 1, (4 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) {
        fprintf(stderr, "baton simulate: out of memory\n");
        return NULL;
    }
    buf[n] = '\0';
    return buf;
}

static int parse_fail(const char *v, sim_config_t *c)
{
    char role[16];
    double t, repair = 0;
    int count, n = sscanf(v, "%lf:%15[a-z]:%d:%lf", &t, role, &count, &repair);
    if (c->n_fails >= SIM_MAX_FAILS || n < 3 || t < 0 || count < 1 || (strcmp(role, "decode") && strcmp(role, "prefill"))) {
        fprintf(stderr, "baton simulate: --fail: want T:prefill|decode:COUNT[:REPAIR_S], not '%s' (at most %d)\n", v,
                SIM_MAX_FAILS);
        return -1;
    }
    sim_fail_t *f = &c->fails[c->n_fails++];
    f->t = t;
    f->decode = !strcmp(role, "decode");
    f->count = count;
    f->repair_s = n == 4 ? repair : 0;
    return 0;
}

/* A generator spec line of --workload into o. 0, or -1 with the reason printed. */
static int parse_spec(const char *path, const cJSON *j, sm_opts *o)
{
    struct {
        const char *key;
        double *dst;
        double lo, hi;
    } f[] = {{"rate", &o->rate, 1e-6, 1e9}, {"duration_s", &o->duration, 1e-3, 1e7},
             {"prompt_tokens", &o->prompt_mean, 1, 1e6}, {"prompt_sd", &o->prompt_sd, 0, 1e6},
             {"output_tokens", &o->output_mean, 1, 1e6}, {"output_sd", &o->output_sd, 0, 1e6}};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, f[i].key);
        if (!v) continue;
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= f[i].lo && v->valuedouble <= f[i].hi)) {
            fprintf(stderr, "baton simulate: %s: \"%s\" must be a number from %g to %g\n", path, f[i].key, f[i].lo, f[i].hi);
            return -1;
        }
        *f[i].dst = v->valuedouble;
    }
    const cJSON *rq = cJSON_GetObjectItemCaseSensitive(j, "requests"), *sd = cJSON_GetObjectItemCaseSensitive(j, "seed"),
                *ri = cJSON_GetObjectItemCaseSensitive(j, "rate_index"), *pg = cJSON_GetObjectItemCaseSensitive(j, "prefix_groups"),
                *pt = cJSON_GetObjectItemCaseSensitive(j, "prefix_tokens");
    if ((rq && (!cJSON_IsNumber(rq) || rq->valuedouble < 1)) || (sd && (!cJSON_IsNumber(sd) || sd->valuedouble < 0)) ||
        (ri && (!cJSON_IsNumber(ri) || ri->valuedouble < 0)) || (pg && !cJSON_IsNumber(pg)) || (pt && !cJSON_IsNumber(pt))) {
        fprintf(stderr, "baton simulate: %s: requests, seed, rate_index, prefix_groups, prefix_tokens must be numbers >= 0\n", path);
        return -1;
    }
    if (rq) o->requests = (long)rq->valuedouble;
    if (sd) o->seed = (unsigned long long)sd->valuedouble;
    if (ri) o->rate_index = (long)ri->valuedouble;
    if (pg) o->prefix_groups = (long)pg->valuedouble;
    if (pt) o->prefix_tokens = (long)pt->valuedouble;
    if (!o->requests && !(o->duration > 0)) {
        fprintf(stderr, "baton simulate: %s: a generator line needs \"duration_s\" or \"requests\"\n", path);
        return -1;
    }
    o->have_rate = 1;
    return 0;
}

/* Opens --workload: a trace (w->trace set) or a generator line (into o). 0, or -1 printed. */
static int open_workload(sm_opts *o, sm_wl_t *w)
{
    FILE *f = fopen(o->workload, "r");
    if (!f) {
        fprintf(stderr, "baton simulate: cannot open the workload %s: %s\n", o->workload, strerror(errno));
        return -1;
    }
    char line[SM_LINE_MAX];
    long pos = 0;
    int lineno = 0;
    while ((pos = ftell(f)) >= 0 && fgets(line, sizeof line, f)) {
        lineno++;
        if (line[strspn(line, " \t\r\n")] == 0) continue;
        cJSON *j = cJSON_Parse(line);
        if (!cJSON_IsObject(j)) {
            fprintf(stderr, "baton simulate: %s:%d: not a JSON object\n", o->workload, lineno);
            cJSON_Delete(j);
            fclose(f);
            return -1;
        }
        int rc = 0;
        if (cJSON_GetObjectItemCaseSensitive(j, "rate")) {
            rc = parse_spec(o->workload, j, o);
            fclose(f);
        } else if (cJSON_GetObjectItemCaseSensitive(j, "chat") || cJSON_GetObjectItemCaseSensitive(j, "prompt")) {
            fprintf(stderr, "baton simulate: %s holds prompt texts (a bench workload): the simulator wants token "
                            "counts: a trace or a generator line (see --help)\n", o->workload);
            rc = -1;
            fclose(f);
        } else {
            fseek(f, pos, SEEK_SET);
            w->trace = f;
            w->path = o->workload;
            w->lineno = lineno - 1;
        }
        cJSON_Delete(j);
        return rc;
    }
    fclose(f);
    fprintf(stderr, "baton simulate: the workload %s is empty\n", o->workload);
    return -1;
}

static int parse_flags(int argc, char **argv, sm_opts *o, sim_config_t *c)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 1;
        }
        if (!v) {
            fprintf(stderr, "baton simulate: unknown option or missing value: '%s' (see --help)\n", a);
            return -1;
        }
        i++;
        double x = 0;
        int bad = 0;
        if (!strcmp(a, "--profile")) o->profile = v;
        else if (!strcmp(a, "--workload")) o->workload = v;
        else if (!strcmp(a, "--json")) o->json = v;
        else if (!strcmp(a, "--prefill")) bad = num(a, v, 0, 500000, &x), c->n_prefill = (int)x;
        else if (!strcmp(a, "--decode")) bad = num(a, v, 1, 500000, &x), c->n_decode = (int)x;
        else if (!strcmp(a, "--rate")) bad = num(a, v, 1e-6, 1e9, &o->rate), o->have_rate = 1;
        else if (!strcmp(a, "--duration")) bad = num(a, v, 1e-3, 1e7, &o->duration);
        else if (!strcmp(a, "--requests")) bad = num(a, v, 1, 1e10, &x), o->requests = (long)x;
        else if (!strcmp(a, "--rate-index")) bad = num(a, v, 0, 31, &x), o->rate_index = (long)x;
        else if (!strcmp(a, "--seed")) bad = num(a, v, 0, 1e18, &x), o->seed = (unsigned long long)x;
        else if (!strcmp(a, "--sim-seed")) bad = num(a, v, 0, 1e18, &x), c->seed = (uint64_t)x;
        else if (!strcmp(a, "--prompt-tokens")) bad = mean_sd(a, v, &o->prompt_mean, &o->prompt_sd);
        else if (!strcmp(a, "--output-tokens")) bad = mean_sd(a, v, &o->output_mean, &o->output_sd);
        else if (!strcmp(a, "--prefix-share")) {
            bad = sscanf(v, "%ld:%ld", &o->prefix_groups, &o->prefix_tokens) != 2 || o->prefix_groups < 1 ||
                  o->prefix_tokens < 16;
            if (bad) fprintf(stderr, "baton simulate: --prefix-share: want GROUPS:TOKENS (TOKENS >= 16), not '%s'\n", v);
        } else if (!strcmp(a, "--slo-ttft-ms")) bad = num(a, v, 0.001, 1e7, &x), c->slo_ttft_s = x / 1e3;
        else if (!strcmp(a, "--slo-tpot-ms")) bad = num(a, v, 0.001, 1e7, &x), c->slo_tpot_s = x / 1e3;
        else if (!strcmp(a, "--admit-ttft-slo-ms")) bad = num(a, v, 0.001, 1e7, &x), c->admit_ttft_slo_s = x / 1e3;
        else if (!strcmp(a, "--max-queue-s")) bad = num(a, v, -1, 1e6, &c->max_queue_s);
        else if (!strcmp(a, "--transport")) c->transport = v;
        else if (!strcmp(a, "--link-gbps")) bad = num(a, v, 1e-6, 1e6, &x), c->link_bytes_s = x * 1e9 / 8;
        else if (!strcmp(a, "--link-latency-us")) bad = num(a, v, 0, 1e9, &x), c->link_latency_s = x / 1e6;
        else if (!strcmp(a, "--planner-window")) bad = num(a, v, 1, PLAN_MAX_WINDOW, &x), c->planner_window = (int)x;
        else if (!strcmp(a, "--fail")) bad = parse_fail(v, c);
        else if (!strcmp(a, "--prefill-mode")) {
            rtr_prefill_mode m;
            if ((bad = rtr_prefill_mode_parse(v, &m) != BT_OK)) fprintf(stderr, "baton simulate: %s\n", bt_last_error());
            c->prefill_mode = (int)m;
        } else {
            fprintf(stderr, "baton simulate: unknown option '%s' (see --help)\n", a);
            return -1;
        }
        if (bad) return -1;
    }
    return 0;
}

int cmd_simulate(int argc, char **argv)
{
    sm_opts o = {.prompt_mean = 256, .output_mean = 128};
    sim_config_t c;
    memset(&c, 0, sizeof c);
    c.slo_ttft_s = PLAN_DEFAULT_TTFT_S;
    c.slo_tpot_s = PLAN_DEFAULT_TPOT_S;
    c.overhead_s = RTR_PLACE_DEFAULT_OVERHEAD_MS / 1000.0;
    c.seed = 1;
    int rc = parse_flags(argc, argv, &o, &c);
    if (rc) return rc > 0 ? 0 : 2;
    if (!o.profile || !c.n_decode || (!o.workload && !o.have_rate)) {
        fprintf(stderr, "baton simulate: --profile, --decode and a workload (--workload, or --rate with --duration or "
                        "--requests) are required (see --help)\n");
        return 2;
    }
    char *txt = read_file("profile", o.profile);
    if (!txt) return 2;
    bt_status st = plan_profile_from_json(txt, &c.profile);
    free(txt);
    if (st) {
        fprintf(stderr, "baton simulate: %s: %s\n", o.profile, bt_last_error());
        return 2;
    }
    sm_wl_t w;
    memset(&w, 0, sizeof w);
    if (o.workload && open_workload(&o, &w)) return 2;
    if (!w.trace) {
        if (!o.requests && !(o.duration > 0)) {
            fprintf(stderr, "baton simulate: a generated workload needs --duration or --requests\n");
            return 2;
        }
        wl_draw_init(&w.draw, o.seed, (int)o.rate_index, o.rate, o.prompt_mean, o.prompt_sd, o.output_mean, o.output_sd);
        w.requests = o.requests;
        w.duration = o.duration;
        w.prefix_groups = (uint32_t)o.prefix_groups;
        w.prefix_tokens = (int32_t)o.prefix_tokens;
        w.group_rng = o.seed ^ 0xA0761D6478BD642Full;
    }
    c.use_prefix_index = w.prefix_groups > 0 || w.trace;
    sim_result_t res;
    st = sim_run(&c, wl_next, &w, &res);
    if (w.trace) fclose(w.trace);
    if (w.bad) {
        if (!st) sim_result_free(&res);
        return 2;
    }
    if (st) {
        fprintf(stderr, "baton simulate: %s\n", bt_last_error());
        return st == BT_ERR_INVALID ? 2 : 1;
    }
    rc = 0;
    if (o.json) {
        FILE *f = strcmp(o.json, "-") ? fopen(o.json, "w") : stdout;
        if (!f || sim_report_json(f, &c, &res) || (f != stdout && fclose(f))) {
            fprintf(stderr, "baton simulate: cannot write %s\n", o.json);
            rc = 1;
        }
    }
    if (!o.json || strcmp(o.json, "-")) sim_report_text(stdout, &c, &res);
    sim_result_free(&res);
    return rc;
}
