// Qwen3.5's Gated DeltaNet convolution: the depthwise causal convolution over time with its SiLU, split into the
// q / k / v parts, and its VJP, float32, as two MLX primitives. Not a translation unit of its own: bindings.cpp
// #includes it (it uses common.h's fast_exp, parallel_items, worker_count and primitive helpers). The arithmetic
// is `mlxrl.models.qwen3_5.text`'s `_conv_qkv`:
//
//   c[t] = sum_j w[:, j] in[t - K + 1 + j]   (in: the K - 1 state rows, then x; with documents, a tap counts
//                                              only when its row is in t's document, and the state never does)
//   y[t] = c[t] sigmoid(c[t]), written into the parts' outputs [B, L, width_i] side by side;
//   dc[t] = dy[t] s (1 + c (1 - s)),  d_in[p] = sum_j w[:, j] dc[p + K - 1 - j],  dw[:, j] = sum_t in[t-K+1+j] dc[t].
//
// One item per block of channels (every batch row inside it, so the block owns its weight gradient's rows).
// The forward runs the positions in order; the backward in reverse, keeping the K newest rows of dc in a ring,
// so that a position's input gradient is complete as soon as its own dc is known. Nothing [L, C] is made but the
// outputs: MLX's graph of the same (`_conv_qkv` on the graph path) materialises the padded input, c, the
// concatenated cotangent, dc and its padded copy.

#include "common.h"

namespace {

constexpr int kConvBlock = 256;  // channels per item: a ring of K such rows stays in L1

struct ConvDims {
  int B, L, C, K;
  ConvDims(const mx::array& x, const mx::array& w) : B(x.shape(0)), L(x.shape(1)), C(x.shape(2)), K(w.shape(2)) {}
};

// The document index of each position of row b (0 everywhere without documents): a tap from position p into
// position t counts when doc[p] == doc[t]; the state's rows (p < 0) count only without documents.
std::vector<int> conv_docs(const ConvDims& d, const bool* starts, int b) {
  std::vector<int> doc(size_t(d.L), 0);
  if (starts == nullptr) return doc;
  int n = 0;
  for (int t = 0; t < d.L; ++t) doc[size_t(t)] = n += starts[size_t(b) * d.L + t] ? 1 : 0;
  return doc;
}

// Row p (-(K - 1) <= p < L) of the convolution's input for batch row b: the state's rows, then x's.
inline const float* conv_row(const ConvDims& d, const float* x, const float* state, int b, int p) {
  return p < 0 ? state + (size_t(b) * (d.K - 1) + (d.K - 1 + p)) * d.C : x + (size_t(b) * d.L + p) * d.C;
}

inline bool conv_tap(const std::vector<int>& doc, bool documents, int p, int t) {
  return p < 0 ? !documents : doc[size_t(p)] == doc[size_t(t)];
}

// c[t] over the channels [c0, c0 + n) into acc.
inline void conv_at(const ConvDims& d, const float* x, const float* state, const float* wt, const std::vector<int>& doc,
                    bool documents, int b, int t, int c0, int n, float* acc) {
  std::fill(acc, acc + n, 0.0f);
  for (int j = 0; j < d.K; ++j) {
    const int p = t - d.K + 1 + j;
    if (!conv_tap(doc, documents, p, t)) continue;
    const float* in = conv_row(d, x, state, b, p) + c0;
    const float* w = wt + size_t(j) * d.C + c0;
#pragma omp simd
    for (int i = 0; i < n; ++i) acc[i] += w[i] * in[i];
  }
}

// The parts side by side (the forward's outputs, the backward's cotangents): channel ch of the convolution is
// column ch - begin[i] of part i.
struct ConvParts {
  std::vector<float*> ptr;
  std::vector<int> begin, width;
  ConvParts(const std::vector<int>& widths, std::vector<float*> ptrs) : ptr(std::move(ptrs)), width(widths) {
    for (int c0 = 0; int w : widths) begin.push_back(std::exchange(c0, c0 + w));
  }
  // (part, its column) of channel ch; a block never straddles two parts (ConvPlan's blocks)
  std::pair<int, int> at(int ch) const {
    int i = 0;
    while (ch >= begin[i] + width[i]) ++i;
    return {i, ch - begin[i]};
  }
  // the row of part `part` at (b, t), from column `col`
  float* row(const ConvDims& d, int part, int b, int t, int col) const {
    return ptr[size_t(part)] + (size_t(b) * d.L + t) * width[size_t(part)] + col;
  }
};

// What both directions set up once per call: the weight as [K, C] (each tap's weights contiguous over the
// channels, from HF's [C, 1, K]), the channel blocks (at most kConvBlock each, none straddling two parts: the
// work items) and every batch row's document index.
struct ConvPlan {
  std::vector<float> wt;
  std::vector<std::pair<int, int>> blocks;  // (first channel, count)
  std::vector<std::vector<int>> docs;
  ConvPlan(const ConvDims& d, const float* w, const ConvParts& parts, const bool* starts) : wt(size_t(d.K) * d.C) {
    for (int ch = 0; ch < d.C; ++ch)
      for (int j = 0; j < d.K; ++j) wt[size_t(j) * d.C + ch] = w[size_t(ch) * d.K + j];
    for (size_t i = 0; i < parts.width.size(); ++i)
      for (int s = 0; s < parts.width[i]; s += kConvBlock)
        blocks.emplace_back(parts.begin[i] + s, std::min(kConvBlock, parts.width[i] - s));
    for (int b = 0; b < d.B; ++b) docs.push_back(conv_docs(d, starts, b));
  }
};

class ConvPrimitive : public CpuPrimitive {
 public:
  ConvPrimitive(mx::Stream s, std::vector<int> widths, bool documents)
      : CpuPrimitive(s), widths_(std::move(widths)), documents_(documents) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const ConvPrimitive&>(other);
    return CpuPrimitive::is_equivalent(other) && o.widths_ == widths_ && o.documents_ == documents_;
  }

 protected:
  std::vector<int> widths_;
  bool documents_;
};

std::vector<mx::array> causal_conv_grad_op(const std::vector<mx::array>& inputs, const std::vector<int>& widths,
                                           bool documents, mx::Stream s);

// inputs x [B, L, C], w [C, 1, K], state [B, K - 1, C], starts bool [B, L]; outputs the parts [B, L, width_i] of
// silu(conv), then the last K - 1 input rows [B, K - 1, C] (the decoding state after x).
class CausalConvSilu : public ConvPrimitive {
 public:
  using ConvPrimitive::ConvPrimitive;
  const char* name() const override { return "MlxrlCausalConvSilu"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    std::vector<mx::Shape> shapes;
    for (int w : widths_) shapes.push_back({x.shape(0), x.shape(1), w});
    shapes.push_back(inputs[2].shape());
    return shapes;
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = encode_outputs(stream(), inputs, outputs);  // allocates the outputs: their pointers after
    std::vector<float*> ptrs;
    for (size_t i = 0; i < widths_.size(); ++i) ptrs.push_back(outputs[i].data<float>());
    encoder.dispatch([d = ConvDims(inputs[0], inputs[1]), parts = ConvParts(widths_, std::move(ptrs)),
        x = inputs[0].data<float>(), w = inputs[1].data<float>(), state = inputs[2].data<float>(),
        starts = documents_ ? inputs[3].data<bool>() : nullptr, documents = documents_,
        last = outputs.back().data<float>()]() {
      const ConvPlan plan(d, w, parts, starts);
      parallel_items(plan.blocks.size(), worker_count(), [&](size_t, size_t item) {
        const auto [c0, n] = plan.blocks[item];
        const auto [part, col] = parts.at(c0);
        float acc[kConvBlock];
        for (int b = 0; b < d.B; ++b)
          for (int t = 0; t < d.L; ++t) {
            conv_at(d, x, state, plan.wt.data(), plan.docs[size_t(b)], documents, b, t, c0, n, acc);
            float* y = parts.row(d, part, b, t, col);
#pragma omp simd
            for (int i = 0; i < n; ++i) y[i] = acc[i] / (1.0f + fast_exp(-acc[i]));
          }
      });
      for (int b = 0; b < d.B; ++b)  // the last K - 1 rows of (state, x)
        for (int i = 0; i < d.K - 1; ++i) {
          const float* row = conv_row(d, x, state, b, d.L - (d.K - 1) + i);
          std::copy(row, row + d.C, last + (size_t(b) * (d.K - 1) + i) * d.C);
        }
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    auto s = stream();
    std::vector<mx::array> in{primals[0], primals[1], primals[2], primals[3]};
    for (size_t i = 0; i < outputs.size(); ++i) in.push_back(dense_cotangent(cotangents[i], outputs[i], s));
    auto grads = causal_conv_grad_op(in, widths_, documents_, s);
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(a < 3 ? grads[size_t(a)] : mx::zeros_like(primals[size_t(a)], s));
    return out;
  }
};

// inputs x, w, state, starts, the parts' cotangents, the last rows' cotangent; outputs dx, dw, d_state.
class CausalConvSiluGrad : public ConvPrimitive {
 public:
  using ConvPrimitive::ConvPrimitive;
  const char* name() const override { return "MlxrlCausalConvSiluGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  }
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const size_t np = widths_.size();
    std::vector<float*> ptrs;
    for (size_t i = 0; i < np; ++i) ptrs.push_back(const_cast<float*>(inputs[4 + i].data<float>()));
    encode_outputs(stream(), inputs, outputs).dispatch([d = ConvDims(inputs[0], inputs[1]),
        dparts = ConvParts(widths_, std::move(ptrs)),
        x = inputs[0].data<float>(), w = inputs[1].data<float>(), state = inputs[2].data<float>(),
        starts = documents_ ? inputs[3].data<bool>() : nullptr, documents = documents_,
        dlast = inputs[4 + np].data<float>(), dx = outputs[0].data<float>(), dw = outputs[1].data<float>(),
        dstate = outputs[2].data<float>()]() {
      const ConvPlan plan(d, w, dparts, starts);
      const auto& wt = plan.wt;
      const int K = d.K;
      parallel_items(plan.blocks.size(), worker_count(), [&](size_t, size_t item) {
        const auto [c0, n] = plan.blocks[item];
        const auto [part, col] = dparts.at(c0);
        std::vector<float> ring(size_t(K) * kConvBlock), dwt(size_t(K) * kConvBlock, 0.0f);
        float c[kConvBlock];
        for (int b = 0; b < d.B; ++b) {
          const auto& doc = plan.docs[size_t(b)];
          std::fill(ring.begin(), ring.end(), 0.0f);
          // the input gradient of position p (-(K - 1) <= p < L): its own cotangent as one of the last K - 1
          // rows, then the taps of the outputs t = p + K - 1 - j it feeds, whose dc sit in the ring
          auto input_grad = [&](int p, float* out) {
            const int q = p + K - 1 - d.L;  // its index among the last rows, when 0 <= q < K - 1
            if (q >= 0) {
              const float* g = dlast + (size_t(b) * (K - 1) + q) * d.C + c0;
              std::copy(g, g + n, out);
            } else {
              std::fill(out, out + n, 0.0f);
            }
            for (int j = 0; j < K; ++j) {
              const int t = p + K - 1 - j;
              if (t < 0 || t >= d.L || !conv_tap(doc, documents, p, t)) continue;
              const float* g = ring.data() + size_t(t % K) * kConvBlock;
              const float* wj = wt.data() + size_t(j) * d.C + c0;
#pragma omp simd
              for (int i = 0; i < n; ++i) out[i] += wj[i] * g[i];
            }
          };
          for (int t = d.L - 1; t >= 0; --t) {
            conv_at(d, x, state, wt.data(), doc, documents, b, t, c0, n, c);
            const float* dy = dparts.row(d, part, b, t, col);
            float* dc = ring.data() + size_t(t % K) * kConvBlock;
#pragma omp simd
            for (int i = 0; i < n; ++i) {
              const float s = 1.0f / (1.0f + fast_exp(-c[i]));
              dc[i] = dy[i] * s * (1.0f + c[i] * (1.0f - s));
            }
            for (int j = 0; j < K; ++j) {
              const int p = t - K + 1 + j;
              if (!conv_tap(doc, documents, p, t)) continue;
              const float* in = conv_row(d, x, state, b, p) + c0;
              float* acc = dwt.data() + size_t(j) * kConvBlock;
#pragma omp simd
              for (int i = 0; i < n; ++i) acc[i] += in[i] * dc[i];
            }
            input_grad(t, dx + (size_t(b) * d.L + t) * d.C + c0);
          }
          for (int p = -(K - 1); p < 0; ++p)
            input_grad(p, dstate + (size_t(b) * (K - 1) + (K - 1 + p)) * d.C + c0);
        }
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < K; ++j) dw[size_t(c0 + i) * K + j] = dwt[size_t(j) * kConvBlock + i];
      });
    });
  }
};

std::vector<mx::array> causal_conv_grad_op(const std::vector<mx::array>& inputs, const std::vector<int>& widths,
                                           bool documents, mx::Stream s) {
  std::vector<mx::array> in;
  for (auto& a : inputs) in.push_back(dense(a, s));
  return mx::array::make_arrays({inputs[0].shape(), inputs[1].shape(), inputs[2].shape()},
                                std::vector<mx::Dtype>(3, mx::float32),
                                std::make_shared<CausalConvSiluGrad>(s, widths, documents), in);
}

void conv_check(const mx::array& x, const mx::array& w, const mx::array& state, const mx::array& starts,
                const std::vector<int>& widths) {
  const bool widths_ok = std::all_of(widths.begin(), widths.end(), [](int v) { return v > 0; }) &&
                         std::accumulate(widths.begin(), widths.end(), 0) == x.shape(2);
  const bool ok = x.ndim() == 3 && w.ndim() == 3 && w.shape(0) == x.shape(2) && w.shape(1) == 1 && w.shape(2) >= 1 &&
                  state.shape() == mx::Shape{x.shape(0), w.shape(2) - 1, x.shape(2)} &&
                  starts.shape() == mx::Shape{x.shape(0), x.shape(1)} && widths_ok && w.shape(2) <= 64;
  if (!ok)
    throw std::invalid_argument("causal_conv_silu: x [B, L, C], weight [C, 1, K] (K <= 64), state [B, K - 1, C], "
                                "starts [B, L] and part widths summing to C expected.");
}

std::vector<mx::array> causal_conv_silu_op(const mx::array& x, const mx::array& w, const mx::array& state,
                                           const mx::array& starts, const std::vector<int>& widths, bool documents) {
  auto s = cpu_stream({&x, &w, &state});
  conv_check(x, w, state, starts, widths);
  // the kernel reads w as [C, K]: its layout [C, 1, K] is that, once dense
  std::vector<mx::array> in{dense(x, s), dense(w, s), dense(state, s), dense(mx::astype(starts, mx::bool_, s), s)};
  auto prim = std::make_shared<CausalConvSilu>(s, widths, documents);
  auto shapes = prim->output_shapes(in);
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32), prim, in);
}

}  // namespace
