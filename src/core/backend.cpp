#include "core/backend.h"

#include "comm/comm.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include <array>
#include <cmath>
#include <numbers>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace loom {

std::vector<double> rope_inv_freq(int64_t HS, double base, const RopeScaling& s) {
  LOOM_CHECK(HS > 0 && HS % 2 == 0, "rope: the head size must be even, got {}", HS);
  LOOM_CHECK(base > 1, "rope: the base must exceed 1, got {}", base);
  const int64_t half = HS / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f[size_t(i)] = std::pow(base, -double(2 * i) / double(HS));
  if (s.factor > 0) {
    LOOM_CHECK(s.high_freq_factor > s.low_freq_factor && s.original_max_position > 0,
               "rope scaling: high_freq_factor ({}) must exceed low_freq_factor ({}) and the original length ({}) "
               "be positive",
               s.high_freq_factor, s.low_freq_factor, s.original_max_position);
    // Wavelengths longer than original / low_freq_factor are slowed by factor, those shorter than
    // original / high_freq_factor kept, and the ones between blended smoothly.
    const double low_wavelen = double(s.original_max_position) / s.low_freq_factor;
    const double high_wavelen = double(s.original_max_position) / s.high_freq_factor;
    for (double& x : f) {
      const double wavelen = 2 * std::numbers::pi / x;
      if (wavelen > low_wavelen) {
        x /= s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (double(s.original_max_position) / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        x = (1 - smooth) * x / s.factor + smooth * x;
      }
    }
  }
  return f;
}

std::unique_ptr<comm::Comm> Backend::buffer_comm(std::unique_ptr<comm::Comm> host, bool staged) {
  (void)staged;
  return host;
}

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
    case Op::rmsnorm: return "rmsnorm";
    case Op::rope: return "rope";
    case Op::swiglu: return "swiglu";
    case Op::count: break;
  }
  return "?";
}

void check_strided_copy(const StridedCopy& a) {
  LOOM_CHECK(a.batches >= 0 && a.rows >= 0 && a.cols >= 0, "copy_strided: negative sizes ({} x {} x {})", a.batches,
             a.rows, a.cols);
  LOOM_CHECK(!a.accumulate || (a.dst_dtype == DType::f32 && a.src_dtype != DType::i32),
             "copy_strided: accumulate needs an f32 destination and a floating-point source, got {} into {}",
             dtype_name(a.src_dtype), dtype_name(a.dst_dtype));
  // Rows side by side on each side (a GPU's pitched copy takes no narrower pitch).
  LOOM_CHECK(a.rows <= 1 || (a.dst_row >= a.cols && a.src_row >= a.cols),
             "copy_strided: {} rows of {} columns with row strides {} (dst) and {} (src): a row stride must be at "
             "least the row's width",
             a.rows, a.cols, a.dst_row, a.src_row);
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
  DeviceInfoFn info = nullptr;
};

struct Registry {
  std::mutex mu;
  std::array<Entry, 3> entries{};  // by Device
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

void register_backend(Device device, BackendFactory factory, BackendProbe probe, DeviceInfoFn info) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.at(size_t(device)) = {factory, probe, info};
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

bool device_info(Device device, DeviceInfo* info, std::string* why) {
  if (!backend_available(device, why)) return false;
  const Entry e = entry(device);
  if (!e.info) {
    if (why) *why = fmt::format("the {} backend does not describe its device", device_name(device));
    return false;
  }
  return e.info(info, why);
}

std::unique_ptr<Backend> make_backend(Device device, const BackendOptions& opt) {
  std::string why;
  LOOM_CHECK(backend_available(device, &why), "no {} backend: {}", device_name(device), why);
  return entry(device).factory(opt);
}

}  // namespace loom
