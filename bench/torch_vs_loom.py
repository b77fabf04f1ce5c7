#!/usr/bin/python3
"""PyTorch vs loom: GPT-2 training throughput on the CPU, alternating runs in one invocation.

Each round runs PyTorch (Debian's python3-torch, torch.set_num_threads(N), OPENBLAS_CORETYPE set
in its environment) and then `loom bench train` on the same configuration (GPT-2 124M, B=4,
T=256 by default), each for a few steps after warm-up, and prints both tokens/s and the ratio.
The summary uses the median over rounds. Run from the repository root:

  /usr/bin/python3 bench/torch_vs_loom.py --loom build/loom

The PyTorch model is the one scripts/torch_reference.py checks loom against (fp32, tanh-GELU,
tied lm_head, no dropout), trained with torch.optim.AdamW and global-norm clipping as loom does.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PRESETS = {"gpt2-124m": (12, 12, 768, 50257, 1024), "gpt2-tiny": (2, 4, 64, 503, 64)}


def torch_worker(a):
    """Runs in a subprocess: times PyTorch training steps and prints a RESULT line."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import torch_reference as ref

    torch.set_num_threads(a.threads)
    L, H, C, V, block = PRESETS[a.model]
    gen = torch.Generator().manual_seed(1337)
    specs = ref.param_specs(L, C, V, block)
    P = ref.init_params(specs, L, gen)
    seq = torch.randint(0, V, (a.batch, a.seq + 1), generator=gen)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    decay = [P[n] for n, s, _ in specs if len(s) >= 2]
    no_decay = [P[n] for n, s, _ in specs if len(s) < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, foreach=a.foreach)
    times = []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = ref.gpt_forward(P, x, y, L, H)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if s >= a.warmup:
            times.append(dt)
        print(f"  torch {'step' if s >= a.warmup else 'warm-up'}: {dt * 1e3:.0f} ms loss {loss.item():.4f}",
              file=sys.stderr, flush=True)
    ms = 1e3 * sum(times) / len(times)
    print(f"RESULT tokens_per_s={a.batch * a.seq / (ms * 1e-3):.2f} ms_per_step={ms:.1f} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}", flush=True)


def parse_result(text, who):
    m = re.search(r"^RESULT (.*)$", text, re.M)
    if not m:
        sys.exit(f"{who}: no RESULT line in its output:\n{text[-3000:]}")
    return {k: v for k, v in (kv.split("=", 1) for kv in m.group(1).split())}


def has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "loom"), help="the loom executable")
    ap.add_argument("--model", default="gpt2-124m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--openblas-coretype", default=None,
                    help="OPENBLAS_CORETYPE for PyTorch (default SkylakeX where the CPU has AVX-512, "
                         "else OpenBLAS's own detection)")
    ap.add_argument("--python", default="/usr/bin/python3", help="the Python that has torch (Debian's)")
    ap.add_argument("--foreach", type=int, default=1, help="torch.optim.AdamW(foreach=...)")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.foreach = bool(a.foreach)
    if a.torch_worker:
        return torch_worker(a)

    if not os.access(a.loom, os.X_OK):
        sys.exit(f"{a.loom}: not an executable (build loom and pass --loom PATH)")
    coretype = a.openblas_coretype if a.openblas_coretype is not None else ("SkylakeX" if has_avx512() else "")
    torch_env = dict(os.environ)
    if coretype:
        torch_env["OPENBLAS_CORETYPE"] = coretype
    torch_cmd = [a.python, os.path.abspath(__file__), "--torch-worker", "--model", a.model, "--batch",
                 str(a.batch), "--seq", str(a.seq), "--threads", str(a.threads), "--steps", str(a.steps),
                 "--warmup", str(a.warmup), "--foreach", str(int(a.foreach))]
    loom_cmd = [a.loom, "bench", "train", "--model", a.model, "--batch", str(a.batch), "--seq", str(a.seq),
                "--threads", str(a.threads), "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--gemm-seconds", "0.5"]
    print(f"{a.model} B={a.batch} T={a.seq}, {a.threads} threads, {a.warmup} warm-up + {a.steps} timed steps, "
          f"{a.rounds} rounds; PyTorch with OPENBLAS_CORETYPE={coretype or '(unset)'}", flush=True)
    print(f"loom: {' '.join(loom_cmd)}", flush=True)
    torch_tps, loom_tps, mfu = [], [], []
    for r in range(a.rounds):
        t = subprocess.run(torch_cmd, env=torch_env, capture_output=True, text=True)
        if t.returncode != 0:
            sys.exit(f"PyTorch run failed ({t.returncode}):\n{t.stderr[-3000:]}")
        tr = parse_result(t.stdout, "PyTorch")
        lo = subprocess.run(loom_cmd, capture_output=True, text=True)
        if lo.returncode != 0:
            sys.exit(f"loom run failed ({lo.returncode}):\n{lo.stdout[-3000:]}{lo.stderr[-3000:]}")
        lr = parse_result(lo.stdout, "loom")
        torch_tps.append(float(tr["tokens_per_s"]))
        loom_tps.append(float(lr["tokens_per_s"]))
        mfu.append(float(lr["mfu"]))
        print(f"round {r + 1}: PyTorch {torch_tps[-1]:8.1f} tokens/s | loom {loom_tps[-1]:8.1f} tokens/s "
              f"(MFU {100 * mfu[-1]:.1f}% of {float(lr['gemm_peak_gflops']):.0f} GFLOP/s) | ratio "
              f"{loom_tps[-1] / torch_tps[-1]:.2f}", flush=True)
    tm, lm = statistics.median(torch_tps), statistics.median(loom_tps)
    print(f"median: PyTorch {tm:.1f} tokens/s, loom {lm:.1f} tokens/s, loom/PyTorch {lm / tm:.2f}x, "
          f"loom MFU {100 * statistics.median(mfu):.1f}%")


if __name__ == "__main__":
    main()
