/* Which CPU ISAs an engine test covers, and an honest account of those it could not.
 * ctest runs each ISA-dependent test once per ISA as <test>.<isa> with BATON_CPU_ISA=<isa> (PER_ISA in
 * tests/CMakeLists.txt): that entry covers that ISA alone and returns 77 (skipped) where the CPU lacks it, so the
 * others still count. Run by hand without BATON_CPU_ISA, a test covers every ISA the CPU has and records each
 * missing one as a skip. BATON_TEST_ISA_MAX=<isa> treats every higher ISA as missing: a rehearsal, on a big host,
 * of a smaller one (BATON_TEST_ISA_MAX=avx2: an AVX2-only machine such as AMD Zen 3). BATON_REQUIRE_ISA=avx2,avx512
 * turns a missing ISA from a skip into a failure (neon: the aarch64 build, run under qemu by `make test-neon`).
 * One translation unit per test binary includes this (its state is static). */
#ifndef BATON_TEST_ISA_H
#define BATON_TEST_ISA_H

#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_util.h"

static int test_isa_entry = -1;              /* the ISA BATON_CPU_ISA named, -1 when unset */
static int test_isa_seen[BT_CPU_ISA_COUNT]; /* ISAs a test actually exercised */

static inline int test_isa_from_name(const char *name)
{
    for (int i = 0; i < BT_CPU_ISA_COUNT; i++)
        if (!strcmp(name, bt_cpu_isa_name((bt_cpu_isa)i))) return i;
    return -1;
}

/* True when BATON_TEST_ISA_MAX hides isa. */
static inline int test_isa_hidden(bt_cpu_isa isa)
{
    const char *max = getenv("BATON_TEST_ISA_MAX");
    return max && *max && (int)isa > test_isa_from_name(max);
}

/* True when this host runs isa, within BATON_TEST_ISA_MAX. */
static inline int test_isa_present(bt_cpu_isa isa)
{
    return !test_isa_hidden(isa) && bt_cpu_isa_supported(isa);
}

/* True when BATON_REQUIRE_ISA (a comma-separated list, e.g. "avx2,avx512") names isa: a CI host that must test
 * those kernels fails instead of skipping them. */
static inline int test_isa_required(bt_cpu_isa isa)
{
    return test_list_has(getenv("BATON_REQUIRE_ISA"), bt_cpu_isa_name(isa));
}

/* Records why isa cannot run here: a skip, or a failure when BATON_REQUIRE_ISA names it. */
static inline void test_isa_skip(bt_cpu_isa isa)
{
    const char *name = bt_cpu_isa_name(isa);
    if (test_isa_required(isa)) {
        CHECK_MSG(0, "BATON_REQUIRE_ISA=%s, but the %s kernels cannot run here (%s)", getenv("BATON_REQUIRE_ISA"),
                  name, test_isa_hidden(isa) ? "hidden by BATON_TEST_ISA_MAX" : "the CPU lacks them");
        return;
    }
    if (test_isa_hidden(isa))
        test_skip("%s kernels: BATON_TEST_ISA_MAX=%s hides %s", name, getenv("BATON_TEST_ISA_MAX"), name);
    else
        test_skip("%s kernels: this host lacks %s", name, name);
}

/* True when the test should exercise isa here (and notes that it did): the entry's ISA, or every present ISA in a
 * run by hand. */
static inline int test_isa_covers(bt_cpu_isa isa)
{
    int yes = test_isa_entry >= 0 ? (int)isa == test_isa_entry : test_isa_present(isa);
    if (yes) test_isa_seen[isa] = 1;
    return yes;
}

/* The highest ISA this run covers (the entry's ISA, or the best present one). */
static inline bt_cpu_isa test_isa_top(void)
{
    if (test_isa_entry >= 0) return (bt_cpu_isa)test_isa_entry;
    for (int i = BT_CPU_ISA_COUNT - 1; i > 0; i--)
        if (test_isa_present((bt_cpu_isa)i)) return (bt_cpu_isa)i;
    return BT_CPU_ISA_SCALAR;
}

/* Call first in main(). Returns 0 when nothing of this run can execute here (the entry's ISA is missing: the skip
 * is recorded, main returns test_summary()); records a skip for each missing ISA in a run by hand. */
static inline int test_isa_begin(void)
{
    const char *env = getenv("BATON_CPU_ISA");
    if (env && *env) {
        test_isa_entry = test_isa_from_name(env);
        if (test_isa_entry < 0) {
            fprintf(stderr, "BATON_CPU_ISA=%s: expected scalar, avx2, avx2-vnni, avx512, neon or neon-i8mm\n", env);
            exit(2);
        }
        if (!test_isa_present((bt_cpu_isa)test_isa_entry)) {
            test_isa_skip((bt_cpu_isa)test_isa_entry);
            return 0;
        }
        return 1;
    }
    const char *max = getenv("BATON_TEST_ISA_MAX"); /* the engine's own choice must respect the rehearsal too */
    if (max && *max) setenv("BATON_CPU_ISA", bt_cpu_isa_name(test_isa_top()), 1);
    for (int i = 0; i < BT_CPU_ISA_COUNT; i++) /* another architecture's ISA is not applicable, not missing */
        if (bt_cpu_isa_built((bt_cpu_isa)i) && !test_isa_present((bt_cpu_isa)i)) test_isa_skip((bt_cpu_isa)i);
    return 1;
}

/* Prints the ISAs the run exercised ("ISAs covered: avx2 avx512"; the scalar reference is the oracle of every
 * comparison, so it runs in all of them). An entry whose ISA no check exercised fails: it would pass untested. */
static inline void test_isa_report(void)
{
    fputs("ISAs covered:", stderr);
    int any = 0;
    for (int i = 0; i < BT_CPU_ISA_COUNT; i++)
        if (test_isa_seen[i]) fprintf(stderr, " %s", bt_cpu_isa_name((bt_cpu_isa)i)), any = 1;
    fputs(any ? "\n" : " none beyond the scalar reference\n", stderr);
    if (test_isa_entry > 0)
        CHECK_MSG(test_isa_seen[test_isa_entry], "BATON_CPU_ISA=%s but no check ran the %s kernels",
                  bt_cpu_isa_name((bt_cpu_isa)test_isa_entry), bt_cpu_isa_name((bt_cpu_isa)test_isa_entry));
}

#endif
