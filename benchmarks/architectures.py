"""Current model families: our registered attention against each model's eager attention.

    python benchmarks/architectures.py     # writes benchmarks/results/architectures.json

Needs ``.[transformers]`` (``nox -s tests-integrations`` installs it). For every family of
``tests/integrations/test_architectures.py`` (Llama 4, Gemma 3, gpt-oss, Qwen3, Qwen2-VL,
DeepSeek V3, ModernBERT; tiny configs, seeded random weights, float32), the models and
the decoding loop of that test: the largest relative difference of the logits,
``max |ours - eager| / max |eager|``, over the 16-token prompt (real tokens only) and over
the 8 greedy decoding steps with the model's own cache, for a left-padded and an
unpadded batch of 2, and whether the greedy tokens are the same. The issue's target is
1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import git_state  # noqa: E402


def _cases() -> Any:
    path = HERE.parent / "tests" / "integrations" / "test_architectures.py"
    spec = importlib.util.spec_from_file_location("architectures_cases", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    import torch
    import transformers

    cases = _cases()
    rows: dict[str, Any] = {}
    for name, family in cases.FAMILIES.items():
        eager, ours = cases.models(family)
        row: dict[str, Any] = {}
        for padded in (True, False):
            ids, mask = cases.prompt(padded)
            real = mask.bool()
            with torch.no_grad():
                if not family.decodes:
                    want = eager(input_ids=ids, attention_mask=mask).logits
                    got = ours(input_ids=ids, attention_mask=mask).logits
                    row["padded" if padded else "unpadded"] = {
                        "logits": cases.relative(got[real], want[real])
                    }
                    continue
                want_prompt, want_tokens, want_steps = cases.greedy(
                    eager, ids, mask, family.positions
                )
                got_prompt, got_tokens, got_steps = cases.greedy(ours, ids, mask, family.positions)
            row["padded" if padded else "unpadded"] = {
                "prompt": cases.relative(got_prompt[real], want_prompt[real]),
                "decode": cases.relative(got_steps, want_steps),
                "same_tokens": bool(torch.equal(got_tokens, want_tokens)),
            }
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    worst = max(
        v
        for row in rows.values()
        for part in row.values()
        for k, v in part.items()
        if k != "same_tokens"
    )
    out = {
        "git": git_state(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target_relative": cases.RTOL,
        "worst_relative": worst,
        "families": rows,
    }
    path = HERE / "results" / "architectures.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("worst", worst, "wrote", path)


if __name__ == "__main__":
    main()
