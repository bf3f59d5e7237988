/* baton-prefill: a prefill node. Flags, listeners, etcd and signals come from node/node.h; the Prefill service
 * from prefill_service.c. */
#include "common/log.h"
#include "node/node.h"
#include "prefill-node/prefill_service.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    bt_node_flags_t flags;
    int help = 0;
    if (bt_node_flags_parse(&flags, MBR_ROLE_PREFILL, argc, argv, &help) != BT_OK) {
        fprintf(stderr, "baton-prefill: %s (see baton-prefill --help)\n", bt_last_error());
        return 2;
    }
    if (help) {
        bt_node_usage(stdout, "baton-prefill");
        return 0;
    }
    bt_node_t *node = NULL;
    if (bt_node_create(&flags, MBR_ROLE_PREFILL, &node) != BT_OK) {
        fprintf(stderr, "baton-prefill: %s\n", bt_last_error());
        return 1;
    }
    prefill_config_t pc = {
        .model_path = flags.model,
        .threads = flags.threads,
        .kv_mem = flags.kv_mem,
        .max_batch_tokens = flags.max_batch_tokens,
        .node_id = flags.node_id,
        .metrics = bt_node_metrics(node),
        .rpc = bt_node_rpc(node),
    };
    prefill_service_t *svc = NULL;
    if (prefill_service_create(&pc, &svc) != BT_OK) {
        fprintf(stderr, "baton-prefill: %s\n", bt_last_error());
        bt_node_destroy(node);
        return 1;
    }
    mbr_node_info_t info;
    memset(&info, 0, sizeof info);
    int rc = 0;
    char summary[512];
    prefill_service_summary(svc, summary, sizeof summary);
    if (prefill_service_node_info(svc, &info) != BT_OK ||
        bt_node_start(node, &info, prefill_service_load, svc, summary) != BT_OK) {
        fprintf(stderr, "baton-prefill: %s\n", bt_last_error());
        rc = 1;
    } else {
        int sig = bt_node_wait(node);
        BT_INFO("prefill", "%s: draining %d calls in flight (grace %d ms)", sig ? strsignal(sig) : "stop requested",
                prefill_service_inflight(svc), flags.grace_ms);
    }
    mbr_node_info_free(&info);
    bt_node_stop(node, flags.grace_ms);
    prefill_service_destroy(svc);
    bt_node_destroy(node);
    if (rc == 0) BT_INFO("prefill", "stopped cleanly");
    return rc;
}
