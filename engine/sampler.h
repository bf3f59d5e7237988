/* Token sampling from one row of logits (DESIGN 4.4). Randomness comes from a counter-based generator keyed by
 * (seed, sample index, position), so a sequence samples the same tokens whatever it is batched with and in whatever
 * order steps run: a sampled token is a pure function of (logits, parameters, seed, sample index, position,
 * the sequence's own history).
 *
 * Processing order (vLLM v1's): raw logits -> [grammar mask: forbidden tokens -inf] -> logit bias -> repetition penalty -> frequency and presence penalties
 * -> (temperature 0: argmax, lowest id on ties) -> divide by temperature -> min-p -> top-k -> top-p over the
 * renormalised survivors -> draw. Reported logprobs are log-softmax of the RAW logits (before bias, penalties and
 * temperature), which is what OpenAI and vLLM (logprobs_mode "raw_logprobs", its default) report; under a grammar,
 * of the masked raw logits (the distribution the grammar leaves).
 *
 * Two ways in:
 *  - bt_sample(): stateless, one sequence, no history (penalties see nothing), sample index 0.
 *  - bt_sampler_seq: per-sequence state (a copy of the parameters, the prompt's token set, counts of generated
 *    tokens) updated with each accepted token, for penalties, stop ids, max_tokens and n > 1. Per step it costs
 *    O(distinct tokens seen) on top of the vocabulary passes, never O(history).
 *
 * How callers use it:
 *  - HTTP / gRPC layer: fill a bt_sampling from the request (bt_sampling_default() first, then the fields given;
 *    OpenAI's logit_bias object becomes (id, bias) pairs, chat "logprobs"/"top_logprobs" map 1:1, completions'
 *    integer "logprobs" = logprobs true + top_logprobs), reject with bt_sampling_check() (400 / INVALID_ARGUMENT,
 *    bt_last_error() names the field). Without a client seed, pick a random one per request and keep it.
 *  - Scheduler: on admission create sample 0 with bt_sampler_seq_create(sp, n_vocab, prompt, n_prompt, eog ids,
 *    n_eog, 0, &seq) (this also checks token ids against the vocabulary), fork samples 1..n-1 with
 *    bt_sampler_seq_fork. Each step, for each
 *    sequence with a logits row: id = bt_sampler_sample(seq, row, position, scratch, &out), where position is the
 *    sampled token's position in its sequence (prompt length + tokens generated so far), then
 *    bt_sampler_seq_accept(seq, id, &finish) and finish the sequence when finish != BT_FINISH_NONE. One scratch
 *    buffer of 2 * n_vocab floats per sampling thread serves every sequence. Preemption needs nothing: the state
 *    lives with the request. Speculative decoding: bt_sampler_probs for each draft position, accept the drafts
 *    tentatively, bt_sampler_seq_rollback the rejected ones.
 * Thread-safety: pure functions; a bt_sampler_seq is owned by one thread at a time; scratch is per caller.
 * Cost: greedy is one argmax pass; truncated sampling never sorts the vocabulary (top-k: a size-k heap; top-p: a
 * weighted quickselect over the candidates that can matter, or a mass histogram when there are many). */
#ifndef BATON_ENGINE_SAMPLER_H
#define BATON_ENGINE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

#define BT_MAX_TOP_LOGPROBS 20 /* OpenAI's limit for top_logprobs */
#define BT_MAX_LOGIT_BIAS 300  /* entries in one request's logit_bias (baton's limit) */
#define BT_MAX_STOP_IDS 32     /* stop_token_ids per request */
#define BT_MAX_EOS 8           /* model end-of-sequence ids given to bt_sampler_seq_create */
#define BT_MAX_N 128           /* parallel samples per request (OpenAI's limit for n) */

typedef struct bt_logit_bias {
    int32_t id;  /* token id, checked against the vocabulary by bt_sampling_check_vocab */
    float bias;  /* added to the raw logit, in [-100, 100] */
} bt_logit_bias;

typedef struct bt_sampling {
    float temperature; /* < 1e-5 (or top_k 1) = greedy: argmax of the biased/penalised logits, lowest id on ties */
    int32_t top_k;     /* 0 = off */
    float top_p;       /* 1 = off */
    float min_p;       /* 0 = off; keeps tokens with p >= min_p * p_max (after temperature) */
    uint64_t seed;
    float repetition_penalty; /* 1 = off; HF/vLLM: logit > 0 ? logit / r : logit * r, tokens of prompt + output */
    float frequency_penalty;  /* 0 = off; OpenAI: logit -= f * count in output, in [-2, 2] */
    float presence_penalty;   /* 0 = off; OpenAI: logit -= p * (count in output > 0), in [-2, 2] */
    int32_t n_logit_bias;
    bt_logit_bias logit_bias[BT_MAX_LOGIT_BIAS]; /* distinct ids */
    bool logprobs;        /* report the chosen token's logprob */
    int32_t top_logprobs; /* 0..20 most likely tokens to report too; > 0 needs logprobs */
    int32_t n;            /* parallel samples, 1..BT_MAX_N; the caller creates one bt_sampler_seq per sample */
    int32_t max_tokens;   /* generated tokens before finish "length"; 0 = no limit here (the context bounds it) */
    int32_t n_stop_ids;
    int32_t stop_ids[BT_MAX_STOP_IDS]; /* finish "stop" once one of these is generated */
    bool ignore_eos;                   /* do not finish on the model's end-of-sequence ids */
} bt_sampling;

/* Defaults: greedy, no truncation, no penalties or bias, no logprobs, n 1, no token limit, seed 0. */
bt_sampling bt_sampling_default(void);

/* Checks what does not depend on the model: temperature in [0, 100], top_k >= 0, top_p in (0, 1], min_p in [0, 1],
 * repetition_penalty in (0, 10], frequency/presence_penalty in [-2, 2], logit_bias count, ids >= 0, distinct,
 * biases in [-100, 100], top_logprobs in [0, 20] (and logprobs set when > 0), n in [1, 128], max_tokens >= 0,
 * stop id count and ids >= 0. BT_ERR_INVALID with a message naming the field. */
bt_status bt_sampling_check(const bt_sampling *sp);

/* bt_sampling_check plus token ids (logit_bias, stop_ids) < n_vocab. */
bt_status bt_sampling_check_vocab(const bt_sampling *sp, int32_t n_vocab);

/* A uniform double in [0, 1) determined by (seed, position) alone. Stream 0 of bt_rng_uniform_stream. */
double bt_rng_uniform(uint64_t seed, int64_t position);

/* A uniform double in [0, 1) determined by (seed, stream, position): stream i is sample i of an n > 1 request, so
 * sample 0 draws exactly what an n = 1 request with the same seed draws and the others are independent of it. */
double bt_rng_uniform_stream(uint64_t seed, int32_t stream, int64_t position);

/* Floats of scratch that bt_sample, bt_sampler_sample and bt_sampler_probs need: 2 * n_vocab. */
static inline int64_t bt_sampler_scratch_floats(int32_t n_vocab) { return 2 * (int64_t)n_vocab; }

/* Samples a token from logits[n_vocab] for the token at `position` of its sequence, without history (penalties
 * have no effect, logit_bias ids outside the vocabulary are skipped) and with sample index 0. scratch must hold
 * 2 * n_vocab floats (any contents). *logprob (optional) receives log-softmax of the raw logits at the chosen id.
 * Can't fail for a checked bt_sampling. */
int32_t bt_sample(const bt_sampling *sp, const float *logits, int32_t n_vocab, int64_t position, float *scratch,
                  float *logprob);

/* log-softmax of logits at id (numerically stable). */
float bt_logprob(const float *logits, int32_t n_vocab, int32_t id);

/* ---- per-sequence state ---- */

typedef struct bt_sampler_seq bt_sampler_seq;
typedef struct bt_constraint bt_constraint; /* engine/constraint.h */

typedef enum bt_finish {
    BT_FINISH_NONE = 0,   /* keep generating */
    BT_FINISH_STOP = 1,   /* a stop id or (unless ignore_eos) an end-of-sequence id was generated */
    BT_FINISH_LENGTH = 2, /* max_tokens tokens were generated */
} bt_finish;

typedef struct bt_token_logprob {
    int32_t id;
    float logprob; /* log-softmax of the raw logits */
} bt_token_logprob;

typedef struct bt_sample_out {
    int32_t id;      /* the sampled token (also the return value) */
    float logprob;   /* of id; 0 unless sp.logprobs */
    int32_t rank;    /* of id among raw logits, 1 = most likely (ties: lower id first); 0 unless sp.logprobs */
    int32_t n_top;   /* = sp.top_logprobs when sp.logprobs, else 0 */
    bt_token_logprob top[BT_MAX_TOP_LOGPROBS]; /* most likely first, ties lower id first */
} bt_sample_out;

/* Creates the state of sample `sample_index` (0..sp->n - 1) of a request: copies *sp (after
 * bt_sampling_check_vocab), remembers the prompt's tokens when a repetition penalty is set, and the model's
 * end-of-sequence ids (at most BT_MAX_EOS). BT_ERR_INVALID naming the field, BT_ERR_NOMEM; *out set on success. */
bt_status bt_sampler_seq_create(const bt_sampling *sp, int32_t n_vocab, const int32_t *prompt, int32_t n_prompt,
                                const int32_t *eos, int32_t n_eos, int32_t sample_index, bt_sampler_seq **out);

/* A deep copy of src (history included) with another sample index: for n > 1, create sample 0 after the prompt
 * and fork the others. BT_ERR_INVALID (index), BT_ERR_NOMEM. */
bt_status bt_sampler_seq_fork(const bt_sampler_seq *src, int32_t sample_index, bt_sampler_seq **out);

/* NULL is allowed. */
void bt_sampler_seq_free(bt_sampler_seq *s);

/* The request's parameters as copied at creation. */
const bt_sampling *bt_sampler_seq_params(const bt_sampler_seq *s);

/* Constrains s with a grammar (engine/constraint.h; its vocabulary must be the model's): a reference is taken, forks
 * share it. Call before the first accept. From then on the tokens the grammar forbids get -inf before anything else
 * (bias, penalties, temperature, truncation), end-of-sequence ids are allowed only where the grammar accepts,
 * reported logprobs are those of the masked raw logits, accept advances the grammar (BT_ERR_INVALID for a token it
 * forbids) and finishes with BT_FINISH_STOP once nothing may follow, and rollback rewinds it.
 * BT_ERR_INVALID (already set, tokens accepted, vocabulary mismatch), BT_ERR_NOMEM. */
bt_status bt_sampler_seq_set_constraint(bt_sampler_seq *s, bt_constraint *c);

/* Advances s's grammar over tokens[n] that were generated before (a migrated request's delivered tokens, which
 * arrive as part of its prompt), before the first accept. BT_ERR_INVALID when the grammar forbids them. */
bt_status bt_sampler_seq_constraint_feed(bt_sampler_seq *s, const int32_t *tokens, int32_t n);

/* Whether the output so far is a sentence of s's grammar (1 without a constraint). */
int bt_sampler_seq_constraint_accepting(const bt_sampler_seq *s);

/* Records an accepted (generated) token: penalties count it from the next step on. *finish (optional) says
 * whether the sequence is done (stop beats length, as in vLLM). BT_ERR_INVALID (id out of range), BT_ERR_NOMEM. */
bt_status bt_sampler_seq_accept(bt_sampler_seq *s, int32_t token, bt_finish *finish);

/* Forgets the last n accepted tokens (rejected speculative tokens). BT_ERR_INVALID when n > generated. */
bt_status bt_sampler_seq_rollback(bt_sampler_seq *s, int32_t n);

/* Tokens accepted so far (the prompt not counted). */
int32_t bt_sampler_seq_n_generated(const bt_sampler_seq *s);

/* The sample index s draws with (its RNG stream): bt_sampler_seq_fork(s, bt_sampler_seq_index(s), ...) makes a
 * scratch copy that draws as s does. */
int32_t bt_sampler_seq_index(const bt_sampler_seq *s);

/* Tokens the sequence may still generate under max_tokens, or INT32_MAX when there is no limit. */
int32_t bt_sampler_seq_remaining(const bt_sampler_seq *s);

/* Samples the token at `position` from logits[n_vocab of s] using s's parameters, history and sample index.
 * scratch: 2 * n_vocab floats. out (optional) receives the id and, when sp.logprobs, the logprobs. Can't fail. */
int32_t bt_sampler_sample(const bt_sampler_seq *s, const float *logits, int64_t position, float *scratch,
                          bt_sample_out *out);

/* The distribution bt_sampler_sample draws from for logits[n_vocab of s], written to probs[n_vocab] (zeros outside
 * the kept set, one-hot for greedy): for speculative decoding's rejection rule and for tests.
 * scratch: 2 * n_vocab floats. Can't fail. */
void bt_sampler_probs(const bt_sampler_seq *s, const float *logits, float *scratch, float *probs);

#endif
