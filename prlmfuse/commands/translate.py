"""`prlmfuse translate`: raw text through a trained run, its PrLM run live."""

from __future__ import annotations

import click

from prlmfuse.commands._common import _decode_options, _device_option_alone


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="A trained run directory.")
@click.option("--input", "input_file", type=click.File("rb"), default="-", help="UTF-8 text file (default: stdin).")
@_decode_options
@click.option("--trust-remote-code", is_flag=True, help="Allow code shipped with the run's hub checkpoint to run.")
@_device_option_alone
def translate(run_dir: str, input_file, trust_remote_code: bool, device: str | None, **decoding) -> None:
    """Translate raw text with a trained run, running its PrLM live on the input; one output line per input line."""
    from prlmfuse.evaluate import translate as translate_lines
    from prlmfuse.fileio import decode_lines

    # Checked like a corpus file: invalid UTF-8 or a control character is one line naming where it is.
    name = getattr(input_file, "name", "<stdin>")
    lines = decode_lines(input_file.read(), name if isinstance(name, str) else "<stdin>")
    for hyp in translate_lines(run_dir, lines, trust_remote_code=trust_remote_code, device=device or "auto", **decoding):
        click.echo(hyp)
