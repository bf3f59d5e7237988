#include "common/etcd_json.h"

#include "common/base64.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bt_status json_open(const char *body, size_t len, cJSON **root)
{
    if (!body || len == 0) return bt_fail(BT_ERR_FORMAT, "etcd: empty answer");
    cJSON *j = cJSON_ParseWithLength(body, len);
    if (!j) return bt_fail(BT_ERR_FORMAT, "etcd: answer is not valid JSON");
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return bt_fail(BT_ERR_FORMAT, "etcd: answer is not a JSON object");
    }
    *root = j;
    return BT_OK;
}

/* int64 field: a decimal string (the gateway's encoding) or an integral number; absent or null = 0. */
static bt_status json_i64(const cJSON *obj, const char *name, int64_t *out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!f || cJSON_IsNull(f)) {
        *out = 0;
        return BT_OK;
    }
    if (cJSON_IsString(f)) {
        const char *s = f->valuestring;
        if (!*s) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is an empty string", name);
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || *end || end == s) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not an int64", name);
        *out = v;
        return BT_OK;
    }
    if (cJSON_IsNumber(f)) {
        double d = f->valuedouble;
        if (!isfinite(d) || d != floor(d) || d < -9.2e18 || d > 9.2e18)
            return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not an int64", name);
        *out = (int64_t)d;
        return BT_OK;
    }
    return bt_fail(BT_ERR_FORMAT, "etcd: field %s has the wrong type", name);
}

static bt_status json_bool(const cJSON *obj, const char *name, int *out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!f || cJSON_IsNull(f)) {
        *out = 0;
        return BT_OK;
    }
    if (!cJSON_IsBool(f)) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not a boolean", name);
    *out = cJSON_IsTrue(f);
    return BT_OK;
}

/* Base64 bytes field; absent = empty. *out is a new NUL-terminated buffer. */
static bt_status json_b64(const cJSON *obj, const char *name, char **out, size_t *out_len)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    const char *s = "";
    if (f && !cJSON_IsNull(f)) {
        if (!cJSON_IsString(f)) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not a string", name);
        s = f->valuestring;
    }
    uint8_t *buf;
    size_t n;
    bt_status st = base64_decode(s, strlen(s), &buf, &n);
    if (st) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        return bt_fail(st, "etcd: field %s: %s", name, msg);
    }
    *out = (char *)buf;
    *out_len = n;
    return BT_OK;
}

/* Optional object field: absent or null gives NULL; any other non-object is a format error. */
static bt_status json_obj(const cJSON *obj, const char *name, const cJSON **out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (f && cJSON_IsNull(f)) f = NULL;
    if (f && !cJSON_IsObject(f)) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not an object", name);
    *out = f;
    return BT_OK;
}

static bt_status json_arr(const cJSON *obj, const char *name, const cJSON **out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (f && cJSON_IsNull(f)) f = NULL;
    if (f && !cJSON_IsArray(f)) return bt_fail(BT_ERR_FORMAT, "etcd: field %s is not an array", name);
    *out = f;
    return BT_OK;
}

static bt_status json_header_revision(const cJSON *root, int64_t *revision)
{
    const cJSON *h;
    bt_status st = json_obj(root, "header", &h);
    if (st) return st;
    if (!h) {
        *revision = 0;
        return BT_OK;
    }
    return json_i64(h, "revision", revision);
}

void etcd_kv_free(etcd_kv_t *kv)
{
    free(kv->key);
    free(kv->value);
    memset(kv, 0, sizeof *kv);
}

static bt_status json_kv(const cJSON *o, etcd_kv_t *out)
{
    etcd_kv_t kv = {0};
    bt_status st;
    if (!cJSON_IsObject(o)) return bt_fail(BT_ERR_FORMAT, "etcd: kv is not an object");
    if ((st = json_i64(o, "create_revision", &kv.create_revision)) || (st = json_i64(o, "mod_revision", &kv.mod_revision)) ||
        (st = json_i64(o, "version", &kv.version)) || (st = json_i64(o, "lease", &kv.lease)))
        return st;
    if ((st = json_b64(o, "key", &kv.key, &kv.key_len))) goto fail;
    if ((st = json_b64(o, "value", &kv.value, &kv.value_len))) goto fail;
    *out = kv;
    return BT_OK;
fail:
    etcd_kv_free(&kv);
    return st;
}

bt_status etcd_json_parse_error(const char *body, size_t len, int *code, char *msg, size_t msg_cap)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    int64_t c = 0;
    if ((st = json_i64(root, "code", &c))) goto out;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "message");
    if (!m || !cJSON_IsString(m)) m = cJSON_GetObjectItemCaseSensitive(root, "error");
    if (!m || !cJSON_IsString(m)) {
        st = bt_fail(BT_ERR_FORMAT, "etcd: error answer without a message");
        goto out;
    }
    if (c < 0 || c > 1000) c = 2; /* gRPC UNKNOWN */
    *code = (int)c;
    if (msg_cap) {
        strncpy(msg, m->valuestring, msg_cap - 1);
        msg[msg_cap - 1] = '\0';
    }
out:
    cJSON_Delete(root);
    return st;
}

bt_status etcd_json_parse_range(const char *body, size_t len, etcd_range_result_t *out)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    etcd_range_result_t r = {0};
    const cJSON *kvs;
    if ((st = json_header_revision(root, &r.revision)) || (st = json_i64(root, "count", &r.count)) ||
        (st = json_bool(root, "more", &r.more)) || (st = json_arr(root, "kvs", &kvs)))
        goto fail;
    int n = kvs ? cJSON_GetArraySize(kvs) : 0;
    if (n > 0) {
        r.kvs = calloc((size_t)n, sizeof *r.kvs);
        if (!r.kvs) {
            st = bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
            goto fail;
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, kvs) {
            if ((st = json_kv(e, &r.kvs[r.n_kvs]))) goto fail;
            r.n_kvs++;
        }
    }
    cJSON_Delete(root);
    *out = r;
    return BT_OK;
fail:
    etcd_range_result_free(&r);
    cJSON_Delete(root);
    return st;
}

bt_status etcd_json_parse_revision(const char *body, size_t len, int64_t *revision)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    int64_t rev;
    st = json_header_revision(root, &rev);
    cJSON_Delete(root);
    if (!st) *revision = rev;
    return st;
}

bt_status etcd_json_parse_delete(const char *body, size_t len, int64_t *deleted, int64_t *revision)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    int64_t rev, del;
    if (!(st = json_header_revision(root, &rev)) && !(st = json_i64(root, "deleted", &del))) {
        *deleted = del;
        *revision = rev;
    }
    cJSON_Delete(root);
    return st;
}

bt_status etcd_json_parse_txn(const char *body, size_t len, int *succeeded, int64_t *revision)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    int64_t rev;
    int ok;
    const cJSON *resp;
    if (!(st = json_header_revision(root, &rev)) && !(st = json_bool(root, "succeeded", &ok)) &&
        !(st = json_arr(root, "responses", &resp))) {
        *succeeded = ok;
        *revision = rev;
    }
    cJSON_Delete(root);
    return st;
}

bt_status etcd_json_parse_lease(const char *body, size_t len, int in_result, int64_t *id, int64_t *ttl,
                                int64_t *granted)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    const cJSON *o = root;
    if (in_result) {
        if ((st = json_obj(root, "result", &o))) goto out;
        if (!o) {
            st = bt_fail(BT_ERR_FORMAT, "etcd: keepalive answer without a result");
            goto out;
        }
    }
    int64_t i, t, g;
    if ((st = json_i64(o, "ID", &i)) || (st = json_i64(o, "TTL", &t)) || (st = json_i64(o, "grantedTTL", &g))) goto out;
    *id = i;
    *ttl = t;
    if (granted) *granted = g;
out:
    cJSON_Delete(root);
    return st;
}

bt_status etcd_json_parse_token(const char *body, size_t len, char **token)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "token");
    if (!t || !cJSON_IsString(t) || !t->valuestring[0]) {
        st = bt_fail(BT_ERR_FORMAT, "etcd: authenticate answer without a token");
    } else if (!(*token = strdup(t->valuestring))) {
        st = bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
    }
    cJSON_Delete(root);
    return st;
}

void etcd_watch_msg_free(etcd_watch_msg_t *m)
{
    for (size_t i = 0; i < m->n_events; i++) {
        etcd_kv_free(&m->events[i].kv);
        etcd_kv_free(&m->events[i].prev_kv);
    }
    free(m->events);
    memset(m, 0, sizeof *m);
}

static void copy_reason(char *dst, size_t cap, const cJSON *s)
{
    if (s && cJSON_IsString(s)) {
        strncpy(dst, s->valuestring, cap - 1);
        dst[cap - 1] = '\0';
    }
}

bt_status etcd_json_parse_watch(const char *body, size_t len, etcd_watch_msg_t *out)
{
    cJSON *root;
    bt_status st = json_open(body, len, &root);
    if (st) return st;
    etcd_watch_msg_t m = {0};
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(root, "error");
    if (err) {
        /* grpc-gateway stream error: {"error":{"grpc_code":14,"message":...}} */
        m.is_error = 1;
        if (cJSON_IsObject(err)) copy_reason(m.reason, sizeof m.reason, cJSON_GetObjectItemCaseSensitive(err, "message"));
        else copy_reason(m.reason, sizeof m.reason, err);
        goto done;
    }
    const cJSON *r;
    if ((st = json_obj(root, "result", &r))) goto fail;
    if (!r) {
        st = bt_fail(BT_ERR_FORMAT, "etcd: watch message without a result");
        goto fail;
    }
    const cJSON *evs;
    if ((st = json_header_revision(r, &m.revision)) || (st = json_bool(r, "created", &m.created)) ||
        (st = json_bool(r, "canceled", &m.canceled)) || (st = json_i64(r, "compact_revision", &m.compact_revision)) ||
        (st = json_arr(r, "events", &evs)))
        goto fail;
    copy_reason(m.reason, sizeof m.reason, cJSON_GetObjectItemCaseSensitive(r, "cancel_reason"));
    int n = evs ? cJSON_GetArraySize(evs) : 0;
    if (n > 0) {
        m.events = calloc((size_t)n, sizeof *m.events);
        if (!m.events) {
            st = bt_fail(BT_ERR_NOMEM, "etcd: out of memory");
            goto fail;
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, evs) {
            etcd_event_t *ev = &m.events[m.n_events];
            if (!cJSON_IsObject(e)) {
                st = bt_fail(BT_ERR_FORMAT, "etcd: watch event is not an object");
                goto fail;
            }
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(e, "type");
            if (!type || cJSON_IsNull(type) || (cJSON_IsString(type) && !strcmp(type->valuestring, "PUT")) ||
                (cJSON_IsNumber(type) && type->valuedouble == 0)) {
                ev->type = ETCD_EVENT_PUT;
            } else if ((cJSON_IsString(type) && !strcmp(type->valuestring, "DELETE")) ||
                       (cJSON_IsNumber(type) && type->valuedouble == 1)) {
                ev->type = ETCD_EVENT_DELETE;
            } else {
                st = bt_fail(BT_ERR_FORMAT, "etcd: unknown watch event type");
                goto fail;
            }
            const cJSON *kv, *prev;
            if ((st = json_obj(e, "kv", &kv)) || (st = json_obj(e, "prev_kv", &prev))) goto fail;
            if (!kv) {
                st = bt_fail(BT_ERR_FORMAT, "etcd: watch event without a kv");
                goto fail;
            }
            m.n_events++; /* counted before filling so that a failure below frees what was filled */
            if ((st = json_kv(kv, &ev->kv))) goto fail;
            if (prev) {
                if ((st = json_kv(prev, &ev->prev_kv))) goto fail;
                ev->has_prev_kv = 1;
            }
        }
    }
done:
    cJSON_Delete(root);
    *out = m;
    return BT_OK;
fail:
    etcd_watch_msg_free(&m);
    cJSON_Delete(root);
    return st;
}

void etcd_range_result_free(etcd_range_result_t *r)
{
    for (size_t i = 0; i < r->n_kvs; i++) etcd_kv_free(&r->kvs[i]);
    free(r->kvs);
    memset(r, 0, sizeof *r);
}

/* ---- watch stream splitter ---- */

bt_status etcd_lines_feed(etcd_lines_t *s, const char *p, size_t n, int (*on_line)(void *ud, const char *line, size_t len),
                          void *ud)
{
    while (n) {
        const char *nl = memchr(p, '\n', n);
        size_t take = nl ? (size_t)(nl - p) : n;
        if (take > s->limit - s->len || s->len > s->limit)
            return bt_fail(BT_ERR_EXHAUSTED, "etcd watch: a message longer than %zu bytes", s->limit);
        if (s->len == 0 && nl) { /* a whole line in the chunk: no copy */
            if (on_line(ud, p, take)) return bt_fail(BT_ERR_CANCELLED, "etcd watch: stream dropped by its reader");
        } else {
            if (s->len + take > s->cap) {
                size_t cap = s->cap ? s->cap : 1024;
                while (cap < s->len + take) cap *= 2;
                char *d = realloc(s->data, cap);
                if (!d) return bt_fail(BT_ERR_NOMEM, "etcd watch: out of memory");
                s->data = d;
                s->cap = cap;
            }
            if (take) memcpy(s->data + s->len, p, take);
            s->len += take;
            if (nl) {
                size_t len = s->len;
                s->len = 0;
                if (on_line(ud, s->data, len)) return bt_fail(BT_ERR_CANCELLED, "etcd watch: stream dropped by its reader");
            }
        }
        if (!nl) break;
        p = nl + 1;
        n -= take + 1;
    }
    return BT_OK;
}

void etcd_lines_reset(etcd_lines_t *s)
{
    s->len = 0;
}

void etcd_lines_free(etcd_lines_t *s)
{
    free(s->data);
    memset(s, 0, sizeof *s);
}
