"""Every stage on a CUDA GPU: what only runs where torch sees one, and the CPU variants that check the tests.

The tests marked `cuda` skip here (tests/conftest.py skips them where torch.cuda.is_available() is
False). On a GPU machine run them all at once with

    pytest -m cuda            # or: pytest -m cuda tests/test_cuda.py

They cover, on the tiny preset with a few hundred toy sentences and at most 20 updates each:
- stage one: a cache built on cuda at fp32 equals the CPU's within a stated tolerance;
- stage two: an fp32 update on cuda against the CPU's, bf16 training, fp16 training with its gradient
  scaler, `compile: true` against eager;
- stage three: beam search on cuda against the CPU at fp32, `translate` with its PrLM live on cuda;
- the whole pipeline, `prlmfuse run pipeline.yaml --device cuda`, on an English-target corpus (BLEU's
  13a tokenizer, no mecab) with whichever cache backend is importable (zarr, else hdf5).

Each device-parametrized test also has a `cpu` variant that runs here, so that a mistake in the test
itself shows without a GPU; those of the slowest (compile, the pipeline) are marked `slow`. The
helpers defined below have CPU tests of their own.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from prlmfuse.cache_features import CacheReader, build_cache
from prlmfuse.precision import compute_dtype, precision_name, resolve_runtime
from prlmfuse.train_fused import PrLMUse, train_run

from helpers import small_runs

torch.set_num_threads(1)

CUDA = pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")
CPU = pytest.param("cpu", id="cpu")
CPU_SLOW = pytest.param("cpu", marks=pytest.mark.slow, id="cpu")

# ----------------------------------------------------------------------------------- helpers

WORDS = ("light dark water earth sky seed grass star day night god land sea fish bird tree evening morning "
         "heaven stars waters beginning").split()


def cache_backend() -> str:
    """The cache backend this machine can write: zarr where it is importable, else hdf5 (a bare GPU node
    may lack zarr until a bundle is installed; h5py is a core dependency)."""
    return "zarr" if importlib.util.find_spec("zarr") is not None else "hdf5"


def toy_corpus_files(raw: Path, *, train: int = 200, dev: int = 16, test: int = 12, seed: int = 0) -> dict[str, Path]:
    """A toy English->English "translation" (the words reversed and capitalised), one file per split
    and side, named as register_text and a pipeline file's `data: files:` take them."""
    rng = random.Random(seed)
    raw.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n in (("train", train), ("dev", dev), ("test", test)):
        src, tgt = [], []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
            src.append(" ".join(words))
            tgt.append(" ".join(w.capitalize() for w in reversed(words)))
        for side, lines in (("src", src), ("tgt", tgt)):
            path = raw / f"{split}.{side}"
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            files[f"{split}_{side}"] = path
    return files


def train_and_dev_losses(run_dir: Path) -> tuple[list[float], list[float]]:
    """metrics.jsonl's training losses (one per log_every window) and dev losses, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], [r["dev_loss"] for r in records if "dev_loss" in r]


def noise_sensitive_lines(decode, model: torch.nn.Module, reference: list[str], *, scale: float = 1e-5,
                          trials: int = 3, seed: int = 0) -> set[int]:
    """Indices of the lines whose hypothesis `decode(model')` differs from `reference` for some model'
    whose every weight is `model`'s times (1 + scale * N(0, 1)).

    Beam search takes discrete decisions (top-k, </s> against the live beams): where two candidates'
    scores nearly tie, float noise of any kind, a GPU's summation order included, decides between
    them. A relative weight noise of 1e-5 moves the scores about ten times more than fp32 rounding
    (~1e-6 relative) does, so the lines it leaves unchanged are the ones a device must decode alike.
    """
    generator = torch.Generator().manual_seed(seed)
    sensitive: set[int] = set()
    for _ in range(trials):
        noisy = copy.deepcopy(model)
        with torch.no_grad():
            for p in noisy.parameters():
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device, p.dtype)
                p.mul_(1 + scale * noise)
        hyps = decode(noisy)
        assert len(hyps) == len(reference)
        sensitive |= {i for i, (a, b) in enumerate(zip(reference, hyps)) if a != b}
    return sensitive


@pytest.fixture
def strict_fp32():
    """fp32 matmuls in full fp32 for this test: TF32 off (prlmfuse never turns it on; this guards against
    a caller or another test having done so). Convolutions' cuDNN TF32 flag is left alone: none here."""
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        pytest.skip("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 forces TF32 matmuls; an fp32 comparison needs it unset")
    before = torch.get_float32_matmul_precision()
    if before == "highest":  # torch's default: nothing to change (and no TF32 API touched)
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass
class World:
    root: Path
    corpus: object
    checkpoint: Path
    backend: str
    use: PrLMUse
    caches: dict[str, str]  # split -> cache built on the CPU at fp32 (float16 storage)
    fused: Path  # a fused run trained on the CPU at fp32


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """The toy corpus, a tiny random BERT, its CPU-built fp32 caches and a 12-update fused run (all CPU)."""
    from prlmfuse.corpora import register_text

    root = tmp_path_factory.mktemp("cuda")
    corpus = register_text(root / "corpus", **toy_corpus_files(root / "raw"), src_lang="en", tgt_lang="en", name="toy")
    checkpoint = small_runs.tiny_prlm(root / "bert")
    backend = cache_backend()
    caches = {}
    for split in ("train", "dev", "test"):
        # precision fp32 stated: `auto` on the CPU is bf16 where it has AMX (as a GPU node's host may)
        caches[split] = str(build_cache(str(checkpoint), corpus.src_path(split), root / "cache" / split, layers="-2",
                                        backend=backend, precision="fp32", device="cpu", progress=False).path)
    use = PrLMUse(checkpoint=str(checkpoint), layer=-2)
    fused = train_run(small_runs.tiny_run("fused", prlms=[use], max_updates=12), corpus, [dict(caches)],
                      root / "runs" / "fused", progress=False, runtime=resolve_runtime("cpu", "fp32"))
    return World(root, corpus, checkpoint, backend, use, caches, Path(fused))


# ------------------------------------------------------------------ the helpers, on the CPU


def test_helpers_choose_an_importable_backend_and_write_a_toy_english_corpus(tmp_path):
    backend = cache_backend()
    assert backend in ("zarr", "hdf5")
    assert importlib.util.find_spec("zarr" if backend == "zarr" else "h5py") is not None
    files = toy_corpus_files(tmp_path, train=5, dev=2, test=3)
    lines = {name: path.read_text(encoding="utf-8").splitlines() for name, path in files.items()}
    assert [len(lines[f"{s}_src"]) for s in ("train", "dev", "test")] == [5, 2, 3]
    for split in ("train", "dev", "test"):
        for src, tgt in zip(lines[f"{split}_src"], lines[f"{split}_tgt"]):
            assert tgt.split() == [w.capitalize() for w in reversed(src.split())] and 3 <= len(src.split()) <= 8
    assert toy_corpus_files(tmp_path / "again", train=5, dev=2, test=3)["train_src"].read_text() == \
        files["train_src"].read_text()  # seeded: the same corpus every time


def test_helper_reads_metrics_and_finds_noise_sensitive_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"update": 2, "loss": 5.0}\n{"update": 2, "dev_loss": 4.5}\n{"update": 4, "loss": 4.0}\n', encoding="utf-8")
    assert train_and_dev_losses(tmp_path) == ([5.0, 4.0], [4.5])

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    inputs = torch.randn(40, 8)
    decode = lambda m: [str(int(i)) for i in m(inputs).argmax(dim=-1)]  # noqa: E731 - a "decoder" per row
    reference = decode(model)
    assert noise_sensitive_lines(decode, model, reference, scale=0.0) == set()
    # Large noise changes some argmax; the model handed in is left as it was.
    before = [p.clone() for p in model.parameters()]
    assert noise_sensitive_lines(decode, model, reference, scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Rows whose two best logits tie are found at scale 1e-5; rows with a margin of 1 are not.
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 1.0, -3.0, -3.0, -3.0]))
    tie = decode(model)
    assert noise_sensitive_lines(decode, model, tie, scale=1e-5, trials=8) == set(range(len(inputs)))
    with torch.no_grad():
        model.bias.copy_(torch.tensor([1.0, 0.0, -3.0, -3.0, -3.0]))
    wide = decode(model)
    assert noise_sensitive_lines(decode, model, wide, scale=1e-5, trials=8) == set()


# ------------------------------------------------------------------------------ stage one


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_cache_built_on_the_device_equals_the_cpu_cache_at_fp32(world, tmp_path, device, strict_fp32):
    # Both stored as float32 (no float16 rounding to straddle) with the same token budget and shard
    # size, so both builds form the same batches and shards. Tolerance rtol = atol = 1e-4: a tiny BERT's
    # hidden states are O(1) (a few units at most), and fp32 on the GPU (cuBLAS, SDPA's kernels; TF32
    # off) differs from the CPU's only in summation order, ~1e-6 relative over 3 layers: 100x margin,
    # while anything wrong (bf16 or fp16 compute ~1e-2, a wrong layer, mask or pooling ~1) is far above it.
    built = {}
    for name, on in (("cpu", "cpu"), ("device", device)):
        built[name] = build_cache(
            str(world.checkpoint), world.corpus.src_path("train"), tmp_path / name, layers="-2,-1",
            backend=world.backend, dtype="float32", precision="fp32", device=on, max_tokens=512,
            shard_bytes=64 * 1024, progress=False,
        ).path
    cpu, dev = CacheReader(built["cpu"]), CacheReader(built["device"])
    try:
        assert dev.key == cpu.key  # the device is no part of the key: a cache moves between devices
        assert dev.manifest["key_fields"]["precision"] == "fp32" and dev.backend == world.backend
        # several shards and batches: the GPU's overlapped host copies are flushed at each shard's end
        assert len(dev.manifest["shards"]) > 1
        counts = lambda r: [(s["name"], s["num_sentences"], s["num_tokens"]) for s in r.manifest["shards"]]  # noqa: E731
        assert counts(dev) == counts(cpu)
        assert dev.layers == cpu.layers == [2, 3] and np.array_equal(dev.lengths, cpu.lengths)
        assert len(dev) == len(cpu) == 200
        for i in range(len(cpu)):
            a, b = cpu.features(i), dev.features(i)
            assert a.abs().max() > 0.1  # real features, not zeros
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"sentence {i}: {m}")
            torch.testing.assert_close(dev.pooled(i), cpu.pooled(i), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"pooled of sentence {i}: {m}")
    finally:
        cpu.close()
        dev.close()


# ------------------------------------------------------------------------------ stage two


def _fused_trainer(world: World, run, run_dir: Path, runtime):
    """The Trainer that train_run builds for `run` over the world's caches, and its training pairs."""
    from prlmfuse.distributed import DistContext
    from prlmfuse.train_fused.bpe import BPE
    from prlmfuse.train_fused.data import PairDataset
    from prlmfuse.train_fused.modeling import FusedTransformer
    from prlmfuse.train_fused.run_setup import _encode_split, open_run_branches, train_run_bpe
    from prlmfuse.train_fused.trainer import Trainer

    run_dir.mkdir(parents=True)
    branches = open_run_branches(run, world.corpus, [dict(world.caches)])
    train_run_bpe(run, world.corpus, run_dir / "bpe.json")
    bpe = BPE.load(run_dir / "bpe.json")
    torch.manual_seed(run.seed)
    model = FusedTransformer(run.model_config(bpe.vocab_size, [b.spec for b in branches["train"]]))
    src, tgt = _encode_split(bpe, world.corpus, "train", None)
    pairs = PairDataset(src, tgt, branches["train"])
    return Trainer(run, run_dir, model.to(runtime.device), pairs, pairs, DistContext(), progress=False,
                   runtime=runtime), pairs


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_a_training_update_on_the_device_matches_the_cpu_at_fp32(world, tmp_path, device, strict_fp32):
    # One update of the fused model from the same initial weights, gradients accumulated over two
    # batches. The gradients it used are compared, not the weights after it: Adam scales the rounding
    # noise of a gradient that is zero but for rounding (a key projection's bias: softmax cancels it)
    # into a full-size step. fp32 on both sides differs by summation order and attention kernel only,
    # ~1e-6 relative; a wrong mask, layer, PrLM input or accumulation is off by far more than rtol 1e-3.
    run = small_runs.tiny_run("dev", prlms=[world.use], update_freq=2)
    cpu, pairs = _fused_trainer(world, run, tmp_path / "cpu", resolve_runtime("cpu", "fp32"))
    other, _ = _fused_trainer(world, run, tmp_path / "device", resolve_runtime(device, "fp32"))
    micro = [pairs.__getitems__(list(range(0, 6))), pairs.__getitems__(list(range(6, 14)))]
    assert all(len(b.prlm) == 1 for b in micro)  # the PrLM branch is read
    loss_cpu, nll_cpu, tokens_cpu = cpu.train_step(micro)
    loss_dev, nll_dev, tokens_dev = other.train_step(micro)
    assert tokens_dev == tokens_cpu == sum(b.ntokens for b in micro)
    assert float(loss_dev) == pytest.approx(float(loss_cpu), rel=1e-5)
    assert float(nll_dev) == pytest.approx(float(nll_cpu), rel=1e-5)
    differing = []
    for (name, a), b in zip(cpu.model.named_parameters(), other.model.parameters()):
        assert a.grad is not None and b.grad is not None, name
        try:
            torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-3, atol=1e-6)
        except AssertionError as e:
            differing.append(f"{name}: {str(e).splitlines()[-2:]}")
    assert not differing, differing
    assert any("prlm" in name for name, _ in other.model.named_parameters())


# Trains a small model on the device in a loop until killed: a neighbour of the run under test, as another
# run of a grid (train.jobs) is, each in its own process on the same device.
NEIGHBOUR = """
import sys, torch
from prlmfuse.train_fused.config import RunConfig
from prlmfuse.train_fused.modeling import FusedTransformer
device = torch.device(sys.argv[1])
run = RunConfig(name="neighbour", preset="tiny")
model = FusedTransformer(run.model_config(500, [])).to(device)
opt = torch.optim.Adam(model.parameters())
src = torch.randint(4, 500, (32, 40), device=device)
print("busy", flush=True)
while True:
    model(src, src, None).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_a_run_trained_beside_others_on_the_device_gets_the_gradients_it_gets_alone(world, tmp_path, device,
                                                                                    strict_fp32):
    # One update of the fused model, static shapes and all, alone and then with three other training processes
    # on the same device: the gradients it used are the same within fp32 rounding (compared as the
    # device-against-CPU test compares them; the weights after Adam would amplify a zero gradient's noise).
    run = small_runs.tiny_run("grid", prlms=[world.use], static_shapes=True)
    runtime = resolve_runtime(device, "fp32")
    alone, pairs = _fused_trainer(world, run, tmp_path / "alone", runtime)
    batch = [pairs.__getitems__(alone.train_sampler.batches[0])]
    alone.train_step(batch)
    neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, device], stdout=subprocess.PIPE, text=True)
                  for _ in range(3)]
    try:
        assert all(n.stdout.readline().strip() == "busy" for n in neighbours)
        beside, _ = _fused_trainer(world, run, tmp_path / "beside", runtime)
        beside.train_step(batch)
        assert all(n.poll() is None for n in neighbours)  # still training when the update was made
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
    for (name, a), b in zip(alone.model.named_parameters(), beside.model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def cudnn_sdp_restored():
    """torch's process-wide cuDNN attention flag as this test found it, whatever the test sets."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_stages_keep_cudnn_attention_off_on_a_gpu_and_leave_it_alone_on_a_cpu(world, tmp_path, device, cudnn_sdp_restored):
    # cuDNN's SDPA kernel builds a graph for every new shape; every stage resolves its runtime, and a
    # Trainer handed a runtime resolved in another process sets its own process up too.
    import warnings

    from torch.nn.attention import SDPBackend

    def picked() -> SDPBackend:  # SDPA's kernel for a bf16 self-attention with a padding mask, as the model's
        q = torch.randn(4, 8, 37, 64, device=device, dtype=torch.bfloat16)
        mask = torch.ones(4, 1, 1, 37, dtype=torch.bool, device=device)
        return SDPBackend(torch._fused_sdp_choice(q, q, q, mask))

    torch.backends.cuda.enable_cudnn_sdp(True)
    default = picked()
    if device != "cpu" and default != SDPBackend.CUDNN_ATTENTION:
        warnings.warn(f"with cuDNN's kernel allowed, SDPA picks {default.name} on this GPU: nothing to turn off here")
    runtime = resolve_runtime(device, "bf16")
    assert torch.backends.cuda.cudnn_sdp_enabled() == (device == "cpu")
    assert picked() != SDPBackend.CUDNN_ATTENTION and (device != "cpu" or picked() == default)
    torch.backends.cuda.enable_cudnn_sdp(True)  # as in a process that did not resolve it
    trainer, pairs = _fused_trainer(world, small_runs.tiny_run("dev", prlms=[world.use]), tmp_path / "run", runtime)
    assert torch.backends.cuda.cudnn_sdp_enabled() == (device == "cpu")
    assert picked() != SDPBackend.CUDNN_ATTENTION
    loss, _, tokens = trainer.train_step([pairs.__getitems__(list(range(0, 6)))])
    assert tokens > 0 and math.isfinite(loss)


@pytest.mark.parametrize("device, precision", [
    pytest.param("cuda", "bf16", marks=pytest.mark.cuda, id="cuda-bf16"),
    pytest.param("cuda", "fp16", marks=pytest.mark.cuda, id="cuda-fp16"),
    pytest.param("cpu", "bf16", id="cpu-bf16"),
])
def test_mixed_precision_training_ends_with_finite_falling_losses(world, tmp_path, device, precision):
    runtime = resolve_runtime(device, precision)
    run = small_runs.tiny_run("amp", prlms=[world.use], max_updates=20, log_every=2, save_every=10)
    run_dir = train_run(run, world.corpus, [dict(world.caches)], tmp_path / "amp", progress=False, runtime=runtime)
    train, dev = train_and_dev_losses(run_dir)
    assert len(train) == 10 and dev, (train, dev)
    assert all(math.isfinite(x) for x in train + dev), (train, dev)
    # fp16's first updates may overflow and be skipped while the scaler backs off: the first window
    # (updates 1-2) is the untrained loss either way, the last (19-20) follows a dozen or more steps.
    assert train[-1] < train[0] - 0.1, train
    info = json.loads((run_dir / "run.json").read_text())
    assert info["device"] == str(runtime.device) and info["precision"] == precision
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["update"] == 20
    if precision == "fp16":
        # the gradient scaler was in use and is saved with the run, at a finite positive scale
        assert state["grad_scaler"] is not None and 0 < state["grad_scaler"]["scale"] < math.inf, state["grad_scaler"]
    else:
        assert state.get("grad_scaler") is None


@pytest.mark.parametrize("device", [CUDA, CPU_SLOW])
def test_compiled_training_reaches_the_eager_loss(world, tmp_path, device, strict_fp32):
    # fp32 and dropout 0 (tiny_run's default): compiled dropout draws other random numbers than eager,
    # and autocast would add its own rounding. Same seed, so the same initial weights and batch order.
    runtime = resolve_runtime(device, "fp32")
    losses = {}
    for compiled in (False, True):
        run = small_runs.tiny_run("compiled" if compiled else "eager", prlms=[world.use], max_updates=6, log_every=1,
                                  save_every=6, compile=compiled)
        run_dir = train_run(run, world.corpus, [dict(world.caches)], tmp_path / run.name, progress=False,
                            runtime=runtime)
        losses[compiled] = train_and_dev_losses(run_dir)
    (eager, eager_dev), (comp, comp_dev) = losses[False], losses[True]
    assert len(eager) == len(comp) == 6 and len(eager_dev) == len(comp_dev) >= 1
    assert all(math.isfinite(x) for x in comp + comp_dev)
    # The first update's loss comes from identical weights: only the kernels differ (fused by inductor,
    # other summation orders, ~1e-6 relative). Later ones also carry Adam's steps on those differences;
    # after 6 updates they stay far below 1e-3 relative, while a wrong compiled graph (a lost mask, a
    # skipped layer) moves the loss by whole percents.
    assert comp[0] == pytest.approx(eager[0], rel=1e-4)
    assert comp == pytest.approx(eager, rel=1e-3)
    assert comp_dev == pytest.approx(eager_dev, rel=1e-3)
    assert eager[-1] < eager[0]


# ---------------------------------------------------------------------------- stage three


def _decoding_inputs(world: World, branch_paths: list[str] | None = None):
    """(run view, model on the CPU in eval mode, BPE, test lines, their source ids, test branches)."""
    from prlmfuse.evaluate.corpus_decode import encode_sources
    from prlmfuse.evaluate.runs import load_model, open_run, select_weights
    from prlmfuse.evaluate.settings import AVERAGE, AVERAGE_LAST
    from prlmfuse.fileio import read_lines, sha256_file

    run = open_run(world.fused)
    # the weights translate and evaluate_runs take by default (the average of the newest saves)
    model, bpe = load_model(run, select_weights(run, AVERAGE_LAST, AVERAGE), AVERAGE)
    src = run.corpus.src_path("test")
    lines = read_lines(src)
    src_ids = encode_sources(bpe, lines, int(model.config.max_positions))
    branches = run.open_branches(branch_paths or run.test_cache_paths("test"), source=str(src),
                                 source_name="test source", source_sha256=sha256_file(src), source_lines=len(lines))
    return run, model, bpe, lines, src_ids, branches


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_beam_search_on_the_device_gives_the_cpu_hypotheses_at_fp32(world, device, strict_fp32):
    from prlmfuse.evaluate.corpus_decode import decode_corpus
    from prlmfuse.evaluate.settings import DecodeSettings

    _, model, bpe, lines, src_ids, branches = _decoding_inputs(world)
    settings = DecodeSettings(beam=4)  # bf16=False: fp32 decoding on either device
    assert not settings.bf16

    def decode(m):
        return decode_corpus(m, bpe, src_ids, branches, settings).hyps

    on_cpu = decode(model)
    on_device_model = copy.deepcopy(model).to(resolve_runtime(device).device)
    assert next(on_device_model.parameters()).device.type == device
    on_device = decode(on_device_model)
    assert len(on_device) == len(on_cpu) == len(lines) == 12
    assert sum(bool(h) for h in on_cpu) >= len(lines) // 2  # real hypotheses, not empty lines
    # Exactly the CPU's, except on the lines where a near-tie (which any float noise decides) makes the
    # CPU's own answer change under a weight noise ten times larger than fp32 rounding.
    sensitive = noise_sensitive_lines(decode, model, on_cpu)
    stable = [i for i in range(len(lines)) if i not in sensitive]
    assert len(stable) >= len(lines) // 2, f"only {len(stable)} lines decode robustly; the comparison says too little"
    assert {i: on_device[i] for i in stable} == {i: on_cpu[i] for i in stable}


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_translate_with_its_prlm_live_on_the_device_equals_decoding_a_cache_built_there(world, tmp_path, device):
    """What translate guarantees on any device: one line per input, and exactly the hypotheses of the
    batch decoding of a cache built on that device with the training cache's settings (its live
    features ARE such a cache). Across devices it agrees up to float noise, which the cache and beam
    tests above bound; exact equality across devices is not promised."""
    from prlmfuse.cache_features.compat import precision_of
    from prlmfuse.evaluate import translate
    from prlmfuse.evaluate.corpus_decode import decode_corpus
    from prlmfuse.evaluate.settings import DecodeSettings

    runtime = resolve_runtime(device)
    trained = json.loads((world.fused / "run.json").read_text())["prlms"][0]
    fields = trained["key_fields"]
    # As live_features builds it: the trained layers, storage dtype and precision; the device's default batch.
    cache = build_cache(str(world.checkpoint), world.corpus.src_path("test"), tmp_path / "test-cache",
                        layers=[int(x) for x in fields["layers"]], backend=cache_backend(), dtype=str(fields["dtype"]),
                        precision=precision_of(fields), device=str(runtime.device), progress=False).path
    assert precision_of(fields) == "fp32"
    reader = CacheReader(cache)
    assert reader.key == trained["caches"]["test"]["key"]  # the same cache, wherever it is built
    reader.close()
    run, model, bpe, lines, src_ids, branches = _decoding_inputs(world, [str(cache)])
    settings = DecodeSettings.for_run(run, None, beam=3)
    expected = decode_corpus(model.to(runtime.device), bpe, src_ids, branches, settings).hyps

    got = translate(world.fused, lines, beam=3, device=device)
    assert len(got) == len(lines) == 12
    assert all(isinstance(h, str) and "\n" not in h for h in got)
    assert sum(bool(h) for h in got) >= len(lines) // 2
    assert got == expected


# ------------------------------------------------------------------------------ end to end

PIPELINE = """\
workdir: work
data:
  kind: text
  src: en
  tgt: en
  files:
    train_src: {raw}/train.src
    train_tgt: {raw}/train.tgt
    dev_src: {raw}/dev.src
    dev_tgt: {raw}/dev.tgt
    test_src: {raw}/test.src
    test_tgt: {raw}/test.tgt
cache:
  backend: {backend}
  checkpoints:
    - name: {prlm}
      layers: [-2]
train:
  defaults: {{preset: tiny, bpe_vocab: 400, max_tokens: 400, max_updates: 6, max_epochs: null, warmup: 3,
             save_every: 3, keep_last: 3, log_every: 2, num_workers: 0, dropout: 0.0}}
  runs:
    baseline: {{}}
    fused: {{prlms: [{{checkpoint: {prlm}, layer: -2}}]}}
evaluate: {{baseline: baseline, beam: 2, average_last: 2, max_len_b: 5}}
"""


@pytest.mark.parametrize("device", [CUDA, CPU_SLOW])
def test_tiny_pipeline_end_to_end_on_the_device(tmp_path, device):
    """`prlmfuse run pipeline.yaml --device DEVICE`: data -> cache -> train -> evaluate, at the device's
    own (auto) precision, English target so BLEU needs no mecab."""
    raw = tmp_path / "raw"
    toy_corpus_files(raw)
    prlm = small_runs.tiny_prlm(tmp_path / "prlm")
    backend = cache_backend()
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(raw=raw, prlm=prlm, backend=backend), encoding="utf-8")

    done = subprocess.run([sys.executable, "-m", "prlmfuse.cli", "run", str(path), "--device", device],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]

    work = tmp_path / "work"
    runtime = resolve_runtime(device)  # what `--device` resolves to, at the device's auto precision
    precision = precision_name(compute_dtype(runtime.device))
    manifests = list((work / "cache").rglob("manifest.json"))  # the pipeline's cache root: workdir/cache
    assert len(manifests) == 3  # train, dev, test of the one PrLM
    for manifest in manifests:
        m = json.loads(manifest.read_text())
        assert m["backend"] == backend and m["key_fields"]["precision"] == precision and m["complete"]
    for name in ("baseline", "fused"):
        info = json.loads((work / "runs" / name / "run.json").read_text())
        assert info["device"] == str(runtime.device) and info["precision"] == precision
        train, _ = train_and_dev_losses(work / "runs" / name)
        assert len(train) == 3 and all(math.isfinite(x) for x in train)  # log_every 2 of 6 updates
    results = json.loads((work / "results" / "results.json").read_text())
    rows = {r["run"]: r for r in results["rows"]}
    assert set(rows) == {"baseline", "fused"} and rows["fused"]["compared_with"] == "baseline"
    for row in rows.values():
        assert 0.0 <= row["bleu"] <= 100.0 and "tok:13a" in row["signature"]["bleu"]  # English target: no mecab
        hyps = (work / "results" / row["hyp_file"]).read_text(encoding="utf-8").splitlines()
        assert len(hyps) == 12
    if runtime.device.type == "cuda":  # evaluate decoded on the GPU: its results name it
        assert torch.cuda.get_device_name(runtime.device) in results["settings"]["machine"]
