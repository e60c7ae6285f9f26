from pathlib import Path

from squareq.cli_reference import render


def test_docs_cli_md_is_generated_from_the_code():
    path = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
    assert path.read_text() == render(), "docs/cli.md is stale: run `python -m squareq.cli_reference > docs/cli.md`"
