/* baton-decode: a decode node: prefills locally (colocated mode) or on the prefill node the router hints. The
 * process's life comes from node/node_main.h; the Decode service from decode_service.c. */
#include "decode-node/decode_service.h"
#include "node/node_main.h"

/* The Decode service configured by the node's flags, on the node's gRPC server and metrics registry. */
static bt_status create(const bt_node_flags_t *flags, const bt_ne_env_t *env, bt_node_t *node, void **svc)
{
    decode_config_t dc = {
        .model_path = flags->model,
        .threads = flags->threads,
        .kv_mem = flags->kv_mem,
        .max_batch_tokens = flags->max_batch_tokens,
        .env = env,
        .node_id = flags->node_id,
        .spec = flags->spec,
        .spec_k_max = flags->spec_k_max,
        .metrics = bt_node_metrics(node),
        .rpc = bt_node_rpc(node),
        .members = bt_node_members(node),
        .tls = &flags->tls,
    };
    decode_service_t *s = NULL;
    bt_status st = decode_service_create(&dc, &s);
    if (st == BT_OK) *svc = s;
    return st;
}

static const bt_node_service_ops_t DECODE_OPS = {
    .create = create,
    .node_info = decode_service_node_info,
    .summary = decode_service_summary,
    .load = decode_service_load,
    .inflight = decode_service_inflight,
    .destroy = decode_service_destroy,
};

int main(int argc, char **argv) { return bt_node_main(MBR_ROLE_DECODE, &DECODE_OPS, argc, argv); }
