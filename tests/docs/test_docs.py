"""The README, AGENTS.md and the docs/ pages, as written: the README's commands, its six tasks and its Python
example run (the example through the public API of `hops_calib/__init__.py`); every `bash` block of a docs/ page
runs in a copy of the checkout unless it says `# needs ../shared`; every `text` block's verbs and options exist in
the CLI; the CLI reference page is the one the typer app generates; every relative link resolves."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
NEEDS_SHARED = "# needs ../shared"
PUBLIC = ["open_store", "build_spec", "load_model", "predict", "simulate", "predict_job", "plan_job", "evaluate"]


def blocks(path: Path, language: str) -> list[str]:
    """The fenced blocks of `language` in a Markdown file, in order."""
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)


def commands(block: str) -> list[str]:
    """The commands of a block: continuation lines (indented) joined, comments and `&&` chains split off."""
    joined: list[str] = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code = re.split(r"\s#", line, maxsplit=1)[0].rstrip()
        if line[:1].isspace() and joined:
            joined[-1] += " " + code.strip()
        else:
            joined.append(code.strip())
    return [part.strip() for command in joined for part in command.split("&&") if part.strip()]


def cli_tree():
    import typer.main

    from hops_calib.cli import app

    return typer.main.get_command(app)


def check_usage(command: str, root) -> list[str]:
    """What a `hops-calib ...` command names that the CLI lacks: a verb, or an option of the verb it names."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    assert tokens[0] == "hops-calib", command
    parent, node, i = None, root, 1
    while i < len(tokens) and tokens[i] in getattr(node, "commands", {}):
        parent, node, i = node, node.commands[tokens[i]], i + 1
    from hops_calib.cli.verbs import LEGACY

    if LEGACY in getattr(node, "commands", {}) and (i >= len(tokens) or tokens[i] not in node.commands):
        parent, node = node, node.commands[LEGACY]  # the old spelling of a verb split into sub-verbs (`plan --job`)
    if getattr(node, "commands", None) or (i < len(tokens) and tokens[i] == "|"):
        # alternatives: `ledger show | verify | export OUT` (siblings of the verb named first)
        group, first = (node, i) if getattr(node, "commands", None) else (parent, i - 1)
        names = [tokens[first]] + [tokens[k + 1] for k in range(first, len(tokens) - 1) if tokens[k] == "|"]
        missing = [name for name in names if name not in group.commands]
        if missing:
            return [f"{command}: no verb {missing}"]
        verbs = [group.commands[name] for name in names]
        i = first + 2 * len(names) - 1
    else:
        verbs = [node]
    known = {opt for verb in verbs for param in verb.params for opt in (*param.opts, *param.secondary_opts)}
    named = {match for token in tokens[i:] for match in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", token)}
    return [f"{command}: no option {name}" for name in sorted(named - known)]


def checkout_copy(root: Path) -> Path:
    """A checkout as the tool recognises one, with copies of the shipped store, traces, experiments and ledger (the
    code stays where it is: PYTHONPATH)."""
    root.mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for folder in ("fixtures", "traces", "experiments", "ledger"):
        shutil.copytree(REPO / folder, root / folder)
    models = root / "hops_calib" / "model" / "models"
    models.mkdir(parents=True)
    shutil.copy(REPO / "hops_calib" / "model" / "models" / "baseline.toml", models / "baseline.toml")
    return root


def run_block(block: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A bash block run as written from the root of a checkout copy, `hops-calib` being this checkout's, and
    /tmp/ inside the test's own folder."""
    root = checkout_copy(tmp_path / "checkout")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "hops-calib"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hops_calib "$@"\n')
    shim.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "HOPS_CALIB_PROGRESS": "lines"}
    for name in ("HOPS_CALIB_FIXTURES", "HOPS_CALIB_CLUSTER"):
        env.pop(name, None)
    script = block.replace("/tmp/", f"{tmp_path / 'tmp'}/")
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900, check=False)


def runnable_blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for k, block in enumerate(blocks(page, "bash")):
            if not block.startswith(NEEDS_SHARED):
                found.append((page.name, k, block))
    return found


def test_readme_and_agents_are_short_and_every_page_says_what_it_is_for():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    agents = (REPO / "AGENTS.md").read_text()
    assert len(agents.splitlines()) <= 100 and "docs/loop.md" in agents
    assert {p.name for p in PAGES} >= {"ingest.md", "simulator.md", "whatif.md", "loop.md", "research.md",
                                      "captures.md", "results.md", "cli.md"}
    for page in PAGES:
        first = page.read_text().split("\n\n")[1]
        assert first.startswith("What it is for:"), page.name


def test_every_relative_link_resolves():
    for path in [REPO / "README.md", REPO / "AGENTS.md", *PAGES]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), (path.name, target)


def test_the_cli_reference_page_is_the_generated_one():
    from hops_calib.cli.reference import reference

    page = (DOCS / "cli.md").read_text()
    assert page == reference(), "docs/cli.md is stale: python -m hops_calib.cli.reference > docs/cli.md"
    root = cli_tree()
    for name, verb in root.commands.items():  # every verb has its section
        assert f"## `hops-calib {name}`" in page
        for sub, command in getattr(verb, "commands", {}).items():
            # a hidden sub-verb is an old spelling (`plan --job DIR`), documented under its group
            assert (f"## `hops-calib {name} {sub}`" in page) != command.hidden


def test_every_command_a_page_names_exists_in_the_cli():
    """Usage blocks (`text`), blocks that need ../shared, and the runnable ones: each verb and option is the CLI's."""
    root = cli_tree()
    problems, checked = [], 0
    for path in [REPO / "README.md", REPO / "AGENTS.md", *[p for p in PAGES if p.name != "cli.md"]]:
        for language in ("text", "bash"):
            for block in blocks(path, language):
                for command in commands(block):
                    if command.startswith("hops-calib"):
                        problems += [f"{path.name}: {p}" for p in check_usage(command, root)]
                        checked += 1
    assert checked > 60 and problems == []


def test_the_usage_check_finds_a_misspelt_option_and_verb():
    root = cli_tree()
    assert check_usage("hops-calib evaluate --fixtures DIR [--jsn]", root) == [
        "hops-calib evaluate --fixtures DIR [--jsn]: no option --jsn"]
    assert check_usage("hops-calib ledger show | verfy", root)[0].endswith("no verb ['verfy']")
    assert check_usage("hops-calib capture --no-link-bench --out X", root) == []


def test_no_runnable_docs_block_installs_anything():
    """A runnable block runs in the test's own environment (the one README's first command makes): a `pip install`
    there would re-point that environment's editable install at the block's temporary checkout. Installs go in
    `text` blocks or behind the needs-shared mark."""
    installing = [(page, k) for page, k, block in runnable_blocks()
                  if any(word in block for word in ("pip install", "pip3 install", "apt-get install"))]
    assert not installing, f"runnable docs blocks that install: {installing}; make them text blocks"


@pytest.mark.parametrize("page,index,block", [
    pytest.param(*b, id=f"{b[0]}-{b[1]}", marks=[pytest.mark.capture] if "hops-calib capture" in b[2] else [])
    for b in runnable_blocks()])
def test_a_docs_pages_bash_block_runs_as_written(page, index, block, tmp_path):
    if "hops-calib capture" in block:
        pytest.importorskip("torch", reason="the [capture] extra (torch) is not installed")
        pytest.importorskip("megatron.core", reason="the [capture] extra (megatron-core) is not installed")
    done = run_block(block, tmp_path)
    assert done.returncode == 0, (page, block, done.stdout[-2000:], done.stderr[-2000:])
    if page == "simulator.md":  # what the page says it prints
        assert "chosen: 1f1b (utilization 0.901)" in done.stdout and "0.533" in done.stdout
    if page == "captures.md":
        # the page's own capture besides every shipped one: one fixture more than traces/ holds runs
        shipped = [d for d in (REPO / "traces").iterdir() if (d / "manifest.yaml").is_file()]
        assert "cpu_1f1b_l2_h128_s64_m2_run1" in done.stdout and f"{len(shipped) + 1} fixtures" in done.stdout


def test_every_docs_bash_block_runs_or_needs_shared():
    """The blocks the test above does not run are the ones that read ../shared, and they say so."""
    skipped = [(page.name, block) for page in PAGES for block in blocks(page, "bash") if block.startswith(NEEDS_SHARED)]
    for name, block in skipped:
        assert "../shared" in block, (name, block)
    assert len(runnable_blocks()) >= 7


def test_the_readmes_commands_and_tasks_run(tmp_path):
    """README's first command (less the install: this environment is the one it makes) and its six tasks, in a copy
    of the checkout; its second command is the one CI runs."""
    install, tasks = blocks(REPO / "README.md", "bash")[:2]
    first = next(line for line in install.splitlines() if line.startswith("python3 -m venv"))
    assert first.startswith('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && ')
    job = first.split('pip install -e ".[test]" && ', 1)[1]
    assert job == "hops-calib ingest traces --fixtures fixtures && hops-calib evaluate --fixtures fixtures"
    assert commands(install)[-1] == "python -m pytest -q"
    assert (REPO / ".ci" / "run").read_text().rstrip().splitlines()[-1] == "python -m pytest -q"
    done = run_block(job + "\n" + tasks, tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "throughput MAPE" in done.stdout and (tmp_path / "checkout" / "timeline.png").stat().st_size > 10_000
    assert [c.split()[1] for c in commands(tasks)] == ["ingest", "evaluate", "observe", "predict", "plan", "plot"]


def test_import_hops_calib_is_light_and_its_public_names_resolve():
    probe = ("import sys, hops_calib; heavy = sorted({m.split('.')[0] for m in sys.modules} & "
             "{'numpy', 'pandas', 'pyarrow', 'scipy', 'typer', 'torch'}); print(heavy)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    import hops_calib
    from hops_calib.loop.evaluate import evaluate
    from hops_calib.whatif.job import what_if

    assert set(hops_calib.__all__) - {"__version__"} == set(PUBLIC) == set(hops_calib._PUBLIC)
    assert all(callable(getattr(hops_calib, name)) and name in dir(hops_calib) for name in PUBLIC)
    assert hops_calib.predict_job is what_if and hops_calib.evaluate is evaluate
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        hops_calib.nonesuch  # noqa: B018


def test_the_readmes_python_example_runs_on_the_shipped_store():
    """The example as written, from the repository root; what it prints agrees with the CLI on the same store."""
    [example] = blocks(REPO / "README.md", "python")
    assert len([line for line in example.splitlines() if line.strip()]) <= 11
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    predicted, measured = map(float, lines[0].split())
    assert float(lines[1]) > 0 and lines[2].startswith("2 ['1f1b', 'zb_h1']") and float(lines[3]) > 0
    cli = subprocess.run([sys.executable, "-m", "hops_calib", "evaluate", "--fixtures", "fixtures", "--json"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=600, check=False)
    assert float(lines[4]) == pytest.approx(json.loads(cli.stdout)["throughput_mape_pct"])
    real = subprocess.run([sys.executable, "-m", "hops_calib", "predict", "cpu_1f1b_l4_h512_s256_m4_run1",
                           "--fixtures", "fixtures", "--json"], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600, check=False)
    assert real.returncode == 0, real.stderr
    out = json.loads(real.stdout)
    assert (predicted, measured) == pytest.approx((out["predicted"]["throughput_per_s"], out["real"]["throughput_per_s"]))
