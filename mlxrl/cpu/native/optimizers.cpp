// The optimizer's kernels: the sum of squares behind the gradient norm, the AdamW step (each new array taking its
// old one's buffer) and bitsandbytes' 8-bit blockwise AdamW step.

#include "common.h"

namespace {

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
// of a multi-output primitive holds its own reference to the inputs (one 3-output kernel allocates new w, m
// and v every step, the figure in docs/benchmarks.md; these three allocate nothing).
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

}  // namespace
