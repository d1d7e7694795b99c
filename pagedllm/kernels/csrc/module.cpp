#include "amx.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &pagedllm::paged_attention,
        "out[rows' tokens] = causal attention of q over the paged K/V cache (in place), "
        "merged with a shared prefix's attention if given",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("q_starts"), py::arg("q_lens"), py::arg("k_lens"),
        py::arg("scale"), py::arg("prefix_out") = py::none(), py::arg("prefix_lse") = py::none(),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_attention_scores", &pagedllm::paged_attention_scores,
        "how paged_attention scores bf16 keys here: 'avx512_bf16', 'avx512' or 'scalar'");
  m.def("allow_dot_scores", &pagedllm::allow_dot_scores,
        "tests: True scores bf16 keys by dot products where the CPU has them (default but on AMX CPUs), False widens them");
  m.def("prompt_attention", &pagedllm::prompt_attention,
        "out[prompts' tokens] = causal attention of each prompt over its own tokens (bf16; "
        "AMX or AVX512-BF16)",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("starts"),
        py::arg("lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("attention_over_keys", &pagedllm::attention_over_keys,
        "out = attention of the queries over the keys (causal: the queries are the last "
        "positions; else a prefix before them all), bf16; returns each query's "
        "log-sum-exp", py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("scale"), py::arg("causal"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("prompt_attention_isa", &pagedllm::prompt_attention_isa,
        "what prompt_attention and attention_over_keys run on: 'amx', 'avx512_bf16' or '' "
        "(not built)");
  m.def("allow_amx_attention", &pagedllm::allow_amx_attention,
        "tests: False makes the attention kernels use AVX512-BF16 even where AMX runs");
  m.def("amx_available", &pagedllm::amx_available,
        "whether this build and CPU run the AMX kernels (prompt attention, linear)");
  m.def("store_kv", &pagedllm::store_kv, "write new tokens' K and V into their cache slots");
  m.def("small_linear_bf16", &pagedllm::small_linear_bf16,
        "x w^T for a few bf16 rows x, streaming the bf16 weight w once");
  m.def("has_small_linear_bf16", &pagedllm::has_small_linear_bf16,
        "whether this build has the AVX512-BF16 small-batch linear");
  m.def("amx_linear_bf16", &pagedllm::amx_linear_bf16,
        "x w^T for 1-32 bf16 rows x on AMX tiles, from the plain bf16 weight w");
  m.def("pack_linear_weight_bf16", &pagedllm::pack_linear_weight_bf16,
        "the bf16 weight [N, K] packed for packed_linear_bf16: [N/16, K/2, 16, 2]");
  m.def("packed_linear_bf16", &pagedllm::packed_linear_bf16,
        "x w^T for bf16 rows x (any number) from the packed weight (AMX or AVX512-BF16); "
        "fp32_out: the fp32 sums, unrounded",
        py::arg("x"), py::arg("packed"), py::arg("fp32_out") = false);
  m.def("packed_linear_uses_amx", &pagedllm::packed_linear_uses_amx,
        "whether packed_linear_bf16 runs on AMX tiles here for inputs of k features",
        py::arg("k"));
  m.def("allow_amx_linear", &pagedllm::allow_amx_linear,
        "tests: False makes packed_linear_bf16 take AVX512-BF16 dot products where AMX runs");
  m.def("packed_gate_up_silu_bf16", &pagedllm::packed_gate_up_silu_bf16,
        "silu(gate) * up of a packed [gate; up] projection in one pass (the results of "
        "packed_linear_bf16 then silu_and_mul)");
  m.def("gguf_linear", &pagedllm::gguf_linear,
        "x w^T for bf16 rows x from a GGUF weight (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) packed "
        "by pack_gguf (its exact values); writes the first n columns of out if given",
        py::arg("x"), py::arg("packed"), py::arg("qtype"), py::arg("n"),
        py::arg("out") = py::none(), py::arg("fp32_out") = false);
  m.def("gguf_pack", &pagedllm::gguf_pack,
        "a GGUF weight's blocks (uint8 [n, bytes per row]) in gguf_linear's layout");
  m.def("gguf_packed_nbytes", &pagedllm::gguf_packed_nbytes,
        "bytes of pack_gguf's layout for a weight [n, k] of ggml type qtype");
  m.def("gguf_dequantize_rows", &pagedllm::gguf_dequantize_rows,
        "the exact float32 weights of some output rows, from the packed GGUF weight");
  m.def("gguf_linear_isa", &pagedllm::gguf_linear_isa,
        "what gguf_linear runs on: 'amx', 'avx512_bf16', 'avx2' or '' (not built)");
  m.def("force_gguf_linear_isa", &pagedllm::force_gguf_linear_isa,
        "tests: 'amx', 'avx512_bf16' or 'avx2' makes gguf_linear take that path; '' the best");
  m.def("has_packed_linear_bf16", &pagedllm::has_packed_linear_bf16,
        "whether this build has the AVX512-BF16 packed linear");
  m.def("elementwise_isa", &pagedllm::elementwise_isa,
        "what rms_norm, silu_and_mul, rotary_embedding and argmax_rows run on: 'avx512', "
        "'avx2' or 'scalar'");
  m.def("rms_norm", &pagedllm::rms_norm,
        "[norm(x)] or [norm(x + residual), x + residual]; unit_offset: Gemma's (1 + weight)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("unit_offset") = false);
  m.def("silu_and_mul", &pagedllm::silu_and_mul, "silu(x[:, :I]) * x[:, I:]");
  m.def("rotary_embedding", &pagedllm::rotary_embedding,
        "rotate x [T, heads, D] in place by positions (half-rotation layout)");
  m.def("argmax_rows", &pagedllm::argmax_rows, "first index of each row's maximum");
  m.def("apply_token_bitmask_", &pagedllm::apply_token_bitmask_,
        "logits[rows[i], t] = -inf where bit t of int32 mask row i is 0 (in place)");
  py::class_<pagedllm::StackLinear>(m, "StackLinear",
                                    "a linear layer of the decode stack (see ops.h)")
      .def(py::init<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<int64_t>, c10::optional<at::Tensor>>(),
           py::arg("weight"), py::arg("packed"), py::arg("parts"), py::arg("part_types"),
           py::arg("part_rows"), py::arg("bias"));
  py::enum_<pagedllm::StackActivation>(m, "StackActivation",
                                       "a dense MLP's gate activation in the decode stack")
      .value("silu", pagedllm::StackActivation::silu)
      .value("gelu_tanh", pagedllm::StackActivation::gelu_tanh);
  // the stack's descriptions are built empty and filled field by field (kernels/ops.py)
  py::class_<pagedllm::StackMLP>(m, "StackMLP", "a dense MLP of the decode stack (see ops.h)")
      .def(py::init<>())
      .def_readwrite("gate_up", &pagedllm::StackMLP::gate_up)
      .def_readwrite("down", &pagedllm::StackMLP::down)
      .def_readwrite("activation", &pagedllm::StackMLP::activation);
  py::class_<pagedllm::StackMoE>(m, "StackMoE",
                                 "a mixture-of-experts block of the decode stack (see ops.h)")
      .def(py::init<>())
      .def_readwrite("router", &pagedllm::StackMoE::router)
      .def_readwrite("gate_up", &pagedllm::StackMoE::gate_up)
      .def_readwrite("down", &pagedllm::StackMoE::down)
      .def_readwrite("top_k", &pagedllm::StackMoE::top_k)
      .def_readwrite("renormalize", &pagedllm::StackMoE::renormalize)
      .def_readwrite("weights_in_fp32", &pagedllm::StackMoE::weights_in_fp32)
      .def_readwrite("shared", &pagedllm::StackMoE::shared)
      .def_readwrite("shared_gate", &pagedllm::StackMoE::shared_gate);
  py::class_<pagedllm::StackLayer>(m, "StackLayer",
                                   "a decoder layer of the decode stack (see ops.h)")
      .def(py::init<>())
      .def_readwrite("input_norm", &pagedllm::StackLayer::input_norm)
      .def_readwrite("post_attn_norm", &pagedllm::StackLayer::post_attn_norm)
      .def_readwrite("pre_mlp_norm", &pagedllm::StackLayer::pre_mlp_norm)
      .def_readwrite("post_mlp_norm", &pagedllm::StackLayer::post_mlp_norm)
      .def_readwrite("q_norm", &pagedllm::StackLayer::q_norm)
      .def_readwrite("k_norm", &pagedllm::StackLayer::k_norm)
      .def_readwrite("unit_offset_norms", &pagedllm::StackLayer::unit_offset_norms)
      .def_readwrite("qkv", &pagedllm::StackLayer::qkv)
      .def_readwrite("o", &pagedllm::StackLayer::o)
      .def_readwrite("scale", &pagedllm::StackLayer::scale)
      .def_readwrite("softcap", &pagedllm::StackLayer::softcap)
      .def_readwrite("window", &pagedllm::StackLayer::window)
      .def_readwrite("rotary_dim", &pagedllm::StackLayer::rotary_dim)
      .def_readwrite("long_after", &pagedllm::StackLayer::long_after)
      .def_readwrite("cos", &pagedllm::StackLayer::cos)
      .def_readwrite("sin", &pagedllm::StackLayer::sin)
      .def_readwrite("long_cos", &pagedllm::StackLayer::long_cos)
      .def_readwrite("long_sin", &pagedllm::StackLayer::long_sin)
      .def_readwrite("mlp", &pagedllm::StackLayer::mlp)
      .def_readwrite("moe", &pagedllm::StackLayer::moe)
      .def_readwrite("k_cache", &pagedllm::StackLayer::k_cache)
      .def_readwrite("v_cache", &pagedllm::StackLayer::v_cache);
  m.def("moe_experts", &pagedllm::moe_experts,
        "a mixture-of-experts block's routed experts in one call (same results as the "
        "per-expert forward)");
  py::class_<pagedllm::StackLayers>(m, "StackLayers",
                                    "a model's layer descriptions for decode_layers, copied once")
      .def(py::init([](std::vector<pagedllm::StackLayer> layers) {
        return pagedllm::StackLayers{std::move(layers)};
      }))
      .def("__len__", [](const pagedllm::StackLayers& s) { return s.layers.size(); });
  m.def("decode_layers", &pagedllm::decode_layers,
        "a decode step's decoder layers for bf16 rows in one call (same results as the "
        "per-op forward)");
}
