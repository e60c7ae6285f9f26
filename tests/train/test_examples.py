"""The example configurations in examples/ parse, and each names its slab, data and a VRAM budget."""
import shlex
from pathlib import Path

import click
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


def example_commands(path: Path) -> list[list[str]]:
    """The squareq command lines in an example's comments (a trailing backslash continues a line; parentheses
    around an alternative are dropped)."""
    text = "\n".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
    text = text.replace("\\\n", " ").replace("(or from ComfyUI's files: ", "").replace(")", "")
    return [shlex.split(line[line.index("squareq "):])[1:] for line in text.splitlines() if "squareq " in line]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_the_commands_an_example_names_are_valid_command_lines(path):
    """Every `squareq ...` line an example gives parses with today's CLI (flags renamed or gone would fail), and the
    compile lines take no --device: the GPU is the default."""
    from squareq.cli import main

    commands = example_commands(path)
    assert any(c[0] == "compile" for c in commands) and any(c[0] == "train" for c in commands)
    # parsed under the group's context, as `squareq ...` parses them: a command parsed on its own caches a help option
    # without the group's -h (click 8.2), which would change docs/cli.md's rendering for the rest of the process
    group = click.Context(main, info_name="squareq", **main.context_settings)
    for args in commands + [["compile", "m", "--budget", "1GB", "-o", "x", "--cpu-only"]]:
        command = main.commands[args[0]]
        if args[-1] == "--cpu-only":  # negative control: an unknown flag is refused
            with pytest.raises(click.UsageError):
                command.make_context(args[0], args[1:], parent=group)
            continue
        command.make_context(args[0], args[1:], parent=group)
        assert "--device" not in args


def _host_table() -> dict[str, list[str]]:
    """docs/train.md's table of example configs: config file -> its cells."""
    text = (EXAMPLES.parent / "docs" / "train.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `examples/")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_each_example_names_its_pc_and_docs_list_it_with_its_card(path):
    """An example states the host memory of the PC it is for (host_budget, not the machine's auto), within that PC's
    RAM as its comment says, and docs/train.md's table shows its card, vram_budget and host_budget as the file has
    them."""
    cfg = load_config(path)
    assert cfg.host_budget != "auto" and cfg.host_budget_bytes
    line = next(line for line in path.read_text().splitlines() if line.startswith("host_budget"))
    ram = int(line.split("a PC with ")[1].split(" GB")[0])
    assert cfg.host_budget_bytes <= ram * 10**9
    card, vram, pc = _host_table()[f"examples/{path.name}"][:3]
    assert vram == cfg.vram_budget and pc == f"{ram} GB of RAM ({cfg.host_budget})"
    named = [w for w in path.stem.split("-") if w.endswith("gb")]
    if named:
        assert card == f"{named[0][:-2]} GB"


def test_the_table_lists_every_example_and_no_other():
    assert set(_host_table()) == {f"examples/{p.name}" for p in EXAMPLES.glob("*.toml")}
