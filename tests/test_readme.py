"""The README's promises to a first-time reader (issue 60): short enough to read in two minutes, one figures table
whose every row is a recorded run (its device, date and commit together in the section it links to under
docs/benchmarks*, and its figures as that run recorded them), `make demo` and `make test` timed once each at a stated
commit, and example configs that use the quickstart's names and compile commands. Each check returns its problems,
so each is also run on a doctored README or config that it must reject."""
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
MAX_CHARS = 9_000
MAX_ROWS = 8
DURATION = r"\d+(?:\.\d+)? ?(?:s|min|minutes?|seconds?)\b(?: \d+ ?s\b)?"
NUMBER = re.compile(r"\d+(?:\.\d+)?")
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def section(text: str, heading: str) -> str:
    """The text from the `## heading` line up to the next `## ` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (and superscripts) dropped, spaces to hyphens."""
    return "".join(c for c in heading.strip().lower() if c.isalpha() or c in "0123456789-_ ").replace(" ", "-")


def linked_run(link: str) -> str | None:
    """The text of the docs/benchmarks* section a README link points to (with its subsections), or None."""
    path, _, anchor = link.partition("#")
    file = (ROOT / path).resolve()
    if not (file == ROOT / "docs" / "benchmarks.md" or file.parent == ROOT / "docs" / "benchmarks") \
            or not file.is_file():
        return None
    lines = file.read_text().splitlines()
    for i, line in enumerate(lines):
        level = len(line) - len(line.lstrip("#"))
        if level and line[level:level + 1] == " " and slug(line[level:]) == anchor:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("#")
                        and len(lines[j]) - len(lines[j].lstrip("#")) <= level), len(lines))
            return "\n".join(lines[i:end])
    return None


def table_rows(text: str) -> list[list[str]]:
    """The figures table's rows (header and rule left out), each as its cells."""
    lines = [line for line in section(text, "Current figures").splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]


def size_problems(text: str) -> list[str]:
    problems = [f"README.md is {len(text)} characters, over {MAX_CHARS}"] if len(text) > MAX_CHARS else []
    tables = [m.start() for m in re.finditer(r"^\|.*\|\n\|[-| ]+\|$", section(text, "Current figures"), re.M)]
    if len(tables) != 1:
        problems.append(f"the Current figures section has {len(tables)} tables, not one")
    rows = table_rows(text)
    if not 0 < len(rows) <= MAX_ROWS:
        problems.append(f"the figures table has {len(rows)} rows, not 1 to {MAX_ROWS}")
    return problems


def row_problems(cells: list[str]) -> list[str]:
    """A row must link to a recorded run whose section holds its device, date and commit, and every figure it quotes
    (its cells between the claim and the device) as that run recorded it."""
    link = re.search(r"\]\(([^)]+)\)", cells[0])
    where = cells[-1]
    dates, commits = DATE.findall(where), COMMIT.findall(where)
    device = where.split(",")[0].strip()
    if not link or len(dates) != 1 or len(commits) != 1 or not device:
        return [f"row {cells[0][:60]!r}: needs a link and 'device, date, `commit`', has {where!r}"]
    run = linked_run(link.group(1))
    if run is None:
        return [f"row {cells[0][:60]!r}: {link.group(1)} is no section of docs/benchmarks.md or docs/benchmarks/"]
    problems = [f"row {cells[0][:60]!r}: its run ({link.group(1)}) does not record {part!r}"
                for part in (device, dates[0], commits[0]) if part not in run]
    for cell in cells[1:-1]:
        for number in NUMBER.findall(cell):
            if not re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", run):
                problems.append(f"row {cells[0][:60]!r}: {number} ({cell!r}) is not in its run's record")
    return problems


def setup_time_problems(text: str) -> list[str]:
    """`make demo` and `make test` each timed exactly once, in a paragraph that names the date and commit, with
    times that a recorded run under docs/benchmarks* holds beside that date and commit."""
    problems = []
    for target in ("make demo", "make test"):
        timed = [m for m in re.finditer(rf"`{target}`[^`\n]{{0,20}}?({DURATION})", text)]
        if len(timed) != 1:
            problems.append(f"`{target}` is timed {len(timed)} times in README.md, not once")
            continue
        paragraph = text[text.rfind("\n\n", 0, timed[0].start()):text.find("\n\n", timed[0].end())]
        dates, commits = DATE.findall(paragraph), COMMIT.findall(paragraph)
        if len(dates) != 1 or len(commits) != 1:
            problems.append(f"`{target}`'s time needs one date and one commit beside it, has {dates} {commits}")
            continue
        recorded = any(timed[0].group(1) in run and dates[0] in run and commits[0] in run and target in run
                       for run in benchmark_sections())
        if not recorded:
            problems.append(f"`{target}` {timed[0].group(1)} at {commits[0]} on {dates[0]} is in no run recorded "
                            "under docs/benchmarks*")
    return problems


def benchmark_sections() -> list[str]:
    texts = [ROOT / "docs" / "benchmarks.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
    return [part for path in texts for part in re.split(r"\n(?=#)", path.read_text())]


def quickstart_train(text: str) -> dict[str, str]:
    """The quickstart's `squareq train` flags that name things: --data, -o, --trigger."""
    lines = [line for line in section(text, "Quickstart").splitlines() if line.startswith("squareq train ")]
    assert len(lines) == 1, lines
    args = shlex.split(lines[0])
    return {flag: args[args.index(flag) + 1] for flag in ("--data", "-o", "--trigger") if flag in args}


def example_problems(text: str, name: str, config: dict, header: str) -> list[str]:
    """An example config uses the quickstart's data folder (a video one, which cuts clips with target_frames:
    my_clips), output and trigger, and its header shows the compile command for its card (its slab, its vram_budget)
    and how to train with it."""
    names = quickstart_train(text)
    if "target_frames" in config:
        names = {**names, "--data": "my_clips"}
    problems = [f"{name}: {key} = {config.get(key)!r}, the quickstart's {flag} is {names.get(flag)!r}"
                for key, flag in (("data", "--data"), ("output", "-o"), ("trigger", "--trigger"))
                if config.get(key) != names.get(flag)]
    compiles = header.count("squareq compile ")
    if not compiles:
        problems.append(f"{name}: the header shows no `squareq compile` command")
    if header.count(f"-o {config['slab']}") != compiles:
        problems.append(f"{name}: not every compile in the header writes {config['slab']}")
    if "vram_budget" in config and len(re.findall(rf"--vram-budget {re.escape(config['vram_budget'])}(?!\S)",
                                                  header)) != compiles:
        problems.append(f"{name}: not every compile in the header takes --vram-budget {config['vram_budget']}")
    if f"squareq train --config examples/{name}.toml" not in header:
        problems.append(f"{name}: the header does not show `squareq train --config examples/{name}.toml`")
    return problems


def quickstart_compile_problems(text: str) -> list[str]:
    """The quickstart is the 16 GB path: its compiles take the 16 GB config's --vram-budget and write its slab."""
    config = tomllib.loads((ROOT / "examples" / "flux1-dev-16gb.toml").read_text())
    lines = [line for line in section(text, "Quickstart").splitlines() if line.startswith("squareq compile ")]
    want = f"--vram-budget {config['vram_budget']}"
    problems = [f"a quickstart compile lacks {want}: {line[:80]}" for line in lines if f"{want} " not in line]
    problems += [f"a quickstart compile does not write {config['slab']}" for line in lines
                 if not line.rstrip().endswith(f"-o {config['slab']}")]
    return problems if lines else ["the quickstart has no `squareq compile` line"]


def examples() -> list[tuple[str, dict, str]]:
    out = []
    for path in EXAMPLES:
        text = path.read_text()
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        out.append((path.stem, tomllib.loads(text), header))
    return out


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_the_readme_is_short_with_one_small_figures_table(readme):
    assert size_problems(readme) == []
    assert size_problems(readme + "x" * (MAX_CHARS - len(readme) + 1))
    last = [line for line in section(readme, "Current figures").splitlines() if line.startswith("|")][-1]
    doctored = readme.replace(last, "\n".join([last] * (MAX_ROWS + 2 - len(table_rows(readme)))))
    assert any("rows" in p for p in size_problems(doctored))


def test_every_figure_is_a_recorded_run_with_its_device_date_and_commit(readme):
    rows = table_rows(readme)
    assert rows and all(len(cells) == len(rows[0]) for cells in rows)
    assert [p for cells in rows for p in row_problems(cells)] == []
    first = rows[0]
    for doctored in ([*first[:-1], first[-1].replace("2026", "2025")],                          # another date
                     [*first[:-1], re.sub(r"`[0-9a-f]+`", "`0000000`", first[-1])],            # another commit
                     [*first[:-1], "A100" + first[-1][first[-1].index(","):]],                 # another device
                     [first[0], "9.999 s", *first[2:]],                                        # a figure not measured
                     [re.sub(r"#[^)]*", "#no-such-section", first[0]), *first[1:]]):           # a dead link
        assert row_problems(doctored), doctored


def test_make_demo_and_make_test_are_timed_once_at_a_stated_commit(readme):
    assert setup_time_problems(readme) == []
    once = setup_time_problems(readme + "\n\n`make demo` takes 51 s here (2026-11-23, `c9fb21f`).\n")
    assert any("timed 2 times" in p for p in once)
    wrong = re.sub(r"(`make test`[^`\n]{0,20}?)\d+ min", r"\g<1>12 min", readme, count=1)
    assert wrong != readme and any("in no run recorded" in p for p in setup_time_problems(wrong))


def test_the_example_configs_use_the_quickstarts_names_and_compile_commands(readme):
    configs = examples()
    assert {name for name, _, _ in configs} >= {"flux1-dev-8gb", "flux1-dev-16gb", "flux1-dev-24gb"}
    assert [p for name, config, header in configs for p in example_problems(readme, name, config, header)] == []
    assert quickstart_compile_problems(readme) == []
    name, config, header = next(c for c in configs if c[0] == "flux1-dev-16gb")
    assert example_problems(readme.replace("--data my_images", "--data data"), name, config, header)
    assert example_problems(readme, name, {**config, "output": "lora-flux1-16gb"}, header)
    assert example_problems(readme, name, config, header.replace("--vram-budget 15GB", ""))
    assert quickstart_compile_problems(readme.replace("--vram-budget 15GB ", ""))
