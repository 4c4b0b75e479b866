// The decoder's and the vision towers' non-matmul work, fused and spread over the cores (MLX runs each of
// its ops on one core, one pass per op): RMSNorm and LayerNorm (forward and VJP), rotary embedding (forward =
// its VJP with the rotation reversed), the SwiGLU product silu(g) u and GELU's tanh form (forward and VJP).

#include "common.h"

namespace {

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

}  // namespace
