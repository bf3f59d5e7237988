/* The `baton` CLI's subcommands: X(name-string, function, one-line summary).
 * Each function takes argc/argv starting at the subcommand name and returns the process exit code. */
#ifndef BATON_TOOLS_COMMANDS_H
#define BATON_TOOLS_COMMANDS_H

#define BATON_COMMANDS(X)                                                                 \
    X("model", cmd_model, "model files: `model fetch`, `model inspect PATH`")

#define X(name, fn, help) int fn(int argc, char **argv);
BATON_COMMANDS(X)
#undef X

#endif
