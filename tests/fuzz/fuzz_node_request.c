/* libFuzzer target: what a node accepts from the network before any work, the wire bytes of a Decode/Run or a
 * Prefill/Run or a Decode/Embed request through protobuf-c and then the node's own validation (decode_run_params,
 * prefill_check_request, decode_embed_check) under the default model's limits. The first byte picks the request
 * (mod 3); the rest is its wire encoding. The two service files are compiled in so that they are instrumented. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "baton/v1/node.pb-c.h"
#include "common/log.h"
#include "decode-node/decode_service.h"
#include "prefill-node/prefill_service.h"

/* The limits the validators read, as the default model sets them (SmolLM2-135M: 49,152 tokens, 8,192 context). */
static bt_model g_model;
static bt_ne_t g_ne;

static void setup(void)
{
    if (g_ne.n_vocab) return;
    bt_log_set_level(BT_LOG_ERROR);
    strcpy(g_model.name, "fuzz");
    g_ne.m = &g_model;
    strcpy(g_ne.fingerprint, "0123456789abcdef");
    g_ne.n_vocab = 49152;
    g_ne.max_context = 8192;
    g_ne.layout.fingerprint = 0x5eed;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    setup();
    char err[512] = "";
    bt_req_params rp = bt_req_params_default();
    rp.sampling = bt_sampling_default();
    if (data[0] % 3 == 2) {
        Baton__V1__DecodeEmbedRequest *q = baton__v1__decode_embed_request__unpack(NULL, size - 1, data + 1);
        if (!q) return 0;
        uint32_t tokens = 0;
        bt_rpc_code code = decode_embed_check(&g_ne, q, &tokens, err, sizeof err);
        if (code != BT_RPC_OK && !err[0]) abort();
        if (code == BT_RPC_OK) { /* what the handler then trusts */
            uint64_t sum = 0;
            if (!q->n_inputs || q->n_inputs > DECODE_EMBED_MAX_INPUTS) abort();
            for (size_t i = 0; i < q->n_inputs; i++) {
                if (!q->inputs[i] || !q->inputs[i]->n_ids || q->inputs[i]->n_ids > (size_t)g_ne.max_context) abort();
                for (size_t k = 0; k < q->inputs[i]->n_ids; k++)
                    if (q->inputs[i]->ids[k] < 0 || q->inputs[i]->ids[k] >= g_ne.n_vocab) abort();
                sum += q->inputs[i]->n_ids;
            }
            if (sum != tokens || sum > DECODE_EMBED_MAX_TOKENS) abort();
        }
        baton__v1__decode_embed_request__free_unpacked(q, NULL);
    } else if (data[0] % 3 == 1) {
        Baton__V1__PrefillRunRequest *q = baton__v1__prefill_run_request__unpack(NULL, size - 1, data + 1);
        if (!q) return 0;
        bt_rpc_code code = prefill_check_request(&g_ne, q, &rp, err, sizeof err);
        if (code != BT_RPC_OK && !err[0]) abort(); /* a refusal always says why */
        baton__v1__prefill_run_request__free_unpacked(q, NULL);
    } else {
        Baton__V1__DecodeRunRequest *q = baton__v1__decode_run_request__unpack(NULL, size - 1, data + 1);
        if (!q) return 0;
        err[0] = 0;
        bt_rpc_code code = decode_run_params(&g_ne, q, &rp, err, sizeof err);
        if (code != BT_RPC_OK && !err[0]) abort();
        if (code == BT_RPC_OK && (rp.sampling.max_tokens < 0 || rp.sampling.n_stop_ids > BT_MAX_STOP_IDS)) abort();
        baton__v1__decode_run_request__free_unpacked(q, NULL);
    }
    return 0;
}
