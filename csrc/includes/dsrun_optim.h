// dsrun_optim.h: what the three CPU optimizers share: dtype dispatch, argument checks, the parallel
// element loop and huge-page state allocation.
//
// A kernel is a struct with `template <class V> void at(int64_t i) const` that updates elements
// [i, i + V::WIDTH). A step collects one kernel per tensor in a `StepWork` (all argument checks happen
// while collecting, so a bad tensor raises before anything is updated) and `StepWork::run` updates every
// tensor in ONE OpenMP parallel region: the concatenated elements of all tensors are split into one
// contiguous range per thread, each cut moved up to a multiple of kCutAlign elements of its tensor (4 KiB
// of fp32: a page; two threads never write the same cache line of any output, 16-bit ones included).
// Within a range, the body runs four vectors per iteration (more loads in flight), then single vectors,
// then a ScalarF tail, so any length is handled.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <sys/mman.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include "dsrun_simd.h"

namespace dsrun {

// Tag for "no low-precision copy to write".
struct NoLowPrecision {};

// Below this many elements (all tensors of a step together) a parallel region costs more than it saves.
constexpr int64_t kParallelThreshold = 1 << 15;
// Thread ranges start at a multiple of this many elements of their tensor.
constexpr int64_t kCutAlign = 1024;

// Elements per iteration of the unrolled body: four vectors.
constexpr int64_t kBlock = 4 * VecF::WIDTH;
// Software prefetch distance: 2 KiB ahead in every array the kernel streams through. The hardware
// prefetchers alone keep too few lines in flight. Measured on the shared 2-core development VM (100M
// parameters, 15 steps interleaved with torch's fused AdamW, load average ~16; speed-up over fused): fp32
// Adam 1.11x without prefetch, 1.13x at 1 KiB, 1.20x at 2 KiB, 1.15x at 4 KiB, 1.13x at 8 KiB; bf16
// params+states 1.73x without, 2.17x at 2 KiB, 2.15x at 4 KiB.
constexpr int64_t kPrefetchBytes = 2048;

// Prefetch the lines of array `p` that the block starting at element i will cover kPrefetchBytes later
// (SIMD builds only). Prefetches are hints that never fault, so running past the end of the array is harmless.
// Written as inline asm: GCC 12 dropped __builtin_prefetch from these kernels (objdump found no prefetch
// instruction in the built op, though a standalone copy of this code kept them; cause not found).
template <class T>
inline void prefetch_block(const T* p, int64_t i) {
#if defined(DSRUN_SIMD_AVX512) || defined(DSRUN_SIMD_AVX2)
    if constexpr (!std::is_same_v<T, NoLowPrecision>) {
        const char* a = reinterpret_cast<const char*>(p + i) + kPrefetchBytes;
        for (size_t off = 0; off < kBlock * sizeof(T); off += 64) asm volatile("prefetcht0 %0" : : "m"(a[off]));
    }
#else
    (void)p;
    (void)i;
#endif
}

// Update elements [begin, end) of one tensor.
template <class K>
void run_range(const K& shared_kernel, int64_t begin, int64_t end) {
    // A local copy: the stores through the kernel's data pointers cannot alias it, so the compiler keeps its
    // scalars (and their broadcasts) in registers instead of re-reading them after every store.
    const K kernel = shared_kernel;
    constexpr int64_t W = VecF::WIDTH;
    int64_t i = begin;
    for (; i + kBlock <= end; i += kBlock) {
        kernel.prefetch(i);
        kernel.template at<VecF>(i);
        kernel.template at<VecF>(i + W);
        kernel.template at<VecF>(i + 2 * W);
        kernel.template at<VecF>(i + 3 * W);
    }
    for (; i + W <= end; i += W) kernel.template at<VecF>(i);
    for (; i < end; ++i) kernel.template at<ScalarF>(i);
}

// The tensors of one optimizer step: `add` one kernel per tensor, then `run` them all.
class StepWork {
public:
    template <class K>
    void add(const K& kernel, int64_t numel) {
        if (numel <= 0) return;
        items_.push_back({[kernel](int64_t b, int64_t e) { run_range(kernel, b, e); }, numel});
        total_ += numel;
    }

    void run() const {
        const int threads = at::get_num_threads();
#ifdef _OPENMP
        if (total_ >= kParallelThreshold && threads > 1) {
            std::vector<int64_t> offsets(items_.size() + 1, 0);
            for (size_t k = 0; k < items_.size(); ++k) offsets[k + 1] = offsets[k] + items_[k].numel;
#pragma omp parallel num_threads(threads)
            {
                const int64_t t = omp_get_thread_num();
                const int64_t team = omp_get_num_threads();
                run_span(offsets, cut(offsets, total_ * t / team), cut(offsets, total_ * (t + 1) / team));
            }
            return;
        }
#endif
        for (const Item& item : items_) item.fn(0, item.numel);
    }

private:
    struct Item {
        std::function<void(int64_t, int64_t)> fn;
        int64_t numel;
    };

    // The point x of the concatenated index space, moved up to a multiple of kCutAlign within its tensor
    // (or that tensor's end). Monotone in x, so consecutive threads get adjacent, disjoint spans.
    int64_t cut(const std::vector<int64_t>& offsets, int64_t x) const {
        if (x >= total_) return total_;
        const size_t k = std::upper_bound(offsets.begin(), offsets.end(), x) - offsets.begin() - 1;
        const int64_t local = (x - offsets[k] + kCutAlign - 1) / kCutAlign * kCutAlign;
        return offsets[k] + std::min(local, items_[k].numel);
    }

    // Update the concatenated elements [begin, end), tensor by tensor.
    void run_span(const std::vector<int64_t>& offsets, int64_t begin, int64_t end) const {
        if (begin >= end) return;
        size_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
        for (; k < items_.size() && offsets[k] < end; ++k) {
            const int64_t lo = std::max(begin, offsets[k]) - offsets[k];
            const int64_t hi = std::min(end, offsets[k + 1]) - offsets[k];
            if (lo < hi) items_[k].fn(lo, hi);
        }
    }

    std::vector<Item> items_;
    int64_t total_ = 0;
};

// A zero-filled, contiguous CPU tensor for optimizer state (moments, fp32 master copies). From 2 MiB up,
// the memory is its own 2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE: the kernels stream through
// several such arrays at once, and 2 MiB pages cut the TLB misses (and page walks) of those streams. Where
// the kernel does not grant huge pages (transparent_hugepage=never) it is ordinary memory. Smaller tensors
// use torch's allocator.
inline at::Tensor empty_state(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
    constexpr size_t kHuge = size_t{2} << 20;
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    if (nbytes < kHuge) return at::zeros(sizes, at::TensorOptions().dtype(dtype));
    const size_t length = (nbytes + kHuge - 1) / kHuge * kHuge;
    // Map one huge page more than needed and trim, so the kept part starts on a 2 MiB boundary.
    void* raw = mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "cannot allocate ", nbytes, " bytes of optimizer state (mmap failed)");
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
    if (aligned > start) munmap(raw, aligned - start);
    munmap(reinterpret_cast<void*>(aligned + length), start + kHuge - aligned);  // the tail: never empty
    void* data = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
    madvise(data, length, MADV_HUGEPAGE);  // advice only: failure leaves ordinary pages
#endif
    // Fresh anonymous memory reads as zeros; touch it now (in parallel) so the first step pays no faults.
    at::Tensor t = torch::from_blob(data, sizes, [length](void* p) { munmap(p, length); },
                                    at::TensorOptions().dtype(dtype));
    t.zero_();
    return t;
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

// Registers what every optimizer module offers besides its step function.
#define DSRUN_OPTIMIZER_COMMON_DEFS(m)                                                                         \
    m.def("simd_level", [] { return std::string(DSRUN_SIMD_LEVEL); });                                          \
    m.def("empty_state", &dsrun::empty_state,                                                                  \
          "A zero-filled tensor for optimizer state (2 MiB-aligned, MADV_HUGEPAGE from 2 MiB up)",                \
          py::arg("sizes"), py::arg("dtype"))

}  // namespace dsrun
