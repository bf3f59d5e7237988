/* The node process's life, once for both roles (see node_main.h). */
#include "node/node_main.h"

#include "common/log.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>

/* Parses the flags; returns -1 to go on, else the exit code (0 after --help, 2 on bad flags). */
static int parse_flags(const char *prog, mbr_role role, int argc, char **argv, bt_node_flags_t *flags)
{
    int help = 0;
    if (bt_node_flags_parse(flags, role, argc, argv, &help) != BT_OK) {
        fprintf(stderr, "%s: %s (see %s --help)\n", prog, bt_last_error(), prog);
        return 2;
    }
    if (help) {
        bt_node_usage(stdout, prog);
        return 0;
    }
    return -1;
}

/* Publishes the node and serves until a signal; 0, or 1 when the node could not start. */
static int serve(const char *prog, mbr_role role, const bt_node_service_ops_t *ops, bt_node_t *node, void *svc,
                 int grace_ms)
{
    mbr_node_info_t info;
    memset(&info, 0, sizeof info);
    char summary[1024];
    ops->summary(svc, summary, sizeof summary);
    int rc = 0;
    if (ops->node_info(svc, &info) != BT_OK || bt_node_start(node, &info, ops->load, svc, summary) != BT_OK) {
        fprintf(stderr, "%s: %s\n", prog, bt_last_error());
        rc = 1;
    } else {
        int sig = bt_node_wait(node);
        BT_INFO(mbr_role_name(role), "%s: draining %d calls in flight (grace %d ms)",
                sig ? strsignal(sig) : "stop requested", ops->inflight(svc), grace_ms);
    }
    mbr_node_info_free(&info);
    return rc;
}

int bt_node_main(mbr_role role, const bt_node_service_ops_t *ops, int argc, char **argv)
{
    char prog[32];
    snprintf(prog, sizeof prog, "baton-%s", mbr_role_name(role));
    bt_node_flags_t flags;
    int rc = parse_flags(prog, role, argc, argv, &flags);
    if (rc >= 0) return rc;
    bt_ne_env_t env;
    if (bt_ne_env_read(&env) != BT_OK) {
        fprintf(stderr, "%s: %s\n", prog, bt_last_error());
        return 1;
    }
    env.use_cuda = flags.device >= 0;
    env.cuda_device = flags.device >= 0 ? flags.device : 0;
    bt_node_t *node = NULL;
    if (bt_node_create(&flags, role, &node) != BT_OK) {
        fprintf(stderr, "%s: %s\n", prog, bt_last_error());
        return 1;
    }
    void *svc = NULL;
    if (ops->create(&flags, &env, node, &svc) != BT_OK) {
        fprintf(stderr, "%s: %s\n", prog, bt_last_error());
        bt_node_destroy(node);
        return 1;
    }
    rc = serve(prog, role, ops, node, svc, flags.grace_ms);
    bt_node_stop(node, flags.grace_ms); /* the engine keeps running: cancelled calls still finish through it */
    ops->destroy(svc);
    bt_node_destroy(node);
    if (rc == 0) BT_INFO(mbr_role_name(role), "stopped cleanly");
    return rc;
}
