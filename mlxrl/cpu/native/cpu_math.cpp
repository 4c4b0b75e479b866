// mlxrl's CPU kernels: exp, sigmoid, softmax over the last axis, sum of squares, the AdamW step,
// the fused LM head (loss + gradients over row chunks, its matmuls through the BLAS MLX uses), dropout,
// and the decoder's elementwise work (RMSNorm, rotary embedding, the SwiGLU product), FlashAttention and the
// gated delta rule with its causal convolution (gated_delta.cpp and causal_conv.cpp, included below), as MLX
// primitives.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "mlx/transforms.h"

namespace mx = mlx::core;
namespace nb = nanobind;

// The BLAS MLX itself calls (mlxrl's preloaded OpenBLAS / MKL when there is one, else the one
// libmlx links): resolved when the module is loaded, nothing extra to link.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);

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

// Cephes' 2^f for f in [-0.5, 0.5] (degree 6, the coefficients MLX's exp uses), on a float or a vector.
template <class T>
inline T exp2_poly(T f) {
  T p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  return p * f + 1.0f;
}

inline float fast_exp(float x) {
  float t = std::min(std::max(x, kLow), kHigh) * kLog2e;
  float r = t + kMagic;
  float f = t - (r - kMagic);
  float p = exp2_poly(f);
  float scale = bits_to_float((float_to_bits(r) - (kMagicBits - 127)) << 23);
  float y = p * scale;
  y = x > kOverflow ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;  // NaN in, NaN out (std::max above would have dropped it)
}

// 16 floats in one AVX-512 register (two AVX2 ones elsewhere): GCC's vector extension, unaligned loads
// and stores. The loops below that reduce (max, sum) keep four / two accumulators: a vectorised
// `omp simd reduction(max)` measured ~1 G elements/s (one compare-and-blend chain), these ~13.
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

inline vf16 splat(float x) { return vf16{} + x; }
inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16*>(p); }
inline void store16(float* p, vf16 v) { *reinterpret_cast<vf16*>(p) = v; }

// fast_exp on 16 lanes, for x <= kOverflow (x - max in a softmax, s - lse in a backward): the same arithmetic
// without the upper clamp, which such x never reach. A NaN passes the lower clamp (the comparison is false) and
// the polynomial, so it comes out NaN with no select.
inline vf16 vexp(vf16 x) {
  const vf16 t = (x < splat(kLow) ? splat(kLow) : x) * kLog2e;
  const vf16 r = t + kMagic;
  const vf16 p = exp2_poly(t - (r - kMagic));
  const vi16 bits = (reinterpret_cast<const vi16&>(r) - (kMagicBits - 127)) << 23;
  return p * reinterpret_cast<const vf16&>(bits);
}

// max(x[0..n)) (-inf for n = 0).
inline float row_max(const float* x, size_t n) {
  const vf16 lo = splat(-std::numeric_limits<float>::infinity());
  vf16 a0 = lo, a1 = lo, a2 = lo, a3 = lo;
  size_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const vf16 y0 = load16(x + j), y1 = load16(x + j + 16), y2 = load16(x + j + 32), y3 = load16(x + j + 48);
    a0 = y0 > a0 ? y0 : a0;
    a1 = y1 > a1 ? y1 : a1;
    a2 = y2 > a2 ? y2 : a2;
    a3 = y3 > a3 ? y3 : a3;
  }
  for (; j + 16 <= n; j += 16) {
    const vf16 y = load16(x + j);
    a0 = y > a0 ? y : a0;
  }
  a0 = a1 > a0 ? a1 : a0;
  a2 = a3 > a2 ? a3 : a2;
  a0 = a2 > a0 ? a2 : a0;
  float m = a0[0];
  for (int c = 1; c < 16; ++c) m = std::max(m, a0[c]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// y[j] = exp(x[j] - m) over [0, n) (y may be x); returns their sum.
inline float exp_shift_sum(const float* x, float* y, size_t n, float m) {
  const vf16 mv = splat(m);
  vf16 s0 = vf16{}, s1 = vf16{};
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const vf16 e0 = vexp(load16(x + j) - mv), e1 = vexp(load16(x + j + 16) - mv);
    store16(y + j, e0);
    store16(y + j + 16, e1);
    s0 += e0;
    s1 += e1;
  }
  for (; j + 16 <= n; j += 16) {
    const vf16 e = vexp(load16(x + j) - mv);
    store16(y + j, e);
    s0 += e;
  }
  s0 += s1;
  float s = 0.0f;
  for (int c = 0; c < 16; ++c) s += s0[c];
  for (; j < n; ++j) {
    y[j] = fast_exp(x[j] - m);
    s += y[j];
  }
  return s;
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

// MLX's CPU evaluation runs ahead of its worker: the main thread encodes up to ~100 operations (10 tasks
// of 10 dispatches) before it waits, and each operation's output buffer is allocated when it is encoded,
// while the inputs of the queued operations are freed only when those run. In a backward pass that is up
// to ~100 outputs alive beside everything they will free (a checkpointed 0.6B layer at 4096 tokens: 682 MB
// above its inputs instead of 367). Before allocating a large output, the stream's queued work is finished
// first (a blocking wait, no spinning), so the queue frees what it holds. The order of the operations, and
// so every result, is unchanged; the worker idles only while the main thread encodes the next operation.
// MLXRL_DRAIN_BYTES: outputs from this size drain (default 1 MB; 0: never).
size_t drain_bytes() {
  static const size_t bytes = [] {
    const char* e = std::getenv("MLXRL_DRAIN_BYTES");
    return e ? size_t(std::strtoull(e, nullptr, 10)) : size_t(1) << 20;
  }();
  return bytes;
}

// Finish the work queued on stream `s` before an output of `nbytes` is allocated (see drain_bytes).
void drain_before(mx::Stream s, size_t nbytes) {
  if (drain_bytes() && nbytes >= drain_bytes()) mx::synchronize(s);
}

mx::allocator::Data fresh(mx::Stream s, size_t nbytes) {
  drain_before(s, nbytes);
  return mx::allocator::malloc(nbytes);
}

bool donatable(const mx::array& a) {
  return a.is_donatable() && a.flags().row_contiguous && a.data_size() == a.size();
}

// The output takes the input's buffer when MLX says it may (the input is not used again); the queue is
// drained first, so an input that only queued operations still read can be taken too.
void allocate_like(mx::Stream s, const mx::array& in, mx::array& out) {
  drain_before(s, out.nbytes());
  if (donatable(in)) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

// The output takes `first`'s buffer when MLX may donate it, else `second`'s, else a fresh one.
void allocate_like_either(mx::Stream s, const mx::array& first, const mx::array& second, mx::array& out) {
  drain_before(s, out.nbytes());
  if (donatable(first)) {
    out.copy_shared_buffer(first);
  } else if (donatable(second)) {
    out.copy_shared_buffer(second);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

// One-output kernels: `out` takes inputs[0]'s buffer when it may (allocate_like), every array is
// registered with the stream's encoder, which is returned for the dispatch.
mx::cpu::CommandEncoder& encode_unary_output(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out) {
  allocate_like(s, inputs[0], out);
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  return encoder;
}

// Multi-output kernels: every output gets a fresh buffer, every array is registered with the stream's
// encoder, which is returned for the dispatch.
mx::cpu::CommandEncoder& encode_outputs(mx::Stream s, const std::vector<mx::array>& inputs,
                                        std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(fresh(s, o.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  return encoder;
}

using RangeFn = void (*)(const float*, float*, size_t);

void run_elementwise(mx::Stream stream, const mx::array& in, mx::array& out, RangeFn fn) {
  allocate_like(stream, in, out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), n = in.size(), fn]() {
    parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) { fn(src + b, dst + b, e - b); });
  });
}

using BinaryRangeFn = void (*)(const float*, const float*, float*, size_t);

// out = fn(a, b) elementwise over same-shaped dense arrays; out takes b's or a's buffer when it may.
void run_binary(mx::Stream stream, const mx::array& a, const mx::array& b, mx::array& out, BinaryRangeFn fn) {
  allocate_like_either(stream, b, a, out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(a);
  encoder.set_input_array(b);
  encoder.set_output_array(out);
  encoder.dispatch([ap = a.data<float>(), bp = b.data<float>(), dst = out.data<float>(), n = a.size(), fn]() {
    parallel_for(n, kGrain, [=](size_t, size_t lo, size_t hi) { fn(ap + lo, bp + lo, dst + lo, hi - lo); });
  });
}

// A norm's VJP over rows of d, inputs (x, weight, g): dx takes g's or x's buffer when it may and is the only
// output; with the parameters' gradients every output gets a fresh buffer. fn(row, dx, acc) runs per row in
// parallel parts (dx: the first output's data), acc a zeroed per-part accumulator of (outputs - 1) x d floats
// (null when dx is the only output); the parts' accumulators are then added in order into the other outputs.
template <class F>
void norm_grad_rows(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, F fn) {
  if (outputs.size() > 1) {
    for (auto& o : outputs) o.set_data(fresh(s, o.nbytes()));
  } else {
    allocate_like_either(s, inputs[2], inputs[0], outputs[0]);
  }
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  std::vector<float*> sums;
  for (size_t j = 1; j < outputs.size(); ++j) sums.push_back(outputs[j].data<float>());
  const size_t d = inputs[0].shape().back(), rows = d == 0 ? 0 : inputs[0].size() / d;
  encoder.dispatch([=, dx = outputs[0].data<float>()]() {
    const size_t width = sums.size() * d, grain = std::max<size_t>(1, kGrain / std::max<size_t>(1, d));
    const size_t parts = std::min<size_t>(worker_count(), std::max<size_t>(1, rows / grain));
    std::vector<float> partial(parts * width, 0.0f);
    parallel_for(rows, std::max<size_t>(grain, (rows + parts - 1) / parts), [&](size_t part, size_t b, size_t e) {
      float* acc = width > 0 ? partial.data() + part * width : nullptr;
      for (size_t i = b; i < e; ++i) fn(i, dx, acc);
    });
    for (size_t j = 0; j < sums.size(); ++j) {
      std::fill(sums[j], sums[j] + d, 0.0f);
      for (size_t p = 0; p < parts; ++p)
        for (size_t k = 0; k < d; ++k) sums[j][k] += partial[p * width + j * d + k];
    }
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

// A primitive with a causal flag; its name, which is_equivalent compares, carries the flag.
template <class Base>
class WithCausal : public Base {
 public:
  WithCausal(mx::Stream s, bool causal, const char* plain, const char* masked)
      : Base(s), causal_(causal), names_{plain, masked} {}
  const char* name() const override { return names_[causal_ ? 1 : 0]; }

 protected:
  bool causal_;

 private:
  const char* names_[2];
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

// `a` as a row-contiguous array: itself when it is already evaluated that way (a contiguous() node
// would share its buffer and so keep MLX from donating it to the kernel's output), else a copy.
mx::array dense(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous && a.data_size() == a.size()) return a;
  return mx::contiguous(a, false, s);
}

// A cotangent (any dtype, broadcastable) as a dense float32 array of `like`'s shape, what the VJP kernels read.
mx::array dense_cotangent(const mx::array& c, const mx::array& like, mx::Stream s) {
  return dense(mx::broadcast_to(mx::astype(c, mx::float32, s), like.shape(), s), s);
}

mx::array fast_exp_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_sigmoid_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array fast_softmax_op(const mx::array& x, mx::StreamOrDevice s = {});
mx::array softmax_grad_op(const mx::array& y, const mx::array& g, mx::StreamOrDevice s = {});
mx::array dropout_op(const mx::array& x, const mx::array& key, float keep, mx::StreamOrDevice s = {});

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

// fn(first_row, n_rows) over [0, rows) in parallel parts of at least kGrain elements.
template <class F>
void over_rows(size_t rows, size_t cols, F fn) {
  parallel_for(rows, std::max<size_t>(1, kGrain / std::max<size_t>(1, cols)),
               [=](size_t, size_t b, size_t e) { fn(b, e - b); });
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
    out.set_data(fresh(stream(), out.nbytes()));
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
  return mx::array(mx::Shape{}, mx::float32, std::make_shared<SumSquares>(stream), {dense(x, stream)});
}

// One AdamW step (torch.optim.AdamW's arithmetic), hyper = [grad scale, lr, c1, c2]:
//   g *= scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   w = w (1 - lr wd) - lr c1 m / (sqrt(v) c2 + eps)      with c1 = 1 / (1 - b1^t), c2 = 1 / sqrt(1 - b2^t)
// as three single-output primitives (m, v, then w from the new m and v), so that each new array can
// take its old one's buffer: MLX donates a buffer only when the array is used once, and every output
// of a multi-output primitive holds its own reference to the inputs (measured: one 3-output kernel
// allocated new w, m and v every step, 3.5 GB at 291M parameters; these three allocate nothing).
class AdamWMoment : public CpuPrimitive {
 public:
  AdamWMoment(mx::Stream s, float beta, bool squared) : CpuPrimitive(s), beta_(beta), squared_(squared) {}
  const char* name() const override { return squared_ ? "MlxrlAdamWSecondMoment" : "MlxrlAdamWFirstMoment"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const AdamWMoment&>(other).beta_ == beta_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[1].shape()}; }
  // inputs: g, moment, hyper
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    allocate_like(stream(), inputs[1], outputs[0]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(outputs[0]);
    encoder.dispatch([g = inputs[0].data<float>(), x = inputs[1].data<float>(), hyper = inputs[2].data<float>(),
                      out = outputs[0].data<float>(), n = inputs[1].size(), beta = beta_, squared = squared_]() {
      const float scale = hyper[0];
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
        if (squared) {
#pragma omp simd
          for (size_t i = b; i < e; ++i) {
            float gi = g[i] * scale;
            out[i] = beta * x[i] + (1.0f - beta) * (gi * gi);
          }
        } else {
#pragma omp simd
          for (size_t i = b; i < e; ++i) out[i] = beta * x[i] + (1.0f - beta) * (g[i] * scale);
        }
      });
    });
  }

 private:
  float beta_;
  bool squared_;
};

class AdamWWeight : public CpuPrimitive {
 public:
  AdamWWeight(mx::Stream s, float wd, float eps) : CpuPrimitive(s), wd_(wd), eps_(eps) {}
  const char* name() const override { return "MlxrlAdamWWeight"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    auto& o = static_cast<const AdamWWeight&>(other);
    return wd_ == o.wd_ && eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  // inputs: w, new m, new v, hyper
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    allocate_like(stream(), inputs[0], outputs[0]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(outputs[0]);
    encoder.dispatch([w = inputs[0].data<float>(), m = inputs[1].data<float>(), v = inputs[2].data<float>(),
                      hyper = inputs[3].data<float>(), out = outputs[0].data<float>(), n = inputs[0].size(),
                      wd = wd_, eps = eps_]() {
      const float lr = hyper[1], c1 = hyper[2], c2 = hyper[3];
      const float decay = 1.0f - lr * wd, step = lr * c1;
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
        for (size_t i = b; i < e; ++i) out[i] = w[i] * decay - step * m[i] / (std::sqrt(v[i]) * c2 + eps);
      });
    });
  }

 private:
  float wd_, eps_;
};

std::vector<mx::array> adamw_step_op(const mx::array& g, const mx::array& w, const mx::array& m,
                                     const mx::array& v, const mx::array& hyper, float wd, float b1, float b2,
                                     float eps) {
  auto stream = cpu_stream({&g, &w, &m, &v, &hyper});
  if (g.shape() != w.shape() || m.shape() != w.shape() || v.shape() != w.shape() || hyper.size() != 4)
    throw std::invalid_argument("adamw_step: g, w, m, v must share a shape and hyper hold 4 values.");
  auto dg = dense(g, stream), dh = dense(hyper, stream);
  auto m_new = mx::array(w.shape(), mx::float32, std::make_shared<AdamWMoment>(stream, b1, false),
                         {dg, dense(m, stream), dh});
  auto v_new = mx::array(w.shape(), mx::float32, std::make_shared<AdamWMoment>(stream, b2, true),
                         {dg, dense(v, stream), dh});
  auto w_new = mx::array(w.shape(), mx::float32, std::make_shared<AdamWWeight>(stream, wd, eps),
                         {dense(w, stream), m_new, v_new, dh});
  return {w_new, m_new, v_new};
}

// ------------------------------------------------------------------------- 8-bit AdamW (blockwise)
//
// bitsandbytes' 8-bit AdamW (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"): a moment is
// one uint8 code per element, an index into a sorted 256-value map (m: signed, in [-1, 1]; v: in [0, 1]),
// times the absolute maximum of its block of 256 consecutive elements (float32, one per block). A step
// dequantizes both moments, updates them and the weight in float32 exactly as adamw_step, and quantizes each
// new moment to the code nearest to it over its block's new maximum. The weight is one single-output
// primitive (it takes w's buffer, as AdamWWeight); each moment is a two-output one (codes, maxima: 1 byte
// and 1/64 byte per element, fresh each step). maps = [m's 256 codes, v's 256 codes, m's 255 midpoints and
// +inf, v's 255 midpoints and +inf]; luts = [m's, v's] 65536-entry start tables (nearest_code); hyper as
// adamw_step.
constexpr size_t kQBlock = 256;

// The code nearest to x (ties to the lower): the count of midpoints below x. `lut`, indexed by x's upper 16
// bits (its bfloat16 truncation), holds that count for the lowest value with those bits; the map's codes lie
// further apart than bfloat16's steps, so at most a step or two up from there reaches x's.
inline unsigned nearest_code(const float* mid, const uint8_t* lut, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  unsigned i = lut[bits >> 16];
  while (i < 255 && x > mid[i]) ++i;
  return i;
}

class AdamW8Weight : public CpuPrimitive {
 public:
  AdamW8Weight(mx::Stream s, float wd, float b1, float b2, float eps)
      : CpuPrimitive(s), wd_(wd), b1_(b1), b2_(b2), eps_(eps) {}
  const char* name() const override { return "MlxrlAdamW8Weight"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    auto& o = static_cast<const AdamW8Weight&>(other);
    return wd_ == o.wd_ && b1_ == o.b1_ && b2_ == o.b2_ && eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  // inputs: w, g, m codes, m maxima, v codes, v maxima, maps, hyper (then the new codes: an order only)
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_unary_output(stream(), inputs, outputs[0]);
    encoder.dispatch([w = inputs[0].data<float>(), g = inputs[1].data<float>(), mq = inputs[2].data<uint8_t>(),
                      ma = inputs[3].data<float>(), vq = inputs[4].data<uint8_t>(), va = inputs[5].data<float>(),
                      maps = inputs[6].data<float>(), hyper = inputs[7].data<float>(),
                      out = outputs[0].data<float>(), n = inputs[0].size(), wd = wd_, b1 = b1_, b2 = b2_,
                      eps = eps_]() {
      const float scale = hyper[0], lr = hyper[1], c1 = hyper[2], c2 = hyper[3];
      const float decay = 1.0f - lr * wd, step = lr * c1;
      const float *mmap = maps, *vmap = maps + 256;
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
        for (size_t i = b; i < e; ++i) {
          const float gi = g[i] * scale;
          const float m = b1 * (mmap[mq[i]] * ma[i / kQBlock]) + (1.0f - b1) * gi;
          const float v = b2 * (vmap[vq[i]] * va[i / kQBlock]) + (1.0f - b2) * (gi * gi);
          out[i] = w[i] * decay - step * m / (std::sqrt(v) * c2 + eps);
        }
      });
    });
  }

 private:
  float wd_, b1_, b2_, eps_;
};

class AdamW8Moment : public CpuPrimitive {
 public:
  AdamW8Moment(mx::Stream s, float beta, bool squared) : CpuPrimitive(s), beta_(beta), squared_(squared) {}
  const char* name() const override { return squared_ ? "MlxrlAdamW8SecondMoment" : "MlxrlAdamW8FirstMoment"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const AdamW8Moment&>(other).beta_ == beta_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape(), inputs[2].shape()};
  }
  // inputs: g, codes, maxima, maps, luts, hyper; outputs: codes, maxima
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_outputs(stream(), inputs, outputs);
    encoder.dispatch([g = inputs[0].data<float>(), q = inputs[1].data<uint8_t>(), a = inputs[2].data<float>(),
                      maps = inputs[3].data<float>(), luts = inputs[4].data<uint8_t>(),
                      hyper = inputs[5].data<float>(), qo = outputs[0].data<uint8_t>(),
                      ao = outputs[1].data<float>(), n = inputs[1].size(), beta = beta_, squared = squared_]() {
      const float scale = hyper[0];
      const float* code = maps + (squared ? 256 : 0);
      const float* mid = maps + 512 + (squared ? 256 : 0);
      const uint8_t* lut = luts + (squared ? 65536 : 0);
      const size_t blocks = (n + kQBlock - 1) / kQBlock;
      parallel_for(blocks, kGrain / kQBlock, [=](size_t, size_t bb, size_t be) {
        float x[kQBlock];
        for (size_t blk = bb; blk < be; ++blk) {
          const size_t lo = blk * kQBlock, len = std::min(kQBlock, n - lo);
          const float old = a[blk];
          float top = 0.0f;
#pragma omp simd reduction(max : top)
          for (size_t j = 0; j < len; ++j) {
            const float gi = g[lo + j] * scale;
            const float upd = squared ? gi * gi : gi;
            x[j] = beta * (code[q[lo + j]] * old) + (1.0f - beta) * upd;
            top = std::max(top, std::fabs(x[j]));
          }
          ao[blk] = top;
          const float inv = top > 0.0f ? 1.0f / top : 0.0f;
          for (size_t j = 0; j < len; ++j) qo[lo + j] = uint8_t(nearest_code(mid, lut, x[j] * inv));
        }
      });
    });
  }

 private:
  float beta_;
  bool squared_;
};

std::vector<mx::array> adamw8_step_op(const mx::array& g, const mx::array& w, const mx::array& mq,
                                      const mx::array& ma, const mx::array& vq, const mx::array& va,
                                      const mx::array& maps, const mx::array& luts, const mx::array& hyper, float wd,
                                      float b1, float b2, float eps) {
  auto stream = cpu_stream({&g, &w, &ma, &va, &maps, &hyper});  // the codes: uint8, checked below
  const size_t blocks = (w.size() + kQBlock - 1) / kQBlock;
  if (g.shape() != w.shape() || mq.shape() != w.shape() || vq.shape() != w.shape() || mq.dtype() != mx::uint8 ||
      vq.dtype() != mx::uint8 || ma.size() != blocks || va.size() != blocks || maps.size() != 1024 ||
      luts.dtype() != mx::uint8 || luts.size() != 2 * 65536 || hyper.size() != 4)
    throw std::invalid_argument("adamw8_step: g, w and the uint8 codes must share a shape, each moment hold one "
                                "maximum per 256 elements, maps 1024 values, luts 2 x 65536 codes and hyper 4.");
  auto dg = dense(g, stream), dh = dense(hyper, stream), dmaps = dense(maps, stream), dluts = dense(luts, stream);
  auto dmq = dense(mq, stream), dma = dense(ma, stream), dvq = dense(vq, stream), dva = dense(va, stream);
  auto m_new = mx::array::make_arrays({w.shape(), ma.shape()}, {mx::uint8, mx::float32},
                                      std::make_shared<AdamW8Moment>(stream, b1, false),
                                      {dg, dmq, dma, dmaps, dluts, dh});
  auto v_new = mx::array::make_arrays({w.shape(), va.shape()}, {mx::uint8, mx::float32},
                                      std::make_shared<AdamW8Moment>(stream, b2, true),
                                      {dg, dvq, dva, dmaps, dluts, dh});
  // The new codes are inputs of the weight's kernel only as an order (it reads the old ones): each
  // parameter's three kernels then run together, so its gradient (and a dense copy of it) is released
  // before the next parameter's update instead of after every weight's (as AdamWWeight after m and v).
  auto w_new = mx::array(w.shape(), mx::float32, std::make_shared<AdamW8Weight>(stream, wd, b1, b2, eps),
                         {dense(w, stream), dg, dmq, dma, dvq, dva, dmaps, dh, m_new[0], v_new[0]});
  return {w_new, m_new[0], m_new[1], v_new[0], v_new[1]};
}

// ------------------------------------------------------------------------- the fused LM head
//
// Loss, logp, entropy, argmax, d_hidden and d_weight of a token-separable loss over the LM head,
// in one pass over row chunks with ONE [rows, vocab] tile buffer reused for every chunk and d_weight
// accumulated in place by the BLAS (beta = 1): per chunk 3 sgemms, one vectorised pass over the tile.
//     z = h W^T / T,  ez = exp(z - max),  s = sum ez,  lse = max + log s,  logp = z_t - lse,
//     entropy = lse - sum(ez z) / s,  g = d loss / d logp,  a = -g / s,  ez' = ez - s onehot(t)
//     dh = (a / T) (ez' W),  dW += ez'^T (a h / T)
// loss modes: 0 nll (l = -w logp, g = -w), 1 dft (l = -w p logp, g = -w p, p = exp(logp) detached).
// A bfloat16 W (a frozen head kept in the checkpoint's dtype: mlxrl.models.widened) has no weight gradient, so
// it takes the frozen pass below, which widens it to float32 one block of kWidenRows rows at a time into a small
// scratch (exact: widening only appends zero bits): the float32 [V, D] copy never exists.
constexpr int kWidenRows = 2048;

// The first j with z[j] == m (an argmax's index once m is the row's max; n - 1 if none is).
inline int first_index_of(const float* z, int n, float m) {
  int j = 0;
  while (j < n - 1 && !(z[j] == m)) ++j;
  return j;
}

inline void widen_rows(const uint16_t* src, float* dst, size_t n) {
  parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
    for (size_t i = b; i < e; ++i) {
      const uint32_t bits = uint32_t(src[i]) << 16;
      std::memcpy(dst + i, &bits, sizeof bits);
    }
  });
}

// A frozen head (no weight gradient) in one pass over vocabulary blocks: each block of W (widened once, when
// bfloat16) serves both of its products, z_b = h W_b^T / T and d_hidden's accumulator U += ez_b W_b, with an
// online softmax as FlashAttention's: ez is taken against a per-row reference max, and when a block's max rises
// past it by more than kRescale the row's U and sums are scaled down to the new one (exp(kRescale) keeps them
// finite, and rows rarely rescale after the first blocks). The target's own term stays out of U, so that
//     dh = (a / T) (U - s_other W_t),  s_other = sum of ez over j != t,
// has no cancellation when p_t nears 1 (the same d_hidden as the tile pass's (a / T) (ez' W)); the entropy's
// sum of ez z is taken with z less the reference, for the same reason. The tile is
// [rows, block] rather than [rows, V], so a chunk takes all the rows the [rows, V] budget would, and W is read
// (and widened) once per chunk instead of twice per chunk.
constexpr float kRescale = 16.0f;

struct FrozenHeadArgs {
  const float* h;
  const float* W;
  const uint16_t* Wb;
  const int32_t* t;
  const float* w;
  float *loss, *logp, *ent, *dh;
  int32_t* arg;
  int n, d, v;
  float inv_t;
  int mode;
  size_t tile_floats;  // the budget the tile pass would take: chunk rows x V
  bool with_ent;
};

inline void frozen_head_pass(const FrozenHeadArgs& a) {
  const int n = a.n, d = a.d, v = a.v;
  const int vb = std::min(v, kWidenRows);
  const int rows_max = int(std::max<size_t>(1, std::min<size_t>(size_t(std::max(n, 1)), a.tile_floats / vb)));
  auto tile_buf = mx::allocator::malloc(sizeof(float) * size_t(rows_max) * vb);
  float* tile = static_cast<float*>(tile_buf.buffer().raw_ptr());
  auto wide_buf = mx::allocator::malloc(sizeof(float) * size_t(a.Wb != nullptr ? vb : 1) * d);
  float* wide = static_cast<float*>(wide_buf.buffer().raw_ptr());
  std::vector<float> ref(rows_max), s_other(rows_max), ez_t(rows_max), z_t(rows_max), sz(rows_max),
      best(rows_max);
  std::vector<int32_t> top(rows_max);
  std::vector<float> w_t(d);
  std::vector<double> row_loss(n, 0.0);
  for (int r0 = 0; r0 < n; r0 += rows_max) {
    const int nc = std::min(rows_max, n - r0);
    const float* hc = a.h + size_t(r0) * d;
    float* U = a.dh + size_t(r0) * d;
    for (int b0 = 0; b0 < v; b0 += vb) {
      const int nb = std::min(vb, v - b0);
      const float* Wblk = a.W + size_t(b0) * d;
      if (a.Wb != nullptr) {
        widen_rows(a.Wb + size_t(b0) * d, wide, size_t(nb) * d);
        Wblk = wide;
      }
      cblas_sgemm(101, 111, 112, nc, nb, d, a.inv_t, hc, d, Wblk, d, 0.0f, tile, nb);  // z_b
      const bool first = b0 == 0;
      parallel_for(nc, 1, [&](size_t, size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) {
          float* z = tile + i * size_t(nb);
          const float bm = row_max(z, nb);
          if (first || bm > best[i]) {
            best[i] = bm;
            top[i] = b0 + first_index_of(z, nb, bm);
          }
          if (first) {
            ref[i] = bm;
            s_other[i] = ez_t[i] = sz[i] = 0.0f;
          } else if (bm > ref[i] + kRescale) {  // the row's sums and U move to the new reference
            const float f = std::exp(ref[i] - bm);
            sz[i] = f * (sz[i] + (ref[i] - bm) * (s_other[i] + ez_t[i]));
            s_other[i] *= f;
            ez_t[i] *= f;
            float* u = U + i * size_t(d);
#pragma omp simd
            for (int k = 0; k < d; ++k) u[k] *= f;
            ref[i] = bm;
          }
          const float m = ref[i];
          const int tj = a.t[r0 + i] - b0;
          const bool has_t = tj >= 0 && tj < nb;
          if (has_t) z_t[i] = z[tj];
          float s = 0.0f, s_z = 0.0f;
#pragma omp simd reduction(+ : s, s_z)
          for (int j = 0; j < nb; ++j) {
            const float e_ = fast_exp(z[j] - m);
            if (a.with_ent) s_z += e_ * (z[j] - m);
            z[j] = e_;
            s += e_;
          }
          if (has_t) {  // the target's term: kept aside, out of U
            ez_t[i] = z[tj];
            s -= z[tj];
            z[tj] = 0.0f;
          }
          s_other[i] += s;
          sz[i] += s_z;
        }
      });
      cblas_sgemm(101, 111, 111, nc, d, nb, 1.0f, tile, nb, Wblk, d, first ? 0.0f : 1.0f, U, d);  // U += ez_b W_b
    }
    for (int i = 0; i < nc; ++i) {
      const int r = r0 + i, ti = a.t[r];
      if (a.Wb != nullptr) {
        widen_rows(a.Wb + size_t(ti) * d, w_t.data(), size_t(d));
      } else {
        std::memcpy(w_t.data(), a.W + size_t(ti) * d, sizeof(float) * d);
      }
      const float s = s_other[i] + ez_t[i];
      const float lse = ref[i] + std::log(s);
      const float lp = z_t[i] - lse;
      float g = -a.w[r];
      if (a.mode == 1) g *= std::exp(lp);
      row_loss[r] = double(g) * double(lp);
      a.logp[r] = lp;
      a.ent[r] = a.with_ent ? std::log(s) - sz[i] / s : 0.0f;  // lse - sum(p z), with z taken from the reference
      a.arg[r] = top[i];
      const float ha = -g / s * a.inv_t, so = s_other[i];
      float* u = U + i * size_t(d);
#pragma omp simd
      for (int k = 0; k < d; ++k) u[k] = ha * (u[k] - so * w_t[k]);
    }
  }
  double total = 0.0;
  for (double x : row_loss) total += x;
  *a.loss = static_cast<float>(total);
}

class FusedHead : public CpuPrimitive {
 public:
  FusedHead(mx::Stream s, float inv_t, int mode, int chunk_rows, bool with_entropy, bool weight_grad)
      : CpuPrimitive(s), inv_t_(inv_t), mode_(mode), chunk_(chunk_rows), ent_(with_entropy), dw_(weight_grad) {}
  const char* name() const override { return "MlxrlFusedHead"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    auto& o = static_cast<const FusedHead&>(other);
    return inv_t_ == o.inv_t_ && mode_ == o.mode_ && chunk_ == o.chunk_ && ent_ == o.ent_ && dw_ == o.dw_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape n{inputs[0].shape(0)};
    return {mx::Shape{}, n, n, n, inputs[0].shape(), dw_ ? inputs[1].shape() : mx::Shape{0}};
  }
  // inputs: h [N, D], W [V, D], t [N] int32, w [N]; outputs: loss [], logp, ent [N], argmax [N] int32,
  // dh [N, D], dW [V, D] ([0] without the weight gradient)
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_outputs(stream(), inputs, outputs);
    const int n = inputs[0].shape(0), d = inputs[0].shape(1), v = inputs[1].shape(0);
    const bool narrow = inputs[1].dtype() == mx::bfloat16;
    encoder.dispatch([h = inputs[0].data<float>(), W = narrow ? nullptr : inputs[1].data<float>(),
                      Wb = narrow ? reinterpret_cast<const uint16_t*>(inputs[1].data<mx::bfloat16_t>()) : nullptr,
                      t = inputs[2].data<int32_t>(),
                      w = inputs[3].data<float>(), loss = outputs[0].data<float>(), logp = outputs[1].data<float>(),
                      ent = outputs[2].data<float>(), arg = outputs[3].data<int32_t>(),
                      dh = outputs[4].data<float>(), dw = dw_ ? outputs[5].data<float>() : nullptr, n, d, v,
                      inv_t = inv_t_, mode = mode_, chunk = std::max(1, chunk_), with_ent = ent_]() {
      if (dw == nullptr) {
        frozen_head_pass({h, W, Wb, t, w, loss, logp, ent, dh, arg, n, d, v, inv_t, mode,
                          size_t(chunk) * size_t(v), with_ent});
        return;
      }
      const int rows_max = std::min(chunk, std::max(n, 1));
      // scratch from MLX's allocator (its buffer cache: the next step reuses the pages), freed on return
      auto tile_buf = mx::allocator::malloc(sizeof(float) * size_t(rows_max) * v);
      auto scaled_buf = mx::allocator::malloc(sizeof(float) * size_t(rows_max) * d);
      float* tile = static_cast<float*>(tile_buf.buffer().raw_ptr());
      float* scaled = static_cast<float*>(scaled_buf.buffer().raw_ptr());
      std::vector<double> row_loss(n, 0.0);
      std::vector<float> row_a(rows_max);
      for (int r0 = 0; r0 < n; r0 += chunk) {
        const int nc = std::min(chunk, n - r0);
        cblas_sgemm(101, 111, 112, nc, v, d, inv_t, h + size_t(r0) * d, d, W, d, 0.0f, tile, v);  // z
        parallel_for(nc, 1, [&](size_t, size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            const size_t r = r0 + i;
            float* z = tile + i * size_t(v);
            const float m = row_max(z, v);
            const int top = first_index_of(z, v, m);
            const int ti = t[r];
            const float zt = z[ti];
            float s = 0.0f, sz = 0.0f;
#pragma omp simd reduction(+ : s, sz)
            for (int j = 0; j < v; ++j) {
              float e_ = fast_exp(z[j] - m);
              if (with_ent) sz += e_ * z[j];
              z[j] = e_;
              s += e_;
            }
            const float lse = m + std::log(s);
            const float lp = zt - lse;
            float g = -w[r];
            if (mode == 1) g *= std::exp(lp);
            row_loss[r] = double(g) * double(lp);  // -w logp (nll) or -w p logp (dft)
            logp[r] = lp;
            ent[r] = with_ent ? lse - sz / s : 0.0f;
            arg[r] = top;
            const float a = -g / s;
            z[ti] = std::exp(zt - m) - s;  // ez - s onehot(t)
            row_a[i] = a;
            const float ha = a * inv_t;
            for (int k = 0; k < d; ++k) scaled[i * size_t(d) + k] = ha * h[r * size_t(d) + k];
          }
        });
        cblas_sgemm(101, 111, 111, nc, d, v, 1.0f, tile, v, W, d, 0.0f, dh + size_t(r0) * d, d);  // ez' W
        for (int i = 0; i < nc; ++i) {
          const float ha = row_a[i] * inv_t;
          float* row = dh + size_t(r0 + i) * d;
#pragma omp simd
          for (int k = 0; k < d; ++k) row[k] *= ha;
        }
        if (dw != nullptr)  // dW (+)= ez'^T (a h / T), in place
          cblas_sgemm(101, 112, 111, v, d, nc, 1.0f, tile, v, scaled, d, r0 == 0 ? 0.0f : 1.0f, dw, d);
      }
      if (dw != nullptr && n == 0) std::fill(dw, dw + size_t(v) * d, 0.0f);
      double total = 0.0;
      for (double x : row_loss) total += x;
      *loss = static_cast<float>(total);
    });
  }

 private:
  float inv_t_;
  int mode_, chunk_;
  bool ent_, dw_;
};

std::vector<mx::array> fused_head_op(const mx::array& h, const mx::array& weight, const mx::array& targets,
                                     const mx::array& w, float inv_t, int mode, int chunk_rows, bool with_entropy,
                                     bool weight_grad) {
  auto stream = weight.dtype() == mx::bfloat16 ? cpu_stream({&h, &w}) : cpu_stream({&h, &weight, &w});
  if (h.ndim() != 2 || weight.ndim() != 2 || h.shape(1) != weight.shape(1) || targets.ndim() != 1 ||
      targets.shape(0) != h.shape(0) || w.shape() != targets.shape())
    throw std::invalid_argument("fused_head: h [N, D], weight [V, D], targets [N] and w [N] expected.");
  if (mode != 0 && mode != 1) throw std::invalid_argument("fused_head: mode is 0 (nll) or 1 (dft).");
  if (weight.dtype() == mx::bfloat16 && weight_grad)
    throw std::invalid_argument("fused_head: a bfloat16 weight is a frozen head's (no weight gradient).");
  auto dense = [&](const mx::array& a) { return ::dense(a, stream); };
  auto t = mx::clip(mx::astype(targets, mx::int32, stream), mx::array(0), mx::array(weight.shape(0) - 1), stream);
  mx::Shape n{h.shape(0)};
  return mx::array::make_arrays(
      {mx::Shape{}, n, n, n, h.shape(), weight_grad ? weight.shape() : mx::Shape{0}},
      {mx::float32, mx::float32, mx::float32, mx::int32, mx::float32, mx::float32},
      std::make_shared<FusedHead>(stream, inv_t, mode, chunk_rows, with_entropy, weight_grad),
      {dense(h), dense(weight), dense(t), dense(w)});
}


// ------------------------------------------------------------------------------------- dropout

// Dropout with a counter-based mask: element i is kept when hash(i, key) < keep * 2^32, so the mask is
// a pure function of (key, i) and the VJP (the cotangent through the same mask) needs no saved mask.
// The hash is a 32-bit integer finalizer (xor-shift-multiply, "lowbias32") of i mixed with the key's
// two words: vectorisable, and uniform enough that the kept fraction matches keep to ~1e-4 on 1M draws.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The mask of a uint32[2] key and a kept fraction: element i is kept (and scaled by 1 / keep) when its hash
// is below keep * 2^32. Built inside a kernel's dispatch, where the key's data is readable.
struct DropMask {
  uint32_t k0, k1, threshold;
  float scale;
  DropMask(const uint32_t* key, float keep)
      : k0(mix32(key[0] ^ 0x9e3779b9U)),
        k1(key[1]),
        threshold(static_cast<uint32_t>(std::min(4294967295.0, std::floor(double(keep) * 4294967296.0)))),
        scale(1.0f / keep) {}
  bool kept(size_t i) const {
    uint32_t h = mix32(static_cast<uint32_t>(i) * 0x9e3779b1U + k0) ^ k1;
    return mix32(h + static_cast<uint32_t>(i >> 32)) < threshold;
  }
};

class Dropout : public CpuPrimitive {
 public:
  Dropout(mx::Stream s, float keep) : CpuPrimitive(s), keep_(keep) {}
  const char* name() const override { return "MlxrlDropout"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    const auto& key = inputs[1];
    auto& out = outputs[0];
    allocate_like(stream(), in, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_input_array(key);
    encoder.set_output_array(out);
    encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), n = in.size(), k = key.data<uint32_t>(),
                      keep = keep_]() {
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
        const DropMask mask(k, keep);  // a local (not a capture the stores could alias): vectorises
#pragma omp simd
        for (size_t i = b; i < e; ++i) dst[i] = mask.kept(i) ? src[i] * mask.scale : 0.0f;
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> out;
    for (int a : argnums)
      out.push_back(a == 0 ? dropout_op(cotangents[0], primals[1], keep_, stream())
                           : mx::zeros_like(primals[1], stream()));
    return out;
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {dropout_op(tangents[0], primals[1], keep_, stream())};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const Dropout&>(other).keep_ == keep_;
  }

 private:
  float keep_;
};

mx::array dropout_op(const mx::array& x, const mx::array& key, float keep, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x}, s);
  if (key.dtype() != mx::uint32 || key.size() != 2) throw std::invalid_argument("dropout's key is a uint32[2] array.");
  if (!(keep > 0.0f && keep <= 1.0f)) throw std::invalid_argument("dropout keeps a fraction in (0, 1].");
  return mx::array(x.shape(), mx::float32, std::make_shared<Dropout>(stream, keep),
                   {dense(x, stream), dense(key, stream)});
}

// ------------------------------------------------------------ LoRA's dropout + down-projection
//
// u = dropout(x) A for a LoRA adapter's A [d, r] (r small), x [..., d]: per row, the kept elements of x
// (scaled by 1 / keep) times A's rows summed into the row's r outputs, so the [rows, d] dropout copy
// that `dropout(x) @ A` writes, reads and keeps for A's gradient never exists. The mask is dropout_op's
// (element i of x, the same hash and key), so the result is dropout(x) @ A. Its VJP is one pass too:
// per row, the mask once, dx = mask (g A^T) / keep and dA += (mask x / keep)^T g (dA per worker, the
// partials then added in order).

mx::array lora_down_op(const mx::array& x, const mx::array& key, const mx::array& a, float keep,
                       mx::StreamOrDevice s = {});

constexpr size_t kRowBlock = 4;  // rows per pass over A: four independent accumulator chains share each load

// Rows t .. t + n of x [rows, d] through the mask: m [n, d] the factors (1 / keep where kept, else 0) and
// xm [n, d] = x m; xm's rows n .. kRowBlock are zeroed (a partial block adds nothing). The mask is taken by
// value: a local the stores below cannot alias, so its fields stay in registers and the loop vectorises.
void mask_rows(const DropMask mask, const float* x, size_t t, size_t n, size_t d, float* m, float* xm) {
  for (size_t q = 0; q < n; ++q) {
    const size_t start = (t + q) * d;
    const float* xr = x + start;
    float* mq = m + q * d;
    float* xq = xm + q * d;
#pragma omp simd
    for (size_t j = 0; j < d; ++j) {
      mq[j] = mask.kept(start + j) ? mask.scale : 0.0f;
      xq[j] = xr[j] * mq[j];
    }
  }
  std::fill(xm + n * d, xm + kRowBlock * d, 0.0f);
}

// out[q, :] = xm[q, :] A for the n <= kRowBlock rows of xm [n, d], A [d, R].
template <int R>
void down_rows(const float* xm, const float* a, float* out, size_t n, size_t d) {
  float acc[kRowBlock][R] = {};
  for (size_t j = 0; j < d; ++j) {
    const float* arow = a + j * R;
    for (size_t q = 0; q < kRowBlock; ++q) {
      const float v = q < n ? xm[q * d + j] : 0.0f;
#pragma omp simd
      for (int c = 0; c < R; ++c) acc[q][c] += v * arow[c];
    }
  }
  for (size_t q = 0; q < n; ++q) std::copy(acc[q], acc[q] + R, out + q * R);
}

void down_rows_any(const float* xm, const float* a, float* out, size_t n, size_t d, size_t r) {
  for (size_t q = 0; q < n; ++q) {
    float* o = out + q * r;
    std::fill(o, o + r, 0.0f);
    for (size_t j = 0; j < d; ++j) {
      const float v = xm[q * d + j];
      const float* arow = a + j * r;
#pragma omp simd
      for (size_t c = 0; c < r; ++c) o[c] += v * arow[c];
    }
  }
}

class LoraDown : public CpuPrimitive {
 public:
  LoraDown(mx::Stream s, float keep) : CpuPrimitive(s), keep_(keep) {}
  const char* name() const override { return "MlxrlLoraDown"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const LoraDown&>(other).keep_ == keep_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(1);
    return {shape};
  }
  // inputs: x [..., d], key uint32[2], a [d, r]; output u [..., r]
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(fresh(stream(), out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const size_t d = inputs[2].shape(0), r = inputs[2].shape(1), rows = d == 0 ? 0 : inputs[0].size() / d;
    encoder.dispatch([xp = inputs[0].data<float>(), k = inputs[1].data<uint32_t>(), ap = inputs[2].data<float>(),
                      up = out.data<float>(), d, r, rows, keep = keep_]() {
      const DropMask mask(k, keep);
      parallel_for(rows, std::max<size_t>(kRowBlock, kGrain / std::max<size_t>(1, d)), [=](size_t, size_t b, size_t e) {
        std::vector<float> m(kRowBlock * d), xm(kRowBlock * d);
        for (size_t t = b; t < e; t += kRowBlock) {
          const size_t n = std::min(kRowBlock, e - t);
          mask_rows(mask, xp, t, n, d, m.data(), xm.data());
          switch (r) {  // the usual ranks with the accumulators in registers
            case 8: down_rows<8>(xm.data(), ap, up + t * r, n, d); break;
            case 16: down_rows<16>(xm.data(), ap, up + t * r, n, d); break;
            case 32: down_rows<32>(xm.data(), ap, up + t * r, n, d); break;
            case 64: down_rows<64>(xm.data(), ap, up + t * r, n, d); break;
            default: down_rows_any(xm.data(), ap, up + t * r, n, d, r);
          }
        }
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override;

 private:
  float keep_;
};

// inputs: x [..., d], key, a [d, r], g [..., r]; outputs: dx [..., d], da [d, r]
class LoraDownGrad : public CpuPrimitive {
 public:
  LoraDownGrad(mx::Stream s, float keep) : CpuPrimitive(s), keep_(keep) {}
  const char* name() const override { return "MlxrlLoraDownGrad"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const LoraDownGrad&>(other).keep_ == keep_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[2].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_outputs(stream(), inputs, outputs);
    const size_t d = inputs[2].shape(0), r = inputs[2].shape(1), rows = d == 0 ? 0 : inputs[0].size() / d;
    encoder.dispatch([xp = inputs[0].data<float>(), k = inputs[1].data<uint32_t>(), ap = inputs[2].data<float>(),
                      gp = inputs[3].data<float>(), dx = outputs[0].data<float>(), da = outputs[1].data<float>(),
                      d, r, rows, keep = keep_]() {
      const DropMask mask(k, keep);
      std::vector<float> at(r * d);  // A^T [r, d]: the row loops below run over d
      for (size_t j = 0; j < d; ++j)
        for (size_t c = 0; c < r; ++c) at[c * d + j] = ap[j * r + c];
      const size_t grain = std::max<size_t>(1, kGrain / std::max<size_t>(1, d));
      const size_t parts = std::min<size_t>(worker_count(), std::max<size_t>(1, rows / grain));
      std::vector<float> partial(parts * r * d, 0.0f);  // dA^T [r, d] per worker
      parallel_for(rows, std::max<size_t>(grain, (rows + parts - 1) / parts), [&](size_t part, size_t b, size_t e) {
        std::vector<float> m(kRowBlock * d), xm(kRowBlock * d);
        float* acc = partial.data() + part * r * d;
        const float* atp = at.data();
        for (size_t t = b; t < e; t += kRowBlock) {
          const size_t n = std::min(kRowBlock, e - t);
          mask_rows(mask, xp, t, n, d, m.data(), xm.data());
          for (size_t q = 0; q < n; ++q) {  // dx = mask (g A^T) / keep: the row stays in L1 over A^T's r rows
            const float* gr = gp + (t + q) * r;
            const float* mq = m.data() + q * d;
            float* o = dx + (t + q) * d;
            std::fill(o, o + d, 0.0f);
            for (size_t c = 0; c < r; ++c) {
              const float gc = gr[c];
              const float* ar = atp + c * d;
#pragma omp simd
              for (size_t j = 0; j < d; ++j) o[j] += gc * ar[j];
            }
#pragma omp simd
            for (size_t j = 0; j < d; ++j) o[j] *= mq[j];
          }
          static_assert(kRowBlock == 4, "the dA update below names the block's four rows");
          const float* g0 = gp + t * r;  // dA^T += g^T (mask x / keep), the block's rows at once
          const float *x0 = xm.data(), *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
          for (size_t c = 0; c < r; ++c) {
            const float c0 = g0[c], c1 = n > 1 ? g0[r + c] : 0.0f, c2 = n > 2 ? g0[2 * r + c] : 0.0f,
                        c3 = n > 3 ? g0[3 * r + c] : 0.0f;
            float* arow = acc + c * d;
#pragma omp simd
            for (size_t j = 0; j < d; ++j) arow[j] += c0 * x0[j] + c1 * x1[j] + c2 * x2[j] + c3 * x3[j];
          }
        }
      });
      for (size_t j = 0; j < d; ++j)
        for (size_t c = 0; c < r; ++c) {
          float sum = 0.0f;
          for (size_t p = 0; p < parts; ++p) sum += partial[(p * r + c) * d + j];
          da[j * r + c] = sum;
        }
    });
  }

 private:
  float keep_;
};

std::vector<mx::array> LoraDown::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                     const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto g = dense(mx::astype(cotangents[0], mx::float32, stream()), stream());
  auto grads = mx::array::make_arrays({primals[0].shape(), primals[2].shape()}, {mx::float32, mx::float32},
                                      std::make_shared<LoraDownGrad>(stream(), keep_),
                                      {primals[0], primals[1], primals[2], g});
  std::vector<mx::array> out;
  for (int a : argnums) out.push_back(a == 0 ? grads[0] : a == 2 ? grads[1] : mx::zeros_like(primals[1], stream()));
  return out;
}

mx::array lora_down_op(const mx::array& x, const mx::array& key, const mx::array& a, float keep, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x, &a}, s);
  if (key.dtype() != mx::uint32 || key.size() != 2) throw std::invalid_argument("lora_down's key is a uint32[2] array.");
  if (!(keep > 0.0f && keep <= 1.0f)) throw std::invalid_argument("lora_down keeps a fraction in (0, 1].");
  if (x.ndim() < 1 || a.ndim() != 2 || x.shape(-1) != a.shape(0))
    throw std::invalid_argument("lora_down: x [..., d] and a [d, r] expected.");
  auto shape = x.shape();
  shape.back() = a.shape(1);
  return mx::array(shape, mx::float32, std::make_shared<LoraDown>(stream, keep),
                   {dense(x, stream), dense(key, stream), dense(a, stream)});
}

template <class P>
mx::array make_unary(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x}, s);
  auto in = dense(x, stream);
  return mx::array(in.shape(), mx::float32, std::make_shared<P>(stream), {in});
}

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


// ------------------------------------------------------------------------- decoder elementwise work
//
// The decoder's and the vision towers' non-matmul work, fused and spread over the cores (MLX runs each of
// its ops on one core, one pass per op): RMSNorm and LayerNorm (forward and VJP), rotary embedding (forward =
// its VJP with the rotation reversed), the SwiGLU product silu(g) u and GELU's tanh form (forward and VJP).

// The decoder's RMSNorm, y = x r w with r = 1 / sqrt(mean(x^2) + eps), and the vision towers' LayerNorm,
// y = (x - mean) r w + b with r = 1 / sqrt(var + eps) (mean and biased variance over the row): one primitive,
// `centered` telling them apart, one pass per row after its sums. The VJPs per row, with c = g w:
//   RMSNorm:   dx = r c - x r^3 mean(c x),              dw += g x r
//   LayerNorm: dx = r (c - mean(c) - x^ mean(c x^)),     dw += g x^,  db += g   (x^ = (x - mean) r)
// the parameters' gradients summed over rows per worker, then added in order.
void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, size_t d, float eps) {
  for (size_t i = 0; i < rows; ++i) {
    const float* xr = x + i * d;
    float* yr = y + i * d;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (size_t k = 0; k < d; ++k) ss += xr[k] * xr[k];
    const float r = 1.0f / std::sqrt(ss / float(d) + eps);
#pragma omp simd
    for (size_t k = 0; k < d; ++k) yr[k] = xr[k] * r * w[k];
  }
}

void layer_norm_rows(const float* x, const float* w, const float* bias, float* y, size_t rows, size_t d, float eps) {
  for (size_t i = 0; i < rows; ++i) {
    const float* xr = x + i * d;
    float* yr = y + i * d;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (size_t k = 0; k < d; ++k) sum += xr[k];
    const float mean = sum / float(d);
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (size_t k = 0; k < d; ++k) ss += (xr[k] - mean) * (xr[k] - mean);
    const float r = 1.0f / std::sqrt(ss / float(d) + eps);
#pragma omp simd
    for (size_t k = 0; k < d; ++k) yr[k] = (xr[k] - mean) * r * w[k] + bias[k];
  }
}

// One row of the RMSNorm's VJP; acc ([d]: dw) may be null.
inline void rms_norm_grad_row(const float* xr, const float* gr, const float* wp, float* o, float* acc, size_t d,
                              float eps) {
  float ss = 0.0f, cx = 0.0f;
#pragma omp simd reduction(+ : ss, cx)
  for (size_t k = 0; k < d; ++k) {
    ss += xr[k] * xr[k];
    cx += gr[k] * wp[k] * xr[k];
  }
  const float r = 1.0f / std::sqrt(ss / float(d) + eps);
  const float coef = r * r * r * cx / float(d);
  if (acc != nullptr) {
#pragma omp simd
    for (size_t k = 0; k < d; ++k) acc[k] += gr[k] * xr[k] * r;
  }
#pragma omp simd
  for (size_t k = 0; k < d; ++k) o[k] = r * gr[k] * wp[k] - coef * xr[k];
}

// One row of the LayerNorm's VJP; acc ([2 d]: dw, then db) may be null.
inline void layer_norm_grad_row(const float* xr, const float* gr, const float* wp, float* o, float* acc, size_t d,
                                float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (size_t k = 0; k < d; ++k) sum += xr[k];
  const float mean = sum / float(d);
  float ss = 0.0f, sc = 0.0f, scx = 0.0f;
#pragma omp simd reduction(+ : ss, sc, scx)
  for (size_t k = 0; k < d; ++k) {
    const float xc = xr[k] - mean, c = gr[k] * wp[k];
    ss += xc * xc;
    sc += c;
    scx += c * xc;
  }
  const float r = 1.0f / std::sqrt(ss / float(d) + eps);
  const float mc = sc / float(d), mcx = scx * r / float(d);  // mean(c), mean(c x^)
  if (acc != nullptr) {
#pragma omp simd
    for (size_t k = 0; k < d; ++k) {
      acc[k] += gr[k] * (xr[k] - mean) * r;
      acc[d + k] += gr[k];
    }
  }
#pragma omp simd
  for (size_t k = 0; k < d; ++k) o[k] = r * (gr[k] * wp[k] - mc - (xr[k] - mean) * r * mcx);
}

std::vector<mx::array> norm_grad_op(const mx::array& x, const mx::array& w, const mx::array& g, float eps,
                                    bool centered, bool param_grads, mx::Stream s);

class Norm : public CpuPrimitive {
 public:
  Norm(mx::Stream s, float eps, bool centered) : CpuPrimitive(s), eps_(eps), centered_(centered) {}
  const char* name() const override { return centered_ ? "MlxrlLayerNorm" : "MlxrlRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const Norm&>(other).eps_ == eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  // inputs: x [..., d], w [d] (, b [d])
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    auto& out = outputs[0];
    auto& encoder = encode_unary_output(stream(), inputs, out);
    const size_t d = x.shape().back(), rows = d == 0 ? 0 : x.size() / d;
    encoder.dispatch([xp = x.data<float>(), wp = inputs[1].data<float>(),
                      bp = centered_ ? inputs[2].data<float>() : nullptr, yp = out.data<float>(), rows, d,
                      eps = eps_]() {
      over_rows(rows, d, [=](size_t b, size_t n) {
        if (bp != nullptr) {
          layer_norm_rows(xp + b * d, wp, bp, yp + b * d, n, d, eps);
        } else {
          rms_norm_rows(xp + b * d, wp, yp + b * d, n, d, eps);
        }
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    bool params = std::any_of(argnums.begin(), argnums.end(), [](int a) { return a > 0; });
    auto grads = norm_grad_op(primals[0], primals[1], cotangents[0], eps_, centered_, params, stream());
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(grads[a]);
    return out;
  }

 private:
  float eps_;
  bool centered_;
};

class NormGrad : public CpuPrimitive {
 public:
  NormGrad(mx::Stream s, float eps, bool centered, bool params)
      : CpuPrimitive(s), eps_(eps), centered_(centered), params_(params) {}
  const char* name() const override {
    static const char* names[2][2] = {{"MlxrlRmsNormGrad", "MlxrlRmsNormGradW"},
                                      {"MlxrlLayerNormGrad", "MlxrlLayerNormGradWB"}};
    return names[centered_][params_];
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && static_cast<const NormGrad&>(other).eps_ == eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[0].shape()};
    for (int j = 0; params_ && j < (centered_ ? 2 : 1); ++j) shapes.push_back(inputs[1].shape());
    return shapes;
  }
  // inputs: x [..., d], w [d], g [..., d]; outputs: dx (, dw (, db))
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const size_t d = inputs[0].shape().back();
    norm_grad_rows(stream(), inputs, outputs, [xp = inputs[0].data<float>(), wp = inputs[1].data<float>(),
                                               gp = inputs[2].data<float>(), d, eps = eps_,
                                               centered = centered_](size_t i, float* dx, float* acc) {
      auto row = centered ? layer_norm_grad_row : rms_norm_grad_row;
      row(xp + i * d, gp + i * d, wp, dx + i * d, acc, d, eps);
    });
  }

 private:
  float eps_;
  bool centered_, params_;
};

mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {}) {
  auto stream = cpu_stream({&x, &w}, s);
  if (x.ndim() == 0 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: x [..., d] and weight [d] expected.");
  return mx::array(x.shape(), mx::float32, std::make_shared<Norm>(stream, eps, false),
                   {dense(x, stream), dense(w, stream)});
}

mx::array layer_norm_op(const mx::array& x, const mx::array& w, const mx::array& b, float eps, mx::StreamOrDevice s = {}) {
  auto stream = cpu_stream({&x, &w, &b}, s);
  if (x.ndim() == 0 || w.ndim() != 1 || b.ndim() != 1 || w.shape(0) != x.shape(-1) || b.shape(0) != x.shape(-1))
    throw std::invalid_argument("layer_norm: x [..., d], weight [d] and bias [d] expected.");
  return mx::array(x.shape(), mx::float32, std::make_shared<Norm>(stream, eps, true),
                   {dense(x, stream), dense(w, stream), dense(b, stream)});
}

std::vector<mx::array> norm_grad_op(const mx::array& x, const mx::array& w, const mx::array& g, float eps,
                                    bool centered, bool param_grads, mx::Stream s) {
  auto stream = cpu_stream({&x, &w}, s);
  auto gd = dense_cotangent(g, x, stream);
  auto prim = std::make_shared<NormGrad>(stream, eps, centered, param_grads);
  std::vector<mx::Shape> shapes{x.shape()};
  for (int j = 0; param_grads && j < (centered ? 2 : 1); ++j) shapes.push_back(w.shape());
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32), prim,
                                {dense(x, stream), dense(w, stream), gd});
}

// Rotary embedding of x [B, H, L, D] (any strides: the input is typically a transposed view of
// [B, L, H, D]) with cos / sin broadcast to it (their strides, 0 along broadcast axes), written
// contiguous:  y[:h] = x[:h] c[:h] - x[h:] s[:h],  y[h:] = x[h:] c[h:] + x[:h] s[h:]  (h = D / 2).
// The VJP is the transposed rotation (`inverse`):  dx[:h] = g[:h] c[:h] + g[h:] s[h:],
// dx[h:] = g[h:] c[h:] - g[:h] s[:h].
struct Strides4 {
  int64_t s[4];
};
Strides4 strides_of(const mx::array& a) {
  Strides4 out{};
  for (int i = 0; i < 4; ++i) out.s[i] = a.strides()[i];
  return out;
}

mx::array rotary_op(const mx::array& x, const mx::array& cos, const mx::array& sin, bool inverse,
                    mx::StreamOrDevice s = {});

class Rotary : public CpuPrimitive {
 public:
  Rotary(mx::Stream s, bool inverse) : CpuPrimitive(s), inverse_(inverse) {}
  const char* name() const override { return inverse_ ? "MlxrlRotaryInverse" : "MlxrlRotary"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    auto& out = outputs[0];
    auto& encoder = encode_unary_output(stream(), inputs, out);
    const auto& sh = x.shape();
    encoder.dispatch([xp = x.data<float>(), cp = inputs[1].data<float>(), sp = inputs[2].data<float>(),
                      yp = out.data<float>(), B = size_t(sh[0]), H = size_t(sh[1]), L = size_t(sh[2]),
                      D = size_t(sh[3]), xs = strides_of(x), cs = strides_of(inputs[1]), ss = strides_of(inputs[2]),
                      inv = inverse_]() {
      const size_t half = D / 2, rows = B * H * L;
      over_rows(rows, D, [=](size_t b0, size_t n) {
        for (size_t row = b0; row < b0 + n; ++row) {
          const size_t l = row % L, h = (row / L) % H, b = row / (L * H);
          const float* xr = xp + b * xs.s[0] + h * xs.s[1] + l * xs.s[2];
          const float* c = cp + b * cs.s[0] + h * cs.s[1] + l * cs.s[2];
          const float* s = sp + b * ss.s[0] + h * ss.s[1] + l * ss.s[2];
          float* y = yp + row * D;
          const int64_t xd = xs.s[3], cd = cs.s[3], sd = ss.s[3];
          if (xd == 1 && cd == 1 && sd == 1) {
            // both halves are read before either is written: y may be x's buffer (donated)
            if (!inv) {
#pragma omp simd
              for (size_t k = 0; k < half; ++k) {
                const float x1 = xr[k], x2 = xr[k + half];
                y[k] = x1 * c[k] - x2 * s[k];
                y[k + half] = x2 * c[k + half] + x1 * s[k + half];
              }
            } else {
#pragma omp simd
              for (size_t k = 0; k < half; ++k) {
                const float x1 = xr[k], x2 = xr[k + half];
                y[k] = x1 * c[k] + x2 * s[k + half];
                y[k + half] = x2 * c[k + half] - x1 * s[k];
              }
            }
          } else {
            for (size_t k = 0; k < half; ++k) {
              const float x1 = xr[k * xd], x2 = xr[(k + half) * xd];
              const float c1 = c[k * cd], c2 = c[(k + half) * cd], s1 = s[k * sd], s2 = s[(k + half) * sd];
              y[k] = inv ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
              y[k + half] = inv ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
            }
          }
        }
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> out;
    auto st = stream();
    const auto& x = primals[0];
    const auto& g = cotangents[0];
    const int half = x.shape(3) / 2;
    for (int a : argnums) {
      if (a == 0) {
        out.push_back(rotary_op(g, primals[1], primals[2], !inverse_, st));
        continue;
      }
      // cos / sin (not trained in a model; for completeness): d/dc = g x, d/ds = g rot(x), summed to
      // their shape (the primals were broadcast to x's shape)
      mx::array t = x;
      if (a == 2) {  // the rotated x: [-x2, x1], or [x2, -x1] for the transposed rotation
        auto x1 = mx::slice(x, {0, 0, 0, 0}, {x.shape(0), x.shape(1), x.shape(2), half}, st);
        auto x2 = mx::slice(x, {0, 0, 0, half}, x.shape(), st);
        t = inverse_ ? mx::concatenate({x2, mx::negative(x1, st)}, 3, st)
                     : mx::concatenate({mx::negative(x2, st), x1}, 3, st);
      }
      out.push_back(mx::multiply(g, t, st));
    }
    return out;
  }

 private:
  bool inverse_;
};

mx::array rotary_op(const mx::array& x, const mx::array& cos, const mx::array& sin, bool inverse,
                    mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x, &cos, &sin}, s);
  if (x.ndim() != 4 || x.shape(3) % 2 != 0) throw std::invalid_argument("rotary: x [B, H, L, D] with D even expected.");
  return mx::array(x.shape(), mx::float32, std::make_shared<Rotary>(stream, inverse),
                   {x, mx::broadcast_to(cos, x.shape(), stream), mx::broadcast_to(sin, x.shape(), stream)});
}

// The SwiGLU product silu(g) u = g sigmoid(g) u, and its VJP in one pass over (g, u, c):
// du = c g s,  dg = c u s (1 + g (1 - s))  with s = sigmoid(g).
std::vector<mx::array> silu_mul_grad_op(const mx::array& g, const mx::array& u, const mx::array& c, mx::Stream s);

class SiluMul : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlSiluMul"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_binary(stream(), inputs[0], inputs[1], outputs[0], [](const float* g, const float* u, float* y, size_t n) {
#pragma omp simd
      for (size_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto grads = silu_mul_grad_op(primals[0], primals[1], cotangents[0], stream());
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(grads[a]);
    return out;
  }
};

class SiluMulGrad : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlSiluMulGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }
  // inputs: g, u, c; outputs: dg, du
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_outputs(stream(), inputs, outputs);
    encoder.dispatch([gp = inputs[0].data<float>(), up = inputs[1].data<float>(), cp = inputs[2].data<float>(),
                      dg = outputs[0].data<float>(), du = outputs[1].data<float>(), n = inputs[0].size()]() {
      parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
        for (size_t i = b; i < e; ++i) {
          const float x = gp[i], sg = 1.0f / (1.0f + fast_exp(-x)), ci = cp[i];
          du[i] = ci * x * sg;
          dg[i] = ci * up[i] * sg * (1.0f + x * (1.0f - sg));
        }
      });
    });
  }
};

mx::array silu_mul_op(const mx::array& g, const mx::array& u, mx::StreamOrDevice s = {}) {
  auto stream = cpu_stream({&g, &u}, s);
  if (g.shape() != u.shape()) throw std::invalid_argument("silu_mul: g and u must share a shape.");
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(stream), {dense(g, stream), dense(u, stream)});
}

std::vector<mx::array> silu_mul_grad_op(const mx::array& g, const mx::array& u, const mx::array& c, mx::Stream s) {
  auto stream = cpu_stream({&g, &u}, s);
  auto cd = dense_cotangent(c, g, stream);
  return mx::array::make_arrays({g.shape(), g.shape()}, {mx::float32, mx::float32},
                                std::make_shared<SiluMulGrad>(stream), {dense(g, stream), dense(u, stream), cd});
}

// GELU's tanh approximation (torch's gelu(approximate="tanh")) as x sigmoid(z), z = k (x + a x^3),
// k = 2 sqrt(2 / pi) (0.5 (1 + tanh(t)) = sigmoid(2 t)), in one pass; its VJP in one pass over (x, c):
// dx = c (s + x s (1 - s) k (1 + 3 a x^2)),  s = sigmoid(z).
constexpr float kGeluK = 1.5957691216057308f, kGeluA = 0.044715f;

void gelu_tanh_range(const float* in, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float x = in[i];
    out[i] = x / (1.0f + fast_exp(-kGeluK * (x + kGeluA * x * x * x)));
  }
}

mx::array gelu_tanh_grad_op(const mx::array& x, const mx::array& c, mx::Stream s);

class GeluTanh : public Unary {
 public:
  using Unary::Unary;
  const char* name() const override { return "MlxrlGeluTanh"; }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_elementwise(stream(), inputs[0], outputs[0], gelu_tanh_range);
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>&) override {
    return {gelu_tanh_grad_op(primals[0], cotangents[0], stream())};
  }
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {gelu_tanh_grad_op(primals[0], tangents[0], stream())};  // elementwise: the same product
  }
};

class GeluTanhGrad : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "MlxrlGeluTanhGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  // inputs: x, c; output: dx
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    run_binary(stream(), inputs[0], inputs[1], outputs[0], [](const float* x, const float* c, float* dx, size_t n) {
#pragma omp simd
      for (size_t i = 0; i < n; ++i) {
        const float v = x[i], x2 = v * v;
        const float sg = 1.0f / (1.0f + fast_exp(-kGeluK * (v + kGeluA * x2 * v)));
        dx[i] = c[i] * (sg + v * sg * (1.0f - sg) * kGeluK * (1.0f + 3.0f * kGeluA * x2));
      }
    });
  }
};

mx::array gelu_tanh_op(const mx::array& x, mx::StreamOrDevice s = {}) { return make_unary<GeluTanh>(x, s); }

mx::array gelu_tanh_grad_op(const mx::array& x, const mx::array& c, mx::Stream s) {
  auto stream = cpu_stream({&x}, s);
  auto cd = dense_cotangent(c, x, stream);
  return mx::array(x.shape(), mx::float32, std::make_shared<GeluTanhGrad>(stream), {dense(x, stream), cd});
}

// ----------------------------------------------------------------------------- flash attention

// Attention without the score square (FlashAttention's memory shape): per (batch, kv-head) and block of
// queries, the keys in chunks of kKeyChunk: the block's scores against a chunk stay in a per-worker buffer
// (64 rows x 256 keys, 64 KB: in L2), an online softmax runs over them in place (each row's running max and
// sum; o rescaled when the max grows) and P V accumulates; only the output and each row's log-sum-exp are
// written (with a whole row of scores, 1 MB at 4096 keys, and the old exp: 302-303 against 285-293 ms at
// Qwen3-0.6B's 16/8 heads and 4096 causal tokens, `scripts/bench_attention.py`, alternating processes). The backward recomputes P = exp(S - lse) per block and builds
// dq, dk, dv with the same tiles. The matmuls are the register-tiled micro-kernel `mk_mm` (the C tile in
// registers in the machine's vector width, B packed in panels of 32 columns, k blocked by 128 so a panel block
// stays in L1): the BLAS would pack and zero more than it multiplies at these sizes (K = head_dim = 64-128), and
// each call would send the block's scores through memory.

constexpr int kPanel = 32;                                          // packed B panels: 32 columns
constexpr int kDepth = 128;                                         // k per pass over a panel

inline size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// The small products' micro-kernel (FlashAttention's blocks, the gated delta rule's chunks): C[MR, NV lanes] (+)=
// A B with the C tile in registers, in the machine's own vector width, so the tile fits the register file: with
// AVX-512, 8 x 32 tiles of 16-lane vectors (16 accumulators); otherwise (AVX2, NEON) 6 x 16 tiles of 8-lane ones
// (12 accumulators, 2 for B, 1 broadcast: 15 of 16 AVX2 registers). A tile of 16-lane vectors on an AVX2 machine
// needs 32 registers and spills: ~1.5 GFLOP/s instead of the GEMM rate.
#if defined(__AVX512F__)
constexpr int kMkLanes = 16, kMkRows = 8;
#else
constexpr int kMkLanes = 8, kMkRows = 6;
#endif
typedef float mk_vec __attribute__((vector_size(kMkLanes * sizeof(float)), aligned(4)));

inline mk_vec mk_load(const float* p) { return *reinterpret_cast<const mk_vec*>(p); }
inline void mk_store(float* p, mk_vec v) { *reinterpret_cast<mk_vec*>(p) = v; }

template <int MR, int NV>
inline void mk_tile(int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c, size_t ldc,
                    bool acc) {
  mk_vec r[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) r[i][v] = acc ? mk_load(c + i * ldc + v * kMkLanes) : mk_vec{};
  for (int k = 0; k < K; ++k) {
    const float* bk = b + size_t(k) * ldb;
    mk_vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = mk_load(bk + v * kMkLanes);
    const float* ak_ = a + size_t(k) * ak;
    for (int i = 0; i < MR; ++i) {
      const float x = ak_[i * ai];
      for (int v = 0; v < NV; ++v) r[i][v] += x * bv[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) mk_store(c + i * ldc + v * kMkLanes, r[i][v]);
}

// mk_tile for a tile of mr <= kMkRows rows and nv (1 or 2) vectors of columns.
template <int NV>
void mk_tile_n(int mr, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c, size_t ldc,
               bool acc) {
  switch (mr) {
    case 8: if constexpr (kMkRows >= 8) mk_tile<8, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 7: if constexpr (kMkRows >= 7) mk_tile<7, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 6: mk_tile<6, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 5: mk_tile<5, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 4: mk_tile<4, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 3: mk_tile<3, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 2: mk_tile<2, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    case 1: mk_tile<1, NV>(K, a, ai, ak, b, ldb, c, ldc, acc); break;
    default: break;
  }
}

// What a product may skip (its [c, c] operands are triangular): kLowerA, A(i, k) = 0 for k > i (the inverse,
// P = L * QK); kUpperA, A(i, k) = 0 for k < i (their transposes); kLowerC, only C(i, j) for j <= i is read
// afterwards (K K^T, Q K^T, dO U^T; what lies above is left as it was).
enum MkShape { kFull, kLowerA, kUpperA, kLowerC };

// C[M, N] (+)= A B: A(i, k) = a[i ai + k ak], B row-major [K, N] with row stride ldb, N a multiple of 16.
// Per block of 2 vectors' columns (B's block stays in L1), every tile of rows.
void mk_mm(int M, int N, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, float* c,
           size_t ldc, bool acc, MkShape shape = kFull) {
  for (int j = 0; j < N; j += 2 * kMkLanes) {
    const bool two = N - j >= 2 * kMkLanes;
    for (int i = 0; i < M; i += kMkRows) {
      const int mr = std::min(kMkRows, M - i);
      if (shape == kLowerC && j > i + mr - 1) continue;  // the tile lies above the diagonal
      const int k0 = shape == kUpperA ? std::min(K, i) : 0, k1 = shape == kLowerA ? std::min(K, i + mr) : K;
      const float* ap = a + i * ai + size_t(k0) * ak;
      const float* bp = b + size_t(k0) * ldb + j;
      float* cp = c + i * ldc + j;
      if (two) {
        mk_tile_n<2>(mr, std::max(0, k1 - k0), ap, ai, ak, bp, ldb, cp, ldc, acc);
      } else {
        mk_tile_n<1>(mr, std::max(0, k1 - k0), ap, ai, ak, bp, ldb, cp, ldc, acc);
      }
    }
  }
}

// C[M, N] (+)= A[M, K] B[K, N]: A(i, k) = a[i ai + k ak]; B(k, j) = b[(j / kPanel) panel + k ldb + j % kPanel]:
// panels packed by pack_panels (ldb = kPanel, panel = K kPanel) or a row-major matrix (ldb its row stride,
// panel = kPanel; its rows readable up to N); N a multiple of 16, C's rows ldc apart.
void panel_gemm(int M, int N, int K, const float* a, size_t ai, size_t ak, const float* b, size_t ldb, size_t panel,
                float* c, size_t ldc, bool acc) {
  if (K == 0) {
    if (!acc)
      for (int i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return;
  }
  for (int k0 = 0; k0 < K; k0 += kDepth) {
    const int kk = std::min(kDepth, K - k0);
    const bool add = acc || k0 > 0;
    for (int j0 = 0; j0 < N; j0 += kPanel) {
      const float* bp = b + size_t(j0 / kPanel) * panel + size_t(k0) * ldb;
      const float* ap = a + size_t(k0) * ak;
      mk_mm(M, std::min(kPanel, N - j0), kk, ap, ai, ak, bp, ldb, c + j0, ldc, add);
    }
  }
}

// Packs B(k, j) = src[k sk + j sj] (k < K, j < N) into panels of kPanel columns, K rows each, zero past N.
void pack_panels(const float* src, size_t sk, size_t sj, int K, int N, float* dst) {
  const int panels = int(round_up(N, kPanel) / kPanel);
  for (int p = 0; p < panels; ++p) {
    float* d = dst + size_t(p) * K * kPanel;
    for (int k = 0; k < K; ++k)
      for (int jj = 0; jj < kPanel; ++jj) {
        const int j = p * kPanel + jj;
        d[size_t(k) * kPanel + jj] = j < N ? src[k * sk + j * sj] : 0.0f;
      }
  }
}

// Float scratch from MLX's allocator (its buffer cache: the next call reuses the pages), made on the
// dispatching thread and freed when it goes out of scope.
class Scratch {
 public:
  float* take(size_t n) {
    bufs_.push_back(mx::allocator::malloc(sizeof(float) * std::max<size_t>(n, 1)));
    return static_cast<float*>(bufs_.back().buffer().raw_ptr());
  }

 private:
  std::vector<mx::allocator::Data> bufs_;
};

// Runs fn(worker, item) for item in [0, n) on min(workers, n) threads, items taken in order as workers
// free up (the first items should be the longest).
template <class F>
void parallel_items(size_t n, size_t workers, F fn) {
  workers = std::max<size_t>(1, std::min(workers, n));
  std::atomic<size_t> next{0};
  auto run = [&](size_t w) {
    for (size_t i = next++; i < n; i = next++) fn(w, i);
  };
  std::vector<std::thread> threads;
  for (size_t w = 1; w < workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (auto& t : threads) t.join();
}

// Keys per pass of both attention kernels: a block's [rows, chunk] scores and, in the backward, a chunk's
// [Dp, chunk] dk^T / dv^T stay in L2.
constexpr int kKeyChunk = 256;

// Rows per block: the forward's blocks are large, so each chunk of k / v (streamed from beyond L2: 4 MB packed
// per group at 4096 keys) serves more rows before the next (alternating processes: 512 rows against 64 took
// the forward 0.44-0.47 -> 0.33-0.34 s on Qwen3-VL's tower shape, ~0.30 -> ~0.28 s at Qwen3-0.6B's 16/8 heads
// at 4096 causal tokens), halved while there would be fewer than 4 blocks a worker; the backward's stay at 64
// (larger ones ran ~2% slower: its dk / dv chunks are the reused side).
constexpr int kForwardRows = 512;
constexpr int kBackwardRows = 64;

// q [B, G, rep, L, D] (scaled), k / v [B, G, S, D]: G kv-heads, each shared by rep query heads; causal:
// query i sees keys j <= i + S - L. A block is bq queries of every head of a group, stacked as rep x bq
// rows (row h bq + t is query r0 + t of head h), so the group's k / v panels serve ~`target` rows at a time.
struct AttnDims {
  int B, G, rep, L, S, D;
  bool causal;
  int Dp, bq, rows, blocks;
  int chunk;   // keys per pass (kKeyChunk, fewer for short rows): a multiple of kPanel
  size_t ldc;  // the score buffers' row stride: past a multiple of the cache's alias stride
  AttnDims(const mx::array& q, const mx::array& k, bool c, int target)
      : B(q.shape(0)), G(q.shape(1)), rep(q.shape(2)), L(q.shape(3)), S(k.shape(2)), D(q.shape(4)), causal(c) {
    Dp = int(round_up(D, 16));
    const size_t groups = size_t(B) * G, enough = 4 * size_t(worker_count());
    for (; target > 64; target /= 2) {  // fewer rows while the blocks would not keep every worker busy
      const int b = std::max(1, target / std::max(1, rep));
      if (groups * ((size_t(L) + b - 1) / b) >= enough) break;
    }
    bq = std::max(1, target / std::max(1, rep));
    bq = std::min(bq, std::max(1, L));
    rows = rep * bq;
    blocks = L == 0 ? 0 : (L + bq - 1) / bq;
    chunk = std::min(kKeyChunk, int(round_up(std::max(S, 1), kPanel)));
    ldc = size_t(chunk) + 16;
  }
  int seen(int r1) const { return causal ? std::min(S, r1 + S - L) : S; }  // keys a block ending at r1 sees
  int limit(int i) const { return causal ? std::min(S, i + S - L + 1) : S; }  // keys query i sees
};

// The keys [start, end) batch row b attends to (bounds int32 [B, 2]; none: all S), clamped to [0, S].
struct KeyWindow {
  int start, end;
  KeyWindow(const int32_t* bounds, int b, int S)
      : start(bounds ? std::clamp(bounds[2 * b], 0, S) : 0),
        end(bounds ? std::clamp(bounds[2 * b + 1], start, S) : S) {}
};

// The rows of block [r0, r1) of one group of x [.., rep, L, D] (group offset x0) into tile [rep n, Dp]
// (zero past D), and back (first D columns, row i times scale[i] when scale is given).
void gather_rows(const AttnDims& d, const float* x0, int r0, int n, float* tile) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const float* src = x0 + (size_t(h) * d.L + r0 + t) * d.D;
      float* dst = tile + size_t(h * n + t) * d.Dp;
      std::copy(src, src + d.D, dst);
      std::fill(dst + d.D, dst + d.Dp, 0.0f);
    }
}

void scatter_rows(const AttnDims& d, const float* tile, int r0, int n, float* x0, const float* scale) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const int i = h * n + t;
      const float* src = tile + size_t(i) * d.Dp;
      float* dst = x0 + (size_t(h) * d.L + r0 + t) * d.D;
      if (scale == nullptr) {
        std::copy(src, src + d.D, dst);
      } else {
        const float s = scale[i];
#pragma omp simd
        for (int c = 0; c < d.D; ++c) dst[c] = src[c] * s;
      }
    }
}

// x0's rows of block [r0, r1) += tile's (first D columns).
void add_rows(const AttnDims& d, const float* tile, int r0, int n, float* x0) {
  for (int h = 0; h < d.rep; ++h)
    for (int t = 0; t < n; ++t) {
      const float* src = tile + size_t(h * n + t) * d.Dp;
      float* dst = x0 + (size_t(h) * d.L + r0 + t) * d.D;
#pragma omp simd
      for (int c = 0; c < d.D; ++c) dst[c] += src[c];
    }
}

std::vector<mx::array> flash_attention_grad_op(const std::vector<mx::array>& inputs, bool causal, mx::Stream s);

// inputs q, k, v[, bounds]; outputs o [B, G, rep, L, D], lse [B, G, rep, L]. bounds int32 [B, 2]: batch row b
// sees keys [start, end) only (a padded row's keys); a query that sees no key gets o = 0 and lse = -inf.
class FlashAttention : public WithCausal<CpuPrimitive> {
 public:
  FlashAttention(mx::Stream s, bool causal)
      : WithCausal(s, causal, "MlxrlFlashAttention", "MlxrlCausalFlashAttention") {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto lse = inputs[0].shape();
    lse.pop_back();
    return {inputs[0].shape(), lse};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = AttnDims(inputs[0], inputs[1], causal_, kForwardRows), qp = inputs[0].data<float>(),
                      kp = inputs[1].data<float>(), vp = inputs[2].data<float>(), op = outputs[0].data<float>(),
                      lp = outputs[1].data<float>(), bp = inputs.size() > 3 ? inputs[3].data<int32_t>() : nullptr]() {
      const size_t heads = size_t(d.B) * d.G;
      if (heads == 0 || d.blocks == 0) return;
      const size_t kt_size = size_t(d.D) * round_up(d.S, kPanel), v_size = size_t(d.S) * round_up(d.Dp, kPanel);
      const size_t workers = std::min<size_t>(worker_count(), heads * d.blocks);
      Scratch scratch;
      float* kt = scratch.take(heads * kt_size);  // k^T per group: panels of D rows x 32 keys
      float* vpk = scratch.take(heads * v_size);  // v per group: panels of S rows x 32 columns
      std::vector<float*> qtile(workers), stile(workers), otile(workers), mtile(workers), ltile(workers), atile(workers);
      for (size_t w = 0; w < workers; ++w) {
        qtile[w] = scratch.take(size_t(d.rows) * d.Dp);
        otile[w] = scratch.take(size_t(d.rows) * d.Dp);
        stile[w] = scratch.take(size_t(d.rows) * d.ldc);
        mtile[w] = scratch.take(size_t(d.rows));  // each row's running max, sum and the chunk's rescale
        ltile[w] = scratch.take(size_t(d.rows));
        atile[w] = scratch.take(size_t(d.rows));
      }
      parallel_items(heads, workers, [&](size_t, size_t g) {
        const float* k0 = kp + g * d.S * d.D;
        pack_panels(k0, 1, d.D, d.D, d.S, kt + g * kt_size);
        pack_panels(vp + g * d.S * d.D, d.D, 1, d.S, d.D, vpk + g * v_size);
      });
      // items: (group, block), the blocks that see the most keys first. Per block, the keys in chunks with a
      // running max and sum per row (FlashAttention's online softmax): o is rescaled when the max grows.
      const size_t items = heads * d.blocks;
      parallel_items(items, workers, [&](size_t w, size_t item) {
        const size_t g = item % heads;
        const KeyWindow win(bp, int(g / d.G), d.S);
        const int blk = d.causal ? d.blocks - 1 - int(item / heads) : int(item / heads);
        const int r0 = blk * d.bq, n = std::min(d.bq, d.L - r0), rows = d.rep * n;
        const int seen = std::min(win.end, d.seen(r0 + n));
        const size_t group = g * d.rep * d.L;  // the group's first row of q / o / lse
        float *qt = qtile[w], *st = stile[w], *ot = otile[w], *m = mtile[w], *l = ltile[w], *alpha = atile[w];
        gather_rows(d, qp + group * d.D, r0, n, qt);
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        bool first = true;
        for (int j0 = win.start / kPanel * kPanel; j0 < seen; j0 += d.chunk) {
          const int cnt = std::min(seen, j0 + d.chunk) - j0, ncols = int(round_up(cnt, 16));
          panel_gemm(rows, ncols, d.D, qt, d.Dp, 1, kt + g * kt_size + size_t(j0 / kPanel) * d.D * kPanel, kPanel,
                     size_t(d.D) * kPanel, st, d.ldc, false);
          for (int i = 0; i < rows; ++i) {
            const int t = i % n;
            const int lo = std::max(win.start, j0) - j0, hi = std::min({win.end, d.limit(r0 + t), j0 + cnt}) - j0;
            float* x = st + size_t(i) * d.ldc;
            alpha[i] = 1.0f;
            if (hi <= lo) {  // no key of this chunk
              std::fill(x, x + ncols, 0.0f);
              continue;
            }
            const float mn = std::max(m[i], row_max(x + lo, hi - lo));
            const float sum = exp_shift_sum(x + lo, x + lo, hi - lo, mn);
            std::fill(x, x + lo, 0.0f);
            std::fill(x + hi, x + ncols, 0.0f);
            alpha[i] = std::exp(m[i] - mn);  // 0 while the row had no key
            l[i] = l[i] * alpha[i] + sum;
            m[i] = mn;
          }
          if (!first)
            for (int i = 0; i < rows; ++i)
              if (alpha[i] != 1.0f) {
                float* o = ot + size_t(i) * d.Dp;
#pragma omp simd
                for (int c = 0; c < d.Dp; ++c) o[c] *= alpha[i];
              }
          panel_gemm(rows, d.Dp, cnt, st, d.ldc, 1, vpk + g * v_size + size_t(j0) * kPanel, kPanel,
                     size_t(d.S) * kPanel, ot, d.Dp, !first);
          first = false;
        }
        if (first) std::fill(ot, ot + size_t(rows) * d.Dp, 0.0f);  // the block sees no key
        for (int i = 0; i < rows; ++i) {
          const int h = i / n, t = i % n;
          lp[group + size_t(h) * d.L + r0 + t] = l[i] > 0.0f ? m[i] + std::log(l[i]) : -std::numeric_limits<float>::infinity();
          l[i] = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // no key: o = 0
        }
        scatter_rows(d, ot, r0, n, op + group * d.D, l);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    auto s = stream();
    std::vector<mx::array> in{primals[0], primals[1], primals[2], outputs[0], outputs[1],
                              mx::astype(cotangents[0], mx::float32, s), mx::astype(cotangents[1], mx::float32, s)};
    if (primals.size() > 3) in.push_back(primals[3]);
    auto grads = flash_attention_grad_op(in, causal_, s);
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(a < 3 ? grads[a] : mx::zeros_like(primals[a], s));
    return out;
  }
};

// inputs q, k, v, o, lse, dO, dlse[, bounds]; outputs dq, dk, dv. Per group (one worker each): k^T, k and v^T
// packed once; then per chunk of kKeyChunk keys, every block of queries that sees one of them: P = exp(S - lse),
// dP = dO v^T, dS = P (dP - rowsum(dO o) + dlse), dq += dS k, dv += P^T dO, dk += dS^T q (d lse / dS = P: the
// cotangent of lse adds to every key's term). The backward needs no softmax statistic beyond lse, so the keys
// split freely: a chunk's dk^T / dv^T ([Dp, chunk]) and the block's P / dS ([rows, chunk]) stay in L2 while the
// blocks accumulate into them, where [Dp, S] ones (2 MB each at 4096 keys) went to L3 and back once per block
// (a `/tmp` probe calling the kernel, alternating builds: the chunks took the backward from ~0.80 to ~0.70 s
// at Qwen3's 16/8 heads of 128 and 4096 causal tokens).

class FlashAttentionGrad : public WithCausal<CpuPrimitive> {
 public:
  FlashAttentionGrad(mx::Stream s, bool causal)
      : WithCausal(s, causal, "MlxrlFlashAttentionGrad", "MlxrlCausalFlashAttentionGrad") {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    encode_outputs(stream(), inputs, outputs).dispatch([d = AttnDims(inputs[0], inputs[1], causal_, kBackwardRows), qp = inputs[0].data<float>(),
                      kp = inputs[1].data<float>(), vp = inputs[2].data<float>(), op = inputs[3].data<float>(),
                      lp = inputs[4].data<float>(), gp = inputs[5].data<float>(), dlp = inputs[6].data<float>(),
                      bp = inputs.size() > 7 ? inputs[7].data<int32_t>() : nullptr, dq = outputs[0].data<float>(),
                      dk = outputs[1].data<float>(), dv = outputs[2].data<float>()]() {
      const size_t heads = size_t(d.B) * d.G;
      if (heads == 0) return;
      const size_t SD = size_t(d.S) * d.D;
      std::fill(dq, dq + heads * d.rep * size_t(d.L) * d.D, 0.0f);  // accumulated over the chunks
      if (d.blocks == 0) {  // no queries: no gradient for k, v
        std::fill(dk, dk + heads * SD, 0.0f);
        std::fill(dv, dv + heads * SD, 0.0f);
        return;
      }
      const int chunk = d.chunk;
      const size_t Spad = round_up(d.S, kPanel), Dpp = round_up(d.Dp, kPanel), ldc = d.ldc;
      const size_t workers = std::min<size_t>(worker_count(), heads);
      Scratch scratch;
      struct Work {
        float *kt, *kk, *vt, *dkt, *dvt, *qt, *gt, *st, *pt, *dqt, *delta;
      };
      std::vector<Work> work(workers);
      for (auto& w : work) {
        w.kt = scratch.take(size_t(d.D) * Spad);    // k^T panels (scores)
        w.vt = scratch.take(size_t(d.D) * Spad);    // v^T panels (dP)
        w.kk = scratch.take(size_t(d.S) * Dpp);     // k panels (dq)
        w.dkt = scratch.take(size_t(d.Dp) * ldc);  // the chunk's dk^T, dv^T [Dp, chunk]: P / dS rows are B
        w.dvt = scratch.take(size_t(d.Dp) * ldc);
        w.qt = scratch.take(size_t(d.rows) * d.Dp);
        w.gt = scratch.take(size_t(d.rows) * d.Dp);
        w.st = scratch.take(size_t(d.rows) * ldc);  // scores, then P
        w.pt = scratch.take(size_t(d.rows) * ldc);  // dP, then dS
        w.dqt = scratch.take(size_t(d.rows) * d.Dp);
        w.delta = scratch.take(size_t(d.rep) * d.L);  // the group's rows' rowsum(dO o) - dlse
      }
      parallel_items(heads, workers, [&](size_t wi, size_t g) {
        Work& w = work[wi];
        const float *k0 = kp + g * SD, *v0 = vp + g * SD;
        pack_panels(k0, 1, d.D, d.D, d.S, w.kt);
        pack_panels(v0, 1, d.D, d.D, d.S, w.vt);
        pack_panels(k0, d.D, 1, d.S, d.D, w.kk);
        const size_t group = g * d.rep * d.L;
        const KeyWindow win(bp, int(g / d.G), d.S);
        float *dkg = dk + g * SD, *dvg = dv + g * SD;
        for (size_t i = 0; i < size_t(d.rep) * d.L; ++i) {  // once per row, not per chunk
          const float *orow = op + (group + i) * d.D, *grow = gp + (group + i) * d.D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int c = 0; c < d.D; ++c) s += orow[c] * grow[c];
          w.delta[i] = s - dlp[group + i];
        }
        for (int j0 = 0; j0 < d.S; j0 += chunk) {
          const int j1 = std::min(d.S, j0 + chunk);
          std::fill(w.dkt, w.dkt + size_t(d.Dp) * ldc, 0.0f);
          std::fill(w.dvt, w.dvt + size_t(d.Dp) * ldc, 0.0f);
          for (int blk = d.blocks - 1; blk >= 0 && j1 > win.start; --blk) {
            const int r0 = blk * d.bq, n = std::min(d.bq, d.L - r0), rows = d.rep * n;
            const int cnt = std::min({win.end, d.seen(r0 + n), j1}) - j0;  // the chunk's keys the block sees
            if (cnt <= 0) {
              if (d.causal) break;  // the blocks above see fewer keys
              continue;
            }
            const int ncols = int(round_up(cnt, 16));
            gather_rows(d, qp + group * d.D, r0, n, w.qt);
            gather_rows(d, gp + group * d.D, r0, n, w.gt);
            const size_t panel0 = size_t(j0 / kPanel) * d.D * kPanel;  // the chunk's first k^T / v^T panel
            panel_gemm(rows, ncols, d.D, w.qt, d.Dp, 1, w.kt + panel0, kPanel, size_t(d.D) * kPanel, w.st, ldc, false);
            panel_gemm(rows, ncols, d.D, w.gt, d.Dp, 1, w.vt + panel0, kPanel, size_t(d.D) * kPanel, w.pt, ldc, false);
            for (int i = 0; i < rows; ++i) {
              const int h = i / n, t = i % n;
              const int lo = std::max(win.start, j0) - j0, hi = std::min({win.end, d.limit(r0 + t), j1}) - j0;
              const size_t row = size_t(h) * d.L + r0 + t;  // within the group
              const float l = lp[group + row], de = w.delta[row];
              float* x = w.st + size_t(i) * ldc;
              float* y = w.pt + size_t(i) * ldc;
              if (hi <= lo) {  // no key here: P = dS = 0
                std::fill(x, x + ncols, 0.0f);
                std::fill(y, y + ncols, 0.0f);
                continue;
              }
              std::fill(x, x + lo, 0.0f);
              std::fill(y, y + lo, 0.0f);
              int j = lo;
              for (; j + 16 <= hi; j += 16) {
                const vf16 p = vexp(load16(x + j) - l);
                store16(x + j, p);
                store16(y + j, p * (load16(y + j) - de));
              }
              for (; j < hi; ++j) {
                const float p = fast_exp(x[j] - l);
                x[j] = p;
                y[j] = p * (y[j] - de);
              }
              std::fill(x + hi, x + ncols, 0.0f);  // read as B up to ncols below
              std::fill(y + hi, y + ncols, 0.0f);
            }
            // dq += dS k
            panel_gemm(rows, d.Dp, cnt, w.pt, ldc, 1, w.kk + size_t(j0) * kPanel, kPanel, size_t(d.S) * kPanel, w.dqt,
                       d.Dp, false);
            add_rows(d, w.dqt, r0, n, dq + group * d.D);
            // dv^T += dO^T P, dk^T += q^T dS: A the block's dO / q read transposed (in L1), B the rows of P / dS
            panel_gemm(d.Dp, ncols, rows, w.gt, 1, d.Dp, w.st, ldc, kPanel, w.dvt, ldc, true);
            panel_gemm(d.Dp, ncols, rows, w.qt, 1, d.Dp, w.pt, ldc, kPanel, w.dkt, ldc, true);
          }
          for (int j = j0; j < j1; ++j)
            for (int c = 0; c < d.D; ++c) {
              dkg[size_t(j) * d.D + c] = w.dkt[c * ldc + j - j0];
              dvg[size_t(j) * d.D + c] = w.dvt[c * ldc + j - j0];
            }
        }
      });
    });
  }
};

std::vector<mx::array> flash_attention_grad_op(const std::vector<mx::array>& inputs, bool causal, mx::Stream s) {
  std::vector<mx::array> dense_inputs;
  for (auto& a : inputs) dense_inputs.push_back(dense(a, s));  // (dO and dlse: float32 already)
  return mx::array::make_arrays({inputs[0].shape(), inputs[1].shape(), inputs[2].shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<FlashAttentionGrad>(s, causal), dense_inputs);
}

std::vector<mx::array> flash_attention_op(const mx::array& q, const mx::array& k, const mx::array& v, bool causal,
                                          const std::optional<mx::array>& bounds, mx::StreamOrDevice s = {}) {
  auto stream = cpu_stream({&q, &k, &v}, s);
  if (q.ndim() != 5 || k.ndim() != 4 || v.shape() != k.shape() || q.shape(0) != k.shape(0) ||
      q.shape(1) != k.shape(1) || q.shape(4) != k.shape(3))
    throw std::invalid_argument("flash_attention: q [B, G, rep, L, D], k and v [B, G, S, D] expected.");
  if (causal && q.shape(3) > k.shape(2))
    throw std::invalid_argument("flash_attention: causal attention needs L <= S (queries are the last L keys).");
  std::vector<mx::array> in{dense(q, stream), dense(k, stream), dense(v, stream)};
  if (bounds) {
    if (bounds->ndim() != 2 || bounds->shape(0) != q.shape(0) || bounds->shape(1) != 2)
      throw std::invalid_argument("flash_attention: bounds are [B, 2] (each row's first and past-last key).");
    in.push_back(dense(mx::astype(*bounds, mx::int32, stream), stream));
  }
  auto lse = q.shape();
  lse.pop_back();
  return mx::array::make_arrays({q.shape(), lse}, {mx::float32, mx::float32},
                                std::make_shared<FlashAttention>(stream, causal), in);
}

// ------------------------------------------------------------------------------ the gated delta rule

// Forward and backward of Qwen3.5's Gated DeltaNet core, in its own file (a .cpp so that the package data ships it)
// but compiled here, inside this namespace: it uses the helpers above.
#include "gated_delta.cpp"

// Its convolution with the SiLU, split into q / k / v, and the VJP (causal_conv.cpp, compiled here as above).
#include "causal_conv.cpp"

// ------------------------------------------------------------------------------ mixture-of-experts matmuls

// An MoE layer's gathered matmuls, one GEMM per expert over its rows (experts.cpp, compiled here as above).
#include "experts.cpp"

}  // namespace

NB_MODULE(_cpu_math, m) {
  m.doc() = "mlxrl's vectorised, multi-threaded CPU kernels (float32): exp, sigmoid, softmax (last axis), "
            "sum of squares, the AdamW step, the fused LM head, dropout (and LoRA's dropout + down-projection), "
            "RMSNorm, rotary embedding, SwiGLU, FlashAttention, the gated delta rule and its causal convolution.";
  m.def("drain_bytes", &drain_bytes,
        "Output size from which a kernel finishes the stream's queued work before allocating (MLXRL_DRAIN_BYTES).");
  m.def("exp", [](const mx::array& x) { return fast_exp_op(x); }, nb::arg("x"));
  m.def("sigmoid", [](const mx::array& x) { return fast_sigmoid_op(x); }, nb::arg("x"));
  m.def("softmax", [](const mx::array& x) { return fast_softmax_op(x); }, nb::arg("x"), "Softmax over the last axis.");
  m.def("softmax_grad", [](const mx::array& y, const mx::array& g) { return softmax_grad_op(y, g); }, nb::arg("y"),
        nb::arg("g"), "The softmax's VJP from its output y and cotangent g: y (g - sum(g y, -1)).");
  m.def("adamw_step", &adamw_step_op, nb::arg("g"), nb::arg("w"), nb::arg("m"), nb::arg("v"), nb::arg("hyper"),
        nb::arg("weight_decay"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        "One AdamW step (torch's arithmetic); hyper = [grad scale, lr, 1/(1-b1^t), 1/sqrt(1-b2^t)]. "
        "Returns (w, m, v).");
  m.def("adamw8_step", &adamw8_step_op, nb::arg("g"), nb::arg("w"), nb::arg("m_codes"), nb::arg("m_max"),
        nb::arg("v_codes"), nb::arg("v_max"), nb::arg("maps"), nb::arg("luts"), nb::arg("hyper"),
        nb::arg("weight_decay"),
        nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        "One 8-bit blockwise AdamW step (bitsandbytes' scheme; hyper as adamw_step). Returns (w, m codes, m "
        "maxima, v codes, v maxima).");
  m.def("sum_squares", &sum_squares_op, nb::arg("x"), "sum(x^2) as a float32 scalar (accumulated in double).");
  m.def("fused_head", &fused_head_op, nb::arg("h"), nb::arg("weight"), nb::arg("targets"), nb::arg("w"),
        nb::arg("inv_t"), nb::arg("mode"), nb::arg("chunk_rows"), nb::arg("with_entropy"), nb::arg("weight_grad"),
        "The LM head and a token-separable loss (mode 0 nll, 1 dft) over row chunks: (loss, logp, entropy, "
        "argmax, d_hidden, d_weight), the gradients of loss = sum w_i l_i.");
  m.def("dropout", [](const mx::array& x, const mx::array& key, float keep) { return dropout_op(x, key, keep); },
        nb::arg("x"), nb::arg("key"), nb::arg("keep"),
        "x * mask / keep with mask_i = hash(key, i) < keep (a uint32[2] key: the same key, the same mask).");
  m.def("lora_down", [](const mx::array& x, const mx::array& key, const mx::array& a, float keep) {
          return lora_down_op(x, key, a, keep);
        }, nb::arg("x"), nb::arg("key"), nb::arg("a"), nb::arg("keep"),
        "dropout(x, key, keep) @ a for a LoRA adapter's a [d, r], without the dropout copy (dropout's mask).");
  m.def("rms_norm", [](const mx::array& x, const mx::array& w, float eps) { return rms_norm_op(x, w, eps); },
        nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.");
  m.def("rotary", [](const mx::array& x, const mx::array& cos, const mx::array& sin) {
          return rotary_op(x, cos, sin, false);
        }, nb::arg("x"), nb::arg("cos"), nb::arg("sin"),
        "Rotary embedding of x [B, H, L, D] (any strides): x cos + rotate_half(x) sin, cos / sin broadcast to x.");
  m.def("gelu_tanh", [](const mx::array& x) { return gelu_tanh_op(x); }, nb::arg("x"),
        "GELU's tanh approximation, x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)).");
  m.def("layer_norm", [](const mx::array& x, const mx::array& w, const mx::array& b, float eps) {
          return layer_norm_op(x, w, b, eps);
        }, nb::arg("x"), nb::arg("weight"), nb::arg("bias"), nb::arg("eps"),
        "LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.");
  m.def("silu_mul", [](const mx::array& g, const mx::array& u) { return silu_mul_op(g, u); }, nb::arg("g"),
        nb::arg("u"), "silu(g) * u (the SwiGLU product).");
  m.def("flash_attention", [](const mx::array& q, const mx::array& k, const mx::array& v, bool causal,
                              const std::optional<mx::array>& bounds, bool return_lse) -> nb::object {
          auto out = flash_attention_op(q, k, v, causal, bounds);
          return return_lse ? nb::cast(out) : nb::cast(out[0]);
        }, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("causal"), nb::arg("bounds") = nb::none(),
        nb::arg("return_lse") = false,
        "softmax(q k^T) v for scaled q [B, G, rep, L, D] and k / v [B, G, S, D] without the score square "
        "(causal: query i sees keys j <= i + S - L; bounds int32 [B, 2]: row b sees keys [start, end) only, "
        "a query seeing none gives 0 and lse -inf); return_lse: [o, the rows' log-sum-exp [B, G, rep, L]], "
        "both differentiable. Its VJP recomputes the scores per block of queries.");
  m.def("flash_attention_grad", [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& o,
                                   const mx::array& lse, const mx::array& d_out, const mx::array& d_lse, bool causal,
                                   const std::optional<mx::array>& bounds) {
          auto s = cpu_stream({&q, &k, &v, &o, &lse});
          std::vector<mx::array> in{q, k, v, o, lse, mx::astype(d_out, mx::float32, s), mx::astype(d_lse, mx::float32, s)};
          if (bounds) in.push_back(mx::astype(*bounds, mx::int32, s));
          return flash_attention_grad_op(in, causal, s);
        }, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("lse"), nb::arg("d_out"), nb::arg("d_lse"),
        nb::arg("causal"), nb::arg("bounds") = nb::none(),
        "flash_attention's VJP from its inputs, outputs (o, lse) and their cotangents: [dq, dk, dv] (the scores "
        "recomputed per block of queries, as in the backward of flash_attention).");
  m.def("gated_delta", &gated_delta_op, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
        nb::arg("state"), nb::arg("starts"), nb::arg("chunk"), nb::arg("scale"), nb::arg("l2norm"),
        "The gated delta rule over a sequence (mlxrl.models.gated_delta's chunked form; float32 q, k [B, T, Hk, dk], "
        "v [B, T, Hv, dv], g, beta [B, T, Hv], state [B, Hv, dk, dv], starts bool [B, T]): [out, final state, the "
        "states at the chunk starts [N, B, Hv, dk, dv]].");
  m.def("gated_delta_grad", &gated_delta_backward_op, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("starts"), nb::arg("saved"), nb::arg("d_out"), nb::arg("d_final"), nb::arg("chunk"),
        nb::arg("scale"), nb::arg("l2norm"),
        "gated_delta's VJP from its inputs, the saved chunk-start states and the cotangents of (out, final state): "
        "[dq, dk, dv, dg, dbeta, d_state], each chunk recomputed from its start state, last chunk first.");
  m.def("causal_conv_silu", &causal_conv_silu_op, nb::arg("x"), nb::arg("weight"), nb::arg("state"), nb::arg("starts"),
        nb::arg("widths"), nb::arg("documents"),
        "silu(depthwise causal conv over time) of x [B, L, C] with weight [C, 1, K], the K - 1 rows before x (state "
        "[B, K - 1, C]) and, when documents, the document starts (bool [B, L]: no tap crosses a start, the state "
        "is not read), split into parts [B, L, width] side by side: [*parts, the last K - 1 rows of (state, x)].");
  m.def("expert_matmul", &expert_matmul_op, nb::arg("x"), nb::arg("w"), nb::arg("experts"),
        "x [M, in] rows sorted by expert times their expert's w [E, out, in] transposed: [M, out], one GEMM per "
        "expert (experts [M], non-decreasing), differentiable in x and w.");
  m.def("threads", &worker_count);
}
