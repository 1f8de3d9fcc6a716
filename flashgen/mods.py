"""Attention mods: score, mask and sink expressions from the spec, compiled into kernels.

A spec's `mods:` entry names an expression over the kernel's indices and the score, e.g.
``cap * tanh(score / cap)`` (a score mod), ``doc[b, q_idx] == doc[b, kv_idx]`` (a mask
mod) or ``sinks[h]`` (a sink: a per-head logit that joins every row's softmax
denominator, gpt-oss style). This module is the compiler for them:

1. **parse**: the text goes through Python's own expression parser, then every node is
   checked against a whitelist and turned into a small typed tree (:class:`Expr`): numbers,
   the index variables ``b, h, q_idx, kv_idx``, ``score`` (score mods only), the mod's
   params, loads of its declared tensors, arithmetic, comparisons, ``and/or/not``,
   ``x if c else y`` and the calls ``where, abs, min, max, exp, log, tanh, sqrt``. Anything
   else is a :class:`ModError` naming the offending token and what is allowed; the spec
   parser turns it into a SpecError at the expression's file:line.
2. **differentiate**: :func:`derivative` builds d(expr)/d(score) (or d/d(a tensor's
   element)) symbolically, as another tree, so the backward kernel gets the chain rule
   without anyone writing it per mod.
3. **render**: :func:`to_triton` prints a tree as a Triton expression over names the
   kernel template defines (``score``, ``q_idx``, ``kv_idx``, ...); :func:`to_torch`
   evaluates one on torch tensors (the reference the tests compare against, and the
   sink's gradient on the host).

Semantics (FlexAttention's): ``score`` is the scaled score q.k * softmax_scale in natural
units; ``q_idx`` / ``kv_idx`` are the row and column of the score matrix (0-based, before
any causal alignment); ``b`` and ``h`` the batch and query head. Params are run-time
scalars (changing one does not recompile); tensors are run-time arguments validated
before launch. A tensor index that is not a bare index variable is clamped into the
tensor's extent, so no value of an index expression can read out of bounds.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field

__all__ = ["ModError", "Expr", "TensorDecl", "Mod", "BUILTINS", "parse_expr",
           "parse_tensor_decl", "derivative", "substitute", "to_triton", "to_torch",
           "free_names", "ops_of", "loads_of", "combine", "score_offset", "scale_into",
           "INDEX_VARS", "FUNCTIONS"]

INDEX_VARS = ("b", "h", "q_idx", "kv_idx")
FUNCTIONS = ("where", "abs", "min", "max", "exp", "log", "tanh", "sqrt")
TENSOR_DTYPES = ("fp32", "fp16", "bf16", "int32", "int64", "bool")
# symbolic extents and the index variable that must be used along them
DIM_INDEX = {"B": ("b",), "H": ("h",), "Nq": ("q_idx",), "Nk": ("kv_idx",),
             "N": ("q_idx", "kv_idx")}
KINDS = ("score", "mask", "sink")
# names a mod may not take (they are words of variant names or of the expression language)
RESERVED = {"none", "causal", "window", "sliding_window", "dropout", "score", "mask", "sink",
            *INDEX_VARS, *FUNCTIONS}
# names a param or tensor may not take
TAKEN = {"score", "True", "False", *INDEX_VARS, *FUNCTIONS}

_ALLOWED = ("numbers, the index variables b, h, q_idx, kv_idx{score}, the mod's params "
            "and tensors (indexed like t[b, q_idx]), + - * /, comparisons, and/or/not, "
            "`x if c else y` and the functions " + ", ".join(FUNCTIONS))


class ModError(ValueError):
    """A problem with a mod expression or declaration; `token` is the offending text."""

    def __init__(self, problem: str, token: str = "", allowed: str = ""):
        super().__init__(problem)
        self.problem, self.token, self.allowed = problem, token, allowed


# ----------------------------------------------------------------------------------------
# The typed tree
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expr:
    """One node. op: const | var | param | load | neg | not | add | sub | mul | div |
    lt | le | gt | ge | eq | ne | and | or | where | abs | min | max | exp | log | tanh |
    sqrt. `value` holds a const's number or a var/param/load's name; `args` the children
    (a load's are its indices). `type`: bool | int | float."""
    op: str
    args: tuple = ()
    value: object = None
    type: str = "float"

    def __str__(self) -> str:
        return to_source(self)


@dataclass(frozen=True)
class TensorDecl:
    name: str
    dims: tuple  # each a symbolic extent (B, H, N, Nq, Nk), another name (free), or an int
    dtype: str

    @property
    def type(self) -> str:
        return "bool" if self.dtype == "bool" else ("int" if self.dtype.startswith("int") else "float")

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.dims))}] {self.dtype}"


@dataclass(frozen=True)
class Mod:
    """A named mod of the spec: one kind (score | mask | sink), its expression (source text
    and tree), run-time params with their defaults and the tensors it reads."""
    name: str
    kind: str
    source: str
    expr: Expr
    params: tuple = ()  # ((name, default), ...)
    tensors: tuple = ()  # (TensorDecl, ...)
    builtin: str | None = None
    doc: str = field(default="", compare=False)

    @property
    def data_dependent(self) -> bool:
        return bool(self.tensors)


_CMP = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_BIN = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">",
           "ge": ">=", "eq": "==", "ne": "!="}


def _const(x) -> Expr:
    if isinstance(x, bool):
        return Expr("const", value=x, type="bool")
    return Expr("const", value=x, type="int" if isinstance(x, int) else "float")


def _num_type(*types) -> str:
    return "float" if "float" in types else "int"


def parse_tensor_decl(name: str, text: str) -> TensorDecl:
    """'[B, N] int32' -> TensorDecl."""
    t = text.strip() if isinstance(text, str) else ""
    if not (t.startswith("[") and "]" in t):
        raise ModError(f"tensor `{name}`: {text!r} is not a declaration", str(text),
                       "'[dims] dtype', e.g. '[B, N] int32' or '[H] fp32'")
    dims_text, dtype = t[1:].split("]", 1)
    dtype = dtype.strip()
    if dtype not in TENSOR_DTYPES:
        raise ModError(f"tensor `{name}`: dtype {dtype!r} is not supported", dtype,
                       "one of " + ", ".join(TENSOR_DTYPES))
    dims = []
    for d in (x.strip() for x in dims_text.split(",")):
        if d.isdigit() and int(d) > 0:
            dims.append(int(d))
        elif d.isidentifier():
            dims.append(d)
        else:
            raise ModError(f"tensor `{name}`: extent {d!r} is not a name or a positive int", d,
                           "B, H, N, Nq, Nk, another name (any extent) or a positive int")
    if not dims:
        raise ModError(f"tensor `{name}` has no dimensions", text, "at least one extent")
    return TensorDecl(name, tuple(dims), dtype)


def parse_expr(text: str, kind: str, params: dict, tensors: dict) -> Expr:
    """Parse and type-check one mod expression. `params` maps names to defaults, `tensors`
    names to TensorDecl. Raises ModError."""
    allowed = _ALLOWED.format(score=", score" if kind == "score" else "")
    if not isinstance(text, str) or not text.strip():
        raise ModError("the expression is empty", "", allowed)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ModError(f"syntax error: {e.msg}", (e.text or text).strip(), allowed) from None

    def seg(node) -> str:
        return ast.get_source_segment(text.strip(), node) or type(node).__name__

    def bad(node, why: str):
        raise ModError(f"{why}: `{seg(node)}`", seg(node), allowed)

    def walk(node) -> Expr:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float)):
                return _const(node.value)
            bad(node, "only numbers and True/False are constants")
        if isinstance(node, ast.Name):
            n = node.id
            if n == "score":
                if kind != "score":
                    bad(node, f"`score` is only defined in a score mod, not a {kind} mod")
                return Expr("var", value=n, type="float")
            if n in INDEX_VARS:
                if kind == "sink" and n in ("q_idx", "kv_idx"):
                    bad(node, "a sink is one logit per (b, h): it cannot depend on q_idx/kv_idx")
                return Expr("var", value=n, type="int")
            if n in params:
                v = params[n]
                return Expr("param", value=n, type="int" if isinstance(v, int) else "float")
            if n in ("True", "False"):
                return _const(n == "True")
            if n in tensors:
                bad(node, f"tensor `{n}` must be indexed, e.g. {n}[{', '.join(['b'] * len(tensors[n].dims))}]")
            bad(node, f"unknown name `{n}`")
        if isinstance(node, ast.Subscript):
            if not (isinstance(node.value, ast.Name) and node.value.id in tensors):
                bad(node, "only the mod's declared tensors can be indexed")
            decl = tensors[node.value.id]
            idx = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if len(idx) != len(decl.dims):
                bad(node, f"`{decl.name}` has {len(decl.dims)} dimensions ({decl}) but "
                          f"{len(idx)} indices")
            args = []
            for dim, i in zip(decl.dims, idx):
                e = walk(i)
                if e.type != "int":
                    bad(i, "a tensor index must be an integer expression")
                if isinstance(dim, str) and dim in DIM_INDEX and not (
                        e.op == "var" and e.value in DIM_INDEX[dim]):
                    bad(i, f"along extent {dim} the index must be "
                           f"{' or '.join(DIM_INDEX[dim])}")
                args.append(e)
            return Expr("load", tuple(args), decl.name, decl.type)
        if isinstance(node, ast.UnaryOp):
            x = walk(node.operand)
            if isinstance(node.op, ast.USub):
                if x.type == "bool":
                    bad(node, "cannot negate a condition (use `not`)")
                return Expr("neg", (x,), type=x.type)
            if isinstance(node.op, ast.UAdd):
                return x
            if isinstance(node.op, ast.Not):
                if x.type != "bool":
                    bad(node, "`not` needs a condition")
                return Expr("not", (x,), type="bool")
            bad(node, "operator not allowed")
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BIN:
                bad(node, "operator not allowed (use + - * /)")
            l, r = walk(node.left), walk(node.right)
            if "bool" in (l.type, r.type):
                bad(node, "arithmetic on a condition (use `x if c else y`)")
            op = _BIN[type(node.op)]
            return Expr(op, (l, r), type="float" if op == "div" else _num_type(l.type, r.type))
        if isinstance(node, ast.Compare):
            parts, left = [], walk(node.left)
            for o, right_node in zip(node.ops, node.comparators):
                right = walk(right_node)
                if type(o) not in _CMP:
                    bad(node, "comparison not allowed")
                if "bool" in (left.type, right.type) and type(o) not in (ast.Eq, ast.NotEq):
                    bad(node, "ordering conditions is not allowed")
                parts.append(Expr(_CMP[type(o)], (left, right), type="bool"))
                left = right
            return parts[0] if len(parts) == 1 else Expr("and", tuple(parts), type="bool")
        if isinstance(node, ast.BoolOp):
            xs = tuple(walk(v) for v in node.values)
            if any(x.type != "bool" for x in xs):
                bad(node, "`and`/`or` need conditions on both sides")
            return Expr("and" if isinstance(node.op, ast.And) else "or", xs, type="bool")
        if isinstance(node, ast.IfExp):
            return _where(node, walk(node.test), walk(node.body), walk(node.orelse), bad)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                bad(node.func, "function not allowed")
            if node.keywords:
                bad(node, "keyword arguments are not allowed")
            fn, xs = node.func.id, [walk(a) for a in node.args]
            want = {"where": 3, "min": 2, "max": 2}.get(fn, 1)
            if len(xs) != want:
                bad(node, f"{fn} takes {want} argument{'s' if want > 1 else ''}")
            if fn == "where":
                return _where(node, *xs, bad)
            if any(x.type == "bool" for x in xs):
                bad(node, f"{fn} needs numbers, not conditions")
            if fn in ("abs", "min", "max"):
                return Expr(fn, tuple(xs), type=_num_type(*(x.type for x in xs)))
            return Expr(fn, tuple(xs), type="float")
        bad(node, "not allowed in a mod expression")

    expr = walk(tree.body)
    if kind == "mask" and expr.type != "bool":
        raise ModError("a mask mod must be a condition (True = the key is visible)", text.strip(),
                       "a comparison or and/or/not of comparisons")
    if kind in ("score", "sink") and expr.type == "bool":
        raise ModError(f"a {kind} mod must be a number, not a condition", text.strip(),
                       "e.g. `x if cond else y` to choose between numbers")
    if kind == "sink":
        for load in loads_of(expr):
            if any(not (i.op == "var" and i.value in ("b", "h")) for i in load.args):
                raise ModError("a sink's tensors are indexed by b and h only", load.value,
                               "e.g. sinks[h]")
    return expr


def _where(node, c: Expr, a: Expr, b: Expr, bad) -> Expr:
    if c.type != "bool":
        bad(node, "the condition of where / `if` must be a comparison")
    if (a.type == "bool") != (b.type == "bool"):
        bad(node, "both branches must be numbers, or both conditions")
    t = "bool" if a.type == "bool" else _num_type(a.type, b.type)
    return Expr("where", (c, a, b), type=t)


# ----------------------------------------------------------------------------------------
# Tree utilities
# ----------------------------------------------------------------------------------------
def _children(e: Expr) -> tuple:
    return e.args


def free_names(e: Expr) -> set:
    """Every var, param and tensor name the tree uses."""
    out = set()
    if e.op in ("var", "param", "load"):
        out.add(e.value)
    for c in _children(e):
        out |= free_names(c)
    return out


def heads_by_index_only(mod: "Mod") -> bool:
    """Whether the mod reads the head index h only as a tensor's index along an H extent
    (ALiBi's slope[h]). A call over a subset of the heads (the ring backward's head
    groups, which count heads from their own first) is then exact with those tensors
    narrowed to its heads; h in arithmetic, or inside another index, is not."""
    extents = {t.name: [str(d) for d in t.dims] for t in mod.tensors}

    def ok(e: Expr) -> bool:
        if e.op == "var":
            return e.value != "h"
        if e.op == "load":
            dims = extents.get(e.value, [])
            return all((i < len(dims) and dims[i] == "H") if (a.op, a.value) == ("var", "h")
                       else ok(a) for i, a in enumerate(e.args))
        return all(ok(c) for c in _children(e))

    return ok(mod.expr)


def _is_var(e: Expr, name: str) -> bool:
    return e.op == "var" and e.value == name


def _small(e: Expr) -> bool:
    """A bound that does not grow with the sequence: a number or a run-time param."""
    return e.op in ("const", "param")


def _same_segment(e: Expr) -> bool:
    """`t[..., q_idx, ...] == t[..., kv_idx, ...]`: both sides one tensor at the same
    indices but for q_idx on one side where kv_idx is on the other (per-token ids)."""
    if e.op != "eq" or any(a.op != "load" for a in e.args):
        return False
    a, b = e.args
    if a.value != b.value or len(a.args) != len(b.args):
        return False
    swapped = [(x, y) for x, y in zip(a.args, b.args) if x != y]
    return len(swapped) == 1 and {(s.op, s.value) for s in swapped[0]} == {
        ("var", "q_idx"), ("var", "kv_idx")}


def _few_keys(e: Expr) -> bool:
    """A condition that admits a bounded number of keys a query, whatever N: a window
    behind it (`q_idx - kv_idx <= w`, `kv_idx >= q_idx - w`), the first keys
    (`kv_idx < n`), with w and n numbers or params; or of such conditions."""
    if e.op == "or":
        return all(_few_keys(a) for a in e.args)
    if e.op == "and":
        return any(_few_keys(a) for a in e.args)
    if e.op in ("lt", "le", "gt", "ge"):
        lhs, rhs = e.args if e.op in ("lt", "le") else e.args[::-1]  # lhs <(=) rhs
        if _is_var(lhs, "kv_idx") and _small(rhs):
            return True
        if (lhs.op == "sub" and _is_var(lhs.args[0], "q_idx") and _is_var(lhs.args[1], "kv_idx")
                and _small(rhs)):
            return True
        if (_is_var(rhs, "kv_idx") and lhs.op == "sub" and _is_var(lhs.args[0], "q_idx")
                and _small(lhs.args[1])):
            return True
    return False


def key_span(mod: "Mod") -> str | None:
    """How a mask mod bounds the keys one query sees, which bounds a forward tile's key
    blocks (families.gluon_default picks the forward's tile boundary knobs from it):
    "segment" where it is a conjunction with a same-segment test (documents: a query sees
    its own document only), "window" where a conjunct admits a bounded number of keys
    (a sliding window, sink tokens), else None (prefix-LM, padding: up to every key)."""
    if mod.kind != "mask":
        return None
    parts = mod.expr.args if mod.expr.op == "and" else (mod.expr,)
    if any(_same_segment(p) for p in parts):
        return "segment"
    if _few_keys(mod.expr):
        return "window"
    return None


def variant_key_span(mods_: list) -> str | None:
    """key_span of a variant's mods together (its mask mods all apply): the tightest."""
    spans = {key_span(m) for m in mods_}
    return next((s for s in ("segment", "window") if s in spans), None)


def ops_of(e: Expr) -> set:
    """Every operation the tree uses (e.g. whether a kernel needs tanh)."""
    out = {e.op}
    for c in _children(e):
        out |= ops_of(c)
    return out


def loads_of(e: Expr) -> list:
    out = [e] if e.op == "load" else []
    for c in _children(e):
        out += loads_of(c)
    return out


def replace_nodes(e: Expr, by: dict) -> Expr:
    """e with every subtree that is a key of `by` replaced by its value."""
    if e in by:
        return by[e]
    if not e.args:
        return e
    return Expr(e.op, tuple(replace_nodes(a, by) for a in e.args), e.value, e.type)


def split_vector_loads(e: Expr, tensors: dict) -> tuple:
    """The loads of a mask whose indices read only one of q_idx / kv_idx (besides b, h and
    params; no load inside an index): (q_loads, kv_loads), each a list of load nodes, in
    first-use order, without repeats. A kernel can read such a load once per query (key)
    vector instead of once per score: the Gluon backward stages the query ones per step in
    shared memory and holds the key ones (no h: a program serves several query heads)
    from its start. Only int and bool tensors (document ids, padding flags)."""
    q_loads, kv_loads = [], []
    for ld in loads_of(e):
        if tensors[ld.value].type == "float" or any(loads_of(i) for i in ld.args):
            continue
        idx_vars = set().union(*(free_names(i) for i in ld.args)) & set(INDEX_VARS)
        if "q_idx" in idx_vars and idx_vars <= {"b", "h", "q_idx"} and ld not in q_loads:
            q_loads.append(ld)
        elif "kv_idx" in idx_vars and idx_vars <= {"b", "kv_idx"} and ld not in kv_loads:
            kv_loads.append(ld)
    return q_loads, kv_loads


def substitute(e: Expr, name: str, by: Expr) -> Expr:
    """e with every var `name` replaced by the tree `by` (composing score mods)."""
    if e.op == "var" and e.value == name:
        return by
    if not e.args:
        return e
    return Expr(e.op, tuple(substitute(a, name, by) for a in e.args), e.value, e.type)


def combine(score_exprs: list) -> Expr | None:
    """Score mods applied in order: f2(f1(score))."""
    out = None
    for e in score_exprs:
        out = e if out is None else substitute(e, "score", out)
    return out


# ----------------------------------------------------------------------------------------
# Score mods that only shift the score
# ----------------------------------------------------------------------------------------
# A score mod score + h(b, h, q_idx, kv_idx) (ALiBi, relative biases) has d/d score = 1, and
# the kernels need it in their own units: raw scores (Q K^T) in the forward, log2 units in
# the backward. Written as it is parsed, that is a multiply into natural units, the mod, and
# a multiply back, per score element; with h taken apart from the score the unit change
# is one factor of h, and placed on a factor that is the same for the whole tile (slope[h],
# a param) it is computed once per tile, not per element: score' = qk + (slope[h] * k) *
# |q - kv| is an add and an FMA a score.
_SCORE = Expr("var", value="score")
_PER_ELEMENT = {"score", "q_idx", "kv_idx"}


def score_offset(e: Expr | None) -> Expr | None:
    """h when the score mod e is score + h (in any arrangement of adds and subtracts of
    terms free of `score`, the score's coefficient 1), else None."""
    if e is None:
        return None
    if e == _SCORE:
        return _ZERO
    if e.op in ("add", "sub"):
        a, b = e.args
        if "score" not in free_names(b):
            base = score_offset(a)
            if base is not None:
                return (_add if e.op == "add" else _sub)(base, b)
        if e.op == "add" and "score" not in free_names(a):
            base = score_offset(b)
            if base is not None:
                return _add(a, base)
    return None


def _per_tile(e: Expr) -> bool:
    """Whether e is one value for a whole tile of scores (no index but b and h)."""
    return not (free_names(e) & _PER_ELEMENT)


def scale_into(e: Expr, k: Expr) -> Expr:
    """e * k with the factor k multiplied into a per-tile factor of e where there is one
    (so that k costs one multiply a tile), else onto e itself."""
    if _per_tile(e):
        return _mul(e, k)
    if e.op == "neg":  # (onto the factor: -x * k would be a negate and a multiply a score)
        return scale_into(e.args[0], _neg(k))
    if e.op == "add":
        return _add(scale_into(e.args[0], k), scale_into(e.args[1], k))
    if e.op == "sub":
        return _add(scale_into(e.args[0], k), scale_into(e.args[1], _neg(k)))
    if e.op == "mul":
        a, b = e.args
        if _per_tile(a) or not _per_tile(b):
            return _mul(scale_into(a, k), b)
        return _mul(a, scale_into(b, k))
    if e.op == "div" and _per_tile(e.args[1]):
        return _div(scale_into(e.args[0], k), e.args[1])
    if e.op == "where":
        c, a, b = e.args
        return Expr("where", (c, scale_into(a, k), scale_into(b, k)), type="float")
    return _mul(e, k)


# ----------------------------------------------------------------------------------------
# Symbolic differentiation
# ----------------------------------------------------------------------------------------
_ZERO, _ONE = _const(0.0), _const(1.0)


def _is(e: Expr, v: float) -> bool:
    return e.op == "const" and not isinstance(e.value, bool) and e.value == v


def _add(a, b):
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    return Expr("add", (a, b), type="float")


def _sub(a, b):
    if _is(b, 0):
        return a
    if _is(a, 0):
        return _neg(b)
    return Expr("sub", (a, b), type="float")


def _mul(a, b):
    if _is(a, 0) or _is(b, 0):
        return _ZERO
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return Expr("mul", (a, b), type="float")


def _div(a, b):
    if _is(a, 0):
        return _ZERO
    if _is(b, 1):
        return a
    return Expr("div", (a, b), type="float")


def _neg(a):
    if _is(a, 0):
        return _ZERO
    return Expr("neg", (a,), type="float")


def _wh(c, a, b):
    if _is(a, 0) and _is(b, 0):
        return _ZERO
    return Expr("where", (c, a, b), type="float")


def derivative(e: Expr, wrt: Expr) -> Expr:
    """d e / d wrt, where wrt is the var `score` or one load node (a tensor element: every
    load equal to it counts as that element). Numbers that do not depend on wrt give 0;
    conditions are piecewise constant (0 almost everywhere)."""
    if e == wrt:
        return _ONE
    op, a = e.op, e.args
    if op in ("const", "var", "param", "load") or e.type == "bool":
        return _ZERO
    if op == "neg":
        return _neg(derivative(a[0], wrt))
    if op in ("add", "sub"):
        f = _add if op == "add" else _sub
        return f(derivative(a[0], wrt), derivative(a[1], wrt))
    if op == "mul":
        return _add(_mul(derivative(a[0], wrt), a[1]), _mul(a[0], derivative(a[1], wrt)))
    if op == "div":
        du, dv = derivative(a[0], wrt), derivative(a[1], wrt)
        return _sub(_div(du, a[1]), _div(_mul(a[0], dv), _mul(a[1], a[1])))
    if op == "where":
        return _wh(a[0], derivative(a[1], wrt), derivative(a[2], wrt))
    if op == "abs":
        x = a[0]
        sign = Expr("where", (Expr("gt", (x, _ZERO), type="bool"), _ONE,
                              Expr("where", (Expr("lt", (x, _ZERO), type="bool"), _const(-1.0),
                                             _ZERO), type="float")), type="float")
        return _mul(sign, derivative(x, wrt))
    if op in ("min", "max"):
        pick = Expr("le" if op == "min" else "ge", a, type="bool")
        return _wh(pick, derivative(a[0], wrt), derivative(a[1], wrt))
    if op == "exp":
        return _mul(e, derivative(a[0], wrt))
    if op == "log":
        return _div(derivative(a[0], wrt), a[0])
    if op == "tanh":
        return _mul(_sub(_ONE, _mul(e, e)), derivative(a[0], wrt))
    if op == "sqrt":
        return _div(derivative(a[0], wrt), _mul(_const(2.0), e))
    raise ModError(f"no derivative rule for `{op}`")  # unreachable for parsed trees


# ----------------------------------------------------------------------------------------
# Renderers
# ----------------------------------------------------------------------------------------
def to_source(e: Expr) -> str:
    """Back to the spec's syntax (for describe() and messages)."""
    op, a = e.op, e.args
    if op == "const":
        return repr(e.value)
    if op in ("var", "param"):
        return str(e.value)
    if op == "load":
        return f"{e.value}[{', '.join(to_source(i) for i in a)}]"
    if op == "neg":
        return f"-({to_source(a[0])})"
    if op == "not":
        return f"not ({to_source(a[0])})"
    if op in _SYMBOL:
        return f"({to_source(a[0])} {_SYMBOL[op]} {to_source(a[1])})"
    if op in ("and", "or"):
        return "(" + f" {op} ".join(to_source(x) for x in a) + ")"
    return f"{op}({', '.join(to_source(x) for x in a)})"


def to_triton(e: Expr, names: dict, load, lang: str = "tl", tanh_fn: str | None = None,
              float_names: dict | None = None) -> str:
    """A Triton expression. `names` maps vars and params to the kernel's names; `load(node,
    index_texts)` renders a tensor load (the template owns pointers, strides and masks).
    lang "gl" prints Gluon (the same functions under gl., tanh without tl.sigmoid).
    `tanh_fn` names a jit function of one fp32 tensor that computes tanh (the package's
    special-function-unit version); None spells tanh with exp.

    `float_names` maps index vars to fp32 copies the kernel has made once per row / column
    vector (q_idx -> q_idx_f). With it, an int subtree of index sums and differences that
    feeds float arithmetic (ALiBi's slope * abs(q_idx - kv_idx)) is computed in fp32 from
    those vectors: one float add per score instead of an int add and an int-to-float
    conversion, which runs at the special-function unit's quarter rate beside the
    softmax's exp2. Exact while the indices stay below 2^24."""
    def rf(x: Expr) -> str:
        """An int-typed subtree as an fp32 expression."""
        op, a = x.op, x.args
        if op == "var" and x.value in float_names:
            return float_names[x.value]
        if op == "const" and not isinstance(x.value, bool):
            return repr(float(x.value))
        if op in ("add", "sub"):
            return f"({rf(a[0])} {_SYMBOL[op]} {rf(a[1])})"
        if op == "neg":
            return f"(-{rf(a[0])})"
        if op == "abs":
            return f"{lang}.abs({rf(a[0])})"
        if op in ("min", "max"):
            return f"{lang}.{op}imum({rf(a[0])}, {rf(a[1])})"
        return f"({r(x)}).to({lang}.float32)"

    def operand(x: Expr, parent: Expr) -> str:
        """x as an argument of `parent`: through rf where an int meets float arithmetic."""
        if float_names and parent.type == "float" and x.type == "int":
            return rf(x)
        return r(x)

    def r(x: Expr) -> str:
        op, a = x.op, x.args
        if op == "const":
            if isinstance(x.value, bool):
                return "True" if x.value else "False"
            return repr(float(x.value)) if isinstance(x.value, float) else str(x.value)
        if op in ("var", "param"):
            return names[x.value]
        if op == "load":
            return load(x, [r(i) for i in a])
        if op == "neg":
            return f"(-{r(a[0])})"
        if op == "not":
            return f"(~{r(a[0])})"
        if op in _SYMBOL:
            return f"({operand(a[0], x)} {_SYMBOL[op]} {operand(a[1], x)})"
        if op in ("and", "or"):
            return "(" + (" & " if op == "and" else " | ").join(r(v) for v in a) + ")"
        if op == "where":
            return f"{lang}.where({r(a[0])}, {operand(a[1], x)}, {operand(a[2], x)})"
        if op == "abs":
            return f"{lang}.abs({operand(a[0], x)})"
        if op in ("min", "max"):
            return f"{lang}.{op}imum({operand(a[0], x)}, {operand(a[1], x)})"
        if op in ("exp", "log", "sqrt"):
            return f"{lang}.{op}(({r(a[0])}).to({lang}.float32))"
        if op == "tanh" and tanh_fn:
            return f"{tanh_fn}(({r(a[0])}).to({lang}.float32))"
        if op == "tanh" and lang == "gl":  # Gluon has no sigmoid: 2 / (1 + e^-2x) - 1
            return f"(2.0 / (1.0 + gl.exp(-2.0 * ({r(a[0])}).to(gl.float32))) - 1.0)"
        if op == "tanh":  # Triton's language has no tanh: 2 sigmoid(2x) - 1
            return f"(2.0 * tl.sigmoid(2.0 * ({r(a[0])}).to(tl.float32)) - 1.0)"
        raise ModError(f"cannot render `{op}`")
    return r(e)


def to_torch(e: Expr, env: dict):
    """Evaluate on torch tensors / numbers. env maps vars and params to values and tensor
    names to tensors; loads index with clamping like the kernels (bare-variable indices
    are in range by validation)."""
    import torch

    def r(x: Expr):
        op, a = x.op, x.args
        if op == "const":
            return x.value
        if op in ("var", "param"):
            return env[x.value]
        if op == "load":
            t = env[x.value]
            idx = []
            for dim, i in zip(t.shape, a):
                v = torch.as_tensor(r(i))
                if dim == 1:
                    v = torch.zeros_like(v)
                idx.append(v.clamp(0, dim - 1).long())
            idx = torch.broadcast_tensors(*idx)
            return t[tuple(idx)]
        if op == "neg":
            return -r(a[0])
        if op == "not":
            return ~torch.as_tensor(r(a[0]))
        if op == "add":
            return r(a[0]) + r(a[1])
        if op == "sub":
            return r(a[0]) - r(a[1])
        if op == "mul":
            return r(a[0]) * r(a[1])
        if op == "div":
            return r(a[0]) / r(a[1])
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            return getattr(torch, op)(torch.as_tensor(r(a[0])), torch.as_tensor(r(a[1])))
        if op in ("and", "or"):
            out = torch.as_tensor(r(a[0]))
            for v in a[1:]:
                out = (out & torch.as_tensor(r(v))) if op == "and" else (out | torch.as_tensor(r(v)))
            return out
        if op == "where":
            return torch.where(torch.as_tensor(r(a[0])), torch.as_tensor(r(a[1])),
                               torch.as_tensor(r(a[2])))
        if op == "abs":
            return torch.as_tensor(r(a[0])).abs()
        if op in ("min", "max"):
            return getattr(torch, "minimum" if op == "min" else "maximum")(
                torch.as_tensor(r(a[0])), torch.as_tensor(r(a[1])))
        v = r(a[0])
        v = v if torch.is_tensor(v) and v.is_floating_point() else torch.as_tensor(v, dtype=torch.float64)
        return getattr(torch, op)(v)
    return r(e)


# ----------------------------------------------------------------------------------------
# The library of built-ins, referenced from a spec as {builtin: NAME, params: {...}}
# ----------------------------------------------------------------------------------------
BUILTINS = {
    "softcap": dict(kind="score", expr="cap * tanh(score / cap)", params={"cap": 50.0},
                    doc="logit soft-capping (Gemma 2, Grok): scores squashed into (-cap, cap)"),
    "alibi": dict(kind="score", expr="score - slope[h] * abs(q_idx - kv_idx)",
                  tensors={"slope": "[H] fp32"},
                  doc="ALiBi (BLOOM, MPT): a per-head linear distance penalty"),
    "relative_bias": dict(kind="score", expr="score + rel_bias[h, kv_idx - q_idx + max_distance]",
                          params={"max_distance": 128}, tensors={"rel_bias": "[H, R] fp32"},
                          doc="learned relative-position bias per head (T5-style, distances "
                              "beyond +-max_distance share the end buckets; R = 2 * "
                              "max_distance + 1)"),
    "prefix_lm": dict(kind="mask", expr="kv_idx < prefix_len[b] or kv_idx <= q_idx",
                      tensors={"prefix_len": "[B] int32"},
                      doc="prefix-LM (T5, PaliGemma): the prefix is seen by every query, "
                          "the rest causally"),
    "document": dict(kind="mask", expr="doc[b, q_idx] == doc[b, kv_idx]",
                     tensors={"doc": "[B, N] int32"},
                     doc="document masking for packed sequences: a query sees only keys of "
                         "its own document (doc = each token's document id)"),
    "key_padding": dict(kind="mask", expr="keep[b, kv_idx]", tensors={"keep": "[B, Nk] bool"},
                        doc="a key-padding mask (True = a real token): a padded batch read "
                            "through one (B, Nk) tensor (what the transformers integration "
                            "passes, docs/TRANSFORMERS.md)"),
    "sliding_window_sinks": dict(kind="mask",
                                 expr="kv_idx <= q_idx and (kv_idx < sinks or q_idx - kv_idx <= window)",
                                 params={"sinks": 4, "window": 1024},
                                 doc="causal sliding window that also keeps the first `sinks` "
                                     "tokens visible (StreamingLLM attention sinks)"),
    "sink_logits": dict(kind="sink", expr="sinks[h]", tensors={"sinks": "[H] fp32"},
                        doc="a learned logit per head added to every row's softmax "
                            "denominator (gpt-oss); the row may attend to nothing"),
    "bias": dict(kind="score", expr="score + bias[b, h, q_idx, kv_idx]",
                 tensors={"bias": "[B, H, Nq, Nk] fp32"},
                 doc="an additive bias broadcastable to (B, H, Nq, Nk): SDPA's float "
                     "attn_mask (a boolean mask becomes 0 / -inf)"),
}


def make_mod(name: str, kind: str, source: str, params: dict, tensors: dict,
             builtin: str | None = None, doc: str = "") -> Mod:
    """Build a Mod from checked parts (raises ModError)."""
    decls = {}
    for t, text in tensors.items():
        if t in params or t in TAKEN:
            raise ModError(f"tensor name `{t}` is taken", t, "a name that is not a param, "
                           "an index variable, a function or score")
        decls[t] = parse_tensor_decl(t, text)
    for p, v in params.items():
        if p in TAKEN:
            raise ModError(f"param name `{p}` is taken", p, "a name that is not an index "
                           "variable, a function or score")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ModError(f"param `{p}`: {v!r} is not a finite number", str(v), "a number")
    expr = parse_expr(source, kind, params, decls)
    used = free_names(expr)
    for t in decls:
        if t not in used:
            raise ModError(f"tensor `{t}` is declared but the expression does not use it", t,
                           "declare only the tensors the expression reads")
    return Mod(name, kind, source.strip(), expr, tuple(params.items()), tuple(decls.values()),
               builtin, doc)


def builtin_mod(name: str, builtin: str, params: dict | None = None) -> Mod:
    if builtin not in BUILTINS:
        raise ModError(f"unknown built-in `{builtin}`", builtin,
                       "one of " + ", ".join(sorted(BUILTINS)))
    spec = BUILTINS[builtin]
    merged = dict(spec.get("params", {}))
    for p, v in (params or {}).items():
        if p not in merged:
            raise ModError(f"built-in `{builtin}` has no param `{p}`", p,
                           "one of " + (", ".join(merged) or "(none)"))
        merged[p] = v
    return make_mod(name, spec["kind"], spec["expr"], merged, spec.get("tensors", {}),
                    builtin, spec["doc"])


def to_python(e: Expr) -> str:
    """A Python expression over torch tensors, for the generated package's host side (the
    sink's gradient): vars are local names, params P[name], loads _load(T[name], ...)."""
    op, a = e.op, e.args
    if op == "const":
        return repr(e.value)
    if op == "var":
        return str(e.value)
    if op == "param":
        return f"P[{e.value!r}]"
    if op == "load":
        return f"_load(T[{e.value!r}], {', '.join(to_python(i) for i in a)})"
    if op == "neg":
        return f"(-{to_python(a[0])})"
    if op == "not":
        return f"(~{to_python(a[0])})"
    if op in _SYMBOL:
        return f"({to_python(a[0])} {_SYMBOL[op]} {to_python(a[1])})"
    if op in ("and", "or"):
        return "(" + (" & " if op == "and" else " | ").join(to_python(x) for x in a) + ")"
    if op == "where":
        return f"torch.where({', '.join(to_python(x) for x in a)})"
    if op in ("min", "max"):
        return f"torch.{op}imum({to_python(a[0])}, {to_python(a[1])})"
    return f"torch.{op}(torch.as_tensor({to_python(a[0])}, dtype=torch.float32))"


_DTYPE_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4, "int64": 8, "bool": 1}


def score_bytes(mods_: list) -> int:
    """Bytes the mods read per score element: the loads whose indices use both q_idx and
    kv_idx (a bias, a relative-position gather) are [BLOCK_M, BLOCK_N] tiles, which the
    planner counts in shared memory (the software pipeline stages them)."""
    total = 0
    for m in mods_:
        decls = {t.name: t for t in m.tensors}
        for load in loads_of(m.expr):
            used = set().union(*(free_names(i) for i in load.args)) if load.args else set()
            if {"q_idx", "kv_idx"} <= used:
                total += _DTYPE_SIZES[decls[load.value].dtype]
    return total
