#include "model/param_specs.h"

#include <cmath>
#include <string>

namespace loom::model {

std::vector<ParamSpec> embedding_param_specs(const GPTConfig& cfg) {
  const int64_t C = cfg.n_embd;
  return {{"wte.weight", {cfg.vocab_size, C}, cfg.padded_vocab(), Init::normal, cfg.init_std},
          {"wpe.weight", {cfg.block_size, C}, cfg.block_size, Init::normal, cfg.init_std}};
}

std::vector<ParamSpec> block_param_specs(const GPTConfig& cfg, int64_t layer) {
  const int64_t C = cfg.n_embd;
  const std::string p = "h." + std::to_string(layer) + ".";
  const float std = cfg.init_std;
  const float proj_std = cfg.init_std / std::sqrt(2.0f * float(cfg.n_layer));
  return {{p + "ln_1.weight", {C}, C, Init::ones, 0},
          {p + "ln_1.bias", {C}, C, Init::zeros, 0},
          {p + "attn.c_attn.weight", {3 * C, C}, 3 * C, Init::normal, std},
          {p + "attn.c_attn.bias", {3 * C}, 3 * C, Init::zeros, 0},
          {p + "attn.c_proj.weight", {C, C}, C, Init::normal, proj_std},
          {p + "attn.c_proj.bias", {C}, C, Init::zeros, 0},
          {p + "ln_2.weight", {C}, C, Init::ones, 0},
          {p + "ln_2.bias", {C}, C, Init::zeros, 0},
          {p + "mlp.c_fc.weight", {4 * C, C}, 4 * C, Init::normal, std},
          {p + "mlp.c_fc.bias", {4 * C}, 4 * C, Init::zeros, 0},
          {p + "mlp.c_proj.weight", {C, 4 * C}, C, Init::normal, proj_std},
          {p + "mlp.c_proj.bias", {C}, C, Init::zeros, 0}};
}

std::vector<ParamSpec> head_param_specs(const GPTConfig& cfg) {
  const int64_t C = cfg.n_embd;
  std::vector<ParamSpec> s = {{"ln_f.weight", {C}, C, Init::ones, 0}, {"ln_f.bias", {C}, C, Init::zeros, 0}};
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
