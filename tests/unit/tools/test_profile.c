/* tools/cmd_profile.c: the fit over repeated sweeps (the median of the repetitions' medians sets a disturbed
 * repetition aside and is not biased low; over two repetitions the least), a second coefficient measured apart
 * held fixed, and the timing of a prompt ending's logits row and sampling on a tiny model. */
#include "tools/cmd_profile.c"

#include "engine/tiny_model.h"
#include "engine/test_engine_env.h"
#include "test_util.h"

/* y = 2 ms + 0.6 ms per token + 0.1 ms per prompt ending, for prefill shapes (n tokens, k endings); repetition r's
 * steps are scaled by scale[r], 3 steps per shape and repetition. */
static void prefill_points(pf_points *p, const double *scale, int reps)
{
    static const double shapes[][2] = {{16, 1}, {64, 4}, {128, 1}, {256, 1}, {512, 1}, {512, 4}};
    memset(p, 0, sizeof *p);
    p->k = 2;
    for (int r = 0; r < reps; r++) {
        p->cur_rep = r;
        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
            for (int j = 0; j < 3; j++)
                pf_add(p, shapes[i][0], shapes[i][1],
                       scale[r] * (0.002 + 0.0006 * shapes[i][0] + 0.0001 * shapes[i][1]));
    }
}

static void test_fit_recovers_the_model(void)
{
    static pf_points p;
    const double one[3] = {1, 1, 1};
    double c[3];
    prefill_points(&p, one, 3);
    REQUIRE(fit_robust(&p, 0, -1, c) == 0);
    CHECK_MSG(fabs(c[0] - 0.002) < 1e-9 && fabs(c[1] - 0.0006) < 1e-12 && fabs(c[2] - 0.0001) < 1e-10,
              "free fit %g %g %g", c[0], c[1], c[2]);
    /* the ending's cost given: the rest is fitted on tokens alone */
    REQUIRE(fit_robust(&p, 0, 0.0001, c) == 0);
    CHECK_MSG(fabs(c[0] - 0.002) < 1e-9 && fabs(c[1] - 0.0006) < 1e-12 && c[2] == 0.0001, "fixed c2 %g %g %g", c[0],
              c[1], c[2]);
}

static void test_fit_sets_a_disturbed_repetition_aside(void)
{
    static pf_points p;
    const double scale[3] = {1, 2.5, 1}; /* a build next door during the second sweep */
    double c[3];
    prefill_points(&p, scale, 3);
    REQUIRE(fit_robust(&p, 0, -1, c) == 0);
    CHECK_MSG(fabs(c[1] - 0.0006) < 1e-12, "token_s %g", c[1]);
}

static void test_fit_takes_the_median_not_the_least(void)
{
    static pf_points p;
    const double scale[3] = {1.1, 1.0, 1.2}; /* the spread of a quiet machine: the typical sweep, not the luckiest */
    double c[3];
    prefill_points(&p, scale, 3);
    REQUIRE(fit_robust(&p, 0, -1, c) == 0);
    CHECK_MSG(fabs(c[1] - 1.1 * 0.0006) < 1e-12 && fabs(c[0] - 1.1 * 0.002) < 1e-9, "three: %g %g", c[0], c[1]);
    prefill_points(&p, scale, 2); /* two repetitions have no median that sets one aside: the least */
    REQUIRE(fit_robust(&p, 0, -1, c) == 0);
    CHECK_MSG(fabs(c[1] - 0.0006) < 1e-12, "two: %g", c[1]);
}

static void test_prompt_end_is_timed(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/profile-tiny.gguf", test_tmpdir());
    tiny_model_opts o = {0};
    tiny_model_defaults(&o);
    o.n_vocab = 4096; /* a logits row worth timing */
    bt_model *m = NULL;
    bt_backend *be = NULL;
    REQUIRE(tiny_model_write(path, &o) == 0 && bt_model_load(path, &m) == BT_OK);
    REQUIRE(test_backend_cpu(1, &be) == BT_OK);
    double seq_s = -1, first_s = -1, sample_s = -1;
    REQUIRE(measure_prompt_end(m, be, &seq_s, &first_s, &sample_s) == 0);
    CHECK_MSG(sample_s > 0 && seq_s >= sample_s && first_s >= 0 && seq_s < 0.1, "seq %g first %g sample %g", seq_s,
              first_s, sample_s);
    bt_backend_destroy(be);
    bt_model_free(m);
}

int main(void)
{
    RUN(test_fit_recovers_the_model);
    RUN(test_fit_sets_a_disturbed_repetition_aside);
    RUN(test_fit_takes_the_median_not_the_least);
    RUN(test_prompt_end_is_timed);
    test_tmpdir_cleanup();
    return test_summary();
}
