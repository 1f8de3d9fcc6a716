"""flashgen: a compiler-style generator of tuned FlashAttention kernels.

The pipeline, one module a stage (docs/ARCHITECTURE.md):
spec -> plan -> render -> (compile/verify: check) -> (tune) -> emit -> the generated
package's dispatch.
"""
__version__ = "0.1.0"
