/* The simulation's report: a human summary, or one JSON object (sim.h). */
#include "tools/sim/sim.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

static void role_util(const sim_result_t *r, int from, int to, double span, double *mean, double *lo, double *hi)
{
    double sum = 0;
    *lo = INFINITY;
    *hi = 0;
    for (int i = from; i < to; i++) {
        double u = span > 0 ? r->nodes[i].busy_s / span : 0;
        sum += u;
        if (u < *lo) *lo = u;
        if (u > *hi) *hi = u;
    }
    *mean = to > from ? sum / (to - from) : 0;
    if (to <= from) *lo = 0;
}

static double goodput(const sim_result_t *r) { return r->arrivals_end_s > 0 ? (double)r->good / r->arrivals_end_s : 0; }

void sim_report_text(FILE *f, const sim_config_t *cfg, const sim_result_t *r)
{
    fprintf(f, "simulated %d prefill + %d decode nodes (%s), %.0f s of arrivals, %.1f s in all, in %.2f s wall "
               "(%llu events)\n",
            cfg->n_prefill, cfg->n_decode, cfg->n_prefill ? "disaggregated" : "colocated", r->arrivals_end_s,
            r->sim_end_s, r->wall_s, (unsigned long long)r->events);
    fprintf(f, "requests: %llu arrived, %llu finished, %llu rejected at admission, %llu failed; %llu migrations; "
               "prefill %llu remote, %llu local\n",
            (unsigned long long)r->arrived, (unsigned long long)r->finished, (unsigned long long)r->rejected,
            (unsigned long long)r->failed, (unsigned long long)r->migrations, (unsigned long long)r->remote_prefills,
            (unsigned long long)r->local_prefills);
    /* the parts of a remote prefill's TTFT when there were any: on the prefill node, then to the first token */
    const struct {
        const char *name;
        const sim_hist_t *h;
    } hs[] = {{"TTFT", &r->ttft}, {"TPOT", &r->tpot}, {"E2E", &r->e2e}, {"  on P", &r->prefill_node},
              {"  P->D", &r->after_prefill}};
    fprintf(f, "%-6s %10s %10s %10s %10s\n", "", "mean ms", "p50 ms", "p90 ms", "p99 ms");
    for (int i = 0; i < (r->prefill_node.n ? 5 : 3); i++)
        fprintf(f, "%-6s %10.1f %10.1f %10.1f %10.1f\n", hs[i].name, hs[i].h->n ? hs[i].h->sum / hs[i].h->n * 1e3 : 0,
                sim_hist_quantile(hs[i].h, 0.5) * 1e3, sim_hist_quantile(hs[i].h, 0.9) * 1e3,
                sim_hist_quantile(hs[i].h, 0.99) * 1e3);
    fprintf(f, "goodput: %.2f req/s within TTFT <= %.0f ms and TPOT <= %.0f ms (%.1f%% of arrivals)\n", goodput(r),
            cfg->slo_ttft_s * 1e3, cfg->slo_tpot_s * 1e3, r->arrived ? 100.0 * (double)r->good / (double)r->arrived : 0);
    double mean, lo, hi;
    if (cfg->n_prefill) {
        role_util(r, 0, cfg->n_prefill, r->sim_end_s, &mean, &lo, &hi);
        fprintf(f, "prefill utilisation: mean %.1f%%, min %.1f%%, max %.1f%%\n", mean * 100, lo * 100, hi * 100);
    }
    role_util(r, cfg->n_prefill, r->n_nodes, r->sim_end_s, &mean, &lo, &hi);
    fprintf(f, "decode utilisation: mean %.1f%%, min %.1f%%, max %.1f%%\n", mean * 100, lo * 100, hi * 100);
    if (r->n_nodes <= 16)
        for (int i = 0; i < r->n_nodes; i++)
            fprintf(f, "  %s%d: busy %.1f%%, %llu steps, %llu tokens, %d failures\n", i < cfg->n_prefill ? "p" : "d",
                    i < cfg->n_prefill ? i : i - cfg->n_prefill, r->sim_end_s > 0 ? 100 * r->nodes[i].busy_s / r->sim_end_s : 0,
                    (unsigned long long)r->nodes[i].steps, (unsigned long long)r->nodes[i].tokens, r->nodes[i].failures);
    fprintf(f, "planner (desired prefill/decode over time, smoothed):");
    int last_p = -1, last_d = -1, shown = 0;
    for (int i = 0; i < r->n_plan; i++) {
        const sim_plan_point_t *p = &r->plan[i];
        if (p->prefill == last_p && p->decode == last_d && i != r->n_plan - 1) continue;
        if (shown++ < 40) fprintf(f, " t=%.0fs %d/%d", p->t, p->prefill, p->decode);
        last_p = p->prefill;
        last_d = p->decode;
    }
    if (shown > 40) fprintf(f, " ... (%d changes)", shown);
    fprintf(f, "\n");
}

static cJSON *hist_json(const sim_hist_t *h)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", (double)h->n);
    cJSON_AddNumberToObject(o, "mean_s", h->n ? h->sum / h->n : 0);
    cJSON_AddNumberToObject(o, "p50_s", sim_hist_quantile(h, 0.5));
    cJSON_AddNumberToObject(o, "p90_s", sim_hist_quantile(h, 0.9));
    cJSON_AddNumberToObject(o, "p99_s", sim_hist_quantile(h, 0.99));
    return o;
}

bt_status sim_report_json(FILE *f, const sim_config_t *cfg, const sim_result_t *r)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return bt_fail(BT_ERR_NOMEM, "out of memory");
    cJSON_AddNumberToObject(o, "prefill_nodes", cfg->n_prefill);
    cJSON_AddNumberToObject(o, "decode_nodes", cfg->n_decode);
    cJSON_AddNumberToObject(o, "arrivals_s", r->arrivals_end_s);
    cJSON_AddNumberToObject(o, "simulated_s", r->sim_end_s);
    cJSON_AddNumberToObject(o, "wall_s", r->wall_s);
    cJSON_AddNumberToObject(o, "events", (double)r->events);
    cJSON_AddNumberToObject(o, "arrived", (double)r->arrived);
    cJSON_AddNumberToObject(o, "finished", (double)r->finished);
    cJSON_AddNumberToObject(o, "rejected", (double)r->rejected);
    cJSON_AddNumberToObject(o, "failed", (double)r->failed);
    cJSON_AddNumberToObject(o, "migrations", (double)r->migrations);
    cJSON_AddNumberToObject(o, "remote_prefills", (double)r->remote_prefills);
    cJSON_AddNumberToObject(o, "local_prefills", (double)r->local_prefills);
    cJSON_AddNumberToObject(o, "good", (double)r->good);
    cJSON_AddNumberToObject(o, "goodput_req_s", goodput(r));
    cJSON_AddNumberToObject(o, "slo_ttft_s", cfg->slo_ttft_s);
    cJSON_AddNumberToObject(o, "slo_tpot_s", cfg->slo_tpot_s);
    cJSON_AddItemToObject(o, "ttft", hist_json(&r->ttft));
    cJSON_AddItemToObject(o, "tpot", hist_json(&r->tpot));
    cJSON_AddItemToObject(o, "e2e", hist_json(&r->e2e));
    cJSON_AddItemToObject(o, "prefill_node", hist_json(&r->prefill_node));
    cJSON_AddItemToObject(o, "after_prefill", hist_json(&r->after_prefill));
    cJSON *nodes = cJSON_AddArrayToObject(o, "nodes");
    for (int i = 0; nodes && i < r->n_nodes; i++) {
        cJSON *n = cJSON_CreateObject();
        cJSON_AddStringToObject(n, "role", i < cfg->n_prefill ? "prefill" : "decode");
        cJSON_AddNumberToObject(n, "utilisation", r->sim_end_s > 0 ? r->nodes[i].busy_s / r->sim_end_s : 0);
        cJSON_AddNumberToObject(n, "steps", (double)r->nodes[i].steps);
        cJSON_AddNumberToObject(n, "tokens", (double)r->nodes[i].tokens);
        cJSON_AddNumberToObject(n, "failures", r->nodes[i].failures);
        cJSON_AddItemToArray(nodes, n);
    }
    cJSON *plan = cJSON_AddArrayToObject(o, "planner");
    for (int i = 0; plan && i < r->n_plan; i++) {
        const sim_plan_point_t *p = &r->plan[i];
        cJSON *pt = cJSON_CreateObject();
        cJSON_AddNumberToObject(pt, "t", p->t);
        cJSON_AddNumberToObject(pt, "prefill", p->prefill);
        cJSON_AddNumberToObject(pt, "decode", p->decode);
        cJSON_AddNumberToObject(pt, "rate", p->rate);
        cJSON_AddNumberToObject(pt, "ttft_s", isfinite(p->ttft_s) ? p->ttft_s : -1);
        cJSON_AddNumberToObject(pt, "tpot_s", isfinite(p->tpot_s) ? p->tpot_s : -1);
        cJSON_AddItemToArray(plan, pt);
    }
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!txt) return bt_fail(BT_ERR_NOMEM, "out of memory");
    int bad = fprintf(f, "%s\n", txt) < 0;
    cJSON_free(txt);
    return bad ? bt_fail(BT_ERR_IO, "cannot write the JSON report") : BT_OK;
}
