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


# ---------------------------------------------------------------- the device option, every path

from prlmfuse.precision import (  # noqa: E402
    Runtime,
    check_device_text,
    grad_scaler,
    resolve_precision,
    resolve_runtime,
)


@pytest.mark.parametrize("text, canonical", [("auto", "auto"), ("CPU", "cpu"), (" cuda ", "cuda"), ("cuda:3", "cuda:3")])
def test_device_text_is_checked_for_spelling_only(text, canonical):
    assert check_device_text(text) == canonical


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "mps", "", 0, None])
def test_bad_device_text_is_one_user_error(bad):
    with pytest.raises(UserError, match="unknown; use auto, cpu, cuda or cuda:N"):
        check_device_text(bad)


def test_auto_resolves_to_what_torch_sees():
    runtime = resolve_runtime("auto", "auto")
    assert runtime.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert runtime.dtype == compute_dtype(runtime.device)
    assert runtime.describe() == f"device {runtime.device}, precision {precision_name(runtime.dtype)}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_is_refused_in_one_line_without_a_gpu(setting):
    with pytest.raises(UserError, match="torch sees no CUDA GPU here; use --device cpu") as info:
        resolve_runtime(setting)
    assert "\n" not in str(info.value)


@pytest.mark.cuda
def test_cuda_index_out_of_range_is_refused():
    with pytest.raises(UserError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.cuda
def test_cuda_resolves_to_the_local_rank_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_runtime("cuda").device == torch.device("cuda", 0)
    assert resolve_runtime("cuda", "auto").dtype in (torch.bfloat16, torch.float16)


def test_precision_choice():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == compute_dtype(cpu)
    assert resolve_precision(None, cpu) == compute_dtype(cpu)
    assert resolve_precision("fp32", cpu) == torch.float32
    assert resolve_precision("bf16", cpu) == torch.bfloat16
    with pytest.raises(UserError, match="fp16.*CUDA"):
        resolve_precision("fp16", cpu)
    with pytest.raises(UserError, match="precision 'half' unknown"):
        resolve_precision("half", cpu)


def test_gradient_scaler_only_for_fp16():
    assert not grad_scaler(Runtime(torch.device("cpu"), torch.bfloat16)).is_enabled()
    assert not grad_scaler(Runtime(torch.device("cpu"), torch.float32)).is_enabled()


@pytest.mark.cuda
def test_gradient_scaler_on_for_fp16_on_cuda():
    assert grad_scaler(Runtime(torch.device("cuda", 0), torch.float16)).is_enabled()
