"""The float64 reference with mods, for the self-test cases (flashgen.selftest.kinds).

The mods are written out here from their documented expressions (docs/MODS.md's table of
built-ins), not taken from the generated package or from flashgen's expression compiler,
so that a mistake there cannot cancel out; the attention itself is flashgen.reference's,
written from its definition.
"""
from __future__ import annotations

import torch

from ..reference import attention_ref
from .cases import Case

F64 = torch.float64


class Mods:
    """A case's mods: the call's keyword arguments, and the reference's score mod, mask and
    sink as functions of index grids (b, h, i = q_idx, j = kv_idx: long tensors that
    broadcast to the scores)."""

    def __init__(self, case: Case, pkg, g: torch.Generator, device, batch: int, n_q: int,
                 n_k: int, grad: bool):
        decl = pkg._registry.MODS
        self.names = tuple(case.mods)
        self.kwargs: dict = {}
        self.grads: dict[str, torch.Tensor] = {}  # name -> the tensor the call differentiates
        self.params: dict = {}
        self.host: dict[str, torch.Tensor] = {}   # the tensors' values, on the CPU
        heads, n = case.h_q, max(n_q, n_k)
        for m in self.names:
            if m not in decl:
                raise ValueError(f"{case.package} has no mod {m!r}")
            for p, default in decl[m]["params"].items():
                self.params[p] = dict(case.mod_params).get(p, default)
        if not self.names:
            return
        self.kwargs["mods"] = self.names
        self.kwargs.update({p: v for p, v in case.mod_params})
        for m in self.names:
            if m == "alibi":
                self.host["slope"] = torch.rand(heads, generator=g) * 0.95 + 0.05
            elif m == "relative_bias":
                r = 2 * int(self.params["max_distance"]) + 1
                self.host["rel_bias"] = torch.randn(heads, r, generator=g) * 0.5
            elif m == "prefix_lm":
                self.host["prefix_len"] = torch.randint(0, n_k + 1, (batch,), generator=g,
                                                        dtype=torch.int32)
            elif m == "document":
                runs = max(2, n // 8)
                ids = torch.randint(0, runs, (batch, n), generator=g)
                self.host["doc"] = torch.sort(ids, -1).values.to(torch.int32)
            elif m == "key_padding":
                self.host["keep"] = padding(g, batch, n_k)
            elif m == "sink_logits":
                self.host["sinks"] = torch.randn(heads, generator=g)
        for name, value in self.host.items():
            t = value.to(device)
            if name == "sinks" and grad:
                t.requires_grad_()
                self.grads["d" + name] = t
            self.kwargs[name] = t

    def _t(self, name, like):
        t = self.host[name].to(like.device)
        return t.to(F64) if t.is_floating_point() else t

    def score(self, s, b, h, i, j, leaves=None):
        """The score mods in order; `leaves` replace tensors by differentiable copies."""
        leaves = leaves or {}
        for m in self.names:
            if m == "softcap":
                cap = float(self.params["cap"])
                s = cap * torch.tanh(s / cap)
            elif m == "alibi":
                s = s - self._t("slope", s)[h] * (i - j).abs()
            elif m == "relative_bias":
                rel, dist = self._t("rel_bias", s), int(self.params["max_distance"])
                s = s + rel[h, (j - i + dist).clamp(0, rel.shape[1] - 1)]
        return s

    def mask(self, b, h, i, j):
        """The mask mods ANDed (None without one)."""
        out = None
        for m in self.names:
            if m == "prefix_lm":
                v = (j < self._t("prefix_len", i).long()[b]) | (j <= i)
            elif m == "document":
                doc = self._t("doc", i).long()
                v = doc[b, i] == doc[b, j]
            elif m == "key_padding":
                v = self._t("keep", i)[b, j]
            elif m == "window_sinks":
                sinks, window = int(self.params["sinks"]), int(self.params["window"])
                v = (j <= i) & ((j < sinks) | (i - j <= window))
            else:
                continue
            out = v if out is None else out & v
        return out

    def sink(self, b, h, leaves=None):
        """(len(b), H) sink logits, or None."""
        if "sink_logits" not in self.names:
            return None
        sinks = (leaves or {}).get("dsinks")
        sinks = self._t("sinks", b) if sinks is None else sinks
        return sinks[h.view(1, -1)].expand(b.numel(), -1)

    def has_score(self) -> bool:
        return any(m in ("softcap", "alibi", "relative_bias") for m in self.names)


def padding(g, batch: int, n: int) -> torch.Tensor:
    """[batch, n] bool key-padding masks: right-padded, left-padded, scattered, or (one in
    eight) all padding -- a batch element whose rows see no key."""
    keep = torch.ones(batch, n, dtype=torch.bool)
    for b in range(batch):
        kind = int(torch.randint(0, 8, (1,), generator=g))
        cut = int(torch.randint(0, n + 1, (1,), generator=g))
        if kind < 3:
            keep[b, cut:] = False
        elif kind < 6:
            keep[b, :cut] = False
        elif kind < 7:
            keep[b] = torch.rand(n, generator=g) > 0.3
        else:
            keep[b] = False
    return keep


def reference(q, k, v, visible, *, mods: Mods | None, b_index, positions=None, keep=None,
              p=0.0, mod_leaves=None, bias=None, scale=None):
    """(out (B, Nq, Hq, dv), lse (B, Hq, Nq)) in float64 for (B, N, H, d) inputs on one
    device; `b_index` the batch indices the mods see, `positions` the queries' q_idx
    (default 0..Nq-1), `bias` an additive (attn_mask) float bias broadcastable to
    (B, H, Nq, Nk)."""
    bq, n_q, h_q, _ = q.shape
    n_k, dev = k.shape[1], q.device
    b = b_index.to(dev).view(-1, 1, 1, 1)
    h = torch.arange(h_q, device=dev).view(1, -1, 1, 1)
    i = (torch.arange(n_q, device=dev) if positions is None else positions.to(dev)).view(-1, 1)
    j = torch.arange(n_k, device=dev).view(1, -1)
    vis = visible.to(dev)
    score_mod, sink = None, None
    if mods is not None and mods.names:
        extra = mods.mask(b, h, i, j)
        vis = vis if extra is None else vis & extra
        if mods.has_score():
            score_mod = lambda s: mods.score(s, b, h, i, j, mod_leaves)  # noqa: E731
        sink = mods.sink(b.view(-1), h.view(-1), mod_leaves)
    if bias is not None:
        inner = score_mod
        score_mod = lambda s: (s if inner is None else inner(s)) + bias  # noqa: E731
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = attention_ref(t(q), t(k), t(v), vis, scale=scale, keep=keep, dropout_p=p,
                             score_mod=score_mod, sink=sink)
    return t(out), lse
