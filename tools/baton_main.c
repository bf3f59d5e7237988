/* `baton`: the command-line tool. Thin dispatcher; each subcommand lives in its own cmd_*.c. */
#include <stdio.h>
#include <string.h>

#include "tools/commands.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: baton COMMAND [options]\n\ncommands:\n");
#define X(name, fn, help) fprintf(out, "  %-14s %s\n", name, help);
    BATON_COMMANDS(X)
#undef X
    fprintf(out, "\nRun `baton COMMAND --help` for a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("baton %s\n", BATON_VERSION);
        return 0;
    }
#define X(name, fn, help) \
    if (!strcmp(argv[1], name)) return fn(argc - 1, argv + 1);
    BATON_COMMANDS(X)
#undef X
    fprintf(stderr, "baton: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
