"""The mistakes people make get a message that names the fix (docs: Common mistakes)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from _helpers import assert_close, qkv
from portable_attn import causal_mask, scaled_dot_product_attention
from portable_attn.block_mask import create_block_mask
from portable_attn.testing import reference_attention


class TestALayoutOfLengthsBeforeHeads:
    """(B, L, H, D) arrays whose head and length axes do not fit say to transpose them."""

    def test_a_head_count_error_names_the_layout(self, backend):
        q = backend.asarray(np.zeros((2, 8, 4, 16)))  # (B, L=8, H=4, D) read as H=8, L=4
        k = backend.asarray(np.zeros((2, 6, 4, 16)))  # (B, L=6, H=4, D) read as H=6
        with pytest.raises(ValueError, match=r"\(B, L, H, D\).*transpose\(1, 2\)"):
            scaled_dot_product_attention(q, k, k)

    def test_a_key_value_mismatch_names_the_layout(self, backend):
        q = backend.asarray(np.zeros((2, 4, 8, 16)))
        k = backend.asarray(np.zeros((2, 4, 6, 16)))
        v = backend.asarray(np.zeros((2, 4, 7, 16)))
        with pytest.raises(ValueError, match=r"axis -2.*\(B, L, H, D\)"):
            scaled_dot_product_attention(q, k, v)


class TestAPaddingMaskOfBatchAndKeys:
    """A Hugging Face-style (B, L) padding mask says how to give it its axes."""

    def test_the_hint(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv(lq=7, lk=7))
        mask = backend.asarray(np.ones((2, 7), dtype=bool))
        with pytest.raises(ValueError, match=r"mask\[:, None, None, :\].*kv_lengths="):
            scaled_dot_product_attention(q, k, v, mask=mask)


class TestPythonLogicInARule:
    """``and`` / ``or`` / ``if`` on index arrays say to use ``&``, ``|``, ``~``, ``xp.where``."""

    @pytest.mark.skip_backends("dask", reason="a lazy rule: evaluated inside the tasks")
    def test_a_mask_mod_with_and(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv(lq=7, lk=7))
        with pytest.raises(TypeError, match=r"Python `and`.*`&`, `\|`, `~`"):
            scaled_dot_product_attention(
                q, k, v, mask_mod=lambda b, h, i, j: i >= j and j >= 0, block_size=4
            )

    @pytest.mark.skip_backends("dask", reason="a lazy rule: evaluated inside the tasks")
    def test_a_score_mod_with_if(self, backend):
        q, k, v = (backend.asarray(a) for a in qkv(lq=7, lk=7))

        def mod(s, b, h, i, j):
            return s if i > j else -s

        with pytest.raises(TypeError, match=r"`score_mod` used Python `and`, `or`, `not` or `if`"):
            scaled_dot_product_attention(q, k, v, score_mod=mod)

    def test_create_block_mask(self):
        with pytest.raises(TypeError, match=r"`mask_mod` used Python"):
            create_block_mask(lambda b, h, i, j: i >= j or j == 0, None, None, 8, 8)


@pytest.mark.backends("torch", reason="a rule closing over torch tensors")
class TestARuleOfAnotherLibrary:
    """A rule that closes over another library's arrays names the namespace to build with."""

    def test_create_block_mask_without_xp(self, backend):
        import torch

        docs = torch.arange(16) // 4

        def same_doc(b, h, i, j):
            return docs[torch.as_tensor(i)] == docs[torch.as_tensor(j)]

        with pytest.raises(TypeError, match=r"xp=torch"):
            create_block_mask(same_doc, None, None, 16, 16, block_size=4)
        bm = create_block_mask(same_doc, None, None, 16, 16, block_size=4, xp=torch)
        assert bm.visible_fraction() == 0.25


class TestXpIsANamespace:
    @pytest.mark.parametrize("module", ["numpy", "array_api_compat.numpy"])
    def test_the_module_or_its_compat_namespace(self, module):
        mask = causal_mask(3, 4, xp=importlib.import_module(module))
        assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]

    def test_a_string_is_refused_by_name(self):
        with pytest.raises(
            TypeError, match=r"pass the module itself \(xp=torch, not xp='torch'\)"
        ):
            causal_mask(3, 4, xp="torch")


@pytest.mark.backends("torch", reason="torch.export")
class TestTorchExportWithADynamicLength:
    """``torch.export`` with a dynamic sequence length was refused as ``torch.jit.trace``.

    ``_lib/_validation.py`` read its symbolic sizes (``torch.SymInt``) as the traced
    tensors of ``torch.jit.trace``; the docs recommend ``torch.export``. The exported
    program must give the eager call's values at lengths other than the traced one.
    """

    @staticmethod
    def export(backend, length, **kw):
        import torch

        class Attention(torch.nn.Module):
            def forward(self, q, k, v):
                return scaled_dot_product_attention(q, k, v, **kw)

        q, k, v = qkv(lq=32, lk=32, backend=backend)
        dims = ({2: length},) * 3  # the sequence axis of (B, H, L, D)
        return torch.export.export(Attention(), (q, k, v), dynamic_shapes=dims).module()

    @pytest.mark.parametrize("kw", [{}, {"is_causal": True}], ids=["plain", "causal"])
    def test_a_dim_on_the_sequence_axis(self, backend, kw):
        import torch

        program = self.export(backend, torch.export.Dim("L", min=16, max=512), **kw)
        for n in (16, 45):  # neither is the traced length, 32
            q, k, v = qkv(lq=n, lk=n, seed=n)
            arrays = [backend.asarray(a) for a in (q, k, v)]
            out = program(*arrays)
            assert_close(backend, out, scaled_dot_product_attention(*arrays, **kw))
            assert_close(backend, out, reference_attention(q, k, v, **kw))

    def test_a_dynamic_hint(self, backend):
        import torch

        program = self.export(backend, torch.export.Dim.DYNAMIC, is_causal=True)
        q, k, v = qkv(lq=40, lk=40, seed=3)
        out = program(*(backend.asarray(a) for a in (q, k, v)))
        assert_close(backend, out, reference_attention(q, k, v, is_causal=True))

    def test_the_whole_default_range(self, backend):
        import torch

        program = self.export(backend, torch.export.Dim("L"))
        q, k, v = qkv(lq=4, lk=4)
        out = program(*(backend.asarray(a) for a in (q, k, v)))
        assert_close(backend, out, reference_attention(q, k, v))
