"""A save whose slowest rank takes longer than --distributed-timeout-minutes still
completes: the ranks wait for each other in a group whose timeout follows the save's size."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import free_port, run_distributed
from helpers import CKPT_RUN

from mp_offload import parallel_state as ps
from mp_offload.checkpoint import on_disk as fmt
from mp_offload.checkpoint import save_group as sg
from mp_offload.checkpoint.save import save_checkpoint
from mp_offload.config import parse_args, resolve
from mp_offload.model.gpt import GPTModel
from mp_offload.optimizer import build_optimizer
from mp_offload.runtime import distributed

TIMEOUT_S = 2  # the run's collective timeout here
SLOW_S = 5  # rank 1's optimizer file takes this long to write


def test_the_save_timeout_follows_the_largest_rank(monkeypatch):
    monkeypatch.setattr(distributed, "_TIMEOUT_MINUTES", 10.0)
    assert sg.save_timeout_s(0) == 600
    # 70B at TP=8 on one node: ~8.75e9 params a rank, 14 B each written and read back
    big = 14 * 8_750_000_000
    assert sg.save_timeout_s(big) == 600 + 60 * -(-2 * big / sg.FLOOR_BYTES_PER_S // 60)
    assert sg.save_timeout_s(big) > 2.7 * 3600


def _slow_rank_worker(rank, world, port, root):
    dist.barrier()  # both ranks' first group is up before either tears it down
    dist.destroy_process_group()  # again, with the short timeout the test is about
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    distributed._TIMEOUT_MINUTES = TIMEOUT_S / 60
    ps.initialize_model_parallel(1, timedelta(seconds=TIMEOUT_S))
    args = resolve(parse_args(CKPT_RUN), world)
    torch.manual_seed(0)
    model = GPTModel(args.model)
    opt = build_optimizer(model, args, torch.device("cpu"))
    nbytes = sg.planned_bytes(model, opt, ps.get_data_parallel_rank())
    sg.FLOOR_BYTES_PER_S = nbytes / 10  # this tiny save "takes" 20 s at the floor rate
    write = fmt.write_file

    def slow_write(obj, path, text=False):
        if rank == 1 and path.endswith(fmt.optim_file(0, 1)):
            time.sleep(SLOW_S)  # slow storage, beyond the collective timeout
        return write(obj, path, text)

    fmt.write_file = slow_write
    save_checkpoint(root, 1, 8, model, opt, args)
    assert fmt.is_complete(root, 1)


@pytest.mark.slow
def test_a_rank_slower_than_the_collective_timeout_saves(tmp_path):
    run_distributed(_slow_rank_worker, 2, free_port(), str(tmp_path))
