"""The public surface is itself under test: names, examples, and no side effects on import."""

from __future__ import annotations

import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchplace

# The names docs/design.md documents and this release implements.
DOCUMENTED = {
    # devices
    "device",
    "available",
    # looking
    "devices_of",
    "where",
    "stragglers",
    "Straggler",
    "verify",
    "report",
    "Report",
    # moving and the data path
    "move",
    "DeviceLoader",
    # guard
    "guard",
    "Guard",
    # watching a step
    "watch",
    # checkpoints
    "load",
    "skeleton",
    "load_into",
    "save",
    "Saving",
    # several devices
    "plan",
    "dispatch",
    "estimate",
    "Estimate",
    # errors
    "TorchplaceError",
    "DeviceSpecError",
    "DeviceUnavailableError",
    "MixedDevicesError",
    "NoTensorsError",
    "PlacementError",
    "DeviceMismatchError",
    "MoveError",
    "CheckpointError",
}


def test_all_is_exactly_the_documented_names() -> None:
    assert set(torchplace.__all__) == DOCUMENTED
    assert len(torchplace.__all__) == len(set(torchplace.__all__))


def test_public_objects_say_they_are_torchplaces() -> None:
    for name in torchplace.__all__:
        assert getattr(torchplace, name).__module__ == "torchplace", name


def test_every_public_callable_opens_with_an_example() -> None:
    for name in torchplace.__all__:
        obj = getattr(torchplace, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            continue
        doc = inspect.getdoc(obj) or ""
        assert ">>>" in doc, f"torchplace.{name} has no >>> example"


def test_exception_tree() -> None:
    for name in DOCUMENTED:
        obj = getattr(torchplace, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, torchplace.TorchplaceError)
    assert issubclass(torchplace.TorchplaceError, RuntimeError)
    assert issubclass(torchplace.DeviceSpecError, ValueError)


@pytest.mark.slow
def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, torchplace; "
        "heavy = [m for m in ('rich', 'safetensors', 'torch.distributed.run', 'accelerate') "
        "if m in sys.modules]; "
        "print(heavy); "
        "import torch; print(torch.cuda.is_initialized(), torch._C._len_torch_dispatch_stack(), "
        "torch._C._len_torch_function_stack())"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["[]", "False", "0", "0"]  # and no mode (watch's) installed


def test_distributed_is_a_lazy_submodule() -> None:
    assert torchplace.distributed.setup.__name__ == "setup"


def test_a_misspelt_public_name_suggests_the_one_meant() -> None:
    """The message itself (what logs and notebooks show) names the public name meant."""
    with pytest.raises(
        AttributeError, match=r"no attribute 'laod_into'; did you mean 'load_into'\?$"
    ) as e:
        torchplace.laod_into  # type: ignore[attr-defined]  # noqa: B018
    assert e.value.name == "laod_into"
    with pytest.raises(
        AttributeError, match=r"no attribute 'DeviceLaoder'; did you mean 'DeviceLoader'\?$"
    ):
        torchplace.DeviceLaoder  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute 'zebra'$"):
        torchplace.zebra  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(torchplace, "__wrapped__")


def test_dir_lists_the_public_names_and_the_subpackages_and_nothing_else() -> None:
    """dir(torchplace) listed importlib and annotations (and, once used, private modules); in
    a fresh process, before and after the lazy names and subpackages are touched."""
    script = (
        "import json, torchplace\n"
        "before = dir(torchplace)\n"
        "torchplace.load, torchplace.estimate, torchplace.distributed, torchplace.cli\n"
        "import torchplace.moving._move\n"
        "print(json.dumps([before, dir(torchplace)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, after = json.loads(done.stdout)
    root = Path(torchplace.__file__).parent
    subpackages = {
        info.name for info in pkgutil.iter_modules([str(root)]) if not info.name.startswith("_")
    }
    expected = sorted({*torchplace.__all__, "__version__", *subpackages})
    assert before == expected
    assert after == expected
