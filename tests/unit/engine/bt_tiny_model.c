/* Writes a tiny random-weight model (tiny_model.h defaults, no tokenizer) to argv[1]: integration tests use it as a
 * model that matches nothing real (e.g. a draft model with another vocabulary). */
#include <stdio.h>

#include "common/status.h"
#include "tiny_model.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: bt_tiny_model OUT.gguf\n");
        return 2;
    }
    tiny_model_opts o = {0};
    if (tiny_model_write(argv[1], &o)) {
        fprintf(stderr, "bt_tiny_model: %s\n", bt_last_error());
        return 1;
    }
    return 0;
}
