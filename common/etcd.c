#include "common/etcd.h"

#include "common/base64.h"
#include "common/etcd_json.h"
#include "common/log.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ETCD_IDLE_HANDLES 8
#define ETCD_WATCH_BACKOFF_MIN_MS 100
#define ETCD_WATCH_BACKOFF_MAX_MS 2000

struct etcd_client {
    char **endpoints; /* without trailing '/' */
    size_t n_endpoints;
    char *user, *password, *ca_file, *cert_file, *key_file;
    int insecure;
    int timeout_ms;
    size_t max_response;
    pthread_mutex_t mu;
    size_t current;                  /* guarded by mu: endpoint tried first */
    char *token;                     /* guarded by mu: NULL = not authenticated */
    CURL *idle[ETCD_IDLE_HANDLES];   /* guarded by mu: reusable handles keep their connections */
    size_t n_idle;
};

typedef struct etcd_buf {
    char *data;
    size_t len, cap, limit;
    int overflow;
} etcd_buf;

static pthread_once_t etcd_curl_once = PTHREAD_ONCE_INIT;

static void etcd_curl_init(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT); /* process-wide by libcurl's design; never cleaned up */
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char *dup_or_null(const char *s)
{
    return s && *s ? strdup(s) : NULL;
}

static int buf_append(etcd_buf *b, const char *p, size_t n)
{
    if (b->len + n > b->limit) {
        b->overflow = 1;
        return -1;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n + 1) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

static size_t buf_write_cb(char *ptr, size_t size, size_t nmemb, void *ud)
{
    size_t n = size * nmemb;
    return buf_append(ud, ptr, n) ? 0 : n;
}

static void buf_free(etcd_buf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ---- client ---- */

bt_status etcd_client_create(const etcd_config_t *cfg, etcd_client_t **out)
{
    if (!cfg || !cfg->endpoints || !*cfg->endpoints) return bt_fail(BT_ERR_INVALID, "etcd: no endpoints");
    if (cfg->timeout_ms < 0) return bt_fail(BT_ERR_INVALID, "etcd: negative timeout");
    pthread_once(&etcd_curl_once, etcd_curl_init);
    bt_status st = BT_ERR_NOMEM;
    etcd_client_t *c = calloc(1, sizeof *c);
    if (!c) return bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
    c->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : ETCD_DEFAULT_TIMEOUT_MS;
    c->max_response = cfg->max_response ? cfg->max_response : ETCD_DEFAULT_MAX_RESPONSE;
    c->insecure = cfg->insecure_skip_verify;
    if (pthread_mutex_init(&c->mu, NULL)) {
        free(c);
        return bt_fail(BT_ERR_INTERNAL, "etcd: mutex init failed");
    }
    char *list = strdup(cfg->endpoints);
    if (!list) goto fail;
    size_t n = 1;
    for (const char *p = list; *p; p++) n += *p == ',';
    c->endpoints = calloc(n, sizeof *c->endpoints);
    if (!c->endpoints) goto fail_list;
    char *save = NULL;
    for (char *tok = strtok_r(list, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        size_t len = strlen(tok);
        while (len && tok[len - 1] == '/') tok[--len] = '\0';
        if (!len) continue;
        int has_scheme = strstr(tok, "://") != NULL;
        char *ep = malloc(len + 8);
        if (!ep) goto fail_list;
        snprintf(ep, len + 8, "%s%s", has_scheme ? "" : "http://", tok);
        c->endpoints[c->n_endpoints++] = ep;
    }
    free(list);
    list = NULL;
    if (!c->n_endpoints) {
        st = bt_fail(BT_ERR_INVALID, "etcd: no endpoints in \"%s\"", cfg->endpoints);
        goto fail;
    }
    c->user = dup_or_null(cfg->user);
    c->password = cfg->password ? strdup(cfg->password) : strdup("");
    c->ca_file = dup_or_null(cfg->ca_file);
    c->cert_file = dup_or_null(cfg->cert_file);
    c->key_file = dup_or_null(cfg->key_file);
    if ((cfg->user && *cfg->user && !c->user) || !c->password || (cfg->ca_file && *cfg->ca_file && !c->ca_file) ||
        (cfg->cert_file && *cfg->cert_file && !c->cert_file) || (cfg->key_file && *cfg->key_file && !c->key_file))
        goto fail;
    *out = c;
    return BT_OK;
fail_list:
    free(list);
fail:
    if (st == BT_ERR_NOMEM) bt_fail(st, "etcd: out of memory");
    etcd_client_destroy(c);
    return st;
}

void etcd_client_destroy(etcd_client_t *c)
{
    if (!c) return;
    for (size_t i = 0; i < c->n_endpoints; i++) free(c->endpoints[i]);
    free(c->endpoints);
    for (size_t i = 0; i < c->n_idle; i++) curl_easy_cleanup(c->idle[i]);
    free(c->user);
    free(c->password);
    free(c->ca_file);
    free(c->cert_file);
    free(c->key_file);
    free(c->token);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

const char *etcd_client_endpoint(etcd_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    const char *ep = c->endpoints[c->current];
    pthread_mutex_unlock(&c->mu);
    return ep;
}

static CURL *handle_get(etcd_client_t *c)
{
    CURL *h = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->n_idle) h = c->idle[--c->n_idle];
    pthread_mutex_unlock(&c->mu);
    return h ? h : curl_easy_init();
}

static void handle_put(etcd_client_t *c, CURL *h)
{
    if (!h) return;
    pthread_mutex_lock(&c->mu);
    if (c->n_idle < ETCD_IDLE_HANDLES) {
        c->idle[c->n_idle++] = h;
        h = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (h) curl_easy_cleanup(h);
}

static size_t current_endpoint(etcd_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    size_t i = c->current;
    pthread_mutex_unlock(&c->mu);
    return i;
}

static void set_current(etcd_client_t *c, size_t idx)
{
    pthread_mutex_lock(&c->mu);
    c->current = idx;
    pthread_mutex_unlock(&c->mu);
}

/* Moves off a failed endpoint unless another thread already did. */
static void advance_endpoint(etcd_client_t *c, size_t failed)
{
    pthread_mutex_lock(&c->mu);
    if (c->current == failed) c->current = (failed + 1) % c->n_endpoints;
    pthread_mutex_unlock(&c->mu);
}

/* Forgets token if it is still the current one (another thread may have re-authenticated already). */
static void invalidate_token(etcd_client_t *c, const char *token)
{
    pthread_mutex_lock(&c->mu);
    if (c->token && token && !strcmp(c->token, token)) {
        free(c->token);
        c->token = NULL;
    }
    pthread_mutex_unlock(&c->mu);
}

/* Common options of every request, including the streaming watch. */
static bt_status setup_handle(etcd_client_t *c, CURL *h, const char *url, const char *body,
                              struct curl_slist **headers, const char *token)
{
    struct curl_slist *hl = NULL, *t;
    char auth[1024];
    curl_easy_reset(h);
    if (!(t = curl_slist_append(hl, "Content-Type: application/json"))) goto nomem;
    hl = t;
    if (!(t = curl_slist_append(hl, "Expect:"))) goto nomem;
    hl = t;
    if (token) {
        snprintf(auth, sizeof auth, "Authorization: %s", token);
        if (!(t = curl_slist_append(hl, auth))) goto nomem;
        hl = t;
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 5L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 2L);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    if (c->ca_file) curl_easy_setopt(h, CURLOPT_CAINFO, c->ca_file);
    if (c->cert_file) curl_easy_setopt(h, CURLOPT_SSLCERT, c->cert_file);
    if (c->key_file) curl_easy_setopt(h, CURLOPT_SSLKEY, c->key_file);
    if (c->insecure) {
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    *headers = hl;
    return BT_OK;
nomem:
    curl_slist_free_all(hl);
    return bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
}

static bt_status map_grpc_code(int code)
{
    switch (code) {
    case 3: return BT_ERR_INVALID;     /* INVALID_ARGUMENT */
    case 4: return BT_ERR_TIMEOUT;     /* DEADLINE_EXCEEDED */
    case 5: return BT_ERR_NOT_FOUND;   /* NOT_FOUND */
    case 8: return BT_ERR_EXHAUSTED;   /* RESOURCE_EXHAUSTED */
    case 11: return BT_ERR_STALE;      /* OUT_OF_RANGE: compacted or future revision */
    case 14: return BT_ERR_UNAVAILABLE;
    default: return BT_ERR_PEER;
    }
}

enum { CALL_NO_AUTH = 1 };

static bt_status call_dl(etcd_client_t *c, const char *path, const char *body, etcd_buf *resp, int64_t deadline,
                         int flags);

/* Copies the current token, authenticating first if there is none. */
static bt_status ensure_token(etcd_client_t *c, int64_t deadline, char **token)
{
    pthread_mutex_lock(&c->mu);
    char *t = c->token ? strdup(c->token) : NULL;
    int have = c->token != NULL;
    pthread_mutex_unlock(&c->mu);
    if (have) {
        if (!t) return bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
        *token = t;
        return BT_OK;
    }
    cJSON *req = cJSON_CreateObject();
    char *body = NULL;
    etcd_buf resp = {.limit = c->max_response};
    bt_status st = BT_OK;
    if (!req || !cJSON_AddStringToObject(req, "name", c->user) ||
        !cJSON_AddStringToObject(req, "password", c->password) || !(body = cJSON_PrintUnformatted(req))) {
        st = bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
        goto out;
    }
    if ((st = call_dl(c, "/v3/auth/authenticate", body, &resp, deadline, CALL_NO_AUTH))) {
        if (st == BT_ERR_INVALID) { /* refused credentials */
            char msg[256];
            snprintf(msg, sizeof msg, "%s", bt_last_error());
            st = bt_fail(BT_ERR_PEER, "%s", msg);
        }
        goto out;
    }
    if ((st = etcd_json_parse_token(resp.data, resp.len, &t))) goto out;
    pthread_mutex_lock(&c->mu);
    free(c->token);
    c->token = strdup(t);
    pthread_mutex_unlock(&c->mu);
    BT_DEBUG("etcd", "authenticated as %s", c->user);
    *token = t;
out:
    buf_free(&resp);
    cJSON_free(body);
    cJSON_Delete(req);
    return st;
}

static bt_status call_dl(etcd_client_t *c, const char *path, const char *body, etcd_buf *resp, int64_t deadline,
                         int flags)
{
    char *token = NULL;
    int reauthed = 0;
    bt_status st;
    if (c->user && !(flags & CALL_NO_AUTH) && (st = ensure_token(c, deadline, &token))) return st;
    CURL *h = handle_get(c);
    if (!h) {
        free(token);
        return bt_fail(BT_ERR_NOMEM, "etcd: curl handle allocation failed");
    }
retry:
    st = bt_fail(BT_ERR_UNAVAILABLE, "etcd %s: no endpoint tried", path);
    size_t start = current_endpoint(c);
    for (size_t i = 0; i < c->n_endpoints; i++) {
        size_t idx = (start + i) % c->n_endpoints;
        const char *ep = c->endpoints[idx];
        int64_t remaining = deadline - now_ms();
        if (remaining <= 0) {
            st = bt_fail(BT_ERR_TIMEOUT, "etcd %s: no answer within %d ms", path, c->timeout_ms);
            break;
        }
        char url[1024];
        snprintf(url, sizeof url, "%s%s", ep, path);
        struct curl_slist *headers = NULL;
        if ((st = setup_handle(c, h, url, body, &headers, token))) break;
        resp->len = 0;
        resp->overflow = 0;
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, buf_write_cb);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, resp);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)remaining);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)remaining);
        CURLcode cr = curl_easy_perform(h);
        long code = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
        curl_slist_free_all(headers);
        if (resp->overflow) {
            st = bt_fail(BT_ERR_EXHAUSTED, "etcd %s: answer from %s exceeds %zu bytes", path, ep, c->max_response);
            goto out;
        }
        if (cr != CURLE_OK) {
            st = bt_fail(cr == CURLE_OPERATION_TIMEDOUT ? BT_ERR_TIMEOUT : BT_ERR_UNAVAILABLE, "etcd %s at %s: %s",
                         path, ep, curl_easy_strerror(cr));
            advance_endpoint(c, idx);
            continue;
        }
        if (!resp->data && buf_append(resp, "", 0)) {
            st = bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
            goto out;
        }
        if (code == 200) {
            set_current(c, idx);
            st = BT_OK;
            goto out;
        }
        int ecode = 2;
        char msg[256];
        if (etcd_json_parse_error(resp->data, resp->len, &ecode, msg, sizeof msg)) {
            snprintf(msg, sizeof msg, "HTTP %ld", code);
            ecode = code == 503 ? 14 : code == 404 ? 12 : 2;
        }
        if (ecode == 14) { /* this member cannot serve (no leader, stopping): try the next one */
            st = bt_fail(BT_ERR_UNAVAILABLE, "etcd %s at %s: %s", path, ep, msg);
            advance_endpoint(c, idx);
            continue;
        }
        set_current(c, idx);
        if (token && !reauthed && (ecode == 16 || strstr(msg, "auth store is old"))) {
            /* UNAUTHENTICATED: token expired or revoked; or the auth store changed under the token */
            reauthed = 1;
            invalidate_token(c, token);
            free(token);
            token = NULL;
            if ((st = ensure_token(c, deadline, &token))) goto out;
            goto retry;
        }
        st = bt_fail(map_grpc_code(ecode), "etcd %s: %s (code %d)", path, msg, ecode);
        goto out;
    }
out:
    handle_put(c, h);
    free(token);
    return st;
}

/* POSTs a JSON request built by the caller (consumed), returns the 200 answer's body in resp. */
static bt_status call_json(etcd_client_t *c, const char *path, cJSON *req, int build_ok, etcd_buf *resp)
{
    char *body = build_ok && req ? cJSON_PrintUnformatted(req) : NULL;
    cJSON_Delete(req);
    if (!body) return bt_fail(BT_ERR_NOMEM, "etcd: out of memory building a request");
    resp->limit = c->max_response;
    bt_status st = call_dl(c, path, body, resp, now_ms() + c->timeout_ms, 0);
    cJSON_free(body);
    return st;
}

/* ---- request building ---- */

static int add_b64(cJSON *o, const char *name, const void *data, size_t n)
{
    char *s;
    if (base64_encode(data ? data : "", n, &s)) return 0;
    int ok = cJSON_AddStringToObject(o, name, s) != NULL;
    free(s);
    return ok;
}

static int add_i64(cJSON *o, const char *name, int64_t v)
{
    char s[24];
    snprintf(s, sizeof s, "%lld", (long long)v);
    return cJSON_AddStringToObject(o, name, s) != NULL;
}

/* range_end for "every key starting with key": the key with its last byte below 0xff incremented, the rest
 * dropped; "\0" (all keys >= key) when there is none. */
static int add_prefix_end(cJSON *o, const char *key)
{
    size_t n = strlen(key);
    unsigned char *end = malloc(n + 1);
    if (!end) return 0;
    memcpy(end, key, n);
    while (n && end[n - 1] == 0xff) n--;
    size_t len;
    if (n) {
        end[n - 1]++;
        len = n;
    } else {
        end[0] = 0;
        len = 1;
    }
    int ok = add_b64(o, "range_end", end, len);
    free(end);
    return ok;
}

static int add_key(cJSON *o, const char *key, int prefix)
{
    return add_b64(o, "key", key, strlen(key)) && (!prefix || add_prefix_end(o, key));
}

/* ---- kv ---- */

bt_status etcd_range(etcd_client_t *c, const char *key, const etcd_range_opts_t *opts, etcd_range_result_t *out)
{
    if (!c || !key || !out) return bt_fail(BT_ERR_INVALID, "etcd_range: NULL argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_key(req, key, opts && opts->prefix);
    if (ok && opts) {
        if (opts->limit) ok = ok && add_i64(req, "limit", opts->limit);
        if (opts->revision) ok = ok && add_i64(req, "revision", opts->revision);
        if (opts->keys_only) ok = ok && cJSON_AddTrueToObject(req, "keys_only");
        if (opts->count_only) ok = ok && cJSON_AddTrueToObject(req, "count_only");
    }
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/kv/range", req, ok, &resp);
    if (!st) st = etcd_json_parse_range(resp.data, resp.len, out);
    buf_free(&resp);
    return st;
}

bt_status etcd_get(etcd_client_t *c, const char *key, char **value, size_t *value_len, int64_t *mod_revision)
{
    etcd_range_result_t r;
    bt_status st = etcd_range(c, key, NULL, &r);
    if (st) return st;
    if (r.n_kvs == 0) {
        etcd_range_result_free(&r);
        return bt_fail(BT_ERR_NOT_FOUND, "etcd: no key %s", key);
    }
    *value = r.kvs[0].value;
    *value_len = r.kvs[0].value_len;
    if (mod_revision) *mod_revision = r.kvs[0].mod_revision;
    r.kvs[0].value = NULL;
    etcd_range_result_free(&r);
    return BT_OK;
}

static int fill_put(cJSON *o, const char *key, const void *value, size_t value_len, int64_t lease)
{
    return add_b64(o, "key", key, strlen(key)) && add_b64(o, "value", value, value_len) &&
           (!lease || add_i64(o, "lease", lease));
}

bt_status etcd_put(etcd_client_t *c, const char *key, const void *value, size_t value_len, int64_t lease,
                   int64_t *revision)
{
    if (!c || !key || (!value && value_len)) return bt_fail(BT_ERR_INVALID, "etcd_put: NULL argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && fill_put(req, key, value, value_len, lease);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/kv/put", req, ok, &resp);
    int64_t rev;
    if (!st && !(st = etcd_json_parse_revision(resp.data, resp.len, &rev)) && revision) *revision = rev;
    buf_free(&resp);
    return st;
}

bt_status etcd_delete(etcd_client_t *c, const char *key, int prefix, int64_t *deleted, int64_t *revision)
{
    if (!c || !key) return bt_fail(BT_ERR_INVALID, "etcd_delete: NULL argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_key(req, key, prefix);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/kv/deleterange", req, ok, &resp);
    int64_t del, rev;
    if (!st && !(st = etcd_json_parse_delete(resp.data, resp.len, &del, &rev))) {
        if (deleted) *deleted = del;
        if (revision) *revision = rev;
    }
    buf_free(&resp);
    return st;
}

static int add_ops(cJSON *req, const char *name, const etcd_op_t *ops, size_t n)
{
    if (!n) return 1;
    cJSON *arr = cJSON_AddArrayToObject(req, name);
    if (!arr) return 0;
    for (size_t i = 0; i < n; i++) {
        cJSON *item = cJSON_CreateObject();
        if (!item) return 0;
        cJSON_AddItemToArray(arr, item);
        if (!ops[i].key) return 0;
        if (ops[i].type == ETCD_OP_PUT) {
            cJSON *p = cJSON_AddObjectToObject(item, "request_put");
            if (!p || !fill_put(p, ops[i].key, ops[i].value, ops[i].value_len, ops[i].lease)) return 0;
        } else {
            cJSON *d = cJSON_AddObjectToObject(item, "request_delete_range");
            if (!d || !add_key(d, ops[i].key, ops[i].prefix)) return 0;
        }
    }
    return 1;
}

bt_status etcd_txn(etcd_client_t *c, const etcd_cmp_t *cmp, size_t n_cmp, const etcd_op_t *then, size_t n_then,
                   const etcd_op_t *otherwise, size_t n_otherwise, int *succeeded, int64_t *revision)
{
    static const char *const targets[] = {"VERSION", "CREATE", "MOD", "VALUE", "LEASE"};
    static const char *const fields[] = {"version", "create_revision", "mod_revision", "value", "lease"};
    static const char *const results[] = {"EQUAL", "GREATER", "LESS", "NOT_EQUAL"};
    if (!c || !succeeded || (n_cmp && !cmp) || (n_then && !then) || (n_otherwise && !otherwise))
        return bt_fail(BT_ERR_INVALID, "etcd_txn: NULL argument");
    for (size_t i = 0; i < n_cmp; i++)
        if (!cmp[i].key || (unsigned)cmp[i].target > ETCD_CMP_LEASE || (unsigned)cmp[i].result > ETCD_CMP_NOT_EQUAL)
            return bt_fail(BT_ERR_INVALID, "etcd_txn: bad comparison %zu", i);
    for (size_t i = 0; i < n_then + n_otherwise; i++) {
        const etcd_op_t *op = i < n_then ? &then[i] : &otherwise[i - n_then];
        if (!op->key || (unsigned)op->type > ETCD_OP_DELETE) return bt_fail(BT_ERR_INVALID, "etcd_txn: bad op");
    }
    cJSON *req = cJSON_CreateObject();
    int ok = req != NULL;
    cJSON *arr = ok && n_cmp ? cJSON_AddArrayToObject(req, "compare") : NULL;
    ok = ok && (!n_cmp || arr);
    for (size_t i = 0; ok && i < n_cmp; i++) {
        cJSON *o = cJSON_CreateObject();
        if (!o) {
            ok = 0;
            break;
        }
        cJSON_AddItemToArray(arr, o);
        ok = cJSON_AddStringToObject(o, "target", targets[cmp[i].target]) &&
             cJSON_AddStringToObject(o, "result", results[cmp[i].result]) &&
             add_b64(o, "key", cmp[i].key, strlen(cmp[i].key)) &&
             (cmp[i].target == ETCD_CMP_VALUE ? add_b64(o, "value", cmp[i].value, cmp[i].value_len)
                                               : add_i64(o, fields[cmp[i].target], cmp[i].number));
    }
    ok = ok && add_ops(req, "success", then, n_then) && add_ops(req, "failure", otherwise, n_otherwise);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/kv/txn", req, ok, &resp);
    int s;
    int64_t rev;
    if (!st && !(st = etcd_json_parse_txn(resp.data, resp.len, &s, &rev))) {
        *succeeded = s;
        if (revision) *revision = rev;
    }
    buf_free(&resp);
    return st;
}

/* ---- leases ---- */

bt_status etcd_lease_grant(etcd_client_t *c, int64_t ttl_s, int64_t *id, int64_t *granted_ttl)
{
    if (!c || !id || ttl_s <= 0) return bt_fail(BT_ERR_INVALID, "etcd_lease_grant: bad argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_i64(req, "TTL", ttl_s);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/lease/grant", req, ok, &resp);
    int64_t i, t;
    if (!st && !(st = etcd_json_parse_lease(resp.data, resp.len, 0, &i, &t, NULL))) {
        if (i == 0 || t <= 0) {
            st = bt_fail(BT_ERR_FORMAT, "etcd: lease grant answer without ID or TTL");
        } else {
            *id = i;
            if (granted_ttl) *granted_ttl = t;
        }
    }
    buf_free(&resp);
    return st;
}

bt_status etcd_lease_keepalive(etcd_client_t *c, int64_t id, int64_t *ttl)
{
    if (!c || !id) return bt_fail(BT_ERR_INVALID, "etcd_lease_keepalive: bad argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_i64(req, "ID", id);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/lease/keepalive", req, ok, &resp);
    int64_t i, t;
    if (!st && !(st = etcd_json_parse_lease(resp.data, resp.len, 1, &i, &t, NULL))) {
        /* An expired or unknown lease is answered with 200 and no TTL. */
        if (t <= 0) st = bt_fail(BT_ERR_NOT_FOUND, "etcd: lease %llx expired or unknown", (unsigned long long)id);
        else if (ttl) *ttl = t;
    }
    buf_free(&resp);
    return st;
}

bt_status etcd_lease_revoke(etcd_client_t *c, int64_t id)
{
    if (!c || !id) return bt_fail(BT_ERR_INVALID, "etcd_lease_revoke: bad argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_i64(req, "ID", id);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/lease/revoke", req, ok, &resp);
    int64_t rev;
    if (!st) st = etcd_json_parse_revision(resp.data, resp.len, &rev);
    buf_free(&resp);
    return st;
}

bt_status etcd_lease_timetolive(etcd_client_t *c, int64_t id, int64_t *ttl, int64_t *granted_ttl)
{
    if (!c || !id) return bt_fail(BT_ERR_INVALID, "etcd_lease_timetolive: bad argument");
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_i64(req, "ID", id);
    etcd_buf resp = {0};
    bt_status st = call_json(c, "/v3/lease/timetolive", req, ok, &resp);
    int64_t i, t, g;
    if (!st && !(st = etcd_json_parse_lease(resp.data, resp.len, 0, &i, &t, &g))) {
        if (t < 0) { /* etcd answers TTL -1 for an expired or unknown lease */
            st = bt_fail(BT_ERR_NOT_FOUND, "etcd: lease %llx expired or unknown", (unsigned long long)id);
        } else {
            if (ttl) *ttl = t;
            if (granted_ttl) *granted_ttl = g;
        }
    }
    buf_free(&resp);
    return st;
}

bt_status etcd_authenticate(etcd_client_t *c)
{
    if (!c || !c->user) return bt_fail(BT_ERR_INVALID, "etcd: no user configured");
    pthread_mutex_lock(&c->mu);
    free(c->token);
    c->token = NULL;
    pthread_mutex_unlock(&c->mu);
    char *token;
    bt_status st = ensure_token(c, now_ms() + c->timeout_ms, &token);
    if (!st) free(token);
    return st;
}

/* ---- watch ---- */

struct etcd_watch {
    etcd_client_t *c;
    char *key;
    int prefix;
    etcd_watch_ops_t ops;
    int64_t next_rev;   /* revision to resume from; 0 = now (or resync) */
    int need_resync;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int stop;
    CURLM *multi;
    /* per stream, watch thread only */
    etcd_lines_t lines;
    int connected;
    int failed;         /* the stream must be dropped and reconnected */
    int auth_failed;
};

static void watch_sleep(etcd_watch_t *w, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&w->mu);
    while (!atomic_load(&w->stop))
        if (pthread_cond_timedwait(&w->cv, &w->mu, &ts)) break;
    pthread_mutex_unlock(&w->mu);
}

/* Handles one line of the stream; returns 0 to keep reading, -1 to drop the stream. */
static int watch_line(etcd_watch_t *w, const char *p, size_t n)
{
    while (n && (p[n - 1] == '\r' || p[n - 1] == ' ')) n--;
    if (!n) return 0;
    etcd_watch_msg_t m;
    if (etcd_json_parse_watch(p, n, &m)) {
        BT_WARN("etcd", "watch %s: dropping stream: %s", w->key, bt_last_error());
        return -1;
    }
    int rc = 0;
    if (m.is_error) {
        BT_WARN("etcd", "watch %s: stream error: %s", w->key, m.reason);
        if (strstr(m.reason, "auth")) w->auth_failed = 1;
        rc = -1;
    } else if (m.canceled) {
        if (m.compact_revision > 0) {
            BT_WARN("etcd", "watch %s: revision %lld compacted (oldest %lld)", w->key, (long long)w->next_rev,
                    (long long)m.compact_revision);
            if (w->ops.resync) w->need_resync = 1;
            else w->next_rev = m.compact_revision;
        } else {
            BT_WARN("etcd", "watch %s: canceled: %s", w->key, m.reason);
            if (strstr(m.reason, "auth") || strstr(m.reason, "Unauthenticated")) w->auth_failed = 1;
        }
        rc = -1;
    } else if (m.created && w->next_rev > 0 && m.revision + 1 < w->next_rev) {
        /* the store is behind what we already saw: etcd lost its data (new cluster, wiped volume) */
        BT_WARN("etcd", "watch %s: etcd is at revision %lld, before the %lld already seen; reloading", w->key,
                (long long)m.revision, (long long)w->next_rev - 1);
        if (w->ops.resync) w->need_resync = 1;
        w->next_rev = w->ops.resync ? 0 : m.revision + 1;
        rc = -1;
    } else if (m.created) {
        if (!w->connected) {
            w->connected = 1;
            if (w->next_rev == 0) w->next_rev = m.revision + 1;
            if (w->ops.on_state) w->ops.on_state(w->ops.arg, 1);
        }
    } else if (m.n_events) {
        int64_t last = 0;
        for (size_t i = 0; i < m.n_events; i++)
            if (m.events[i].kv.mod_revision > last) last = m.events[i].kv.mod_revision;
        w->ops.on_events(w->ops.arg, m.events, m.n_events);
        if (last + 1 > w->next_rev) w->next_rev = last + 1;
    } else if (m.revision + 1 > w->next_rev && w->connected) {
        w->next_rev = m.revision + 1; /* progress notification: nothing up to this revision is pending */
    }
    etcd_watch_msg_free(&m);
    return rc;
}

static int watch_line_cb(void *ud, const char *line, size_t len)
{
    return watch_line(ud, line, len);
}

static size_t watch_write_cb(char *ptr, size_t size, size_t nmemb, void *ud)
{
    etcd_watch_t *w = ud;
    size_t n = size * nmemb;
    if (atomic_load(&w->stop)) return 0;
    bt_status st = etcd_lines_feed(&w->lines, ptr, n, watch_line_cb, w);
    if (st != BT_OK) {
        if (st != BT_ERR_CANCELLED) BT_WARN("etcd", "watch %s: %s", w->key, bt_last_error());
        w->failed = 1;
        return 0;
    }
    return n;
}

/* Runs one stream until it ends, fails or the watch is stopped. */
static void watch_stream(etcd_watch_t *w, CURL *h, const char *token)
{
    etcd_client_t *c = w->c;
    size_t idx = current_endpoint(c);
    cJSON *req = cJSON_CreateObject();
    cJSON *cr = req ? cJSON_AddObjectToObject(req, "create_request") : NULL;
    int ok = cr && add_key(cr, w->key, w->prefix) && cJSON_AddTrueToObject(cr, "prev_kv") &&
             (!w->next_rev || add_i64(cr, "start_revision", w->next_rev));
    char *body = ok ? cJSON_PrintUnformatted(req) : NULL;
    cJSON_Delete(req);
    if (!body) {
        w->failed = 1;
        return;
    }
    char url[1024];
    snprintf(url, sizeof url, "%s/v3/watch", c->endpoints[idx]);
    struct curl_slist *headers = NULL;
    if (setup_handle(c, h, url, body, &headers, token)) {
        cJSON_free(body);
        w->failed = 1;
        return;
    }
    etcd_lines_reset(&w->lines);
    w->lines.limit = c->max_response;
    w->connected = 0;
    w->failed = 0;
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, watch_write_cb);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, w);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)c->timeout_ms);
    curl_multi_add_handle(w->multi, h);
    int64_t started = now_ms();
    int running = 1;
    while (running && !atomic_load(&w->stop) && !w->failed) {
        if (curl_multi_perform(w->multi, &running) != CURLM_OK) break;
        if (!running) break;
        if (!w->connected && now_ms() - started > c->timeout_ms) {
            BT_WARN("etcd", "watch %s: %s did not confirm the watch within %d ms", w->key, c->endpoints[idx],
                    c->timeout_ms);
            w->failed = 1;
            break;
        }
        curl_multi_poll(w->multi, NULL, 0, 500, NULL);
    }
    long code = 0;
    CURLcode result = CURLE_OK;
    int msgs;
    CURLMsg *msg;
    while ((msg = curl_multi_info_read(w->multi, &msgs)))
        if (msg->msg == CURLMSG_DONE) result = msg->data.result;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_multi_remove_handle(w->multi, h);
    curl_slist_free_all(headers);
    cJSON_free(body);
    if (atomic_load(&w->stop)) return;
    if (!w->connected && !w->failed) {
        if (result != CURLE_OK) BT_DEBUG("etcd", "watch %s at %s: %s", w->key, c->endpoints[idx], curl_easy_strerror(result));
        else BT_WARN("etcd", "watch %s at %s: stream ended (HTTP %ld)", w->key, c->endpoints[idx], code);
    }
    if (!w->connected) advance_endpoint(c, idx);
}

static void *watch_main(void *arg)
{
    etcd_watch_t *w = arg;
    etcd_client_t *c = w->c;
    int backoff = 0;
    CURL *h = curl_easy_init();
    while (h && !atomic_load(&w->stop)) {
        if (backoff) {
            watch_sleep(w, backoff);
            if (atomic_load(&w->stop)) break;
        }
        backoff = backoff ? backoff * 2 : ETCD_WATCH_BACKOFF_MIN_MS;
        if (backoff > ETCD_WATCH_BACKOFF_MAX_MS) backoff = ETCD_WATCH_BACKOFF_MAX_MS;
        if (w->need_resync) {
            int64_t rev;
            bt_status st = w->ops.resync(w->ops.arg, &rev);
            if (st) {
                BT_DEBUG("etcd", "watch %s: resync failed: %s", w->key, bt_last_error());
                continue;
            }
            w->next_rev = rev;
            w->need_resync = 0;
        }
        char *token = NULL;
        if (c->user && ensure_token(c, now_ms() + c->timeout_ms, &token)) {
            BT_DEBUG("etcd", "watch %s: %s", w->key, bt_last_error());
            continue;
        }
        w->auth_failed = 0;
        watch_stream(w, h, token);
        if (w->auth_failed) invalidate_token(c, token);
        free(token);
        if (w->connected) {
            backoff = ETCD_WATCH_BACKOFF_MIN_MS;
            if (w->ops.on_state) w->ops.on_state(w->ops.arg, 0);
        }
    }
    if (h) curl_easy_cleanup(h);
    return NULL;
}

bt_status etcd_watch_start(etcd_client_t *c, const char *key, int prefix, int64_t start_revision,
                           const etcd_watch_ops_t *ops, etcd_watch_t **out)
{
    if (!c || !key || !ops || !ops->on_events || start_revision < 0)
        return bt_fail(BT_ERR_INVALID, "etcd_watch_start: bad argument");
    etcd_watch_t *w = calloc(1, sizeof *w);
    if (!w) return bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
    bt_status st = BT_ERR_NOMEM;
    w->c = c;
    w->prefix = prefix;
    w->ops = *ops;
    w->next_rev = start_revision;
    w->need_resync = start_revision == 0 && ops->resync;
    if (!(w->key = strdup(key))) goto fail_key;
    if (!(w->multi = curl_multi_init())) goto fail_multi;
    if (pthread_mutex_init(&w->mu, NULL)) goto fail_mu;
    if (pthread_cond_init(&w->cv, NULL)) goto fail_cv;
    if (pthread_create(&w->thread, NULL, watch_main, w)) {
        st = bt_fail(BT_ERR_INTERNAL, "etcd: cannot start the watch thread");
        goto fail_thread;
    }
    *out = w;
    return BT_OK;
fail_thread:
    pthread_cond_destroy(&w->cv);
fail_cv:
    pthread_mutex_destroy(&w->mu);
fail_mu:
    curl_multi_cleanup(w->multi);
fail_multi:
    free(w->key);
fail_key:
    free(w);
    if (st == BT_ERR_NOMEM) bt_fail(st, "etcd: out of memory starting a watch");
    return st;
}

void etcd_watch_stop(etcd_watch_t *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    atomic_store(&w->stop, 1);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    curl_multi_wakeup(w->multi);
    pthread_join(w->thread, NULL);
    curl_multi_cleanup(w->multi);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    etcd_lines_free(&w->lines);
    free(w->key);
    free(w);
}
