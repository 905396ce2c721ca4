"""The first sentences of a test set with the reference and each run's output side by side: what a table of
scores cannot show (a baseline that writes one synopsis whatever it reads, a name copied or garbled)."""

from __future__ import annotations

import re
from pathlib import Path

from prlmfuse.errors import UserError
from prlmfuse.evaluate.report import Report
from prlmfuse.fileio import read_lines

MARKDOWN = re.compile(r"([\\`*_\[\]<>|])")  # what Markdown would read as markup inside a table cell
SOURCE_WIDTH = 100  # characters of a source shown: a long description's start is enough to judge a summary


def examples_markdown(report: Report, count: int, source: str | Path | None = None) -> str:
    """The first `count` sentences of each test set: the source's start (with `source`, the test set's source
    file), the reference and each run's hypothesis, in the report's run order."""
    if count < 1:
        raise UserError(f"--examples {count}: give the number of test sentences to show, 1 or more")
    splits = list(dict.fromkeys(r.test_set for r in report.rows))
    if source is not None and len(splits) > 1:
        raise UserError(f"--source names one file, but the report has {len(splits)} test sets ({', '.join(splits)}); "
                        "drop --source to see each test set's examples without their sources")
    lines = ["# Examples", ""]
    for split in splits:
        rows = [r for r in report.rows if r.test_set == split]
        shown = min(count, rows[0].num_sentences)
        folder = report.sources[rows[0].run].parent
        refs = read_lines(folder / rows[0].ref_file)
        # (header, cells) pairs, not a dict: a run named "reference" gets a column of its own
        columns = [("reference", refs[:shown])]
        for row in rows:
            hypotheses = read_lines(report.sources[row.run].parent / row.hyp_file, check_text=False)
            columns.append((row.run, hypotheses[:shown]))
        if source is not None:
            sources = read_lines(source)
            if len(sources) != rows[0].num_sentences or sources == refs:
                what = (f"has {len(sources)} lines but test set {split!r} has {rows[0].num_sentences} sentences"
                        if len(sources) != rows[0].num_sentences else "holds the references")
                raise UserError(f"--source {source} {what}; pass the source side of the test set the runs were "
                                "evaluated on")
            columns.insert(0, ("source (start)", [_start(s) for s in sources[:shown]]))
        lines += [f"## {split}: the first {shown} of {rows[0].num_sentences} sentences", "",
                  "| # | " + " | ".join(header for header, _ in columns) + " |", "|---|" + "---|" * len(columns)]
        for i in range(shown):
            lines.append(f"| {i + 1} | " + " | ".join(_cell(cells[i]) for _, cells in columns) + " |")
        lines.append("")
    return "\n".join(lines)


def _start(text: str, width: int = SOURCE_WIDTH) -> str:
    """`text` cut at a word boundary before `width` characters, with an ellipsis where it was cut."""
    if len(text) <= width:
        return text
    space = text.rfind(" ", 1, width + 1)  # a space just past the width still ends the last word shown
    return (text[:space] if space > 0 else text[:width]) + " …"


def _cell(text: str) -> str:
    """A Markdown table cell shown as written: a pipe would end the cell, and `<name@host>`, `*` or `_` in a
    description would render as a link or emphasis; an empty hypothesis is shown as such."""
    return MARKDOWN.sub(r"\\\1", text) if text else "(empty)"
