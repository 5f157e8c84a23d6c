/* sha256.h - SHA-256 (FIPS 180-4), small and self-contained: the identity
 * hash of a LoRA run's frozen base (trainer/checkpoint.h). */
#ifndef QTRAIN_TRAINER_SHA256_H
#define QTRAIN_TRAINER_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define SHA256_DIGEST_BYTES 32
#define SHA256_HEX_CHARS 65 /* 64 lowercase hex digits and the NUL */

typedef struct {
    uint32_t h[8];        /* the chaining state */
    uint64_t bytes;       /* message length so far */
    uint8_t block[64];    /* a partial block */
    size_t fill;          /* bytes in block */
} Sha256;

void sha256_init(Sha256 *s);
void sha256_update(Sha256 *s, const void *data, size_t len);
/* Pads, writes the digest [32] and leaves s to be re-initialized. */
void sha256_final(Sha256 *s, uint8_t digest[SHA256_DIGEST_BYTES]);
/* digest as 64 lowercase hex digits into hex[SHA256_HEX_CHARS]. */
void sha256_hex(const uint8_t digest[SHA256_DIGEST_BYTES], char hex[SHA256_HEX_CHARS]);

#endif
