// What the kernel families of mlxrl's native CPU kernels share (each family's source includes it; bindings.cpp
// compiles them all as one translation unit): the includes, the BLAS's sgemm, the vectorised exp with the row max
// and exp-sum loops built on it, the threading helpers (contiguous parts over the workers, items taken in order,
// per-call scratch) and what every MLX primitive here shares (output buffers and the queue's drain, the command
// encoder, the CpuPrimitive / Unary bases, the float32 CPU stream, dense inputs).
//
// Why: MLX's Linux CPU wheel is built for baseline x86-64, so its exp / sigmoid / softmax are scalar
// loops whose fma calls go through libm, far slower than a multiply (the figures: docs/benchmarks.md, "Figures
// behind the code's choices"). These kernels are compiled on the user's machine by mlxrl.cpu.native (g++ -O3
// -march=native, like MLX's own CPU JIT), so the loops vectorise, and large arrays are split over the cores.
//
// The exp is the Cephes algorithm MLX itself uses (2^t = 2^n * 2^f, n = round(t), a degree-6
// polynomial for 2^f on [-0.5, 0.5], 2^n from the exponent bits), written branch-free. Outside
// [-87.3, 88.72] it gives what IEEE exp gives: 0 below (exactly 0 from -88.03 down), +inf above,
// NaN stays NaN. Inputs must be float32 (the Python side falls back to MLX's ops otherwise).

#pragma once

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

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "mlx/transforms.h"

namespace mx = mlx::core;

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
// and stores. The loops below that reduce (max, sum) keep four / two accumulators, independent chains the core
// overlaps, where a vectorised `omp simd reduction(max)` is one compare-and-blend chain (the figures:
// docs/benchmarks.md).
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

inline size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

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

// n bfloat16 values (their bits) as float32, in parallel: exact, widening only appends 16 zero bits (a frozen
// weight kept in the checkpoint's dtype under float32 compute, mlxrl.models.widened: the fused head's blocks,
// the expert stacks' matrices).
inline void widen_rows(const uint16_t* src, float* dst, size_t n) {
  parallel_for(n, kGrain, [=](size_t, size_t b, size_t e) {
#pragma omp simd
    for (size_t i = b; i < e; ++i) {
      const uint32_t bits = uint32_t(src[i]) << 16;
      std::memcpy(dst + i, &bits, sizeof bits);
    }
  });
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

// ---------------------------------------------------------------------------------- primitives

// MLX's CPU evaluation runs ahead of its worker: the main thread encodes up to ~100 operations (10 tasks
// of 10 dispatches) before it waits, and each operation's output buffer is allocated when it is encoded,
// while the inputs of the queued operations are freed only when those run. In a backward pass that is up
// to ~100 outputs alive beside everything they will free (a checkpointed layer's peak above its inputs:
// docs/benchmarks.md). Before allocating a large output, the stream's queued work is finished
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

// fn(first_row, n_rows) over [0, rows) in parallel parts of at least kGrain elements.
template <class F>
void over_rows(size_t rows, size_t cols, F fn) {
  parallel_for(rows, std::max<size_t>(1, kGrain / std::max<size_t>(1, cols)),
               [=](size_t, size_t b, size_t e) { fn(b, e - b); });
}

template <class P>
mx::array make_unary(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = cpu_stream({&x}, s);
  auto in = dense(x, stream);
  return mx::array(in.shape(), mx::float32, std::make_shared<P>(stream), {in});
}

}  // namespace
