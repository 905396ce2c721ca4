"""`prlmfuse bundle`: wheels, checkpoints and corpora for GPU nodes with no network."""

from __future__ import annotations

from pathlib import Path

import click

from prlmfuse.commands._common import creatable_parent


@click.command()
@click.argument("out", type=click.Path(), callback=creatable_parent)
@click.option("--checkpoints", "checkpoints", default="", metavar="ALIAS[,ALIAS…]",
              help="Offline aliases to carry as float16 checkpoint directories (`prlmfuse checkpoints list`).")
@click.option("--python", "python", default="3.12", show_default=True, metavar="X.Y", help="The node's Python.")
@click.option("--platform", "platform", default="manylinux_2_28_x86_64", show_default=True,
              help="The node's wheel platform tag.")
@click.option("--max-mb", "max_mb", default=64.0, show_default=True, type=float,
              help="Refuse a bundle that with the source tree copied beside it (git's tracked and unignored files) "
                   "passes this many MiB: the node's copy limit.")
@click.option("--corpus", "corpora", multiple=True, type=click.Path(),
              help="A corpus directory written by `prlmfuse data …`, for nodes that cannot build it; repeatable.")
@click.option("--trim-embeddings", "trim", is_flag=True,
              help="Keep only the embedding rows the bundled corpora's source sentences read (the rest as zeros, the "
                   "weights gzipped): their features unchanged at a fraction of the size, for these corpora only.")
@click.option("--leave-out", "leave_out", default="", metavar="PKG[,PKG…]",
              help="Packages not to carry, with what only they need: ones the node's image already holds, or ones "
                   "its pipelines do without (zarr, where caches are hdf5).")
@click.option("--with-ja", "with_ja", is_flag=True,
              help="Also carry MeCab and its IPA dictionary (about 14 MiB) so the node can compute Japanese BLEU.")
def bundle(out: str, checkpoints: str, python: str, platform: str, max_mb: float, corpora: tuple[str, ...],
           trim: bool, leave_out: str, with_ja: bool) -> None:
    """Write into OUT what an offline GPU node needs beyond a stock PyTorch image.

    The wheels prlmfuse needs that the node lacks (for the node's Python and platform), each named
    checkpoint as a local directory, optionally corpora, install.sh and bundle.json (every part with
    its size and sha256). OUT appears only when the bundle is complete and, with the source tree, within
    --max-mb.
    """
    from prlmfuse.bundle import build_bundle

    names = [c for c in checkpoints.split(",") if c.strip()]
    result = build_bundle(out, checkpoints=names, python=python, platform=platform, max_mb=max_mb, corpora=list(corpora),
                          with_ja=with_ja, trim=trim, leave_out=leave_out.split(","))
    for row in result.lacking:
        click.echo(f"lacks {row.package} ({row.why}): {row.means}")
    wheels = sum(1 for p in result.parts if p["path"].startswith("wheels/"))
    click.echo(f"bundle: {result.out} ({result.total_bytes / (1 << 20):.1f} MiB: {wheels} wheels"
               + "".join(f", checkpoints/{n}" for n in names)
               + "".join(f", corpus {Path(c).name}" for c in corpora) + ")"
               + (f"; with the source tree beside it {(result.total_bytes + result.tree_bytes) / (1 << 20):.1f} MiB "
                  f"of --max-mb {max_mb:g}" if result.tree_bytes else ""))
    click.echo(f"install on the node, from the copied source tree: {result.install_line}")
