"""The README and docs/ match what runs.

Every ``python`` code block in them is either a whole program, run here as written (on the CPU;
the torch ones skip without torch), or marked ``python fragment`` and labelled as an excerpt in
its first line. Links between the pages resolve, the README has none that a package index would
break, and the user guide's sample report and exit-status table are what the command does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helix_kv import cli
from helix_kv.simulate import command

from .helpers.scheduler import needs_scheduler

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FRAGMENT_LABEL = "# Fragment:"


def code_blocks(info: str) -> list[tuple[str, int, str]]:
    """``(page, line, code)`` of every fenced block whose info string is ``info``."""
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group(1).strip() == info:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((str(page.relative_to(ROOT)), line, match.group(2)))
    return blocks


PROGRAMS = code_blocks("python")
FRAGMENTS = code_blocks("python fragment")


def test_every_python_block_is_a_program_or_a_labelled_fragment() -> None:
    infos = set()
    for page in PAGES:
        for match in FENCE.finditer(page.read_text(encoding="utf-8")):
            infos.add(match.group(1).strip())
    python_infos = {info for info in infos if info.split()[:1] == ["python"]}
    assert python_infos <= {"python", "python fragment"}, python_infos
    assert len(PROGRAMS) >= 5
    for page, line, code in FRAGMENTS:
        assert code.startswith(FRAGMENT_LABEL), f"{page}:{line} is not labelled as a fragment"


@pytest.mark.parametrize(
    ("page", "line", "code"), PROGRAMS, ids=[f"{page}:{line}" for page, line, _ in PROGRAMS]
)
@needs_scheduler
def test_python_block_runs_as_written(page: str, line: int, code: str, tmp_path: Path) -> None:
    if re.search(r"^import torch|^from helix_kv\.(executor|distributed)", code, re.MULTILINE):
        pytest.importorskip("torch")
    if "prometheus_client" in code:
        pytest.importorskip("prometheus_client")  # the metrics extra (in the test extra too)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # a block may write files (a trace, a plot)
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{page}:{line}\n{done.stderr}"


@needs_scheduler
def test_the_readme_example_without_torch_runs_where_torch_cannot_be_imported(
    tmp_path: Path,
) -> None:
    """The README's torch-free example (``import helix_kv`` never imports torch): it runs with
    every import of torch made to fail, and finishes its request."""
    (code,) = [
        code
        for page, _, code in PROGRAMS
        if page == "README.md" and not re.search(r"^(import|from) (torch|helix_kv\.)", code, re.M)
    ]
    assert "helix_kv.Scheduler(" in code
    no_torch = "import sys\nsys.modules['torch'] = None  # an import of torch raises\n"
    done = subprocess.run(
        [sys.executable, "-c", no_torch + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "finish_reason='length'" in done.stdout


def test_the_engine_loop_uses_no_placeholder_names() -> None:
    """The README's and executor.md's loop is a whole program; the names an engine supplies
    appear only in labelled fragments."""
    loops = [code for page, _, code in PROGRAMS if "HelixKVRank.create" in code]
    assert {page for page, _, code in PROGRAMS if "HelixKVRank.create" in code} == {
        "README.md",
        "docs/executor.md",
        "docs/kv-memory-pressure.md",  # the Prometheus example
    }
    for code in loops:
        for name in ("free_kv_bytes", "make_kv_pool", "run_model"):
            assert name not in code
    for page, _, code in FRAGMENTS:
        for name in ("free_kv_bytes", "make_kv_pool", "run_model", "arrivals"):
            if name in code:
                assert name in code.splitlines()[0], f"{page}: {name} is not named in the label"


def test_readme_has_no_link_a_package_index_would_break() -> None:
    """The README is the package's description on the index, where a relative link points
    nowhere: it names the docs by path instead."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in LINK.findall(readme):
        assert target.startswith("https://"), target


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_links_between_the_docs_resolve() -> None:
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith("https://"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.is_file(), f"{page.relative_to(ROOT)}: {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{page.relative_to(ROOT)}: {target}"


@needs_scheduler
def test_user_guide_sample_report_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    first_run = guide[guide.index("## First run") :]
    sample = next(m.group(2) for m in FENCE.finditer(first_run) if m.group(1).strip() == "text")
    assert cli.main(["simulate"]) == 0
    assert capsys.readouterr().out == sample


def test_user_guide_lists_every_exit_status() -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    table = guide[guide.index("## Exit status and scripting") :]
    listed = {int(status) for status in re.findall(r"^\| `(\d+)` \|", table, re.MULTILINE)}
    assert listed == {
        command.EXIT_OK,
        command.EXIT_RUN_FAILED,
        command.EXIT_USAGE,
        command.EXIT_INTERRUPTED,
        cli.EXIT_BROKEN_PIPE,
    }


def test_gpu_figures_live_in_one_stamped_place() -> None:
    results = (ROOT / "docs" / "gpu-results.md").read_text(encoding="utf-8")
    # One table of what holds now: every row of a table with commit and machine columns
    # names both (a commit hash, a GPU machine).
    stamped = 0
    for table in re.findall(r"(?:^\|.*\|\n)+", results, re.MULTILINE):
        header, _rule, *rows = [
            [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            for line in table.splitlines()
        ]
        if "commit" not in header or "machine" not in header:
            continue
        commit, machine = header.index("commit"), header.index("machine")
        for row in rows:
            assert re.fullmatch(r"`[0-9a-f]{7,40}`( / `[0-9a-f]{7,40}`)*", row[commit]), row
            assert re.search(r"H\d00|GPU", row[machine]), row
            stamped += 1
    assert stamped >= 10, "the current figures, each with its commit and machine"
    for page in PAGES:
        if page.name == "gpu-results.md":
            continue
        text = page.read_text(encoding="utf-8")
        # a throughput or per-step time measured on a GPU is quoted only in gpu-results.md
        for figure in (r"\d[\d.]*k? (decode )?tokens/s", r"\d+ ?us/step", r"\d+ MiB"):
            assert not re.search(figure, text), f"{page.name}: {figure}"
