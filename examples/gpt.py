"""A tiny GPT whose attention block is pluggable: train it with the generated package's
`Attention` and with a reference block on PyTorch's scaled_dot_product_attention, from the
same initial weights, and print the two loss curves side by side.

    python examples/gpt.py

Runs on a GPU when there is one; otherwise in Triton's CPU interpreter (slow, but the same
kernel code), with sizes small enough to take well under a minute. The model and the
reference block are also used by tests/test_module.py.

    python examples/gpt.py --bench [--steps 30] [--dropout 0.0 0.1] [--out FILE.json]
        [--profile] [--fp8] [--data repeat|markov]

The end-to-end benchmark (CUDA GPU): a GPT-2-small-shaped model (12 layers, 12 heads of 64,
embed 768, vocab 50257, N = 1024, B = 8, bf16, AdamW) trained from identical weights on
identical batches with the generated package's `Attention` and with the same block on
SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends, at each attention dropout; reports
training steps per second (after warm-up steps, synchronised) and the loss curves side by
side. --fp8 adds the model on flashgen's fp8 attention (q, k, v quantized per head on every
call, q and k rotated first), its loss set against bf16's (issue 50's bar: 1,000 steps,
within 1%).
"""
import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class SDPAAttention(nn.Module):
    """The reference block: the same parameters as the generated `Attention` (a fused `qkv`
    projection laid out [q heads | k heads | v heads], an output `proj`), so state dicts
    move between the two, with attention by torch.nn.functional.scaled_dot_product_attention.
    For GQA it repeats each K/V head for its group of query heads."""

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, causal=True, dropout=0.0,
                 bias=True):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout = causal, dropout
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * self.num_kv_heads) * self.head_dim,
                             bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x):
        b, n, c = x.shape
        h, h_kv = self.num_heads, self.num_kv_heads
        q, k, v = self.qkv(x).view(b, n, h + 2 * h_kv, self.head_dim).split([h, h_kv, h_kv], 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, N, d)
        if h_kv != h:
            k, v = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class MLP(nn.Module):
    def __init__(self, embed_dim):
        super().__init__()
        self.fc = nn.Linear(embed_dim, 4 * embed_dim)
        self.proj = nn.Linear(4 * embed_dim, embed_dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, embed_dim, num_heads, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = attention(embed_dim, num_heads)
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.mlp = MLP(embed_dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` pre-LayerNorm blocks, a final LayerNorm and
    an LM head. `attention(embed_dim, num_heads)` builds each block's attention module
    (use functools.partial for further arguments, e.g. num_kv_heads)."""

    def __init__(self, attention, vocab_size=64, block_size=32, embed_dim=128, num_heads=2,
                 n_layer=2):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(block_size, embed_dim)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, attention)
                                    for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        n = idx.shape[1]
        if n > self.block_size:
            raise ValueError(f"sequence of {n} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(n, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def twin_models(attention, reference=SDPAAttention, seed=0, **config):
    """(model with `attention`, model with `reference`) holding identical weights."""
    torch.manual_seed(seed)
    model = GPT(attention, **config)
    ref = GPT(reference, **config)
    ref.load_state_dict(copy.deepcopy(model.state_dict()))
    return model, ref


def main(steps=5, batch=2, seed=0):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from generated.gpt2_attn import Attention  # head dim 64; fp16, bf16, fp32

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = dict(vocab_size=64, block_size=32, embed_dim=128, num_heads=2, n_layer=2)
    model, ref = (m.to(device=device, dtype=dtype) for m in twin_models(Attention, **config))
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config["vocab_size"], (batch, config["block_size"] + 1),
                         generator=gen).to(device)
    x, y = data[:, :-1], data[:, 1:]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]

    print(f"tiny GPT on {device} ({dtype}): {sum(p.numel() for p in model.parameters())} "
          f"parameters, batch {batch} x {config['block_size']} random tokens")
    print(f"{'step':>4}  {'flashgen Attention':>18}  {'torch SDPA':>10}  {'|diff|':>8}")
    start = time.perf_counter()
    worst = 0.0
    for step in range(steps):
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad(set_to_none=True)
            _, loss = m(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        print(f"{step:>4}  {losses[0]:>18.6f}  {losses[1]:>10.6f}  {abs(losses[0] - losses[1]):>8.1e}")
    print(f"{steps} steps of both models in {time.perf_counter() - start:.1f} s")
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    return 0 if worst < tol else 1


BENCH_CONFIG = dict(vocab_size=50257, block_size=1024, embed_dim=768, num_heads=12, n_layer=12)


def markov_batches(count, batch, length, *, states=512, spread=2.0, seed=0, device="cpu"):
    """`count` batches of (batch, length) tokens from one fixed random first-order Markov
    chain over `states` token ids (transition logits N(0, spread^2)), and its entropy rate
    in nats: the loss a perfect model ends at. The four repeated random batches of the
    default data are memorised (the loss falls to ~0.04, where two bf16 kernels that agree
    to rounding already end 4% apart); a loss with a floor makes "within 1% of bf16" a
    statement about fp8, not about how chaotic memorisation is."""
    gen = torch.Generator(device=device).manual_seed(seed)
    probs = (torch.randn(states, states, generator=gen, device=device) * spread).softmax(-1)
    rows = count * batch
    tokens = torch.empty(rows, length, dtype=torch.long, device=device)
    tokens[:, 0] = torch.randint(0, states, (rows,), generator=gen, device=device)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=gen)[:, 0]
    stationary = torch.full((states,), 1.0 / states, dtype=torch.float64, device=device)
    for _ in range(200):  # power iteration: the chain mixes in a few steps
        stationary = stationary @ probs.double()
    per_state = -(probs.double() * probs.double().clamp_min(1e-300).log()).sum(-1)
    return list(tokens.view(count, batch, length).unbind(0)), float(stationary @ per_state)


# attention kernels by name: flashgen's (fwd_*/bwd_* variants: kernel, preprocess, dkdv, dq),
# SDPA flash's (flash_fwd/flash_bwd, dot_do_o, convert_dq), cuDNN's (sdpa/fmha/flash
# fprop/bprop, cudnn::fusion dot_do_o and convert_dq). Not counted as attention: the
# concatenation of dQ, dK, dV into the QKV projection's gradient (CatArrayBatchedCopy),
# which SDPA's block pays and flashgen's packed `Attention` does not.
_ATTENTION_WORDS = ("flash", "fmha", "sdpa", "fprop", "bprop", "dkdv", "dq_kernel",
                    "preprocess", "attn", "dot_do_o", "convert_dq")


def _attention_kind(name):
    """'fwd', 'bwd' or None (not an attention kernel) for a GPU kernel's name."""
    low = name.lower()
    if low.startswith(("fwd_", "bwd_")):
        return low[:3]
    if not any(w in low for w in _ATTENTION_WORDS):
        return None
    return "bwd" if any(w in low for w in ("bwd", "bprop", "dkdv", "dq_", "dot_do_o",
                                           "convert_dq", "preprocess", "backward")) else "fwd"


def profile_steps(step, steps=2, top=12):
    """GPU time per training step from torch.profiler, split into attention forward,
    attention backward and the rest, plus the `top` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    split = {"attn_fwd": 0.0, "attn_bwd": 0.0, "other": 0.0}
    kernels = {}
    for e in prof.events():
        if (e.device_type != torch.autograd.DeviceType.CUDA
                or getattr(e, "is_user_annotation", False) or "#" in e.name):
            continue  # a GPU-side copy of a record_function range (Optimizer.step#...)
        us = e.device_time / steps
        kind = _attention_kind(e.name)
        split[f"attn_{kind}" if kind else "other"] += us
        entry = kernels.setdefault(e.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    split = {k: round(v / 1e3, 3) for k, v in split.items()}  # ms per step
    split["gpu_total"] = round(sum(split.values()), 3)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"gpu_ms_per_step": split,
            "top_kernels": [{"name": n[:110], "ms_per_step": round(t / 1e3, 3),
                             "launches_per_step": c // steps, "kind": _attention_kind(n)}
                            for n, (t, c) in ranked[:top]],
            "kernels": {n[:200]: [round(t / 1e3, 4), c // steps] for n, (t, c) in ranked}}


def bench(steps=30, warmup=3, batch=8, dropouts=(0.0, 0.1), seed=0, out=None, log=print,
          profile=False, package=None, fp8=False, data="repeat"):
    """Training steps/s of GPT-2 small with flashgen vs SDPA flash vs SDPA cuDNN; with fp8,
    also flashgen's fp8 attention (`Attention(fp8=True)`), its loss set against bf16's."""
    import functools

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if package:  # another build of gpt2_attn (an A/B against generated/)
        sys.path.insert(0, str(Path(package).resolve()))
        from gpt2_attn import Attention
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from generated.gpt2_attn import Attention

    if not torch.cuda.is_available():
        print("examples/gpt.py --bench needs a CUDA GPU", file=sys.stderr)
        return 2
    device, dtype = "cuda", torch.bfloat16
    cfg = BENCH_CONFIG
    gen = torch.Generator().manual_seed(seed)
    if data == "markov":  # a fresh batch every step, one chain for every model
        batches, floor = markov_batches(warmup + steps, batch, cfg["block_size"] + 1,
                                        seed=seed, device=device)
        log(f"# data: a random Markov chain over 512 tokens, entropy rate {floor:.4f} nats "
            f"(the loss floor), {warmup + steps} distinct batches")
    else:
        batches = [torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"] + 1),
                                 generator=gen).to(device) for _ in range(4)]
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: GPT-2 small "
        f"({cfg['n_layer']} layers, {cfg['num_heads']} heads, d=64, N={cfg['block_size']}, "
        f"B={batch}, bf16, AdamW), {steps} timed steps after {warmup}")
    results = []
    for p in dropouts:
        torch.manual_seed(seed)
        base = GPT(functools.partial(Attention, dropout=p), **cfg)
        state = copy.deepcopy(base.state_dict())
        rows = {}
        for name in ("flashgen", *(("flashgen_fp8",) if fp8 else ()), *backends):
            block = (functools.partial(Attention, dropout=p) if name == "flashgen" else
                     functools.partial(Attention, dropout=p, fp8=True)
                     if name == "flashgen_fp8" else functools.partial(SDPAAttention, dropout=p))
            model = GPT(block, **cfg)
            model.load_state_dict(state)
            model.to(device=device, dtype=dtype).train()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            ctx = (sdpa_kernel(backends[name]) if name in backends
                   else contextlib.nullcontext())
            losses = []
            try:
                with ctx:
                    torch.manual_seed(seed + 1)
                    for step in range(warmup + steps):
                        if step == warmup:
                            torch.cuda.synchronize()
                            start = time.perf_counter()
                        data = batches[step % len(batches)]
                        opt.zero_grad(set_to_none=True)
                        _, loss = model(data[:, :-1], data[:, 1:])
                        loss.backward()
                        opt.step()
                        losses.append(loss.detach())
                    torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    rows[name] = {"steps_per_s": round(steps / elapsed, 3),
                                  "ms_per_step": round(elapsed / steps * 1e3, 2),
                                  "losses": [round(x.item(), 4) for x in losses]}
                    if profile:
                        def one_step(data=batches[0]):
                            opt.zero_grad(set_to_none=True)
                            model(data[:, :-1], data[:, 1:])[1].backward()
                            opt.step()
                        rows[name]["profile"] = profile_steps(one_step)
            except Exception as e:  # a backend that refuses (e.g. no dropout) is reported
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            log(f"dropout {p}: {name:10s} " + (f"{rows[name]['steps_per_s']:.2f} steps/s "
                f"({rows[name]['ms_per_step']} ms/step)" if "error" not in rows[name]
                else rows[name]["error"]))
            if "profile" in rows.get(name, {}):
                prof = rows[name]["profile"]
                log(f"dropout {p}: {name:10s} GPU ms/step {prof['gpu_ms_per_step']}")
                for kern in prof["top_kernels"]:
                    log(f"    {kern['ms_per_step']:8.3f} ms  x{kern['launches_per_step']:<4d} "
                        f"{kern['kind'] or '':3s}  {kern['name']}")
            del model, opt
            torch.cuda.empty_cache()
        results.append({"dropout": p, **rows})
        ok = [n for n in rows if "error" not in rows[n]]
        log(f"\ndropout {p}: loss per step ({', '.join(ok)})")
        for i in range(warmup + steps):
            log(f"{i:>4}  " + "  ".join(f"{rows[n]['losses'][i]:8.4f}" for n in ok))
        if "flashgen" in ok and "flashgen_fp8" in ok:
            # the loss at the end: a mean over the last tenth of the steps (with --data
            # markov every step's batch is fresh, so one step's loss is noisy: two bf16
            # kernels read 3.9% apart over the last 10 of 1000 steps)
            tail = max(1, min(steps, max(10, steps // 10)))
            end16, end8 = (sum(rows[n]["losses"][-tail:]) / tail
                           for n in ("flashgen", "flashgen_fp8"))
            log(f"dropout {p}: fp8 attention: {rows['flashgen_fp8']['steps_per_s']:.2f} "
                f"steps/s ({rows['flashgen_fp8']['steps_per_s'] / rows['flashgen']['steps_per_s']:.3f}x "
                f"bf16's); loss over the last {tail} steps {end8:.4f} vs bf16 {end16:.4f} "
                f"({(end8 - end16) / end16 * 100:+.2f}%)")
            if "sdpa_flash" in ok:  # the spread two bf16 kernels show: the noise floor
                end_sdpa = sum(rows["sdpa_flash"]["losses"][-tail:]) / tail
                log(f"dropout {p}: bf16 against bf16: sdpa_flash {end_sdpa:.4f} vs flashgen "
                    f"{end16:.4f} ({(end_sdpa - end16) / end16 * 100:+.2f}%)")
        peers = [rows[n]["steps_per_s"] for n in backends if n in ok]
        if "flashgen" in ok and peers:
            log(f"dropout {p}: flashgen / fastest SDPA backend = "
                f"{rows['flashgen']['steps_per_s'] / max(peers):.3f}x; max |loss diff| vs "
                + ", ".join(f"{n} {max(abs(a - b) for a, b in zip(rows['flashgen']['losses'], rows[n]['losses'])):.4f}"
                            for n in backends if n in ok) + "\n")
    if out:
        Path(out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "batch": batch,
                                         "steps": steps, "warmup": warmup, **cfg,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Train a tiny GPT with flashgen and with SDPA "
                                 "(default), or benchmark GPT-2-small training (--bench).")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true",
                    help="with --bench: a torch.profiler split of each model's step")
    ap.add_argument("--fp8", action="store_true",
                    help="with --bench: also train with flashgen's fp8 attention")
    ap.add_argument("--package", help="with --bench: a folder holding the gpt2_attn package "
                    "to time instead of generated/gpt2_attn")
    ap.add_argument("--data", choices=("repeat", "markov"), default="repeat",
                    help="with --bench: four random batches repeated (default), or a fresh "
                    "batch a step from a random Markov chain whose loss has a floor "
                    "(issue 50's fp8 loss bar)")
    args = ap.parse_args()
    if args.bench:
        sys.exit(bench(args.steps, args.warmup, args.batch, args.dropout, out=args.out,
                       profile=args.profile, package=args.package, fp8=args.fp8,
                       data=args.data))
    sys.exit(main())
