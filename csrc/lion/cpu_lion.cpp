// CPU Lion (Chen et al., 2023):
//   p *= 1 - lr * wd;  c = m * beta1 + g * (1 - beta1);  p -= lr * sign(c);  m = m * beta2 + g * (1 - beta2)
// Each product and sum rounds separately (-ffp-contract=off, no fma) so sign(c) agrees with a plain torch
// reference even when c is within an ulp of zero. Same parameter/state dtype rules as cpu_adam.cpp.
#include "dsrun_optim.h"

namespace dsrun {

template <class P, class G, class S, class L>
struct LionKernel {
    P* param;
    const G* grad;
    S* exp_avg;
    L* low_precision;
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
    bool decays;

    template <class V>
    inline void at(int64_t i) const {
        V g = V::load(grad + i);
        V p = V::load(param + i);
        V m = V::load(exp_avg + i);
        if (decays) p = p * V::set1(decay);
        V c = m * V::set1(beta1) + g * V::set1(one_minus_beta1);
        p = p - V::set1(lr) * V::sign(c);
        m = m * V::set1(beta2) + g * V::set1(one_minus_beta2);
        p.store(param + i);
        m.store(exp_avg + i);
        store_low_precision(p, low_precision, i);
    }
};

void lion_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& low_precision, double lr,
               double beta1, double beta2, double weight_decay) {
    const size_t n = params.size();
    check_lists(n, {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}});
    TORCH_CHECK(low_precision.empty() || low_precision.size() == n, "expected 0 or ", n, " low-precision copies");
    for (size_t t = 0; t < n; ++t) {
        const at::Tensor& p = params[t];
        check_operand(p, p, "params", t);
        check_operand(grads[t], p, "grads", t);
        check_operand(exp_avgs[t], p, "exp_avgs", t);
        const at::Tensor lp = low_precision_at(low_precision, t, p);
        dispatch_types(p, grads[t], exp_avgs[t], lp, [&](auto p_tag, auto g_tag, auto s_tag, auto l_tag) {
            using P = decltype(p_tag);
            using G = decltype(g_tag);
            using S = decltype(s_tag);
            using L = decltype(l_tag);
            LionKernel<P, G, S, L> kernel{data_of<P>(p), data_of<G>(grads[t]), data_of<S>(exp_avgs[t]), data_of<L>(lp),
                                          static_cast<float>(lr), static_cast<float>(beta1),
                                          static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                                          static_cast<float>(1.0 - beta2), static_cast<float>(1.0 - lr * weight_decay),
                                          weight_decay != 0.0};
            run_kernel(kernel, p.numel());
        });
    }
}

}  // namespace dsrun

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dsrun CPU Lion (SIMD " DSRUN_SIMD_LEVEL ")";
    m.def("lion_step", &dsrun::lion_step, "One Lion step over a list of tensors", py::arg("params"), py::arg("grads"),
          py::arg("exp_avgs"), py::arg("low_precision"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"),
          py::call_guard<py::gil_scoped_release>());  // offload overlaps transfers with the step
    m.def("simd_level", [] { return std::string(DSRUN_SIMD_LEVEL); });
}
