#include "core/backend.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include <array>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace loom {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::linear: return "linear";
    case Op::layernorm: return "layernorm";
    case Op::attention: return "attention";
    case Op::crossentropy: return "crossentropy";
    case Op::embedding: return "embedding";
    case Op::gelu: return "gelu";
    case Op::add: return "add";
    case Op::adamw: return "adamw";
    case Op::sum: return "sum";
    case Op::copy: return "copy";
    case Op::count: break;
  }
  return "?";
}

std::string_view attn_kernel_name(AttnKernel k) {
  switch (k) {
    case AttnKernel::automatic: return "auto";
    case AttnKernel::tiled: return "tiled";
    case AttnKernel::flash: return "flash";
    case AttnKernel::cudnn: return "cudnn";
    case AttnKernel::gemm: return "gemm";
  }
  return "?";
}

AttnKernel attn_kernel_from_name(std::string_view name) {
  for (AttnKernel k : {AttnKernel::automatic, AttnKernel::tiled, AttnKernel::flash, AttnKernel::cudnn, AttnKernel::gemm})
    if (attn_kernel_name(k) == name) return k;
  LOOM_FAIL("attention kernel '{}': expected auto, tiled, flash, cudnn or gemm", name);
}

void Backend::upload(void* dst, DType dtype, const float* host, int64_t n) {
  copy({.dst = dst, .dst_dtype = dtype, .dst_host = false, .src = host, .src_dtype = DType::f32, .src_host = true, .n = n});
  synchronize();
}

void Backend::download(float* host, const void* src, DType dtype, int64_t n) {
  copy({.dst = host, .dst_dtype = DType::f32, .dst_host = true, .src = src, .src_dtype = dtype, .src_host = false, .n = n});
  synchronize();
}

void Backend::begin_capture() { LOOM_FAIL("the {} backend cannot capture graphs", name()); }

std::unique_ptr<Graph> Backend::end_capture() { LOOM_FAIL("the {} backend cannot capture graphs", name()); }

namespace {

struct Entry {
  BackendFactory factory = nullptr;
  BackendProbe probe = nullptr;
};

struct Registry {
  std::mutex mu;
  std::array<Entry, 2> entries{};  // by Device
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose: backends register from static initialisers
  return *r;
}

Entry entry(Device d) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.entries.at(size_t(d));
}

}  // namespace

void register_backend(Device device, BackendFactory factory, BackendProbe probe) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.at(size_t(device)) = {factory, probe};
}

bool load_cuda_plugin(std::string* why) {
  static std::once_flag once;
  static bool loaded = false;
  static std::string reason;
  std::call_once(once, [] {
#ifdef LOOM_HAVE_CUDA
    std::string path;
    if (const char* p = std::getenv("LOOM_CUDA_PLUGIN"); p && *p) {
      path = p;
    } else {
      std::error_code ec;
      const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
      path = ((ec ? std::filesystem::path(".") : exe.parent_path()) / "libloom_cuda.so").string();
    }
    if (!std::filesystem::exists(path)) {
      reason = fmt::format("{}: the CUDA plugin is missing (built with loom in CUDA builds; LOOM_CUDA_PLUGIN names "
                           "another)", path);
      return;
    }
    if (!::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* e = ::dlerror();
      reason = fmt::format("{}: cannot load the CUDA plugin: {}", path, e ? e : "unknown reason");
      return;
    }
    loaded = true;
#else
    reason = "this build of loom has no CUDA (configure with the CUDA toolkit installed)";
#endif
  });
  if (!loaded && why) *why = reason;
  return loaded;
}

bool backend_available(Device device, std::string* why) {
  if (device == Device::cuda && !entry(device).factory) {
    std::string reason;
    if (!load_cuda_plugin(&reason)) {
      if (why) *why = reason;
      return false;
    }
  }
  const Entry e = entry(device);
  if (!e.factory) {
    if (why) *why = fmt::format("this build of loom has no {} backend", device_name(device));
    return false;
  }
  return !e.probe || e.probe(why);
}

std::unique_ptr<Backend> make_backend(Device device, const BackendOptions& opt) {
  std::string why;
  LOOM_CHECK(backend_available(device, &why), "no {} backend: {}", device_name(device), why);
  return entry(device).factory(opt);
}

}  // namespace loom
