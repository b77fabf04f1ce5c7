#!/usr/bin/env python3
"""Flash attention forward/backward TFLOP/s: PyTorch's scaled_dot_product_attention (flash
backend, and cuDNN's fused attention backend where available) against loom's bench_flash (loom's
flash kernels, and loom's own cuDNN fused-attention path where bench_flash reports it), same
shapes, same process invocation, one table.

Shapes (FlashAttention-2 paper): 16k tokens per batch, (B, T) in {(16, 1024), (4, 4096),
(1, 16384)}, hidden 2048 (HS 64 -> 32 heads, HS 128 -> 16 heads), bf16, causal, q/k/v laid out
[B, T, NH, HS] (viewed as [B, NH, T, HS] for SDPA, as loom reads them).
FLOP convention (FlashAttention-2's, for every column): forward 4 * B * NH * T^2 * HS / 2 (causal),
backward 2.5x forward. Times: CUDA-event medians after warm-up; backward is
torch.autograd.grad of the output (no gradient accumulation), loom's includes its D preprocessing
and dq conversion.

  python3 bench/flash_vs_sdpa.py [--loom "scripts/gpu_env.sh .devbundle bench_flash"] [--reps N] [--json OUT.json]
"""
import argparse
import json
import re
import shlex
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(16, 1024), (4, 4096), (1, 16384)]
HIDDEN = 2048


def flops_fwd(b, nh, t, hs, causal=True):
    return 4.0 * b * nh * t * t * hs / (2.0 if causal else 1.0)


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def time_sdpa(backend, b, t, hs, warmup, reps):
    nh = HIDDEN // hs
    gen = torch.Generator(device="cuda").manual_seed(1234 + t + hs)

    def rnd():
        x = torch.rand(b, t, nh, hs, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 - 1
        return x.transpose(1, 2)  # [B, NH, T, HS] view of [B, T, NH, HS]

    q, k, v = (rnd().requires_grad_(True) for _ in range(3))
    dout = rnd()
    with sdpa_kernel(backend):
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fwd_ms = median_ms(fwd, warmup, reps)
        out = fwd()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        bwd_ms = median_ms(bwd, warmup, reps)
    f = flops_fwd(b, nh, t, hs)
    return fwd_ms, f / (fwd_ms * 1e9), bwd_ms, 2.5 * f / (bwd_ms * 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="bench_flash", help="loom's bench_flash executable (a command line: split as a shell does)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--hs", default="64,128")
    ap.add_argument("--json", default="", help="write all figures to this JSON file")
    args = ap.parse_args()
    head_sizes = [int(x) for x in args.hs.split(",")]

    dev = torch.cuda.get_device_name()
    print(f"# device: {dev}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    rows = {}
    for hs in head_sizes:
        for b, t in SHAPES:
            r = rows.setdefault((hs, b, t), {})
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    r[name] = time_sdpa(backend, b, t, hs, args.warmup, args.reps)
                except Exception as e:  # a backend that does not take this shape on this build
                    print(f"# {name} hs={hs} B={b} T={t}: unavailable ({type(e).__name__}: {str(e)[:120]})")
                torch.cuda.empty_cache()
            if "sdpa_flash" in r:
                print(f"sdpa_flash hs={hs} B={b} T={t} fwd_tflops={r['sdpa_flash'][1]:.1f} bwd_tflops={r['sdpa_flash'][3]:.1f}",
                      flush=True)

    cmd = shlex.split(args.loom) + ["--reps", str(args.reps), "--warmup", str(args.warmup), "--hs", args.hs]
    print("# running: " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    pat = re.compile(r"^loom_(flash|cudnn) hs=(\d+) B=(\d+) T=(\d+) NH=\d+ causal=1 fwd_ms=([\d.]+) "
                     r"fwd_tflops=([\d.]+) bwd_ms=([\d.]+) bwd_tflops=([\d.]+)", re.MULTILINE)
    for m in pat.finditer(proc.stdout):
        hs, b, t = int(m.group(2)), int(m.group(3)), int(m.group(4))
        name = "loom" if m.group(1) == "flash" else "loom_cudnn"
        rows.setdefault((hs, b, t), {})[name] = (float(m.group(5)), float(m.group(6)), float(m.group(7)),
                                                 float(m.group(8)))
    if proc.returncode != 0:
        print(f"# loom bench_flash exited with {proc.returncode}")

    def cell(r, name, i):
        return f"{r[name][i]:7.1f}" if name in r else "      -"

    def ratio(r, i):
        if "loom" in r and "sdpa_flash" in r:
            return f"{r['loom'][i] / r['sdpa_flash'][i]:5.2f}"
        return "    -"

    print()
    print(f"TFLOP/s on {dev}, bf16, causal (FA2 FLOP convention: fwd 4*B*NH*T^2*HS/2, bwd 2.5x fwd)")
    print("| HS | B  | T     | fwd sdpa-flash | fwd loom | loom/sdpa | fwd sdpa-cudnn | fwd loom-cudnn "
          "| bwd sdpa-flash | bwd loom | loom/sdpa | bwd sdpa-cudnn | bwd loom-cudnn |")
    print("|----|----|-------|----------------|----------|-----------|----------------|----------------"
          "|----------------|----------|-----------|----------------|----------------|")
    for (hs, b, t), r in sorted(rows.items()):
        print(f"| {hs:3d}| {b:2d} | {t:5d} | {cell(r, 'sdpa_flash', 1):>14} | {cell(r, 'loom', 1):>8} | {ratio(r, 1):>9} "
              f"| {cell(r, 'sdpa_cudnn', 1):>14} | {cell(r, 'loom_cudnn', 1):>14} "
              f"| {cell(r, 'sdpa_flash', 3):>14} | {cell(r, 'loom', 3):>8} "
              f"| {ratio(r, 3):>9} | {cell(r, 'sdpa_cudnn', 3):>14} | {cell(r, 'loom_cudnn', 3):>14} |")
    print("loom-cudnn: loom's cuDNN fused-attention path (backend graph API), '-' where bench_flash did not report it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__,
                       "rows": [{"hs": hs, "B": b, "T": t, **{k: dict(zip(("fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops"), v))
                                                             for k, v in r.items()}}
                                for (hs, b, t), r in sorted(rows.items())]}, f, indent=1)
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
