#!/usr/bin/python3
"""Writes a versioned GPT-2 reference dump from plain PyTorch (fp32) for loom's parity tests.

The model is GPT-2 as loom builds it: pre-LayerNorm blocks, tanh-GELU MLP of width 4C, causal
attention, final LayerNorm, lm_head tied to wte, no dropout; weights in Linear layout [out, in]
with Hugging Face GPT-2 names. The script draws its own weights from a torch seed (biases and
LayerNorm parameters are perturbed away from 0 and 1 so that every parameter shapes the forward),
runs forward and backward on one batch, then trains the same batch for a number of AdamW steps
(nanoGPT groups: decay on parameters with two or more dimensions, global-norm clipping).

Output: one safetensors file with
  param.<name>  f32  initial weights            grad.<name>  f32  gradients at the initial weights
  tokens, targets  i32 [B, T] (targets of -1 are ignored)
  logits  f32 [B, T, V]     loss  f32 []     step_losses  f32 [steps]
and __metadata__ holding format, version, the model config, batch, optimiser settings and the
torch version. Run with Debian's python3-torch:
  /usr/bin/python3 scripts/torch_reference.py --model gpt2-tiny --out tests/data/gpt2_tiny_reference.safetensors
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F

FORMAT = "loom-gpt-reference"
VERSION = "1"

# name: (n_layer, n_head, n_embd, vocab_size, block_size, batch, seq)
PRESETS = {
    "gpt2-tiny": (2, 4, 64, 503, 64, 4, 32),
    "gpt2-124m": (12, 12, 768, 50257, 1024, 2, 64),
}


def param_specs(L, C, V, block):
    """(name, shape, kind) in loom's order; kind picks the initialisation."""
    specs = [("wte.weight", (V, C), "w"), ("wpe.weight", (block, C), "w")]
    for i in range(L):
        p = f"h.{i}."
        specs += [
            (p + "ln_1.weight", (C,), "ln_w"), (p + "ln_1.bias", (C,), "b"),
            (p + "attn.c_attn.weight", (3 * C, C), "w"), (p + "attn.c_attn.bias", (3 * C,), "b"),
            (p + "attn.c_proj.weight", (C, C), "proj"), (p + "attn.c_proj.bias", (C,), "b"),
            (p + "ln_2.weight", (C,), "ln_w"), (p + "ln_2.bias", (C,), "b"),
            (p + "mlp.c_fc.weight", (4 * C, C), "w"), (p + "mlp.c_fc.bias", (4 * C,), "b"),
            (p + "mlp.c_proj.weight", (C, 4 * C), "proj"), (p + "mlp.c_proj.bias", (C,), "b"),
        ]
    specs += [("ln_f.weight", (C,), "ln_w"), ("ln_f.bias", (C,), "b")]
    return specs


def init_params(specs, L, gen):
    out = {}
    for name, shape, kind in specs:
        t = torch.empty(shape, dtype=torch.float32)
        if kind == "w":
            t.normal_(0.0, 0.02, generator=gen)
        elif kind == "proj":
            t.normal_(0.0, 0.02 / math.sqrt(2 * L), generator=gen)
        elif kind == "b":
            t.normal_(0.0, 0.02, generator=gen)
        elif kind == "ln_w":
            t.normal_(1.0, 0.1, generator=gen)
        out[name] = t.requires_grad_(True)
    return out


def gpt_forward(P, tokens, targets, L, H, eps=1e-5):
    B, T = tokens.shape
    C = P["wte.weight"].shape[1]
    x = P["wte.weight"][tokens] + P["wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        p = f"h.{i}."
        h = F.layer_norm(x, (C,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        qkv = F.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        h = F.gelu(F.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], eps)
    logits = F.linear(x, P["wte.weight"])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, off = [], 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        dtype = {torch.float32: "F32", torch.int32: "I32"}[t.dtype]
        b = t.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def add_training_args(ap):
    """The options of the reference's batch and AdamW steps (shared with torch_llama_reference.py)."""
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--ignored", type=int, default=1, help="targets set to -1 (ignored by the loss)")
    ap.add_argument("--threads", type=int, default=2)


def make_batch(gen, B, T, V, ignored):
    """Random tokens and their next tokens, i32 [B, T], `ignored` targets set to -1."""
    seq = torch.randint(0, V, (B, T + 1), generator=gen)
    tokens = seq[:, :-1].to(torch.int32).contiguous()
    targets = seq[:, 1:].to(torch.int32).contiguous()
    flat = targets.view(-1)
    for j in torch.randperm(B * T, generator=gen)[:ignored]:
        flat[j] = -1
    return tokens, targets


def run_reference(P, forward, tokens, targets, a):
    """forward(P, tokens, targets) -> (logits, loss) on the initial weights, backward, then a.steps
    AdamW steps on the same batch (decay on matrices only, global-norm clipping). Returns the
    initial weights, logits, loss, gradients, gradient norm and the steps' losses."""
    initial = {n: t.detach().clone() for n, t in P.items()}
    logits, loss = forward(P, tokens.long(), targets.long())
    loss.backward()
    grads = {n: t.grad.detach().clone() for n, t in P.items()}
    grad_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    decay = [t for t in P.values() if t.dim() >= 2]
    no_decay = [t for t in P.values() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    step_losses = []
    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        _, l = forward(P, tokens.long(), targets.long())
        step_losses.append(float(l))
        l.backward()
        if a.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(P.values()), a.max_norm)
        opt.step()
    return initial, logits, loss, grads, grad_norm, step_losses


def training_meta(a, B, T, grad_norm):
    return {"batch": str(B), "seq": str(T), "seed": str(a.seed), "steps": str(a.steps),
            "lr": repr(a.lr), "beta1": repr(a.beta1), "beta2": repr(a.beta2), "eps": repr(a.eps),
            "weight_decay": repr(a.weight_decay), "max_norm": repr(a.max_norm), "grad_norm": repr(grad_norm),
            "torch_version": torch.__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-tiny", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    add_training_args(ap)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    L, H, C, V, block, B, T = PRESETS[a.model]
    B = a.batch or B
    T = a.seq or T
    if T > block:
        sys.exit(f"--seq {T} exceeds block_size {block}")
    gen = torch.Generator().manual_seed(a.seed)
    specs = param_specs(L, C, V, block)
    P = init_params(specs, L, gen)
    tokens, targets = make_batch(gen, B, T, V, a.ignored)
    initial, logits, loss, grads, grad_norm, step_losses = run_reference(
        P, lambda P, x, y: gpt_forward(P, x, y, L, H), tokens, targets, a)

    tensors = [("tokens", tokens), ("targets", targets), ("logits", logits), ("loss", loss.detach().reshape(())),
               ("step_losses", torch.tensor(step_losses, dtype=torch.float32))]
    tensors += [("param." + n, initial[n]) for n, _, _ in specs]
    tensors += [("grad." + n, grads[n]) for n, _, _ in specs]
    meta = {
        "format": FORMAT, "version": VERSION, "model": a.model,
        "n_layer": str(L), "n_head": str(H), "n_embd": str(C), "vocab_size": str(V), "block_size": str(block),
        **training_meta(a, B, T, grad_norm),
    }
    write_safetensors(a.out, tensors, meta)
    print(f"{a.out}: {a.model} B={B} T={T} loss {float(loss):.6f} grad_norm {grad_norm:.6f} "
          f"step losses {' '.join(f'{x:.5f}' for x in step_losses)}")


if __name__ == "__main__":
    main()
