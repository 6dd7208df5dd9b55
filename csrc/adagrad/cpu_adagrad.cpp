// CPU Adagrad, following torch.optim.Adagrad (lr_decay = 0, initial accumulator 0):
//   g += wd * p;  sum += g * g;  p -= lr * g / (sqrt(sum) + eps)
// Same parameter/state dtype rules as cpu_adam.cpp.
#include "dsrun_optim.h"

namespace dsrun {

template <class P, class G, class S, class L>
struct AdagradKernel {
    P* param;
    const G* grad;
    S* sum;
    L* low_precision;
    float lr, eps, weight_decay;

    template <class V>
    inline void at(int64_t i) const {
        V g = V::load(grad + i);
        V p = V::load(param + i);
        // fma, as torch's add(alpha=) does: g + wd * p can cancel exactly, and a twice-rounded sum would differ
        if (weight_decay != 0.f) g = V::fma(p, V::set1(weight_decay), g);
        V s = V::load(sum + i);
        s = s + g * g;
        p = p - V::set1(lr) * (g / (V::sqrt(s) + V::set1(eps)));
        p.store(param + i);
        s.store(sum + i);
        store_low_precision(p, low_precision, i);
    }
};

void adagrad_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& low_precision, double lr,
                  double eps, double weight_decay) {
    const size_t n = params.size();
    check_lists(n, {{"grads", grads.size()}, {"sums", sums.size()}});
    TORCH_CHECK(low_precision.empty() || low_precision.size() == n, "expected 0 or ", n, " low-precision copies");
    for (size_t t = 0; t < n; ++t) {
        const at::Tensor& p = params[t];
        check_operand(p, p, "params", t);
        check_operand(grads[t], p, "grads", t);
        check_operand(sums[t], p, "sums", t);
        const at::Tensor lp = low_precision_at(low_precision, t, p);
        dispatch_types(p, grads[t], sums[t], lp, [&](auto p_tag, auto g_tag, auto s_tag, auto l_tag) {
            using P = decltype(p_tag);
            using G = decltype(g_tag);
            using S = decltype(s_tag);
            using L = decltype(l_tag);
            AdagradKernel<P, G, S, L> kernel{data_of<P>(p), data_of<G>(grads[t]), data_of<S>(sums[t]), data_of<L>(lp),
                                             static_cast<float>(lr), static_cast<float>(eps),
                                             static_cast<float>(weight_decay)};
            run_kernel(kernel, p.numel());
        });
    }
}

}  // namespace dsrun

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dsrun CPU Adagrad (SIMD " DSRUN_SIMD_LEVEL ")";
    m.def("adagrad_step", &dsrun::adagrad_step, "One Adagrad step over a list of tensors", py::arg("params"),
          py::arg("grads"), py::arg("sums"), py::arg("low_precision"), py::arg("lr"), py::arg("eps"),
          py::arg("weight_decay"),
          py::call_guard<py::gil_scoped_release>());  // offload overlaps transfers with the step
    m.def("simd_level", [] { return std::string(DSRUN_SIMD_LEVEL); });
}
