"""The command line starts at once: ``import torchplace``, ``torchplace --help``, an argument
error and ``torchplace inspect FILE.safetensors`` import no torch (it takes seconds)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import torchplace
from torchplace.cli import _main as cli

safetensors_torch = pytest.importorskip("safetensors.torch")


def _run(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; its stdout's lines."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    return done.stdout.splitlines()


def _cli_then_modules(argv: list[str]) -> str:
    """Code that runs ``torchplace ARGV`` and then prints, last, which heavy modules it
    imported."""
    return (
        "import contextlib, io, sys\n"
        "from torchplace.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "    try:\n"
        f"        status = main({argv!r})\n"
        "    except SystemExit as exc:\n"
        "        status = exc.code\n"
        "print(out.getvalue())\n"
        "print(status, sorted(m for m in ('torch', 'rich') if m in sys.modules))\n"
    )


@pytest.mark.slow
def test_import_torchplace_imports_no_torch() -> None:
    assert _run("import sys, torchplace; print('torch' in sys.modules)") == ["False"]
    # a public name is torch's the first time it is used, and says it is torchplace's
    assert _run(
        "import sys, torchplace; f = torchplace.load; print('torch' in sys.modules, f.__module__)"
    ) == ["True torchplace"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["--help"], 0),
        ([], 2),
        (["inspect"], 2),  # missing FILE: an argument error
        (["no-such-command"], 2),
        (["inspect", "--help"], 0),
        (["remap", "--help"], 0),
        (["inspect", "--bogus", "x"], 2),
        (["inspcet", "x"], 2),
    ],
    ids=[
        "help",
        "nothing",
        "inspect-no-file",
        "unknown",
        "inspect-help",
        "remap-help",
        "inspect-bad-option",
        "misspelt-command",
    ],
)
def test_help_and_argument_errors_import_no_torch(argv: list[str], status: int) -> None:
    lines = _run(_cli_then_modules(argv))
    assert lines[-1] == f"{status} []"
    if argv == ["--help"]:
        text = "\n".join(lines)
        for command in ("doctor", "inspect", "remap", "estimate", "bench"):
            assert command in text


@pytest.mark.slow
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_inspect_of_a_safetensors_file_imports_no_torch(tmp_path: Path, as_json: bool) -> None:
    import torch

    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2, 3), "b": torch.zeros(3)}, path)
    argv = ["inspect", str(path), *(["--json"] if as_json else [])]
    lines = _run(_cli_then_modules(argv))
    assert lines[-1] == ("0 []" if as_json else "0 ['rich']")  # rich only to draw the table
    text = "\n".join(lines[:-1])
    if as_json:
        report = json.loads(text)
        assert {t["name"]: t["shape"] for t in report["tensors"]} == {"w": [2, 3], "b": [3]}
    else:
        assert "[2, 3]" in text and "float32" in text


def test_help_lines_are_the_ones_the_commands_register() -> None:
    """``--help`` lists each command by the line in cli.py, without importing its module."""

    def help_lines(parser: argparse.ArgumentParser) -> dict[str, str | None]:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return {a.dest: a.help for a in action._choices_actions}

    registered = help_lines(cli._parser(None))
    assert registered == help_lines(cli._parser(""))
    assert list(registered) == ["doctor", "inspect", "remap", "convert", "estimate", "bench"]


def test_the_lazy_names_are_the_public_names() -> None:
    """``__init__``'s table of homes says what its TYPE_CHECKING imports (what mypy sees) say."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(torchplace))
    (checking,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_TYPE_CHECKING"
    ]
    seen = {
        alias.name: node.module
        for node in checking.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert seen == torchplace._HOMES
    eager = set(torchplace._errors.__all__)  # the exception tree and Straggler: no torch
    assert set(torchplace._HOMES) | eager == set(torchplace.__all__)
    assert set(torchplace.__all__) <= set(dir(torchplace))
    assert "distributed" in dir(torchplace)
    with pytest.raises(AttributeError, match="no attribute 'lod'"):
        torchplace.lod  # noqa: B018


@pytest.mark.parametrize(
    ("argv", "command", "said"),
    [
        (["inspect", "--bogus", "x"], "inspect", "unrecognized arguments: --bogus"),
        (["remap", "--bogus"], "remap", "unrecognized arguments: --bogus"),  # not "required"
        (["remap", "a.pt", "--to", "cpu", "-o", "b.pt", "--bogus"], "remap", "arguments: --bogus"),
        (["remap", "a.pt", "--t", "cpu", "-ob.pt", "--", "-x"], "remap", "-x"),
        (["bench", "--bogus"], "bench", "unrecognized arguments: --bogus"),
        (["doctor", "--bogus"], "doctor", "unrecognized arguments: --bogus"),
        (["doctor", "extra"], "doctor", "unrecognized arguments: extra"),
        (["bench", "--devcie", "cpu"], "bench", "--devcie; did you mean '--device'?"),
        (["bench", "--devcie=cpu"], "bench", "--devcie=cpu; did you mean '--device'?"),
        (["doctor", "--jsno"], "doctor", "--jsno; did you mean '--json'?"),
        (
            ["inspect", "--version"],
            "inspect",
            "an option of torchplace itself: torchplace --version",
        ),
    ],
    ids=[
        "inspect-bogus",
        "remap-bogus-alone",
        "remap-bogus-last",
        "remap-after-dashes",
        "bench-bogus",
        "doctor-bogus",
        "doctor-extra-word",
        "bench-devcie",
        "bench-devcie-equals",
        "doctor-jsno",
        "inspect-version",
    ],
)
def test_a_commands_bad_option_gets_that_commands_usage(
    argv: list[str], command: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: torchplace {command} [-h]")  # the command's, not the top's
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"torchplace {command}: error: ") and last.endswith(said)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["inspcet", "x.pt"],
            "argument COMMAND: invalid choice: 'inspcet'; did you mean 'inspect'? choose from",
        ),
        (
            ["doctro"],
            "argument COMMAND: invalid choice: 'doctro'; did you mean 'doctor'? choose from",
        ),
        (
            ["no-such-command"],
            "argument COMMAND: invalid choice: 'no-such-command'; choose from doctor, inspect",
        ),
        (["--verison"], "unrecognized arguments: --verison; did you mean '--version'?"),
        (["--bogus", "doctor"], "unrecognized arguments: --bogus"),  # before the command
    ],
    ids=["inspcet", "doctro", "unknown", "verison", "before-command"],
)
def test_a_misspelt_command_or_top_option_gets_the_top_usage(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: torchplace [-h] [--version] COMMAND")
    assert err.strip().splitlines()[-1].startswith(f"torchplace: error: {said}")


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_plain_load_imports_only_its_own_path(tmp_path: Path, suffix: str) -> None:
    # a first load in a fresh process pays its imports: what a device map, a sharded model or
    # the CRC check alone needs is imported when one is there (the import figure: RESULTS.md);
    # a zip .pt records CRC-32s, checked by default with ISA-L's where it is installed
    path = tmp_path / f"m{suffix}"
    fill = f"torchplace.load_into(torchplace.skeleton(torch.nn.Linear, 4, 4), {str(path)!r})"
    isal = ", 'isal'" if suffix == ".safetensors" else ""
    code = (
        "import sys, torch, torchplace\n"
        "layer = torch.nn.Linear(4, 4)\n"
        + (
            "from safetensors.torch import save_file\n"
            f"save_file(layer.state_dict(), {str(path)!r})\n"
            if suffix == ".safetensors"
            else f"torch.save(layer.state_dict(), {str(path)!r})\n"
        )
        + f"model = {fill}\n"
        "print(torch.equal(model.weight, layer.weight))\n"
        "heavy = ('torchplace.spreading._dispatch', 'torchplace.spreading._offload',\n"
        "         'torchplace.checkpoint._disk_weights', 'torchplace.checkpoint._sharded',\n"
        f"         'torchplace.checkpoint._rendezvous'{isal})\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert _run(code) == ["True", "[]"]


@pytest.mark.slow
def test_collecting_the_inner_loop_imports_nothing_heavy(tmp_path: Path) -> None:
    """``pytest -m "not slow" --collect-only`` imports neither torch._dynamo (1.9 s: doctest
    collection imported every module of the package, ``_dynamo_compat`` among them, and
    test_compile called torch.compile at import) nor transformers' conversion mapping (0.7 s).
    The tests import those when they run."""
    root = Path(__file__).resolve().parent.parent
    found = tmp_path / "modules.json"
    script = (
        "import json, sys, pytest\n"
        "code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'not slow'])\n"
        f"open({str(found)!r}, 'w').write(json.dumps([int(code), sorted(sys.modules)]))\n"
    )
    subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, timeout=600, check=True
    )
    code, modules = json.loads(found.read_text())
    assert code == 0
    heavy = {"torch._dynamo", "torch._inductor", "transformers.conversion_mapping"}
    assert heavy.isdisjoint(modules), heavy & set(modules)


@pytest.mark.slow
def test_every_public_names_example_is_collected() -> None:
    """Each public name whose docstring has a ``>>>`` example is a doctest of the suite: found
    through ``torchplace/__init__.py`` (their ``__module__`` is ``torchplace``), which the
    collection of modules without doctests must not skip."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "src"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    collected = {line.rsplit(".", 1)[-1] for line in done.stdout.splitlines() if "::" in line}
    documented = [
        name for name in torchplace.__all__ if ">>>" in (getattr(torchplace, name).__doc__ or "")
    ]
    assert {"load", "estimate", "TorchplaceError"} <= set(documented)
    assert set(documented) <= collected, set(documented) - collected
