"""Baseline: a PyTorch Llama of an mtx preset's shape (configs/llama_1b.toml by default: RMSNorm, SwiGLU, rotary
positions, grouped-query attention, no biases, tied output layer), compiled and timed as benchmarks/torch_gpt.py
times its GPT, so mtx's Llama rows have a torch.compile baseline of the same FLOPs. Not part of mtx; GPU machine.

    python benchmarks/torch_llama.py --seq 4096 --micro-batch 4       # the 1B preset's shape at 4,096 tokens

The vocabulary is padded as mtx pads it (a multiple of 1,024: 128,256 -> 129,024), the padded ids masked out of the
loss, so the parameters (1,237,387,264 for the preset) and the FLOPs are mtx's (tests/test_torch_llama.py checks the
count and the loss against mtx's on the same weights).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtx.errors import script_needs  # noqa: E402

script_needs("torch", "pip install torch; the GPU machine has it", __name__)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.torch_gpt import parse_args, time_training  # noqa: E402

# SDPA shares each key/value head among its query heads itself from torch 2.5 (enable_gqa); earlier, repeat them.
GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def padded_vocab(vocab: int, multiple: int = 1024) -> int:
    """mtx's padding (ModelConfig.padded_vocab_size: 128 x 8, so every TP shard up to 8 is a multiple of 128)."""
    return math.ceil(vocab / multiple) * multiple


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):  # in float32, as mtx's and HF's
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


def rotate(x, cos, sin):
    """Rotate-half rope (HF Llama, mtx): pairs (i, i + H / 2) of (B, n, S, H) heads, in float32, cast back."""
    x32, half = x.float(), x.shape[-1] // 2
    return (x32 * cos + torch.cat([-x32[..., half:], x32[..., :half]], -1) * sin).type_as(x)


class Block(nn.Module):
    def __init__(self, d, n, g, f, eps):
        super().__init__()
        self.n, self.g, self.hd = n, g, d // n
        self.ln1, self.ln2 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.qkv = nn.Linear(d, (n + 2 * g) * self.hd, bias=False)  # q, k, v fused: one matmul
        self.proj = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * f, bias=False)  # gate and up fused
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, self.n + 2 * self.g, self.hd).transpose(1, 2).split(
            [self.n, self.g, self.g], dim=1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.g < self.n)
        else:
            k, v = (t.repeat_interleave(self.n // self.g, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.ln2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers, d, n, g, f, seq, vocab, *, base=500000.0, eps=1e-5, untied=False, std=0.02):
        super().__init__()
        self.vocab = vocab  # the real ids; the table has padded_vocab(vocab) rows
        self.wte = nn.Embedding(padded_vocab(vocab), d)
        self.blocks = nn.ModuleList(Block(d, n, g, f, eps) for _ in range(layers))
        self.ln_f = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, padded_vocab(vocab), bias=False) if untied else None
        hd = d // n
        angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                             1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.cat([angles, angles], -1)  # (S, H): computed once, float32
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        s = idx.shape[1]
        x, cos, sin = self.wte(idx), self.cos[:s], self.sin[:s]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        h = self.ln_f(x)
        logits = self.lm_head(h) if self.lm_head is not None else h @ self.wte.weight.T
        logits = logits[..., :self.vocab]  # the padded ids take no probability, as in mtx's loss
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))

    @torch.no_grad()
    def load_hf(self, tensors):
        """Copies a LlamaForCausalLM state dict (numpy or torch, unpadded vocabulary, e.g. mtx's params_to_hf) in,
        fusing q/k/v and gate/up; the padding rows become zero."""
        t = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        self.wte.weight.zero_()[:self.vocab] = t["model.embed_tokens.weight"]
        self.ln_f.weight.copy_(t["model.norm.weight"])
        if self.lm_head is not None:
            self.lm_head.weight.zero_()[:self.vocab] = t["lm_head.weight"]
        for i, blk in enumerate(self.blocks):
            w = lambda name: t[f"model.layers.{i}.{name}.weight"]
            blk.qkv.weight.copy_(torch.cat([w(f"self_attn.{c}_proj") for c in "qkv"]))
            blk.proj.weight.copy_(w("self_attn.o_proj"))
            blk.gate_up.weight.copy_(torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
            blk.down.weight.copy_(w("mlp.down_proj"))
            blk.ln1.weight.copy_(w("input_layernorm"))
            blk.ln2.weight.copy_(w("post_attention_layernorm"))
        return self


def flops_per_token(model: Llama, layers, d, seq) -> float:
    """mtx's count (ModelConfig.flops_per_token): 6N + 12 L D S, N without an untied input table (a lookup)."""
    n = sum(p.numel() for p in model.parameters())
    lookup = model.wte.weight.numel() if model.lm_head is not None else 0
    return 6 * (n - lookup) + 12 * layers * d * seq


def main(argv=None):
    a = parse_args([("layers", 16), ("hidden", 2048), ("heads", 32), ("groups", 8), ("ffn", 8192), ("seq", 4096),
                    ("vocab", 128256), ("rope-base", 500000.0), ("eps", 1e-5), ("untied", False)], argv, __doc__,
                   "torch_llama.py")
    torch.manual_seed(0)
    model = Llama(a.layers, a.hidden, a.heads, a.groups, a.ffn, a.seq, a.vocab, base=a.rope_base, eps=a.eps,
                  untied=a.untied)
    time_training(model, a, a.vocab, flops_per_token(model, a.layers, a.hidden, a.seq),
                  "torch.compile Llama (SDPA, GQA)" if GQA else "torch.compile Llama (SDPA, k/v repeated)")


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
