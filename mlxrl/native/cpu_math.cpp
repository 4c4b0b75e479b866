// mlxrl's CPU kernels: exp, sigmoid, softmax over the last axis, sum of squares and the AdamW step,
// as MLX primitives.
//
// Why: MLX's Linux CPU wheel is built for baseline x86-64, so its exp / sigmoid / softmax are scalar
// loops whose fma calls go through libm (~0.05 G elements/s, against ~1.3 for a multiply). These
// kernels are compiled on the user's machine by mlxrl.native (g++ -O3 -march=native, like MLX's
// own CPU JIT), so the loops vectorise, and large arrays are split over the cores.
//
// The exp is the Cephes algorithm MLX itself uses (2^t = 2^n * 2^f, n = round(t), a degree-6
// polynomial for 2^f on [-0.5, 0.5], 2^n from the exponent bits), written branch-free. Outside
// [-87.3, 88.72] it gives what IEEE exp gives: 0 below (exactly 0 from -88.03 down), +inf above,
// NaN stays NaN. Inputs must be float32 (the Python side falls back to MLX's ops otherwise).
//
// Each elementwise primitive has a VJP and a JVP built from MLX ops on its output, so they train under
// mx.grad and mx.compile like MLX's own ops.

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// ---------------------------------------------------------------------------------------- math

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: t + kMagic rounds t to an integer in the low bits
constexpr int32_t kMagicBits = 0x4B400000;
constexpr float kLow = -88.02969193111305f;  // -127 / log2(e): 2^-127 has exponent bits 0, i.e. 0.0
constexpr float kHigh = 88.0f;
constexpr float kOverflow = 88.72283905206835f;  // log(FLT_MAX): above, exp is +inf

inline float bits_to_float(int32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline int32_t float_to_bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float fast_exp(float x) {
  float t = std::min(std::max(x, kLow), kHigh) * kLog2e;
  float r = t + kMagic;
  float f = t - (r - kMagic);
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  float scale = bits_to_float((float_to_bits(r) - (kMagicBits - 127)) << 23);
  float y = p * scale;
  y = x > kOverflow ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;  // NaN in, NaN out (std::max above would have dropped it)
}

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
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (size_t i = 0; i < cols; ++i) m = std::max(m, x[i]);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < cols; ++i) {
      float e = fast_exp(x[i] - m);
      y[i] = e;
      s += e;
    }
    float inv = 1.0f / s;
#pragma omp simd
    for (size_t i = 0; i < cols; ++i) y[i] *= inv;
  }
}

// ----------------------------------------------------------------------------------- threading

int worker_count() {
  static const int count = [] {
    if (const char* env = std::getenv("MLXRL_CPU_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return count;
}

// Runs fn(part, begin, end) over [0, n) in contiguous parts (part < worker_count()), one per
// worker, each at least `grain` long.
template <class F>
void parallel_for(size_t n, size_t grain, F fn) {
  size_t parts = std::min<size_t>(worker_count(), std::max<size_t>(1, n / grain));
  if (parts <= 1) {
    fn(size_t(0), size_t(0), n);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(parts - 1);
  size_t step = (n + parts - 1) / parts;
  for (size_t p = 1; p < parts; ++p) {
    size_t b = p * step, e = std::min(n, b + step);
    if (b < e) threads.emplace_back([=] { fn(p, b, e); });
  }
  fn(size_t(0), size_t(0), std::min(n, step));
  for (auto& t : threads) t.join();
}

constexpr size_t kGrain = 1 << 16;  // elements per worker below which threads cost more than they give

// ---------------------------------------------------------------------------------- primitives

// The output takes the input's buffer when MLX says it may (the input is not used again).
void allocate_like(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.data_size() == in.size()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

using RangeFn = void (*)(const float*, float*, size_t);

void run_elementwise(mx::Stream stream, const mx::array& in, mx::array& out, RangeFn fn) {
  allocate_like(in, out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), n = in.size(), fn]() {
    parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) { fn(src + b, dst + b, e - b); });
  });
}

// What every primitive here shares: CPU only; equivalent to another of the same name (subclasses
// with parameters compare those too).
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " is a CPU kernel; use MLX's op on the GPU.");
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return std::strcmp(name(), other.name()) == 0;
  }
};

class Unary : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// The CPU stream for a kernel over `arrays`: float32 only (the Python side falls back to MLX's ops
// otherwise).
mx::Stream cpu_stream(std::initializer_list<const mx::array*> arrays, mx::StreamOrDevice s = {}) {
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::DeviceType::cpu) throw std::invalid_argument("mlxrl CPU kernels run on the CPU.");
  for (auto* a : arrays)
    if (a->dtype() != mx::float32) throw std::invalid_argument("mlxrl CPU kernels take float32 arrays.");
  return stream;
}

mx::array fast_exp_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_sigmoid_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_softmax_op(const mx::array& x, mx::StreamOrDevice s = {});

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

class FastSoftmax : public Unary {
 public:
  using Unary::Unary;
  const char* name() const override { return "MlxrlSoftmax"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    allocate_like(in, out);
    size_t cols = in.shape().back();
    size_t rows = cols == 0 ? 0 : in.size() / cols;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), rows, cols]() {
      size_t grain_rows = std::max<size_t>(1, kGrain / std::max<size_t>(1, cols));
      parallel_for(rows, grain_rows, [=](size_t, size_t b, size_t e) {
        softmax_rows(src + b * cols, dst + b * cols, e - b, cols);
      });
    });
  }
  // d softmax: y * (g - sum(g * y, -1))
  static mx::array pullback(const mx::array& y, const mx::array& g, mx::Stream s) {
    auto gy = mx::sum(mx::multiply(g, y, s), -1, true, s);
    return mx::multiply(y, mx::subtract(g, gy, s), s);
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>& outputs) override {
    return {pullback(outputs[0], cotangents[0], stream())};
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {pullback(fast_softmax_op(primals[0], stream()), tangents[0], stream())};
  }
};

// sum(x^2) of a float32 array as a float32 scalar (the gradient norm's square), accumulated in
// double: per worker a vectorised partial sum, then the partials in order (deterministic for a
// given thread count).
class SumSquares : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlSumSquares"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {mx::Shape{}}; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([x = inputs[0].data<float>(), dst = out.data<float>(), n = inputs[0].size()]() {
      std::vector<double> partial(worker_count(), 0.0);
      parallel_for(n, kGrain, [&](size_t part, size_t b, size_t e) {
        double acc = 0.0;
#pragma omp simd reduction(+ : acc)
        for (size_t i = b; i < e; ++i) acc += double(x[i]) * double(x[i]);
        partial[part] = acc;
      });
      double total = 0.0;
      for (double v : partial) total += v;
      *dst = static_cast<float>(total);
    });
  }
};

mx::array sum_squares_op(const mx::array& x) {
  auto stream = cpu_stream({&x});
  return mx::array(mx::Shape{}, mx::float32, std::make_shared<SumSquares>(stream), {mx::contiguous(x, false, stream)});
}

// One parameter's AdamW step, torch.optim.AdamW's arithmetic (as the engine's compiled kernel):
//   g *= scale;  w *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   w -= lr c1 m / (sqrt(v) c2 + eps)      with c1 = 1 / (1 - b1^t), c2 = 1 / sqrt(1 - b2^t)
// in one pass over w, g, m, v; the new w, m, v take the old ones' buffers when MLX allows it.
class AdamWStep : public CpuPrimitive {
 public:
  AdamWStep(mx::Stream s, float wd, float b1, float b2, float eps)
      : CpuPrimitive(s), wd_(wd), b1_(b1), b2_(b2), eps_(eps) {}
  const char* name() const override { return "MlxrlAdamW"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    auto& o = static_cast<const AdamWStep&>(other);
    return wd_ == o.wd_ && b1_ == o.b1_ && b2_ == o.b2_ && eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape(), inputs[1].shape(), inputs[1].shape()};
  }
  // inputs: g, w, m, v, hyper = [scale, lr, c1, c2]; outputs: w, m, v
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (int i = 0; i < 3; ++i) allocate_like(inputs[i + 1], outputs[i]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    for (auto& a : outputs) encoder.set_output_array(a);
    encoder.dispatch([g = inputs[0].data<float>(), w = inputs[1].data<float>(), m = inputs[2].data<float>(),
                      v = inputs[3].data<float>(), hyper = inputs[4].data<float>(), wo = outputs[0].data<float>(),
                      mo = outputs[1].data<float>(), vo = outputs[2].data<float>(), n = inputs[1].size(),
                      wd = wd_, b1 = b1_, b2 = b2_, eps = eps_]() {
      const float scale = hyper[0], lr = hyper[1], c1 = hyper[2], c2 = hyper[3];
      const float decay = 1.0f - lr * wd, step = lr * c1;
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
        for (size_t i = b; i < e; ++i) {
          float gi = g[i] * scale;
          float mi = b1 * m[i] + (1.0f - b1) * gi;
          float vi = b2 * v[i] + (1.0f - b2) * (gi * gi);
          wo[i] = w[i] * decay - step * mi / (std::sqrt(vi) * c2 + eps);
          mo[i] = mi;
          vo[i] = vi;
        }
      });
    });
  }

 private:
  float wd_, b1_, b2_, eps_;
};

std::vector<mx::array> adamw_step_op(const mx::array& g, const mx::array& w, const mx::array& m,
                                     const mx::array& v, const mx::array& hyper, float wd, float b1, float b2,
                                     float eps) {
  auto stream = cpu_stream({&g, &w, &m, &v, &hyper});
  if (g.shape() != w.shape() || m.shape() != w.shape() || v.shape() != w.shape() || hyper.size() != 4)
    throw std::invalid_argument("adamw_step: g, w, m, v must share a shape and hyper hold 4 values.");
  auto dense = [&](const mx::array& a) { return mx::contiguous(a, false, stream); };
  return mx::array::make_arrays({w.shape(), w.shape(), w.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<AdamWStep>(stream, wd, b1, b2, eps),
                                {dense(g), dense(w), dense(m), dense(v), dense(hyper)});
}

template <class P>
mx::array make_unary(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x}, s);
  auto dense = mx::contiguous(x, false, stream);
  return mx::array(dense.shape(), mx::float32, std::make_shared<P>(stream), {dense});
}

mx::array fast_exp_op(const mx::array& x, mx::StreamOrDevice s) { return make_unary<FastExp>(x, s); }
mx::array fast_sigmoid_op(const mx::array& x, mx::StreamOrDevice s) { return make_unary<FastSigmoid>(x, s); }
mx::array fast_softmax_op(const mx::array& x, mx::StreamOrDevice s) {
  if (x.ndim() == 0) throw std::invalid_argument("softmax needs at least one axis.");
  return make_unary<FastSoftmax>(x, s);
}

}  // namespace

NB_MODULE(_cpu_math, m) {
  m.doc() = "mlxrl's vectorised, multi-threaded CPU kernels (float32): exp, sigmoid, softmax (last axis), "
            "sum of squares, the AdamW step.";
  m.def("exp", [](const mx::array& x) { return fast_exp_op(x); }, nb::arg("x"));
  m.def("sigmoid", [](const mx::array& x) { return fast_sigmoid_op(x); }, nb::arg("x"));
  m.def("softmax", [](const mx::array& x) { return fast_softmax_op(x); }, nb::arg("x"));
  m.def("adamw_step", &adamw_step_op, nb::arg("g"), nb::arg("w"), nb::arg("m"), nb::arg("v"), nb::arg("hyper"),
        nb::arg("weight_decay"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        "One AdamW step (torch's arithmetic); hyper = [grad scale, lr, 1/(1-b1^t), 1/sqrt(1-b2^t)]. "
        "Returns (w, m, v).");
  m.def("sum_squares", &sum_squares_op, nb::arg("x"), "sum(x^2) as a float32 scalar (accumulated in double).");
  m.def("threads", &worker_count);
}
