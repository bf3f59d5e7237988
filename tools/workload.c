#include "tools/workload.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
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

uint64_t wl_rng_next(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double wl_rng_unit(uint64_t *s)
{
    return (double)(wl_rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static double rng_normal(uint64_t *s)
{
    double u = 1.0 - wl_rng_unit(s), v = wl_rng_unit(s);
    const double two_pi = 6.283185307179586;
    return sqrt(-2.0 * log(u)) * cos(two_pi * v); /* Box-Muller */
}

static int draw_len(uint64_t *s, double mean, double sd)
{
    double x = sd > 0 ? mean + sd * rng_normal(s) : mean;
    long l = lround(x);
    return l < 1 ? 1 : (int)l;
}

void wl_draw_init(wl_draw_t *d, unsigned long long seed, int rate_index, double rate, double prompt_mean,
                  double prompt_sd, double output_mean, double output_sd)
{
    d->s = (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)rate_index * 0xD1B54A32D192ED03ull + 1;
    d->rate = rate;
    d->prompt_mean = prompt_mean;
    d->prompt_sd = prompt_sd;
    d->output_mean = output_mean;
    d->output_sd = output_sd;
    d->t = 0;
}

void wl_draw_next(wl_draw_t *d, double *t, int *prompt_len, int *output_len, uint64_t *prompt_seed)
{
    if (!isinf(d->rate)) d->t += -log(1.0 - wl_rng_unit(&d->s)) / d->rate;
    *t = d->t;
    *prompt_len = draw_len(&d->s, d->prompt_mean, d->prompt_sd);
    *output_len = draw_len(&d->s, d->output_mean, d->output_sd);
    *prompt_seed = wl_rng_next(&d->s);
}
