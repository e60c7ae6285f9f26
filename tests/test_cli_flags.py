"""A flag that several commands share has the same type, choices and default in each (issue 60: `train` and `sample`
spelled --compute and --cuda-graphs differently), apart from the few whose meaning differs by command, listed here
with why."""
import click
import pytest

from squareq.cli import main
from squareq.cli.options import AutoOrInt

# flags whose name is shared but whose meaning is the command's own
DIFFERENT_MEANING = {
    "--out": "what is written differs: a slab, a LoRA folder, a LoRA file, images, the demo's folder",
    "-o": "as --out",
    "--steps": "optimizer steps (train, demo), denoising steps (sample), each convergence run's (accept)",
    "--budget": "compile's size budget is required; accept checks the recorded one; the demo's tiny model has 2MB",
    "--resolution": "one image side in sample and accept, one or several (comma-separated) in train and cache",
    "--guidance": "train embeds a guidance value (FLUX.1-dev trains at 1); sample's is the guidance scale",
    "--resume": "compile continues its one state folder (a switch); train names a checkpoint (latest or a folder)",
}
# accept's convergence runs take these from --train-config, else from the built-in dataset's recipe: no fixed default
DERIVED_DEFAULT = {("accept", "--lr"), ("accept", "--rank"), ("accept", "--max-sequence-length")}


def kind(param: click.Parameter) -> tuple:
    """The type as a user meets it: an int range is an int (its bounds are the command's check), a Choice its
    choices, ``auto|N`` its minimum."""
    t = param.type
    if isinstance(t, (click.IntRange, click.FloatRange)):
        return ("integer" if isinstance(t, click.IntRange) else "float", param.is_flag, param.multiple)
    if isinstance(t, click.Choice):
        return ("choice", tuple(t.choices))
    if isinstance(t, AutoOrInt):
        return ("auto|N", t.minimum)
    return (t.name, param.is_flag, param.multiple)


def default(param: click.Parameter):
    value = param.default
    return None if value is None or str(value) == "Sentinel.UNSET" else value


def mismatches(commands: dict[str, click.Command]) -> list[str]:
    """Every shared flag (not in DIFFERENT_MEANING) whose type, choices or default differs between two commands."""
    seen: dict[str, list[tuple[str, click.Parameter]]] = {}
    for name, command in commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                for flag in param.opts + param.secondary_opts:
                    seen.setdefault(flag, []).append((name, param))
    found = []
    for flag, uses in sorted(seen.items()):
        if len(uses) < 2 or flag in DIFFERENT_MEANING:
            continue
        (first, p), rest = uses[0], uses[1:]
        for name, q in rest:
            if kind(q) != kind(p):
                found.append(f"{flag}: {first} {kind(p)} but {name} {kind(q)}")
            if default(q) != default(p) and not {(first, flag), (name, flag)} & DERIVED_DEFAULT:
                found.append(f"{flag}: {first} defaults to {default(p)!r} but {name} to {default(q)!r}")
    return found


def all_commands() -> dict[str, click.Command]:
    ctx = click.Context(main, info_name="squareq")
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def test_every_shared_flag_has_one_type_choices_and_default():
    commands = all_commands()
    shared = {"--compute", "--cuda-graphs", "--prefetch", "--host", "--dtype", "--model", "--vram-budget"}
    flags = {f for c in commands.values() for p in c.params if isinstance(p, click.Option) for f in p.opts}
    assert shared <= flags
    assert mismatches(commands) == []


def test_the_check_catches_a_mismatched_pair():
    """The negative control: the old `sample --cuda-graphs` switch beside train's [auto|on|off], and a default that
    differs, are each reported."""
    a = click.Command("a", params=[click.Option(["--cuda-graphs"], type=click.Choice(["auto", "on", "off"]),
                                                default="auto"), click.Option(["--seed"], type=int, default=42)])
    b = click.Command("b", params=[click.Option(["--cuda-graphs"], is_flag=True),
                                   click.Option(["--seed"], type=int, default=0)])
    found = mismatches({"a": a, "b": b})
    assert len(found) == 3 and any("--cuda-graphs" in f and "choice" in f for f in found)
    assert any(f.startswith("--seed: a defaults to 42") for f in found)


@pytest.mark.parametrize(("args", "word"), [([], "auto"), (["--cuda-graphs"], "on"), (["--cuda-graphs", "off"], "off"),
                                            (["--cuda-graphs", "on"], "on")])
def test_a_bare_cuda_graphs_still_means_on(args, word):
    """The old spelling (a switch, in sample) keeps working in train and sample: a bare flag is on."""
    # parsed under the group's context, as `squareq ...` parses them: a command parsed on its own caches a help option
    # without the group's -h (click 8.2), which would change docs/cli.md's rendering for the rest of the process
    group = click.Context(main, info_name="squareq", **main.context_settings)
    for name in ("train", "sample"):
        command = all_commands()[name]
        ctx = command.make_context(name, ["x", *args, "--print-config"] if name == "train" else ["x", *args],
                                   parent=group)
        assert ctx.params["cuda_graphs"] == word, name


def test_a_config_file_value_stands_where_no_flag_is_given(tmp_path):
    """train's flags show TrainConfig's defaults, and only the flags given override --config."""
    from click.testing import CliRunner

    path = tmp_path / "t.toml"
    path.write_text('[train]\nrank = 4\ncompute = "bf16"\nresolution = [512]\n')
    out = CliRunner().invoke(main, ["train", "--config", str(path), "--print-config"]).output
    assert "rank = 4" in out and 'compute = "bf16"' in out and "resolution = [512]" in out
    out = CliRunner().invoke(main, ["train", "--config", str(path), "--print-config", "--rank", "16",
                                    "--compute", "auto"]).output
    assert "rank = 16" in out and 'compute = "auto"' in out and "resolution = [512]" in out
