"""Two patches to the unpacked SGLang site (idempotent; `prepare.sh` and `device.sh setup`).

Both are needed only because the payload leaves files out (README.md beside this says which):
sgl_kernel must not hand its norm/sampling kernels to flashinfer's JIT (its sources are not
carried), and EAGLE v2 must not import the DeepSeek sparse-attention backend (it needs cutlass).
"""

import pathlib
import re
import sys

site = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site")
done = []

# 1. sgl_kernel 0.4.4 hands rmsnorm/gemma_rmsnorm and top-k/top-p renorm to flashinfer when it
#    imports; flashinfer then JIT-builds flashinfer/data/csrc/*.cu, which is not carried.
for name in ("elementwise.py", "sampling.py"):
    p = site / "sgl_kernel" / name
    s = p.read_text()
    t = re.sub(
        r"^    _has_flashinfer = True$",
        "    _has_flashinfer = False  # patched: no flashinfer JIT sources",
        s,
        flags=re.M,
    )
    if t != s:
        p.write_text(t)
        done.append(str(p))

# 2. EAGLE v2's draft-extend CUDA graph capture imports the DeepSeek sparse-attention backend only
#    for an isinstance check; that module imports nvidia-cutlass-dsl (`cutlass`), not carried.
p = site / "sglang/srt/speculative/eagle_worker_v2.py"
s = p.read_text()
old = """            from sglang.srt.layers.attention.dsa_backend import (
                DeepseekSparseAttnBackend,
            )

            graph_supported_backend_types.append(DeepseekSparseAttnBackend)
"""
new = """            try:  # patched: the DSA backend needs nvidia-cutlass-dsl, not carried
                from sglang.srt.layers.attention.dsa_backend import (
                    DeepseekSparseAttnBackend,
                )

                graph_supported_backend_types.append(DeepseekSparseAttnBackend)
            except ImportError:
                pass
"""
if old in s:
    p.write_text(s.replace(old, new))
    done.append(str(p))
elif "patched: the DSA backend" not in s:
    print("WARNING: eagle_worker_v2.py did not match; not patched")
print("patched:", done or "nothing new")
