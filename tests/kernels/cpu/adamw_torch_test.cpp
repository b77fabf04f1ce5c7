// AdamW and global-norm clipping against torch.optim.AdamW and torch.nn.utils.clip_grad_norm_
// (Debian's python3-torch): the same parameters and the same gradient sequence through 10 steps.
// Skips when /usr/bin/python3 cannot import torch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::random_vec;

namespace {

constexpr const char* kPython = "/usr/bin/python3";

// Reads p0 [n] and grads [steps, n] (raw f32), runs torch's AdamW with clipping, writes the final
// param, exp_avg and exp_avg_sq (raw f32).
constexpr const char* kScript = R"PY(
import array, sys, torch
d, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lr, b1, b2, eps, wd, max_norm = map(float, sys.argv[4:10])
def load(name, count):
    a = array.array('f')
    with open(f"{d}/{name}", "rb") as f:
        a.fromfile(f, count)
    return torch.tensor(a, dtype=torch.float32)
def save(name, t):
    with open(f"{d}/{name}", "wb") as f:
        array.array('f', t.detach().reshape(-1).tolist()).tofile(f)
torch.set_num_threads(1)
p = torch.nn.Parameter(load("p0.bin", n))
grads = load("grads.bin", n * steps).reshape(steps, n)
opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
for s in range(steps):
    p.grad = grads[s].clone()
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_([p], max_norm)
    opt.step()
st = opt.state[p]
save("p.bin", p)
save("m.bin", st["exp_avg"])
save("v.bin", st["exp_avg_sq"])
)PY";

void write_f32(const std::string& path, const std::vector<float>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
}

std::vector<float> read_f32(const std::string& path, size_t n) {
  std::vector<float> v(n);
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(float)));
  EXPECT_TRUE(bool(f)) << "short read of " << path;
  return v;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

TEST(AdamWTorch, TenStepsWithClippingMatchPyTorch) {
  if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << kPython << " cannot import torch (install Debian's python3-torch)";
  const int64_t n = 1003, steps = 10;
  const double lr = 6e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  const float max_norm = 10.f;
  const std::string dir = std::string(LOOM_BINARY_DIR) + "/adamw_torch_test";
  std::filesystem::create_directories(dir);

  auto p = random_vec(n, 1);
  // Gradient norms about 18 * scale: steps with scale 1 are clipped to 10, the others are not.
  std::vector<float> grads;
  for (int64_t s = 0; s < steps; ++s) {
    auto g = random_vec(n, 100 + uint64_t(s));
    const float scale = (s % 3 == 0) ? 0.3f : 1.f;
    for (int64_t i = 0; i < n; ++i) g[size_t(i)] *= (i % 7 == 0) ? scale * 1e-5f : scale;
    grads.insert(grads.end(), g.begin(), g.end());
  }
  write_f32(dir + "/p0.bin", p);
  write_f32(dir + "/grads.bin", grads);
  std::ofstream(dir + "/adamw_reference.py") << kScript;
  char args[256];
  std::snprintf(args, sizeof(args), " %ld %ld %.17g %.17g %.17g %.17g %.17g %.17g", long(n), long(steps), lr, b1, b2,
                eps, wd, double(max_norm));
  const std::string cmd = std::string(kPython) + " " + dir + "/adamw_reference.py " + dir + args;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "failed: " << cmd;

  std::vector<float> m(size_t(n), 0.f), v(size_t(n), 0.f);
  int clipped = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const float* g = grads.data() + s * n;
    cpu::AdamWArgs a;
    a.lr = lr;
    a.beta1 = b1;
    a.beta2 = b2;
    a.eps = eps;
    a.weight_decay = wd;
    a.step = s + 1;
    a.grad_scale = cpu::clip_scale(std::sqrt(cpu::sum_squares(g, n)), max_norm);
    clipped += a.grad_scale < 1.f;
    cpu::adamw_update(p.data(), g, m.data(), v.data(), n, a);
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, steps);
  const auto tp = read_f32(dir + "/p.bin", size_t(n)), tm = read_f32(dir + "/m.bin", size_t(n)),
             tv = read_f32(dir + "/v.bin", size_t(n));
  const double dp = max_abs_diff(p, tp), dm = max_abs_diff(m, tm), dv = max_abs_diff(v, tv);
  std::printf("max |loom - torch| after %ld steps: param %.3g, exp_avg %.3g, exp_avg_sq %.3g\n", long(steps), dp, dm,
              dv);
  // Same float operations in the same order as PyTorch's vectorised kernels: bitwise equal with
  // Debian's torch 1.13 on x86-64. A torch build that fuses differently may differ by a few
  // roundings: params ~1 (ulp 6e-8), moments below 1.
  EXPECT_LE(dp, 1e-6);
  EXPECT_LE(dm, 1e-7);
  EXPECT_LE(dv, 1e-7);
}
