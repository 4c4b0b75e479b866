// The fused LM head: a token-separable loss and its gradients over row chunks, its matmuls through the BLAS MLX
// uses (the tile pass), and a frozen head's one pass over vocabulary blocks (frozen_head_pass).

#include "common.h"

namespace {

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

}  // namespace
