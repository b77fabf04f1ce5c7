#!/usr/bin/python3
"""Writes a versioned Llama-family reference dump from plain PyTorch (fp32) for loom's parity tests.

The model is written here from the architecture's definition (Touvron et al. 2023; Hugging Face's
LlamaForCausalLM), not from loom: pre-norm blocks with RMSNorm (x / sqrt(mean(x^2) + eps) * w),
rotary position embeddings on queries and keys (each head's element i paired with element
i + head_size / 2, angle position * theta^(-2i / head_size)), grouped-query causal attention
(each key/value head serves n_head / n_kv_head query heads), a SwiGLU feed-forward
(down(silu(gate(x)) * up(x))), no biases, a final RMSNorm and an untied lm_head. The script keeps
q, k, v, gate and up as separate matrices and writes them in loom's fused layout when it saves:
attn.c_attn.weight = [q; k; v] (rows), mlp.c_fc.weight = [gate; up], mlp.c_proj.weight = down,
attn.c_proj.weight = o, ln_1 / ln_2 / ln_f the RMSNorm weights, lm_head.weight.

It draws its own weights from a torch seed (RMSNorm weights perturbed away from 1), runs forward
and backward on one batch, then trains the same batch for a number of AdamW steps (decay on
matrices only, global-norm clipping). Output: the format of scripts/torch_reference.py
(param.<name>, grad.<name>, tokens, targets, logits, loss, step_losses) with the architecture
options in __metadata__. With --hf-out DIR it also writes the initial weights as a Hugging Face
LlamaForCausalLM checkpoint (the hub's key names, f32, two shards and model.safetensors.index.json,
and config.json), for the conversion tests. Run with Debian's python3-torch:
  /usr/bin/python3 scripts/torch_llama_reference.py --model llama-tiny \
      --out tests/data/llama_tiny_reference.safetensors --hf-out tests/model/hf_llama_tiny
"""
import json
import os
import argparse
import math
import sys

import torch
import torch.nn.functional as F

from torch_reference import FORMAT, VERSION, add_training_args, make_batch, run_reference, training_meta, write_safetensors

# name: (n_layer, n_head, n_kv_head, n_embd, ffn_hidden, vocab_size, block_size, batch, seq)
PRESETS = {
    "llama-tiny": (2, 4, 2, 64, 176, 503, 64, 4, 32),
    "llama-small": (4, 8, 2, 256, 688, 1000, 128, 2, 64),  # the labelled torch test's larger shape
}
THETA = 10000.0
EPS = 1e-5


def init(shape, gen, kind):
    t = torch.empty(shape, dtype=torch.float32)
    if kind == "norm":
        t.normal_(1.0, 0.1, generator=gen)
    else:
        t.normal_(0.0, 0.02, generator=gen)
    return t.requires_grad_(True)


def make_params(L, H, KV, C, Fh, V, gen):
    hs = C // H
    P = {"embed": init((V, C), gen, "w")}
    for i in range(L):
        P[f"{i}.attn_norm"] = init((C,), gen, "norm")
        P[f"{i}.q"] = init((H * hs, C), gen, "w")
        P[f"{i}.k"] = init((KV * hs, C), gen, "w")
        P[f"{i}.v"] = init((KV * hs, C), gen, "w")
        P[f"{i}.o"] = init((C, H * hs), gen, "w")
        P[f"{i}.ffn_norm"] = init((C,), gen, "norm")
        P[f"{i}.gate"] = init((Fh, C), gen, "w")
        P[f"{i}.up"] = init((Fh, C), gen, "w")
        P[f"{i}.down"] = init((C, Fh), gen, "w")
    P["norm"] = init((C,), gen, "norm")
    P["lm_head"] = init((V, C), gen, "w")
    return P


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x, T, hs):
    """x [B, heads, T, hs] rotated by the angle of each position."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    return x * cos + rotate_half(x) * sin


def llama_forward(P, tokens, targets, L, H, KV):
    B, T = tokens.shape
    C = P["embed"].shape[1]
    hs = C // H
    x = P["embed"][tokens]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        h = rms_norm(x, P[f"{i}.attn_norm"])
        q = F.linear(h, P[f"{i}.q"]).view(B, T, H, hs).transpose(1, 2)
        k = F.linear(h, P[f"{i}.k"]).view(B, T, KV, hs).transpose(1, 2)
        v = F.linear(h, P[f"{i}.v"]).view(B, T, KV, hs).transpose(1, 2)
        q, k = rotary(q, T, hs), rotary(k, T, hs)
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, P[f"{i}.o"])
        h = rms_norm(x, P[f"{i}.ffn_norm"])
        x = x + F.linear(F.silu(F.linear(h, P[f"{i}.gate"])) * F.linear(h, P[f"{i}.up"]), P[f"{i}.down"])
    x = rms_norm(x, P["norm"])
    logits = F.linear(x, P["lm_head"])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss


def loom_layout(T, L):
    """(loom name, tensor) in loom's parameter order, from a dict of this script's tensors."""
    out = [("wte.weight", T["embed"])]
    for i in range(L):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", T[f"{i}.attn_norm"]),
            (p + "attn.c_attn.weight", torch.cat([T[f"{i}.q"], T[f"{i}.k"], T[f"{i}.v"]], dim=0)),
            (p + "attn.c_proj.weight", T[f"{i}.o"]),
            (p + "ln_2.weight", T[f"{i}.ffn_norm"]),
            (p + "mlp.c_fc.weight", torch.cat([T[f"{i}.gate"], T[f"{i}.up"]], dim=0)),
            (p + "mlp.c_proj.weight", T[f"{i}.down"]),
        ]
    out += [("ln_f.weight", T["norm"]), ("lm_head.weight", T["lm_head"])]
    return out


def hf_layout(T, L):
    """(Hugging Face LlamaForCausalLM key, tensor) of this script's tensors."""
    out = [("model.embed_tokens.weight", T["embed"])]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", T[f"{i}.attn_norm"]),
            (p + "self_attn.q_proj.weight", T[f"{i}.q"]),
            (p + "self_attn.k_proj.weight", T[f"{i}.k"]),
            (p + "self_attn.v_proj.weight", T[f"{i}.v"]),
            (p + "self_attn.o_proj.weight", T[f"{i}.o"]),
            (p + "post_attention_layernorm.weight", T[f"{i}.ffn_norm"]),
            (p + "mlp.gate_proj.weight", T[f"{i}.gate"]),
            (p + "mlp.up_proj.weight", T[f"{i}.up"]),
            (p + "mlp.down_proj.weight", T[f"{i}.down"]),
        ]
    out += [("model.norm.weight", T["norm"]), ("lm_head.weight", T["lm_head"])]
    return out


def write_hf(out_dir, tensors, L, H, KV, C, Fh, V, block):
    os.makedirs(out_dir, exist_ok=True)
    half = len(tensors) // 2
    shards = [tensors[:half], tensors[half:]]
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, name), shard, {"format": "pt"})
        for key, t in shard:
            weight_map[key] = name
            total += t.numel() * 4
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": C, "intermediate_size": Fh, "num_hidden_layers": L, "num_attention_heads": H,
        "num_key_value_heads": KV, "vocab_size": V, "max_position_embeddings": block, "rms_norm_eps": EPS,
        "rope_theta": THETA, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-out", help="also write the initial weights as a Hugging Face checkpoint here")
    add_training_args(ap)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    L, H, KV, C, Fh, V, block, B, T = PRESETS[a.model]
    if T > block:
        sys.exit(f"seq {T} exceeds block_size {block}")
    gen = torch.Generator().manual_seed(a.seed)
    P = make_params(L, H, KV, C, Fh, V, gen)
    tokens, targets = make_batch(gen, B, T, V, a.ignored)
    initial, logits, loss, grads, grad_norm, step_losses = run_reference(
        P, lambda P, x, y: llama_forward(P, x, y, L, H, KV), tokens, targets, a)

    tensors = [("tokens", tokens), ("targets", targets), ("logits", logits), ("loss", loss.detach().reshape(())),
               ("step_losses", torch.tensor(step_losses, dtype=torch.float32))]
    tensors += [("param." + n, t) for n, t in loom_layout(initial, L)]
    tensors += [("grad." + n, t) for n, t in loom_layout(grads, L)]
    meta = {
        "format": FORMAT, "version": VERSION, "model": a.model,
        "n_layer": str(L), "n_head": str(H), "n_embd": str(C), "vocab_size": str(V), "block_size": str(block),
        "norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "n_kv_head": str(KV), "ffn_hidden": str(Fh),
        "bias": "false", "tied_embeddings": "false", "rope_theta": repr(THETA), "ln_eps": repr(EPS),
        **training_meta(a, B, T, grad_norm),
    }
    write_safetensors(a.out, tensors, meta)
    if a.hf_out:
        write_hf(a.hf_out, hf_layout(initial, L), L, H, KV, C, Fh, V, block)
    print(f"{a.out}: {a.model} B={B} T={T} loss {float(loss):.6f} grad_norm {grad_norm:.6f} "
          f"step losses {' '.join(f'{x:.5f}' for x in step_losses)}")


if __name__ == "__main__":
    main()
