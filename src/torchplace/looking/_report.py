"""``report()``: where every byte of a model, its optimizer or a batch lives, as a table.

Rows come from the same walk as ``stragglers`` (``_inspect.entries``), so a report and a
``verify`` never disagree about what exists. rich renders the table and is imported only then.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .._sizes import format_bytes
from .._tensor_size import nbytes, numel
from .._tree import refuse_unwalkable
from ._inspect import describe, entries

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Report", "ReportRow", "report"]


@dataclass(frozen=True)
class ReportRow:
    """One row: a module's tensors of one kind, device and dtype (or one tensor in detail)."""

    path: str
    kind: str
    device: str
    dtype: str
    tensors: int
    count: int  # elements
    bytes: int


@dataclass(frozen=True)
class Report:
    """Rows, and totals per device and per dtype.

    >>> import torch, torchplace
    >>> found = torchplace.report(torch.nn.Linear(2, 2))
    >>> [(row.path, row.kind, row.count, row.bytes) for row in found.rows]
    [('(model)', 'parameter', 6, 24)]
    >>> found.to_dict()["totals"]["by_device"]
    {'cpu': {'tensors': 2, 'count': 6, 'bytes': 24}}
    """

    title: str
    rows: tuple[ReportRow, ...]
    detail: bool = False
    by_tensor: bool = False  # each row names one tensor (detail, or a batch holding no module)

    def _totals(self, key: str) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for row in self.rows:
            slot = totals.setdefault(getattr(row, key), {"tensors": 0, "count": 0, "bytes": 0})
            slot["tensors"] += row.tensors
            slot["count"] += row.count
            slot["bytes"] += row.bytes
        return totals

    @property
    def by_device(self) -> dict[str, dict[str, int]]:
        return self._totals("device")

    @property
    def by_dtype(self) -> dict[str, dict[str, int]]:
        return self._totals("dtype")

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps``."""
        return {
            "title": self.title,
            "rows": [asdict(row) for row in self.rows],
            "totals": {
                "by_device": self.by_device,
                "by_dtype": self.by_dtype,
                "bytes": self.total_bytes,
            },
        }

    def __rich__(self) -> Table:
        from rich.table import Table
        from rich.text import Text

        # Paths are the user's names (any string can be a dict key or module name): plain text.
        table = Table(title=Text(self.title), title_justify="left")
        for column, justify in (
            ("tensor" if self.detail or self.by_tensor else "module", "left"),
            ("kind", "left"),
            ("device", "left"),
            ("dtype", "left"),
            ("count", "right"),
            ("bytes", "right"),
        ):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        if not self.rows:
            table.add_row("(no tensors)", "", "", "", "", "")
        for row in self.rows:
            table.add_row(
                Text(row.path),
                row.kind,
                row.device,
                row.dtype,
                f"{row.count:,}",
                format_bytes(row.bytes),
            )
        table.add_section()
        for label, totals in (("device", self.by_device), ("dtype", self.by_dtype)):
            for name, total in totals.items():
                table.add_row(
                    f"total on {name}" if label == "device" else f"total {name}",
                    "",
                    name if label == "device" else "",
                    name if label == "dtype" else "",
                    f"{total['count']:,}",
                    format_bytes(total["bytes"]),
                    style="bold" if label == "device" else "dim",
                )
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=110, color_system=None, force_terminal=False, emoji=False).print(
            self
        )
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def _dtype(name: Any) -> str:
    return str(name).replace("torch.", "")


def report(obj: Any, /, *, optimizer: Any = None, detail: bool = False) -> Report:
    """Where every byte lives: one row per module (or per tensor with ``detail=True``).

    >>> import torch, torchplace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> found = torchplace.report(model)
    >>> for row in found.rows:
    ...     print(row.path, row.kind, row.dtype, row.count)
    0 parameter float32 20
    1 parameter float32 8
    1 buffer float32 8
    1 buffer int64 1
    >>> print(found)  # doctest: +ELLIPSIS
    Where the tensors of the Sequential model live
    ┏━━━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━┳━━━━━━━┓
    ┃ module        ┃ kind      ┃ device ┃ dtype   ┃ count ┃ bytes ┃
    ...

    ``str(report)`` is a table (rendered by rich), ``report.to_dict()`` is JSON-able, and the
    object is a rich renderable. Rows group by the module that holds the tensors directly;
    optimizer state groups under ``optimizer.state``; ``detail=True`` gives one row per tensor.
    A sharded tensor (a DTensor, as FSDP2 and tensor parallelism make) counts the shard this
    process holds, so each rank reports its own memory. The weights of a module that
    ``dispatch`` offloads show their home tier and the device they run on
    (``disk, runs on cuda:0``; ``cpu, runs on cuda:0``) in the device column.
    """
    refuse_unwalkable(obj, "report")
    found = entries(obj, optimizer=optimizer)
    rows: list[ReportRow] = []
    if detail:
        for e in found:
            t = e.tensor
            rows.append(ReportRow(e.name, e.kind, e.place, _dtype(t.dtype), 1, numel(t), nbytes(t)))
    else:
        groups: dict[tuple[str, str, str, str], list[int]] = {}
        for e in found:
            t = e.tensor
            path = e.module if e.module is not None else e.name
            key = (path or "(model)", e.kind, e.place, _dtype(t.dtype))
            slot = groups.setdefault(key, [0, 0, 0])
            slot[0] += 1
            slot[1] += numel(t)
            slot[2] += nbytes(t)
        rows = [ReportRow(*key, *values) for key, values in groups.items()]
    by_tensor = detail or all(e.module is None for e in found)
    return Report(f"Where the tensors of {describe(obj)} live", tuple(rows), detail, by_tensor)
