"""report(): golden tables (regenerate with `pytest --regen-golden`), JSON, totals, rich."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchplace
from helpers import check_golden


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool), persistent=False)
        self.scale = torch.ones(1, dtype=torch.float16)


def trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    model.head(model.norm(model.embed(torch.arange(4)))).sum().backward()
    opt.step()
    return model, opt


def test_report_per_module_golden(regen_golden: bool) -> None:
    model, opt = trained()
    with pytest.warns(UserWarning, match="discarded the values of 1 non-persistent buffer"):
        torchplace.move(model, "meta", optimizer=opt, attributes="ignore")
    check_golden("report_modules.txt", str(torchplace.report(model, optimizer=opt)), regen_golden)


def test_report_per_tensor_golden(regen_golden: bool) -> None:
    model, _ = trained()
    check_golden("report_detail.txt", str(torchplace.report(model, detail=True)), regen_golden)


def test_report_counts_every_byte_once() -> None:
    model, opt = trained()
    found = torchplace.report(model, optimizer=opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # tie counted once
    grads = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert found.total_bytes == params + grads + buffers + state + 2  # + the fp16 attribute
    data = json.loads(json.dumps(found.to_dict()))
    assert data["totals"]["bytes"] == found.total_bytes
    assert set(data["totals"]["by_dtype"]) == {"float32", "int64", "bool", "float16"}
    assert {row["kind"] for row in data["rows"]} == {
        "parameter",
        "grad",
        "buffer",
        "attribute",
        "optimizer_state",
    }


def test_report_of_a_split_model_totals_per_device() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    totals = torchplace.report(model).by_device
    assert totals == {
        "cpu": {"tensors": 2, "count": 6, "bytes": 24},
        "meta": {"tensors": 2, "count": 6, "bytes": 24},
    }


def test_report_renders_in_rich() -> None:
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(torchplace.report({"x": torch.ones(3)}))
    text = console.export_text()
    assert "batch['x']" in text and "tensor" in text


def test_report_of_nothing_says_so() -> None:
    found = torchplace.report(nn.ReLU())
    assert found.rows == () and found.total_bytes == 0
    assert "(no tensors)" in str(found)


def test_report_counts_the_local_shard_of_fsdp2_parameters(fake_world: object) -> None:
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=fake_world)
    weight = model[0].weight
    assert weight.numel() == 64  # a DTensor counts all four ranks' elements
    found = torchplace.report(model)
    # each rank holds a quarter of every parameter: 2 of 8 rows, 2 of 8 bias entries
    assert [(row.path, row.tensors, row.count, row.bytes) for row in found.rows] == [
        ("0", 2, 16 + 2, 72),
        ("1", 2, 16 + 2, 72),
    ]
    detail = torchplace.report(model, detail=True)
    assert [(row.path, row.count) for row in detail.rows][:2] == [("0.weight", 16), ("0.bias", 2)]
    stragglers = torchplace.stragglers(model, "meta")
    assert stragglers[0].name == "0.weight" and stragglers[0].nbytes == 64


def test_report_shows_names_as_plain_text() -> None:
    """Dict keys and module names are the user's: rich markup in them is shown, not parsed."""
    model = nn.Sequential()
    model.add_module("[/x]", nn.Linear(1, 1))
    assert "[/x]" in str(torchplace.report(model))
    batch = {"[/]": torch.ones(1), "[bold]w": torch.ones(1), ":thumbs_up:": torch.ones(1)}
    text = str(torchplace.report(batch, detail=True))
    for key in batch:
        assert f"batch['{key}']" in text


def test_a_view_whose_storage_was_given_back_holds_no_bytes() -> None:
    """Classic FSDP frees the storage of its unsharded views after each forward; the report's
    totals are the memory held, so such views count nothing."""
    model = nn.Linear(4, 4)
    held = model.bias.numel() * 4
    with torch.no_grad():
        model.weight.untyped_storage().resize_(0)
    assert torchplace.report(model).to_dict()["totals"]["bytes"] == held


def test_a_batch_report_names_its_rows_as_tensors_and_a_model_report_as_modules() -> None:
    batch_table = str(torchplace.report({"x": torch.ones(3)}))
    model_table = str(torchplace.report(torch.nn.Linear(2, 2)))
    assert "┃ tensor " in batch_table and "┃ module " not in batch_table
    assert "┃ module " in model_table


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing torch.compile
def test_wrapped_models_are_named_as_the_users_own_model() -> None:
    # torch.compile and DataParallel wrap the model: its rows, stragglers and optimizer state
    # are named as the model itself names them, not under _orig_mod. or module.
    model, opt = trained()
    for wrapped in (torch.compile(model), nn.DataParallel(model)):
        # The model's own report once wrapped: DataParallel moves it to cuda:0 where there is one.
        plain = torchplace.report(model, optimizer=opt, detail=True).to_dict()
        found = torchplace.report(wrapped, optimizer=opt, detail=True)
        assert found.to_dict()["rows"] == plain["rows"]
        assert found.title == "Where the tensors of the Net model live"
        names = [s.name for s in torchplace.stragglers(wrapped, "meta", optimizer=opt)]
        assert names == [s.name for s in torchplace.stragglers(model, "meta", optimizer=opt)]
        assert "embed.weight" in names


def test_a_wrapper_holding_a_tensor_of_its_own_keeps_its_names() -> None:
    model = nn.Linear(2, 2)
    wrapped = nn.DataParallel(model)
    wrapped.register_buffer("extra", torch.zeros(1))
    assert {row.path for row in torchplace.report(wrapped).rows} == {"module", "(model)"}
