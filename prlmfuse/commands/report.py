"""`prlmfuse report`: one table from results.json files evaluated apart (seeds as separate jobs or machines)."""

from __future__ import annotations

import click

from prlmfuse.commands._common import creatable_dir


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), callback=creatable_dir, help="Where the merged results.md/csv/json and scores.png go.")
@click.option("--against", "against", multiple=True, metavar="RUN",
              help="Also compare every run with RUN (Δ and paired-bootstrap p), e.g. a table's default setting; where "
                   "several files hold their own RUN, the one of the row's file, and of its seed where RUN has one "
                   "(fused.seed-2); a system's name (fused, where the files hold fused.seed-N) names its run of "
                   "each row's seed, and rows of a seed it lacks are not compared; repeatable.")
@click.option("--examples", type=click.IntRange(min=1), metavar="N",
              help="Also write examples.md: the first N sentences of each test set, the reference and each run's "
                   "output side by side.")
@click.option("--source", type=click.Path(dir_okay=False, exists=True),
              help="With --examples: the test set's source file (e.g. WORKDIR/data/CORPUS/test.src), whose start "
                   "each example shows; one test set only.")
def report(files: tuple[str, ...], out: str, against: tuple[str, ...], examples: int | None,
           source: str | None) -> None:
    """Merge FILES (results.json of `evaluate`, each with its hyp.* and ref.* files beside it) into one table.

    Each fused run is compared again with the baseline its evaluation named (its own seed's), from the
    hypothesis files; each system gets its mean ± sd over seeds. Files scored on other test sets or
    corpora, with other metric or decoding settings, or whose hypotheses are missing or changed are refused.
    With --against RUN, every run is also compared with RUN (of its own seed where there is one), in a
    table of its own.
    """
    from prlmfuse.errors import UserError
    from prlmfuse.evaluate.examples import examples_markdown
    from prlmfuse.evaluate.report import merge_evaluations, write_report
    from prlmfuse.fileio import atomic_write_text

    if source is not None and examples is None:
        raise UserError("--source shows the sources of --examples; add --examples N")
    merged = merge_evaluations(list(files), out, against, write=False)
    shown = None if examples is None else examples_markdown(merged, examples, source)  # checked before writing
    write_report(merged)
    click.echo(f"results: {merged.files['results.md']}")
    if shown is not None:
        atomic_write_text(merged.out / "examples.md", shown)
        click.echo(f"examples: {merged.out / 'examples.md'}")
    else:  # an earlier report's examples are not of these results
        (merged.out / "examples.md").unlink(missing_ok=True)
    for m in merged.systems:
        name = {"bleu": "BLEU", "rougeL": "ROUGE-L"}.get(m.metric, m.metric)
        several = len(m.runs) > 1  # a standard deviation needs two runs
        delta = "" if m.delta_mean is None else f", Δ {m.delta_mean:+.2f}" + (f" ± {m.delta_sd:.2f}" if m.compared > 1 else "")
        spread = f" ± {m.sd:.2f} over {len(m.runs)} runs" if several else " (one run)"
        click.echo(f"  {m.test_set} {m.system}: {name} {m.mean:.2f}{spread}{delta}")
    for c in merged.against:
        metric = next(r.main_metric for r in merged.rows if r.run == c["run"] and r.test_set == c["test_set"])
        if metric in c["delta"]:
            click.echo(f"  {c['test_set']} {c['run']} vs {c['against_run']}: Δ {c['delta'][metric]:+.2f} "
                       f"(p {c['p_value'][metric]:.3f})")
    click.echo(f"plot: {merged.files['scores.png']}")
