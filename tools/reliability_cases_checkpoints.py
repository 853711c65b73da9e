"""The reliability probe's checkpoint cases: --save and --load (see
tools/reliability_cases.py).
"""

from __future__ import annotations

from reliability_runs import (
    TINY,
    Case,
    base_untouched,
    locked_save,
    pretrain,
    save_survived_kill,
    torchrun,
)


def checkpoint_cases() -> list:
    """--save and --load: what could overwrite, hide or misread a checkpoint. $D/ck-base
    holds iterations 2 and 4 of $TINY; the other ck-* directories are copies of it."""
    base = "$D/ck-base"
    c = lambda name, args, needle, **kw: Case(
        "checkpoints", name, pretrain(*TINY, *args), needle, **kw
    )
    held = "already holds checkpoints (iterations 2, 4)"
    return [
        c(
            "misspelled --load, --save holds checkpoints",
            ["--load", "$D/ck-bse", "--save", base],
            held,
            check=base_untouched,
        ),
        c(
            "no --load, --save holds checkpoints",
            ["--save", base],
            f"{held} this run would overwrite or hide (no --load)",
            check=base_untouched,
        ),
        c(
            "--load an older iteration of --save",
            ["--load", f"{base}/iter_0000002", "--save", base],
            "resumes iteration 2, not the newest",
            check=base_untouched,
        ),
        c(
            "--finetune into its own --save",
            ["--load", base, "--save", base, "--finetune"],
            "--finetune restarts at iteration 0",
            check=base_untouched,
        ),
        c("--save is a file", ["--save", "$D/afile"], "--save $D/afile: is a file"),
        c("--save under a file", ["--save", "$D/afile/ck"], "--save $D/afile/ck: not writable"),
        c(
            "--save in use by another job",
            ["--save", "$D/ck-locked"],
            "in use by another job",
            runner=locked_save,
        ),
        c(
            "a model flag differs from the checkpoint",
            ["--load", base, "--num-layers", "3", "--train-iters", "6"],
            "--num-layers is 3 here but 2 in the checkpoint",
            code=1,
            check=base_untouched,
        ),
        c(
            "hand-edited manifest (TP 1 -> 2)",
            ["--load", "$D/ck-edit", "--train-iters", "6"],
            "manifest.json: does not match",
            code=1,
        ),
        c(
            "truncated optimizer file",
            ["--load", "$D/ck-trunc", "--train-iters", "6"],
            "optim_dp000.pt",
            code=1,
        ),
        c(
            "--load not a checkpoint",
            ["--load", "$D/emptydir", "--save", "$D/ck-fresh"],
            "no checkpoint in $D/emptydir: starting from scratch",
            expect="ok",
        ),
        c(
            "--load an iter_* directory",
            ["--load", f"{base}/iter_0000002", "--save", "$D/ck-from2", "--train-iters", "4"],
            "at iteration 2",
            expect="ok",
            check=base_untouched,
        ),
        c(
            "--override-existing-checkpoints",
            [
                "--load",
                "$D/ck-over/iter_0000002",
                "--save",
                "$D/ck-over",
                "--override-existing-checkpoints",
                "--train-iters",
                "4",
            ],
            "--override-existing-checkpoints: $D/ck-over holds iterations 2, 4",
            expect="ok",
        ),
        c(
            "the lock of a job that is gone",
            ["--load", "$D/ck-stale", "--save", "$D/ck-stale", "--train-iters", "6"],
            "saved checkpoint $D/ck-stale/iter_0000006",
            expect="ok",
        ),
        Case(
            "checkpoints",
            "killed during a save (torchrun 2)",
            torchrun(
                2, *TINY, "--train-iters", "4", "--save", "$D/ck-killed", "--save-interval", "1"
            ),
            "lost contact with another rank during the checkpoint save at iteration 3",
            code=17,
            env={"MP_OFFLOAD_CKPT_FAULT": "before_rename:3"},
            check=save_survived_kill,
        ),
    ]
