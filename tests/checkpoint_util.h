// Reading whole checkpoints in tests: every full tensor of a checkpoint of any version (however
// many ranks wrote it), and the bytes of its files.
#pragma once
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace loom::test {

// Every full tensor of checkpoint `ckpt` by name (f32 values), checksums checked.
inline std::map<std::string, std::vector<float>> checkpoint_tensors(const std::string& ckpt) {
  train::CheckpointReader r(ckpt);
  std::vector<std::string> names;
  if (!r.meta().tensors.empty()) {
    for (const train::TensorInfo& t : r.meta().tensors) names.push_back(t.name);
  } else {  // versions 1 and 2: one file of full tensors
    train::SafetensorsReader f(ckpt + "/state.safetensors");
    for (const auto& e : f.entries()) names.push_back(e.name);
  }
  std::map<std::string, std::vector<float>> out;
  for (const std::string& n : names) {
    std::vector<float>& v = out[n];
    v.resize(size_t(shape_numel(r.shape(n))));
    r.read(n, 0, int64_t(v.size()), v.data());
  }
  return out;
}

// The bytes of every rank's data and index file of checkpoint `ckpt`, in rank order ("" when it
// has none).
inline std::string checkpoint_bytes(const std::string& ckpt) {
  std::string all;
  for (int r = 0;; ++r) {
    bool any = false;
    for (const char* ext : {"safetensors", "json"}) {
      std::ifstream f(std::filesystem::path(ckpt) / fmt::format("rank_{:05d}.{}", r, ext), std::ios::binary);
      if (!f) continue;
      any = true;
      all += std::string(std::istreambuf_iterator<char>(f), {});
    }
    if (!any) return all;
  }
}

}  // namespace loom::test
