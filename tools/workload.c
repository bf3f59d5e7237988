#include "tools/workload.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void workload_free(workload_item *w, int n)
{
    if (!w) return;
    for (int i = 0; i < n; i++) free(w[i].text);
    free(w);
}

/* One line into *it; 0, or -1 with the reason printed. */
static int parse_line(const char *prog, const char *path, int lineno, const char *line, workload_item *it)
{
    cJSON *j = cJSON_Parse(line);
    const cJSON *chat = cJSON_GetObjectItemCaseSensitive(j, "chat");
    const cJSON *raw = cJSON_GetObjectItemCaseSensitive(j, "prompt");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
    it->chat = cJSON_IsString(chat);
    const cJSON *t = it->chat ? chat : raw;
    int rc = 0;
    if (!cJSON_IsString(t)) {
        fprintf(stderr, "%s: %s:%d: want a JSON object with a string \"chat\" or \"prompt\"\n", prog, path, lineno);
        rc = -1;
    } else if (!(it->text = strdup(t->valuestring))) {
        fprintf(stderr, "%s: out of memory reading %s\n", prog, path);
        rc = -1;
    } else {
        snprintf(it->name, sizeof it->name, "%s", cJSON_IsString(name) ? name->valuestring : "");
    }
    cJSON_Delete(j);
    return rc;
}

int workload_load(const char *prog, const char *path, int max, workload_item **out, int *n_out)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: cannot open the workload %s: %s\n", prog, path, strerror(errno));
        return -1;
    }
    workload_item *w = NULL;
    int n = 0, lineno = 0, rc = 0;
    char line[65536];
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        if (line[strspn(line, " \t\r\n")] == 0) continue;
        if (n >= max) {
            fprintf(stderr, "%s: %s holds more than the %d prompts allowed\n", prog, path, max);
            rc = -1;
            break;
        }
        workload_item *g = realloc(w, sizeof *w * (size_t)(n + 1));
        if (!g) {
            fprintf(stderr, "%s: out of memory reading %s\n", prog, path);
            rc = -1;
            break;
        }
        w = g;
        memset(&w[n], 0, sizeof w[n]);
        if ((rc = parse_line(prog, path, lineno, line, &w[n])) == 0) n++;
    }
    fclose(f);
    if (!rc && n == 0) {
        fprintf(stderr, "%s: %s holds no prompt\n", prog, path);
        rc = -1;
    }
    if (rc) {
        workload_free(w, n);
        return -1;
    }
    *out = w;
    *n_out = n;
    return 0;
}
