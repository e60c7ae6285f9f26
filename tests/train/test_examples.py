"""The example configurations in examples/ parse, and each names its slab, data and a VRAM budget."""
from pathlib import Path

import pytest

from squareq.train.config import ConfigError, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_promised_examples_ship():
    assert {p.name for p in EXAMPLES.glob("*.toml")} >= {"flux1-dev-24gb.toml", "flux1-dev-16gb.toml",
                                                         "flux1-dev-8gb.toml", "flux2-dev.toml", "qwen-image.toml"}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_each_example_parses_into_a_complete_config(path, tmp_path):
    cfg = load_config(path)
    assert cfg.slab and cfg.data and cfg.output and cfg.vram_budget_bytes
    card = [int(w[:-2]) for w in path.stem.split("-") if w.endswith("gb")]
    if card:  # the card's size in the name: the budget stays below it
        assert cfg.vram_budget_bytes < card[0] * 10**9
    # negative control: the same file with a misspelt key is refused, so a broken example cannot pass
    broken = tmp_path / path.name
    broken.write_text(path.read_text() + "\nlearnig_rate = 1e-4\n")
    with pytest.raises(ConfigError, match="learnig_rate"):
        load_config(broken)
