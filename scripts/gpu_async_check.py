"""Tokens of one tiny40 generation under every (graph mode, async_scheduling) pair on CUDA.

    python3 scripts/gpu_async_check.py

Prints one line per pair and whether all agree (the GPU check of overlapped stepping beside
``tests/gpu/test_graphs_gpu.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 40))]
    got = {}
    for mode in ("NONE", "FULL"):
        for overlap in (False, True):
            llm = LLM("tiny40", enforce_eager=mode == "NONE", cudagraph_mode=mode, device="cuda",
                      dtype="float32", max_num_seqs=4, max_model_len=256,
                      async_scheduling=overlap)  # fmt: skip
            got[mode, overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            print(mode, overlap, got[mode, overlap], llm.overlapped_steps,
                  dict(llm.runner.stats), flush=True)  # fmt: skip
    same = len({repr(v) for v in got.values()}) == 1
    print("all equal:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
