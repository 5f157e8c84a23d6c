/* convert.c - stored values (uint8, int8, float16, float32) to floats. */
#include "convert.h"

#include <math.h>
#include <string.h>

size_t data_elem_bytes(DataElem e) {
    switch (e) {
    case DATA_ELEM_U8:
    case DATA_ELEM_I8: return 1;
    case DATA_ELEM_F16: return 2;
    case DATA_ELEM_F32: return 4;
    default: return 0;
    }
}

const char *data_elem_name(DataElem e) {
    static const char *const names[DATA_ELEM_COUNT] = {"uint8", "int8", "float16", "float32"};
    return (unsigned)e < DATA_ELEM_COUNT ? names[e] : "?";
}

float data_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31;
    const int exp = (h >> 10) & 0x1f;
    const uint32_t man = h & 0x3ffu;
    float v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float */
        v = ldexpf((float)man, -24);
    } else if (exp == 31) {
        uint32_t bits = 0x7f800000u | (man << 13);
        memcpy(&v, &bits, sizeof v);
    } else {
        uint32_t bits = ((uint32_t)(exp - 15 + 127) << 23) | (man << 13);
        memcpy(&v, &bits, sizeof v);
    }
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    b |= sign;
    memcpy(&v, &b, sizeof v);
    return v;
}

float convert_value(const uint8_t *raw, size_t i, DataElem e) {
    switch (e) {
    case DATA_ELEM_U8: return (float)raw[i];
    case DATA_ELEM_I8: return (float)(int8_t)raw[i];
    case DATA_ELEM_F16: {
        uint16_t h;
        memcpy(&h, raw + 2 * i, sizeof h);
        return data_half_to_float(h);
    }
    case DATA_ELEM_F32: {
        float f;
        memcpy(&f, raw + 4 * i, sizeof f);
        return f;
    }
    default: return NAN;
    }
}

size_t convert_first_nonfinite(const uint8_t *raw, size_t n, DataElem e) {
    if (e == DATA_ELEM_U8 || e == DATA_ELEM_I8) return n;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(convert_value(raw, i, e))) return i;
    return n;
}

/* x = scale * p + shift for len bytes: Fashion-MNIST's path, kept as it was. */
static void convert_bytes(float *x, const uint8_t *px, size_t len, float scale, float shift) {
    for (size_t j = 0; j < len; j++) x[j] = scale * (float)px[j] + shift;
}

void convert_rows(float *x, const uint8_t *raw, int k, const Dataset *d, bool transpose) {
    const size_t feat = (size_t)d->feat, eb = data_elem_bytes(d->elem);
    if (d->elem == DATA_ELEM_U8 && !d->chan_scale && !transpose) {
        convert_bytes(x, raw, (size_t)k * feat, d->pixel_scale, d->pixel_shift);
        return;
    }
    const int channels = d->shape[0];
    const size_t plane = feat / (size_t)channels;
    const int side = d->ndim == 3 ? d->shape[1] : 0;
    for (int r = 0; r < k; r++, x += feat, raw += feat * eb) {
        for (int c = 0; c < channels; c++) {
            const float a = d->chan_scale ? d->chan_scale[c] : d->pixel_scale;
            const float b = d->chan_scale ? d->chan_shift[c] : d->pixel_shift;
            const uint8_t *src = raw + (size_t)c * plane * eb;
            float *dst = x + (size_t)c * plane;
            if (!transpose) {
                for (size_t i = 0; i < plane; i++) dst[i] = a * convert_value(src, i, d->elem) + b;
            } else {
                for (int i = 0; i < side; i++)
                    for (int j = 0; j < side; j++)
                        dst[i * side + j] = a * convert_value(src, (size_t)j * side + i, d->elem) + b;
            }
        }
    }
}

void convert_transpose_rows(uint8_t *raw, int n, int channels, int side, DataElem e) {
    const size_t eb = data_elem_bytes(e), plane = (size_t)side * side * eb;
    uint8_t tmp[4];
    for (int ex = 0; ex < n; ex++)
        for (int c = 0; c < channels; c++) {
            uint8_t *img = raw + ((size_t)ex * channels + c) * plane;
            for (int i = 0; i < side; i++)
                for (int j = i + 1; j < side; j++) {
                    uint8_t *p = img + ((size_t)i * side + j) * eb, *q = img + ((size_t)j * side + i) * eb;
                    memcpy(tmp, p, eb), memcpy(p, q, eb), memcpy(q, tmp, eb);
                }
        }
}
