"""The reliability probe's runtime cases: divergence, ranks alone, stalled or killed,
signals to torchrun, valid runs, and mistakes under torchrun (see
tools/reliability_cases.py).
"""

from __future__ import annotations

from reliability_runs import (
    DATA,
    MODEL,
    TINY,
    Case,
    free_port,
    kill9_torchrun,
    no_checkpoint,
    port_in_use,
    pretrain,
    sigterm_torchrun,
    torchrun,
)


def runtime_cases() -> list:
    port = str(free_port())
    lone = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    c = lambda name, cmd, needle, **kw: Case("runtime", name, cmd, needle, **kw)
    return [
        c(
            "fp16: every step overflows",
            pretrain(
                *TINY,
                "--train-iters",
                "8",
                "--fp16",
                "--initial-loss-scale",
                "1e30",
                "--min-loss-scale",
                "1e30",
                "--max-consecutive-skipped-steps",
                "3",
                "--save",
                "$D/ck-fp16",
            ),
            "3 consecutive steps skipped",
            code=1,
            check=no_checkpoint,
        ),
        c(
            "fp32: the loss becomes NaN",
            pretrain(*TINY, "--train-iters", "20", "--lr", "1e30"),
            "loss is nan",
            code=1,
        ),
        c(
            "WORLD_SIZE=2, rank 0 alone",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.05"),
            f"waiting for 2 ranks at 127.0.0.1:{port} (1 of 2 joined",
            code=1,
            env=lone,
        ),
        c(
            "WORLD_SIZE=2, rank 1 alone",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.05"),
            "rank 0 never answered",
            code=1,
            env=dict(lone, RANK="1", MASTER_PORT=str(free_port())),
        ),
        c(
            "MASTER_PORT not a number",
            pretrain(*TINY),
            "MASTER_PORT 'abc' is not a port",
            code=1,
            env=dict(lone, MASTER_PORT="abc"),
        ),
        c(
            "MASTER_PORT in use",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.1"),
            "the port is in use",
            code=1,
            runner=port_in_use,
        ),
        c(
            "a rank stalls (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "10", "--distributed-timeout-minutes", "0.25"),
            "timed out after 15 s during iteration 3 waiting for rank 1, which did not reach it",
            code=1,
            env={"MP_OFFLOAD_FAULT_STALL": "1:3:120"},
            first=True,
        ),
        c(
            "a rank is killed (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "10"),
            "lost contact with another rank during iteration 3",
            code=13,
            env={"MP_OFFLOAD_FAULT_ONCE": "$D/killed-once:3"},
        ),
        c(
            "disk full under --log-json (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "4", "--log-json", "/dev/full"),
            "--log-json /dev/full: No space left on device",
            code=1,
        ),
        c(
            "SIGTERM to torchrun: step finished, saved",
            torchrun(2, *TINY),
            "stop requested",
            expect="ok",
            runner=sigterm_torchrun,
        ),
        c(
            "kill -9 of torchrun: workers stop and save",
            torchrun(2, *TINY),
            "stop requested",
            expect="ok",
            runner=kill9_torchrun,
        ),
        c("valid run, mock data", pretrain(*TINY), "iteration 2/2 ", expect="ok"),
        c(
            "valid run, NullTokenizer data",
            pretrain(*DATA, "--data-path", "$D/small_text_document"),
            "iteration 2/2 ",
            expect="ok",
        ),
        c(
            "valid run, SentencePiece data, TP=2",
            torchrun(
                2,
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/sp.model",
                "--tensor-model-parallel-size",
                "2",
            ),
            "iteration 2/2 ",
            expect="ok",
        ),
        c(
            "run shorter than its warmup: a warning",
            pretrain(*TINY, "--lr-warmup-iters", "5"),
            "warning: --lr-warmup-iters 5 is longer than the run",
            expect="ok",
        ),
        c("--help", pretrain("--help"), "usage:", expect="ok"),
        c(
            "misspelled flag (torchrun 4)",
            torchrun(4, *TINY, "--hiden-size", "64"),
            "did you mean --hidden-size?",
        ),
        c(
            "misspelled flag with --config (torchrun 4)",
            torchrun(4, "--config", "$D/run.yaml", "--hiden-size", "64"),
            "did you mean --hidden-size?",
        ),
        c(
            "missing tokenizer (torchrun 4)",
            torchrun(
                4,
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/nope.model",
            ),
            "no such file",
        ),
        c(
            ".bin as the prefix (torchrun 4)",
            torchrun(4, *DATA, "--data-path", "$D/small_text_document.bin"),
            "give the prefix",
        ),
    ]
