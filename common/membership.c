#include "common/membership.h"

#include "common/base64.h"
#include "common/log.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits on cv until the monotonic deadline (pthread condvars here use CLOCK_MONOTONIC, see cond_init_mono). */
static void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ms)
{
    struct timespec ts = {deadline_ms / 1000, (long)(deadline_ms % 1000) * 1000000};
    pthread_cond_timedwait(cv, mu, &ts);
}

static int cond_init_mono(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a)) return -1;
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc;
}

const char *mbr_role_name(mbr_role role)
{
    switch (role) {
    case MBR_ROLE_PREFILL: return "prefill";
    case MBR_ROLE_DECODE: return "decode";
    default: return "unknown";
    }
}

static int valid_name(const char *s)
{
    if (!s || !*s) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '.' ||
              *s == '_' || *s == '-'))
            return 0;
    return 1;
}

bt_status mbr_key(char *buf, size_t cap, const char *cluster, const char *kind, const char *node_id)
{
    if (!valid_name(cluster) || !valid_name(kind) || !valid_name(node_id))
        return bt_fail(BT_ERR_INVALID, "membership: bad key part (cluster \"%s\", node \"%s\")", cluster ? cluster : "",
                       node_id ? node_id : "");
    int n = snprintf(buf, cap, "/baton/%s/%s/%s", cluster, kind, node_id);
    if (n < 0 || (size_t)n >= cap) return bt_fail(BT_ERR_INVALID, "membership: key too long");
    return BT_OK;
}

/* ---- JSON ---- */

void mbr_node_info_free(mbr_node_info_t *info)
{
    if (!info) return;
    free(info->ucx_desc);
    info->ucx_desc = NULL;
    info->ucx_desc_len = 0;
}

bt_status mbr_node_info_copy(const mbr_node_info_t *src, mbr_node_info_t *dst)
{
    mbr_node_info_t c = *src;
    c.ucx_desc = NULL;
    if (src->ucx_desc_len) {
        if (!(c.ucx_desc = malloc(src->ucx_desc_len))) return bt_fail(BT_ERR_NOMEM, "membership: out of memory");
        memcpy(c.ucx_desc, src->ucx_desc, src->ucx_desc_len);
    } else {
        c.ucx_desc_len = 0;
    }
    *dst = c;
    return BT_OK;
}

static int add_num(cJSON *o, const char *name, double v)
{
    return cJSON_AddNumberToObject(o, name, v) != NULL;
}

static bt_status print_json(cJSON *root, int ok, char **out)
{
    char *s = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!s) return bt_fail(BT_ERR_NOMEM, "membership: out of memory building JSON");
    *out = strdup(s); /* callers free() it; cJSON may use its own allocator */
    cJSON_free(s);
    return *out ? BT_OK : bt_fail(BT_ERR_NOMEM, "membership: out of memory");
}

bt_status mbr_node_info_to_json(const mbr_node_info_t *n, char **out)
{
    cJSON *root = cJSON_CreateObject();
    char *ucx = NULL;
    if (base64_encode(n->ucx_desc ? (const void *)n->ucx_desc : "", n->ucx_desc_len, &ucx)) {
        cJSON_Delete(root);
        return BT_ERR_NOMEM;
    }
    cJSON *cap = NULL;
    int ok = root && cJSON_AddStringToObject(root, "node_id", n->node_id) &&
             cJSON_AddStringToObject(root, "role", mbr_role_name(n->role)) &&
             cJSON_AddStringToObject(root, "model", n->model) && cJSON_AddStringToObject(root, "grpc_addr", n->grpc_addr) &&
             cJSON_AddStringToObject(root, "http_addr", n->http_addr) && cJSON_AddStringToObject(root, "ucx", ucx) &&
             (cap = cJSON_AddObjectToObject(root, "capacity")) && add_num(cap, "kv_blocks", (double)n->kv_blocks_total) &&
             add_num(cap, "kv_block_tokens", (double)n->kv_block_tokens) &&
             add_num(cap, "max_running", (double)n->max_running) && add_num(cap, "max_context", (double)n->max_context) &&
             cJSON_AddStringToObject(root, "version", n->version) && add_num(root, "started_ms", (double)n->started_ms);
    free(ucx);
    return print_json(root, ok, out);
}

static bt_status get_str(const cJSON *o, const char *name, char *dst, size_t cap, int required)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!f || cJSON_IsNull(f)) {
        if (required) return bt_fail(BT_ERR_FORMAT, "membership: missing field %s", name);
        dst[0] = '\0';
        return BT_OK;
    }
    if (!cJSON_IsString(f)) return bt_fail(BT_ERR_FORMAT, "membership: field %s is not a string", name);
    if (strlen(f->valuestring) >= cap) return bt_fail(BT_ERR_FORMAT, "membership: field %s is too long", name);
    strcpy(dst, f->valuestring);
    return BT_OK;
}

/* Integral JSON number (or decimal string) in [0, 2^53]; absent = 0. */
static bt_status get_i64(const cJSON *o, const char *name, int64_t *out)
{
    const cJSON *f = o ? cJSON_GetObjectItemCaseSensitive(o, name) : NULL;
    if (!f || cJSON_IsNull(f)) {
        *out = 0;
        return BT_OK;
    }
    double d;
    if (cJSON_IsNumber(f)) {
        d = f->valuedouble;
    } else if (cJSON_IsString(f)) {
        char *end;
        d = strtod(f->valuestring, &end);
        if (end == f->valuestring || *end) return bt_fail(BT_ERR_FORMAT, "membership: field %s is not a number", name);
    } else {
        return bt_fail(BT_ERR_FORMAT, "membership: field %s is not a number", name);
    }
    if (!isfinite(d) || d != floor(d) || d < 0 || d > 9007199254740992.0)
        return bt_fail(BT_ERR_FORMAT, "membership: field %s is not a count", name);
    *out = (int64_t)d;
    return BT_OK;
}

static bt_status get_double(const cJSON *o, const char *name, double *out)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!f || cJSON_IsNull(f)) {
        *out = 0;
        return BT_OK;
    }
    if (!cJSON_IsNumber(f) || !isfinite(f->valuedouble) || f->valuedouble < 0)
        return bt_fail(BT_ERR_FORMAT, "membership: field %s is not a rate", name);
    *out = f->valuedouble;
    return BT_OK;
}

static bt_status open_json(const char *json, size_t len, cJSON **root)
{
    if (!json || !len) return bt_fail(BT_ERR_FORMAT, "membership: empty record");
    cJSON *r = cJSON_ParseWithLength(json, len);
    if (!r || !cJSON_IsObject(r)) {
        cJSON_Delete(r);
        return bt_fail(BT_ERR_FORMAT, "membership: record is not a JSON object");
    }
    *root = r;
    return BT_OK;
}

bt_status mbr_node_info_from_json(const char *json, size_t len, mbr_node_info_t *out)
{
    cJSON *root;
    bt_status st = open_json(json, len, &root);
    if (st) return st;
    mbr_node_info_t n;
    memset(&n, 0, sizeof n);
    char role[16];
    const cJSON *cap = cJSON_GetObjectItemCaseSensitive(root, "capacity");
    if (cap && !cJSON_IsNull(cap) && !cJSON_IsObject(cap)) {
        st = bt_fail(BT_ERR_FORMAT, "membership: capacity is not an object");
        goto fail;
    }
    if ((st = get_str(root, "node_id", n.node_id, sizeof n.node_id, 1)) ||
        (st = get_str(root, "role", role, sizeof role, 1)) || (st = get_str(root, "model", n.model, sizeof n.model, 0)) ||
        (st = get_str(root, "grpc_addr", n.grpc_addr, sizeof n.grpc_addr, 0)) ||
        (st = get_str(root, "http_addr", n.http_addr, sizeof n.http_addr, 0)) ||
        (st = get_str(root, "version", n.version, sizeof n.version, 0)) ||
        (st = get_i64(root, "started_ms", &n.started_ms)) || (st = get_i64(cap, "kv_blocks", &n.kv_blocks_total)) ||
        (st = get_i64(cap, "kv_block_tokens", &n.kv_block_tokens)) || (st = get_i64(cap, "max_running", &n.max_running)) ||
        (st = get_i64(cap, "max_context", &n.max_context)))
        goto fail;
    if (!valid_name(n.node_id)) {
        st = bt_fail(BT_ERR_FORMAT, "membership: bad node_id");
        goto fail;
    }
    if (!strcmp(role, "prefill")) n.role = MBR_ROLE_PREFILL;
    else if (!strcmp(role, "decode")) n.role = MBR_ROLE_DECODE;
    else {
        st = bt_fail(BT_ERR_FORMAT, "membership: unknown role \"%s\"", role);
        goto fail;
    }
    const cJSON *ucx = cJSON_GetObjectItemCaseSensitive(root, "ucx");
    if (ucx && !cJSON_IsNull(ucx)) {
        if (!cJSON_IsString(ucx)) {
            st = bt_fail(BT_ERR_FORMAT, "membership: ucx is not a string");
            goto fail;
        }
        if ((st = base64_decode(ucx->valuestring, strlen(ucx->valuestring), &n.ucx_desc, &n.ucx_desc_len))) goto fail;
        if (!n.ucx_desc_len) {
            free(n.ucx_desc);
            n.ucx_desc = NULL;
        }
    }
    cJSON_Delete(root);
    *out = n;
    return BT_OK;
fail:
    cJSON_Delete(root);
    return st;
}

bt_status mbr_load_to_json(const mbr_load_report_t *l, char **out)
{
    cJSON *root = cJSON_CreateObject();
    int ok = root && add_num(root, "queued_requests", (double)l->queued_requests) &&
             add_num(root, "queued_prefill_tokens", (double)l->queued_prefill_tokens) &&
             add_num(root, "running_seqs", (double)l->running_seqs) &&
             add_num(root, "kv_blocks_free", (double)l->kv_blocks_free) &&
             add_num(root, "kv_blocks_total", (double)l->kv_blocks_total) &&
             add_num(root, "prefill_tok_s", l->prefill_tok_s) && add_num(root, "decode_tok_s", l->decode_tok_s) &&
             add_num(root, "kv_transfer_bytes_s", l->kv_transfer_bytes_s) && add_num(root, "step_s", l->step_s) &&
             add_num(root, "tokens_per_step", l->tokens_per_step) && add_num(root, "step_fixed_s", l->step_fixed_s) &&
             add_num(root, "step_token_s", l->step_token_s) && add_num(root, "decode_fixed_s", l->decode_fixed_s) &&
             add_num(root, "decode_row_s", l->decode_row_s) && add_num(root, "timestamp_ms", (double)l->timestamp_ms);
    return print_json(root, ok, out);
}

bt_status mbr_load_from_json(const char *json, size_t len, mbr_load_report_t *out)
{
    cJSON *root;
    bt_status st = open_json(json, len, &root);
    if (st) return st;
    mbr_load_report_t l = {0};
    if (!(st = get_i64(root, "queued_requests", &l.queued_requests)) &&
        !(st = get_i64(root, "queued_prefill_tokens", &l.queued_prefill_tokens)) &&
        !(st = get_i64(root, "running_seqs", &l.running_seqs)) && !(st = get_i64(root, "kv_blocks_free", &l.kv_blocks_free)) &&
        !(st = get_i64(root, "kv_blocks_total", &l.kv_blocks_total)) &&
        !(st = get_double(root, "prefill_tok_s", &l.prefill_tok_s)) &&
        !(st = get_double(root, "decode_tok_s", &l.decode_tok_s)) &&
        !(st = get_double(root, "kv_transfer_bytes_s", &l.kv_transfer_bytes_s)) &&
        !(st = get_double(root, "step_s", &l.step_s)) &&
        !(st = get_double(root, "tokens_per_step", &l.tokens_per_step)) &&
        !(st = get_double(root, "step_fixed_s", &l.step_fixed_s)) && !(st = get_double(root, "step_token_s", &l.step_token_s)) &&
        !(st = get_double(root, "decode_fixed_s", &l.decode_fixed_s)) && !(st = get_double(root, "decode_row_s", &l.decode_row_s)) && !(st = get_i64(root, "timestamp_ms", &l.timestamp_ms)))
        *out = l;
    cJSON_Delete(root);
    return st;
}

static int count_moved(int64_t a, int64_t b, int64_t min_abs)
{
    if ((a == 0) != (b == 0)) return 1;
    int64_t d = a > b ? a - b : b - a;
    int64_t m = a > b ? a : b;
    return d >= min_abs && d * 4 >= m;
}

int mbr_load_large_change(const mbr_load_report_t *a, const mbr_load_report_t *b)
{
    if (count_moved(a->queued_requests, b->queued_requests, 2) || count_moved(a->running_seqs, b->running_seqs, 2) ||
        count_moved(a->queued_prefill_tokens, b->queued_prefill_tokens, 256))
        return 1;
    int64_t total = b->kv_blocks_total > a->kv_blocks_total ? b->kv_blocks_total : a->kv_blocks_total;
    int64_t d = a->kv_blocks_free > b->kv_blocks_free ? a->kv_blocks_free - b->kv_blocks_free : b->kv_blocks_free - a->kv_blocks_free;
    return a->kv_blocks_total != b->kv_blocks_total || (total > 0 && d * 10 >= total);
}

static int load_same(const mbr_load_report_t *a, const mbr_load_report_t *b)
{
    return a->queued_requests == b->queued_requests && a->queued_prefill_tokens == b->queued_prefill_tokens &&
           a->running_seqs == b->running_seqs && a->kv_blocks_free == b->kv_blocks_free &&
           a->kv_blocks_total == b->kv_blocks_total && a->prefill_tok_s == b->prefill_tok_s &&
           a->decode_tok_s == b->decode_tok_s && a->kv_transfer_bytes_s == b->kv_transfer_bytes_s &&
           a->step_s == b->step_s && a->tokens_per_step == b->tokens_per_step && a->step_fixed_s == b->step_fixed_s &&
           a->step_token_s == b->step_token_s && a->decode_fixed_s == b->decode_fixed_s &&
           a->decode_row_s == b->decode_row_s;
}

/* ---- registration ---- */

struct mbr_registration {
    etcd_client_t *c;
    char node_key[MBR_KEY_MAX];
    char load_key[MBR_KEY_MAX];
    int ttl_s, load_min_ms, load_refresh_ms, backoff_max_ms, load_heartbeat_ms;
    void (*on_state)(void *arg, mbr_reg_state state, int64_t lease);
    void *arg;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* guarded by mu */
    int stop;
    mbr_node_info_t info;
    int info_dirty;
    mbr_load_report_t load;     /* latest handed over */
    int has_load, load_large;
    mbr_reg_state state;
    int64_t lease;
    /* registration thread only */
    mbr_load_report_t written;  /* last load written */
    int has_written;
    int64_t last_load_write;    /* monotonic ms */
    uint64_t rng;
};

static void reg_set_state(mbr_registration_t *r, mbr_reg_state st, int64_t lease)
{
    pthread_mutex_lock(&r->mu);
    int changed = r->state != st || r->lease != lease;
    r->state = st;
    r->lease = lease;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (changed && r->on_state) r->on_state(r->arg, st, lease);
}

/* Writes the NodeInfo under lease. */
static bt_status reg_put_info(mbr_registration_t *r, int64_t lease)
{
    pthread_mutex_lock(&r->mu);
    char *json = NULL;
    bt_status st = mbr_node_info_to_json(&r->info, &json);
    r->info_dirty = 0;
    pthread_mutex_unlock(&r->mu);
    if (st) return st;
    st = etcd_put(r->c, r->node_key, json, strlen(json), lease, NULL);
    free(json);
    if (st) {
        pthread_mutex_lock(&r->mu);
        r->info_dirty = 1;
        pthread_mutex_unlock(&r->mu);
    }
    return st;
}

/* 1 when the latest load differs from what etcd holds, or the heartbeat is due; under r->mu. */
static int reg_load_pending(const mbr_registration_t *r, int64_t now)
{
    if (!r->has_load) return 0;
    if (!r->has_written || !load_same(&r->load, &r->written)) return 1;
    return now - r->last_load_write >= r->load_heartbeat_ms;
}

/* Writes the latest load report when it changed or the heartbeat is due. */
static bt_status reg_put_load(mbr_registration_t *r, int64_t lease, int64_t now)
{
    pthread_mutex_lock(&r->mu);
    if (!reg_load_pending(r, now)) {
        pthread_mutex_unlock(&r->mu);
        return BT_OK;
    }
    mbr_load_report_t l = r->load;
    r->load_large = 0;
    pthread_mutex_unlock(&r->mu);
    if (!l.timestamp_ms) l.timestamp_ms = wall_ms();
    char *json;
    bt_status st = mbr_load_to_json(&l, &json);
    if (st) return st;
    BT_DEBUG("membership", "load write %s", r->load_key);
    r->last_load_write = now; /* counts even when the put fails: the rate limit is on attempts */
    st = etcd_put(r->c, r->load_key, json, strlen(json), lease, NULL);
    free(json);
    if (!st) {
        pthread_mutex_lock(&r->mu);
        r->written = l;
        r->has_written = 1;
        pthread_mutex_unlock(&r->mu);
    }
    return st;
}

/* Next load write time (a change, else the heartbeat), or INT64_MAX before the first report. */
static int64_t reg_load_due(mbr_registration_t *r)
{
    pthread_mutex_lock(&r->mu);
    int64_t due = INT64_MAX;
    if (r->has_load && r->has_written && load_same(&r->load, &r->written)) {
        due = r->last_load_write + r->load_heartbeat_ms;
    } else if (r->has_load) {
        int large = r->load_large || !r->has_written;
        due = r->last_load_write + (large ? r->load_min_ms : r->load_refresh_ms);
        int64_t min = r->last_load_write + r->load_min_ms;
        if (due < min) due = min;
    }
    pthread_mutex_unlock(&r->mu);
    return due;
}

/* 250 ms doubling up to backoff_max_ms (1 s by default): short, because a node that misses etcd's return misses
 * routing for as long (leases expire together after an outage); up to 50 % jitter so nodes do not herd. */
static int reg_next_backoff(mbr_registration_t *r, int backoff)
{
    int next = backoff ? backoff * 2 : 250;
    if (next > r->backoff_max_ms) next = r->backoff_max_ms;
    r->rng ^= r->rng << 13;
    r->rng ^= r->rng >> 7;
    r->rng ^= r->rng << 17;
    return next - (int)(r->rng % (uint64_t)(next / 2 + 1));
}

static void *reg_main(void *arg)
{
    mbr_registration_t *r = arg;
    int64_t lease = 0;
    int backoff = 0;
    int64_t next_keepalive = 0, retry_at = 0;
    int ka_ms = r->ttl_s * 1000 / 3;
    int was_down = 0;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        pthread_mutex_unlock(&r->mu);
        int64_t now = mono_ms();
        bt_status st = BT_OK;
        if (now < retry_at) {
            pthread_mutex_lock(&r->mu);
            if (!r->stop) cond_wait_until(&r->cv, &r->mu, retry_at);
            continue;
        }
        if (!lease) {
            int64_t id = 0;
            if (!(st = etcd_lease_grant(r->c, r->ttl_s, &id, NULL)) && !(st = reg_put_info(r, id))) {
                lease = id;
                next_keepalive = mono_ms() + ka_ms;
                backoff = 0;
                was_down = 0;
                BT_INFO("membership", "registered %s with lease %llx", r->node_key, (unsigned long long)id);
                reg_set_state(r, MBR_REG_REGISTERED, lease);
                pthread_mutex_lock(&r->mu);
                r->has_written = 0; /* the old record went with the old lease */
                pthread_mutex_unlock(&r->mu);
                if (mono_ms() >= r->last_load_write + r->load_min_ms) reg_put_load(r, lease, mono_ms());
            } else if (id) {
                etcd_lease_revoke(r->c, id); /* best effort; it expires anyway */
            }
        } else if (was_down || now >= next_keepalive) { /* after a failure the keepalive is the probe */
            st = etcd_lease_keepalive(r->c, lease, NULL);
            if (st == BT_ERR_NOT_FOUND) {
                BT_WARN("membership", "lease %llx of %s lost; registering again", (unsigned long long)lease, r->node_key);
                lease = 0;
                backoff = 0;
                retry_at = 0;
                reg_set_state(r, MBR_REG_PENDING, 0);
                pthread_mutex_lock(&r->mu);
                continue;
            }
            if (!st) {
                next_keepalive = mono_ms() + ka_ms;
                backoff = 0;
                if (was_down) { /* etcd may have lost or restored records while away: write them again */
                    st = reg_put_info(r, lease);
                    if (!st) {
                        pthread_mutex_lock(&r->mu);
                        r->has_written = 0;
                        pthread_mutex_unlock(&r->mu);
                    }
                }
                if (!st) {
                    was_down = 0;
                    reg_set_state(r, MBR_REG_REGISTERED, lease);
                }
            }
        }
        if (!st && lease && !was_down) {
            pthread_mutex_lock(&r->mu);
            int dirty = r->info_dirty;
            pthread_mutex_unlock(&r->mu);
            if (dirty) st = reg_put_info(r, lease);
            if (!st && mono_ms() >= reg_load_due(r)) st = reg_put_load(r, lease, mono_ms());
            if (st == BT_ERR_NOT_FOUND) { /* lease vanished under a put */
                lease = 0;
                reg_set_state(r, MBR_REG_PENDING, 0);
                pthread_mutex_lock(&r->mu);
                continue;
            }
        }
        if (st) {
            backoff = reg_next_backoff(r, backoff);
            retry_at = mono_ms() + backoff;
            if (lease) next_keepalive = retry_at;
            if (!was_down) BT_WARN("membership", "%s: etcd: %s; retrying with backoff", r->node_key, bt_last_error());
            else BT_DEBUG("membership", "%s: etcd: %s; next try in %d ms", r->node_key, bt_last_error(), backoff);
            was_down = 1;
            reg_set_state(r, lease ? MBR_REG_ETCD_DOWN : MBR_REG_PENDING, lease);
        }
        int64_t wake = retry_at > mono_ms() ? retry_at : (lease ? next_keepalive : mono_ms());
        if (lease && !st) {
            int64_t due = reg_load_due(r);
            if (due < wake) wake = due;
        }
        pthread_mutex_lock(&r->mu);
        if (!r->stop && !(lease && r->info_dirty) && wake > mono_ms()) cond_wait_until(&r->cv, &r->mu, wake);
    }
    pthread_mutex_unlock(&r->mu);
    return (void *)(intptr_t)lease;
}

bt_status mbr_registration_create(etcd_client_t *c, const mbr_config_t *cfg, const mbr_node_info_t *info,
                                  mbr_registration_t **out)
{
    mbr_config_t dflt = {0};
    if (!cfg) cfg = &dflt;
    if (!c || !info) return bt_fail(BT_ERR_INVALID, "membership: NULL argument");
    if (cfg->ttl_s < 0 || cfg->load_min_interval_ms < 0 || cfg->load_refresh_ms < 0 || cfg->backoff_max_ms < 0 ||
        cfg->load_heartbeat_ms < 0)
        return bt_fail(BT_ERR_INVALID, "membership: negative interval");
    mbr_registration_t *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "membership: out of memory");
    const char *cluster = cfg->cluster ? cfg->cluster : MBR_DEFAULT_CLUSTER;
    bt_status st;
    if ((st = mbr_key(r->node_key, sizeof r->node_key, cluster, "nodes", info->node_id)) ||
        (st = mbr_key(r->load_key, sizeof r->load_key, cluster, "load", info->node_id)))
        goto fail;
    r->c = c;
    r->ttl_s = cfg->ttl_s ? cfg->ttl_s : MBR_DEFAULT_TTL_S;
    r->load_min_ms = cfg->load_min_interval_ms ? cfg->load_min_interval_ms : MBR_LOAD_MIN_INTERVAL_MS;
    r->load_refresh_ms = cfg->load_refresh_ms ? cfg->load_refresh_ms : MBR_LOAD_REFRESH_MS;
    r->backoff_max_ms = cfg->backoff_max_ms ? cfg->backoff_max_ms : MBR_BACKOFF_MAX_MS;
    r->load_heartbeat_ms = cfg->load_heartbeat_ms ? cfg->load_heartbeat_ms : MBR_LOAD_HEARTBEAT_MS;
    r->on_state = cfg->on_state;
    r->arg = cfg->arg;
    r->last_load_write = mono_ms() - r->load_refresh_ms;
    r->rng = (uint64_t)wall_ms() * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)r;
    if (!r->rng) r->rng = 1;
    if ((st = mbr_node_info_copy(info, &r->info))) goto fail;
    if (pthread_mutex_init(&r->mu, NULL)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: mutex init failed");
        goto fail_info;
    }
    if (cond_init_mono(&r->cv)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: condvar init failed");
        goto fail_mu;
    }
    if (pthread_create(&r->thread, NULL, reg_main, r)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: cannot start the registration thread");
        goto fail_cv;
    }
    *out = r;
    return BT_OK;
fail_cv:
    pthread_cond_destroy(&r->cv);
fail_mu:
    pthread_mutex_destroy(&r->mu);
fail_info:
    mbr_node_info_free(&r->info);
fail:
    free(r);
    return st;
}

void mbr_registration_destroy(mbr_registration_t *r, int deregister)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    void *ret = NULL;
    pthread_join(r->thread, &ret);
    int64_t lease = (int64_t)(intptr_t)ret;
    if (deregister && lease && etcd_lease_revoke(r->c, lease))
        BT_WARN("membership", "%s: revoke failed (%s); the lease will expire", r->node_key, bt_last_error());
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    mbr_node_info_free(&r->info);
    free(r);
}

bt_status mbr_registration_update_info(mbr_registration_t *r, const mbr_node_info_t *info)
{
    mbr_node_info_t copy;
    if (strcmp(info->node_id, r->info.node_id)) return bt_fail(BT_ERR_INVALID, "membership: node id cannot change");
    bt_status st = mbr_node_info_copy(info, &copy);
    if (st) return st;
    pthread_mutex_lock(&r->mu);
    mbr_node_info_free(&r->info);
    r->info = copy;
    r->info_dirty = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return BT_OK;
}

void mbr_registration_publish_load(mbr_registration_t *r, const mbr_load_report_t *load)
{
    pthread_mutex_lock(&r->mu);
    /* large relative to what is in etcd, so a slow drift still triggers once it adds up */
    int large = !r->has_load || mbr_load_large_change(r->has_written ? &r->written : &r->load, load);
    r->load = *load;
    r->has_load = 1;
    if (large) {
        r->load_large = 1;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

mbr_reg_state mbr_registration_state(mbr_registration_t *r, int64_t *lease)
{
    pthread_mutex_lock(&r->mu);
    mbr_reg_state st = r->state;
    if (lease) *lease = r->lease;
    pthread_mutex_unlock(&r->mu);
    return st;
}

bt_status mbr_registration_wait(mbr_registration_t *r, int timeout_ms)
{
    int64_t deadline = mono_ms() + timeout_ms;
    pthread_mutex_lock(&r->mu);
    while (r->state != MBR_REG_REGISTERED && mono_ms() < deadline) cond_wait_until(&r->cv, &r->mu, deadline);
    int ok = r->state == MBR_REG_REGISTERED;
    pthread_mutex_unlock(&r->mu);
    return ok ? BT_OK : bt_fail(BT_ERR_TIMEOUT, "membership: not registered within %d ms", timeout_ms);
}

/* ---- watcher ---- */

typedef struct mbr_entry {
    char node_id[MBR_NODE_ID_MAX];
    int has_info;
    int64_t hold_until;      /* monotonic ms; while node.held */
    mbr_node_t node; /* info valid when has_info, load when node.has_load */
} mbr_entry;

typedef enum { CB_JOIN, CB_UPDATE, CB_LEAVE } mbr_cb_kind;

typedef struct mbr_pending_cb {
    mbr_cb_kind kind;
    mbr_node_t node;
} mbr_pending_cb;

typedef struct mbr_cb_list {
    mbr_pending_cb *v;
    size_t n, cap;
} mbr_cb_list;

struct mbr_watcher {
    etcd_client_t *c;
    char prefix[MBR_KEY_MAX]; /* "/baton/<cluster>/" */
    mbr_watch_ops_t ops;
    etcd_watch_t *watch;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* guarded by mu */
    mbr_entry *entries; /* sorted by node_id */
    size_t n_entries, cap_entries;
    int synced, connected, ever_connected;
    int64_t connected_since;    /* monotonic ms the watch stream came up; 0 while down */
    /* rejoin grace (guarded by mu): see mbr_watcher_set_rejoin_grace */
    int grace_ms;
    int64_t last_ok;            /* the last probe etcd answered */
    int64_t probe_up_since;     /* since when every probe was answered; 0 after a failure */
    int64_t recovered;          /* etcd answered again after a failed probe or a lost watch */
    int probe_failed, stop_probe, probe_started;
    pthread_t probe;
    pthread_mutex_t cb_mu;      /* callbacks run one at a time, from the watch thread or the probe thread */
};

static void cb_push(mbr_cb_list *l, mbr_cb_kind kind, const mbr_node_t *node)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        mbr_pending_cb *v = realloc(l->v, cap * sizeof *v);
        if (!v) return; /* a lost notification; the view itself stays right */
        l->v = v;
        l->cap = cap;
    }
    mbr_node_t copy = *node;
    if (mbr_node_info_copy(&node->info, &copy.info)) return;
    l->v[l->n].kind = kind;
    l->v[l->n].node = copy;
    l->n++;
}

static void cb_run(mbr_watcher_t *w, mbr_cb_list *l)
{
    pthread_mutex_lock(&w->cb_mu);
    for (size_t i = 0; i < l->n; i++) {
        const mbr_node_t *n = &l->v[i].node;
        switch (l->v[i].kind) {
        case CB_JOIN:
            BT_INFO("membership", "node %s (%s) joined", n->info.node_id, mbr_role_name(n->info.role));
            if (w->ops.on_join) w->ops.on_join(w->ops.arg, n);
            break;
        case CB_UPDATE:
            if (w->ops.on_update) w->ops.on_update(w->ops.arg, n);
            break;
        case CB_LEAVE:
            BT_INFO("membership", "node %s left", n->info.node_id);
            if (w->ops.on_leave) w->ops.on_leave(w->ops.arg, n);
            break;
        }
        mbr_node_info_free(&l->v[i].node.info);
    }
    pthread_mutex_unlock(&w->cb_mu);
    free(l->v);
    memset(l, 0, sizeof *l);
}

/* Whether a vanished lease now is more likely etcd's outage than the node's death; under w->mu. Every lease of a
 * cluster expires together when etcd comes back after more than a TTL, just as the nodes are re-registering. */
static int recovering(const mbr_watcher_t *w, int64_t now)
{
    if (w->grace_ms <= 0) return 0;
    if (w->recovered && now - w->recovered < w->grace_ms) return 1;
    return w->last_ok && now - w->last_ok > 3 * MBR_PROBE_MS; /* etcd just answered the watch, not yet a probe */
}

/* Keeps a node whose NodeInfo was deleted while etcd recovers; under w->mu. */
static void hold_entry(mbr_watcher_t *w, mbr_entry *e, int64_t now)
{
    if (!e->node.held)
        BT_INFO("membership", "node %s: lease gone while etcd recovers; kept in the view for up to %d ms",
                e->node_id, w->grace_ms);
    e->node.held = 1;
    e->hold_until = now + w->grace_ms;
}

static mbr_entry *entry_find(mbr_entry *v, size_t n, const char *id, size_t *pos)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(v[mid].node_id, id);
        if (!c) {
            if (pos) *pos = mid;
            return &v[mid];
        }
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    if (pos) *pos = lo;
    return NULL;
}

static mbr_entry *entry_get(mbr_watcher_t *w, const char *id)
{
    size_t pos;
    mbr_entry *e = entry_find(w->entries, w->n_entries, id, &pos);
    if (e) return e;
    if (w->n_entries == w->cap_entries) {
        size_t cap = w->cap_entries ? w->cap_entries * 2 : 16;
        mbr_entry *v = realloc(w->entries, cap * sizeof *v);
        if (!v) return NULL;
        w->entries = v;
        w->cap_entries = cap;
    }
    memmove(&w->entries[pos + 1], &w->entries[pos], (w->n_entries - pos) * sizeof *w->entries);
    w->n_entries++;
    e = &w->entries[pos];
    memset(e, 0, sizeof *e);
    snprintf(e->node_id, sizeof e->node_id, "%s", id);
    return e;
}

static void entry_drop_if_empty(mbr_watcher_t *w, mbr_entry *e)
{
    if (e->has_info || e->node.has_load) return;
    size_t pos = (size_t)(e - w->entries);
    memmove(&w->entries[pos], &w->entries[pos + 1], (w->n_entries - pos - 1) * sizeof *w->entries);
    w->n_entries--;
}

/* Splits "<prefix><kind>/<id>"; 0 when the key is not a membership record. */
static int parse_key(const mbr_watcher_t *w, const char *key, int *is_load, char *id)
{
    size_t pl = strlen(w->prefix);
    if (strncmp(key, w->prefix, pl)) return 0;
    key += pl;
    if (!strncmp(key, "nodes/", 6)) {
        *is_load = 0;
        key += 6;
    } else if (!strncmp(key, "load/", 5)) {
        *is_load = 1;
        key += 5;
    } else {
        return 0;
    }
    if (!valid_name(key) || strlen(key) >= MBR_NODE_ID_MAX) return 0;
    strcpy(id, key);
    return 1;
}

/* Applies one record (value NULL = deleted) to the view; queues callbacks. Called with mu held. */
static void apply_record(mbr_watcher_t *w, const char *key, const char *value, size_t value_len, int64_t lease,
                         int64_t rev, mbr_cb_list *cbs)
{
    int is_load;
    char id[MBR_NODE_ID_MAX];
    if (!parse_key(w, key, &is_load, id)) return;
    mbr_entry *e = value ? entry_get(w, id) : entry_find(w->entries, w->n_entries, id, NULL);
    if (!e) return;
    int64_t now = mono_ms();
    if (!is_load) {
        if (!value) {
            if (e->has_info && recovering(w, now)) {
                hold_entry(w, e, now);
            } else if (e->has_info) {
                cb_push(cbs, CB_LEAVE, &e->node);
                mbr_node_info_free(&e->node.info);
                e->has_info = 0;
            }
        } else {
            mbr_node_info_t info;
            if (mbr_node_info_from_json(value, value_len, &info)) {
                BT_WARN("membership", "ignoring bad record %s: %s", key, bt_last_error());
                if (!e->has_info) entry_drop_if_empty(w, e);
                return;
            }
            snprintf(info.node_id, sizeof info.node_id, "%s", id); /* the key is authoritative */
            int joined = !e->has_info;
            if (e->has_info) mbr_node_info_free(&e->node.info);
            if (e->node.held) BT_INFO("membership", "node %s registered again while held", id);
            e->node.info = info;
            e->node.lease = lease;
            e->has_info = 1;
            e->node.held = 0;
            e->node.mod_revision = rev;
            e->node.seen_ms = now;
            cb_push(cbs, joined ? CB_JOIN : CB_UPDATE, &e->node);
        }
    } else {
        if (!value && e->has_info && (e->node.held || recovering(w, now))) return; /* the last report stands */
        if (!value) {
            e->node.has_load = 0;
            memset(&e->node.load, 0, sizeof e->node.load);
        } else {
            mbr_load_report_t l;
            if (mbr_load_from_json(value, value_len, &l)) {
                BT_WARN("membership", "ignoring bad record %s: %s", key, bt_last_error());
                entry_drop_if_empty(w, e);
                return;
            }
            e->node.load = l;
            e->node.has_load = 1;
            e->node.seen_ms = now;
        }
        if (rev > e->node.mod_revision) e->node.mod_revision = rev;
        if (e->has_info) cb_push(cbs, CB_UPDATE, &e->node);
    }
    entry_drop_if_empty(w, e);
}

static void watcher_events(void *arg, const etcd_event_t *ev, size_t n)
{
    mbr_watcher_t *w = arg;
    mbr_cb_list cbs = {0};
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < n; i++) {
        const etcd_kv_t *kv = &ev[i].kv;
        if (ev[i].type == ETCD_EVENT_PUT) apply_record(w, kv->key, kv->value, kv->value_len, kv->lease, kv->mod_revision, &cbs);
        else apply_record(w, kv->key, NULL, 0, 0, kv->mod_revision, &cbs);
    }
    pthread_mutex_unlock(&w->mu);
    cb_run(w, &cbs);
}

static void free_entries(mbr_entry *v, size_t n)
{
    for (size_t i = 0; i < n; i++) mbr_node_info_free(&v[i].node.info);
    free(v);
}

/* Moves a node missing from a reloaded view back into it, held; under w->mu. 0 when it cannot (no memory). */
static int resync_keep(mbr_watcher_t *w, mbr_entry *old, int64_t now)
{
    mbr_entry *e = entry_get(w, old->node_id);
    if (!e) return 0;
    mbr_load_report_t load = e->node.load;
    int has_load = e->node.has_load;
    e->node = old->node; /* the info's buffer moves */
    e->has_info = 1;
    old->has_info = 0;
    old->node.info.ucx_desc = NULL;
    if (has_load) {
        e->node.load = load;
        e->node.has_load = 1;
    }
    hold_entry(w, e, now);
    return 1;
}

/* Reads the whole prefix and replaces the view, reporting the differences (first load and after compaction). */
static bt_status watcher_resync(void *arg, int64_t *start_revision)
{
    mbr_watcher_t *w = arg;
    etcd_range_opts_t opts = {.prefix = 1};
    etcd_range_result_t r;
    bt_status st = etcd_range(w->c, w->prefix, &opts, &r);
    if (st) return st;
    mbr_cb_list cbs = {0};
    pthread_mutex_lock(&w->mu);
    mbr_entry *old = w->entries;
    size_t n_old = w->n_entries;
    w->entries = NULL;
    w->n_entries = w->cap_entries = 0;
    mbr_cb_list ignore = {0};
    for (size_t i = 0; i < r.n_kvs; i++)
        apply_record(w, r.kvs[i].key, r.kvs[i].value, r.kvs[i].value_len, r.kvs[i].lease, r.kvs[i].mod_revision, &ignore);
    for (size_t i = 0; i < ignore.n; i++) mbr_node_info_free(&ignore.v[i].node.info);
    free(ignore.v);
    for (size_t i = 0; i < w->n_entries; i++) {
        mbr_entry *e = &w->entries[i];
        if (!e->has_info) continue;
        mbr_entry *o = entry_find(old, n_old, e->node_id, NULL);
        if (!o || !o->has_info) cb_push(&cbs, CB_JOIN, &e->node);
        else if (o->node.mod_revision != e->node.mod_revision) cb_push(&cbs, CB_UPDATE, &e->node);
    }
    int64_t now = mono_ms();
    for (size_t i = 0; i < n_old; i++) {
        mbr_entry *e = entry_find(w->entries, w->n_entries, old[i].node_id, NULL);
        if (!old[i].has_info || (e && e->has_info)) continue;
        if (recovering(w, now) && resync_keep(w, &old[i], now)) continue;
        cb_push(&cbs, CB_LEAVE, &old[i].node);
    }
    free_entries(old, n_old);
    w->synced = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    *start_revision = r.revision + 1;
    etcd_range_result_free(&r);
    cb_run(w, &cbs);
    return BT_OK;
}

static void watcher_state(void *arg, int connected)
{
    mbr_watcher_t *w = arg;
    pthread_mutex_lock(&w->mu);
    w->connected = connected;
    w->connected_since = connected ? mono_ms() : 0;
    if (connected && w->ever_connected) w->recovered = w->connected_since;
    if (connected) w->ever_connected = 1;
    pthread_mutex_unlock(&w->mu);
    if (!connected) BT_WARN("membership", "lost the etcd watch on %s; keeping the last view", w->prefix);
    if (w->ops.on_connection) w->ops.on_connection(w->ops.arg, connected);
}

bt_status mbr_watcher_create(etcd_client_t *c, const char *cluster, const mbr_watch_ops_t *ops, mbr_watcher_t **out)
{
    if (!c) return bt_fail(BT_ERR_INVALID, "membership: NULL client");
    if (!cluster) cluster = MBR_DEFAULT_CLUSTER;
    if (!valid_name(cluster)) return bt_fail(BT_ERR_INVALID, "membership: bad cluster name \"%s\"", cluster);
    mbr_watcher_t *w = calloc(1, sizeof *w);
    if (!w) return bt_fail(BT_ERR_NOMEM, "membership: out of memory");
    bt_status st;
    w->c = c;
    if (ops) w->ops = *ops;
    if ((size_t)snprintf(w->prefix, sizeof w->prefix, "/baton/%s/", cluster) >= sizeof w->prefix) {
        st = bt_fail(BT_ERR_INVALID, "membership: cluster name too long");
        goto fail;
    }
    if (pthread_mutex_init(&w->mu, NULL)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: mutex init failed");
        goto fail;
    }
    if (pthread_mutex_init(&w->cb_mu, NULL)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: mutex init failed");
        pthread_mutex_destroy(&w->mu);
        goto fail;
    }
    if (cond_init_mono(&w->cv)) {
        st = bt_fail(BT_ERR_INTERNAL, "membership: condvar init failed");
        goto fail_mu;
    }
    etcd_watch_ops_t wops = {.on_events = watcher_events, .resync = watcher_resync, .on_state = watcher_state, .arg = w};
    if ((st = etcd_watch_start(c, w->prefix, 1, 0, &wops, &w->watch))) goto fail_cv;
    *out = w;
    return BT_OK;
fail_cv:
    pthread_cond_destroy(&w->cv);
fail_mu:
    pthread_mutex_destroy(&w->cb_mu);
    pthread_mutex_destroy(&w->mu);
fail:
    free(w);
    return st;
}

/* Drops held nodes whose grace ran out; under w->mu. */
static void expire_holds(mbr_watcher_t *w, int64_t now, mbr_cb_list *cbs)
{
    for (size_t i = w->n_entries; i-- > 0;) {
        mbr_entry *e = &w->entries[i];
        if (!e->has_info || !e->node.held || now < e->hold_until) continue;
        cb_push(cbs, CB_LEAVE, &e->node);
        mbr_node_info_free(&e->node.info);
        e->has_info = 0;
        e->node.has_load = 0;
        entry_drop_if_empty(w, e);
    }
}

/* One probe's answer; under w->mu. */
static void probe_note(mbr_watcher_t *w, int ok, int64_t now)
{
    if (!ok) {
        if (!w->probe_failed) BT_WARN("membership", "etcd does not answer %s; keeping the last view", w->prefix);
        w->probe_failed = 1;
        w->probe_up_since = 0;
        return;
    }
    if (w->probe_failed) {
        BT_INFO("membership", "etcd answers again; nodes whose lease vanished stay for up to %d ms", w->grace_ms);
        w->recovered = now;
    }
    w->probe_failed = 0;
    if (!w->probe_up_since) w->probe_up_since = now;
    w->last_ok = now;
}

static void *probe_main(void *arg)
{
    mbr_watcher_t *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stop_probe) {
        pthread_mutex_unlock(&w->mu);
        int64_t t0 = mono_ms();
        etcd_range_opts_t o = {.prefix = 1, .count_only = 1};
        etcd_range_result_t r;
        bt_status st = etcd_range(w->c, w->prefix, &o, &r);
        if (!st) etcd_range_result_free(&r);
        mbr_cb_list cbs = {0};
        pthread_mutex_lock(&w->mu);
        int64_t now = mono_ms();
        probe_note(w, st == BT_OK, now);
        expire_holds(w, now, &cbs);
        pthread_mutex_unlock(&w->mu);
        cb_run(w, &cbs);
        pthread_mutex_lock(&w->mu);
        while (!w->stop_probe && mono_ms() < t0 + MBR_PROBE_MS) cond_wait_until(&w->cv, &w->mu, t0 + MBR_PROBE_MS);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

bt_status mbr_watcher_set_rejoin_grace(mbr_watcher_t *w, int grace_ms)
{
    if (grace_ms <= 0 || w->probe_started) return bt_fail(BT_ERR_INVALID, "membership: bad rejoin grace");
    pthread_mutex_lock(&w->mu);
    w->grace_ms = grace_ms;
    pthread_mutex_unlock(&w->mu);
    if (pthread_create(&w->probe, NULL, probe_main, w)) {
        pthread_mutex_lock(&w->mu);
        w->grace_ms = 0;
        pthread_mutex_unlock(&w->mu);
        return bt_fail(BT_ERR_INTERNAL, "membership: cannot start the etcd probe thread");
    }
    w->probe_started = 1;
    return BT_OK;
}

int64_t mbr_watcher_confirmed_ms(mbr_watcher_t *w)
{
    pthread_mutex_lock(&w->mu);
    int64_t since = w->connected ? w->connected_since : 0;
    if (since && w->grace_ms > 0) /* and every probe since then answered */
        since = !w->probe_up_since ? 0 : w->probe_up_since > since ? w->probe_up_since : since;
    pthread_mutex_unlock(&w->mu);
    return since ? mono_ms() - since : 0;
}

void mbr_watcher_destroy(mbr_watcher_t *w)
{
    if (!w) return;
    if (w->probe_started) {
        pthread_mutex_lock(&w->mu);
        w->stop_probe = 1;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->probe, NULL);
    }
    etcd_watch_stop(w->watch);
    free_entries(w->entries, w->n_entries);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->cb_mu);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

bt_status mbr_watcher_wait_synced(mbr_watcher_t *w, int timeout_ms)
{
    int64_t deadline = mono_ms() + timeout_ms;
    pthread_mutex_lock(&w->mu);
    while (!w->synced && mono_ms() < deadline) cond_wait_until(&w->cv, &w->mu, deadline);
    int ok = w->synced;
    pthread_mutex_unlock(&w->mu);
    return ok ? BT_OK : bt_fail(BT_ERR_TIMEOUT, "membership: no initial view within %d ms", timeout_ms);
}

void mbr_nodes_free(mbr_node_t *nodes, size_t n)
{
    for (size_t i = 0; i < n; i++) mbr_node_info_free(&nodes[i].info);
    free(nodes);
}

bt_status mbr_watcher_snapshot(mbr_watcher_t *w, mbr_node_t **nodes, size_t *n)
{
    pthread_mutex_lock(&w->mu);
    size_t count = 0;
    for (size_t i = 0; i < w->n_entries; i++) count += w->entries[i].has_info;
    mbr_node_t *v = count ? calloc(count, sizeof *v) : NULL;
    if (count && !v) {
        pthread_mutex_unlock(&w->mu);
        return bt_fail(BT_ERR_NOMEM, "membership: out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < w->n_entries; i++) {
        if (!w->entries[i].has_info) continue;
        v[k] = w->entries[i].node;
        if (mbr_node_info_copy(&w->entries[i].node.info, &v[k].info)) {
            pthread_mutex_unlock(&w->mu);
            mbr_nodes_free(v, k);
            return BT_ERR_NOMEM;
        }
        k++;
    }
    pthread_mutex_unlock(&w->mu);
    *nodes = v;
    *n = k;
    return BT_OK;
}

bt_status mbr_watcher_get(mbr_watcher_t *w, const char *node_id, mbr_node_t *out)
{
    pthread_mutex_lock(&w->mu);
    mbr_entry *e = entry_find(w->entries, w->n_entries, node_id, NULL);
    bt_status st;
    if (!e || !e->has_info) {
        st = bt_fail(BT_ERR_NOT_FOUND, "membership: no node %s", node_id);
    } else {
        mbr_node_t copy = e->node;
        if (!(st = mbr_node_info_copy(&e->node.info, &copy.info))) *out = copy;
    }
    pthread_mutex_unlock(&w->mu);
    return st;
}

size_t mbr_watcher_count(mbr_watcher_t *w)
{
    pthread_mutex_lock(&w->mu);
    size_t count = 0;
    for (size_t i = 0; i < w->n_entries; i++) count += w->entries[i].has_info;
    pthread_mutex_unlock(&w->mu);
    return count;
}

int mbr_watcher_connected(mbr_watcher_t *w)
{
    pthread_mutex_lock(&w->mu);
    int c = w->connected;
    pthread_mutex_unlock(&w->mu);
    return c;
}
