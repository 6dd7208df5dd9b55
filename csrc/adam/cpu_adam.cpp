// CPU Adam / AdamW: one pass over param, grad, exp_avg and exp_avg_sq per step.
//
// The math follows torch.optim.Adam/AdamW so results agree to rounding:
//   adamw: p *= 1 - lr * wd            adam (L2): g += wd * p
//   m = m + (g - m) * (1 - beta1)      v = v * beta2 + g * g * (1 - beta2)
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// Parameters may be fp32 (optionally with a bf16/fp16 copy written in the same pass) or bf16/fp16 updated
// directly; states are fp32 or bf16; all arithmetic is fp32.
#include "dsrun_optim.h"

#include <cmath>

namespace dsrun {

struct AdamScalars {
    float lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt;
    bool adamw;
};

template <class P, class G, class S, class L>
struct AdamKernel {
    P* param;
    const G* grad;
    S* exp_avg;
    S* exp_avg_sq;
    L* low_precision;
    AdamScalars c;

    template <class V>
    inline void at(int64_t i) const {
        V g = V::load(grad + i);
        V p = V::load(param + i);
        if (c.weight_decay != 0.f) {
            if (c.adamw) p = p * V::set1(c.decay);
            else g = V::fma(p, V::set1(c.weight_decay), g);  // fused like torch's add(alpha=)
        }
        V m = V::load(exp_avg + i);
        V v = V::load(exp_avg_sq + i);
        m = m + (g - m) * V::set1(c.one_minus_beta1);
        v = v * V::set1(c.beta2) + (g * g) * V::set1(c.one_minus_beta2);
        V denom = V::sqrt(v) * V::set1(c.inv_bc2_sqrt) + V::set1(c.eps);
        p = p - V::set1(c.step_size) * (m / denom);
        p.store(param + i);
        m.store(exp_avg + i);
        v.store(exp_avg_sq + i);
        store_low_precision(p, low_precision, i);
    }
};

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& low_precision, const std::vector<int64_t>& steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool bias_correction, bool adamw_mode) {
    const size_t n = params.size();
    check_lists(n, {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()},
                    {"steps", steps.size()}});
    TORCH_CHECK(low_precision.empty() || low_precision.size() == n, "expected 0 or ", n, " low-precision copies");
    for (size_t t = 0; t < n; ++t) {
        const at::Tensor& p = params[t];
        check_operand(p, p, "params", t);
        check_operand(grads[t], p, "grads", t);
        check_operand(exp_avgs[t], p, "exp_avgs", t);
        check_operand(exp_avg_sqs[t], p, "exp_avg_sqs", t);
        TORCH_CHECK(exp_avgs[t].scalar_type() == exp_avg_sqs[t].scalar_type(), "exp_avg and exp_avg_sq dtypes differ");
        const at::Tensor lp = low_precision_at(low_precision, t, p);
        TORCH_CHECK(steps[t] >= 1, "step counts start at 1");

        AdamScalars c{};
        const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(steps[t])) : 1.0;
        const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(steps[t])) : 1.0;
        c.lr = static_cast<float>(lr);
        c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
        c.beta2 = static_cast<float>(beta2);
        c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
        c.eps = static_cast<float>(eps);
        c.weight_decay = static_cast<float>(weight_decay);
        c.decay = static_cast<float>(1.0 - lr * weight_decay);
        c.step_size = static_cast<float>(lr / bc1);
        c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
        c.adamw = adamw_mode;

        dispatch_types(p, grads[t], exp_avgs[t], lp, [&](auto p_tag, auto g_tag, auto s_tag, auto l_tag) {
            using P = decltype(p_tag);
            using G = decltype(g_tag);
            using S = decltype(s_tag);
            using L = decltype(l_tag);
            AdamKernel<P, G, S, L> kernel{data_of<P>(p), data_of<G>(grads[t]), data_of<S>(exp_avgs[t]),
                                          data_of<S>(exp_avg_sqs[t]), data_of<L>(lp), c};
            run_kernel(kernel, p.numel());
        });
    }
}

}  // namespace dsrun

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dsrun CPU Adam/AdamW (SIMD " DSRUN_SIMD_LEVEL ")";
    m.def("adam_step", &dsrun::adam_step, "One Adam/AdamW step over a list of tensors", py::arg("params"),
          py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("low_precision"), py::arg("steps"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("bias_correction"), py::arg("adamw_mode"),
          py::call_guard<py::gil_scoped_release>());  // offload overlaps transfers with the step
    m.def("simd_level", [] { return std::string(DSRUN_SIMD_LEVEL); });
}
