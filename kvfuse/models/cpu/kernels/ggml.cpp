// Products, dequantization and embedding lookups of weights held in a GGUF file's own blocks
// (kvfuse.models.ggml.GGMLWeight): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16.
//
// A weight is one or more parts stacked along the output channels (a fused q/k/v projection
// whose q, k and v a file quantizes differently has three), each a (rows, row_bytes) uint8 tensor
// of one GGML type, rows in the file's order: block after block of one output channel, exactly
// the file's bytes. Products are float32 throughout: the activations are never quantized, each
// weight value is dequantized in registers or in a buffer that stays in cache, so a product
// equals the one with the weight dequantized to float32 up to float rounding. Threads split the
// output channels (kvf::parallel_for, parallel.h); the instruction-set-specific loops are in
// ggml_impl.h.

#include <algorithm>
#include <vector>

#include "ggml_ops.h"
#include "kernels.h"
#include "parallel.h"

namespace {

struct Part {
  const uint8_t* data;
  int64_t rows, row_bytes;
  int type;
};

Part part_of(const torch::Tensor& t, int64_t type, int64_t in) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kByte && t.device().is_cpu(),
              "a GGML weight part must be a (rows, row_bytes) uint8 CPU tensor");
  TORCH_CHECK(t.stride(1) == 1 && t.stride(0) == t.size(1),
              "a GGML weight part must be contiguous");
  const kvf::BlockShape s = kvf::block_shape(static_cast<int>(type));
  TORCH_CHECK(s.elems > 0, "GGML type ", type, " is not one kvfuse's kernels read");
  TORCH_CHECK(in % s.elems == 0, in, " input features are not whole blocks of ", s.elems);
  TORCH_CHECK(t.size(1) == in / s.elems * s.bytes, "row bytes ", t.size(1), " do not match ", in,
              " features of GGML type ", type);
  return Part{t.data_ptr<uint8_t>(), t.size(0), t.size(1), static_cast<int>(type)};
}

std::vector<Part> parts_of(const std::vector<torch::Tensor>& parts,
                           const std::vector<int64_t>& types, int64_t in) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one GGML type per weight part");
  std::vector<Part> out;
  for (size_t i = 0; i < parts.size(); ++i) out.push_back(part_of(parts[i], types[i], in));
  return out;
}

// Rows of x per pass of many_rows: each pass dequantizes the weight again, and keeps its rows of
// x in L2 while every group of output channels multiplies them.
constexpr int64_t kRowsPerPass = 256;

// One decode step's product (n <= kFewRows): the output channels of every part in one parallel
// region, split evenly between the threads (a region per part costs a fork and a join each,
// which a step of small products pays hundreds of times).
void few_rows(const kvf::GgmlOps* ops, const std::vector<Part>& ws, const float* x, int64_t n,
              int64_t in, float* y, int64_t ldy) {
  int64_t total = 0;
  for (const Part& w : ws) total += w.rows;
  kvf::parallel_for(0, total, 32, [&](int64_t r0, int64_t r1) {
    int64_t first = 0;  // the first output channel of part w
    for (const Part& w : ws) {
      const int64_t a = std::max(r0, first) - first, b = std::min(r1, first + w.rows) - first;
      if (a < b)
        ops->few_rows(kvf::QuantProduct{w.type, w.data, w.row_bytes, in, x, n, y + first, ldy}, a,
                      b);
      first += w.rows;
    }
  });
}

void many_rows(const kvf::GgmlOps* ops, const Part& w, const float* x, int64_t n, int64_t in,
               float* y, int64_t ldy) {
  const int64_t groups = (w.rows + kvf::kGroupRows - 1) / kvf::kGroupRows;
  for (int64_t i0 = 0; i0 < n; i0 += kRowsPerPass) {
    const kvf::QuantProduct p{w.type,       w.data,      w.row_bytes,
                              in,           x + i0 * in, std::min(kRowsPerPass, n - i0),
                              y + i0 * ldy, ldy};
    kvf::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> scratch(kvf::kGroupRows * in);
      for (int64_t g = g0; g < g1; ++g)
        ops->many_rows(p, g * kvf::kGroupRows, std::min((g + 1) * kvf::kGroupRows, w.rows),
                       scratch.data());
    });
  }
}

}  // namespace

torch::Tensor ggml_linear(torch::Tensor x, std::vector<torch::Tensor> parts,
                          std::vector<int64_t> types, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (n, in) float32 on the CPU");
  x = x.contiguous();
  const int64_t n = x.size(0), in = x.size(1);
  const std::vector<Part> ws = parts_of(parts, types, in);
  int64_t out = 0;
  for (const Part& w : ws) out += w.rows;
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                "bias: (out,) float32");
  auto y = torch::empty({n, out}, x.options());
  if (n == 0) return y;
  const kvf::GgmlOps* ops = ggml_ops();
  float* yp = y.data_ptr<float>();
  if (n <= kvf::kFewRows) {
    few_rows(ops, ws, x.data_ptr<float>(), n, in, yp, out);
  } else {
    int64_t col0 = 0;
    for (const Part& w : ws) {
      many_rows(ops, w, x.data_ptr<float>(), n, in, yp + col0, out);
      col0 += w.rows;
    }
  }
  if (bias) y.add_(*bias);
  return y;
}

torch::Tensor ggml_dequantize(torch::Tensor part, int64_t type, int64_t in) {
  const Part w = part_of(part, type, in);
  auto y = torch::empty({w.rows, in}, torch::kFloat);
  const kvf::GgmlOps* ops = ggml_ops();
  const int64_t blocks = in / kvf::block_shape(w.type).elems;
  float* yp = y.data_ptr<float>();
  kvf::parallel_for(0, w.rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ops->dequant(w.type, w.data + r * w.row_bytes, 0, blocks, yp + r * in);
  });
  return y;
}

torch::Tensor ggml_rows(torch::Tensor part, int64_t type, int64_t in, torch::Tensor ids) {
  const Part w = part_of(part, type, in);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be (n,) int64");
  ids = ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < w.rows, "row ", id[i], " is out of range for ", w.rows,
                " rows");
  auto y = torch::empty({ids.numel(), in}, torch::kFloat);
  const kvf::GgmlOps* ops = ggml_ops();
  const int64_t blocks = in / kvf::block_shape(w.type).elems;
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    ops->dequant(w.type, w.data + id[i] * w.row_bytes, 0, blocks, yp + i * in);
  return y;
}
