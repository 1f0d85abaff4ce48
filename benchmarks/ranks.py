"""torch calls whose arrays are not rank 4: the default call against SDPA given rank 4.

    python benchmarks/ranks.py        # writes benchmarks/results/ranks.json

torch's fused CPU kernel takes (B, H, L, D) arrays and a mask of rank 2 or 4; otherwise
SDPA computes by its unfused math. The native route gives it rank 4 whatever the call's
batch axes (``_paths/_native.sdpa``). Per case, interleaved in one process (medians of
the rounds and the median per-round ratio to ``sdpa``), float32, 2 threads:

- ``ours``: the default call, ``scaled_dot_product_attention(q, k, v, ...)``;
- ``ours_as_given``: the same call with the kernel given the arrays at the call's own
  rank (``_native.sdpa`` replaced by SDPA as called before): what the route did before;
- ``sdpa``: ``F.scaled_dot_product_attention`` on rank-4 views with the same mask.

Cases: a chunked prefill of one request as (H, L, D) arrays (Hq = 32, Hkv = 8, D = 128,
512 new rows over 3512 keys, bottom-right causal); a (2, 2, 8, 1024, 64) call (two
batch axes), plain; and ``varlen_attention`` of 4 causal documents of 1024 packed
(Hq = Hkv = 8, D = 64; its call is (H, T, D)), against SDPA per document.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import report
from _timing import interleaved_seconds

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    import torch
    import torch.nn.functional as F

    from portable_attn import scaled_dot_product_attention, varlen_attention
    from portable_attn._paths import _native

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def as_given(q, k, v, mask, is_causal, scale, enable_gqa):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )

    cases = {}
    # one request's chunked prefill, (H, L, D)
    q, k, v = randn(32, 512, 128), randn(8, 3512, 128), randn(8, 3512, 128)
    band = torch.arange(3512)[None, :] <= (3000 + torch.arange(512))[:, None]
    cases["prefill (H, L, D)"] = (
        lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda: F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=band, enable_gqa=True
        )[0],
    )
    # two batch axes
    q5, k5, v5 = (randn(2, 2, 8, 1024, 64) for _ in range(3))
    cases["(2, 2, 8, 1024, 64)"] = (
        lambda: scaled_dot_product_attention(q5, k5, v5),
        lambda: F.scaled_dot_product_attention(
            *(x.reshape(4, 8, 1024, 64) for x in (q5, k5, v5))
        ).reshape(2, 2, 8, 1024, 64),
    )
    # varlen: 4 causal documents of 1024
    qv, kv, vv = (randn(4096, 8, 64) for _ in range(3))
    starts = torch.arange(5) * 1024

    def per_document():
        outs = []
        for a in range(0, 4096, 1024):
            parts = (x[a : a + 1024].transpose(0, 1)[None] for x in (qv, kv, vv))
            outs.append(F.scaled_dot_product_attention(*parts, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    cases["varlen 4 x 1024"] = (
        lambda: varlen_attention(qv, kv, vv, starts, starts, is_causal=True),
        per_document,
    )

    out = {**report.git_state(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    out["cases"] = {}
    kernel = _native.sdpa
    with torch.no_grad():
        for name, (ours, peer) in cases.items():
            torch.testing.assert_close(ours(), peer(), rtol=1e-4, atol=1e-5)

            def ours_as_given(ours=ours):
                _native.sdpa = as_given
                try:
                    return ours()
                finally:
                    _native.sdpa = kernel

            fns = {"ours": ours, "ours_as_given": ours_as_given, "sdpa": peer}
            res = interleaved_seconds(fns, repeats=9)
            out["cases"][name] = {
                "ms": {n: 1e3 * t for n, t in res.medians.items()},
                "ratio_vs_sdpa": {
                    n: statistics.median(res.ratios(n, "sdpa")) for n in fns if n != "sdpa"
                },
                "ours_vs_as_given": statistics.median(res.ratios("ours", "ours_as_given")),
            }
            print(name, json.dumps(out["cases"][name]))
    (RESULTS / "ranks.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
