/* The whole life of a node process, written once for both roles: parse the flags, create the node runtime
 * (node.h), create the role's service through its ops, start serving, wait for SIGINT/SIGTERM, drain, tear down.
 * A node binary's main() is one call to bt_node_main with its role's table. */
#ifndef BATON_NODE_NODE_MAIN_H
#define BATON_NODE_NODE_MAIN_H

#include "common/membership.h"
#include "common/status.h"
#include "node/node.h"
#include "node/node_engine.h"

#include <stddef.h>
#include <stdint.h>

/* What a role's service offers the node main. svc is the pointer create returned. */
typedef struct bt_node_service_ops {
    /* Creates the service from the parsed flags and the environment switches (read once by bt_node_main), adding
     * its gRPC methods to bt_node_rpc(node) and its metrics to bt_node_metrics(node). bt_status with the message
     * set; *svc set only on success. */
    bt_status (*create)(const bt_node_flags_t *flags, const bt_ne_env_t *env, bt_node_t *node, void **svc);
    /* Fills the role's part of the etcd record (model fingerprint, capacity, kvtransfer descriptor). */
    bt_status (*node_info)(const void *svc, mbr_node_info_t *info);
    /* One line for the ready log. */
    void (*summary)(const void *svc, char *buf, size_t cap);
    bt_node_load_fn load;
    /* Calls in flight, for the drain log. */
    int32_t (*inflight)(const void *svc);
    /* Called after the gRPC server has shut down. */
    void (*destroy)(void *svc);
} bt_node_service_ops_t;

/* Runs a node of role with ops until a signal or a fatal error and returns the process exit code: 0 after a clean
 * stop (or --help), 1 when start-up failed (a bad environment switch included), 2 for bad flags. Errors go to
 * stderr once, by the message that bt_last_error holds. The only place a node reads BATON_* switches that have no
 * flag (bt_ne_env_read); flags and their variables are bt_node_flags_parse's. */
int bt_node_main(mbr_role role, const bt_node_service_ops_t *ops, int argc, char **argv);

#endif
