"""`prlmfuse cache`: stage one, the feature cache of a frozen PrLM over a corpus."""

from __future__ import annotations

import json

import click

from prlmfuse.commands._common import _device_option_alone, creatable_parent


@click.group()
def cache() -> None:
    """Stage one: run a frozen PrLM once over a corpus and store its hidden states."""


@cache.command("build")
@click.option("--checkpoint", required=True, help="Alias (see `checkpoints list`), hub id or local directory.")
@click.option("--corpus", required=True, type=click.Path(dir_okay=False), help="One sentence a line, UTF-8.")
@click.option("--out", required=True, callback=creatable_parent, help="Cache directory (zarr also takes fsspec URLs such as s3://...).")
@click.option("--layers", default="-2", show_default=True, help="Comma-separated hidden-state indices, or 'all'.")
@click.option("--backend", default="zarr", show_default=True, help="zarr or hdf5.")
@click.option("--dtype", default="float16", show_default=True, help="float16, bfloat16, float32 or int8.")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1),
              help="Token budget per batch (default: 8192 on a CPU, 65536 on a GPU).")
@click.option("--force", is_flag=True, help="Replace a cache with a different key in --out.")
@click.option("--trust-remote-code", is_flag=True, help="Allow code shipped with a hub checkpoint to run.")
@_device_option_alone
@click.option("--precision", default=None, type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
              help="Autocast precision of the forward pass (default auto: the precision of a matching cache "
              "already in --out, else the device's fast one). A different one than --out holds needs --force.")
def cache_build(checkpoint, corpus, out, layers, backend, dtype, max_tokens, force, trust_remote_code, device,
                precision) -> None:
    """Build (or reuse) the feature cache of one checkpoint over one corpus file."""
    from prlmfuse.cache_features import build_cache

    result = build_cache(
        checkpoint, corpus, out, layers=layers, backend=backend, dtype=dtype,
        max_tokens=max_tokens, force=force, trust_remote_code=trust_remote_code, device=device or "auto",
        precision=precision,
    )
    click.echo(f"{'cached' if result.reused else 'built'}: {result.path} (key {result.key[:16]})")


@cache.command("verify")
@click.argument("path")
def cache_verify(path: str) -> None:
    """Check every shard's checksum; name the first bad or missing one (exit 2)."""
    from prlmfuse.cache_features import verify_cache

    verify_cache(path)
    click.echo(f"ok: {path}")


@cache.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--scale-sample", default=200, show_default=True, type=click.IntRange(min=0),
              help="Sentences read for the feature-scale figures per layer (0: skip).")
def cache_inspect(path: str, as_json: bool, scale_sample: int) -> None:
    """Print a cache's key, sentence and token counts, size on disk, bytes per token, and the scale of
    its features per layer (a causal LM's residual stream can be thousands of times a BERT's)."""
    from prlmfuse.cache_features import feature_scale, inspect_cache

    info = inspect_cache(path)
    if scale_sample:
        info["feature_scale"] = feature_scale(path, scale_sample)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    for k, v in info.items():
        if isinstance(v, dict):
            click.echo(f"{k}:")
            for kk, vv in v.items():
                click.echo(f"  {kk}: {vv}")
        elif isinstance(v, float):
            click.echo(f"{k}: {v:.1f}")
        elif isinstance(v, int) and (k.endswith("bytes") or k == "size_on_disk"):
            click.echo(f"{k}: {v} ({v / 2**20:.1f} MiB)")
        else:
            click.echo(f"{k}: {v}")
