/* Standard base64 (RFC 4648, padded), as etcd's JSON gateway uses for keys and values and baton uses for opaque
 * blobs (UCX descriptors) inside JSON records. */
#ifndef BATON_COMMON_BASE64_H
#define BATON_COMMON_BASE64_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

/* Length of the encoding of n bytes, without the terminating NUL. Can't fail. */
size_t base64_encoded_len(size_t n);

/* Encodes n bytes into dst, which must hold base64_encoded_len(n) + 1 bytes; writes a NUL. Can't fail. */
void base64_encode_to(const void *src, size_t n, char *dst);

/* Encodes n bytes into a new NUL-terminated string owned by the caller (free()).
 * Returns BT_ERR_NOMEM; *out is set only on success. */
bt_status base64_encode(const void *src, size_t n, char **out);

/* Decodes len characters of padded base64 (whitespace not allowed) into a new buffer owned by the caller,
 * NUL-terminated for convenience (the NUL is not counted in *out_len). Returns BT_ERR_FORMAT on a bad
 * character, length or padding, BT_ERR_NOMEM; outputs are set only on success. */
bt_status base64_decode(const char *src, size_t len, uint8_t **out, size_t *out_len);

#endif
