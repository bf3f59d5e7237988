#include "test_util.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int test_failures;
int test_checks;
static int test_skips;

static char tmpdir_path[256];

void test_skip(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("SKIP: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    test_skips++;
}

#define MAX_RUN_NAMES 256
static const char *run_names[MAX_RUN_NAMES]; /* the functions RUN ran (string literals) */
static int n_run;

int test_wanted(const char *name)
{
    const char *only = getenv("BATON_TEST_ONLY"), *except = getenv("BATON_TEST_EXCEPT");
    if ((only && *only && !test_list_has(only, name)) || test_list_has(except, name)) return 0;
    if (n_run < MAX_RUN_NAMES) run_names[n_run++] = name;
    return 1;
}

/* The item of a comma-separated list at *p and its length; *p moves to the next item (NULL after the last). */
static const char *list_item(const char **p, size_t *len)
{
    const char *item = *p, *end = strchr(item, ',');
    *len = end ? (size_t)(end - item) : strlen(item);
    *p = end ? end + 1 : NULL;
    return item;
}

/* With BATON_TEST_ONLY or BATON_TEST_EXCEPT set: says so, and fails for each name in BATON_TEST_ONLY that ran no
 * function (a misspelling). */
static void check_narrowing(void)
{
    const char *only = getenv("BATON_TEST_ONLY"), *except = getenv("BATON_TEST_EXCEPT");
    if (except && *except) fprintf(stderr, "BATON_TEST_EXCEPT=%s: those test functions not run\n", except);
    if (!only || !*only) return;
    fprintf(stderr, "BATON_TEST_ONLY=%s: only those test functions run\n", only);
    for (const char *p = only; p && *p;) {
        size_t len;
        const char *item = list_item(&p, &len);
        int found = 0;
        for (int i = 0; i < n_run && !found; i++)
            found = strlen(run_names[i]) == len && !strncmp(run_names[i], item, len);
        if (!found) {
            fprintf(stderr, "BATON_TEST_ONLY: no test function %.*s in this binary\n", (int)len, item);
            test_failures++;
        }
    }
}

int test_summary(void)
{
    check_narrowing();
    fprintf(stderr, "%d checks, %d failures, %d skipped\n", test_checks, test_failures, test_skips);
    if (test_failures == 0) test_tmpdir_cleanup();
    return test_failures ? 1 : test_skips ? TEST_SKIPPED : 0;
}

const char *test_tmpdir(void)
{
    if (!tmpdir_path[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpdir_path, sizeof tmpdir_path, "%s/baton-test-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(tmpdir_path)) {
            perror("mkdtemp");
            exit(2);
        }
    }
    return tmpdir_path;
}

void test_tmpdir_cleanup(void)
{
    if (!tmpdir_path[0]) return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir_path);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir_path);
    tmpdir_path[0] = '\0';
}

int test_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t n = fwrite(data, 1, len, f);
    int rc = fclose(f);
    return (n == len && rc == 0) ? 0 : -1;
}

int test_list_has(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        size_t len;
        const char *item = list_item(&p, &len);
        if (len == n && !strncmp(item, name, n)) return 1;
    }
    return 0;
}

uint64_t test_rand_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

const char *test_default_model(void)
{
    static char path[1024];
    const char *env = getenv("BATON_MODEL");
    if (env && *env) return access(env, R_OK) == 0 ? env : NULL;
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (xdg && *xdg)
        snprintf(path, sizeof path, "%s/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf", xdg);
    else
        snprintf(path, sizeof path, "%s/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : "/root");
    return access(path, R_OK) == 0 ? path : NULL;
}
