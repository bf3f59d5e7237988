/* CRC-32C (Castagnoli, the iSCSI/ext4 checksum): used by kvtransfer to verify KV blocks end to end.
 * A portable slicing-by-8 implementation, with the SSE4.2 crc32 instruction chosen at run time when present. */
#ifndef BATON_COMMON_CRC32C_H
#define BATON_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends crc (0 to start) over len bytes and returns the new value; chaining is exact:
 * bt_crc32c(bt_crc32c(0, a, na), b, nb) == CRC of a followed by b. Can't fail; thread-safe. */
uint32_t bt_crc32c(uint32_t crc, const void *data, size_t len);

/* Same result, always through the portable table code (the reference the fast path is tested against). */
uint32_t bt_crc32c_sw(uint32_t crc, const void *data, size_t len);

/* 1 when bt_crc32c uses the SSE4.2 instruction on this CPU. */
int bt_crc32c_hw_available(void);

#endif
