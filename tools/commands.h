/* The `baton` CLI's subcommands: X(name-string, function, one-line summary).
 * Each function takes argc/argv starting at the subcommand name and returns the process exit code. */
#ifndef BATON_TOOLS_COMMANDS_H
#define BATON_TOOLS_COMMANDS_H

#define BATON_COMMANDS(X)                                                                 \
    X("model", cmd_model, "model files: `model fetch`, `model inspect PATH`")                \
    X("kvx-bench", cmd_kvx_bench, "KV transfer bandwidth/latency between two processes vs ucx_perftest") \
    X("tokenize", cmd_tokenize, "text to token ids and back: `tokenize [--model PATH] TEXT`")   \
    X("chat-template", cmd_chat_template, "render a JSON conversation with the model's chat template")     \
    X("generate", cmd_generate, "run a prompt through the engine and stream the text")                 \
    X("embed", cmd_embed, "embeddings of texts: mean-pooled final hidden states, normalized (JSON lines)")  \
    X("logits", cmd_logits, "teacher-forced logits of token ids to a float32 file (for tests)")         \
    X("bench", cmd_bench, "engine benchmark: prefill and decode tok/s, bandwidth, decode roofline")           \
    X("bench-grammar", cmd_bench_grammar, "per-step cost of a grammar constraint at a batch: `bench-grammar --grammar FILE`") \
    X("bench-serve", cmd_bench_serve, "open-loop load against a router: TTFT/TPOT/e2e percentiles, goodput") \
    X("profile", cmd_profile, "measure this machine's prefill/decode step times and KV copy rate into a profile") \
    X("simulate", cmd_simulate, "discrete-event simulation of a cluster running the router's own policy code")

#define X(name, fn, help) int fn(int argc, char **argv);
BATON_COMMANDS(X)
#undef X

#endif
