// Counter-hash dropout (the mask a pure function of the key and the element's index), and LoRA's dropout +
// down-projection, which draws the same mask.

#include "common.h"

namespace {

mx::array dropout_op(const mx::array& x, const mx::array& key, float keep, mx::StreamOrDevice s = {});

// Dropout with a counter-based mask: element i is kept when hash(i, key) < keep * 2^32, so the mask is
// a pure function of (key, i) and the VJP (the cotangent through the same mask) needs no saved mask.
// The hash is a 32-bit integer finalizer (xor-shift-multiply, "lowbias32") of i mixed with the key's
// two words: vectorisable, and uniform enough that the kept fraction matches keep (docs/benchmarks.md).
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

}  // namespace
