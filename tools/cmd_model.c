#include <stdio.h>
int cmd_model(int argc, char **argv) { fprintf(stderr, "baton model: not built yet\n"); return 1; }
