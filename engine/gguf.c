#include "engine/gguf.h"
