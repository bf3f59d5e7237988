#include "rpc_test_service.h"

#include "baton/v1/generate.pb-c.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum mode { MODE_FAST, MODE_SLOW, MODE_HANG, MODE_FAIL, MODE_META, MODE_PEER };

typedef struct stream {
    rpc_test_svc *svc;
    bt_rpc_call_t *call;
    enum mode mode;
    unsigned n;
    char meta_key[64];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cancel_seen;
} stream;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void active_add(rpc_test_svc *svc, int d)
{
    pthread_mutex_lock(&svc->mu);
    svc->active += d;
    pthread_cond_broadcast(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
}

void rpc_test_svc_init(rpc_test_svc *svc)
{
    memset(svc, 0, sizeof *svc);
    pthread_mutex_init(&svc->mu, NULL);
    pthread_cond_init(&svc->cv, NULL);
}

void rpc_test_svc_destroy(rpc_test_svc *svc)
{
    pthread_mutex_destroy(&svc->mu);
    pthread_cond_destroy(&svc->cv);
}

int rpc_test_svc_wait_idle(rpc_test_svc *svc, int timeout_ms)
{
    int64_t until = mono_ms() + timeout_ms;
    pthread_mutex_lock(&svc->mu);
    while (svc->active > 0 && mono_ms() < until) {
        pthread_mutex_unlock(&svc->mu);
        sleep_ms(5);
        pthread_mutex_lock(&svc->mu);
    }
    int idle = svc->active == 0;
    pthread_mutex_unlock(&svc->mu);
    return idle;
}

static void finish(rpc_test_svc *svc, bt_rpc_call_t *call, bt_rpc_code code, const char *msg)
{
    atomic_fetch_add(&svc->finished, 1);
    bt_rpc_call_finish(call, code, msg);
}

/* ---- Tokenize ---- */

static void tokenize_cancelled(void *ud, bt_rpc_call_t *call)
{
    rpc_test_svc *svc = ud;
    atomic_fetch_add(&svc->cancelled, 1);
    finish(svc, call, BT_RPC_CANCELLED, "cancelled");
    active_add(svc, -1);
}

static void tokenize(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *reqm)
{
    rpc_test_svc *svc = ud;
    const Baton__V1__TokenizeRequest *req = (const Baton__V1__TokenizeRequest *)reqm;
    const char *text = req->input_case == BATON__V1__TOKENIZE_REQUEST__INPUT_TEXT ? req->text : "";
    if (strcmp(text, "hang") == 0) {
        active_add(svc, 1);
        bt_rpc_call_on_cancel(call, tokenize_cancelled, svc);
        return;
    }
    size_t n = strlen(text);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        finish(svc, call, BT_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) ids[i] = (unsigned char)text[i];
    Baton__V1__TokenizeResponse resp = BATON__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_token_ids = n;
    resp.token_ids = ids;
    resp.max_context = 4096;
    bt_status st = bt_rpc_call_send(call, &resp.base);
    free(ids);
    atomic_fetch_add(&svc->finished, 1);
    bt_rpc_call_finish_status(call, st);
}

/* ---- Generate ---- */

static void stream_cancelled(void *ud, bt_rpc_call_t *call)
{
    stream *s = ud;
    pthread_mutex_lock(&s->mu);
    s->cancel_seen = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static bt_status send_token(stream *s, unsigned i, const char *text, int last)
{
    Baton__V1__GenerateResponse resp = BATON__V1__GENERATE_RESPONSE__INIT;
    int32_t id = (int32_t)i;
    char buf[32];
    snprintf(buf, sizeof buf, "t%u ", i);
    resp.model = "test";
    resp.n_token_ids = 1;
    resp.token_ids = &id;
    resp.text = (char *)(text ? text : buf);
    Baton__V1__Usage usage = BATON__V1__USAGE__INIT;
    if (last) {
        resp.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        usage.prompt_tokens = 1;
        usage.completion_tokens = s->n;
        usage.total_tokens = s->n + 1;
        resp.usage = &usage;
    }
    for (;;) {
        bt_status st = bt_rpc_call_send(s->call, &resp.base);
        if (st != BT_ERR_EXHAUSTED) {
            if (st == BT_OK) atomic_fetch_add(&s->svc->sent, 1);
            return st;
        }
        sleep_ms(1); /* the client reads slowly: wait for the queue to drain */
    }
}

static void *producer(void *arg)
{
    stream *s = arg;
    rpc_test_svc *svc = s->svc;
    bt_status st = BT_OK;
    switch (s->mode) {
    case MODE_HANG:
        st = send_token(s, 0, NULL, 0);
        bt_rpc_call_on_cancel(s->call, stream_cancelled, s);
        pthread_mutex_lock(&s->mu);
        while (!s->cancel_seen) pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
        st = BT_ERR_CANCELLED;
        break;
    case MODE_META: {
        char value[256];
        if (bt_rpc_call_metadata(s->call, s->meta_key, value, sizeof value) != BT_OK) snprintf(value, sizeof value, "<none>");
        st = send_token(s, 0, value, 1);
        break;
    }
    case MODE_PEER: {
        char value[256];
        if (bt_rpc_call_peer_identity(s->call, value, sizeof value) != BT_OK) snprintf(value, sizeof value, "<none>");
        st = send_token(s, 0, value, 1);
        break;
    }
    default:
        for (unsigned i = 0; i < s->n && st == BT_OK; i++) {
            if (s->mode == MODE_FAIL && i == 3) {
                finish(svc, s->call, BT_RPC_INVALID_ARGUMENT, "fail mode after 3 messages");
                goto done;
            }
            if (s->mode == MODE_SLOW) sleep_ms(2);
            st = send_token(s, i, NULL, i + 1 == s->n);
        }
    }
    if (st == BT_ERR_CANCELLED) atomic_fetch_add(&svc->cancelled, 1);
    finish(svc, s->call, st == BT_OK ? BT_RPC_OK : bt_rpc_code_from_status(st), st == BT_OK ? NULL : bt_last_error());
done:
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    active_add(svc, -1);
    return NULL;
}

static void generate(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *reqm)
{
    rpc_test_svc *svc = ud;
    const Baton__V1__GenerateRequest *req = (const Baton__V1__GenerateRequest *)reqm;
    const char *text = req->prompt_case == BATON__V1__GENERATE_REQUEST__PROMPT_TEXT ? req->text : "";
    stream *s = calloc(1, sizeof *s);
    if (!s) {
        finish(svc, call, BT_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    s->svc = svc;
    s->call = call;
    s->n = req->max_tokens_opt_case == BATON__V1__GENERATE_REQUEST__MAX_TOKENS_OPT_MAX_TOKENS ? req->max_tokens : 16;
    s->mode = strcmp(text, "slow") == 0   ? MODE_SLOW
              : strcmp(text, "hang") == 0 ? MODE_HANG
              : strcmp(text, "fail") == 0 ? MODE_FAIL
              : strncmp(text, "meta:", 5) == 0 ? MODE_META
              : strcmp(text, "peer") == 0 ? MODE_PEER
                                                : MODE_FAST;
    if (s->mode == MODE_META) snprintf(s->meta_key, sizeof s->meta_key, "%s", text + 5);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    active_add(svc, 1);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, producer, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        active_add(svc, -1);
        finish(svc, call, BT_RPC_RESOURCE_EXHAUSTED, "cannot start a producer thread");
    }
}

/* ---- Detokenize, ListModels ---- */

static void detokenize(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *reqm)
{
    rpc_test_svc *svc = ud;
    char text[128];
    pthread_mutex_lock(&svc->mu);
    int active = svc->active;
    pthread_mutex_unlock(&svc->mu);
    snprintf(text, sizeof text, "cancelled=%d finished=%d active=%d", atomic_load(&svc->cancelled),
             atomic_load(&svc->finished), active);
    Baton__V1__DetokenizeResponse resp = BATON__V1__DETOKENIZE_RESPONSE__INIT;
    resp.text = text;
    bt_rpc_call_finish_status(call, bt_rpc_call_send(call, &resp.base));
}

static void list_models(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *reqm)
{
    Baton__V1__ModelInfo model = BATON__V1__MODEL_INFO__INIT;
    Baton__V1__ModelInfo *models[1] = {&model};
    model.id = "test";
    int64_t dl = bt_rpc_call_deadline_ms(call);
    model.created = dl == INT64_MAX ? -1 : dl - mono_ms();
    Baton__V1__ListModelsResponse resp = BATON__V1__LIST_MODELS_RESPONSE__INIT;
    resp.n_models = 1;
    resp.models = models;
    bt_rpc_call_finish_status(call, bt_rpc_call_send(call, &resp.base));
}

bt_status rpc_test_svc_register(rpc_test_svc *svc, bt_rpc_server_t *srv)
{
    bt_status st = bt_rpc_server_add_method(srv, "/baton.v1.Generation/Generate", BT_RPC_SERVER_STREAMING,
                                            &baton__v1__generate_request__descriptor, generate, svc);
    if (st == BT_OK)
        st = bt_rpc_server_add_method(srv, "/baton.v1.Generation/Tokenize", BT_RPC_UNARY,
                                      &baton__v1__tokenize_request__descriptor, tokenize, svc);
    if (st == BT_OK)
        st = bt_rpc_server_add_method(srv, "/baton.v1.Generation/Detokenize", BT_RPC_UNARY,
                                      &baton__v1__detokenize_request__descriptor, detokenize, svc);
    if (st == BT_OK)
        st = bt_rpc_server_add_method(srv, "/baton.v1.Generation/ListModels", BT_RPC_UNARY,
                                      &baton__v1__list_models_request__descriptor, list_models, svc);
    if (st == BT_OK) st = bt_rpc_server_set_health(srv, "baton.v1.Generation", 1);
    return st;
}
