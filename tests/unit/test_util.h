/* Minimal unit-test helpers shared by every tests/unit executable.
 * CHECK records a failure and continues; REQUIRE stops the current test function; test_skip records coverage that
 * could not run here. A test binary's main() calls RUN(fn) for each test and returns test_summary(). */
#ifndef BATON_TEST_UTIL_H
#define BATON_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

extern int test_failures;
extern int test_checks;

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        test_checks++;                                                                      \
        if (!(cond)) {                                                                      \
            test_failures++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);        \
        }                                                                                   \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                \
    do {                                                                                    \
        test_checks++;                                                                      \
        if (!(cond)) {                                                                      \
            test_failures++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                                   \
            fputc('\n', stderr);                                                            \
        }                                                                                   \
    } while (0)

#define REQUIRE(cond)                                                                       \
    do {                                                                                    \
        test_checks++;                                                                      \
        if (!(cond)) {                                                                      \
            test_failures++;                                                                \
            fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__, __LINE__, #cond);      \
            return;                                                                         \
        }                                                                                   \
    } while (0)

#define RUN(fn)                                                                             \
    do {                                                                                    \
        if (!test_wanted(#fn)) break;                                                       \
        int before_ = test_failures;                                                        \
        fn();                                                                               \
        fprintf(stderr, "%s %s\n", test_failures == before_ ? "ok  " : "FAIL", #fn);        \
    } while (0)

/* Whether RUN runs the test function called name: every one, unless the environment narrows them with
 * BATON_TEST_ONLY (comma-separated names: only those) or BATON_TEST_EXCEPT (all but those). One binary becomes
 * several ctest entries that way (baton_add_unit_test's SPLIT, tests/CMakeLists.txt). test_summary names the
 * variables when they are set and fails for each BATON_TEST_ONLY name that ran no function (a misspelling). */
int test_wanted(const char *name);

/* Exit code of a test binary that passed but skipped part of what it covers: ctest's SKIP_RETURN_CODE for every
 * unit test (tests/CMakeLists.txt), so the skip shows in ctest's summary instead of passing for a full run. */
#define TEST_SKIPPED 77

/* Records that part of this binary's coverage did not run here, and why: prints "SKIP: <why>" (the line the skip
 * report quotes, tests/skip_report.py) and makes test_summary return TEST_SKIPPED unless a check failed. */
void test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints the totals; returns the process exit code: 1 when a check failed, else TEST_SKIPPED when test_skip was
 * called, else 0. */
int test_summary(void);

/* Creates a fresh temporary directory (removed by test_tmpdir_cleanup or left for inspection on failure).
 * Returns its path in a static buffer. */
const char *test_tmpdir(void);
void test_tmpdir_cleanup(void);

/* Writes len bytes to path; returns 0 on success. */
int test_write_file(const char *path, const void *data, size_t len);

/* Whether the comma-separated list (NULL: empty) names name, e.g. "avx2,avx512" and "avx512". */
int test_list_has(const char *list, const char *name);

/* splitmix64: deterministic test randomness from a seed. */
uint64_t test_rand_next(uint64_t *state);

/* Path of the default model if it is cached (BATON_MODEL env, else the cache location), or NULL. */
const char *test_default_model(void);

#endif
