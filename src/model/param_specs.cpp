#include "model/param_specs.h"

#include <cmath>
#include <string>

namespace loom::model {

std::vector<ParamSpec> embedding_param_specs(const GPTConfig& cfg) {
  const int64_t C = cfg.n_embd;
  // (A pruned input embedding has exactly its kept rows: ids are remapped, never padded.)
  const int64_t rows = cfg.input_rows(), alloc = cfg.kept_tokens ? rows : cfg.padded_vocab();
  std::vector<ParamSpec> s = {{"wte.weight", {rows, C}, alloc, Init::normal, cfg.init_std}};
  if (cfg.position == Position::learned)
    s.push_back({"wpe.weight", {cfg.block_size, C}, cfg.block_size, Init::normal, cfg.init_std});
  return s;
}

bool block_param_present(const GPTConfig& cfg, BlockParam p) {
  switch (p) {
    case kLn1B: case kLn2B: return cfg.norm == Norm::layernorm;
    case kQkvB: case kAttnProjB: case kFcB: case kMlpProjB: return cfg.bias;
    default: return p >= 0 && p < kBlockParams;
  }
}

std::vector<ParamSpec> block_param_specs(const GPTConfig& cfg, int64_t layer) {
  const int64_t C = cfg.n_embd, Q = cfg.qkv_rows(), Fr = cfg.fc_rows(), F = cfg.ffn();
  const std::string p = "h." + std::to_string(layer) + ".";
  const float std = cfg.init_std;
  const float proj_std = cfg.init_std / std::sqrt(2.0f * float(cfg.n_layer));
  const ParamSpec all[kBlockParams] = {{p + "ln_1.weight", {C}, C, Init::ones, 0},
                                       {p + "ln_1.bias", {C}, C, Init::zeros, 0},
                                       {p + "attn.c_attn.weight", {Q, C}, Q, Init::normal, std},
                                       {p + "attn.c_attn.bias", {Q}, Q, Init::zeros, 0},
                                       {p + "attn.c_proj.weight", {C, C}, C, Init::normal, proj_std},
                                       {p + "attn.c_proj.bias", {C}, C, Init::zeros, 0},
                                       {p + "ln_2.weight", {C}, C, Init::ones, 0},
                                       {p + "ln_2.bias", {C}, C, Init::zeros, 0},
                                       {p + "mlp.c_fc.weight", {Fr, C}, Fr, Init::normal, std},
                                       {p + "mlp.c_fc.bias", {Fr}, Fr, Init::zeros, 0},
                                       {p + "mlp.c_proj.weight", {C, F}, C, Init::normal, proj_std},
                                       {p + "mlp.c_proj.bias", {C}, C, Init::zeros, 0}};
  std::vector<ParamSpec> s;
  for (int i = 0; i < kBlockParams; ++i) {
    if (!block_param_present(cfg, BlockParam(i))) continue;
    s.push_back(all[i]);
    if (!cfg.is_llama()) continue;
    const int64_t kv = cfg.kv_heads() * cfg.head_size();
    if (i == kQkvW) s.back().row_blocks = {{"q", C}, {"k", kv}, {"v", kv}};
    if (i == kFcW) s.back().row_blocks = {{"gate", F}, {"up", F}};
  }
  return s;
}

std::vector<ParamSpec> head_param_specs(const GPTConfig& cfg) {
  const int64_t C = cfg.n_embd;
  std::vector<ParamSpec> s = {{"ln_f.weight", {C}, C, Init::ones, 0}};
  if (cfg.norm == Norm::layernorm) s.push_back({"ln_f.bias", {C}, C, Init::zeros, 0});
  if (!cfg.tied_embeddings)
    s.push_back({"lm_head.weight", {cfg.vocab_size, C}, cfg.padded_vocab(), Init::normal, cfg.init_std});
  return s;
}

std::vector<ParamSpec> gpt_param_specs(const GPTConfig& cfg) {
  std::vector<ParamSpec> s = embedding_param_specs(cfg);
  for (int64_t l = 0; l < cfg.n_layer; ++l)
    for (ParamSpec& p : block_param_specs(cfg, l)) s.push_back(std::move(p));
  for (ParamSpec& p : head_param_specs(cfg)) s.push_back(std::move(p));
  return s;
}

}  // namespace loom::model
