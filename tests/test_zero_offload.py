"""ZeRO(-Offload) optimizer vs a single-process torch.optim.AdamW run (gloo, CPU)."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from helpers import ADAM_HP as HP
from helpers import micro_batches, tiny_gpt_config
from zero_helpers import build_zero, host_tensor

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.torch_adamw import param_groups
from mp_offload.tensor_parallel import merge_partitions
from mp_offload.training import train_step

CFG = tiny_gpt_config()
GBS = 8
CPU = torch.device("cpu")


_DATA = MockGPTDataset(10_000, 16, 96, seed=3)  # learnable, so convergence is visible


def _tokens(step):
    return torch.stack([torch.from_numpy(_DATA[step * GBS + i]["text"]) for i in range(GBS)])


def _batch(step):
    t = _tokens(step)
    return t[:, :-1], t[:, 1:]


# Every Llama option, and the replicated activations as sequence shards.
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
    sequence_parallel=True,
)


def _model(group, cfg=None):
    torch.manual_seed(42)
    return GPTModel(cfg or GPTConfig(**CFG), tp_group=group)


def _reference(steps, cfg=None):
    """Unsplit model, full batch, torch AdamW + clip_grad_norm_: (losses, norms, model)."""
    model = _model(ps.ParallelGroup.single(), cfg)
    opt = torch.optim.AdamW(
        param_groups(model, HP["weight_decay"]), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"]
    )
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = model(x, y).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), HP["clip_grad"])))
        opt.step()
        losses.append(float(loss))
    return losses, norms, model


def _ours(
    steps,
    *,
    dtype=torch.float32,
    micro=None,
    dpu=None,
    offload=True,
    bucket=500,
    loss_scale=None,
    on_device=False,
    cfg=None,
):
    """TP x DP ZeRO run over the same data; returns (losses, norms, skipped, model, opt)."""
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GBS // dp
    micro = micro or per_rank
    model = _model(None, cfg)
    opt = build_zero(
        model,
        **HP,
        dp=ps.get_data_parallel_group(),
        tp=ps.get_tensor_model_parallel_group(),
        device="cpu",
        dtype=dtype,
        cpu_offload=offload,
        bucket_size=bucket,
        dpu_warmup_steps=dpu,
        loss_scale=loss_scale,
        micro_batches=per_rank // micro,
        accumulate_on_device=on_device,
    )
    losses, norms, skipped = [], [], []
    for step in range(steps):
        rows = _tokens(step)[dp_rank * per_rank :][:per_rank]
        out = train_step(
            model, opt, micro_batches(rows, micro), per_rank // micro, HP["lr"],
            ps.get_data_parallel_group(), CPU,
        )  # fmt: skip
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
        skipped.append(out.result.skipped)
    opt.flush()
    return losses, norms, skipped, model, opt


def _merged_params(model):
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().float()
        if p.tensor_model_parallel and group.size > 1:
            parts = [torch.empty_like(t) for _ in range(group.size)]
            dist.all_gather(parts, t.contiguous(), group=group.torch_group())
            t = merge_partitions(parts, p.partition_dim, p.partition_stride)
        out[name] = t[:96] if name in ("wte.weight", "output_layer.weight") else t
    return out


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


def _fp32_worker(rank, world):
    ps.initialize_model_parallel(2)  # TP=2 x DP=2
    steps = 30
    ref_losses, ref_norms, ref_model = _reference(steps)
    losses, norms, skipped, model, _ = _ours(steps)
    # fp32 everywhere; only summation order differs (TP/DP reductions, bucketed
    # reduce-scatter, SIMD Adam): measured ~1e-6 relative, so 1e-4 leaves headroom.
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(norms, ref_norms)):  # clipping saw torch's norm
        assert abs(a - b) <= 1e-4 * b, f"step {i}: grad norm {a} vs clip_grad_norm_ {b}"
    assert not any(skipped)
    assert ref_norms[0] > HP["clip_grad"], "the test must exercise clipping"
    # Parameters: Adam divides by sqrt(v), so gradients that are zero in exact arithmetic
    # (e.g. the key bias: softmax ignores a shift) are pure rounding noise that Adam turns
    # into lr-sized steps. Measured worst element ~2e-4 of the tensor's max; bound 1e-3.
    ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}
    ref_params["wte.weight"] = ref_params["wte.weight"][:96]
    err = _max_rel(_merged_params(model), ref_params)
    assert err < 1e-3, f"parameters after {steps} steps: max relative error {err:.2e}"
    assert losses[-1] < losses[0] - 0.5

    # Accumulation over 4 micro-batches equals one 4x micro-batch.
    acc = _ours(4, micro=1)
    one = _ours(4, micro=4)
    for a, b in zip(acc[0], one[0]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert _max_rel(_merged_params(acc[3]), _merged_params(one[3])) < 1e-3
    # The same 4 micro-batches summed on the device, reduce-scattered once per step.
    dev = _ours(4, micro=1, on_device=True)
    for a, b in zip(dev[0], acc[0]):
        assert abs(a - b) <= 1e-5 * abs(b)
    for a, b in zip(dev[1], acc[1]):
        assert abs(a - b) <= 1e-5 * abs(b)

    # DPU: the first N steps equal the synchronous run; afterwards it still converges.
    dpu = _ours(steps, dpu=5)
    assert dpu[0][:6] == losses[:6], "DPU must not change the synchronous warmup steps"
    assert dpu[0][6] != losses[6], "step 7 must run on one-step-stale parameters"
    assert dpu[0][-1] < dpu[0][0] - 0.5, f"DPU run did not converge: {dpu[0][::6]}"


@pytest.mark.slow
def test_tp2_dp2_offload_tracks_torch_adamw_fp32():
    run_distributed(_fp32_worker, 4)


def _llama_worker(rank, world):
    """All Llama options with --sequence-parallel at TP=2 x DP=2, ZeRO-Offload in fp32:
    the SP gradient hooks run before the reducer's bucket hooks, so the run tracks the
    unsplit torch AdamW reference as closely as the GPT-2 one does."""
    ps.initialize_model_parallel(2)
    cfg = GPTConfig(**CFG, **LLAMA)
    steps = 15
    ref_losses, ref_norms, ref_model = _reference(steps, cfg)
    losses, norms, skipped, model, _ = _ours(steps, cfg=cfg, micro=2)
    assert not any(skipped)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        assert abs(a - b) <= 1e-4 * b, f"step {i}: grad norm {a} vs clip_grad_norm_ {b}"
    assert ref_norms[0] > HP["clip_grad"], "the test must exercise clipping"
    ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}
    for name in ("wte.weight", "output_layer.weight"):
        ref_params[name] = ref_params[name][:96]
    err = _max_rel(_merged_params(model), ref_params)
    assert err < 1e-3, f"parameters after {steps} steps: max relative error {err:.2e}"
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_llama_sequence_parallel_tp2_dp2_offload_tracks_torch_adamw():
    run_distributed(_llama_worker, 4)


def _low_precision_worker(rank, world):
    ps.initialize_model_parallel(2)
    steps = 30
    ref_losses, _, _ = _reference(steps)
    losses, _, skipped, model, opt = _ours(steps, dtype=torch.bfloat16)
    assert not any(skipped)
    assert all(math.isfinite(v) for v in losses)
    worst = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    assert worst < 0.05, f"bf16 strays {worst:.3f} from the fp32 reference"
    assert losses[-1] < losses[0] - 0.5
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())

    # fp16 with an absurd initial scale: the first step overflows and is skipped.
    scale = dict(initial=2.0**120, min=1.0, window=1000, hysteresis=1)
    losses, _, skipped, model, opt = _ours(3, dtype=torch.float16, loss_scale=scale)
    assert skipped[0], "overflow must skip the step"
    assert opt.scaler.scale < 2.0**120 and opt.scaler.overflows >= 1
    assert torch.isfinite(host_tensor(opt, "master")).all(), "master weights must stay finite"
    assert opt.step_count == sum(not s for s in skipped)


@pytest.mark.slow
def test_bf16_tracks_loosely_and_fp16_overflow_skips():
    run_distributed(_low_precision_worker, 4)


def _offload_off_worker(rank, world):
    ps.initialize_model_parallel(1)  # DP=2: plain ZeRO-2 on the device equals offload
    a = _ours(5, offload=True)
    b = _ours(5, offload=False)
    for x, y in zip(a[0], b[0]):
        assert abs(x - y) <= 1e-5 * abs(y)


@pytest.mark.slow
def test_offload_off_equals_offload():
    run_distributed(_offload_off_worker, 2)


def _traffic(k, on_device, dtype=torch.bfloat16, reduce_dtype=None, **kw):
    single = ps.ParallelGroup.single()
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG), tp_group=single)
    opt = build_zero(
        model,
        **HP,
        dp=single,
        tp=single,
        device="cpu",
        dtype=dtype,
        cpu_offload=True,
        bucket_size=2000,
        micro_batches=k,
        accumulate_on_device=on_device,
        reduce_dtype=reduce_dtype,
        **kw,
    )
    for step in range(2):
        train_step(model, opt, micro_batches(_tokens(step), GBS // k), k, 1e-3, single, CPU)
    return opt.stats()["host_device_bytes_per_param"], opt.memory_bytes()


def test_host_device_bytes_per_param_with_and_without_device_accumulation():
    assert _traffic(1, False)[0] == 4.0  # 2 down + 2 up, the paper's minimum
    assert _traffic(4, False)[0] == 10.0  # 2k + 2: every micro-batch comes down
    on_device, mem = _traffic(4, True)
    assert on_device == 6.0  # summed on the device in fp32 (as the host sums), down once
    assert mem["device"]["grad_accumulation"] == 2 * mem["device"]["params"]  # fp32 vs bf16
    assert mem["host"]["grads"] == 0, "the staging is the whole gradient: no fp32 copy"
    on_device, mem = _traffic(4, True, accumulate_dtype=torch.bfloat16)
    assert on_device == 4.0  # asked to sum in bf16: 2 down + 2 up
    assert mem["device"]["grad_accumulation"] == mem["device"]["params"]
    assert _traffic(1, False, reduce_dtype=torch.float32)[0] == 6.0  # 4 down (fp32) + 2 up


def test_device_keeps_only_low_precision_params_and_fixed_buckets():
    """docs/DESIGN.md §4: with offload the device holds 2-byte params and fixed-size buckets."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG), tp_group=ps.ParallelGroup.single())
    opt = build_zero(
        model,
        **HP,
        dp=ps.ParallelGroup.single(),
        tp=ps.ParallelGroup.single(),
        device="cpu",
        dtype=torch.bfloat16,
        cpu_offload=True,
        bucket_size=2000,
    )
    x, y = _batch(0)
    opt.zero_grad()
    opt.backward(model(x, y).mean())
    assert all(p.grad is None for p in model.parameters()), "no gradient kept on the device"
    flat_ptr = opt.flat.untyped_storage().data_ptr()
    for p in model.parameters():  # every parameter is a bf16 view of the one flat buffer
        assert p.dtype == torch.bfloat16 and p.untyped_storage().data_ptr() == flat_ptr
    rep = opt.memory_bytes()
    assert set(rep["device"]) == {"params", "grad_buckets"}
    assert rep["device"]["params"] == 2 * opt.flat.numel()
    numel = sum(p.numel() for p in model.parameters())
    assert rep["device"]["grad_buckets"] < 2 * numel / 2, "buckets must not scale with the model"
    n = opt.layout.slice_numel
    assert {k: rep["host"][k] for k in ("master", "exp_avg", "exp_avg_sq")} == {
        k: 4 * n for k in ("master", "exp_avg", "exp_avg_sq")
    }
    # one micro-batch: Adam reads the bf16 gradients as they came down, no fp32 copy; on
    # this CPU "device" it writes the new params into the flat buffer (no 2 * n staging)
    assert rep["host"]["grads"] == 0 and rep["host"]["staging"] == 2 * n
    opt.step(1e-3)


def _bf16_steps(staging: bool, dpu=None):
    """Three bf16 offload steps on one rank; ``staging``: Adam writes into a separate host
    buffer that the publish copies into the params (what CUDA does)."""
    torch.manual_seed(0)
    single = ps.ParallelGroup.single()
    model = GPTModel(GPTConfig(**CFG), tp_group=single)
    opt = build_zero(
        model,
        **HP,
        dp=single,
        tp=single,
        device="cpu",
        dtype=torch.bfloat16,
        cpu_offload=True,
        bucket_size=2000,
        dpu_warmup_steps=dpu,
    )
    if staging:
        for state in opt.host_side.states:
            state.master_form.hi = torch.empty_like(opt.flat)
    losses = []
    for step in range(3):
        out = train_step(model, opt, iter([_tokens(step)]), 1, 1e-3, single, CPU)
        losses.append(out.loss)
    opt.flush()
    return opt, losses


def test_cpu_device_adam_writes_the_params_in_place():
    """CPU device, one DP rank, no DPU: the Adam's bf16 output is the model's flat buffer
    (no publish copy), with the bits of the staging + copy path."""
    opt, losses = _bf16_steps(staging=False)
    assert host_tensor(opt, "param_staging") is opt.flat
    ref, ref_losses = _bf16_steps(staging=True)
    assert losses == ref_losses
    assert torch.equal(opt.flat, ref.flat)
    assert torch.equal(host_tensor(opt, "master"), host_tensor(ref, "master"))
    dpu, _ = _bf16_steps(staging=False, dpu=1)  # forward t+1 runs beside Adam t
    assert host_tensor(dpu, "param_staging").data_ptr() != dpu.flat.data_ptr()


def test_bf16_moments_track_fp32_moments():
    """Adam's moments in bf16 (8 B/param less host state) stay close to fp32 moments."""
    single = ps.ParallelGroup.single()
    runs = {}
    for mdt in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**CFG), tp_group=single)
        opt = build_zero(
            model,
            **HP,
            dp=single,
            tp=single,
            device="cpu",
            dtype=torch.bfloat16,
            cpu_offload=True,
            exp_avg_dtype=mdt,
            exp_avg_sq_dtype=mdt,
        )
        losses = []
        for step in range(20):
            out = train_step(model, opt, iter([_tokens(step)]), 1, HP["lr"], single, CPU)
            losses.append(out.loss)
        assert host_tensor(opt, "exp_avg").dtype == opt.state_dict()["exp_avg_sq"].dtype == mdt
        runs[mdt] = losses
    assert runs[torch.bfloat16][-1] < runs[torch.bfloat16][0] - 0.5
    worst = max(abs(a - b) / b for a, b in zip(runs[torch.bfloat16], runs[torch.float32]))
    assert worst < 0.02, f"bf16 moments stray {worst:.3f} from fp32 moments"
