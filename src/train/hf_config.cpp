#include "train/hf_config.h"

#include <cmath>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/file.h"

namespace loom::model {

using json = nlohmann::json;

namespace {
double shortest(float f) { return std::stod(fmt::format("{}", f)); }
}  // namespace

GPTConfig gpt_config_from_hf(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(fmt::format("{}: config must be a JSON object", where));
  auto integer = [&](const char* key, bool required, int64_t fallback) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) throw Error(fmt::format("{}: missing field '{}'", where, key));
      return fallback;
    }
    if (!j[key].is_number_integer()) throw Error(fmt::format("{}: field '{}' must be an integer", where, key));
    return j[key].get<int64_t>();
  };
  if (j.contains("model_type") && j["model_type"] != "gpt2")
    throw Error(fmt::format("{}: field 'model_type' is {}, loom imports gpt2", where, j["model_type"].dump()));
  GPTConfig c;
  c.name = "hf-gpt2";
  c.n_layer = integer("n_layer", true, 0);
  c.n_head = integer("n_head", true, 0);
  c.n_embd = integer("n_embd", true, 0);
  c.vocab_size = integer("vocab_size", true, 0);
  const bool has_positions = j.contains("n_positions") && !j["n_positions"].is_null();
  c.block_size = integer(has_positions ? "n_positions" : "n_ctx", true, 0);
  if (j.contains("layer_norm_epsilon")) {
    if (!j["layer_norm_epsilon"].is_number())
      throw Error(fmt::format("{}: field 'layer_norm_epsilon' must be a number", where));
    const double eps = j["layer_norm_epsilon"].get<double>();
    // loom keeps epsilon as an f32: a value that does not fit one (inf, or 0 after rounding) would
    // be written into a manifest that loom then refuses.
    if (!(eps > 0) || !std::isfinite(float(eps)) || !(float(eps) > 0.f))
      throw Error(fmt::format("{}: field 'layer_norm_epsilon' is {}: it must be positive and fit a 32-bit float "
                              "(at most {:.6g})",
                              where, eps, double(std::numeric_limits<float>::max())));
    c.ln_eps = float(eps);
  }
  if (j.contains("activation_function")) {
    const json& a = j["activation_function"];
    if (!a.is_string() || (a != "gelu_new" && a != "gelu_pytorch_tanh"))
      throw Error(fmt::format("{}: field 'activation_function' is {}; loom's GPT-2 uses the tanh GELU "
                              "(gelu_new or gelu_pytorch_tanh)", where, a.dump()));
  }
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean())
      throw Error(fmt::format("{}: field 'tie_word_embeddings' must be true or false", where));
    c.tied_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  const int64_t n_inner = integer("n_inner", false, 4 * c.n_embd);
  if (n_inner != 4 * c.n_embd)
    throw Error(fmt::format("{}: field 'n_inner' is {}; loom's MLP is 4 * n_embd = {} wide", where, n_inner,
                            4 * c.n_embd));
  auto refuse_true = [&](const char* key, const char* why) {
    if (j.contains(key) && j[key].is_boolean() && j[key].get<bool>())
      throw Error(fmt::format("{}: field '{}' is true; {}", where, key, why));
  };
  refuse_true("add_cross_attention", "loom's GPT-2 has no cross-attention");
  refuse_true("scale_attn_by_inverse_layer_idx", "loom scales attention by 1/sqrt(head size) only");
  if (j.contains("scale_attn_weights") && j["scale_attn_weights"].is_boolean() && !j["scale_attn_weights"].get<bool>())
    throw Error(fmt::format("{}: field 'scale_attn_weights' is false; loom always scales by 1/sqrt(head size)", where));
  c.validate(where);
  return c;
}

bool is_llama(const GPTConfig& c) { return c.is_llama(); }

GPTConfig llama_config_from_hf(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(fmt::format("{}: config must be a JSON object", where));
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto integer = [&](const char* key, bool required, int64_t fallback) -> int64_t {
    if (!has(key)) {
      if (required) throw Error(fmt::format("{}: missing field '{}'", where, key));
      return fallback;
    }
    if (!j[key].is_number_integer()) throw Error(fmt::format("{}: field '{}' must be an integer", where, key));
    return j[key].get<int64_t>();
  };
  auto number = [&](const json& o, const char* key, double fallback) -> double {
    if (!o.contains(key) || o[key].is_null()) return fallback;
    if (!o[key].is_number()) throw Error(fmt::format("{}: field '{}' must be a number", where, key));
    return o[key].get<double>();
  };
  auto boolean = [&](const char* key, bool fallback) -> bool {
    if (!has(key)) return fallback;
    if (!j[key].is_boolean()) throw Error(fmt::format("{}: field '{}' must be true or false", where, key));
    return j[key].get<bool>();
  };
  if (has("model_type") && j["model_type"] != "llama")
    throw Error(fmt::format("{}: field 'model_type' is {}, expected llama", where, j["model_type"].dump()));
  GPTConfig c;
  c.name = "hf-llama";
  c.norm = Norm::rmsnorm;
  c.mlp = Mlp::swiglu;
  c.position = Position::rope;
  c.n_layer = integer("num_hidden_layers", true, 0);
  c.n_head = integer("num_attention_heads", true, 0);
  c.n_embd = integer("hidden_size", true, 0);
  c.n_kv_head = integer("num_key_value_heads", false, c.n_head);
  c.ffn_hidden = integer("intermediate_size", true, 0);
  c.vocab_size = integer("vocab_size", true, 0);
  c.block_size = integer("max_position_embeddings", true, 0);
  // (transformers' "swish" is its SiLU too.)
  if (has("hidden_act") && j["hidden_act"] != "silu" && j["hidden_act"] != "swish")
    throw Error(fmt::format("{}: field 'hidden_act' is {}; loom's SwiGLU gates with silu", where, j["hidden_act"].dump()));
  if (has("quantization_config"))
    throw Error(fmt::format("{}: field 'quantization_config': a quantized model's weights are not its values; loom "
                            "reads F32, F16 or BF16 weights (dequantize first)",
                            where));
  if (has("partial_rotary_factor") && number(j, "partial_rotary_factor", 1.0) != 1.0)
    throw Error(fmt::format("{}: field 'partial_rotary_factor' is {}; loom rotates every dimension of a head (1)", where,
                            j["partial_rotary_factor"].dump()));
  if (c.n_head > 0 && has("head_dim") && integer("head_dim", false, 0) * c.n_head != c.n_embd)
    throw Error(fmt::format("{}: field 'head_dim' is {}; loom's heads are hidden_size / num_attention_heads = {} wide",
                            where, integer("head_dim", false, 0), c.n_embd / c.n_head));
  // (pretraining_tp > 1 makes transformers compute each projection in that many slices and add
  // them: the same model, other roundings.)
  if (integer("pretraining_tp", false, 1) < 1)
    throw Error(fmt::format("{}: field 'pretraining_tp' is {}; it must be at least 1", where,
                            integer("pretraining_tp", false, 1)));
  const bool attention_bias = boolean("attention_bias", false), mlp_bias = boolean("mlp_bias", false);
  if (attention_bias != mlp_bias)
    throw Error(fmt::format("{}: fields 'attention_bias' ({}) and 'mlp_bias' ({}) differ; loom's model.bias covers "
                            "every linear layer alike",
                            where, attention_bias, mlp_bias));
  c.bias = attention_bias;
  c.tied_embeddings = boolean("tie_word_embeddings", false);
  const double eps = number(j, "rms_norm_eps", 1e-6);
  if (!(eps > 0) || !std::isfinite(float(eps)) || !(float(eps) > 0.f))
    throw Error(fmt::format("{}: field 'rms_norm_eps' is {}: it must be positive and fit a 32-bit float", where, eps));
  c.ln_eps = float(eps);
  // Rotary positions: transformers 4's rope_theta and rope_scaling, or transformers 5's
  // rope_parameters holding both (its rope_type "default": no scaling). Where both are given they
  // must agree; a null rope_theta is not the default.
  const bool v5 = has("rope_parameters");
  if (v5 && !j["rope_parameters"].is_object())
    throw Error(fmt::format("{}: field 'rope_parameters' must be an object or null", where));
  const json none = json::object();
  const json& params = v5 ? j["rope_parameters"] : none;
  if (params.contains("partial_rotary_factor") && !params["partial_rotary_factor"].is_null() &&
      number(params, "partial_rotary_factor", 1.0) != 1.0)
    throw Error(fmt::format("{}: field 'rope_parameters.partial_rotary_factor' is {}; loom rotates every dimension of "
                            "a head (1)",
                            where, params["partial_rotary_factor"].dump()));
  const bool theta4 = j.contains("rope_theta"), theta5 = params.contains("rope_theta");
  if (theta4 && j["rope_theta"].is_null() && !theta5)
    throw Error(fmt::format("{}: field 'rope_theta' is null and no rope_parameters.rope_theta gives it", where));
  if (theta5 && params["rope_theta"].is_null())
    throw Error(fmt::format("{}: field 'rope_parameters.rope_theta' is null", where));
  c.rope_theta = theta5 ? number(params, "rope_theta", 0) : number(j, "rope_theta", 10000.0);
  if (theta4 && theta5 && !j["rope_theta"].is_null() && number(j, "rope_theta", 0) != c.rope_theta)
    throw Error(fmt::format("{}: fields 'rope_theta' ({}) and 'rope_parameters.rope_theta' ({}) differ", where,
                            j["rope_theta"].dump(), params["rope_theta"].dump()));
  // The scaling: rope_scaling (4), or rope_parameters (5) when it names a type.
  const json* scaling = nullptr;
  std::string scaling_name = "rope_scaling";
  if (has("rope_scaling")) {
    if (!j["rope_scaling"].is_object()) throw Error(fmt::format("{}: field 'rope_scaling' must be an object or null", where));
    scaling = &j["rope_scaling"];
  }
  if (v5 && (params.contains("rope_type") || params.contains("type"))) {
    if (scaling && *scaling != params) {
      // Both given: the same scaling (rope_theta aside).
      json a = *scaling, b = params;
      a.erase("rope_theta"), b.erase("rope_theta");
      if (a != b)
        throw Error(fmt::format("{}: fields 'rope_scaling' and 'rope_parameters' give other rotary scalings ({} and {})",
                                where, a.dump(), b.dump()));
    }
    scaling = &params;
    scaling_name = "rope_parameters";
  }
  if (scaling) {
    const json& r = *scaling;
    const json type = r.contains("rope_type") ? r["rope_type"] : (r.contains("type") ? r["type"] : json());
    if (type != "llama3" && type != "default")
      throw Error(fmt::format("{}: field '{}' has rope_type {}; loom implements llama3 (or default: none)", where,
                              scaling_name, type.dump()));
    if (type == "llama3") {
      // transformers reads each of these by key (a missing one is its KeyError).
      for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        if (!r.contains(key) || !r[key].is_number())
          throw Error(fmt::format("{}: field '{}.{}' must be a number (llama3 scaling needs it)", where, scaling_name,
                                  key));
      c.rope_scaling_factor = number(r, "factor", 0);
      if (!(c.rope_scaling_factor > 0))
        throw Error(fmt::format("{}: field '{}.factor' is {}: it must be positive", where, scaling_name,
                                r["factor"].dump()));
      c.rope_low_freq_factor = number(r, "low_freq_factor", 1);
      c.rope_high_freq_factor = number(r, "high_freq_factor", 4);
      const double original = r["original_max_position_embeddings"].get<double>();
      if (!(original >= 1 && original <= double(int64_t(1) << 40)) || std::floor(original) != original)
        throw Error(fmt::format("{}: field '{}.original_max_position_embeddings' is {}: it must be a whole number of "
                                "positions",
                                where, scaling_name, r["original_max_position_embeddings"].dump()));
      c.rope_original_max_position = int64_t(original);
    }
  }
  c.validate(where);
  return c;
}

GPTConfig read_hf_config(const std::string& path) {
  const std::string text = read_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  if (j.is_object() && j.contains("model_type") && j["model_type"] == "llama") return llama_config_from_hf(j, path);
  if (j.is_object() && j.contains("model_type") && j["model_type"] != "gpt2")
    throw Error(fmt::format("{}: field 'model_type' is {}; loom imports gpt2 and llama", path, j["model_type"].dump()));
  return gpt_config_from_hf(j, path);
}

json hf_config_json(const GPTConfig& c) {
  if (is_llama(c)) {
    json j = {{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_act", "silu"},
              {"hidden_size", c.n_embd},
              {"intermediate_size", c.ffn()},
              {"num_hidden_layers", c.n_layer},
              {"num_attention_heads", c.n_head},
              {"num_key_value_heads", c.kv_heads()},
              {"head_dim", c.head_size()},
              {"vocab_size", c.vocab_size},
              {"max_position_embeddings", c.block_size},
              {"rms_norm_eps", shortest(c.ln_eps)},
              {"rope_theta", c.rope_theta},
              {"rope_scaling", nullptr},
              {"attention_bias", c.bias},
              {"mlp_bias", c.bias},
              {"attention_dropout", 0.0},
              {"pretraining_tp", 1},
              {"initializer_range", shortest(c.init_std)},
              {"tie_word_embeddings", c.tied_embeddings},
              {"use_cache", true},
              {"torch_dtype", "float32"},
              // The special tokens' ids are the tokenizer's, which a checkpoint does not hold:
              // null, rather than absent (transformers' Llama defaults, 1 and 2, are ordinary
              // tokens of another vocabulary, and generation would stop at one).
              {"bos_token_id", nullptr},
              {"eos_token_id", nullptr}};
    if (c.rope_scaling_factor > 0)
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", c.rope_scaling_factor},
                           {"low_freq_factor", c.rope_low_freq_factor},
                           {"high_freq_factor", c.rope_high_freq_factor},
                           {"original_max_position_embeddings", c.rope_original_max_position}};
    return j;
  }
  if (!c.is_gpt2())
    throw Error(fmt::format("model '{}' ({}) is neither GPT-2's architecture nor Llama's (RMSNorm, SwiGLU and rotary "
                            "positions together): no Hugging Face model type holds it",
                            c.name, c.str()));
  json j = {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"activation_function", "gelu_new"},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_embd", c.n_embd},
            {"n_inner", nullptr},
            {"vocab_size", c.vocab_size},
            {"n_positions", c.block_size},
            {"n_ctx", c.block_size},
            {"layer_norm_epsilon", shortest(c.ln_eps)},
            {"initializer_range", shortest(c.init_std)},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"tie_word_embeddings", c.tied_embeddings},
            {"use_cache", true},
            {"torch_dtype", "float32"}};
  // GPT-2's own vocabulary: <|endoftext|> is 50256 (transformers' default); another's is the
  // tokenizer's, unknown here: null rather than that default, which may lie outside it.
  j["bos_token_id"] = c.vocab_size == 50257 ? json(50256) : json(nullptr);
  j["eos_token_id"] = c.vocab_size == 50257 ? json(50256) : json(nullptr);
  return j;
}

}  // namespace loom::model
