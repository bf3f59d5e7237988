/* baton-decode: a decode node: prefills locally (colocated mode) or on the prefill node the router hints. Flags, listeners, etcd and signals come from
 * common/node; the Decode service from decode_service.c. */
#include "common/log.h"
#include "common/node.h"
#include "decode-node/decode_service.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    bt_node_flags_t flags;
    int help = 0;
    if (bt_node_flags_parse(&flags, MBR_ROLE_DECODE, argc, argv, &help) != BT_OK) {
        fprintf(stderr, "baton-decode: %s (see baton-decode --help)\n", bt_last_error());
        return 2;
    }
    if (help) {
        bt_node_usage(stdout, "baton-decode");
        return 0;
    }
    bt_node_t *node = NULL;
    if (bt_node_create(&flags, MBR_ROLE_DECODE, &node) != BT_OK) {
        fprintf(stderr, "baton-decode: %s\n", bt_last_error());
        return 1;
    }
    decode_config_t dc = {
        .model_path = flags.model,
        .threads = flags.threads,
        .kv_mem = flags.kv_mem,
        .max_batch_tokens = flags.max_batch_tokens,
        .node_id = flags.node_id,
        .spec = flags.spec,
        .spec_k_max = flags.spec_k_max,
        .metrics = bt_node_metrics(node),
        .rpc = bt_node_rpc(node),
    };
    decode_service_t *svc = NULL;
    if (decode_service_create(&dc, &svc) != BT_OK) {
        fprintf(stderr, "baton-decode: %s\n", bt_last_error());
        bt_node_destroy(node);
        return 1;
    }
    mbr_node_info_t info;
    memset(&info, 0, sizeof info);
    char summary[512];
    decode_service_summary(svc, summary, sizeof summary);
    int rc = 0;
    if (decode_service_node_info(svc, &info) != BT_OK ||
        bt_node_start(node, &info, decode_service_load, svc, summary) != BT_OK) {
        fprintf(stderr, "baton-decode: %s\n", bt_last_error());
        rc = 1;
    } else {
        int sig = bt_node_wait(node);
        BT_INFO("decode", "%s: draining %d calls in flight (grace %d ms)", sig ? strsignal(sig) : "stop requested",
                decode_service_inflight(svc), flags.grace_ms);
    }
    mbr_node_info_free(&info);
    bt_node_stop(node, flags.grace_ms); /* the engine keeps running: cancelled calls still finish through it */
    decode_service_destroy(svc);
    bt_node_destroy(node);
    if (rc == 0) BT_INFO("decode", "stopped cleanly");
    return rc;
}
