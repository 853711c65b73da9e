"""The Llama options and sequence parallelism.

Each option against a plain single-device restatement written here (RoPE against the
rotation formula, RMSNorm against its definition, SwiGLU against silu(gate) * up, GQA
against repeated K/V heads), the whole Llama-style model against HF transformers'
LlamaForCausalLM, and (gloo, CPU) TP=2/4 with and without --sequence-parallel against
TP=1; the bytes autograd saves for a block against the planner's activation formula.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import loss_and_grads, merged_grad, run_distributed

from mp_offload import parallel_state as ps
from mp_offload.config import ConfigError, parse_args, validate
from mp_offload.model.block import (
    ParallelAttention,
    ParallelMLP,
    RotaryEmbedding,
    TransformerBlock,
    apply_rotary,
    build_norm,
)
from mp_offload.model.gpt import GPTConfig, GPTModel, flops_per_token, num_parameters
from mp_offload.planner import estimate_activations
from mp_offload.tensor_parallel import model_parallel_seed

SINGLE = ps.ParallelGroup.single()
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=4,
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
)
TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    ffn_hidden_size=96,
    seq_length=16,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**TINY, **kw})


# ----------------------------------------------------------------- each option alone
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_is_the_rotation_of_channel_pairs(percent):
    """Pair (i, i + r/2) of the first r channels turns by pos * base^(-2i/r); the rest pass."""
    b, heads, s, d, base = 2, 3, 7, 16, 500000.0
    x = torch.randn(b, heads, s, d, dtype=torch.float64)
    rope = RotaryEmbedding(d, base, percent)
    y = apply_rotary(x, *rope(s, torch.float64, None))
    r = int(d * percent)
    want = x.clone()
    for pos in range(s):
        for i in range(r // 2):
            angle = pos * base ** (-2 * i / r)
            c, sn = math.cos(angle), math.sin(angle)
            a, z = x[..., pos, i], x[..., pos, i + r // 2]
            want[..., pos, i] = a * c - z * sn
            want[..., pos, i + r // 2] = z * c + a * sn
    assert torch.allclose(y, want, atol=1e-6)
    # What rotary buys: q.k depends on the positions' difference only.
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    cos, sin = rope(s, torch.float64, None)

    def at(v, p):
        return apply_rotary(v.view(1, 1, 1, d), cos[p : p + 1], sin[p : p + 1]).flatten()

    assert torch.allclose(at(q, 5) @ at(k, 2), at(q, 4) @ at(k, 1))


def test_rope_rejects_an_odd_rotary_dimension():
    assert RotaryEmbedding(16, 10000, 0.3).dim == 4  # int(4.8), as Megatron and HF
    for head_dim, percent in ((10, 0.3), (16, 0.1)):  # 3 channels; 1 channel
        with pytest.raises(ValueError, match="--rotary-percent"):
            RotaryEmbedding(head_dim, 10000, percent)


def test_rmsnorm_is_its_definition():
    cfg = _cfg(normalization="RMSNorm", layernorm_epsilon=1e-6)
    norm = build_norm(cfg, False, torch.float64, None)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64, dtype=torch.float64) * 3
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), want, atol=1e-12)
    ln = build_norm(_cfg(), False, torch.float64, None)  # the default stays LayerNorm
    assert isinstance(ln, torch.nn.LayerNorm) and ln.bias is not None


@pytest.mark.parametrize("bias", [True, False])
def test_swiglu_mlp_is_silu_gate_times_up(bias):
    torch.manual_seed(0)
    mlp = ParallelMLP(
        _cfg(swiglu=True, disable_bias_linear=not bias), SINGLE, False, torch.float64, None
    )
    assert mlp.fc1.weight.shape == (2 * 96, 64) and mlp.fc1.weight.partition_stride == 2
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    w_gate, w_up = mlp.fc1.weight.chunk(2)  # fused [gate; up]
    b_gate, b_up = mlp.fc1.bias.chunk(2) if bias else (0, 0)
    gate, up = x @ w_gate.T + b_gate, x @ w_up.T + b_up
    want = (gate * torch.sigmoid(gate) * up) @ mlp.fc2.weight.T + (mlp.fc2.bias if bias else 0)
    assert torch.allclose(mlp(x), want, atol=1e-12)
    assert (mlp.fc1.bias is None) == (mlp.fc2.bias is None) == (not bias)


def _attention_by_hand(attn, x, groups, rope):
    """Causal softmax attention with each K/V head repeated for its a/G query heads."""
    b, s, h = x.shape
    a, d = attn.heads, attn.head_dim
    w = attn.qkv.weight.view(groups, a // groups + 2, d, h)  # per group [q.., k, v]
    q = torch.einsum("bsh,gjdh->bgjsd", x, w[:, :-2]).reshape(b, a, s, d)
    k = torch.einsum("bsh,gdh->bgsd", x, w[:, -2])
    v = torch.einsum("bsh,gdh->bgsd", x, w[:, -1])
    if rope is not None:
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    k, v = (t.repeat_interleave(a // groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, a * d)
    return y @ attn.proj.weight.T


@pytest.mark.parametrize("groups,rotary", [(2, False), (2, True), (1, True), (8, False)])
def test_gqa_attention_is_attention_with_repeated_kv_heads(groups, rotary):
    torch.manual_seed(1)
    cfg = _cfg(group_query_attention=True, num_query_groups=groups, disable_bias_linear=True)
    attn = ParallelAttention(cfg, SINGLE, False, torch.float64, None)
    assert attn.qkv.weight.shape == ((8 + 2 * groups) * 8, 64)
    x = torch.randn(2, 6, 64, dtype=torch.float64)
    rope = RotaryEmbedding(8, 10000, 1.0)(6, torch.float64, None) if rotary else None
    assert torch.allclose(attn(x, rope), _attention_by_hand(attn, x, groups, rope), atol=1e-10)


def test_gqa_without_a_grouped_kernel_repeats_kv_heads(monkeypatch):
    """Where SDPA has no fused grouped kernel (CUDA before sm80, fp32) the K/V heads are
    repeated before the call; same result."""
    import mp_offload.model.block as layers

    monkeypatch.setattr(layers, "sdpa_takes_groups", lambda q: False)
    torch.manual_seed(1)
    cfg = _cfg(group_query_attention=True, num_query_groups=2, disable_bias_linear=True)
    attn = ParallelAttention(cfg, SINGLE, False, torch.float64, None)
    x = torch.randn(2, 6, 64, dtype=torch.float64)
    rope = RotaryEmbedding(8, 10000, 1.0)(6, torch.float64, None)
    assert torch.allclose(attn(x, rope), _attention_by_hand(attn, x, 2, rope), atol=1e-10)


def test_untied_head_and_no_biases():
    torch.manual_seed(2)
    model = GPTModel(
        _cfg(untie_embeddings_and_output_weights=True, disable_bias_linear=True), tp_group=SINGLE
    )
    names = dict(model.named_parameters())
    head = names["output_layer.weight"]
    assert head.shape == (104, 64) and (
        head.tensor_model_parallel,
        head.partition_dim,
        head.partition_stride,
    ) == (True, 0, 1)
    assert head[100:].abs().max() == 0, "vocabulary padding rows start at zero"
    assert not torch.equal(head[:100], names["wte.weight"][:100])
    assert not [n for n in names if n.endswith(".bias") and (".attn." in n or ".mlp." in n)]
    x = torch.randn(2, 4, 64)
    assert torch.equal(model.head(x), F.linear(x, head))


OPTION_SETS = [
    {},
    dict(normalization="RMSNorm"),
    dict(swiglu=True),
    dict(position_embedding_type="rope"),
    dict(group_query_attention=True, num_query_groups=2),
    dict(untie_embeddings_and_output_weights=True),
    dict(disable_bias_linear=True),
    LLAMA,
]


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_parameter_count_and_flops_follow_the_options(opts):
    cfg = _cfg(**opts)
    model = GPTModel(cfg, tp_group=SINGLE, device="meta")
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    # FLOPs: 2 per weight element of the blocks' linear layers, attention, the head.
    matrices = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2
    )
    s, h, V = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size(1)
    fwd = 2 * matrices + cfg.num_layers * 4 * s * h + 2 * h * V
    assert flops_per_token(cfg) == 3 * fwd and flops_per_token(cfg, recompute=True) == 4 * fwd


def test_default_model_keeps_the_gpt2_names_and_shapes():
    names = {
        n: tuple(p.shape)
        for n, p in GPTModel(_cfg(), tp_group=SINGLE, device="meta").named_parameters()
    }
    assert names["wpe.weight"] == (16, 64) and names["blocks.0.attn.qkv.weight"] == (192, 64)
    assert names["blocks.0.ln1.bias"] == (64,) and names["blocks.1.mlp.fc2.bias"] == (64,)
    assert "output_layer.weight" not in names and len(names) == 2 + 2 * 12 + 2


@pytest.mark.parametrize(
    "argv,world,needle",
    [
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            1,
            "--num-attention-heads 8 is not divisible by --num-query-groups 3",
        ),
        (
            [
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--tensor-model-parallel-size",
                "4",
            ],
            4,
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (["--num-query-groups", "2"], 1, "--num-query-groups needs --group-query-attention"),
        (
            [
                "--sequence-parallel",
                "--tensor-model-parallel-size",
                "4",
                "--seq-length",
                "18",
                "--max-position-embeddings",
                "32",
            ],
            4,
            "--seq-length 18 is not divisible",
        ),
        (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], 1, "--rotary-percent"),
        (["--rotary-percent", "1.5"], 1, "--rotary-percent must be > 0 and <= 1"),
    ],
)
def test_bad_llama_flags_name_the_flag(argv, world, needle):
    args = parse_args(
        ["--train-iters", "1", "--num-attention-heads", "8", "--hidden-size", "64", *argv]
    )
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        validate(args, world)


def test_llama_flags_parse_and_default_to_gpt2():
    args = parse_args(["--train-iters", "1"])
    m = args.model
    assert (
        m.normalization,
        m.position_embedding_type,
        m.swiglu,
        m.num_query_groups,
        m.sequence_parallel,
        m.rotary,
    ) == (None, None, False, None, False, (10000, 1.0))
    # GPT-2's choices are recorded as None: a plain GPT-2 names no option in a checkpoint.
    m = parse_args(
        [
            "--train-iters",
            "1",
            "--normalization",
            "LayerNorm",
            "--position-embedding-type",
            "learned_absolute",
        ]
    ).model
    assert (m.normalization, m.position_embedding_type) == (None, None)
    args = parse_args(
        [
            "--train-iters",
            "1",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "500000",
            "--group-query-attention",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--sequence-parallel",
        ]
    )
    m = args.model
    assert m.num_query_groups == 1 and m.kv_groups == 1 and m.rotary == (500000, 1.0)
    validate(args, 2)
    with pytest.raises(ConfigError, match="argument --normalization: invalid choice: 'BatchNorm'"):
        parse_args(["--normalization", "BatchNorm"])


@pytest.mark.parametrize("rotary_base", [10000, 500000])
def test_tp1_llama_equals_transformers_llama(rotary_base):
    """Our Llama options at TP=1 give HF LlamaForCausalLM's logits once the weights are
    moved over with the layout rules an HF converter needs: the per-group fused QKV
    split into q/k/v, fc1 into gate/up, the vocabulary padding cut."""
    import transformers

    cfg = _cfg(**LLAMA, rotary_base=rotary_base, layernorm_epsilon=1e-6)
    torch.manual_seed(3)
    ours = GPTModel(cfg, tp_group=SINGLE).eval()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=rotary_base),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd, a, g, d = {}, 8, 4, 8
    w = dict(ours.named_parameters())
    sd["model.embed_tokens.weight"] = w["wte.weight"][:100]
    sd["lm_head.weight"] = w["output_layer.weight"][:100]
    sd["model.norm.weight"] = w["ln_f.weight"]
    for i in range(2):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        qkv = w[p + "attn.qkv.weight"].view(g, a // g + 2, d, 64)
        sd[q + "self_attn.q_proj.weight"] = qkv[:, :-2].reshape(a * d, 64)
        sd[q + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(g * d, 64)
        sd[q + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(g * d, 64)
        sd[q + "self_attn.o_proj.weight"] = w[p + "attn.proj.weight"]
        gate, up = w[p + "mlp.fc1.weight"].chunk(2)
        sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"] = gate, up
        sd[q + "mlp.down_proj.weight"] = w[p + "mlp.fc2.weight"]
        sd[q + "input_layernorm.weight"] = w[p + "ln1.weight"]
        sd[q + "post_attention_layernorm.weight"] = w[p + "ln2.weight"]
    missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in sd.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], missing
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)[..., :100]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


# ------------------------------------------------------- TP and SP equal TP=1 (gloo)
def _batch(n=4, s=16, seed=0):
    tokens = torch.randint(0, 100, (n, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg, group):
    torch.manual_seed(42)
    model_parallel_seed(42, group.rank)
    return GPTModel(cfg, tp_group=group)


def _check_equal_to_tp1(cfg, group):
    x, y = _batch()
    ref_loss, ref_grads = loss_and_grads(_model(cfg, SINGLE), x, y)
    model = _model(cfg, group)
    loss, _ = loss_and_grads(model, x, y)
    what = f"TP={group.size} sp={cfg.sequence_parallel} recompute={cfg.recompute_activations}"
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (what, loss, ref_loss)
    for name, p in model.named_parameters():
        g, want = merged_grad(p, group), ref_grads[name]
        if name in ("wte.weight", "output_layer.weight"):  # padding differs by TP size
            assert g[100:].abs().max() == 0 and want[100:].abs().max() == 0
            g, want = g[:100], want[:100]
        err = (g - want).abs().max() / want.abs().max()
        assert err < 1e-5, f"{what}: {name}: relative error {err:.2e}"
    return model


def _check_sp_dropout_masks_differ_across_ranks(group):
    """Dropout on a sequence shard draws from the per-TP-rank stream: the shards' masks
    are independent (the default stream would give every rank the same mask)."""
    cfg = _cfg(**LLAMA, sequence_parallel=True, hidden_dropout=0.5)
    model = _model(cfg, group)
    x = model.embed(_batch()[0])  # [b, s/t, h], dropout 0.5 zeroes about half
    kept = (x != 0).flatten().float()
    parts = [torch.empty_like(kept) for _ in range(group.size)]
    dist.all_gather(parts, kept, group=group.torch_group())
    assert not torch.equal(parts[0], parts[1]), "shards drew the same dropout mask"
    assert 0.3 < kept.mean() < 0.7


def _check_recompute_replays_sp_dropout(group):
    """Recomputation under SP with dropout on replays the per-TP-rank stream: the same
    losses and gradients as keeping the activations."""
    x, y = _batch()
    runs = []
    for recompute in (False, True):
        cfg = _cfg(
            **LLAMA,
            sequence_parallel=True,
            hidden_dropout=0.2,
            attention_dropout=0.2,
            recompute_activations=recompute,
        )
        runs.append(loss_and_grads(_model(cfg, group), x, y))
    assert torch.equal(runs[0][0], runs[1][0])
    for name, g in runs[0][1].items():
        assert torch.allclose(g, runs[1][1][name], rtol=1e-6, atol=1e-8), name


def _saved_bytes(block, x, rope):
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(seen.values())


def _check_saved_activations(group):
    """One block's saved bytes per rank against the planner's per-layer term (CPU: fp32,
    no dropout; RMSNorm's composite keeps its normalized output, e*sbh/r per norm more)."""
    t, b, s, h = group.size, 2, 16, 64
    for opts in ({}, LLAMA):
        counts = {}
        for sp in (False, True):
            cfg = _cfg(**opts, sequence_parallel=sp)
            torch.manual_seed(0)
            block = TransformerBlock(cfg, group, sp, torch.float32, None)
            x = torch.randn(b, s // t if sp else s, h, requires_grad=True)
            rope = RotaryEmbedding(8, 10000, 1.0)(s, torch.float32, None) if opts else None
            counts[sp] = _saved_bytes(block, x, rope)
            est = estimate_activations(cfg, t, b, 4, recompute=False, flash=True).per_layer
            composite = 2 * 4 * s * b * h // (t if sp else 1) if opts else 0
            rope_tables = 2 * s * 8 * 4 if opts else 0  # cos, sin: counted outside the layers
            assert counts[sp] == est + composite + rope_tables, (opts, sp, counts[sp], est)
        assert counts[True] < counts[False]


def _tp_worker(rank, world, tp):
    ps.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group()
    for sp in (False, True):
        _check_equal_to_tp1(_cfg(**LLAMA, sequence_parallel=sp), group)
    _check_equal_to_tp1(_cfg(**LLAMA, sequence_parallel=True, recompute_activations=True), group)
    _check_equal_to_tp1(_cfg(sequence_parallel=True), group)  # GPT-2 + SP
    _check_sp_dropout_masks_differ_across_ranks(group)
    _check_recompute_replays_sp_dropout(group)
    _check_saved_activations(group)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_llama_and_sequence_parallel_equal_tp1(tp):
    run_distributed(_tp_worker, tp, tp)


def _gpt2_sp_worker(rank, world):
    """GPT-2 with --sequence-parallel equals GPT-2 without it, step by step, with dropout
    off; the replicated parameters' gradients come out identical on every TP rank."""
    ps.initialize_model_parallel(2)
    group = ps.get_tensor_model_parallel_group()
    x, y = _batch()
    base = dict(hidden_dropout=0.0, attention_dropout=0.0)
    plain = loss_and_grads(_model(_cfg(**base), group), x, y)
    model = _model(_cfg(**base, sequence_parallel=True), group)
    sp = loss_and_grads(model, x, y)
    assert abs(plain[0] - sp[0]) <= 1e-6 * abs(plain[0])
    for name, p in model.named_parameters():
        assert torch.allclose(sp[1][name], plain[1][name], rtol=1e-5, atol=1e-7), name
        if not p.tensor_model_parallel:
            first = sp[1][name].clone()  # TP rank 0's copy
            dist.broadcast(first, dist.get_rank() - group.rank, group=group.torch_group())
            assert torch.equal(first, sp[1][name]), f"{name}: TP ranks disagree"


@pytest.mark.slow
def test_gpt2_sequence_parallel_equals_gpt2():
    run_distributed(_gpt2_sp_worker, 2)


# ------------------------------------------------------------ planner under SP
def test_activation_formula_under_sp_is_megatrons_and_falls_with_tp():
    """e=2, f=4h, no GQA, dropouts on, the unfused attention kernel: per layer
    sbh(34 + 5as/h)/t with --sequence-parallel (plus the norms' statistics), and the
    per-rank peak falls with TP."""
    cfg = GPTConfig(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=2048,
        vocab_size=32000,
        sequence_parallel=True,
    )
    s, b, h, a = 2048, 2, 1024, 16
    peaks = []
    for t in (1, 2, 4, 8):
        est = estimate_activations(cfg, t, b, 2, recompute=False, flash=False)
        megatron = s * b * h * (34 + 5 * a * s // h) // t
        assert est.per_layer == megatron + 2 * 8 * s * b // t
        peaks.append(est.peak)
        plain = estimate_activations(
            dataclasses.replace(cfg, sequence_parallel=False), t, b, 2, recompute=False, flash=False
        )
        assert (
            plain.per_layer == s * b * h * (10 + 24 // t) + 5 * a * s * s * b // t + 2 * 8 * s * b
        )
    assert all(x > y for x, y in zip(peaks, peaks[1:])), peaks
