/* `baton bench-serve`: an open-loop load generator against a router's OpenAI HTTP API. Arrival times (Poisson) and
 * prompt/output lengths are drawn up front from the seed; each request is sent at its time whatever the others are
 * doing (one thread, libcurl's multi interface), streamed, and timed: TTFT, TPOT, end-to-end. Reports per rate:
 * achieved rate, throughput, p50/p90/p99, goodput under the SLO, errors by HTTP status. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "tools/commands.h"
#include "tools/workload.h"

#define BS_MAX_RATES 32
#define BS_ERR_BODY_MAX 4096

typedef struct bs_opts {
    const char *url; /* base, without a trailing "/" or "/v1" */
    const char *model;
    const char *api_key;
    const char *tls_ca;      /* --tls-ca: CA bundle that verifies an https:// router (NULL: the system's) */
    const char *json;
    int chat;                      /* /v1/chat/completions instead of /v1/completions */
    double rates[BS_MAX_RATES];    /* req/s; INFINITY = all at once */
    int n_rates;
    long requests;                 /* per rate; 0 when --duration is used */
    double duration;               /* s of arrivals per rate; 0 when --requests is used */
    double prompt_mean, prompt_sd; /* tokens */
    double output_mean, output_sd;
    long concurrency_limit; /* 0 = none */
    double slo_ttft_ms, slo_tpot_ms;
    int slo_set;
    unsigned long long seed;
    double request_timeout; /* s */
    int quiet;
    const char *workload;   /* --workload: prompts from this JSON-lines file instead of random words */
    workload_item *wl;      /* [n_wl] the workload's prompts */
    int n_wl;
} bs_opts;

typedef struct bs_req {
    double t_arrive; /* scheduled, s after the run starts */
    int prompt_len, output_len;
    uint64_t prompt_seed;
    int wl_index;    /* --workload: this request's prompt, round robin */
    CURL *easy;
    char *body;
    double t_send, t_first, t_last, t_done; /* monotonic s */
    int n_chunks;
    long usage_out, usage_prompt; /* -1 until a usage object arrives */
    long status;
    int chat; /* the stream is chat.completion.chunk (content in delta.content) */
    int done_seen, stream_error;
    char *buf; /* partial SSE line, or the error body of a non-200 answer */
    size_t n_buf, cap_buf;
    char err_key[32];  /* "503", "connection", "timeout", "stream", "incomplete"; "" = success */
    char err_msg[160];
} bs_req;

typedef struct bs_run {
    double rate;
    long n, ok, good;
    double duration, achieved, req_s, tok_s, goodput;
    double mean_prompt, mean_output;
    double ttft[4], tpot[4], e2e[4]; /* mean, p50, p90, p99, in ms */
    long n_tpot;
    cJSON *errors; /* {"503": count, ...} */
    char first_err[220];
} bs_run;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Words that are one token each (with their leading space) in GPT-2-style BPE vocabularies such as SmolLM2's, so a
 * prompt of k random words is about k tokens; random order keeps prefix caching from sharing prompts. */
static const char *const bs_words[] = {
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as",
    "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some",
    "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each",
    "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would",
    "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day",
    "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
    "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part",
    "take", "get", "place", "made", "live", "where", "after", "back", "little", "only", "round", "man", "year",
    "came", "show", "every", "good", "me", "give", "our", "under", "name", "very", "through", "just", "form",
    "sentence", "great", "think", "say", "help", "low", "line", "turn", "cause", "much", "mean", "before",
    "move", "right", "boy", "old", "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also",
    "play", "small", "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even", "land",
    "here", "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change", "went", "light",
    "kind", "off", "need", "house", "picture", "try", "us", "again", "animal", "point", "mother", "world",
    "near", "build", "self", "earth", "father", "head", "stand", "own", "page", "should", "country", "found",
    "answer", "school", "grow", "study", "still", "learn", "plant", "cover", "food", "sun", "four", "between",
    "state", "keep", "eye", "never", "last", "let", "thought", "city", "tree", "cross", "farm", "hard", "start",
    "might", "story", "saw", "far", "sea", "draw", "left", "late", "run", "while", "press", "close", "night",
    "real", "life", "few", "north", "open", "seem", "together", "next", "white", "children", "begin", "got",
};
#define BS_N_WORDS (sizeof bs_words / sizeof bs_words[0])

static char *make_prompt(uint64_t seed, int n_words)
{
    size_t cap = (size_t)n_words * 10 + 1, n = 0;
    char *p = malloc(cap);
    if (!p) return NULL;
    for (int i = 0; i < n_words; i++) {
        const char *w = bs_words[wl_rng_next(&seed) % BS_N_WORDS];
        size_t l = strlen(w);
        if (i) p[n++] = ' ';
        memcpy(p + n, w, l);
        n += l;
    }
    p[n] = 0;
    return p;
}

static void set_err(bs_req *r, const char *key, const char *msg)
{
    if (r->err_key[0]) return; /* the first cause wins */
    snprintf(r->err_key, sizeof r->err_key, "%s", key);
    snprintf(r->err_msg, sizeof r->err_msg, "%s", msg ? msg : "");
}

static void on_event(bs_req *r, const char *data, size_t len, double t)
{
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        r->done_seen = 1;
        return;
    }
    cJSON *o = cJSON_ParseWithLength(data, len);
    if (!o) {
        set_err(r, "stream", "unparsable SSE data");
        r->stream_error = 1;
        return;
    }
    cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "error");
    if (cJSON_IsObject(e)) {
        cJSON *m = cJSON_GetObjectItemCaseSensitive(e, "message");
        set_err(r, "stream", cJSON_IsString(m) ? m->valuestring : "error event in the stream");
        r->stream_error = 1;
    }
    cJSON *ch, *choices = cJSON_GetObjectItemCaseSensitive(o, "choices");
    cJSON_ArrayForEach(ch, choices) {
        cJSON *txt = r->chat ? cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(ch, "delta"), "content")
                          : cJSON_GetObjectItemCaseSensitive(ch, "text");
        if (cJSON_IsString(txt) && txt->valuestring[0]) {
            if (!r->n_chunks) r->t_first = t;
            r->t_last = t;
            r->n_chunks++;
        }
    }
    cJSON *u = cJSON_GetObjectItemCaseSensitive(o, "usage");
    if (cJSON_IsObject(u)) {
        cJSON *c = cJSON_GetObjectItemCaseSensitive(u, "completion_tokens");
        cJSON *p = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens");
        if (cJSON_IsNumber(c)) r->usage_out = (long)c->valuedouble;
        if (cJSON_IsNumber(p)) r->usage_prompt = (long)p->valuedouble;
    }
    cJSON_Delete(o);
}

static int buf_append(bs_req *r, const char *p, size_t n)
{
    if (r->n_buf + n + 1 > r->cap_buf) {
        size_t cap = r->cap_buf ? r->cap_buf : 1024;
        while (cap < r->n_buf + n + 1) cap *= 2;
        char *b = realloc(r->buf, cap);
        if (!b) return -1;
        r->buf = b;
        r->cap_buf = cap;
    }
    memcpy(r->buf + r->n_buf, p, n);
    r->n_buf += n;
    r->buf[r->n_buf] = 0;
    return 0;
}

/* libcurl write callback: SSE lines of a 200 answer are handled as they come (timestamped now); any other answer's
 * body is kept (up to 4 KiB) for its error message. */
static size_t on_write(char *p, size_t sz, size_t nm, void *ud)
{
    bs_req *r = ud;
    size_t n = sz * nm;
    double t = now_s();
    if (!r->status) curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
    if (r->status != 200) {
        size_t room = r->n_buf < BS_ERR_BODY_MAX ? BS_ERR_BODY_MAX - r->n_buf : 0;
        if (room && buf_append(r, p, n < room ? n : room)) return 0;
        return n;
    }
    if (buf_append(r, p, n)) return 0;
    size_t start = 0;
    for (size_t i = 0; i < r->n_buf; i++) {
        if (r->buf[i] != '\n') continue;
        size_t end = i;
        if (end > start && r->buf[end - 1] == '\r') end--;
        const char *line = r->buf + start;
        size_t len = end - start;
        if (len >= 5 && !memcmp(line, "data:", 5)) {
            line += 5;
            len -= 5;
            if (len && *line == ' ') line++, len--;
            on_event(r, line, len, t);
        }
        start = i + 1;
    }
    memmove(r->buf, r->buf + start, r->n_buf - start);
    r->n_buf -= start;
    return n;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentile p in [0, 100] of sorted v[n] with linear interpolation (numpy's default). */
static double pct(const double *v, long n, double p)
{
    if (n <= 0) return 0;
    double k = (n - 1) * p / 100.0;
    long lo = (long)floor(k), hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (k - lo);
}

static void summarize(double *v, long n, double out[4])
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double s = 0;
    for (long i = 0; i < n; i++) s += v[i];
    out[0] = n ? s / n : 0;
    out[1] = pct(v, n, 50);
    out[2] = pct(v, n, 90);
    out[3] = pct(v, n, 99);
}

static const char *rate_label(double rate, char *buf, size_t cap)
{
    if (isinf(rate)) snprintf(buf, cap, "inf");
    else snprintf(buf, cap, "%g", rate);
    return buf;
}

/* Draws the arrivals and lengths of one rate's run. Returns the count (>= 1) and the array, or -1 on no memory. */
static long draw_requests(const bs_opts *o, int rate_index, bs_req **out)
{
    wl_draw_t dr;
    wl_draw_init(&dr, o->seed, rate_index, o->rates[rate_index], o->prompt_mean, o->prompt_sd, o->output_mean,
                 o->output_sd);
    long cap = o->requests ? o->requests : 64, n = 0;
    bs_req *v = calloc((size_t)cap, sizeof *v);
    while (v) {
        double t;
        int plen, olen;
        uint64_t pseed;
        wl_draw_next(&dr, &t, &plen, &olen, &pseed);
        if (o->requests ? n >= o->requests : (t >= o->duration && n > 0)) break;
        if (n == cap) {
            bs_req *w = realloc(v, sizeof *v * (size_t)cap * 2);
            if (!w) break;
            memset(w + cap, 0, sizeof *v * (size_t)cap);
            v = w;
            cap *= 2;
        }
        bs_req *r = &v[n++];
        r->t_arrive = (!o->requests && t >= o->duration) ? 0 : t; /* --duration shorter than one gap: one request */
        r->prompt_len = plen;
        r->output_len = olen;
        r->prompt_seed = pseed;
        r->wl_index = o->n_wl ? (int)((n - 1) % o->n_wl) : 0;
        r->usage_out = r->usage_prompt = -1;
    }
    if (!v || (o->requests && n < o->requests)) {
        free(v);
        return -1;
    }
    *out = v;
    return n;
}

static char *make_body(const bs_opts *o, const char *model, const bs_req *r)
{
    char *prompt = o->n_wl ? strdup(o->wl[r->wl_index].text) : make_prompt(r->prompt_seed, r->prompt_len);
    cJSON *b = cJSON_CreateObject();
    if (!prompt || !b) {
        free(prompt);
        cJSON_Delete(b);
        return NULL;
    }
    cJSON_AddStringToObject(b, "model", model);
    if (o->chat) {
        cJSON *msgs = cJSON_AddArrayToObject(b, "messages"), *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", prompt);
        cJSON_AddItemToArray(msgs, m);
    } else {
        cJSON_AddStringToObject(b, "prompt", prompt);
    }
    cJSON_AddNumberToObject(b, "max_tokens", r->output_len);
    cJSON_AddTrueToObject(b, "ignore_eos"); /* output lengths as drawn */
    cJSON_AddTrueToObject(b, "stream");
    cJSON_AddTrueToObject(cJSON_AddObjectToObject(b, "stream_options"), "include_usage");
    char *s = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    free(prompt);
    return s;
}

/* Classifies a finished request (err_key stays "" on success). */
static void finish_req(bs_req *r, CURLcode cc)
{
    r->t_done = now_s();
    if (!r->status) curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
    if (cc != CURLE_OK && r->status == 0) {
        set_err(r, cc == CURLE_OPERATION_TIMEDOUT ? "timeout" : "connection", curl_easy_strerror(cc));
    } else if (r->status != 200) {
        char key[16], msg[160];
        snprintf(key, sizeof key, "%ld", r->status);
        snprintf(msg, sizeof msg, "HTTP %ld", r->status);
        cJSON *o = r->buf ? cJSON_Parse(r->buf) : NULL;
        cJSON *m = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "error"), "message");
        if (cJSON_IsString(m)) snprintf(msg, sizeof msg, "HTTP %ld: %s", r->status, m->valuestring);
        cJSON_Delete(o);
        set_err(r, key, msg);
    } else if (cc != CURLE_OK) {
        set_err(r, cc == CURLE_OPERATION_TIMEDOUT ? "timeout" : "connection", curl_easy_strerror(cc));
    } else if (!r->stream_error && (!r->done_seen || !r->n_chunks)) {
        set_err(r, "incomplete", r->done_seen ? "stream had no content" : "stream ended without [DONE]");
    }
}

/* Runs one rate: sends every request at its time (later while --concurrency-limit requests are in flight), waits
 * for all of them, and fills `run`. Returns 0, or -1 on a local failure (no memory, curl). */
static int run_rate(const bs_opts *o, const char *model, struct curl_slist *hdrs, int rate_index, bs_run *run)
{
    bs_req *reqs;
    long n = draw_requests(o, rate_index, &reqs);
    if (n < 0) return -1;
    CURLM *multi = curl_multi_init();
    char path[4096], rl[32];
    snprintf(path, sizeof path, "%s/v1/%s", o->url, o->chat ? "chat/completions" : "completions");
    int rc = multi ? 0 : -1;
    if (!o->quiet && !rc)
        fprintf(stderr, "bench-serve: rate %s req/s: %ld requests, arrivals over %.1f s\n",
                rate_label(o->rates[rate_index], rl, sizeof rl), n, reqs[n - 1].t_arrive);
    double t0 = now_s(), next_progress = t0 + 2;
    long next = 0, in_flight = 0, done = 0, errors = 0;
    while (!rc && done < n) {
        double t = now_s() - t0;
        while (next < n && reqs[next].t_arrive <= t && (!o->concurrency_limit || in_flight < o->concurrency_limit)) {
            bs_req *r = &reqs[next];
            r->chat = o->chat;
            r->body = make_body(o, model, r);
            r->easy = curl_easy_init();
            if (!r->body || !r->easy) {
                rc = -1;
                break;
            }
            curl_easy_setopt(r->easy, CURLOPT_URL, path);
            if (o->tls_ca) curl_easy_setopt(r->easy, CURLOPT_CAINFO, o->tls_ca);
            curl_easy_setopt(r->easy, CURLOPT_HTTPHEADER, hdrs);
            curl_easy_setopt(r->easy, CURLOPT_POSTFIELDS, r->body);
            curl_easy_setopt(r->easy, CURLOPT_WRITEFUNCTION, on_write);
            curl_easy_setopt(r->easy, CURLOPT_WRITEDATA, r);
            curl_easy_setopt(r->easy, CURLOPT_NOSIGNAL, 1L);
            curl_easy_setopt(r->easy, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
            curl_easy_setopt(r->easy, CURLOPT_TIMEOUT_MS, (long)(o->request_timeout * 1000));
            curl_easy_setopt(r->easy, CURLOPT_PRIVATE, r);
            r->t_send = now_s();
            if (curl_multi_add_handle(multi, r->easy) != CURLM_OK) {
                rc = -1;
                break;
            }
            next++;
            in_flight++;
        }
        if (rc) break;
        int running;
        curl_multi_perform(multi, &running);
        CURLMsg *m;
        int left;
        while ((m = curl_multi_info_read(multi, &left))) {
            if (m->msg != CURLMSG_DONE) continue;
            bs_req *r;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&r);
            finish_req(r, m->data.result);
            curl_multi_remove_handle(multi, r->easy);
            curl_easy_cleanup(r->easy);
            r->easy = NULL;
            free(r->body);
            r->body = NULL;
            in_flight--;
            done++;
            if (r->err_key[0]) {
                if (!errors) snprintf(run->first_err, sizeof run->first_err, "%s", r->err_msg);
                errors++;
            }
        }
        double now = now_s();
        if (!o->quiet && now >= next_progress) {
            fprintf(stderr, "  t=%5.1fs  sent %ld/%ld  done %ld  in flight %ld  errors %ld\n", now - t0, next, n,
                    done, in_flight, errors);
            next_progress = now + 2;
        }
        if (done == n) break;
        double wait = 0.1; /* s; bounds the progress interval too */
        if (next < n && (!o->concurrency_limit || in_flight < o->concurrency_limit)) {
            double until = reqs[next].t_arrive - (now - t0);
            if (until < wait) wait = until;
        }
        if (wait > 0) curl_multi_poll(multi, NULL, 0, (int)ceil(wait * 1000), NULL);
    }
    double t_end = now_s();
    if (!rc) {
        double *ttft = malloc(sizeof(double) * (size_t)n), *tpot = malloc(sizeof(double) * (size_t)n);
        double *e2e = malloc(sizeof(double) * (size_t)n);
        if (!ttft || !tpot || !e2e) rc = -1;
        run->rate = o->rates[rate_index];
        run->n = n;
        run->errors = cJSON_CreateObject();
        double last_send = 0, sum_out = 0, sum_prompt = 0;
        long n_prompt = 0;
        for (long i = 0; !rc && i < n; i++) {
            bs_req *r = &reqs[i];
            if (r->t_send - t0 > last_send) last_send = r->t_send - t0;
            if (r->err_key[0]) {
                cJSON *c = cJSON_GetObjectItemCaseSensitive(run->errors, r->err_key);
                if (c) cJSON_SetNumberValue(c, c->valuedouble + 1);
                else cJSON_AddNumberToObject(run->errors, r->err_key, 1);
                continue;
            }
            long toks = r->usage_out >= 0 ? r->usage_out : r->n_chunks;
            double f = (r->t_first - r->t_send) * 1e3, e = (r->t_done - r->t_send) * 1e3;
            double p = toks > 1 ? (r->t_last - r->t_first) * 1e3 / (double)(toks - 1) : 0;
            ttft[run->ok] = f;
            e2e[run->ok] = e;
            if (toks > 1) tpot[run->n_tpot++] = p;
            run->ok++;
            sum_out += (double)toks;
            if (r->usage_prompt >= 0) {
                sum_prompt += (double)r->usage_prompt;
                n_prompt++;
            }
            if (f <= o->slo_ttft_ms && p <= o->slo_tpot_ms) run->good++;
        }
        if (!rc) {
            run->duration = t_end - t0;
            /* with all arrivals at once the span of sends is ~0; the run's duration is the honest denominator */
            double span = last_send > 1e-3 ? last_send : run->duration;
            run->achieved = (double)n / span;
            run->req_s = run->ok / run->duration;
            run->tok_s = sum_out / run->duration;
            run->goodput = run->good / run->duration;
            run->mean_output = run->ok ? sum_out / run->ok : 0;
            run->mean_prompt = n_prompt ? sum_prompt / n_prompt : 0;
            summarize(ttft, run->ok, run->ttft);
            summarize(tpot, run->n_tpot, run->tpot);
            summarize(e2e, run->ok, run->e2e);
            if (!o->quiet)
                fprintf(stderr, "  done in %.1f s: %ld ok, %ld errors\n", run->duration, run->ok, n - run->ok);
        }
        free(ttft);
        free(tpot);
        free(e2e);
    }
    for (long i = 0; i < n; i++) {
        if (reqs[i].easy) {
            curl_multi_remove_handle(multi, reqs[i].easy);
            curl_easy_cleanup(reqs[i].easy);
        }
        free(reqs[i].body);
        free(reqs[i].buf);
    }
    if (multi) curl_multi_cleanup(multi);
    free(reqs);
    return rc;
}

static size_t on_models(char *p, size_t sz, size_t nm, void *ud)
{
    bs_req *r = ud; /* only its buffer is used */
    size_t n = sz * nm;
    if (r->n_buf + n > (1u << 20)) return 0;
    return buf_append(r, p, n) ? 0 : n;
}

/* GET /v1/models: proves the URL answers and, without --model, names the first model. Prints one line and returns
 * -1 on failure; *name is malloc'd. */
static int probe_models(const bs_opts *o, struct curl_slist *hdrs, char **name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/v1/models", o->url);
    bs_req r = {0};
    CURL *c = curl_easy_init();
    if (!c) return -1;
    curl_easy_setopt(c, CURLOPT_URL, path);
    if (o->tls_ca) curl_easy_setopt(c, CURLOPT_CAINFO, o->tls_ca);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_models);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 15000L);
    CURLcode cc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    int rc = -1;
    cJSON *j = NULL;
    if (cc != CURLE_OK) {
        fprintf(stderr, "baton bench-serve: cannot reach %s: %s\n", path, curl_easy_strerror(cc));
    } else if (status == 401) {
        fprintf(stderr, "baton bench-serve: %s answered HTTP 401: give the router's key with --api-key\n", path);
    } else if (status != 200) {
        fprintf(stderr, "baton bench-serve: %s answered HTTP %ld (is this a baton router or OpenAI server?)\n", path,
                status);
    } else if (o->model) {
        rc = (*name = strdup(o->model)) ? 0 : -1;
    } else {
        j = r.buf ? cJSON_Parse(r.buf) : NULL;
        cJSON *id = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "data"), 0),
                                                     "id");
        if (!cJSON_IsString(id))
            fprintf(stderr, "baton bench-serve: %s lists no model; give one with --model\n", path);
        else rc = (*name = strdup(id->valuestring)) ? 0 : -1;
    }
    cJSON_Delete(j);
    free(r.buf);
    return rc;
}

static void print_table(const bs_opts *o, const char *model, const bs_run *runs, int n_runs)
{
    char pl[64], ol[64], cl[64] = "";
    snprintf(pl, sizeof pl, o->prompt_sd > 0 ? "%g (sd %g)" : "%g", o->prompt_mean, o->prompt_sd);
    snprintf(ol, sizeof ol, o->output_sd > 0 ? "%g (sd %g)" : "%g", o->output_mean, o->output_sd);
    if (o->concurrency_limit) snprintf(cl, sizeof cl, ", at most %ld in flight", o->concurrency_limit);
    if (o->n_wl) snprintf(pl, sizeof pl, "from %.40s (%d)", o->workload, o->n_wl);
    printf("model %s, %s, prompt %s tokens, output %s tokens (ignore_eos), Poisson arrivals, seed %llu%s\n", model,
           o->chat ? "/v1/chat/completions" : "/v1/completions", pl, ol, o->seed, cl);
    printf("SLO for goodput: TTFT <= %g ms and TPOT <= %g ms%s\n\n", o->slo_ttft_ms, o->slo_tpot_ms,
           o->slo_set ? "" : " (the defaults; set with --slo-ttft-ms / --slo-tpot-ms)");
    printf("%6s %8s %9s %6s %7s %9s | %-22s | %-20s | %-22s | %s\n", "rate", "achieved", "ok/sent", "errors", "req/s",
           "out tok/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99", "E2E ms p50/p90/p99", "goodput req/s");
    for (int i = 0; i < n_runs; i++) {
        const bs_run *r = &runs[i];
        char rl[32], ok[32], t1[48], t2[48], t3[48];
        snprintf(ok, sizeof ok, "%ld/%ld", r->ok, r->n);
        snprintf(t1, sizeof t1, "%.0f/%.0f/%.0f", r->ttft[1], r->ttft[2], r->ttft[3]);
        snprintf(t2, sizeof t2, "%.1f/%.1f/%.1f", r->tpot[1], r->tpot[2], r->tpot[3]);
        snprintf(t3, sizeof t3, "%.0f/%.0f/%.0f", r->e2e[1], r->e2e[2], r->e2e[3]);
        printf("%6s %8.2f %9s %6ld %7.2f %9.1f | %-22s | %-20s | %-22s | %.2f\n", rate_label(r->rate, rl, sizeof rl),
               r->achieved, ok, r->n - r->ok, r->req_s, r->tok_s, t1, t2, t3, r->goodput);
    }
    for (int i = 0; i < n_runs; i++) {
        const bs_run *r = &runs[i];
        if (r->ok == r->n) continue;
        char rl[32];
        printf("errors at rate %s:", rate_label(r->rate, rl, sizeof rl));
        cJSON *e;
        cJSON_ArrayForEach(e, r->errors) printf(" %s x%.0f", e->string, e->valuedouble);
        printf(" (first: %s)\n", r->first_err);
    }
}

static cJSON *stats_json(const double s[4])
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "mean", s[0]);
    cJSON_AddNumberToObject(o, "p50", s[1]);
    cJSON_AddNumberToObject(o, "p90", s[2]);
    cJSON_AddNumberToObject(o, "p99", s[3]);
    return o;
}

static int write_json(const bs_opts *o, const char *model, const bs_run *runs, int n_runs)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "url", o->url);
    cJSON_AddStringToObject(j, "model", model);
    cJSON_AddStringToObject(j, "endpoint", o->chat ? "/v1/chat/completions" : "/v1/completions");
    cJSON_AddNumberToObject(j, "seed", (double)o->seed);
    cJSON *pt = cJSON_AddObjectToObject(j, "prompt_tokens");
    cJSON_AddNumberToObject(pt, "mean", o->prompt_mean);
    cJSON_AddNumberToObject(pt, "stddev", o->prompt_sd);
    cJSON *ot = cJSON_AddObjectToObject(j, "output_tokens");
    cJSON_AddNumberToObject(ot, "mean", o->output_mean);
    cJSON_AddNumberToObject(ot, "stddev", o->output_sd);
    if (o->concurrency_limit) cJSON_AddNumberToObject(j, "concurrency_limit", (double)o->concurrency_limit);
    else cJSON_AddNullToObject(j, "concurrency_limit");
    cJSON *slo = cJSON_AddObjectToObject(j, "slo");
    cJSON_AddNumberToObject(slo, "ttft_ms", o->slo_ttft_ms);
    cJSON_AddNumberToObject(slo, "tpot_ms", o->slo_tpot_ms);
    cJSON_AddBoolToObject(slo, "defaults", !o->slo_set);
    cJSON *arr = cJSON_AddArrayToObject(j, "runs");
    for (int i = 0; i < n_runs; i++) {
        const bs_run *r = &runs[i];
        cJSON *x = cJSON_CreateObject();
        if (isinf(r->rate)) cJSON_AddNullToObject(x, "rate");
        else cJSON_AddNumberToObject(x, "rate", r->rate);
        cJSON_AddNumberToObject(x, "requests", (double)r->n);
        cJSON_AddNumberToObject(x, "completed", (double)r->ok);
        cJSON_AddNumberToObject(x, "errors", (double)(r->n - r->ok));
        cJSON_AddItemToObject(x, "errors_by_status", cJSON_Duplicate(r->errors, 1));
        cJSON_AddNumberToObject(x, "duration_s", r->duration);
        cJSON_AddNumberToObject(x, "achieved_rate", r->achieved);
        cJSON_AddNumberToObject(x, "throughput_req_s", r->req_s);
        cJSON_AddNumberToObject(x, "throughput_output_tok_s", r->tok_s);
        cJSON_AddNumberToObject(x, "good_requests", (double)r->good);
        cJSON_AddNumberToObject(x, "goodput_req_s", r->goodput);
        cJSON_AddNumberToObject(x, "mean_prompt_tokens", r->mean_prompt);
        cJSON_AddNumberToObject(x, "mean_output_tokens", r->mean_output);
        cJSON_AddItemToObject(x, "ttft_ms", stats_json(r->ttft));
        cJSON_AddItemToObject(x, "tpot_ms", stats_json(r->tpot));
        cJSON_AddItemToObject(x, "e2e_ms", stats_json(r->e2e));
        cJSON_AddItemToArray(arr, x);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    FILE *f = s ? fopen(o->json, "w") : NULL;
    int rc = 0;
    if (!f || fprintf(f, "%s\n", s) < 0) rc = -1;
    if (f && fclose(f)) rc = -1;
    if (rc) fprintf(stderr, "baton bench-serve: cannot write %s: %s\n", o->json, strerror(errno));
    free(s);
    return rc;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: baton bench-serve [--url URL] [--rate R[,R...]] [--requests N | --duration S] [options]\n"
            "\n"
            "Open-loop load against a router's OpenAI HTTP API: arrival times (Poisson at each rate) and lengths\n"
            "are drawn up front from --seed, and each request is sent at its time whatever the others are doing.\n"
            "Requests stream (SSE) with ignore_eos and max_tokens = the drawn output length. Per rate it reports\n"
            "the achieved rate, throughput, TTFT (send to first content chunk), TPOT ((last - first chunk) /\n"
            "(tokens - 1)) and end-to-end latency p50/p90/p99, goodput (requests/s meeting both SLOs) and errors\n"
            "by HTTP status. Several rates run one after another.\n"
            "\n"
            "  --url URL               router base URL (default http://127.0.0.1:8000; a trailing /v1 is fine)\n"
            "  --model NAME            model to ask for (default: the first of /v1/models)\n"
            "  --api chat|completions  endpoint (default completions: the prompt is sent as is)\n"
            "  --rate R[,R...]         requests/s, Poisson arrivals; 'inf' sends all at once (default 1)\n"
            "  --requests N            requests per rate (default 50)\n"
            "  --duration S            instead of --requests: arrivals for S seconds per rate\n"
            "  --prompt-tokens M[:SD]  prompt length, normal with mean M and stddev SD (default 128)\n"
            "  --workload FILE         prompts from a JSON-lines file ({\"chat\": ...} or {\"prompt\": ...} per line,\n"
            "                          e.g. tools/workloads/input-grounded.jsonl), round robin, instead of random\n"
            "                          words; with --api chat each is a user message\n"
            "  --output-tokens M[:SD]  output length, likewise (default 64)\n"
            "  --concurrency-limit C   at most C requests in flight; later arrivals wait (default none)\n"
            "  --slo-ttft-ms X         goodput SLO on TTFT (default 2000)\n"
            "  --slo-tpot-ms Y         goodput SLO on TPOT (default 200)\n"
            "  --seed S                seed of arrivals, lengths and prompt words (default 0)\n"
            "  --api-key K             sent as 'Authorization: Bearer K'\n"
            "  --tls-ca PEM            CA that verifies an https:// router (deploy/local/cluster up --tls: tls/ca.pem)\n"
            "  --request-timeout S     give up on one request after S seconds (default 600)\n"
            "  --json FILE             also write the results as JSON\n"
            "  --quiet                 no progress lines on stderr\n"
            "  -h, --help              this help\n"
            "\n"
            "Prompts are random common words, about one token each. Exit status: 0; 1 when the URL does not\n"
            "answer, every request of a rate failed, or --json cannot be written (one line on stderr); 2 on bad\n"
            "usage.\n");
}

static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int parse_long(const char *s, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno) return -1;
    *out = v;
    return 0;
}

/* "M" or "M:SD" with 1 <= M <= 100000 and 0 <= SD <= 100000. */
static int parse_len(const char *s, double *mean, double *sd)
{
    char buf[64];
    if (strlen(s) >= sizeof buf) return -1;
    snprintf(buf, sizeof buf, "%s", s);
    char *colon = strchr(buf, ':');
    *sd = 0;
    if (colon) {
        *colon = 0;
        if (parse_double(colon + 1, sd) || *sd < 0 || *sd > 100000) return -1;
    }
    return parse_double(buf, mean) || *mean < 1 || *mean > 100000 ? -1 : 0;
}

static int parse_rates(const char *s, bs_opts *o)
{
    char buf[1024];
    if (strlen(s) >= sizeof buf) return -1;
    snprintf(buf, sizeof buf, "%s", s);
    o->n_rates = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        double r;
        if (o->n_rates == BS_MAX_RATES) return -1;
        if (!strcmp(t, "inf")) r = INFINITY;
        else if (parse_double(t, &r) || r <= 0 || r > 1e6) return -1;
        o->rates[o->n_rates++] = r;
    }
    return o->n_rates ? 0 : -1;
}

int cmd_bench_serve(int argc, char **argv)
{
    bs_opts o = {.url = "http://127.0.0.1:8000", .rates = {1}, .n_rates = 1, .prompt_mean = 128,
                 .output_mean = 64, .slo_ttft_ms = 2000, .slo_tpot_ms = 200, .request_timeout = 600};
    long requests = 0;
    int have_requests = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet")) {
            o.quiet = 1;
            continue;
        }
        if (strncmp(a, "--", 2)) {
            fprintf(stderr, "baton bench-serve: unexpected argument '%s' (see --help)\n", a);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "baton bench-serve: unknown option or missing value: '%s' (see --help)\n", a);
            return 2;
        }
        i++;
        int bad = 0;
        long l = 0;
        if (!strcmp(a, "--url")) o.url = v;
        else if (!strcmp(a, "--model")) bad = !*(o.model = v);
        else if (!strcmp(a, "--api-key")) o.api_key = v;
        else if (!strcmp(a, "--tls-ca")) bad = !*(o.tls_ca = v);
        else if (!strcmp(a, "--json")) bad = !*(o.json = v);
        else if (!strcmp(a, "--workload")) bad = !*(o.workload = v);
        else if (!strcmp(a, "--api")) {
            if (!strcmp(v, "chat")) o.chat = 1;
            else if (!strcmp(v, "completions")) o.chat = 0;
            else bad = 1;
        } else if (!strcmp(a, "--rate")) bad = parse_rates(v, &o) != 0;
        else if (!strcmp(a, "--requests")) {
            bad = parse_long(v, &requests) || requests < 1 || requests > 1000000;
            have_requests = 1;
        } else if (!strcmp(a, "--duration")) bad = parse_double(v, &o.duration) || o.duration <= 0 || o.duration > 86400;
        else if (!strcmp(a, "--prompt-tokens")) bad = parse_len(v, &o.prompt_mean, &o.prompt_sd) != 0;
        else if (!strcmp(a, "--output-tokens")) bad = parse_len(v, &o.output_mean, &o.output_sd) != 0;
        else if (!strcmp(a, "--concurrency-limit"))
            bad = parse_long(v, &o.concurrency_limit) || o.concurrency_limit < 1 || o.concurrency_limit > 100000;
        else if (!strcmp(a, "--slo-ttft-ms")) {
            bad = parse_double(v, &o.slo_ttft_ms) || o.slo_ttft_ms <= 0;
            o.slo_set = 1;
        } else if (!strcmp(a, "--slo-tpot-ms")) {
            bad = parse_double(v, &o.slo_tpot_ms) || o.slo_tpot_ms <= 0;
            o.slo_set = 1;
        } else if (!strcmp(a, "--seed")) {
            bad = parse_long(v, &l) || l < 0;
            o.seed = (unsigned long long)l;
        } else if (!strcmp(a, "--request-timeout"))
            bad = parse_double(v, &o.request_timeout) || o.request_timeout <= 0 || o.request_timeout > 86400;
        else {
            fprintf(stderr, "baton bench-serve: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "baton bench-serve: bad value '%s' for %s (see --help)\n", v, a);
            return 2;
        }
    }
    if (have_requests && o.duration > 0) {
        fprintf(stderr, "baton bench-serve: give --requests or --duration, not both\n");
        return 2;
    }
    o.requests = o.duration > 0 ? 0 : have_requests ? requests : 50;
    if (o.workload && workload_load("baton bench-serve", o.workload, 1 << 20, &o.wl, &o.n_wl)) return 2;
    /* with every arrival at t = 0, --duration would never end the drawing */
    for (int i = 0; i < o.n_rates; i++)
        if (isinf(o.rates[i]) && o.duration > 0) {
            fprintf(stderr, "baton bench-serve: --rate inf needs --requests, not --duration\n");
            return 2;
        }
    char url[2048];
    if (strncmp(o.url, "http://", 7) && strncmp(o.url, "https://", 8)) {
        fprintf(stderr, "baton bench-serve: --url must start with http:// or https:// (got '%s')\n", o.url);
        return 2;
    }
    if (strlen(o.url) >= sizeof url) {
        fprintf(stderr, "baton bench-serve: --url too long\n");
        return 2;
    }
    snprintf(url, sizeof url, "%s", o.url);
    size_t ul = strlen(url);
    while (ul && url[ul - 1] == '/') url[--ul] = 0;
    if (ul >= 3 && !strcmp(url + ul - 3, "/v1")) url[ul -= 3] = 0;
    o.url = url;

    if (curl_global_init(CURL_GLOBAL_DEFAULT)) {
        fprintf(stderr, "baton bench-serve: libcurl failed to initialise\n");
        return 1;
    }
    struct curl_slist *hdrs = NULL, *h;
    char auth[1024];
    hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
    hdrs = (h = curl_slist_append(hdrs, "Expect:")) ? h : hdrs; /* no 100-continue round trip before the body */
    if (o.api_key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", o.api_key);
        hdrs = (h = curl_slist_append(hdrs, auth)) ? h : hdrs;
    }
    int rc = 1;
    char *model = NULL;
    bs_run runs[BS_MAX_RATES];
    memset(runs, 0, sizeof runs);
    int n_runs = 0;
    if (!hdrs || probe_models(&o, hdrs, &model)) goto out;
    if (!o.quiet)
        fprintf(stderr, "bench-serve: %s, model %s, %d rate(s)\n", o.url, model, o.n_rates);
    const char *fail = NULL;
    char fail_line[320];
    for (int i = 0; i < o.n_rates; i++) {
        if (run_rate(&o, model, hdrs, i, &runs[i])) {
            fprintf(stderr, "baton bench-serve: out of memory or libcurl failure\n");
            goto out;
        }
        n_runs++;
        if (runs[i].ok == 0) {
            char rl[32];
            snprintf(fail_line, sizeof fail_line, "every request failed at rate %s (first error: %s)",
                     rate_label(o.rates[i], rl, sizeof rl), runs[i].first_err);
            fail = fail_line;
            break; /* the server is not serving; later rates would only repeat it */
        }
    }
    print_table(&o, model, runs, n_runs);
    rc = 0;
    if (o.json && write_json(&o, model, runs, n_runs)) rc = 1;
    if (fail) {
        fprintf(stderr, "baton bench-serve: %s\n", fail);
        rc = 1;
    }
out:
    for (int i = 0; i < BS_MAX_RATES; i++) cJSON_Delete(runs[i].errors);
    workload_free(o.wl, o.n_wl);
    free(model);
    curl_slist_free_all(hdrs);
    curl_global_cleanup();
    return rc;
}
