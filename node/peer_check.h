/* Which peers a node believes: a request that names another node (a decode node's prefill hint, a prefill node's
 * KV destination) is acted on only when that node is registered in this cluster's etcd view with the role and
 * model the request implies, and, for a KV destination, with the very pool descriptor the request carries.
 * Everything else a caller sends about a peer is a claim, not a fact (issue 16: KV poisoning through a forged
 * prefill hint, pushes into a forged pool).
 *
 * With etcd auth on only baton's own role can write member records, so "registered" means "a baton node"; with
 * mTLS the gRPC channel to the registered address proves the server is who the record says. */
#ifndef BATON_NODE_PEER_CHECK_H
#define BATON_NODE_PEER_CHECK_H

#include <stddef.h>

#include "common/membership.h"
#include "common/status.h"

/* Checks a member record against what a request implies: role `want` and model fingerprint `model` (compared
 * case-insensitively). node_id names the peer in messages; rec NULL means "not registered". BT_OK, else
 * BT_ERR_INVALID with why filled. Pure: no I/O. */
bt_status bt_peer_check_record(const mbr_node_t *rec, const char *node_id, mbr_role want, const char *model,
                               char *why, size_t cap);

/* Looks node_id up in the view and checks it as bt_peer_check_record does. On BT_OK *out holds a deep copy (free
 * out->info with mbr_node_info_free). members NULL (the node runs without etcd) refuses every peer: nothing
 * vouches for it. */
bt_status bt_peer_lookup(mbr_watcher_t *members, const char *node_id, mbr_role want, const char *model,
                         mbr_node_t *out, char *why, size_t cap);

/* 1 when desc[len] equals the KV pool descriptor the record published, byte for byte. */
int bt_peer_desc_matches(const mbr_node_t *rec, const void *desc, size_t len);

#endif
