// Gathered matmuls of a mixture-of-experts layer over rows sorted by expert (mlxrl.models.moe), as MLX primitives.
// Included by bindings.cpp (the one translation unit); it uses common.h's helpers.
//
// y[m] = x[m] @ w[e(m)]^T for x [M, in], w [E, out, in] and e [M] uint32, non-decreasing. MLX's CPU gather_mm runs
// one [1, in] x [in, out] product per row; here the rows of each expert are one contiguous segment, so each expert
// is one BLAS GEMM over its rows (the layer's work as E GEMMs instead of M GEMVs). The VJP:
//   dx[m] = dy[m] @ w[e(m)]            (one GEMM per segment, ExpertMatmulT)
//   dw[e] = dy[seg e]^T @ x[seg e]     (one GEMM per expert with rows; zero for the others, ExpertMatmulW)
// w may be bfloat16 (a frozen stack kept in the checkpoint's dtype under float32 compute: mlxrl.models.widened):
// the forward and dx then widen one expert's [out, in] matrix at a time into a scratch, only for the experts
// that have rows, so no float32 copy of the stack exists (widening is exact: the products are the float32
// stack's, bit for bit).

#include "common.h"

namespace {

// seg[e] .. seg[e + 1]: the rows of expert e; experts out of order or out of range are an error.
std::vector<int64_t> expert_segments(const uint32_t* experts, int64_t rows, int64_t n_experts) {
  std::vector<int64_t> seg(n_experts + 1, 0);
  for (int64_t m = 0; m < rows; ++m) {
    if (experts[m] >= uint64_t(n_experts)) throw std::invalid_argument("expert_matmul: an expert index >= E.");
    if (m > 0 && experts[m] < experts[m - 1])
      throw std::invalid_argument("expert_matmul: the rows must be sorted by expert.");
    ++seg[experts[m] + 1];
  }
  for (int64_t e = 0; e < n_experts; ++e) seg[e + 1] += seg[e];
  return seg;
}

// Expert k's [out, in] matrix of a float32 or bfloat16 stack as float32: the stack's own rows, or (bfloat16) its
// rows widened into one reused scratch. Made inside a kernel's dispatch (the scratch is freed with it).
class ExpertMatrices {
 public:
  ExpertMatrices(const float* wf, const uint16_t* wb, size_t size) : wf_(wf), wb_(wb), size_(size) {}
  const float* operator()(int64_t k) {
    if (wf_ != nullptr) return wf_ + size_t(k) * size_;
    if (wide_ == nullptr) wide_ = scratch_.take(size_);
    widen_rows(wb_ + size_t(k) * size_, wide_, size_);
    return wide_;
  }

 private:
  const float* wf_;
  const uint16_t* wb_;
  size_t size_;
  Scratch scratch_;
  float* wide_ = nullptr;
};

const float* float_data(const mx::array& w) { return w.dtype() == mx::bfloat16 ? nullptr : w.data<float>(); }
const uint16_t* bf16_data(const mx::array& w) {
  return w.dtype() == mx::bfloat16 ? reinterpret_cast<const uint16_t*>(w.data<mx::bfloat16_t>()) : nullptr;
}

mx::array expert_matmul_t_op(const mx::array& dy, const mx::array& w, const mx::array& experts, mx::Stream s);
mx::array expert_matmul_w_op(const mx::array& dy, const mx::array& x, const mx::array& experts, int n_experts,
                             mx::Stream s);

// inputs x [M, in], w [E, out, in], experts [M] uint32; output [M, out].
class ExpertMatmul : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlExpertMatmul"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape{inputs[0].shape(0), inputs[1].shape(1)}};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t M = inputs[0].shape(0), in = inputs[0].shape(1), E = inputs[1].shape(0), out = inputs[1].shape(1);
    encode_outputs(stream(), inputs, outputs).dispatch([=, x = inputs[0].data<float>(), wf = float_data(inputs[1]),
        wb = bf16_data(inputs[1]), e = inputs[2].data<uint32_t>(), y = outputs[0].data<float>()]() {
      const auto seg = expert_segments(e, M, E);
      ExpertMatrices w(wf, wb, size_t(out) * in);
      for (int64_t k = 0; k < E; ++k) {
        const int64_t m0 = seg[k], rows = seg[k + 1] - m0;
        if (rows > 0)
          cblas_sgemm(101, 111, 112, int(rows), int(out), int(in), 1.0f, x + m0 * in, int(in), w(k), int(in), 0.0f,
                      y + m0 * out, int(out));
      }
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    auto dy = dense_cotangent(cotangents[0], mx::zeros({primals[0].shape(0), primals[1].shape(1)}, mx::float32, s),
                              s);
    std::vector<mx::array> grads;
    for (int a : argnums) {
      if (a == 0) grads.push_back(expert_matmul_t_op(dy, primals[1], primals[2], s));
      else if (a == 1)  // (a bfloat16 stack is frozen: its gradient is not asked for in training)
        grads.push_back(mx::astype(expert_matmul_w_op(dy, primals[0], primals[2], int(primals[1].shape(0)), s),
                                   primals[1].dtype(), s));
      else grads.push_back(mx::zeros_like(primals[a], s));
    }
    return grads;
  }
};

// inputs dy [M, out], w [E, out, in], experts [M]; output dx [M, in].
class ExpertMatmulT : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlExpertMatmulT"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape{inputs[0].shape(0), inputs[1].shape(2)}};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t M = inputs[0].shape(0), E = inputs[1].shape(0), out = inputs[1].shape(1), in = inputs[1].shape(2);
    encode_outputs(stream(), inputs, outputs).dispatch([=, dy = inputs[0].data<float>(), wf = float_data(inputs[1]),
        wb = bf16_data(inputs[1]), e = inputs[2].data<uint32_t>(), dx = outputs[0].data<float>()]() {
      const auto seg = expert_segments(e, M, E);
      ExpertMatrices w(wf, wb, size_t(out) * in);
      for (int64_t k = 0; k < E; ++k) {
        const int64_t m0 = seg[k], rows = seg[k + 1] - m0;
        if (rows > 0)
          cblas_sgemm(101, 111, 111, int(rows), int(in), int(out), 1.0f, dy + m0 * out, int(out), w(k), int(in),
                      0.0f, dx + m0 * in, int(in));
      }
    });
  }
};

// inputs dy [M, out], x [M, in], experts [M]; output dw [E, out, in] (E: the primitive's).
class ExpertMatmulW : public CpuPrimitive {
 public:
  ExpertMatmulW(mx::Stream s, int n_experts) : CpuPrimitive(s), n_experts_(n_experts) {}
  const char* name() const override { return "MlxrlExpertMatmulW"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const ExpertMatmulW&>(other).n_experts_ == n_experts_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape{n_experts_, inputs[0].shape(1), inputs[1].shape(1)}};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t M = inputs[0].shape(0), out = inputs[0].shape(1), in = inputs[1].shape(1), E = n_experts_;
    encode_outputs(stream(), inputs, outputs).dispatch([=, dy = inputs[0].data<float>(), x = inputs[1].data<float>(),
        e = inputs[2].data<uint32_t>(), dw = outputs[0].data<float>()]() {
      const auto seg = expert_segments(e, M, E);
      for (int64_t k = 0; k < E; ++k) {
        const int64_t m0 = seg[k], rows = seg[k + 1] - m0;
        float* dst = dw + k * out * in;
        if (rows > 0)
          cblas_sgemm(101, 112, 111, int(out), int(in), int(rows), 1.0f, dy + m0 * out, int(out), x + m0 * in,
                      int(in), 0.0f, dst, int(in));
        else
          std::memset(dst, 0, sizeof(float) * out * in);  // an expert no row reached: no gradient
      }
    });
  }

 private:
  int n_experts_;
};

mx::array expert_indices(const mx::array& experts, int64_t rows, mx::Stream s) {
  if (experts.ndim() != 1 || experts.shape(0) != rows)
    throw std::invalid_argument("expert_matmul: experts [M] (one per row of x) expected.");
  return dense(mx::astype(experts, mx::uint32, s), s);
}

mx::array expert_matmul_op(const mx::array& x, const mx::array& w, const mx::array& experts) {
  auto s = cpu_stream({&x});
  if (x.ndim() != 2 || w.ndim() != 3 || x.shape(1) != w.shape(2))
    throw std::invalid_argument("expert_matmul: x [M, in] and w [E, out, in] expected.");
  if (w.dtype() != mx::float32 && w.dtype() != mx::bfloat16)
    throw std::invalid_argument("expert_matmul: w must be float32 or bfloat16 (a kept frozen stack).");
  std::vector<mx::array> in{dense(x, s), dense(w, s), expert_indices(experts, x.shape(0), s)};
  auto prim = std::make_shared<ExpertMatmul>(s);
  return mx::array(prim->output_shapes(in)[0], mx::float32, prim, in);
}

mx::array expert_matmul_t_op(const mx::array& dy, const mx::array& w, const mx::array& experts, mx::Stream s) {
  std::vector<mx::array> in{dense(dy, s), dense(w, s), expert_indices(experts, dy.shape(0), s)};
  auto prim = std::make_shared<ExpertMatmulT>(s);
  return mx::array(prim->output_shapes(in)[0], mx::float32, prim, in);
}

mx::array expert_matmul_w_op(const mx::array& dy, const mx::array& x, const mx::array& experts, int n_experts,
                             mx::Stream s) {
  std::vector<mx::array> in{dense(dy, s), dense(x, s), expert_indices(experts, dy.shape(0), s)};
  auto prim = std::make_shared<ExpertMatmulW>(s, n_experts);
  return mx::array(prim->output_shapes(in)[0], mx::float32, prim, in);
}

}  // namespace
