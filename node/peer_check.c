/* Peers a node believes (see peer_check.h). */
#include "node/peer_check.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

bt_status bt_peer_check_record(const mbr_node_t *rec, const char *node_id, mbr_role want, const char *model,
                               char *why, size_t cap)
{
    if (!rec) {
        snprintf(why, cap, "%s node '%.64s' is not registered in this cluster", mbr_role_name(want), node_id);
        return BT_ERR_INVALID;
    }
    if (rec->info.role != want) {
        snprintf(why, cap, "node '%.64s' is registered as a %s node, not a %s node", node_id,
                 mbr_role_name(rec->info.role), mbr_role_name(want));
        return BT_ERR_INVALID;
    }
    if (!model || strcasecmp(rec->info.model, model) != 0) {
        snprintf(why, cap, "node '%.64s' serves model %.40s, this node %.40s", node_id, rec->info.model,
                 model ? model : "(none)");
        return BT_ERR_INVALID;
    }
    return BT_OK;
}

bt_status bt_peer_lookup(mbr_watcher_t *members, const char *node_id, mbr_role want, const char *model,
                         mbr_node_t *out, char *why, size_t cap)
{
    memset(out, 0, sizeof *out);
    if (!members) {
        snprintf(why, cap, "this node runs without etcd, so no %s node can be verified", mbr_role_name(want));
        return BT_ERR_UNAVAILABLE;
    }
    bt_status st = mbr_watcher_get(members, node_id, out);
    if (st == BT_ERR_NOMEM) {
        snprintf(why, cap, "out of memory");
        return st;
    }
    st = bt_peer_check_record(st == BT_OK ? out : NULL, node_id, want, model, why, cap);
    if (st != BT_OK) {
        mbr_node_info_free(&out->info);
        memset(out, 0, sizeof *out);
    }
    return st;
}

int bt_peer_desc_matches(const mbr_node_t *rec, const void *desc, size_t len)
{
    return rec->info.ucx_desc && rec->info.ucx_desc_len == len && len && memcmp(rec->info.ucx_desc, desc, len) == 0;
}
