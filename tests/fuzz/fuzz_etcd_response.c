/* libFuzzer target: the etcd JSON gateway answer parsers (common/etcd_json.c) and the membership record parsers
 * (NodeInfo, LoadReport) over arbitrary bytes. The first byte picks the parser; the rest is the body. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/etcd_json.h"
#include "common/membership.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t which = data[0];
    size_t len = size - 1;
    /* An exact-size copy, not NUL-terminated, so reads past the end are caught by ASan. */
    char *body = malloc(len ? len : 1);
    if (!body) return 0;
    if (len) memcpy(body, data + 1, len);
    int64_t a, b, c;
    int ok;
    char msg[64];
    switch (which % 10) {
    case 0: {
        etcd_range_result_t r;
        if (etcd_json_parse_range(body, len, &r) == BT_OK) {
            volatile size_t sink = 0;
            for (size_t i = 0; i < r.n_kvs; i++) sink += r.kvs[i].key_len + r.kvs[i].value_len + strlen(r.kvs[i].key);
            (void)sink;
            etcd_range_result_free(&r);
        }
        break;
    }
    case 1: {
        etcd_watch_msg_t m;
        if (etcd_json_parse_watch(body, len, &m) == BT_OK) {
            volatile size_t sink = strlen(m.reason);
            for (size_t i = 0; i < m.n_events; i++) sink += m.events[i].kv.key_len + m.events[i].prev_kv.value_len;
            (void)sink;
            etcd_watch_msg_free(&m);
        }
        break;
    }
    case 2: etcd_json_parse_error(body, len, &ok, msg, sizeof msg); break;
    case 3: etcd_json_parse_revision(body, len, &a); break;
    case 4: etcd_json_parse_delete(body, len, &a, &b); break;
    case 5: etcd_json_parse_txn(body, len, &ok, &a); break;
    case 6: etcd_json_parse_lease(body, len, which & 0x10, &a, &b, &c); break;
    case 7: {
        char *token;
        if (etcd_json_parse_token(body, len, &token) == BT_OK) free(token);
        break;
    }
    case 8: {
        mbr_node_info_t n;
        if (mbr_node_info_from_json(body, len, &n) == BT_OK) {
            char *json;
            if (mbr_node_info_to_json(&n, &json) == BT_OK) { /* what was accepted must round-trip */
                mbr_node_info_t back;
                if (mbr_node_info_from_json(json, strlen(json), &back) != BT_OK) abort();
                if (back.ucx_desc_len != n.ucx_desc_len || strcmp(back.node_id, n.node_id)) abort();
                mbr_node_info_free(&back);
                free(json);
            }
            mbr_node_info_free(&n);
        }
        break;
    }
    default: {
        mbr_load_report_t l;
        mbr_load_from_json(body, len, &l);
        break;
    }
    }
    free(body);
    return 0;
}
