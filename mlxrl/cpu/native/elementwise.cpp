// exp, sigmoid and softmax over the last axis as MLX primitives (float32, vectorised, large arrays split over the
// cores), and the softmax's VJP as one of its own: y (g - sum(g y)) in one pass per row.
//
// Each elementwise primitive has a VJP and a JVP built from MLX ops on its output, so they train under
// mx.grad and mx.compile like MLX's own ops.

#include "common.h"

namespace {

void exp_range(const float* in, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) out[i] = fast_exp(in[i]);
}

void sigmoid_range(const float* in, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) out[i] = 1.0f / (1.0f + fast_exp(-in[i]));
}

// Softmax of `rows` rows of `cols`: max, exp(x - max) summed, scaled by 1 / sum (as mx.softmax:
// a row of all -inf gives NaN).
void softmax_rows(const float* in, float* out, size_t rows, size_t cols) {
  for (size_t r = 0; r < rows; ++r) {
    const float* x = in + r * cols;
    float* y = out + r * cols;
    const float m = row_max(x, cols);
    const float inv = 1.0f / exp_shift_sum(x, y, cols, m);
#pragma omp simd
    for (size_t i = 0; i < cols; ++i) y[i] *= inv;
  }
}

// The softmax's VJP per row: dx = y (g - sum(g y)).
void softmax_grad_rows(const float* y, const float* g, float* out, size_t rows, size_t cols) {
  for (size_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* gr = g + r * cols;
    float* o = out + r * cols;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (size_t i = 0; i < cols; ++i) dot += gr[i] * yr[i];
#pragma omp simd
    for (size_t i = 0; i < cols; ++i) o[i] = yr[i] * (gr[i] - dot);
  }
}

mx::array fast_exp_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_sigmoid_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_softmax_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array softmax_grad_op(const mx::array& y, const mx::array& g, mx::StreamOrDevice s = {});

class FastExp : public Unary {
 public:
  using Unary::Unary;
  const char* name() const override { return "MlxrlExp"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_elementwise(stream(), inputs[0], outputs[0], exp_range);
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>& outputs) override {
    return {mx::multiply(cotangents[0], outputs[0], stream())};
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {mx::multiply(tangents[0], fast_exp_op(primals[0], stream()), stream())};
  }
};

class FastSigmoid : public Unary {
 public:
  using Unary::Unary;
  const char* name() const override { return "MlxrlSigmoid"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_elementwise(stream(), inputs[0], outputs[0], sigmoid_range);
  }
  static mx::array slope(const mx::array& y, mx::Stream s) {  // sigmoid' = y (1 - y)
    return mx::multiply(y, mx::subtract(mx::array(1.0f), y, s), s);
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>& outputs) override {
    return {mx::multiply(cotangents[0], slope(outputs[0], stream()), stream())};
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {mx::multiply(tangents[0], slope(fast_sigmoid_op(primals[0], stream()), stream()), stream())};
  }
};

// Rows and columns of x [..., cols].
struct RowShape {
  size_t rows, cols;
};
RowShape row_shape(const mx::array& x) {
  size_t cols = x.shape().back();
  return {cols == 0 ? 0 : x.size() / cols, cols};
}

class FastSoftmax : public Unary {
 public:
  explicit FastSoftmax(mx::Stream s) : Unary(s) {}
  const char* name() const override { return "MlxrlSoftmax"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    allocate_like(stream(), in, out);
    auto [rows, cols] = row_shape(in);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), rows, cols]() {
      over_rows(rows, cols, [=](size_t b, size_t n) { softmax_rows(src + b * cols, dst + b * cols, n, cols); });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>& outputs) override {
    return {softmax_grad_op(outputs[0], cotangents[0], stream())};
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {softmax_grad_op(fast_softmax_op(primals[0], stream()), tangents[0], stream())};
  }
};

// y (g - sum(g y, -1)): the softmax's VJP (and JVP) in one pass per row; y, g [..., L, S].
class SoftmaxGrad : public CpuPrimitive {
 public:
  explicit SoftmaxGrad(mx::Stream s) : CpuPrimitive(s) {}
  const char* name() const override { return "MlxrlSoftmaxGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& y = inputs[0];
    const auto& g = inputs[1];
    auto& out = outputs[0];
    allocate_like_either(stream(), g, y, out);
    auto [rows, cols] = row_shape(y);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(y);
    encoder.set_input_array(g);
    encoder.set_output_array(out);
    encoder.dispatch([yp = y.data<float>(), gp = g.data<float>(), dst = out.data<float>(), rows, cols]() {
      over_rows(rows, cols, [=](size_t b, size_t n) {
        softmax_grad_rows(yp + b * cols, gp + b * cols, dst + b * cols, n, cols);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    // linear in g: d/dg = y (c - sum(c y)); d/dy (not needed for first-order training) through MLX ops
    std::vector<mx::array> out;
    const auto& y = primals[0];
    const auto& g = primals[1];
    const auto& c = cotangents[0];
    auto s = stream();
    for (int a : argnums) {
      if (a == 1) {
        out.push_back(softmax_grad_op(y, c, s));
      } else {  // d/dy of y (g - sum(g y)) . c = c (g - sum(g y)) - g sum(c y)
        auto gy = mx::sum(mx::multiply(g, y, s), -1, true, s);
        auto cy = mx::sum(mx::multiply(c, y, s), -1, true, s);
        out.push_back(mx::subtract(mx::multiply(c, mx::subtract(g, gy, s), s), mx::multiply(g, cy, s), s));
      }
    }
    return out;
  }
};

mx::array fast_exp_op(const mx::array& x, mx::StreamOrDevice s) { return make_unary<FastExp>(x, s); }
mx::array fast_sigmoid_op(const mx::array& x, mx::StreamOrDevice s) { return make_unary<FastSigmoid>(x, s); }
mx::array fast_softmax_op(const mx::array& x, mx::StreamOrDevice s) {
  if (x.ndim() == 0) throw std::invalid_argument("softmax needs at least one axis.");
  auto stream = cpu_stream({&x}, s);
  auto in = dense(x, stream);
  return mx::array(in.shape(), mx::float32, std::make_shared<FastSoftmax>(stream), {in});
}

mx::array softmax_grad_op(const mx::array& y, const mx::array& g, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&y, &g}, s);
  return mx::array(y.shape(), mx::float32, std::make_shared<SoftmaxGrad>(stream),
                   {dense(y, stream), dense_cotangent(g, y, stream)});
}

}  // namespace
