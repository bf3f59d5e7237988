/* The local-vs-remote prefill cost model (DESIGN 7); the formulas are in router.h. Pure arithmetic over numbers
 * the caller took from the membership view and the prefix index: no lock, no I/O. */
#include "router/router.h"

#include <math.h>
#include <string.h>

bt_status rtr_prefill_mode_parse(const char *s, rtr_prefill_mode *out)
{
    if (!s) return bt_fail(BT_ERR_INVALID, "prefill mode missing");
    if (!strcmp(s, "auto")) *out = RTR_PREFILL_AUTO;
    else if (!strcmp(s, "local")) *out = RTR_PREFILL_LOCAL;
    else if (!strcmp(s, "remote")) *out = RTR_PREFILL_REMOTE;
    else return bt_fail(BT_ERR_INVALID, "prefill mode '%s' is not auto, local or remote", s);
    return BT_OK;
}

const char *rtr_prefill_mode_name(rtr_prefill_mode m)
{
    return m == RTR_PREFILL_LOCAL ? "local" : m == RTR_PREFILL_REMOTE ? "remote" : "auto";
}

static int64_t uncached(int64_t prompt, int64_t cached)
{
    if (cached < 0) cached = 0;
    /* at least the last token is always computed: its logits give the first new token */
    return cached >= prompt ? (prompt > 0 ? 1 : 0) : prompt - cached;
}

static int64_t nonneg(int64_t v) { return v > 0 ? v : 0; }

/* D's rate when measured, else the mean measured rate of the prefill nodes (same model), else the default: the
 * reference every unmeasured rate falls back to, so a fresh cluster compares like with like. */
static double reference_rate(const rtr_place_input_t *in)
{
    if (in->decode.prefill_tok_s > 0) return in->decode.prefill_tok_s;
    double sum = 0;
    int n = 0;
    for (size_t i = 0; i < in->n_prefill; i++)
        if (in->prefill[i].prefill_tok_s > 0) {
            sum += in->prefill[i].prefill_tok_s;
            n++;
        }
    return n ? sum / n : RTR_PLACE_DEFAULT_RATE;
}

static void cost_local(const rtr_place_input_t *in, double ref_rate, rtr_place_decision_t *out)
{
    const rtr_place_node_t *d = &in->decode;
    double rate = d->prefill_tok_s > 0 ? d->prefill_tok_s : ref_rate;
    double step = d->step_s > 0 ? d->step_s : RTR_PLACE_DEFAULT_STEP_S;
    int64_t running = nonneg(d->running_seqs);
    int64_t unc = uncached(in->prompt_tokens, d->cached_tokens);
    out->d_rate = rate;
    out->d_step_s = step;
    out->uncached_local = unc;
    out->local_own_s = (running == 0 ? step : 0.0) + (double)(nonneg(d->queued_prefill_tokens) + unc) / rate;
    /* each running sequence waits out the prefill; a speculating node loses more than one token per step it waits */
    double tps = d->tokens_per_step > 1 ? d->tokens_per_step : 1;
    out->interference_s = (double)running * (double)unc / rate * tps;
    out->cost_local_s = out->local_own_s + out->interference_s;
}

static void cost_remote(const rtr_place_input_t *in, const rtr_place_node_t *p, double d_rate, int64_t unc_d,
                        rtr_place_cand_t *c)
{
    c->rate = p->prefill_tok_s > 0 ? p->prefill_tok_s : d_rate;
    c->step_s = p->step_s > 0 ? p->step_s : RTR_PLACE_DEFAULT_STEP_S;
    c->bps = p->kv_transfer_bytes_s > 0 ? p->kv_transfer_bytes_s : RTR_PLACE_DEFAULT_XFER_BPS;
    c->uncached_tokens = uncached(in->prompt_tokens, p->cached_tokens);
    c->queue_s = (double)nonneg(p->queued_prefill_tokens) / c->rate;
    c->compute_s = (double)c->uncached_tokens / c->rate;
    /* only the blocks D lacks travel: D's own prefix-cache hit is skipped by the push */
    c->transfer_s = (double)unc_d * (in->kv_bytes_per_token > 0 ? in->kv_bytes_per_token : 0) / c->bps;
    c->cost_s = c->step_s + c->queue_s + c->compute_s + c->transfer_s + (in->overhead_s > 0 ? in->overhead_s : 0);
}

void rtr_place_decide(const rtr_place_input_t *in, rtr_place_cand_t *cands, rtr_place_decision_t *out)
{
    memset(out, 0, sizeof *out);
    out->best = -1;
    double ref = reference_rate(in);
    cost_local(in, ref, out);
    for (size_t i = 0; i < in->n_prefill; i++) {
        cost_remote(in, &in->prefill[i], out->d_rate, out->uncached_local, &cands[i]);
        if (out->best < 0 || cands[i].cost_s < cands[out->best].cost_s) out->best = (int)i;
    }
    double best_p = out->best >= 0 ? cands[out->best].cost_s : 0;
    if (in->mode == RTR_PREFILL_LOCAL) {
        out->reason = "forced local";
    } else if (out->best < 0) {
        out->reason = in->mode == RTR_PREFILL_REMOTE ? "forced remote but no prefill node: local" : "no prefill node";
    } else if (in->mode == RTR_PREFILL_REMOTE) {
        out->remote = 1;
        out->reason = "forced remote";
    } else if (best_p < out->cost_local_s) {
        out->remote = 1;
        out->reason = out->interference_s > 0 ? "remote is cheaper (local prefill would delay running decodes)"
                                              : "remote is cheaper (shorter queue or cached prefix)";
    } else {
        out->reason = "local is cheaper";
    }
    out->ttft_s = out->remote ? best_p : out->local_own_s;
    /* what admission compares with the SLO: the fastest first token any allowed placement promises */
    out->best_ttft_s = out->local_own_s;
    if (in->mode == RTR_PREFILL_REMOTE && out->best >= 0) out->best_ttft_s = best_p;
    else if (in->mode == RTR_PREFILL_AUTO && out->best >= 0 && best_p < out->best_ttft_s) out->best_ttft_s = best_p;
}

int rtr_place_within_slo(double ttft_s, double slo_s)
{
    return slo_s <= 0 || ttft_s <= slo_s;
}

int rtr_planner_replicas(double demand_tok_s, double rate_tok_s, int fallback)
{
    if (!(rate_tok_s > 0)) return fallback > 1 ? fallback : 1;
    double n = ceil(demand_tok_s / rate_tok_s);
    if (!(n >= 1)) return 1;
    return n > 1e6 ? 1000000 : (int)n;
}

double rtr_decode_score(double kv_total, double kv_free, int64_t running, double max_running)
{
    double headroom = kv_total > 0 ? kv_free / kv_total : 1.0;
    double cap = max_running > 0 ? max_running : 64.0;
    return headroom - (double)running / cap;
}

double rtr_admit_queue_s(double pending_prompt, double compete, int n, int64_t n_prompt, int64_t o, double decode_tok_s,
                         double prefill_tok_s)
{
    return (pending_prompt + (double)(n - 1) * (double)n_prompt) / prefill_tok_s +
           (compete + (double)(n - 1) * (double)o) / decode_tok_s;
}

static double dmax(double a, double b) { return a > b ? a : b; }

void rtr_admit_rates(double measured_gen_tok_s, double decode_mean_tok_s, double prefill_mean_tok_s, int n_decode,
                     int n_prefill, double *decode_tok_s, double *prefill_tok_s)
{
    int nd = n_decode > 0 ? n_decode : 1, np = n_prefill > 0 ? n_prefill : nd;
    *decode_tok_s = dmax(dmax(measured_gen_tok_s, decode_mean_tok_s * nd), RTR_ADMIT_FLOOR_DECODE_TOK_S * nd);
    *prefill_tok_s = dmax(prefill_mean_tok_s * np, RTR_ADMIT_FLOOR_PREFILL_TOK_S * np);
}

size_t rtr_prefill_candidates(size_t n, const unsigned char *holds, size_t max, uint64_t *rng, size_t *scratch,
                              size_t *out)
{
    size_t k = 0, n_rest = 0;
    if (n <= max) {
        for (size_t i = 0; i < n; i++) out[k++] = i;
        return k;
    }
    for (size_t i = 0; i < n; i++) {
        if (holds && holds[i] && k < max) out[k++] = i;
        else scratch[n_rest++] = i;
    }
    for (size_t j = 0; j < n_rest && k < max; j++) { /* partial Fisher-Yates over the rest */
        uint64_t x = *rng ? *rng : 0x9e3779b97f4a7c15ull;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *rng = x;
        size_t r = j + (size_t)(x % (uint64_t)(n_rest - j)), t = scratch[j];
        scratch[j] = scratch[r];
        scratch[r] = t;
        out[k++] = scratch[j];
    }
    return k;
}
