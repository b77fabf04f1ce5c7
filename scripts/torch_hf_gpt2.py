#!/usr/bin/python3
"""Writes a random GPT-2 in Hugging Face layout and its logits from PyTorch, for loom's import tests.

Output directory:
  model.safetensors  the weights as transformers' GPT-2 stores them: hub key names (wte.weight,
                     h.0.attn.c_attn.weight, ...), Conv1D weights [in, out], lm_head tied (absent),
                     plus the causal-mask buffers h.{i}.attn.bias, __metadata__ {"format": "pt"}
  config.json        GPT-2 config (activation gelu_new)
  reference.safetensors  tokens i32 [B, T], logits f32 [B, T, V]

The logits come from a forward written the way transformers' GPT2LMHeadModel computes it
(Conv1D as addmm(bias, x, W), gelu_new), and the script checks that they equal
scripts/torch_reference.py's GPT-2 on the same weights in Linear layout. Weights are random:
N(0, 0.02) matrices, biases N(0, 0.02), LayerNorm weights N(1, 0.1), so every tensor matters.
Run with Debian's python3-torch:
  /usr/bin/python3 scripts/torch_hf_gpt2.py --out DIR [--n-layer 2 --n-head 4 --n-embd 32 ...]
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference  # noqa: E402  (the foundation's PyTorch GPT-2)

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def hf_params(L, C, V, block, gen):
    """name -> tensor in Hugging Face layout (Conv1D weights [in, out])."""
    out = {}
    for name, shape, kind in torch_reference.param_specs(L, C, V, block):
        if name.endswith(CONV1D):
            shape = (shape[1], shape[0])
        t = torch.empty(shape, dtype=torch.float32)
        if kind == "ln_w":
            t.normal_(1.0, 0.1, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def conv1d(x, w, b):
    """transformers' Conv1D: y = x @ w + b with w [in, out]."""
    size_out = x.size()[:-1] + (w.size(-1),)
    return torch.addmm(b, x.reshape(-1, x.size(-1)), w).view(size_out)


def hf_forward(P, tokens, L, H, eps):
    B, T = tokens.shape
    C = P["wte.weight"].shape[1]
    x = P["wte.weight"][tokens] + P["wpe.weight"][torch.arange(T)]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(L):
        p = f"h.{i}."
        h = F.layer_norm(x, (C,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        q, k, v = conv1d(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"]).split(C, dim=2)
        split = lambda t: t.view(B, T, H, C // H).permute(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        w = torch.matmul(q, k.transpose(-1, -2)) / (v.size(-1) ** 0.5)
        w = torch.where(mask, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        a = torch.matmul(w.softmax(dim=-1), v).permute(0, 2, 1, 3).contiguous().view(B, T, C)
        x = x + conv1d(a, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        h = gelu_new(conv1d(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
        x = x + conv1d(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), P["ln_f.weight"], P["ln_f.bias"], eps)
    return F.linear(x, P["wte.weight"])  # lm_head tied to wte


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=300)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--prefix", action="store_true", help="write keys as transformer.<name>")
    a = ap.parse_args()
    if a.seq > a.block:
        sys.exit(f"--seq {a.seq} exceeds --block {a.block}")
    torch.set_num_threads(2)
    L, H, C, V, Tb = a.n_layer, a.n_head, a.n_embd, a.vocab, a.block
    eps = 1e-5
    gen = torch.Generator().manual_seed(a.seed)
    P = hf_params(L, C, V, Tb, gen)
    tokens = torch.randint(0, V, (a.batch, a.seq), generator=gen)
    with torch.no_grad():
        logits = hf_forward(P, tokens, L, H, eps)
        linear = {n: (t.t().contiguous() if n.endswith(CONV1D) else t) for n, t in P.items()}
        ref, _ = torch_reference.gpt_forward(linear, tokens, torch.zeros_like(tokens), L, H, eps)
    diff = float((logits - ref).norm() / ref.norm())
    if diff > 1e-6:
        sys.exit(f"Hugging Face-style forward and torch_reference disagree: {diff:.3e}")

    os.makedirs(a.out, exist_ok=True)
    pre = "transformer." if a.prefix else ""
    tensors = [(pre + n, t) for n, t in P.items()]
    for i in range(L):  # the causal-mask buffer old transformers versions save (ignored on import)
        tensors.append((f"{pre}h.{i}.attn.bias", torch.tril(torch.ones(Tb, Tb)).view(1, 1, Tb, Tb)))
    torch_reference.write_safetensors(os.path.join(a.out, "model.safetensors"), tensors, {"format": "pt"})
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
              "n_layer": L, "n_head": H, "n_embd": C, "vocab_size": V, "n_positions": Tb, "n_ctx": Tb,
              "layer_norm_epsilon": eps, "n_inner": None, "tie_word_embeddings": True}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    torch_reference.write_safetensors(
        os.path.join(a.out, "reference.safetensors"),
        [("tokens", tokens.to(torch.int32)), ("logits", logits)],
        {"format": "loom-hf-gpt2-reference", "version": "1", "torch_version": torch.__version__,
         "seed": str(a.seed), "reference_agreement": repr(diff)})
    print(f"{a.out}: L={L} H={H} C={C} V={V} block={Tb} B={a.batch} T={a.seq}, "
          f"HF-style vs torch_reference {diff:.2e}")


if __name__ == "__main__":
    main()
