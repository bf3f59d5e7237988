/* baton-prefill: a prefill node. The process's life comes from node/node_main.h; the Prefill service from
 * prefill_service.c. */
#include "node/node_main.h"
#include "prefill-node/prefill_service.h"

/* The Prefill service configured by the node's flags, on the node's gRPC server and metrics registry. */
static bt_status create(const bt_node_flags_t *flags, const bt_ne_env_t *env, bt_node_t *node, void **svc)
{
    prefill_config_t pc = {
        .model_path = flags->model,
        .threads = flags->threads,
        .kv_mem = flags->kv_mem,
        .max_batch_tokens = flags->max_batch_tokens,
        .env = env,
        .node_id = flags->node_id,
        .metrics = bt_node_metrics(node),
        .rpc = bt_node_rpc(node),
        .members = bt_node_members(node),
    };
    prefill_service_t *s = NULL;
    bt_status st = prefill_service_create(&pc, &s);
    if (st == BT_OK) *svc = s;
    return st;
}

static const bt_node_service_ops_t PREFILL_OPS = {
    .create = create,
    .node_info = prefill_service_node_info,
    .summary = prefill_service_summary,
    .load = prefill_service_load,
    .inflight = prefill_service_inflight,
    .destroy = prefill_service_destroy,
};

int main(int argc, char **argv) { return bt_node_main(MBR_ROLE_PREFILL, &PREFILL_OPS, argc, argv); }
