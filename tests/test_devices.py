"""device() and available(): explicit indices, auto/LOCAL_RANK, gpu, best, and clear errors.

GPUs are simulated by monkeypatching torch.cuda (docs/design.md); nothing here needs one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchplace
from torchplace import _devices

FakeGPUs = Callable[..., None]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> FakeGPUs:
    """Pretend this machine has N CUDA GPUs with the given free memory (bytes)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def install(count: int, free: list[int] | None = None, mps: bool = False) -> None:
        free_list = free if free is not None else [8 << 30] * count
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda i=0: (free_list[i], 80 << 30), raising=False
        )
        monkeypatch.setattr(_devices, "_nvml_free_memory", lambda i: None)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        if count:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(count)))
        else:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return install


def test_cpu_and_meta_are_always_there() -> None:
    assert torchplace.device("cpu") == torch.device("cpu")
    assert torchplace.device("meta") == torch.device("meta")
    assert torchplace.device(torch.device("cpu")) == torch.device("cpu")
    assert torchplace.device(" CPU ") == torch.device("cpu")


def test_auto_without_accelerator_is_cpu(gpus: FakeGPUs) -> None:
    gpus(0)
    assert torchplace.device() == torch.device("cpu")
    assert torchplace.device(None) == torch.device("cpu")
    assert torchplace.device("auto") == torch.device("cpu")
    assert torchplace.available() == [torch.device("cpu")]


def test_auto_picks_cuda_with_explicit_index(gpus: FakeGPUs) -> None:
    gpus(4)
    dev = torchplace.device("auto")
    assert dev == torch.device("cuda:0")
    assert dev.index == 0  # never bare "cuda": torch.device("cuda") != torch.device("cuda:0")
    assert torchplace.device("cuda") == torch.device("cuda", 0)
    assert torchplace.device("gpu") == torch.device("cuda", 0)


@pytest.mark.parametrize(("local_rank", "expected"), [("0", 0), ("3", 3)])
def test_auto_under_torchrun_uses_local_rank(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch, local_rank: str, expected: int
) -> None:
    gpus(4)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert torchplace.device() == torch.device("cuda", expected)


@pytest.mark.parametrize("spec", ["auto", "best"])
@pytest.mark.parametrize("world", [2, 4])
def test_local_ranks_never_share_an_accelerator(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch, spec: str, world: int
) -> None:
    """Every local rank of a torchrun machine gets its own device, whatever the free memory."""
    gib = 1 << 30
    gpus(4, free=[1 * gib, 2 * gib, 40 * gib, 3 * gib])  # "most free" alone would be cuda:2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    chosen = []
    for rank in range(world):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        chosen.append(torchplace.device(spec))
    assert chosen == [torch.device("cuda", rank) for rank in range(world)]


@pytest.mark.parametrize("spec", ["auto", "best"])
def test_more_local_ranks_than_accelerators_is_refused_on_every_rank(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """4 processes on 2 GPUs: rank 2 would share cuda:0 with rank 0 (LOCAL_RANK % count)."""
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        with pytest.raises(torchplace.DeviceUnavailableError, match=r"--nproc-per-node=2"):
            torchplace.device(spec)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(torchplace.DeviceUnavailableError, match=r"LOCAL_RANK=5 needs cuda:5"):
        torchplace.device(spec)


def test_best_with_one_process_per_machine_still_reads_free_memory(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 1 << 30
    gpus(4, free=[1 * gib, 2 * gib, 40 * gib, 3 * gib])
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert torchplace.device("best") == torch.device("cuda:2")
    assert torchplace.device("auto") == torch.device("cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(torchplace.DeviceSpecError, match=r"LOCAL_WORLD_SIZE='two'"):
        torchplace.device("best")


def test_local_rank_without_gpu_is_cpu(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchplace.device() == torch.device("cpu")


def test_bad_local_rank_is_named(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(torchplace.DeviceSpecError, match="LOCAL_RANK='first'"):
        torchplace.device()


def test_negative_local_rank_picks_no_gpu_by_its_value(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-1 % 4 is 3: a negative LOCAL_RANK must not silently pick the last GPU. -1 is the usual
    way to say "not distributed" and counts as unset; below that it is refused."""
    gpus(4)
    monkeypatch.setenv("LOCAL_RANK", "-1")
    assert torchplace.device() == torch.device("cuda:0")  # the current one, not cuda:3
    monkeypatch.setenv("LOCAL_RANK", "-2")
    with pytest.raises(torchplace.DeviceSpecError, match="LOCAL_RANK='-2' is negative"):
        torchplace.device()


def test_ints_and_indices(gpus: FakeGPUs) -> None:
    gpus(2)
    assert torchplace.device(1) == torch.device("cuda:1")
    assert torchplace.device("cuda:1") == torch.device("cuda:1")
    assert torchplace.device(torch.device("cuda", 1)) == torch.device("cuda:1")
    assert torchplace.device("gpu:1") == torch.device("cuda:1")
    assert torchplace.available() == [
        torch.device("cuda:0"),
        torch.device("cuda:1"),
        torch.device("cpu"),
    ]


def test_absent_index_says_what_is_visible(gpus: FakeGPUs) -> None:
    gpus(2)
    with pytest.raises(torchplace.DeviceUnavailableError) as info:
        torchplace.device("cuda:3")
    assert str(info.value) == (
        "cuda:3 requested but 2 CUDA devices are visible (cuda:0, cuda:1; CUDA_VISIBLE_DEVICES=0,1)"
    )
    with pytest.raises(torchplace.DeviceUnavailableError, match="cuda:2 requested"):
        torchplace.device(2)


def test_cuda_on_a_cpu_only_machine(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(torchplace.DeviceUnavailableError) as info:
        torchplace.device("cuda")
    message = str(info.value)
    assert message.startswith("cuda:0 requested but no CUDA device is visible")
    assert "has no CUDA support; install a CUDA build of torch" in message
    assert "available: cpu" in message
    with pytest.raises(torchplace.DeviceUnavailableError, match="'gpu' requested"):
        torchplace.device("gpu")
    with pytest.raises(torchplace.DeviceUnavailableError, match="accelerator 0 requested"):
        torchplace.device(0)


def test_hidden_gpus_are_explained(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(0)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(torchplace.DeviceUnavailableError, match="CUDA_VISIBLE_DEVICES is empty"):
        torchplace.device("cuda:0")


def test_best_picks_most_free_memory_lowest_index_on_ties(gpus: FakeGPUs) -> None:
    gib = 1 << 30
    gpus(4, free=[10 * gib, 30 * gib, 5 * gib, 30 * gib])
    assert torchplace.device("best") == torch.device("cuda:1")
    gpus(4, free=[7 * gib] * 4)
    assert torchplace.device("best") == torch.device("cuda:0")
    gpus(4, free=[1 * gib, 2 * gib, 3 * gib, 4 * gib])
    assert torchplace.device("best") == torch.device("cuda:3")


def test_best_reads_nvml_first_without_a_context(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(2, free=[9, 1])

    def no_context(index: int = 0) -> tuple[int, int]:
        raise AssertionError("mem_get_info creates a CUDA context; NVML was available")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(_devices, "_nvml_free_memory", lambda i: [1, 9][i])
    assert torchplace.device("best") == torch.device("cuda:1")


@pytest.mark.parametrize("local_rank", [None, "0", "1"])
def test_best_without_accelerator_is_the_cpu_as_auto_is(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch, local_rank: str | None
) -> None:
    gpus(0)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert torchplace.device("best") == torchplace.device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", [-1, "-1", "cuda:-1", " CUDA:-1 ", "gpu:-1", "xpu:-1", "cpu:-1"])
def test_a_negative_index_is_one_error_however_spelt(spec: object) -> None:
    with pytest.raises(torchplace.DeviceSpecError) as info:
        torchplace.device(spec)  # type: ignore[arg-type]
    assert str(info.value) == "device index -1 is negative; accelerators count from 0"
    with pytest.raises(torchplace.DeviceSpecError) as info:
        torchplace.device(-7 if isinstance(spec, int) else spec.replace("1", "7"))  # type: ignore[arg-type]
    assert str(info.value) == "device index -7 is negative; accelerators count from 0"


def test_mps_when_there_is_no_cuda(gpus: FakeGPUs) -> None:
    gpus(0, mps=True)
    assert torchplace.device() == torch.device("mps:0")
    assert torchplace.device("gpu") == torch.device("mps:0")
    assert torchplace.device("mps") == torch.device("mps:0")
    assert torchplace.available() == [torch.device("mps:0"), torch.device("cpu")]
    with pytest.raises(torchplace.DeviceUnavailableError, match="mps:1 requested"):
        torchplace.device("mps:1")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("cdua", "did you mean 'cuda'"),
        ("cuda0", "did you mean 'cuda:0'"),
        ("meta0", "did you mean 'meta'"),
        ("gpu:x", "use 'gpu' or 'gpu:N'"),
        ("", "unknown device spec ''"),
        (-1, "negative"),
        (1.5, "not float"),
        (True, "not bool"),
        (["cpu"], "not list"),
        ("cpu:1", "no index 1"),
    ],
)
def test_unknown_specs(spec: object, match: str) -> None:
    with pytest.raises(torchplace.DeviceSpecError, match=match) as info:
        torchplace.device(spec)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, torchplace.TorchplaceError)


def test_device_does_not_initialise_cuda(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto and explicit specs read counts only: no current_device() on an uninitialised CUDA."""
    gpus(2)

    def forbidden() -> int:
        raise AssertionError("current_device() initialises CUDA")

    monkeypatch.setattr(torch.cuda, "current_device", forbidden)
    assert torchplace.device() == torch.device("cuda:0")
    assert torchplace.device("cuda") == torch.device("cuda:0")


@pytest.mark.parametrize("spec", ["hpu", "xla:0", "fpga", "ve", "ipu", "privateuseone"])
def test_backends_this_torch_lacks_are_unavailable(spec: str) -> None:
    """A device type torch can parse but has no backend for here fails now, not at the copy."""
    with pytest.raises(torchplace.DeviceUnavailableError, match=r"no \w+ backend loaded.* cpu"):
        torchplace.device(spec)
