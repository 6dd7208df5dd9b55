// dsrun_optim.h: what the three CPU optimizers share: dtype dispatch, argument checks and the parallel
// element loop.
//
// A kernel is a struct with `template <class V> void at(int64_t i) const` that updates elements
// [i, i + V::WIDTH). `run_kernel` splits [0, n) across OpenMP threads in chunks that start on a 64-element
// boundary (so two threads never write the same cache line of a 16-bit output), runs the full vectors of
// each chunk with VecF and the remainder with ScalarF.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "dsrun_simd.h"

namespace dsrun {

// Tag for "no low-precision copy to write".
struct NoLowPrecision {};

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelThreshold = 1 << 15;

template <class K>
void run_kernel(const K& kernel, int64_t n) {
    auto body = [&kernel](int64_t begin, int64_t end) {
        int64_t i = begin;
        for (; i + VecF::WIDTH <= end; i += VecF::WIDTH) kernel.template at<VecF>(i);
        for (; i < end; ++i) kernel.template at<ScalarF>(i);
    };
    int threads = at::get_num_threads();
#ifdef _OPENMP
    if (n >= kParallelThreshold && threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num();
            const int64_t team = omp_get_num_threads();
            const int64_t chunk = ((n + team - 1) / team + 63) / 64 * 64;
            const int64_t begin = std::min(n, t * chunk);
            const int64_t end = std::min(n, begin + chunk);
            if (begin < end) body(begin, end);
        }
        return;
    }
#endif
    body(0, n);
}

template <class F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
    switch (t) {
        case at::kFloat: f(float{}); return;
        case at::kBFloat16: f(bf16{}); return;
        case at::kHalf: f(fp16{}); return;
        default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", t);
    }
}

template <class F>
void dispatch_state(at::ScalarType t, F&& f) {
    switch (t) {
        case at::kFloat: f(float{}); return;
        case at::kBFloat16: f(bf16{}); return;
        default: TORCH_CHECK(false, "optimizer states must be float32 or bfloat16, got ", t);
    }
}

template <class F>
void dispatch_low_precision(const at::Tensor& lp, F&& f) {
    if (!lp.defined() || lp.numel() == 0) { f(NoLowPrecision{}); return; }
    switch (lp.scalar_type()) {
        case at::kBFloat16: f(bf16{}); return;
        case at::kHalf: f(fp16{}); return;
        default: TORCH_CHECK(false, "the low-precision parameter copy must be bfloat16 or float16, got ", lp.scalar_type());
    }
}

// f(param_tag, grad_tag, state_tag, low_precision_tag). Only the combinations that make sense are compiled
// (26, not 54): an fp32 (master) parameter takes any grad dtype and an optional 16-bit copy; a 16-bit
// parameter is updated directly from an fp32 grad or one of its own dtype.
template <class F>
void dispatch_types(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state, const at::Tensor& lp, F&& f) {
    dispatch_float(param.scalar_type(), "param", [&](auto p) {
        using P = decltype(p);
        dispatch_state(state.scalar_type(), [&](auto s) {
            if constexpr (std::is_same_v<P, float>) {
                dispatch_float(grad.scalar_type(), "grad", [&](auto g) {
                    dispatch_low_precision(lp, [&](auto l) { f(p, g, s, l); });
                });
            } else {
                TORCH_CHECK(!lp.defined() || lp.numel() == 0, "a low-precision copy needs float32 (master) params");
                if (grad.scalar_type() == at::kFloat) {
                    f(p, float{}, s, NoLowPrecision{});
                } else {
                    TORCH_CHECK(grad.scalar_type() == param.scalar_type(), "the grad of a ", param.scalar_type(),
                                " parameter must be float32 or ", param.scalar_type(), ", got ", grad.scalar_type());
                    f(p, p, s, NoLowPrecision{});
                }
            }
        });
    });
}

inline void check_operand(const at::Tensor& t, const at::Tensor& param, const char* what, size_t index) {
    TORCH_CHECK(t.device().is_cpu(), what, "[", index, "] must be a CPU tensor");
    TORCH_CHECK(t.is_contiguous(), what, "[", index, "] must be contiguous");
    TORCH_CHECK(t.numel() == param.numel(), what, "[", index, "] has ", t.numel(), " elements but the parameter has ",
                param.numel());
}

// The low-precision copy for tensor t (undefined when there is none), checked against its master param.
inline at::Tensor low_precision_at(const std::vector<at::Tensor>& low_precision, size_t t, const at::Tensor& param) {
    TORCH_CHECK(low_precision.empty() || t < low_precision.size(), "expected one low-precision copy per param");
    at::Tensor lp = low_precision.empty() ? at::Tensor() : low_precision[t];
    if (lp.defined() && lp.numel() > 0) {
        check_operand(lp, param, "low_precision", t);
        TORCH_CHECK(param.scalar_type() == at::kFloat, "a low-precision copy needs float32 (master) params");
    }
    return lp;
}

inline void check_lists(size_t n, std::initializer_list<std::pair<const char*, size_t>> sizes) {
    for (const auto& s : sizes) TORCH_CHECK(s.second == n, "expected ", n, " ", s.first, ", got ", s.second);
}

// Store a value to the low-precision copy, or do nothing for NoLowPrecision.
template <class V, class L>
inline void store_low_precision(const V& value, L* lp, int64_t i) {
    if constexpr (!std::is_same_v<L, NoLowPrecision>) value.store(lp + i);
}

template <class T>
inline T* data_of(const at::Tensor& t) {
    if constexpr (std::is_same_v<T, NoLowPrecision>) {
        return nullptr;
    } else {
        return reinterpret_cast<T*>(t.data_ptr());
    }
}

}  // namespace dsrun
