// dsrun_simd.h: a small vector type per instruction set, so each optimizer kernel is written once.
//
// The build picks one level from the CPU (op_builder passes -DDSRUN_SIMD_AVX512, -DDSRUN_SIMD_AVX2 or
// nothing). Every level provides `VecF`: WIDTH floats with loads/stores from fp32, bf16 and fp16 storage
// and the arithmetic the kernels need. `ScalarF` is the same interface over one float; kernels use it for
// the tail of each chunk, so any length is handled without masked loads or reading past the end.
//
// Rounding: bf16 stores round to nearest even (NaN stays NaN), fp16 stores use the hardware conversion
// (or c10's in the scalar path), both matching torch's `.to(dtype)`. The files are compiled with
// -ffp-contract=off so that `a * b + c` rounds twice unless a kernel asks for fma() explicitly; the scalar
// tail and the vector body then give bit-identical results.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(DSRUN_SIMD_AVX512) || defined(DSRUN_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace dsrun {

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

// ---------------------------------------------------------------- scalar (also the tail of every level)
struct ScalarF {
    static constexpr int WIDTH = 1;
    float v;

    static ScalarF set1(float x) { return {x}; }
    static ScalarF load(const float* p) { return {*p}; }
    static ScalarF load(const bf16* p) { return {static_cast<float>(*p)}; }
    static ScalarF load(const fp16* p) { return {static_cast<float>(*p)}; }
    void store(float* p) const { *p = v; }
    void store(bf16* p) const { *p = bf16(v); }  // c10 rounds to nearest even
    void store(fp16* p) const { *p = fp16(v); }

    friend ScalarF operator+(ScalarF a, ScalarF b) { return {a.v + b.v}; }
    friend ScalarF operator-(ScalarF a, ScalarF b) { return {a.v - b.v}; }
    friend ScalarF operator*(ScalarF a, ScalarF b) { return {a.v * b.v}; }
    friend ScalarF operator/(ScalarF a, ScalarF b) { return {a.v / b.v}; }
    static ScalarF fma(ScalarF a, ScalarF b, ScalarF c) { return {std::fma(a.v, b.v, c.v)}; }
    static ScalarF sqrt(ScalarF a) { return {std::sqrt(a.v)}; }
    // torch.sign: -1, 0 or +1 (and 0 for NaN input is not needed: NaN propagates through p anyway)
    static ScalarF sign(ScalarF a) { return {static_cast<float>((a.v > 0.f) - (a.v < 0.f))}; }
};

#if defined(DSRUN_SIMD_AVX512)
#define DSRUN_SIMD_LEVEL "AVX512"

inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i f32x16_to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    // One instruction: round to nearest even, NaN kept (CPUs with avx512_bf16, e.g. Sapphire Rapids).
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
#endif
}

struct VecF {
    static constexpr int WIDTH = 16;
    __m512 v;

    static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
    static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static VecF load(const bf16* p) { return {bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
    static VecF load(const fp16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
    void store(bf16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32x16_to_bf16(v)); }
    void store(fp16* p) const {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }

    friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
    friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
    friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
    friend VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
    static VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
    static VecF sqrt(VecF a) { return {_mm512_sqrt_ps(a.v)}; }
    static VecF sign(VecF a) {
        __m512 zero = _mm512_setzero_ps();
        __mmask16 pos = _mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ);
        __mmask16 neg = _mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ);
        __m512 r = _mm512_mask_mov_ps(zero, pos, _mm512_set1_ps(1.f));
        return {_mm512_mask_mov_ps(r, neg, _mm512_set1_ps(-1.f))};
    }
};

#elif defined(DSRUN_SIMD_AVX2)
#define DSRUN_SIMD_LEVEL "AVX2"

inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m128i f32x8_to_bf16(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // Values fit in 16 bits, so the unsigned-saturating pack is exact; it packs within 128-bit lanes,
    // hence the permute that gathers lanes 0 and 2.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
    return _mm256_castsi256_si128(packed);
}

struct VecF {
    static constexpr int WIDTH = 8;
    __m256 v;

    static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
    static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
    static VecF load(const bf16* p) { return {bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
    static VecF load(const fp16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
    void store(float* p) const { _mm256_storeu_ps(p, v); }
    void store(bf16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32x8_to_bf16(v)); }
    void store(fp16* p) const {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }

    friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
    friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
    friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
    friend VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
    static VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
    static VecF sqrt(VecF a) { return {_mm256_sqrt_ps(a.v)}; }
    static VecF sign(VecF a) {
        __m256 zero = _mm256_setzero_ps();
        __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), _mm256_set1_ps(1.f));
        __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), _mm256_set1_ps(1.f));
        return {_mm256_sub_ps(pos, neg)};
    }
};

#else
#define DSRUN_SIMD_LEVEL "scalar"
using VecF = ScalarF;
#endif

}  // namespace dsrun
