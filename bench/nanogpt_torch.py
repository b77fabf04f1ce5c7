#!/usr/bin/env python3
"""GPT-2 124M training speed in PyTorch (nanoGPT-style) next to loom's CUDA step, in one run.

  python3 bench/nanogpt_torch.py [--loom-bin train_gpt2_cuda] [-B 16] [-T 1024] [--steps 30]
                                 [--warmup 5] [--modes loom-flash,loom-cudnn,eager,compile] [--json-out FILE]
  python3 bench/nanogpt_torch.py --parity DUMP   # compare a loom dump (train_gpt2_cuda --dump)
  /usr/bin/python3 bench/nanogpt_torch.py --cpu-memorize -B 4 -T 256 --steps 30   # no GPU: loss curves on the CPU

The PyTorch model is nanoGPT's GPT (LayerNorm with bias, tanh GELU, tied wte/lm_head, vocabulary
padded to 50304) trained with bf16 autocast, F.scaled_dot_product_attention (PyTorch's choice of backend, or one pinned by the mode), fused
AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on 2-D parameters) and global-norm clipping at
1.0, on uniform random tokens, as loom's train_gpt2_cuda does.

FLOPs per token (the same for every row): 6 N + 12 L H Q T, N the parameters without wpe (wte
counted once), H heads of size Q, T the sequence length (nanoGPT's estimate_mfu). MFU is given
against the H100 SXM dense bf16 datasheet peak (989 TFLOP/s) and against the bf16 8192^3 matmul
rate measured in this run.
"""
import argparse
import contextlib
import json
import math
import os
import shlex
import struct
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PEAK_DATASHEET = 989e12


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.attn_c_attn = nn.Linear(C, 3 * C)
        self.attn_c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.mlp_c_fc = nn.Linear(C, 4 * C)
        self.mlp_c_proj = nn.Linear(4 * C, C)
        self.H = H
        self.rnd = lambda x: x  # GPT.round_residual_to_bf16 sets it

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn_c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.H, C // self.H).transpose(1, 2)
        k = k.view(B, T, self.H, C // self.H).transpose(1, 2)
        v = v.view(B, T, self.H, C // self.H).transpose(1, 2)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch before 2.0 (Debian's 1.13, for --cpu-memorize): the same attention, written out
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = att.softmax(-1) @ v
        x = self.rnd(x + self.attn_c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return self.rnd(x + self.mlp_c_proj(F.gelu(self.mlp_c_fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, L=12, H=12, C=768, V=50304, maxT=1024, V_real=None):
        super().__init__()
        self.V_real = V_real or V
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(maxT, C)
        self.h = nn.ModuleList([Block(C, H) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.L, self.H, self.C = L, H, C
        std = 0.02
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * L))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            elif n.endswith("bias"):
                nn.init.zeros_(p)
        self.rnd = lambda x: x

    def round_residual_to_bf16(self):
        """The residual stream rounded to bf16 after every add, and its gradient too (the casts' backward
        rounds it), as loom's CUDA step stores both (autocast keeps them in f32)."""
        self.rnd = lambda x: x.to(torch.bfloat16).to(x.dtype)
        for b in self.h:
            b.rnd = self.rnd

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.rnd(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if self.V_real != logits.shape[-1]:
            logits = logits[..., : self.V_real]
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def flops_per_token(model, T, V=50257):
    """6 N + 12 L H Q T, N without wpe and with the real vocabulary (the padding rows of nanoGPT's
    50304-row wte are not model parameters): the same count for loom and PyTorch."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    n -= (model.wte.weight.shape[0] - V) * model.C
    return 6 * n + 12 * model.L * model.H * (model.C // model.H) * T


def matmul_peak():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 30
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (e0.elapsed_time(e1) * 1e-3)


def sdpa_backend(name):
    """A context that pins scaled_dot_product_attention to one backend ("flash", "cudnn",
    "efficient"), or PyTorch's own choice (None)."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[name])


def bench_torch(mode, B, T, steps, warmup):
    # eager, compile, or either with an SDPA backend pinned: eager-flash, compile-cudnn, ...
    mode, _, backend = mode.partition("-")
    with sdpa_backend(backend or None):
        r = bench_torch_run(mode, B, T, steps, warmup)
    if backend:
        r["impl"] += "-" + backend
    return r


def setup(B, T, device):
    """nanoGPT's model from seed 1337, its AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on
    matrices; fused on the GPU) and one batch of uniform random tokens from seed 1338 with its next
    tokens."""
    torch.manual_seed(1337)
    model = GPT().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device == "cuda" else {}))
    g = torch.Generator(device=device).manual_seed(1338)
    data = torch.randint(0, 50257, (B, T + 1), device=device, generator=g)
    return model, opt, data[:, :-1].contiguous(), data[:, 1:].contiguous()


def bench_torch_run(mode, B, T, steps, warmup):
    model, opt, x, y = setup(B, T, "cuda")
    fpt = flops_per_token(model, T)
    run = torch.compile(model) if mode == "compile" else model
    times, losses = [], []
    t_compile = time.time()
    for s in range(warmup + steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        e1.record()
        losses.append(loss.item())  # synchronises, as loom's step reads its loss back
        if s == warmup - 1:
            t_compile = time.time() - t_compile
        if s >= warmup:
            times.append(e0.elapsed_time(e1))
    times.sort()
    med = times[len(times) // 2]
    peak_mem = torch.cuda.max_memory_allocated()
    del model, opt, run
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"impl": f"torch-{mode}", "B": B, "T": T, "step_ms_median": med, "step_ms_mean": sum(times) / len(times),
            "tokens_per_s": B * T / (med * 1e-3), "flops_per_token": fpt, "first_loss": losses[0],
            "last_loss": losses[-1], "warmup_s": t_compile, "peak_bytes": peak_mem}


def bench_loom(binary, B, T, steps, warmup, extra):
    cmd = shlex.split(binary) + ["-B", str(B), "-T", str(T), "--steps", str(steps), "--warmup", str(warmup), "--json"] + extra
    print("running:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr, file=sys.stderr)
        return None
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    r = json.loads(line)
    r["impl"] = "loom-" + r["attention"] + ("" if r["graph"] else "-nograph")
    return r


def cpu_memorize(a):
    """nanoGPT's model and AdamW (f32, its own initialisation) and `loom bench train` (f32, loom's)
    each trained on one repeated batch of uniform random tokens on the CPU: the two loss curves side
    by side. The batches and weights differ (each side's own seed), so the curves are compared as
    curves: same shape, same level after the same number of steps."""
    torch.set_num_threads(a.threads)
    cmd = shlex.split(a.loom_cpu) + ["bench", "train", "--model", "gpt2-124m", "--batch", str(a.B), "--seq", str(a.T),
                                     "--steps", str(a.steps), "--warmup", "0", "--threads", str(a.threads)]
    print("running:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr, file=sys.stderr)
        return False
    loom = [float(l.split("loss ")[1].split()[0]) for l in out.stdout.splitlines() if l.startswith("step ")]
    model, opt, x, y = setup(a.B, a.T, "cpu")
    if a.torch_precision == "bf16-residual":
        model.round_residual_to_bf16()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if a.torch_precision != "f32" else contextlib.nullcontext()
    print(f"GPT-2 124M, B={a.B}, T={a.T} on the CPU ({a.threads} threads): loom f32, torch {torch.__version__} "
          f"{a.torch_precision}; "
          f"AdamW lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices, clip 1.0\n{'step':>4s} {'loom':>8s} {'torch':>8s}",
          flush=True)
    ours = []
    for s in range(a.steps):
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ours.append(loss.item())
        print(f"{s + 1:4d} {loom[s]:8.4f} {ours[-1]:8.4f}", flush=True)
    k = min(5, a.steps)
    print(f"mean of the last {k} steps: loom {sum(loom[-k:]) / k:.4f}, torch {sum(ours[-k:]) / k:.4f}")
    return True


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    dt = {"F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16}
    out = {}
    for k, v in header.items():
        b, e = v["data_offsets"]
        out[k] = torch.frombuffer(bytearray(data[b:e]), dtype=dt[v["dtype"]]).reshape(v["shape"])
    return meta, out


def parity(path):
    """Loom's logits and gradients (bf16 compute) against PyTorch in f32 on the GPU, same weights."""
    meta, t = read_safetensors(path)
    L, H, C = int(meta["n_layer"]), int(meta["n_head"]), int(meta["n_embd"])
    V, maxT = int(meta["vocab_size"]), int(meta["block_size"])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = GPT(L, H, C, V=V, maxT=maxT).cuda()
    names = {}
    for i in range(L):
        for a, b in [("ln_1", "ln_1"), ("attn.c_attn", "attn_c_attn"), ("attn.c_proj", "attn_c_proj"),
                     ("ln_2", "ln_2"), ("mlp.c_fc", "mlp_c_fc"), ("mlp.c_proj", "mlp_c_proj")]:
            for w in ("weight", "bias"):
                names[f"h.{i}.{a}.{w}"] = f"h.{i}.{b}.{w}"
    names.update({"wte.weight": "wte.weight", "wpe.weight": "wpe.weight", "ln_f.weight": "ln_f.weight",
                  "ln_f.bias": "ln_f.bias"})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for loom_name, torch_name in names.items():
            params[torch_name].copy_(t["param." + loom_name])
    tok, tgt = t["tokens"].long().cuda(), t["targets"].long().cuda()
    logits, loss = model(tok, tgt)
    loss.backward()
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    rows = [("loss", abs(float(t["loss"][0]) - loss.item()) / loss.item(), 5e-3),
            ("logits", rel(t["logits"].cuda(), logits.detach()), 2e-2)]
    worst, worst_name = 0.0, ""
    for loom_name, torch_name in names.items():
        e = rel(t["grad." + loom_name].cuda(), params[torch_name].grad)
        if e > worst:
            worst, worst_name = e, loom_name
    rows.append((f"worst gradient ({worst_name})", worst, 5e-2))
    print(f"parity of {path} ({meta.get('model')}, attention {meta.get('attention')}) against PyTorch f32 on "
          f"{torch.cuda.get_device_name()}: torch loss {loss.item():.6f}, loom {float(t['loss'][0]):.6f}")
    ok = True
    for name, e, tol in rows:
        print(f"  {name:40s} rel err {e:.3e}  (tolerance {tol:.0e}) {'ok' if e <= tol else 'FAIL'}")
        ok &= e <= tol
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom-bin", default="train_gpt2_cuda", help="the loom executable (a command line: split as a shell does)")
    ap.add_argument("-B", type=int, default=16)
    ap.add_argument("-T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default="loom,eager,compile",
                    help="comma separated: loom (or loom-flash, loom-cudnn, loom-gemm: that attention path), eager, "
                         "compile (PyTorch's own SDPA backend; eager-cudnn, compile-flash, ...: that backend pinned)")
    ap.add_argument("--loom-extra", default="", help="extra arguments for the loom binary, space separated")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--parity", default="")
    ap.add_argument("--cpu-memorize", action="store_true",
                    help="no GPU: loom (--loom-cpu, f32) and nanoGPT (--torch-precision) memorising one random batch "
                         "on the CPU, the loss curves side by side (try -B 4 -T 256)")
    ap.add_argument("--loom-cpu", default="build/loom", help="with --cpu-memorize: the loom executable")
    ap.add_argument("--threads", type=int, default=2, help="with --cpu-memorize: CPU threads for both")
    ap.add_argument("--torch-precision", default="f32", choices=["f32", "autocast", "bf16-residual"],
                    help="with --cpu-memorize: PyTorch's model in f32, under bf16 autocast, or under autocast with its "
                         "residual stream and its gradient rounded to bf16 at every add (as loom's CUDA step keeps them)")
    a = ap.parse_args()
    if a.parity:
        sys.exit(0 if parity(a.parity) else 1)
    if a.cpu_memorize:
        sys.exit(0 if cpu_memorize(a) else 1)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.cuda.get_device_name()
    peak = matmul_peak()
    print(f"device {dev}, torch {torch.__version__}, measured bf16 8192^3 matmul {peak / 1e12:.1f} TFLOP/s", flush=True)
    results = []
    for mode in a.modes.split(","):
        if mode == "loom" or mode.startswith("loom-"):
            # loom-flash, loom-cudnn, loom-gemm: the attention path (train_gpt2_cuda --attention)
            extra = a.loom_extra.split() if a.loom_extra else []
            if mode.startswith("loom-"):
                extra += ["--attention", mode[len("loom-"):]]
            r = bench_loom(a.loom_bin, a.B, a.T, a.steps, a.warmup, extra)
        else:
            try:
                r = bench_torch(mode, a.B, a.T, a.steps, a.warmup)
            except torch.cuda.OutOfMemoryError:
                print(f"torch-{mode}: out of memory at B={a.B}", flush=True)
                torch.cuda.empty_cache()
                r = None
            except (KeyError, RuntimeError) as e:  # an unknown mode, or an SDPA backend this GPU lacks
                print(f"torch-{mode}: skipped: {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
                r = None
        if r:
            results.append(r)
            print(json.dumps(r), flush=True)
    base = next((r for r in results if r["impl"] == "torch-compile"), None) or next(
        (r for r in results if r["impl"].startswith("torch-compile")), None)
    print(f"\nGPT-2 124M, B={a.B}, T={a.T}, bf16, {dev}; median of {a.steps} steps after {a.warmup} warm-up; "
          f"FLOPs/token 6N+12LHQT; MFU vs 989 TFLOP/s datasheet and vs {peak / 1e12:.0f} TFLOP/s measured")
    print(f"{'impl':22s} {'ms/step':>9s} {'tokens/s':>11s} {'TFLOP/s':>8s} {'MFU989':>7s} {'MFUmeas':>8s} "
          f"{'vs compile':>10s} {'loss first->last':>18s}")
    for r in results:
        tf = r["tokens_per_s"] * r["flops_per_token"]
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{r['impl']:22s} {r['step_ms_median']:9.2f} {r['tokens_per_s']:11.0f} {tf / 1e12:8.1f} "
              f"{100 * tf / PEAK_DATASHEET:6.1f}% {100 * tf / peak:7.1f}% {ratio:10.3f} "
              f"{r['first_loss']:8.4f}->{r['last_loss']:7.4f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "matmul_peak_flops": peak, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
