"""The documentation is kept true: the code of README.md and docs/*.md runs, and its links resolve.

Every ```python block of those pages is checked, by the line just before it:
- no marker: the page's blocks run in order in one fresh Python process (in a temporary
  directory, this checkout first on the path), sharing one namespace, so a block may use what
  the blocks above it on the same page defined;
- ``<!-- not run: why -->``: compiled, not run (it needs a GPU, a framework the test extra does
  not install, a model or a dataset);
- ``<!-- run: torchrun --nproc-per-node N -->``: a whole script, run alone under torchrun with N
  processes (gloo on the CPU); marked ``dist``.

Also checked: every relative link of the pages (and of the other READMEs) names a file that
exists and, after a ``#``, one of its headings as GitHub spells the anchor; every ```json block
is a config of examples/; the signatures and argument tables of docs/cpu_adam.md and
docs/offload.md are the code's; docs/install.md lists every environment variable the package reads.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from rank_spawn import loopback_interface

import cpu_adam
from cpu_adam import ops

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OTHER_READMES = [ROOT / d / "README.md" for d in ("benchmarks", "csrc", "examples", "tests/kernels")]

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"<!-- not run: (?P<why>\S.*?) -->")
TORCHRUN = re.compile(r"<!-- run: torchrun --nproc-per-node (?P<nproc>[1-9]) -->")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1")

PAGE_TIMEOUT_S = 180
TORCHRUN_TIMEOUT_S = 240


def shown(path: Path) -> str:
    """A path as the messages name it: from the repository's root where it lies inside."""
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of code, 1-based
    language: str
    source: str
    marker: str  # the line before the opening fence, stripped

    @property
    def name(self) -> str:
        return f"{shown(self.page)}:{self.line}"

    @property
    def not_run(self) -> bool:
        return NOT_RUN.fullmatch(self.marker) is not None

    @property
    def nproc(self) -> int:
        match = TORCHRUN.fullmatch(self.marker)
        return int(match["nproc"]) if match else 0

    def padded(self) -> str:
        """The source preceded by blank lines, so that errors name the page's own line numbers."""
        return "\n" * (self.line - 1) + self.source


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        marker = lines[i - 1].strip() if i > 0 else ""
        blocks.append(Block(page, i + 2, language, "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return blocks


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code."""
    out, fence = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def python_blocks(pages: list[Path]) -> list[Block]:
    return [b for page in pages for b in fenced_blocks(page) if b.language == "python"]


def check_markers(blocks: list[Block]) -> None:
    for block in blocks:
        if block.marker.startswith("<!--") and not (block.not_run or block.nproc):
            raise AssertionError(
                f"{block.name}: unknown marker {block.marker!r}; use '<!-- not run: why -->' or "
                "'<!-- run: torchrun --nproc-per-node N -->'"
            )


def run_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    return env


RUNNER = textwrap.dedent(
    """
    import json
    import sys

    namespace = {"__name__": "__main__"}
    for filename, source in json.load(open(sys.argv[1])):
        exec(compile(source, filename, "exec"), namespace)
    """
)


def run_page(blocks: list[Block], workdir: Path) -> subprocess.CompletedProcess[str]:
    """The blocks in order, in one fresh process and namespace, in workdir."""
    (workdir / "blocks.json").write_text(json.dumps([[str(b.page), b.padded()] for b in blocks]))
    return subprocess.run(
        [sys.executable, "-c", RUNNER, "blocks.json"],
        cwd=workdir,
        env=run_environment(),
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )


# Runs a script, then leaves without the interpreter's finalization: under torchrun on gloo, FSDP2
# aborts there now and then ("terminate called without an active exception", with torch's AdamW
# too), after the script's last line. An exception in the script still fails the run.
LAUNCHER = textwrap.dedent(
    """
    import os
    import runpy
    import sys

    runpy.run_path(sys.argv[1], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def run_torchrun(block: Block, workdir: Path) -> subprocess.CompletedProcess[str]:
    script = workdir / f"{block.page.stem}_line{block.line}.py"
    script.write_text(block.padded())
    (workdir / "launch.py").write_text(LAUNCHER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.nproc}"]
    return subprocess.run(
        [*torchrun, "launch.py", script.name],
        cwd=workdir,
        env={**run_environment(), "CUDA_VISIBLE_DEVICES": ""},  # gloo on the CPU: NCCL wants a GPU per rank
        capture_output=True,
        text=True,
        timeout=TORCHRUN_TIMEOUT_S,
    )


def failure(run: subprocess.CompletedProcess[str]) -> str:
    return f"exit {run.returncode}\n{(run.stdout + run.stderr)[-4000:]}"


BLOCKS = python_blocks(PAGES)
PAGES_WITH_RUNS = [p for p in PAGES if any(b.page == p and not b.not_run and not b.nproc for b in BLOCKS)]


def test_markers_are_known_and_the_readme_has_code_that_runs() -> None:
    check_markers(BLOCKS)
    assert ROOT / "README.md" in PAGES_WITH_RUNS


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_compiles(block: Block) -> None:
    compile(block.padded(), str(block.page), "exec")


@pytest.mark.parametrize("page", PAGES_WITH_RUNS, ids=shown)
def test_page_runs(page: Path, tmp_path: Path) -> None:
    blocks = [b for b in BLOCKS if b.page == page and not b.not_run and not b.nproc]
    run = run_page(blocks, tmp_path)
    assert run.returncode == 0, f"{shown(page)}: {failure(run)}"


@pytest.mark.dist
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.nproc], ids=lambda b: b.name)
def test_torchrun_block_runs(block: Block, tmp_path: Path) -> None:
    run = run_torchrun(block, tmp_path)
    assert run.returncode == 0, f"{block.name}: {failure(run)}"


def test_a_broken_block_fails_and_names_its_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```python\nanswer = 42\n```\n\n"
        "<!-- not run: would end the run -->\n```python\nraise SystemExit(3)\n```\n\n"
        "```python\nassert answer == 42  # from the block above\nassert answer == 41\n```\n"
    )
    blocks = python_blocks([page])
    assert [b.not_run for b in blocks] == [False, True, False]
    run = run_page([b for b in blocks if not b.not_run], tmp_path)
    assert run.returncode == 1
    assert f'File "{page}", line 14' in run.stderr and "AssertionError" in run.stderr, run.stderr


@pytest.mark.dist
def test_a_broken_torchrun_block_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: torchrun --nproc-per-node 1 -->\n```python\nimport os\n\nassert os.environ['RANK'] == '1'\n```\n"
    )
    [block] = python_blocks([page])
    run = run_torchrun(block, tmp_path)
    assert run.returncode != 0 and "line 5" in run.stdout + run.stderr, failure(run)


def test_an_unknown_marker_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- notrun: typo -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="unknown marker"):
        check_markers(python_blocks([page]))


# -- links --------------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page):
        heading = HEADING.match(line)
        if heading:
            anchor = github_anchor(heading.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            out.add(anchor if count == 0 else f"{anchor}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(page):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{shown(page)}:{number}: {target}"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{where}: no heading with the anchor #{anchor} in {shown(file)}")
    return broken


def test_github_anchors() -> None:
    assert github_anchor("Offload step (clip + Adam + bf16 weights)") == "offload-step-clip--adam--bf16-weights"
    assert github_anchor("On a GPU: end-to-end (`bench_gpu_offload.py`)") == "on-a-gpu-end-to-end-bench_gpu_offloadpy"
    assert github_anchor("cpu_adam's own build") == "cpu_adams-own-build"


@pytest.mark.parametrize("page", PAGES + OTHER_READMES, ids=shown)
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (with `code`)\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-section-with-code) [also](#page) [web](https://example.com) `[code](x.md)`\n"
        "[missing](nowhere.md) [bad anchor](other.md#not-a-heading) [in code](other.md#not-a-heading-1)\n"
    )
    assert [b.split(": ")[1] for b in broken_links(page)] == [
        "nowhere.md",
        "other.md#not-a-heading",
        "other.md#not-a-heading-1",
    ]


def test_json_blocks_are_example_configs() -> None:
    """Every ```json block of the pages is a whole config that examples/ runs as it is shown (tests/test_deepspeed.py
    builds its engines from these files)."""
    examples = [json.loads(path.read_text()) for path in sorted((ROOT / "examples").glob("*.json"))]
    blocks = [b for page in PAGES + OTHER_READMES for b in fenced_blocks(page) if b.language == "json"]
    assert blocks, "no json block found: the check would pass by finding nothing"
    assert [b.name for b in blocks if json.loads(b.source) not in examples] == []


# -- the reference against the code ---------------------------------------------------------------

SIGNATURES = {
    "docs/cpu_adam.md": {"CPUAdam": cpu_adam.CPUAdam.__init__, "cpu_adam.ops.adam_step": ops.adam_step},
    "docs/offload.md": {"OffloadOptimizer": cpu_adam.OffloadOptimizer.__init__},
}


def parameters(function) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]


def documented_signature(page: Path, name: str) -> list[inspect.Parameter]:
    """The plain fenced block that reads ``name(...)``, as the parameters of a def."""
    for block in fenced_blocks(page):
        text = block.source.strip()
        if not block.language and text.startswith(f"{name}(") and text.endswith(")"):
            namespace: dict = {"torch": torch}
            exec(f"def documented{text[len(name) :]}: pass", namespace)
            return parameters(namespace["documented"])
    raise AssertionError(f"{page.name}: no block with the signature of {name}")


@pytest.mark.parametrize(
    ("page", "name"), [(page, name) for page, names in SIGNATURES.items() for name in names], ids=str
)
def test_documented_signatures_are_the_code(page: str, name: str) -> None:
    actual = [(p.name, p.kind, p.default) for p in parameters(SIGNATURES[page][name])]
    documented = [(p.name, p.kind, p.default) for p in documented_signature(ROOT / page, name)]
    assert documented == actual


def argument_table(page: Path) -> list[tuple[str, str]]:
    """(argument, default) of each row of the table headed '| argument | default | ...'."""
    rows, inside = [], False
    for _, line in prose_lines(page):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:2] == ["argument", "default"]:
            inside = True
        elif inside and not cells:
            break
        elif inside and not set(cells[0]) <= set("-: "):
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


@pytest.mark.parametrize(
    ("page", "function"),
    [("docs/cpu_adam.md", cpu_adam.CPUAdam.__init__), ("docs/offload.md", cpu_adam.OffloadOptimizer.__init__)],
    ids=["CPUAdam", "OffloadOptimizer"],
)
def test_argument_tables_list_every_argument_and_its_default(page: str, function) -> None:
    table = argument_table(ROOT / page)
    assert [name for name, _ in table] == [p.name for p in parameters(function)]
    for (name, default), p in zip(table, parameters(function)):
        expected = "required" if p.default is inspect.Parameter.empty else p.default
        documented = default if default == "required" else eval(default.strip("`"), {"torch": torch})
        assert documented == expected, f"{page}: {name} defaults to {expected!r}, documented {default}"


def variables_read() -> set[str]:
    python = re.compile(r"os\.environ(?:\.get\(|\[)\s*[\"']([A-Z][A-Z0-9_]*)[\"']")
    native = re.compile(r"getenv\(\s*\"([A-Z][A-Z0-9_]*)\"")
    found = set()
    for path in [ROOT / "setup.py", *(ROOT / "cpu_adam").rglob("*.py")]:
        found |= set(python.findall(path.read_text()))
    for path in [*(ROOT / "csrc").rglob("*.cpp"), *(ROOT / "csrc").rglob("*.h")]:
        found |= set(native.findall(path.read_text()))
    return found


def test_every_environment_variable_read_is_documented() -> None:
    documented = set()
    for _, line in prose_lines(ROOT / "docs" / "install.md"):
        cell = re.match(r"^\| `([A-Z][A-Z0-9_]*)(?:=[^`]*)?` \|", line)
        if cell:
            documented.add(cell.group(1))
    read = variables_read()
    assert {"CPU_ADAM_ISA", "CPU_ADAM_CACHE_DIR", "CPU_ADAM_BUILD"} <= read
    assert read - documented == set()
