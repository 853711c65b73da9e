"""Scaling on CPU with gloo: the same training at world sizes 1, 2 and 4 over TP and DP.

Every layout sees the same global batch, so the loss curves must agree (fp32: only the
order of reductions differs); the real buffers shrink as 1/(TP*DP) on the host and as
~1/TP on the device.
"""

import json

import pytest
from dist_helpers import run_distributed
from helpers import tiny_model_flags

from mp_offload.training import pretrain

ARGS = tiny_model_flags(hidden_size=64, seq_length=32, vocab_size=128) + [
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--lr",
    "3e-3",
    "--train-iters",
    "10",
    "--eval-interval",
    "1000",
    "--log-interval",
    "100",
    "--cpu-offload",
]
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]  # (TP, DP)
pytestmark = pytest.mark.slow  # trains on up to 4 spawned gloo ranks


def _worker(rank, world, argv):
    pretrain(argv)


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    d = tmp_path_factory.mktemp("scaling")
    out = {}
    for tp, dp in LAYOUTS:
        log = d / f"tp{tp}_dp{dp}.jsonl"
        run_distributed(
            _worker,
            tp * dp,
            ARGS + ["--tensor-model-parallel-size", str(tp), "--log-json", str(log)],
        )
        out[(tp, dp)] = [json.loads(line)["loss"] for line in open(log) if '"loss"' in line]
    return out


def test_loss_curves_agree_across_layouts(curves):
    ref = curves[(1, 1)]
    assert len(ref) == 10 and ref[-1] < ref[0]
    for layout, losses in curves.items():
        worst = max(abs(a - b) / b for a, b in zip(losses, ref))
        assert worst < 1e-4, f"TP,DP={layout}: loss strays {worst:.1e} from TP=1,DP=1"
