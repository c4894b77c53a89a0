"""torchplace beside the libraries people use with it: torchmetrics, Lightning, transformers and
Accelerate, each run for real (tiny configs, no downloads), and every fix torchplace suggests
followed to the letter."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import linecache
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import torchplace
from helpers import needs_transformers_5
from torchplace import MoveError, PlacementError, TorchplaceError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CPU = torch.device("cpu")
META = torch.device("meta")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "coming-from.md"


# --- following torchplace's own advice --------------------------------------------------------

_STARTS = re.compile(r"\b(?:\w+ = )?(?:torchplace|model|opt|optimizer)\.[\w.]*\w\(|\bopt = ")
_OR = re.compile(r"\bor\b")


def suggested_recipes(message: str) -> list[list[str]]:
    """Every fix a message suggests, as the calls to run in order: calls joined by "then" or
    "and" make one fix, "or" starts another (``torchplace.verify`` calls, which only check, are
    left out). Without repeats, in the order the message gives them."""
    recipes: list[list[str]] = []
    for line in message.splitlines():
        current: list[str] = []
        end = 0
        for match in _STARTS.finditer(line):
            if match.start() < end:  # a call inside the last one: model.parameters() in opt = ...
                continue
            depth, close = 0, len(line) - 1
            for close in range(line.index("(", match.start()), len(line)):
                depth += {"(": 1, ")": -1}.get(line[close], 0)
                if depth == 0:
                    break
            call = line[match.start() : close + 1]
            if current and _OR.search(line[end : match.start()]):
                recipes.append(current)
                current = []
            end = close + 1
            if not call.startswith("torchplace.verify("):
                current.append(call)
        if current:
            recipes.append(current)
    unique: list[list[str]] = []
    for recipe in recipes:
        if recipe not in unique:
            unique.append(recipe)
    return unique


def follow(recipe: list[str], namespace: dict[str, Any]) -> None:
    """Run one suggested fix as a user would type it. Placeholders take what a user puts in
    their place: ``YourModel, ...`` the model's class and arguments (``namespace["args"]``),
    ``checkpoint`` the file the model was saved to, ``device`` the device asked for, ``saved``
    an optimizer state saved earlier; a ``skeleton`` built becomes ``model``."""
    for call in recipe:
        code = call.replace("...", "*args")
        if code.startswith("torchplace.skeleton("):
            code = "model = " + code
        exec(code, namespace)  # the point: run what the message says
        if code.startswith("opt ="):
            namespace["optimizer"] = namespace["opt"]


def message_of(fn: Callable[[], object]) -> str | None:
    """The text of the error or warning ``fn`` raises or warns, None when it does neither."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    except TorchplaceError as exc:
        return str(exc)
    return "\n".join(str(w.message) for w in caught) or None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("ddp", 'torchplace.load_into(model, {path!r}, rename={{r"^module\\.": ""}})'),
        ("training", "torchplace.load_into(model, torchplace.load({path!r})['model'])"),
        ("lightning", "torchplace.load_into(model, torchplace.load({path!r})['state_dict'], "
                      'rename={{r"^model\\.": ""}})'),
        ("part", "torchplace.load_into(model.get_submodule('encoder'), {path!r})"),
    ],
)  # fmt: skip
def test_load_into_advice_names_the_file_and_works_when_typed_as_given(
    case: str, expected: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    source = _Net()
    weights = source.state_dict()
    saved: Any = {
        "ddp": {f"module.{k}": v for k, v in weights.items()},
        "training": {"model": weights, "epoch": 3},
        "lightning": {"state_dict": {f"model.{k}": v for k, v in weights.items()}, "epoch": 3},
        "part": source.encoder.state_dict(),
    }[case]
    path = tmp_path / "saved file.pt"  # a space: the name is quoted as Python quotes it
    torch.save(saved, path)
    message = message_of(lambda: torchplace.load_into(torchplace.skeleton(_Net), path))
    assert message is not None
    recipes = suggested_recipes(message)
    assert recipes == [[expected.format(path=str(path))]], message
    model = _Net() if case == "part" else torchplace.skeleton(_Net)
    follow(recipes[0], {"torchplace": torchplace, "model": model})
    for name, value in (source.encoder if case == "part" else source).state_dict().items():
        part = model.encoder if case == "part" else model
        assert torch.equal(part.state_dict()[name], value), name


@pytest.mark.parametrize("what", ["batch", "tensor"])
def test_the_fix_for_a_batch_or_a_tensor_works_when_typed_as_given(what: str) -> None:
    """move returns the moved object and leaves the one passed as it was: the fix keeps it."""
    obj: Any = {"x": [torch.ones(2)], "y": torch.zeros(1)} if what == "batch" else torch.ones(2)
    message = message_of(lambda: torchplace.verify(obj, "meta"))
    assert message is not None
    assert message.startswith("2 tensors of the dict are" if what == "batch" else "the tensor is")
    (recipe,) = suggested_recipes(message)
    assert recipe == [f"{what} = torchplace.move({what}, 'meta')"]
    namespace = {"torchplace": torchplace, what: obj}
    follow(recipe, namespace)
    torchplace.verify(namespace[what], "meta")


def test_guard_fix_for_an_input_works_when_typed_as_given() -> None:
    model = torchplace.move(nn.Linear(2, 2), "meta")
    x = torch.ones(1, 2)
    with torchplace.guard(model):
        message = message_of(lambda: model(x))
        assert message is not None
        (recipe, *_) = suggested_recipes(message)
        assert recipe == ["x = torchplace.move(x, 'meta')"]
        namespace = {"torchplace": torchplace, "x": x}
        follow(recipe, namespace)
        assert model(namespace["x"]).is_meta


# --- torchmetrics ---------------------------------------------------------------------------


def _metrics() -> Any:
    return pytest.importorskip("torchmetrics")


def metric_states(model: nn.Module) -> dict[str, Any]:
    """Device of every state of every metric in ``model``, list states element by element, the
    metric's own ``.device`` and its reset values (``_defaults``)."""
    tm = _metrics()
    found: dict[str, Any] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, tm.Metric):
            continue
        found[f"{path}.device"] = mod.device
        for key in mod._defaults:
            value = getattr(mod, key)
            if isinstance(value, torch.Tensor):
                found[f"{path}.{key}"] = value.device
            else:
                found[f"{path}.{key}"] = [v.device for v in value]
            default = mod._defaults[key]
            if isinstance(default, torch.Tensor):
                found[f"{path}._defaults[{key}]"] = default.device
    assert found, "no metric in the model"
    return found


def flat_devices(model: nn.Module) -> list[torch.device]:
    states = metric_states(model).values()
    return [d for v in states for d in (v if isinstance(v, list) else [v])]


class WithMetric(nn.Module):
    """A classifier holding its metric, as LightningModules and plain training loops do."""

    def __init__(self, metric: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.metric = metric


def _updated(kind: str) -> WithMetric:
    tm = _metrics()
    from torchmetrics import classification

    preds, target = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])
    metric: nn.Module
    if kind == "accuracy":
        metric = classification.MulticlassAccuracy(num_classes=3)
    elif kind == "collection":
        metric = tm.MetricCollection(
            {
                "acc": classification.MulticlassAccuracy(num_classes=3),
                "f1": classification.MulticlassF1Score(num_classes=3),
            }
        )
    elif kind == "cat":  # a list state
        metric = tm.CatMetric()
        metric.update(torch.tensor([1.0, 2.0]))
        metric.update(torch.tensor([3.0]))
        return WithMetric(metric)
    else:  # "compute_on_cpu": states kept on the CPU after sync, but Module.to() still moves them
        metric = tm.MeanMetric(compute_on_cpu=True)
        metric.update(torch.tensor([1.0, 2.0]))
        return WithMetric(metric)
    metric.update(preds, target)
    return WithMetric(metric)


METRIC_KINDS = ["accuracy", "collection", "cat", "compute_on_cpu"]


@pytest.mark.parametrize("kind", METRIC_KINDS)
def test_metric_states_follow_move_to_meta_as_module_to_moves_them(kind: str) -> None:
    model = _updated(kind)
    twin = copy.deepcopy(model).to("meta")
    weight = model.lin.weight
    assert torchplace.move(model, "meta") is model  # warnings are errors here: none may come
    assert metric_states(model) == metric_states(twin)
    assert set(flat_devices(model)) == {META}
    assert model.lin.weight is not weight and model.lin.weight.device == META
    assert torchplace.stragglers(model, "meta") == []
    torchplace.verify(model, "meta")


@pytest.mark.parametrize("kind", METRIC_KINDS)
def test_metric_values_survive_a_move(kind: str) -> None:
    model = _updated(kind)
    expected = copy.deepcopy(model.metric).compute()
    torchplace.move(model, "cpu")
    assert metric_states(model) == metric_states(copy.deepcopy(model).to("cpu"))
    got = model.metric.compute()
    if isinstance(expected, dict):
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    else:
        assert torch.equal(got, expected)


def test_metric_state_left_behind_is_a_straggler_and_the_fix_works() -> None:
    model = _updated("accuracy")
    model.to("meta")
    model.metric.tp = torch.zeros(3, dtype=torch.long)  # a state put back on the CPU by hand
    found = torchplace.stragglers(model, "meta")
    assert [(s.name, s.kind, s.device) for s in found] == [("metric.tp", "attribute", CPU)]
    with pytest.raises(PlacementError, match=r"metric\.tp") as info:
        torchplace.verify(model, "meta")
    assert [s.name for s in info.value.stragglers] == ["metric.tp"]
    text = str(info.value)
    # Module.to() does move a metric's states (torchmetrics' _apply): saying otherwise misleads
    assert "does not move" not in text, text
    recipes = suggested_recipes(text)
    if "attributes='move'" in text:  # "pass attributes='move' to torchplace.move", written out
        recipes.append(["torchplace.move(model, 'meta', attributes='move')"])
    assert recipes, text
    for recipe in recipes:
        fresh = _updated("accuracy").to("meta")
        fresh.metric.tp = torch.zeros(3, dtype=torch.long)
        namespace = {"torchplace": torchplace, "torch": torch, "model": fresh}
        follow(recipe, namespace)
        fresh = namespace["model"]
        torchplace.verify(fresh, "meta")
        assert fresh.metric.tp.device == META


@pytest.mark.parametrize("build", ["real", "skeleton"])
def test_load_into_a_model_holding_a_metric(tmp_path: Path, build: str) -> None:
    source = _updated("accuracy")
    path = tmp_path / "model.pt"
    torch.save(source.state_dict(), path)  # metric states are not persistent: lin.* only
    model = _updated("accuracy") if build == "real" else torchplace.skeleton(_updated, "accuracy")
    torchplace.load_into(model, path)
    assert torch.equal(model.lin.weight, source.lin.weight)
    assert set(flat_devices(model)) == {CPU}
    torchplace.verify(model, "cpu")


def test_load_into_fills_persistent_metric_states(tmp_path: Path) -> None:
    source = _updated("accuracy")
    source.metric.persistent(True)
    path = tmp_path / "model.pt"
    torch.save(source.state_dict(), path)
    model = WithMetric(type(source.metric)(num_classes=3))
    model.metric.persistent(True)
    torchplace.load_into(model, path)
    for key in ("tp", "fp", "tn", "fn"):
        assert torch.equal(getattr(model.metric, key), getattr(source.metric, key)), key
    # as after load_state_dict, torchmetrics warns that compute() comes before any update()
    with pytest.warns(UserWarning, match="before the ``update`` method"):
        assert torch.equal(model.metric.compute(), source.metric.compute())


# --- Lightning --------------------------------------------------------------------------------


def _lightning_module() -> nn.Module:
    mixin = pytest.importorskip("lightning_fabric.utilities.device_dtype_mixin")

    class LitNet(mixin._DeviceDtypeModuleMixin):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # the everyday use of Lightning's bookkeeping: new tensors made where the module is
            out: torch.Tensor = self.lin(x) + torch.ones(3, device=self.device, dtype=self.dtype)
            return out

    torch.manual_seed(0)
    return LitNet()


def test_lightning_device_is_true_after_move() -> None:
    lit = _lightning_module()
    twin = copy.deepcopy(lit).to("meta")
    assert torchplace.move(lit, "meta") is lit
    assert lit.device == twin.device == META  # type: ignore[attr-defined]
    assert lit.dtype == twin.dtype == torch.float32  # type: ignore[attr-defined]
    assert lit(torch.zeros(2, 4, device="meta")).device == META


def test_lightning_device_is_true_after_move_with_optimizer() -> None:
    lit = _lightning_module()
    opt = torch.optim.SGD(lit.parameters(), lr=0.1)
    torchplace.move(lit, "meta", optimizer=opt)
    assert lit.device == META  # type: ignore[attr-defined]
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in lit.parameters()]


def test_lightning_device_is_true_after_load_into(tmp_path: Path) -> None:
    lit = _lightning_module()
    x = torch.randn(2, 4)
    expected = lit(x)
    path = tmp_path / "lit.pt"
    torch.save(lit.state_dict(), path)

    torchplace.move(lit, "meta")
    assert torchplace.load_into(lit, path, "cpu") is lit
    assert lit.device == CPU  # type: ignore[attr-defined]
    assert torch.equal(lit(x), expected)

    skel = torchplace.skeleton(type(lit))
    torchplace.load_into(skel, path)
    assert skel.device == CPU  # type: ignore[attr-defined]
    assert torch.equal(skel(x), expected)


def test_lightning_device_is_true_after_load_into_a_skeleton_on_meta(tmp_path: Path) -> None:
    """A skeleton holds meta parameters beside real buffers, so its ``.device`` is where it
    was built; once load_into puts every tensor on one device, ``.device`` says which."""
    lit = _lightning_module()
    torch.save(lit.state_dict(), tmp_path / "lit.pt")
    skel = torchplace.skeleton(type(lit))
    assert skel.lin.weight.device == META
    torchplace.load_into(skel, tmp_path / "lit.pt", "meta")
    assert skel.device == META  # type: ignore[attr-defined]


def test_lightning_checkpoint_state_dict_loads_into_a_skeleton(tmp_path: Path) -> None:
    lit = _lightning_module()
    x = torch.randn(2, 4)
    expected = lit(x)
    ckpt = {"state_dict": {f"model.{k}": v for k, v in lit.state_dict().items()}, "epoch": 3}
    torch.save(ckpt, tmp_path / "last.ckpt")

    skel = torchplace.skeleton(type(lit))
    state = torchplace.load(tmp_path / "last.ckpt", trusted=True)["state_dict"]
    torchplace.load_into(skel, state, "cpu", rename={r"^model\.": ""})  # type: ignore[call-arg]
    assert skel.device == CPU  # type: ignore[attr-defined]
    assert torch.equal(skel(x), expected)


# --- transformers -----------------------------------------------------------------------------


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def gpt2() -> nn.Module:
    tf = _transformers()
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = tf.GPT2LMHeadModel(config).eval()
    return model


def llama() -> tuple[type[nn.Module], Any]:
    tf = _transformers()
    config = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return tf.LlamaForCausalLM, config


IDS = torch.tensor([[1, 5, 7, 9]])


def tied(model: nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]


def generate(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model.generate(IDS, max_new_tokens=4, do_sample=False)  # type: ignore[operator]
    return out


def test_batch_encoding_is_moved_as_a_copy_and_the_callers_is_untouched() -> None:
    tf = _transformers()
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    batch = tf.BatchEncoding({"input_ids": ids, "attention_mask": mask})
    data = batch.data

    out = torchplace.move(batch, "meta")
    assert type(out) is tf.BatchEncoding and out is not batch and out.data is not data
    assert batch.data is data and batch["input_ids"] is ids and batch["attention_mask"] is mask
    assert ids.device == mask.device == CPU
    assert out["input_ids"].device == out["attention_mask"].device == META
    assert out["input_ids"].shape == ids.shape and out["attention_mask"].dtype == torch.long

    nested = torchplace.move({"batch": batch, "labels": ids}, "meta")
    assert nested["batch"] is not batch and batch["input_ids"] is ids
    assert nested["batch"]["input_ids"].device == META


def test_batch_encoding_values_survive_a_move() -> None:
    tf = _transformers()
    ids = torch.tensor([[1, 2, 3]])
    batch = tf.BatchEncoding({"input_ids": ids})
    out = torchplace.move(batch, "cpu")
    assert type(out) is tf.BatchEncoding and batch["input_ids"] is ids
    assert torch.equal(out["input_ids"], ids)


class InPlaceBatch(collections.UserDict):  # type: ignore[type-arg]
    """A batch whose ``.to()`` works in place and returns itself, as BatchEncoding's does."""

    def to(self, device: Any, non_blocking: bool = False) -> InPlaceBatch:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def test_a_batch_whose_to_works_in_place_is_moved_as_a_copy() -> None:
    ids = torch.ones(2)
    batch = InPlaceBatch({"ids": ids})
    data = batch.data
    out = torchplace.move(batch, "meta")
    assert out is not batch and type(out) is InPlaceBatch and out["ids"].device == META
    assert batch.data is data and batch["ids"] is ids and ids.device == CPU


# transformers 4.x's GPT-2 keeps its causal mask as non-persistent buffers, which a move to
# meta discards, saying so (test_every_way_back_from_meta_for_llama_... tests that warning)
gpt2_mask_buffers = needs_transformers_5("GPT-2's causal mask is a non-persistent buffer")


@gpt2_mask_buffers
def test_gpt2_ties_kept_through_meta_and_load_into(tmp_path: Path) -> None:
    model = gpt2()
    expected = generate(model)
    path = tmp_path / "gpt2.pt"
    torch.save(model.state_dict(), path)
    assert tied(model)

    torchplace.move(model, "meta")
    assert tied(model) and model.device == META  # type: ignore[comparison-overlap]
    torchplace.verify(model, "meta")

    torchplace.load_into(model, path, "cpu")
    assert tied(model) and model.device == CPU  # type: ignore[comparison-overlap]
    torchplace.verify(model, "cpu")
    assert torch.equal(generate(model), expected)

    torchplace.move(model, "cpu")
    assert tied(model) and torch.equal(generate(model), expected)


@gpt2_mask_buffers
def test_gpt2_ties_and_optimizer_kept_through_moves(tmp_path: Path) -> None:
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    n_params = len(opt.param_groups[0]["params"])

    torchplace.move(model, "meta", optimizer=opt)
    assert tied(model)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert len(opt.param_groups[0]["params"]) == n_params
    assert set(map(id, opt.state)) == set(map(id, model.parameters()))
    torchplace.verify(model, "meta", optimizer=opt)


def test_gpt2_skeleton_and_load_into(tmp_path: Path) -> None:
    tf = _transformers()
    model = gpt2()
    expected = generate(model)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)  # type: ignore[operator]
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")

    saved = tmp_path / "hf" / "model.safetensors"  # as Hugging Face saves it: the tie once
    assert "lm_head.weight" not in torchplace.load(saved)
    for source in (tmp_path / "gpt2.pt", saved):
        skel = torchplace.skeleton(tf.GPT2LMHeadModel, model.config)
        assert tied(skel)
        torchplace.load_into(skel, source)
        assert tied(skel) and skel.device == CPU
        assert torch.equal(generate(skel.eval()), expected), source


def test_llama_skeleton_keeps_rotary_buffers(tmp_path: Path) -> None:
    cls, config = llama()
    torch.manual_seed(0)
    model = cls(config).eval()
    expected = model(IDS).logits
    path = tmp_path / "llama.pt"
    torch.save(model.state_dict(), path)
    assert "model.rotary_emb.inv_freq" not in torch.load(path)  # non-persistent

    skel = torchplace.skeleton(cls, config)
    inv_freq = skel.model.rotary_emb.inv_freq
    assert inv_freq.device == CPU
    assert torch.equal(inv_freq, model.model.rotary_emb.inv_freq)
    torchplace.load_into(skel, path)
    assert skel.model.rotary_emb.inv_freq is inv_freq
    assert torch.equal(skel.eval()(IDS).logits, expected)


def test_llama_with_its_layers_on_their_own_device_runs() -> None:
    """``model.layers`` (a ModuleList, never called itself) mapped whole: each decoder layer
    gets its inputs on the layers' device, and the forward runs to the end."""
    cls, config = llama()
    torch.manual_seed(0)
    model = cls(config).eval()
    expected = model(IDS).logits
    device_map = {"": "cpu", "model.layers": "meta", "model.norm": "meta", "lm_head": "meta"}
    torchplace.dispatch(model, device_map)
    seen: list[torch.device] = []
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].device))
    logits = model(IDS).logits
    assert seen == [META, META]
    assert logits.device == META and logits.shape == expected.shape


@pytest.mark.requires_cuda
def test_llama_with_its_layers_on_a_gpu_gives_the_same_logits() -> None:
    cls, config = llama()
    torch.manual_seed(0)
    model = cls(config).eval()
    expected = model(IDS).logits
    torchplace.dispatch(model, {"": "cpu", "model.layers": "cuda:0"})
    assert model.model.layers[0].self_attn.q_proj.weight.device == torch.device("cuda", 0)
    assert model.model.embed_tokens.weight.is_pinned()  # "cpu" beside a GPU: offloaded
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.device == CPU
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_gemma4_whose_config_refuses_a_per_layer_attribute_is_walked() -> None:
    """transformers 5's heterogeneous config raises its own error for ``config.head_dim``
    when layers differ; a walk skips it, as ``Module.to`` never reads it."""
    tf = _transformers()
    if not hasattr(tf, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    config = tf.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = tf.Gemma4ForCausalLM(config)
    with pytest.raises(Exception, match="per-layer attribute"):
        model.config.head_dim  # noqa: B018 (the trap itself)
    assert "Gemma4ForCausalLM" in str(torchplace.report(model))
    torchplace.verify(model, "cpu")
    with pytest.warns(UserWarning, match="non-persistent buffer"):
        torchplace.move(model, "meta")
    torchplace.verify(model, "meta")


def test_a_file_saved_from_a_tied_llama_is_named_and_the_tie_works(tmp_path: Path) -> None:
    """save_pretrained of a model with tied embeddings saves their weight once; a model built
    untied and loaded with strict=False is told so, and the tie it is given works as typed."""
    cls, config = llama()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    source = cls(config).eval()
    expected = source(IDS).logits
    source.save_pretrained(tmp_path / "tied")
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    model = torchplace.skeleton(cls, untied)
    with pytest.warns(UserWarning, match="tie_word_embeddings") as caught:
        torchplace.load_into(model, tmp_path / "tied", strict=False)
    text = str(caught[0].message)
    assert text.startswith(
        "torchplace.load_into left 1 tensor(s) of LlamaForCausalLM on meta, where they hold no "
        "values: lm_head.weight."
    )
    assert "this model was built with tie_word_embeddings=False" in text
    fix = re.search(r"Tie them as it did, (.*?), or build", text)
    assert fix is not None
    assert fix.group(1) == "model.lm_head.weight = model.model.embed_tokens.weight"
    exec(fix.group(1), {"model": model})  # the fix, as given
    torchplace.verify(model, "cpu")
    assert torch.equal(model(IDS).logits, expected)


def test_move_to_meta_warns_when_non_persistent_buffers_lose_their_values() -> None:
    cls, config = llama()
    model = cls(config)
    with pytest.warns(UserWarning, match=r"model\.rotary_emb\.inv_freq") as caught:
        torchplace.move(model, "meta")
    text = " ".join(str(w.message) for w in caught)
    assert "non-persistent" in text or "not in the state dict" in text, text
    assert model.model.rotary_emb.inv_freq.device == META


@gpt2_mask_buffers
def test_move_to_meta_of_a_model_without_non_persistent_buffers_does_not_warn() -> None:
    torchplace.move(gpt2(), "meta")  # GPT-2's buffers are none or persistent: warnings are errors


def test_every_way_back_from_meta_for_llama_works_or_says_what_was_lost(tmp_path: Path) -> None:
    cls, config = llama()
    path = tmp_path / "llama.pt"

    def fresh() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = cls(config).eval()
        torch.save(model.state_dict(), path)
        return model, model(IDS).logits

    model, _ = fresh()
    messages = {"move to meta": message_of(lambda: torchplace.move(model, "meta"))}
    messages["move back"] = message_of(lambda: torchplace.move(model, "cpu"))
    messages["verify"] = message_of(lambda: torchplace.verify(model, "cpu"))
    messages["load_into"] = message_of(lambda: torchplace.load_into(model, path, "cpu"))
    problems = []
    if not messages["move to meta"]:
        problems.append("moving a model with non-persistent buffers to meta is silent")
    for where, text in messages.items():
        if text is None:
            continue
        recipes = suggested_recipes(text)
        if not recipes and "inv_freq" not in text:
            problems.append(f"{where}: neither a fix nor what was lost: {text}")
        for recipe in recipes:
            call = " then ".join(recipe)
            model, expected = fresh()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torchplace.move(model, "meta")
            namespace = {"torchplace": torchplace, "torch": torch, "model": model}
            namespace.update(checkpoint=str(path), device="cpu", YourModel=cls, args=(config,))
            try:
                follow(recipe, namespace)
                model = namespace["model"]
                if recipe[-1].startswith("model.to_empty("):  # "... and initialise it"
                    torchplace.load_into(model, path)
                torchplace.verify(model, "cpu")
                logits = model(IDS).logits
            except Exception as exc:
                problems.append(f"{where} suggests {call}, which fails: {exc!r}")
                continue
            if not torch.equal(logits, expected):
                nan = " (NaN)" if logits.isnan().any() else ""
                problems.append(f"{where} suggests {call}: the outputs differ{nan}")
    assert not problems, "\n".join(problems)


# --- a batch object's own .to() ---------------------------------------------------------------


class ToReturnsNone:
    def __init__(self) -> None:
        self.t = torch.ones(2)

    def to(self, device: Any) -> None:
        self.t = self.t.to(device)


class ToReturnsDict:
    def __init__(self) -> None:
        self.t = torch.ones(2)

    def to(self, device: Any) -> dict[str, torch.Tensor]:
        return {"t": self.t.to(device)}


@pytest.mark.parametrize(
    ("cls", "what"), [(ToReturnsNone, "None"), (ToReturnsDict, "dict")], ids=["none", "dict"]
)
def test_own_to_returning_something_else_raises(cls: type, what: str) -> None:
    obj = cls()
    batch = {"x": obj, "y": torch.ones(1)}
    with pytest.raises(MoveError, match=cls.__name__) as info:
        torchplace.move(batch, "meta")
    assert info.value.name == "batch['x']"
    assert what in str(info.value)
    assert batch["x"] is obj and batch["y"].device == CPU


# --- cached values ----------------------------------------------------------------------------


@dataclasses.dataclass
class Features:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_cached_property_never_stays_on_the_old_device() -> None:
    feats = Features(torch.ones(2))
    cached = feats.doubled
    out = torchplace.move(feats, "meta")
    assert out.x.device == META
    assert out.doubled.device == META
    assert feats.x.device == CPU and feats.doubled is cached  # the caller's object untouched


def test_cached_property_values_survive_a_move() -> None:
    feats = Features(torch.arange(3.0))
    _ = feats.doubled
    out = torchplace.move(feats, "cpu")
    assert torch.equal(out.doubled, torch.arange(3.0) * 2)


def test_verify_sees_a_cached_value_left_behind() -> None:
    feats = Features(torch.ones(2))
    _ = feats.doubled
    feats.x = feats.x.to("meta")
    names = [s.name for s in torchplace.stragglers(feats, "meta")]
    assert len(names) == 1 and "doubled" in names[0], names
    with pytest.raises(PlacementError, match="doubled") as e:
        torchplace.verify(feats, "meta")
    assert [s.name for s in e.value.stragglers] == ["batch.doubled"]


# --- advice that must not dead-end ------------------------------------------------------------


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def bound(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    """The optimizer holds exactly the model's parameters, and its state is keyed by them."""
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    return held == [id(p) for p in model.parameters()] and set(map(id, opt.state)) <= set(held)


def test_advice_after_a_plain_to_meta_with_an_optimizer_built_before() -> None:
    model, opt = trained()
    model.to("meta")
    with pytest.raises(PlacementError) as info:
        torchplace.verify(model, "meta", optimizer=opt)
    text = str(info.value)
    recipes = suggested_recipes(text)
    assert ["torchplace.move(model, 'meta', optimizer=opt)"] in recipes, text
    for recipe in recipes:
        call = " then ".join(recipe)
        model, opt = trained()
        model.to("meta")
        namespace = {"torchplace": torchplace, "torch": torch, "model": model, "opt": opt}
        namespace["optimizer"] = opt
        try:
            follow(recipe, namespace)
            model = namespace["model"]
            opt = namespace["opt"]
            torchplace.verify(model, "meta", optimizer=opt)
        except TorchplaceError as exc:
            pytest.fail(f"verify suggests {call}, which fails: {exc}\n{text}")
        assert bound(model, opt), call
        assert all(s["exp_avg"].device == META for s in opt.state.values())
        assert all(s["step"].device == CPU for s in opt.state.values())  # PyTorch's policy


def state_lost_then_weights_back(path: Path) -> dict[str, Any]:
    """A trained model and Adam moved to meta together, then the weights loaded back on the CPU
    from ``path``: the optimizer's state is left on meta, without values. Returned as the
    namespace a user's program has (``saved``: the optimizer's state saved before)."""
    model, opt = trained()
    torch.save(model.state_dict(), path)
    saved = copy.deepcopy(opt.state_dict())
    torchplace.move(model, "meta", optimizer=opt)
    torchplace.load_into(model, path, "cpu")
    namespace = {"torchplace": torchplace, "torch": torch, "model": model, "opt": opt}
    namespace.update(optimizer=opt, saved=saved, checkpoint=str(path), device="cpu")
    return namespace


def check_fixes_for_lost_state(text: str, path: Path, where: str) -> None:
    assert re.search(r"lost|no values|no data", text), f"does not say the state is gone: {text}"
    recipes = suggested_recipes(text)
    assert recipes, text
    for recipe in recipes:
        call = " then ".join(recipe)
        namespace = state_lost_then_weights_back(path)
        try:
            follow(recipe, namespace)
            model, opt = namespace["model"], namespace["opt"]
            torchplace.verify(model, "cpu", optimizer=opt)
        except TorchplaceError as exc:
            pytest.fail(f"{where} suggests {call}, which fails: {exc}\n{text}")
        assert bound(model, opt), call
        if "saved" in call:  # the values come back bit for bit
            for i, p in enumerate(model.parameters()):
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opt.state[p][key], namespace["saved"]["state"][i][key])
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # the optimizer works again
        torchplace.verify(model, "cpu", optimizer=opt)


def test_advice_after_optimizer_state_went_to_meta_and_weights_came_back(tmp_path: Path) -> None:
    namespace = state_lost_then_weights_back(tmp_path / "model.pt")
    with pytest.raises(PlacementError) as info:
        torchplace.verify(namespace["model"], "cpu", optimizer=namespace["opt"])
    assert {s.kind for s in info.value.stragglers} == {"optimizer_state"}
    assert "exp_avg" in str(info.value)
    check_fixes_for_lost_state(str(info.value), tmp_path / "model.pt", "verify")


def test_move_error_for_meta_optimizer_state_says_what_was_lost(tmp_path: Path) -> None:
    namespace = state_lost_then_weights_back(tmp_path / "model.pt")
    model, opt = namespace["model"], namespace["opt"]
    before = [p for g in opt.param_groups for p in g["params"]]
    with pytest.raises(MoveError) as info:
        torchplace.move(model, "cpu", optimizer=opt)
    assert info.value.name == "optimizer.state[0.weight].exp_avg"
    assert "exp_avg" in str(info.value)
    assert [p for g in opt.param_groups for p in g["params"]] == before  # nothing moved
    check_fixes_for_lost_state(str(info.value), tmp_path / "model.pt", "move")


# --- Accelerate's send_to_device and Lightning's move_data_to_device ---------------------------


class Pair(NamedTuple):
    a: Any
    b: Any
    c: Any


class ToOnlyDevice:
    """An object with ``.to(device)`` that takes no ``non_blocking`` (Accelerate retries)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> ToOnlyDevice:
        return ToOnlyDevice(self.t.to(device))


def _batches() -> Iterator[tuple[str, Any]]:
    t = torch.arange(4.0)
    yield "tensor", t
    yield "list", [t, t + 1]
    yield "tuple", (t, [t + 1], "text")
    yield "namedtuple", Pair(t, [t, t + 1], "a string")
    yield "dict", {"a": t, "b": {"c": [t, (t + 1,)]}, "s": "x", "i": 3, "n": None}
    yield "OrderedDict", collections.OrderedDict(a=t, b=[t])
    yield "UserDict", collections.UserDict(a=t)
    yield "to-object", {"obj": ToOnlyDevice(t)}
    yield "non-tensor", "just a string"


def same_shape(a: Any, b: Any, device: torch.device) -> None:
    """``a`` and ``b`` have one structure, types included; tensors equal in ``b`` on ``device``
    (values compared when on the CPU); other leaves the same objects."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.device == b.device == device and a.dtype == b.dtype and a.shape == b.shape
        if device.type == "cpu":
            assert torch.equal(a, b)
    elif isinstance(a, ToOnlyDevice):
        same_shape(a.t, b.t, device)
    elif isinstance(a, (dict, collections.UserDict)):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            same_shape(a[k], b[k], device)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_shape(x, y, device)
    else:
        assert a is b


BATCHES = dict(_batches())


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", list(BATCHES))
def test_move_agrees_with_send_to_device(case: str, device: str) -> None:
    ops = pytest.importorskip("accelerate.utils")
    batch = BATCHES[case]
    same_shape(
        torchplace.move(batch, device), ops.send_to_device(batch, device), torch.device(device)
    )


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", list(BATCHES))
def test_move_agrees_with_move_data_to_device(case: str, device: str) -> None:
    apply_func = pytest.importorskip("lightning_fabric.utilities.apply_func")
    batch = BATCHES[case]
    theirs = apply_func.move_data_to_device(batch, device)
    same_shape(torchplace.move(batch, device), theirs, torch.device(device))


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def test_deliberate_differences_from_send_to_device() -> None:
    ops = pytest.importorskip("accelerate.utils")
    t = torch.ones(2)

    # frozen dataclasses: Accelerate leaves them where they are, torchplace moves them
    assert ops.send_to_device(Frozen(t), "meta").x.device == CPU
    assert torchplace.move(Frozen(t), "meta").x.device == META

    # device=None: Accelerate leaves tensors where they are, torchplace means "auto"
    on_meta = t.to("meta")
    assert ops.send_to_device(on_meta, None).device == META
    assert torchplace.move(t, None).device == torchplace.device("auto")

    # a wrong argument type: torchplace says so before touching anything
    with pytest.raises(torchplace.DeviceSpecError, match="float"):
        torchplace.move({"a": t}, 1.5)  # type: ignore[arg-type]

    # defaultdict: Accelerate cannot rebuild it, torchplace keeps the factory
    dd = collections.defaultdict(list, a=t)
    with pytest.raises(TypeError):
        ops.send_to_device(dd, "meta")
    moved = torchplace.move(dd, "meta")
    assert type(moved) is collections.defaultdict and moved.default_factory is list

    # one tensor twice: Accelerate makes two copies, torchplace one
    theirs, ours = ops.send_to_device([t, t], "meta"), torchplace.move([t, t], "meta")
    assert theirs[0] is not theirs[1] and ours[0] is ours[1]


def test_deliberate_differences_from_move_data_to_device() -> None:
    apply_func = pytest.importorskip("lightning_fabric.utilities.apply_func")
    with pytest.raises(ValueError, match="frozen"):
        apply_func.move_data_to_device(Frozen(torch.ones(2)), "meta")
    assert torchplace.move(Frozen(torch.ones(2)), "meta").x.device == META


# --- the "coming from" page runs --------------------------------------------------------------


def _doc_blocks() -> list[str]:
    if not DOCS.exists():
        return []
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_coming_from_page_examples_run(index: int, tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning_fabric")
    monkeypatch.chdir(tmp_path)
    code = _doc_blocks()[index]
    name = f"{DOCS}[block {index}]"
    linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)  # tracebacks
    exec(compile(code, name, "exec"), {"__name__": "coming_from"})


def test_coming_from_page_has_examples() -> None:
    assert len(_doc_blocks()) >= 3


@needs_transformers_5("Llama's rotary embedding on meta raises in torch.autocast('meta')")
def test_llama_with_rotary_embeddings_on_meta_names_the_keyword_input() -> None:
    # A Llama dispatched over cpu + meta hands its decoder layers position_embeddings by
    # keyword: the layer on the CPU gets torchplace's MoveError naming that keyword, not
    # PyTorch's bare "Cannot copy out of meta tensor".
    cls, config = llama()
    model = torchplace.dispatch(cls(config), {"": "cpu", "model.rotary_emb": "meta"})
    with pytest.raises(
        MoveError,
        match=r"model.model.layers.0 \(LlamaDecoderLayer\) runs on cpu but got "
        r"kwargs\['position_embeddings'\]\[0\] on meta",
    ) as e:
        model(IDS)
    assert e.value.name == "kwargs['position_embeddings'][0]"


def test_plan_no_split_auto_keeps_each_llama_decoder_layer_whole() -> None:
    cls, config = llama()
    model = torchplace.skeleton(cls, config)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    embed = model.model.embed_tokens.weight.numel() * 4
    budgets = {"cpu": embed + int(1.5 * layer), "meta": "1GiB"}  # the embedding, 1.5 layers
    assert any(".self_attn" in name or ".mlp" in name for name in torchplace.plan(model, budgets))
    device_map = torchplace.plan(model, budgets, no_split="auto")
    assert all(name.count(".") <= 2 for name in device_map), device_map  # layers.N at most


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing torch.compile
@pytest.mark.parametrize("compiled", [False, True], ids=["fabric", "fabric+compile"])
def test_report_names_a_fabric_model_as_the_users_model(compiled: bool) -> None:
    lf = pytest.importorskip("lightning_fabric")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    expected = torchplace.report(model, optimizer=opt, detail=True).to_dict()["rows"]
    fabric = lf.Fabric(accelerator="cpu", devices=1)
    wrapped, wrapped_opt = fabric.setup(torch.compile(model) if compiled else model, opt)
    found = torchplace.report(wrapped, optimizer=wrapped_opt, detail=True)
    assert found.to_dict()["rows"] == expected
    assert "0.weight" in [row["path"] for row in expected]


def _saved(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    torch.save(model.state_dict(), path)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing torch.compile
@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "fabric"])
@pytest.mark.parametrize("saved_from", ["model", "wrapper"])
def test_load_into_a_wrapped_model_fills_the_model_inside(
    wrap: str, saved_from: str, tmp_path: Path
) -> None:
    # The resume loop with a wrapper: load_into(wrapped, file) fills the user's model, whether
    # the file was saved from the model (its own names) or from the wrapper (_orig_mod.*,
    # module.*; Fabric's state_dict gives the model's names).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if wrap == "compile":
        wrapped: nn.Module = torch.compile(model)
    elif wrap == "data_parallel":
        wrapped = nn.DataParallel(model)
    else:
        lf = pytest.importorskip("lightning_fabric")
        wrapped = lf.Fabric(accelerator="cpu", devices=1).setup(model)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    expected = _saved(other if saved_from == "model" else model, tmp_path / "last.pt")
    if saved_from == "wrapper":  # the file holds the wrapper's names; give the model others
        torch.save(wrapped.state_dict(), tmp_path / "last.pt")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    weight = model[0].weight
    assert torchplace.load_into(wrapped, tmp_path / "last.pt") is wrapped
    assert model[0].weight is weight  # filled in place
    for name, value in model.state_dict().items():  # DataParallel moved it to cuda:0 on a GPU
        assert torch.equal(value, expected[name].to(value.device)), name
