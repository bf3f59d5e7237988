#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Thread-local like errno: each thread reports its own last failure. */
static _Thread_local char tls_msg[512];

const char *bt_status_str(bt_status st)
{
    switch (st) {
    case BT_OK: return "ok";
    case BT_ERR_INVALID: return "invalid argument";
    case BT_ERR_NOMEM: return "out of memory";
    case BT_ERR_IO: return "i/o error";
    case BT_ERR_FORMAT: return "malformed data";
    case BT_ERR_UNSUPPORTED: return "unsupported";
    case BT_ERR_NOT_FOUND: return "not found";
    case BT_ERR_TIMEOUT: return "timed out";
    case BT_ERR_PEER: return "peer failed";
    case BT_ERR_EXHAUSTED: return "resource exhausted";
    case BT_ERR_CANCELLED: return "cancelled";
    case BT_ERR_STALE: return "stale";
    case BT_ERR_UNAVAILABLE: return "unavailable";
    case BT_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

bt_status bt_fail(bt_status st, const char *fmt, ...)
{
    /* Format into a local buffer first: callers may pass bt_last_error() itself as an argument. */
    char buf[sizeof tls_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(tls_msg, buf, sizeof buf);
    return st;
}

const char *bt_last_error(void)
{
    return tls_msg;
}

void bt_clear_error(void)
{
    tls_msg[0] = '\0';
}
