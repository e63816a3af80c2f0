"""Baseline: a nanoGPT-style PyTorch GPT of an mtx preset's shape (torch.compile, SDPA flash attention, bf16
autocast, fused AdamW), timed like benchmarks/bench.py. Not part of mtx; run on the GPU machine (torch 2.11).

    python benchmarks/torch_gpt.py --layers 40 --hidden 1536 --heads 16 --seq 1024 --vocab 51200 --micro-batch 8
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from mtx.errors import script_needs  # noqa: E402  (mtx.cli and mtx.errors: the standard library only, no jax)

script_needs("torch", "pip install torch; the GPU machine has it", __name__)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtx.cli import COUNT, WARMUP, OneLineParser, ranged  # noqa: E402

# the timing flags' ranges, as bench.py's; every other number (a size, rope-base, eps) is positive
RANGES = {"steps": COUNT, "warmup": WARMUP}


class Block(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n = n
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n, d // self.n).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, d, n, seq, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parse_args(sizes, argv=None, doc=__doc__, prog="torch_gpt.py"):
    """The shape flags (name, default: its type is the flag's; a bool is a switch) of a baseline plus the timing
    flags every baseline shares."""
    ap = OneLineParser(prog=prog, description=doc.splitlines()[0])
    for name, default in [*sizes, ("micro-batch", 8), ("steps", 10), ("warmup", 3)]:
        if isinstance(default, bool):
            ap.add_argument(f"--{name}", action="store_true")
        else:
            kind = type(default)
            ap.add_argument(f"--{name}", type=ranged(kind, RANGES.get(name, ">= 1" if kind is int else "> 0")),
                            default=default)
    ap.add_argument("--device", default="cuda", help="cpu: an eager smoke test (no torch.compile, no fused AdamW)")
    return ap.parse_args(argv)


def time_training(model, a, vocab, flops_per_token, baseline) -> dict:
    """Warm-up then timed AdamW steps of `model(idx, targets) -> loss` on random ids (batch a.micro_batch x a.seq),
    timed like bench.py -> its JSON line (printed), with bench.py's field names so suite.py tabulates both."""
    cuda = a.device == "cuda"
    model = model.to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    step = torch.compile(model) if cuda else model
    idx = torch.randint(0, vocab, (a.micro_batch, a.seq + 1), device=a.device)
    sync = torch.cuda.synchronize if cuda else lambda: None

    def train_step():
        with torch.autocast(a.device, dtype=torch.bfloat16):
            loss = step(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        train_step()
    sync()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = train_step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = a.micro_batch * a.seq / step_s
    flops = tokens_per_s * flops_per_token
    result = {"baseline": baseline, "device": torch.cuda.get_device_name() if cuda else a.device,
              "params": n_params, "seq": a.seq, "micro_batch": a.micro_batch, "step_s": step_s,
              "step_s_min": min(times), "tokens_per_s": tokens_per_s, "tflops_per_device": flops / 1e12,
              "mfu": flops / 989e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "loss": float(loss.detach())}
    print(json.dumps(result), flush=True)
    return result


def main(argv=None):
    a = parse_args([("layers", 40), ("hidden", 1536), ("heads", 16), ("seq", 1024), ("vocab", 51200)], argv)
    torch.manual_seed(0)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    time_training(model, a, a.vocab, 6 * n_params + 12 * a.layers * a.hidden * a.seq, "torch.compile nanoGPT")


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
