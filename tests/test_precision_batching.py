"""The shared device/precision choice and token-budget batching."""

import numpy as np
import pytest
import torch

from prlmfuse.batching import token_budget_batches
from prlmfuse.errors import UserError
from prlmfuse.precision import autocast, compute_dtype, cpu_has_fast_bf16, precision_name, resolve_device


def test_batches_keep_order_and_budget():
    sizes = np.array([3, 9, 2, 4, 4, 7, 1])
    order = np.argsort(sizes, kind="stable")
    batches = token_budget_batches(order, sizes, 8)
    assert np.concatenate(batches).tolist() == order.tolist()
    for b in batches:
        assert len(b) == 1 or len(b) * sizes[b].max() <= 8
    # the item over budget (9) sits alone
    assert [b.tolist() for b in batches if 1 in b.tolist()] == [[1]]


def test_batches_refuse_empty_budget():
    with pytest.raises(UserError, match="max_tokens"):
        token_budget_batches(np.arange(3), np.ones(3), 0)


def test_resolve_device_choices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match="device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda:0")


def test_cpu_precision_follows_the_cpu_flags():
    dtype = compute_dtype("cpu")
    assert dtype == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert precision_name(dtype) in ("bf16", "fp32")
    with autocast("cpu", torch.bfloat16):
        assert torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast("cpu", torch.float32):
        assert torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
