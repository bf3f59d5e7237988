/* tests node/peer_check: which member records a request may name (a prefill hint, a KV destination). */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "node/peer_check.h"
#include "test_util.h"

static mbr_node_t record(const char *id, mbr_role role, const char *model)
{
    mbr_node_t n;
    memset(&n, 0, sizeof n);
    strcpy(n.info.node_id, id);
    n.info.role = role;
    strcpy(n.info.model, model);
    strcpy(n.info.grpc_addr, "10.0.0.7:7001");
    return n;
}

static void test_record_checks(void)
{
    char why[256];
    mbr_node_t p = record("p-1", MBR_ROLE_PREFILL, "abcdef0123");
    CHECK(bt_peer_check_record(&p, "p-1", MBR_ROLE_PREFILL, "ABCDEF0123", why, sizeof why) == BT_OK);
    CHECK(bt_peer_check_record(NULL, "ghost", MBR_ROLE_PREFILL, "abcdef0123", why, sizeof why) == BT_ERR_INVALID);
    CHECK(strstr(why, "'ghost' is not registered") != NULL);
    CHECK(bt_peer_check_record(&p, "p-1", MBR_ROLE_DECODE, "abcdef0123", why, sizeof why) == BT_ERR_INVALID);
    CHECK_MSG(strstr(why, "registered as a prefill node, not a decode node") != NULL, "%s", why);
    CHECK(bt_peer_check_record(&p, "p-1", MBR_ROLE_PREFILL, "ffff", why, sizeof why) == BT_ERR_INVALID);
    CHECK(strstr(why, "serves model abcdef0123") != NULL);
    CHECK(bt_peer_check_record(&p, "p-1", MBR_ROLE_PREFILL, NULL, why, sizeof why) == BT_ERR_INVALID);
}

static void test_descriptor_match(void)
{
    mbr_node_t d = record("d-1", MBR_ROLE_DECODE, "abc");
    uint8_t desc[8] = {1, 2, 3, 4, 5, 6, 7, 8}, other[8] = {1, 2, 3, 4, 5, 6, 7, 9};
    CHECK(!bt_peer_desc_matches(&d, desc, sizeof desc)); /* nothing registered */
    d.info.ucx_desc = desc;
    d.info.ucx_desc_len = sizeof desc;
    CHECK(bt_peer_desc_matches(&d, desc, sizeof desc));
    CHECK(!bt_peer_desc_matches(&d, other, sizeof other));
    CHECK(!bt_peer_desc_matches(&d, desc, sizeof desc - 1));
    CHECK(!bt_peer_desc_matches(&d, desc, 0));
}

static void test_no_membership(void)
{
    char why[256];
    mbr_node_t out;
    CHECK(bt_peer_lookup(NULL, "p-1", MBR_ROLE_PREFILL, "abc", &out, why, sizeof why) == BT_ERR_UNAVAILABLE);
    CHECK(strstr(why, "without etcd") != NULL);
    CHECK(out.info.ucx_desc == NULL);
}

int main(void)
{
    bt_log_set_level(BT_LOG_ERROR);
    RUN(test_record_checks);
    RUN(test_descriptor_match);
    RUN(test_no_membership);
    return test_summary();
}
