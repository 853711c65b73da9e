"""OffloadAdamW on a model the project does not define, in the user's own loop: equal to
torch.optim.AdamW + clip_grad_norm_, at DP=2 equal to one process, bf16 close to torch's
autocast, a mid-run resume bitwise, and every legal mode of the options table steps."""

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn
from zero_helpers import mode_id

from mp_offload import OffloadAdamW
from mp_offload.optimizer.options import legal_modes

VOCAB, D, CLIP = 50, 32, 20.0  # CLIP: about the median global norm of this run


class Odd(nn.Module):
    """Conv + GRU + MultiheadAttention + LayerNorm, a tied embedding/output, a frozen
    sub-module and a parameter used on odd steps only."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.gru = nn.GRU(D, D, batch_first=True)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.odd = nn.Linear(D, D)
        self.out = nn.Linear(D, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x, y, step: int):
        h = self.conv(self.emb(x).transpose(1, 2)).transpose(1, 2)
        h, _ = self.gru(h)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm(h + a) + self.frozen(h)
        if step % 2:
            h = h + self.odd(h)
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1).float(), y.flatten())


def _groups(m):
    named = list(m.named_parameters())
    return [
        dict(params=[p for _, p in named if p.ndim > 1], weight_decay=0.1),
        dict(params=[p for _, p in named if p.ndim <= 1], weight_decay=0.0),
    ]


def _batch(step: int, rows=slice(None)):
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, VOCAB, (4, 12), generator=g) for _ in range(2))
    return x[rows], y[rows]


def _run(make, steps=20, start=0, m=None, opt=None, rows=slice(None), autocast=None):
    """The user's loop: LambdaLR warm-up, clip_grad_norm_ at CLIP; (losses, norms, m, opt)."""
    if m is None:
        torch.manual_seed(0)
        m = Odd()
        opt = make(_groups(m))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    for _ in range(start):
        sched.step()
    losses, norms = [], []
    for s in range(start, start + steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            loss = m(*_batch(s, rows), s)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, m, opt


def _torch(groups):
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def _ours(groups, **kw):
    return OffloadAdamW(groups, lr=3e-3, betas=(0.9, 0.95), bucket_size=2000, **kw)


def _no_key(in_proj_bias):
    """The query and value thirds of MultiheadAttention's in_proj_bias."""
    return torch.cat([in_proj_bias[:D], in_proj_bias[2 * D :]])


def _params(m):
    return {n: p.detach().float().clone() for n, p in m.named_parameters()}


def test_equals_torch_adamw_with_clipping_in_the_users_loop():
    ref, ours = _run(_torch), _run(_ours)
    assert sorted(ref[1])[5] < CLIP < sorted(ref[1])[-5], "clipping must apply on some steps"
    for a, b in zip(ref[0], ours[0]):
        assert abs(a - b) <= 1e-6 * abs(a), (a, b)
    for a, b in zip(ref[1], ours[1]):
        assert abs(a - b) <= 1e-6 * abs(a), (a, b)
    want, got = _params(ref[2]), _params(ours[2])
    assert torch.equal(got["frozen.weight"], want["frozen.weight"])
    for name in want:
        a, b = want[name], got[name]
        if name == "attn.in_proj_bias":  # the key bias has a zero gradient (softmax is
            a, b = _no_key(a), _no_key(b)  # shift-invariant): Adam amplifies its noise
        err = float((a - b).abs().max() / a.abs().max())
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_a_parameter_without_a_gradient_is_not_stepped():
    """The odd-step parameter is untouched by an even step, as AdamW skips a None .grad."""
    _, _, m, opt = _run(_ours, steps=1)  # step 0: even, `odd` unused
    torch.manual_seed(0)
    fresh = Odd()
    assert torch.equal(m.odd.weight, fresh.odd.weight)
    assert not torch.equal(m.norm.weight, fresh.norm.weight)
    slots = opt.zero.layout.slots
    steps = {id(s.param): n for s, n in zip(slots, opt.zero.slot_steps)}
    assert steps[id(m.odd.weight)] == 0 and steps[id(m.norm.weight)] == 1


def test_bf16_tracks_torch_autocast():
    ref = _run(_torch, autocast=torch.bfloat16)
    # bf16 weights on the device (the frozen sub-module stays fp32: autocast mixes them)
    ours = _run(lambda g: _ours(g, dtype=torch.bfloat16), autocast=torch.bfloat16)
    for a, b in zip(ref[0], ours[0]):
        assert abs(a - b) <= 0.02 * abs(a), (a, b)


def test_a_mid_run_resume_is_bitwise():
    whole = _run(_ours, steps=10)
    first = _run(_ours, steps=5)
    state = first[3].state_dict()
    torch.manual_seed(0)
    m = Odd()
    opt = _ours(_groups(m))
    opt.load_state_dict(state)
    rest = _run(_ours, steps=5, start=5, m=m, opt=opt)
    assert first[0] + rest[0] == whole[0]
    for name, p in _params(whole[2]).items():
        assert torch.equal(p, _params(m)[name]), name


def _dp2_worker(rank, world, out):
    import torch.distributed as dist

    rows = slice(2 * rank, 2 * rank + 2)  # half of the batch on each rank
    losses, norms, m, _ = _run(_ours, steps=8, rows=rows)
    total = torch.tensor(losses)
    dist.all_reduce(total)
    if rank == 0:
        torch.save(dict(losses=(total / world).tolist(), norms=norms, params=_params(m)), out)


def test_two_ranks_with_half_batches_equal_one_process_with_the_whole(tmp_path):
    out = str(tmp_path / "dp2.pt")
    run_distributed(_dp2_worker, 2, out)
    got = torch.load(out)
    losses, norms, m, _ = _run(_ours, steps=8)
    for a, b in zip(losses, got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)
    for a, b in zip(norms, got["norms"]):
        assert abs(a - b) <= 1e-5 * abs(a)
    want = _params(m)
    for name, p in got["params"].items():
        a, b = want[name], p
        if name == "attn.in_proj_bias":
            a, b = _no_key(a), _no_key(b)
        assert float((a - b).abs().max() / a.abs().max()) < 1e-4, name


def _dp2_save_worker(rank, world, path):
    """Five steps at DP=2 on half batches; the state saved from DP rank 0 (the others'
    state_dict holds no tensors, and loading it is refused in one line)."""
    _, _, _, opt = _run(_ours, steps=5, rows=slice(2 * rank, 2 * rank + 2))
    state = opt.state_dict()
    if rank == 0:
        assert len(state["state"]["master"]) == len(opt.zero.layout.slots) > 3
        torch.save(state, path)
    else:
        assert state["state"] is None and state["step"] == 5
        with pytest.raises(ValueError, match="holds no tensors .* load the one DP rank 0 saved"):
            opt.load_state_dict(state)


def test_a_state_saved_at_two_ranks_resumes_in_one_process(tmp_path):
    """Resume at another DP size: the rank-0 state of a DP=2 run (half batches each) loads
    into one process, which trains on with whole batches like an uninterrupted run."""
    path = str(tmp_path / "optimizer.pt")
    run_distributed(_dp2_save_worker, 2, path)
    whole = _run(_ours, steps=8)
    torch.manual_seed(0)
    m = Odd()
    opt = _ours(_groups(m))
    opt.load_state_dict(torch.load(path, mmap=True, weights_only=True))
    rest = _run(_ours, steps=3, start=5, m=m, opt=opt)
    for a, b in zip(whole[0][5:], rest[0]):
        assert abs(a - b) <= 1e-5 * abs(a)
    want = _params(whole[2])
    for name, p in _params(m).items():
        a, b = (_no_key(want[name]), _no_key(p)) if name == "attn.in_proj_bias" else (want[name], p)
        assert float((a - b).abs().max() / a.abs().max()) < 1e-4, name


@pytest.mark.parametrize("options", legal_modes(bucket_size=2000), ids=mode_id)
def test_every_legal_mode_constructs_and_steps(options):
    fields = {
        k: getattr(options, k)
        for k in ("offload_fraction", "store_param_remainders", "exp_avg_dtype",
                  "exp_avg_sq_dtype", "overlap_cpu_optimizer", "dpu_warmup_steps",
                  "accumulate_on_device", "cpu_offload", "loss_scale")
    }  # fmt: skip
    k = options.micro_batches
    torch.manual_seed(0)
    m = Odd()
    opt = _ours(_groups(m) if not _q8(options) else m.parameters(),
                dtype=options.dtype, gradient_accumulation_steps=k, **fields)  # fmt: skip
    before = _params(m)
    for s in (1, 3):  # odd steps: every parameter gets a gradient (8-bit steps whole buckets)
        for part in range(k):
            x, y = _batch(s)
            low = options.dtype != torch.float32  # the frozen sub-module stays fp32
            with torch.autocast("cpu", dtype=options.dtype, enabled=low):
                loss = m(x[part::k], y[part::k], s) / k
            opt.backward(loss)
        opt.step()
    opt.state_dict()
    after = _params(m)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def _q8(o) -> bool:
    return torch.uint8 in (o.exp_avg_dtype, o.exp_avg_sq_dtype)


def test_bad_input_is_one_line():
    m = Odd()
    with pytest.raises(ValueError, match="overlap_cpu_optimizer=True and dpu_warmup_steps=1"):
        _ours(m.parameters(), overlap_cpu_optimizer=True, dpu_warmup_steps=1)
    with pytest.raises(TypeError, match="unknown keyword 'offload'"):
        _ours(m.parameters(), offload=0.5)
    opt = _ours(m.parameters())
    loss = m(*_batch(1), 1)
    loss.backward()
    with pytest.raises(RuntimeError, match="pass clip_grad= to OffloadAdamW"):
        torch.nn.utils.clip_grad_norm_(list(m.parameters())[:2], 1.0)
    opt.step()


def _ddp_worker(rank, world):
    m = Odd()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    with pytest.raises(ValueError, match="averages the gradients .* itself"):
        _ours(ddp.parameters())


def test_a_ddp_wrapped_model_is_refused_in_one_line():
    run_distributed(_ddp_worker, 1)
