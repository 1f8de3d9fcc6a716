"""usage: off.py SPEC OUTJSON name@cfgjson|own[@varlen] ..."""
import json, sys, tempfile, importlib, time, hashlib, re
from pathlib import Path
import triton
from flashgen.build import build
from flashgen import gluon_compile, families
from flashgen.offline import mod_arg_types
_orig = triton.compile
LAST = {}
def _compile(*a, **k):
    c = _orig(*a, **k)
    ptx = c.asm["ptx"]
    # drop the header/comments that may carry paths
    body = "\n".join(l for l in ptx.splitlines() if not l.lstrip().startswith("//"))
    LAST["ptx"] = hashlib.sha1(body.encode()).hexdigest()[:12]
    import subprocess, tempfile as tf
    from triton import knobs
    with tf.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"]); f.flush()
        listing = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True).stdout
    LAST["ptx"] = hashlib.sha1(listing.encode()).hexdigest()[:12]
    return c
triton.compile = _compile
spec, out = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp()
build(spec, Path(tmp))
pkg = next(p for p in Path(tmp).iterdir() if (p / "_registry.py").exists())
sys.path.insert(0, str(pkg.parent))
reg = importlib.import_module(f"{pkg.name}._registry")
rows = []
for item in sys.argv[3:]:
    name, cfg, *rest = item.split("@")
    facts = reg.VARIANTS[name]
    config = families.variant_gluon_default(facts) if cfg == "own" else {**families.GLUON_DEFAULT, **json.loads(cfg)}
    mod = importlib.import_module(f"{pkg.name}.kernels.gluon.{name}")
    t = time.time()
    r = gluon_compile.compile_variant(mod, name, facts["head_dim"], facts["dtype"], config,
                                      mod_arg_types(reg, name)[0], varlen=bool(rest))
    print(r.row(), LAST["ptx"], f"({time.time()-t:.0f}s)", flush=True)
    rows.append({**r.__dict__, "ptx": LAST["ptx"], "key": item})
Path(out).write_text(json.dumps(rows, indent=1))
