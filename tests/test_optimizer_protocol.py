"""The Optimizer protocol (optimizer/base.py) is the whole contract: what its callers read
of an optimizer is in it, and both optimizers have all of it."""

import ast
import os

import pytest
from helpers import ADAM_HP, ROOT, tiny_gpt_config
from zero_helpers import build_zero

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import Optimizer, TorchAdamWOptimizer

#: the modules that take an optimizer through the protocol, each as ``optimizer``.
CALLERS = ("training.py", "checkpoint/save.py", "checkpoint/load.py")


def _members(protocol) -> set[str]:
    names = set(protocol.__annotations__)
    names |= {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, property)}
    return {n for n in names if not n.startswith("_")}


def _reads(path: str) -> set[str]:
    """Every ``optimizer.<name>`` in a module's source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "optimizer"
    }


@pytest.mark.parametrize("module", CALLERS)
def test_callers_read_only_the_protocol(module):
    reads = _reads(os.path.join(ROOT, "mp_offload", module))
    assert reads, f"{module} no longer takes an `optimizer`: update CALLERS"
    assert reads <= _members(Optimizer), f"{module} reads {sorted(reads - _members(Optimizer))}"


@pytest.mark.parametrize("kind", ["zero", "torch-adamw"])
def test_both_optimizers_implement_all_of_it(kind):
    single = ps.ParallelGroup.single()
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=single)
    if kind == "zero":
        opt = build_zero(model, **ADAM_HP, dp=single, tp=single, device="cpu")
    else:
        opt = TorchAdamWOptimizer(model, **ADAM_HP, dp=single, tp=single)
    assert isinstance(opt, Optimizer)  # runtime_checkable: every member is present
    opt.zero_grad(lr=1e-3)  # the step's lr before backward (training.train_step gives it)
    assert opt.checkpoint_kind == kind
    assert (opt.layout is None) == (kind != "zero")
