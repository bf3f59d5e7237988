#include "common/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* -1 = not yet read from the environment. Process-wide by nature (one stderr).
 * BATON_LOG stays lazy here, the one switch not read at the edge: logging runs before any main has parsed anything
 * (library constructors, unit tests, the CLI's tools) and must honour the variable there too; the servers' mains
 * still set the level from --log-level / BATON_LOG through bt_log_set_level, which wins. */
static atomic_int log_threshold = -1;

static int threshold_from_env(void)
{
    const char *v = getenv("BATON_LOG");
    if (!v || !*v) return BT_LOG_INFO;
    if (!strcasecmp(v, "debug")) return BT_LOG_DEBUG;
    if (!strcasecmp(v, "warn")) return BT_LOG_WARN;
    if (!strcasecmp(v, "error")) return BT_LOG_ERROR;
    return BT_LOG_INFO;
}

void bt_log_set_level(bt_log_level level)
{
    atomic_store(&log_threshold, (int)level);
}

int bt_log_enabled(bt_log_level level)
{
    int t = atomic_load(&log_threshold);
    if (t < 0) {
        t = threshold_from_env();
        atomic_store(&log_threshold, t);
    }
    return (int)level >= t;
}

void bt_log(bt_log_level level, const char *component, const char *fmt, ...)
{
    static const char *const names[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};
    if (!bt_log_enabled(level)) return;
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s: ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
                     names[level], component ? component : "baton");
    if (n < 0) return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    fwrite(line, 1, len, stderr);
}
