"""The spec's `window` is the default window of a package built for sliding_window alone
(a sliding-window model); a package that also builds none/causal keeps PyTorch's and
flash-attn's default of no window."""
from __future__ import annotations

import pytest
import torch

from packages import build_and_import
from flashgen.reference import attention_ref, visible_mask


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("win"), "fg_test_window_only", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [sliding_window]
        window: {left: 5, right: 0}
        """)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("winmix"), "fg_test_window_mixed", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [none, causal, sliding_window]
        window: {left: 5, right: 0}
        """)


def bhnd(n=20):
    return [torch.randn(1, 2, n, 32) for _ in range(3)]


def ref(q, k, v, causal=False, window=(-1, -1), bottom_right=True):  # N_q == N_k: the
    # two causal conventions agree
    vis = visible_mask(q.shape[2], k.shape[2], causal=causal, window=window,
                       bottom_right=bottom_right)
    return attention_ref(q, k, v, vis)[0]


def close(a, b):
    torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_window_only_package_applies_the_spec_window(windowed):
    assert windowed.DEFAULT_WINDOW == (5, 0)
    q, k, v = bhnd()
    expected = ref(q, k, v, window=(5, 0))
    close(windowed.scaled_dot_product_attention(q, k, v), expected)
    close(windowed.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
    t = [x.transpose(1, 2) for x in (q, k, v)]
    close(windowed.flash_attn_func(*t).transpose(1, 2), expected)
    attn = windowed.Attention(64, 2, causal=False)
    assert attn.window is None  # None = the package default, the spec's window
    # another window per call still works
    close(windowed.flash_attn_func(*t, window_size=(2, 1)).transpose(1, 2),
          ref(q, k, v, window=(2, 1), bottom_right=True))
    # an explicit "no window" needs a mask this package was not built for
    with pytest.raises(ValueError, match="mask"):
        windowed.flash_attn_func(*t, window_size=(-1, -1))


def test_mixed_package_keeps_no_window_by_default(mixed):
    assert mixed.DEFAULT_WINDOW is None
    q, k, v = bhnd()
    close(mixed.scaled_dot_product_attention(q, k, v, is_causal=True),
          ref(q, k, v, causal=True))
    t = [x.transpose(1, 2) for x in (q, k, v)]
    close(mixed.flash_attn_func(*t).transpose(1, 2), ref(q, k, v))
    close(mixed.flash_attn_func(*t, window_size=(5, 0)).transpose(1, 2),
          ref(q, k, v, window=(5, 0), bottom_right=True))
