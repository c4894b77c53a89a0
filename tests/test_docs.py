"""The documentation's own rules, beside the run of its code blocks (``conftest.py`` at the root
hands every ``python`` block of README.md and docs/*.md to Sybil).

Sybil runs blocks tagged exactly ``python``: a block tagged ``py`` or left untagged would be
skipped without a word, so every fence must carry a tag from a known list."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers import fsdp2_cannot_train_on_cpu, torchrun_two_cpu

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```([^\n]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
# python runs; the others never do: shell commands, terminal sessions, program output
TAGS = {"python", "sh", "bash", "console", "text"}
SKIP = re.compile(r"<!-- skip: next (.*?)-->\s*\n[ \t]*```python")


def fences(page: Path) -> list[tuple[int, str, str]]:
    """(line, tag, code) of each fenced block of a page."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2).strip(), m.group(3))
        for m in FENCE.finditer(text)
    ]


def ids(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_the_pages_are_found() -> None:
    assert {ids(p) for p in PAGES} >= {"README.md", "docs/design.md", "docs/coming-from.md"}
    assert any(tag == "python" for _, tag, _ in fences(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_every_block_says_whether_it_runs(page: Path) -> None:
    wrong = [f"line {line}: {tag or 'no tag'}" for line, tag, _ in fences(page) if tag not in TAGS]
    assert not wrong, f"tag these blocks with one of {sorted(TAGS)}: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_skips_are_rare_and_say_why(page: Path) -> None:
    reasons = SKIP.findall(page.read_text())
    assert all(re.fullmatch(r'\s*"[^"]{10,}"\s*', r) for r in reasons), reasons
    assert len(reasons) <= 1, f"{len(reasons)} skipped blocks: make them run"
    directives = re.findall(r"^[ \t]*<!-- skip:", page.read_text(), flags=re.M)
    assert len(directives) == len(reasons), "only 'skip: next', on the line before a block"


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_blocks_name_no_accelerator_literally(page: Path) -> None:
    """A block that moves to "cuda" fails on a laptop; torchplace.device() runs everywhere.
    Naming one is fine: a budget for plan (a key) or an assert that checks a map."""
    found = []
    for line, tag, code in fences(page):
        if tag != "python":
            continue
        code = re.sub(r"\.type\s*[!=]=\s*[\"']\w+[\"']", "", code)  # asking is fine
        # naming a device without using it is fine too: a budget's key for plan, a check
        code = re.sub(r"f?[\"'][^\"'\n]*[\"']\s*:", "", code)
        code = re.sub(r"^[ \t]*assert\b.*$", "", code, flags=re.M)
        found += [
            f"line {line}: {m}" for m in re.findall(r"[\"'](?:cuda|mps|xpu)\b[^\"']*[\"']", code)
        ]
    assert not found, f"use torchplace.device() instead: {found}"


def test_the_readme_blocks_run_in_the_venv_of_its_set_up_command() -> None:
    """The README's first set-up command installs torch, numpy and torchplace alone: its
    Checkpoints block imported safetensors.torch, which that venv lacks (torchplace.save writes
    a .safetensors file without it)."""
    allowed = {"torch", "numpy", "torchplace", *sys.stdlib_module_names}
    found = []
    for line, tag, code in fences(ROOT / "README.md"):
        if tag != "python":
            continue
        for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", code, flags=re.M):
            if name not in allowed:
                found.append(f"line {line}: {name}")
    assert not found, f"README blocks import what its set-up does not install: {found}"


@pytest.mark.slow
def test_the_readme_training_script_trains_under_torchrun(tmp_path: Path) -> None:
    """The README's torchrun script, which Sybil skips, run as written on two CPU processes."""
    found = re.search(
        r'<!-- skip: next "a torchrun script[^\n]*\n```python\n(.*?)^```',
        (ROOT / "README.md").read_text(),
        flags=re.S | re.M,
    )
    assert found, "README.md's torchrun script (after its skip marker) is gone"
    script = tmp_path / "train.py"
    script.write_text(
        found.group(1)
        + "\nimport os\nprint(f\"rank {os.environ['RANK']} trained\", flush=True)\n"
        # Gloo's threads sometimes abort a finished process at interpreter exit on a loaded host.
        + "os._exit(0)\n"
    )
    out = torchrun_two_cpu(script)
    assert "rank 0 trained" in out and "rank 1 trained" in out


# docs/distributed.md's scripts meant for torchrun: the DDP one, which Sybil skips, and the FSDP2
# one, which Sybil runs as a group of one (setup(single_process=True)) and which is run here on two
# ranks, where each rank reads only its own shards.
DISTRIBUTED_SCRIPTS = {
    "train.py": r'<!-- skip: next "a torchrun script[^\n]*\n```python\n(# train\.py\n.*?)^```',
    "finetune.py": r"^```python\n(# finetune\.py .*?)^```",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DISTRIBUTED_SCRIPTS))
def test_the_distributed_page_scripts_run_under_torchrun(tmp_path: Path, name: str) -> None:
    """docs/distributed.md's torchrun scripts, run as written on two CPU processes."""
    why = fsdp2_cannot_train_on_cpu() if name == "finetune.py" else None
    if why:
        pytest.skip(why)
    found = re.search(
        DISTRIBUTED_SCRIPTS[name], (ROOT / "docs" / "distributed.md").read_text(), flags=re.S | re.M
    )
    assert found, f"docs/distributed.md's {name} is gone"
    script = tmp_path / name
    script.write_text(
        found.group(1)
        + "\nimport os\nprint(f\"rank {os.environ['RANK']} done\", flush=True)\n"
        # Gloo's threads sometimes abort a finished process at interpreter exit on a loaded host.
        + "os._exit(0)\n"
    )
    out = torchrun_two_cpu(script)
    assert "rank 0 done" in out and "rank 1 done" in out
    if name == "train.py":
        assert (tmp_path / "model.pt").is_file()
    else:
        assert (tmp_path / "finetuned.safetensors").is_file()
