/* in progress */ typedef int gguf_writer_placeholder;
