// The functions of kvfuse's CPU kernel module (bound to Python in module.cpp).
#pragma once

#include <torch/extension.h>

#include <map>
#include <string>
#include <vector>

namespace kvf {
struct GgmlOps;
}

// batch_attention.cpp
torch::Tensor attend(torch::Tensor q, std::vector<torch::Tensor> kvs,
                     std::vector<torch::Tensor> positions, std::vector<int64_t> lens,
                     std::vector<int64_t> q_seq, std::vector<int64_t> q_pos, int64_t layer,
                     double scale, int64_t window, double softcap);
void write_kv(std::vector<torch::Tensor> kvs, int64_t layer, torch::Tensor k, torch::Tensor v,
              std::vector<int64_t> row0, std::vector<int64_t> slot0, std::vector<int64_t> count);

// linear.cpp
torch::Tensor pack_linear(torch::Tensor w);
std::vector<torch::Tensor> pack_linear_int8(torch::Tensor w);
torch::Tensor blocked_linear(torch::Tensor x, torch::Tensor blocks, int64_t out,
                             c10::optional<torch::Tensor> scales,
                             c10::optional<torch::Tensor> bias);

// pointwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, torch::Tensor w,
                                        double eps);
torch::Tensor gated_act(torch::Tensor gate, torch::Tensor up, int64_t act);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// ggml.cpp: weights in a GGUF file's own blocks (models.ggml.GGMLWeight)
torch::Tensor ggml_linear(torch::Tensor x, std::vector<torch::Tensor> parts,
                          std::vector<int64_t> types, c10::optional<torch::Tensor> bias);
torch::Tensor ggml_dequantize(torch::Tensor part, int64_t type, int64_t in);
torch::Tensor ggml_rows(torch::Tensor part, int64_t type, int64_t in, torch::Tensor ids);

// isa.cpp: the CPU's instruction sets and the GGUF kernels' table chosen for it
const kvf::GgmlOps* ggml_ops();
std::map<std::string, bool> cpu_features();
std::string isa();
void set_isa(std::string name);

// layer.cpp: a projection weight as the Python side holds it: blocks (packed.BlockedWeight), or
// GGML parts (ggml.GGMLWeight: `parts` and their `types`; `blocks` and `scales` unused then)
struct BlockedArg {
  torch::Tensor blocks;
  int64_t out;
  c10::optional<torch::Tensor> scales;
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> types;
};
std::vector<torch::Tensor> project_qkv(torch::Tensor h, torch::Tensor attn_norm, double eps,
                                       BlockedArg wqkv, c10::optional<torch::Tensor> bqkv,
                                       c10::optional<torch::Tensor> q_norm,
                                       c10::optional<torch::Tensor> k_norm, int64_t heads,
                                       int64_t kv_heads, int64_t head_dim, torch::Tensor cos,
                                       torch::Tensor sin);
torch::Tensor post_attention(torch::Tensor attn, torch::Tensor h, BlockedArg wo,
                             c10::optional<torch::Tensor> attn_out_norm, torch::Tensor mlp_norm,
                             BlockedArg w_gate, BlockedArg w_up, BlockedArg w_down,
                             c10::optional<torch::Tensor> mlp_out_norm, int64_t act, double eps);

// stack.cpp: every layer of a decode step in one call
struct StackLayer {
  torch::Tensor attn_norm;
  BlockedArg wqkv;
  c10::optional<torch::Tensor> bqkv, q_norm, k_norm;
  BlockedArg wo;
  c10::optional<torch::Tensor> attn_out_norm;
  torch::Tensor mlp_norm;
  BlockedArg w_gate, w_up, w_down;
  c10::optional<torch::Tensor> mlp_out_norm;
  int64_t window;     // sliding window, 0 for none
  int64_t rope_kind;  // which of the step's rotation tables
};
struct Stack {
  int64_t heads, kv_heads, head_dim, act;
  double eps, scale, softcap;
  std::vector<StackLayer> layers;
  void add_layer(torch::Tensor attn_norm, BlockedArg wqkv, c10::optional<torch::Tensor> bqkv,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                 BlockedArg wo, c10::optional<torch::Tensor> attn_out_norm, torch::Tensor mlp_norm,
                 BlockedArg w_gate, BlockedArg w_up, BlockedArg w_down,
                 c10::optional<torch::Tensor> mlp_out_norm, int64_t window, int64_t rope_kind);
};
torch::Tensor run_stack(const Stack& stack, torch::Tensor h, std::vector<torch::Tensor> kvs,
                        std::vector<torch::Tensor> positions, std::vector<int64_t> lens,
                        std::vector<int64_t> q_seq, std::vector<int64_t> q_pos,
                        std::vector<int64_t> row0, std::vector<int64_t> slot0,
                        std::vector<int64_t> count, std::vector<torch::Tensor> cos,
                        std::vector<torch::Tensor> sin, c10::optional<torch::Tensor> last_rows,
                        std::vector<int64_t> last_q_seq, std::vector<int64_t> last_q_pos);
