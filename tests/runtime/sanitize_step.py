"""A few streamed LoRA training steps of tiny-flux on CUDA, for ``compute-sanitizer`` (not a pytest module).

    compute-sanitizer --tool racecheck python -m tests.runtime.sanitize_step
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from squareq import runtime
from squareq.models import load_builtin
from squareq.quant import QuantSpec
from squareq.compiler.plain import PlainOptions, write_rtn_slab

from .harness import inputs, step, with_lora


def main() -> int:
    torch.backends.cuda.enable_cudnn_sdp(False)
    model, adapter = load_builtin("tiny-flux")
    plan = {"transformer_blocks.0.attn.to_q": QuantSpec(bits=8), "transformer_blocks.1.attn.to_k": QuantSpec(bits=6)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tiny.slab"
        write_rtn_slab(model, adapter.blocks(model), plan, out, PlainOptions(default_spec=QuantSpec(bits=4), family="flux"))
        for host in ("pinned", "disk"):
            streamed = runtime.load(out, "cuda", options=runtime.LoadOptions(prefetch=2, host=host))
            with_lora(streamed)
            for _ in range(3):
                step(streamed, inputs("cuda"), checkpointing=True, autocast=True)
            runtime.runtime_of(streamed).close()
        torch.cuda.synchronize()
    print("sanitize_step: 6 streamed training steps done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
