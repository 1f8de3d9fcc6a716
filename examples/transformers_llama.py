"""A Hugging Face transformers model on the generated package's kernels: a tiny Llama
(random weights from a config, nothing downloaded) runs a batch and a short greedy
generation with its own "sdpa" attention and with llama_attn registered as
`attn_implementation="fgen"` (docs/TRANSFORMERS.md); the logits must match.

    python examples/transformers_llama.py

Needs transformers (`pip install transformers`, or the dev extra on Python 3.11+) and
`flashgen build specs/llama.yaml` (generated/llama_attn: head dim 128, bf16/fp16, GQA).
Runs on a GPU when there is one (bf16), otherwise in Triton's CPU interpreter (fp16,
about 10 seconds).
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    import transformers
except ImportError:
    sys.exit("this example needs transformers: pip install transformers")

from generated import llama_attn  # noqa: E402

# Llama's shape at toy size: 2 query heads of 128 sharing one key/value head
TINY = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            intermediate_size=512, num_hidden_layers=2, vocab_size=256)


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    impl = llama_attn.register_transformers()  # "fgen": attn_implementation="fgen" works now
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model = model.to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 24),
                        generator=torch.Generator().manual_seed(1)).to(device)

    runs = {}
    for name in ("sdpa", impl):
        model.set_attn_implementation(name)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits.float()
            gen = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        runs[name] = logits, gen
    (ref, ref_gen), (got, got_gen) = runs["sdpa"], runs[impl]
    err = (got - ref).abs().max().item()
    step_err = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(got_gen.scores, ref_gen.scores))
    print(f"tiny Llama on {device} ({dtype}), batch 2 x 24 tokens, {TINY['num_hidden_layers']} "
          f"layers: max |logits {impl} - sdpa| = {err:.2e} (largest logit "
          f"{ref.abs().max().item():.2f})")
    print(f"4 greedy decoding steps with a KV cache: max |scores {impl} - sdpa| = "
          f"{step_err:.2e}; tokens {got_gen.sequences[:, -4:].tolist()} "
          f"(sdpa: {ref_gen.sequences[:, -4:].tolist()})")
    tol = 2e-2  # 16-bit logits of order 1
    return 0 if err < tol and step_err < tol else 1


if __name__ == "__main__":
    sys.exit(main())
