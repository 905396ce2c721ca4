"""`prlmfuse checkpoints`: the offline PrLM aliases."""

from __future__ import annotations

import click

from prlmfuse import prlms


@click.group()
def checkpoints() -> None:
    """Frozen PrLM checkpoints: offline aliases, hub ids and local directories."""


@checkpoints.command("list")
def checkpoints_list() -> None:
    """Show the offline aliases: prepared or not, family, layers and width."""
    rows = prlms.list_aliases()
    click.echo(f"{'alias':<24}{'prepared':<10}{'family':<14}{'layers':>7}{'width':>7}  package")
    for r in rows:
        click.echo(
            f"{r['alias']:<24}{'yes' if r['prepared'] else 'no':<10}{r['family']:<14}"
            f"{r['layers']:>7}{r['width']:>7}  {r.get('package', '')}"
        )


@checkpoints.command("prepare")
@click.argument("names", nargs=-1, required=True)
def checkpoints_prepare(names: tuple[str, ...]) -> None:
    """Convert or copy offline checkpoints into the local cache (once)."""
    for name in names:
        info = prlms.prepare_alias(name)
        click.echo(f"{name}: {info.family}, {info.num_layers} layers, width {info.hidden_size} -> {info.path}")
