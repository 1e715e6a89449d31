// The Python module of kvfuse's CPU kernels (kvfuse.models.cpu.kernels.get()).
//
// The calls that run long (a layer's products, attention, a whole decode step) release the GIL
// while they compute (RELEASE): the engine's other threads (plans and loads from the tiers, the
// saver, the server's event loop) run meanwhile instead of waiting for the step. The per-row
// ops are microseconds long: they keep it, since handing it over and back would cost more.
#include "kernels.h"

#define RELEASE py::call_guard<py::gil_scoped_release>()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, RELEASE,
        "batched attention of a few queries per sequence over each sequence's own KV");
  m.def("write_kv", &write_kv, RELEASE,
        "write a batched step's fresh K/V rows into each sequence's KV buffer");
  m.def("pack_linear", &pack_linear, "a (out, in) float32 weight as (ceil(out/16), in, 16) blocks");
  m.def("pack_linear_int8", &pack_linear_int8,
        "a weight as int8 blocks and per-channel float32 scales");
  m.def("blocked_linear", &blocked_linear, RELEASE,
        "x @ W^T (+ bias) for blocked float32 or int8 weights", py::arg("x"), py::arg("blocks"),
        py::arg("out"), py::arg("scales") = py::none(), py::arg("bias") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of every row");
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta))");
  m.def("gated_act", &gated_act, "act(gate) * up, act silu (0) or gelu-tanh (1)");
  m.def("rope", &rope, "rotary embedding, rotate-half layout");
  m.def("ggml_linear", &ggml_linear, RELEASE,
        "x @ W^T (+ bias) for a weight in GGML blocks, one or more parts", py::arg("x"),
        py::arg("parts"), py::arg("types"), py::arg("bias") = py::none());
  m.def("ggml_dequantize", &ggml_dequantize, RELEASE, "a GGML weight part as float32 (rows, in)");
  m.def("ggml_rows", &ggml_rows, "rows of a GGML weight part as float32 (embedding lookups)");
  m.def("cpu_features", &cpu_features, "the instruction sets this CPU reports");
  m.def("isa", &isa, "the instruction set the GGUF kernels run with");
  m.def("set_isa", &set_isa, "run the GGUF kernels with auto, avx2 or avx512");
  py::class_<BlockedArg>(m, "Blocked", py::module_local(),
                         "a projection weight: blocks, output channels, int8 scales or None")
      .def(py::init<torch::Tensor, int64_t, c10::optional<torch::Tensor>>())
      .def_static(
          "ggml",
          [](std::vector<torch::Tensor> parts, std::vector<int64_t> types) {
            TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one type per part");
            int64_t out = 0;
            for (const auto& p : parts) out += p.size(0);
            return BlockedArg{parts[0], out, c10::nullopt, parts, types};
          },
          "a weight in GGML blocks: its parts and their GGML types");
  m.def("project_qkv", &project_qkv, RELEASE,
        "norm, q/k/v product, q/k norms and RoPE of one layer");
  m.def("post_attention", &post_attention, RELEASE,
        "output product, residual, norm, gated MLP, residual of one layer");
  py::class_<Stack>(m, "Stack", py::module_local(),
                    "a model's layers, described once for run_stack")
      .def(py::init([](int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t act, double eps,
                       double scale, double softcap) {
             return Stack{heads, kv_heads, head_dim, act, eps, scale, softcap, {}};
           }),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("act"),
           py::arg("eps"), py::arg("scale"), py::arg("softcap"))
      .def("add_layer", &Stack::add_layer)
      .def("__len__", [](const Stack& s) { return s.layers.size(); });
  m.def("run_stack", &run_stack, RELEASE,
        "every layer of a decode step: project, write K/V, attend, post-attention");
}
