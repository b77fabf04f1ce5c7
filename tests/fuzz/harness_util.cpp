#include "fuzz/harness.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/hf_config.h"
#include "train/safetensors.h"

namespace loom::fuzz {

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
    std::abort();
  }
}

// Scratch files of this process, removed when it exits.
struct ScratchFiles {
  std::vector<std::string> paths;
  ~ScratchFiles() {
    std::error_code ec;
    for (const auto& p : paths) std::filesystem::remove_all(p, ec);
  }
};

// A file of this process for the reader under test (one per harness, rewritten per input).
std::string scratch_path(const char* name) {
  static ScratchFiles files;
  files.paths.push_back(
      (std::filesystem::temp_directory_path() / ("loom_fuzz_" + std::to_string(::getpid()) + "_" + name)).string());
  return files.paths.back();
}

void write_file(const std::string& path, const void* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  check(f != nullptr, "cannot create the scratch file");
  check(size == 0 || std::fwrite(data, 1, size, f) == size, "cannot write the scratch file");
  check(std::fclose(f) == 0, "cannot close the scratch file");
}

// Runs f; a loom::Error (bad input) is fine, any other exception is a bug.
template <class F>
void expect_clean(F&& f) {
  try {
    f();
  } catch (const Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: unexpected exception (not loom::Error): %s\n", e.what());
    std::abort();
  }
}

void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

}  // namespace

int safetensors(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path("st");
  write_file(path, data, size);
  expect_clean([&] {
    train::SafetensorsReader r(path);
    uint64_t pos = 0;
    for (const auto& e : r.entries()) {
      check(e.begin == pos, "accepted tensors do not tile the data buffer");
      check(e.nbytes() == uint64_t(e.numel()) * dtype_size(e.dtype), "accepted tensor size differs from its shape");
      check(r.contains(e.name) && &r.entry(e.name) == &e, "entry lookup disagrees with the entry list");
      pos = e.end;
      if (e.nbytes() <= (16u << 20)) {
        Tensor t = r.load(e.name, MemTag::workspace);
        check(t.nbytes() == e.nbytes(), "loaded tensor has another size");
        if (e.dtype == DType::f32 || e.dtype == DType::bf16 || e.dtype == DType::f16)
          check(r.read_f32(e.name).size() == size_t(e.numel()), "read_f32 returned another count");
      }
    }
    check(size >= 8 + 2, "accepted a file shorter than its length field and an empty header");
  });
  return 0;
}

int shard(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path("shard");
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  auto* b = reinterpret_cast<uint8_t*>(bytes.data());
  if ((mode & 2) && bytes.size() >= data::kShardHeaderBytes)
    put_u32(b + 28, data::crc32(b + data::kShardHeaderBytes, bytes.size() - data::kShardHeaderBytes));
  if ((mode & 1) && bytes.size() >= 36) put_u32(b + 32, data::crc32(b, 32));
  write_file(path, bytes.data(), bytes.size());
  for (bool verify : {true, false}) {
    expect_clean([&] {
      data::Shard s(path, verify);
      check(data::kShardHeaderBytes + s.size() * s.width() == bytes.size(), "accepted shard size disagrees");
      check(s.vocab_size() > 0 && (s.width() == 2 || s.width() == 4), "accepted shard has a bad width or vocab");
      std::vector<int32_t> toks(size_t(std::min<uint64_t>(s.size(), 1u << 16)));
      s.read(0, toks.size(), toks.data());
      for (size_t i = 0; i < toks.size(); ++i) check(uint32_t(toks[i]) == s.at(i), "read and at disagree");
    });
  }
  return 0;
}

int manifest(const uint8_t* data, size_t size) {
  static const std::string dir = scratch_path("run") + "/ckpt_00000003";
  static const bool made = [] {
    std::filesystem::create_directories(dir);
    return true;
  }();
  (void)made;
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  write_file(dir + "/manifest.json", text.data(), text.size());
  std::error_code ec;
  std::filesystem::remove(dir + "/manifest.crc32", ec);
  if (data[0] & 1) {
    const std::string crc = std::to_string(data::crc32(text.data(), text.size())) + "\n";
    write_file(dir + "/manifest.crc32", crc.data(), crc.size());
  }
  expect_clean([&] {
    const train::CheckpointMeta m = train::read_checkpoint_meta(dir);
    check(m.step == 3, "accepted a manifest whose step is not its directory's");
    check(m.optimizer_steps >= 0 && m.data_position >= 0, "accepted negative counters");
  });
  return 0;
}

int config(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path("config.toml"), again = scratch_path("config_again.toml");
  write_file(path, reinterpret_cast<const char*>(data), size);
  expect_clean([&] {
    const train::TrainConfig c = train::load_config(path, {});
    const std::string toml = train::config_to_toml(c);
    write_file(again, toml.data(), toml.size());
    check(train::config_to_toml(train::load_config(again, {})) == toml, "a written config loads differently");
  });
  return 0;
}

int hf_config(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path("hf_config.json");
  write_file(path, reinterpret_cast<const char*>(data), size);
  expect_clean([&] {
    const model::GPTConfig c = model::read_hf_config(path);
    // GPT-2's or Llama's config.json, by the model it read.
    const nlohmann::json j = model::hf_config_json(c);
    const model::GPTConfig d = model::is_llama(c) ? model::llama_config_from_hf(j, "written back")
                                                  : model::gpt_config_from_hf(j, "written back");
    check(c.n_layer == d.n_layer && c.n_head == d.n_head && c.n_embd == d.n_embd && c.vocab_size == d.vocab_size &&
              c.block_size == d.block_size && c.tied_embeddings == d.tied_embeddings && c.ln_eps == d.ln_eps &&
              c.kv_heads() == d.kv_heads() && c.ffn() == d.ffn() && c.bias == d.bias && c.rope_theta == d.rope_theta &&
              c.rope_scaling_factor == d.rope_scaling_factor,
          "a written config.json reads as another model");
  });
  return 0;
}

int tokenizer_json(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path("tokenizer.json");
  static const std::string saved = scratch_path("tokenizer_json_saved");
  write_file(path, reinterpret_cast<const char*>(data), size);
  expect_clean([&] {
    const data::Tokenizer t = data::Tokenizer::from_tokenizer_json(path);
    check(t.vocab_size() >= 256, "accepted a vocabulary without all 256 bytes");
    const std::string text = "Hello, world! It's 2024 \xe2\x80\x94 caf\xc3\xa9 \xff\xfe bytes.\n  spaced 12345";
    check(t.decode(t.encode(text)) == text, "decode(encode(x)) != x");
    t.save(saved);
    check(data::Tokenizer::from_dir(saved).fingerprint() == t.fingerprint(), "a saved tokenizer reads back as another");
  });
  return 0;
}

int vocab(const uint8_t* data, size_t size) {
  static const std::string json_path = scratch_path("vocab.json"), merges_path = scratch_path("merges.txt");
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t cut = all.find('\0');
  const std::string_view js = all.substr(0, cut), merges = cut == all.npos ? std::string_view() : all.substr(cut + 1);
  write_file(json_path, js.data(), js.size());
  write_file(merges_path, merges.data(), merges.size());
  expect_clean([&] {
    const data::Tokenizer t = data::Tokenizer::from_files(json_path, merges_path);
    check(t.vocab_size() >= 256, "accepted a vocabulary without all 256 bytes");
    const std::string text = "Hello, world! It's 2024 \xe2\x80\x94 caf\xc3\xa9 \xff\xfe bytes.\n  spaced";
    check(t.decode(t.encode(text)) == text, "decode(encode(x)) != x");
    for (int32_t id = 0; id < t.vocab_size(); id += 1 + t.vocab_size() / 64)
      check(t.decode(std::vector<int32_t>{id}) == t.token(id), "decode of one id differs from its bytes");
  });
  return 0;
}

}  // namespace loom::fuzz
