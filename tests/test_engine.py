"""Engine components: batching parity, collation, checkpoints (atomic, validated, rotated)."""

from __future__ import annotations

import re
import shutil
import warnings

import pytest
import torch

from engine.datapath.data import (
    IGNORE_INDEX,
    ShardedBatches,
    collate,
    count_targets,
    token_loss_sum,
)
from engine.state import checkpoint as ckpt


def test_two_ranks_see_exactly_what_one_rank_with_double_batch_sees():
    single = ShardedBatches(50, 8, rank=0, world_size=1, seed=3)
    r0 = ShardedBatches(50, 4, rank=0, world_size=2, seed=3)
    r1 = ShardedBatches(50, 4, rank=1, world_size=2, seed=3)
    for epoch in range(2):
        s, a, b = (x.epoch(epoch).tolist() for x in (single, r0, r1))
        assert len(s) == len(a) == len(b) == 6  # 50 // 8, the incomplete batch dropped
        for k in range(len(s)):
            assert a[k] + b[k] == s[k]
    assert single.epoch(0).tolist() != single.epoch(1).tolist()
    assert single.epoch(1).tolist() == ShardedBatches(50, 8, 0, 1, seed=3).epoch(1).tolist()


def test_accumulation_never_straddles_epochs():
    """46 examples, 2 ranks x batch 2 x accumulation 2: 5 whole steps of 8 examples; the 11th
    micro-batch (which would start a step finishing in the next epoch) is dropped, so each step
    sees what batch 8 on one rank sees."""
    single = ShardedBatches(46, 8, rank=0, world_size=1, seed=1)
    ranks = [ShardedBatches(46, 2, rank=r, world_size=2, seed=1, accumulation=2) for r in (0, 1)]
    assert len(ranks[0]) == 10 and len(single) == 5
    e = [r.epoch(0).tolist() for r in ranks]
    for step in range(5):
        seen = sorted(e[0][2 * step] + e[0][2 * step + 1] + e[1][2 * step] + e[1][2 * step + 1])
        assert seen == sorted(single.epoch(0)[step])


def test_collate_pads_right_and_masks_labels():
    rows = [{"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [1, 7], "labels": [-100, 7]}]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert b["labels"].tolist() == [[-100, 5, 6], [-100, 7, IGNORE_INDEX]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert count_targets(b) == 3


def test_token_loss_sum_matches_mean_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, 4, 5, -100], [-100, -100, 1, 2, 3]])
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                            ignore_index=-100)
    n = int((labels[:, 1:] != -100).sum())
    assert torch.allclose(token_loss_sum(logits, labels) / n, ref)


def _dcp_state(v: float):
    return {"model": {"w": torch.full((3,), v)}, "optim": {"step": torch.tensor(v)}}


def test_checkpoint_roundtrip_rotation_and_corruption(tmp_path, capsys):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, _dcp_state(step), {"history": [step]}, {"world_size": 1}, keep=2)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-0000002", "step-0000003"]
    newest = ckpt.latest(tmp_path)
    assert {".metadata", "__0_0.distcp", "rank-00000.pt", "trainer.pt", "meta.json"} <= {
        p.name for p in newest.iterdir()}
    target, applied = _dcp_state(0), []
    trainer, meta = ckpt.load(newest, target, applied.append)
    assert meta["step"] == 3 and trainer["history"] == [3]
    assert torch.equal(target["model"]["w"], torch.full((3,), 3.0)) and applied == [target]
    # a torn write of the newest checkpoint's DCP shard: detected, previous one used, warned
    with open(newest / "__0_0.distcp", "r+b") as fh:
        fh.truncate(10)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning: line, not a Python warning
        assert ckpt.latest(tmp_path).name == "step-0000002"
    assert capsys.readouterr().err == (f"warning: checkpoint {newest} is incomplete or "
                                       "corrupt (__0_0.distcp fails its SHA-256 check); "
                                       "skipping it\n")
    # one flipped bit in meta.json's step (valid JSON still): detected the same way
    meta_file = tmp_path / "step-0000002/meta.json"
    text = meta_file.read_text()
    assert '"step": 2' in text
    meta_file.write_text(text.replace('"step": 2', '"step": 3'))  # 2 ^ 1 = 3: one bit
    assert ckpt.latest(tmp_path) is None
    assert (f"warning: checkpoint {tmp_path / 'step-0000002'} is incomplete or corrupt "
            "(its meta.json fails its own SHA-256); skipping it"
            ) in capsys.readouterr().err.splitlines()
    meta_file.write_text(text)
    # the newest checkpoint's meta.json gone (a save cut short before it was written): the
    # resume falls back to the previous one and says which it skipped and why (it used to
    # sort the folder first, as the oldest, and pass over it without a word)
    for step in (4, 5):
        ckpt.save(tmp_path, step, _dcp_state(step), {"history": [step]}, {"world_size": 1},
                  keep=None)
    (tmp_path / "step-0000005/meta.json").unlink()
    capsys.readouterr()
    assert ckpt.latest(tmp_path).name == "step-0000004"
    assert capsys.readouterr().err == (
        f"warning: checkpoint {tmp_path / 'step-0000005'} is incomplete or corrupt (no "
        "readable meta.json: its save did not finish); skipping it\n")
    shutil.rmtree(tmp_path / "step-0000004")
    shutil.rmtree(tmp_path / "step-0000005")
    # leftover staging folder from a crash mid-save is ignored
    (tmp_path / ".step-0000004.tmp").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.latest(tmp_path).name == "step-0000002"


def test_rng_state_restores_draws():
    state = ckpt.rng_state()
    a = (torch.rand(3), __import__("random").random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _tiny_named_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("lin", torch.nn.Linear(3, 3))
    model.add_module("norm", torch.nn.LayerNorm(3))
    return model.named_parameters()


def test_optimizer_groups_first_match_wins_and_override_options():
    from engine.objective.optim import build_optimizer
    from finetune.config.optim import OptimizerConfig

    cfg = OptimizerConfig(weight_decay=0.1, optimizer_groups={
        "bias": {"weight_decay": 0.0}, "lin": {"learning_rate": 0.5}})
    opt = build_optimizer(_tiny_named_params(), cfg)
    shapes = [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups]
    # lin.bias matches both patterns: the first one ('bias') takes it
    assert shapes == [[(3,), (3,)], [(3, 3)], [(3,)]]  # lin.bias+norm.bias | lin.weight | norm.weight
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1, 0.1]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.5, 1e-3]
    lines = []
    build_optimizer(_tiny_named_params(), cfg, log=lines.append)
    assert lines[0].startswith("[optimizer] group 'bias' {'weight_decay': 0.0}: 2 tensors: "
                               "lin.bias, norm.bias")


def test_optimizer_groups_bad_input():
    from engine.objective.optim import build_optimizer
    from finetune.config.optim import OptimizerConfig
    from finetune.errors import PipelineError

    with pytest.raises(PipelineError, match=r"optimizer_groups\['attn'\]: matches no trainable"):
        build_optimizer(_tiny_named_params(), OptimizerConfig(optimizer_groups={"attn": {}}))
    with pytest.raises(PipelineError, match="left by the earlier patterns"):
        build_optimizer(_tiny_named_params(), OptimizerConfig(
            optimizer_groups={"lin": {}, r"lin\.bias": {}}))
    with pytest.raises(PipelineError, match=r"optimizer_groups\['bias'\].momentum: AdamW has no"):
        build_optimizer(_tiny_named_params(), OptimizerConfig(
            optimizer_groups={"bias": {"momentum": 0.9}}))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        OptimizerConfig(optimizer_groups={"(": {}})


def test_collate_packed_restarts_positions_and_drops_boundary_targets():
    from engine.datapath.data import collate_packed, count_targets, pack_rows

    rows = [{"input_ids": [1, 2, 3, 4], "labels": [5, 6, 7, 8]},
            {"input_ids": [9, 10], "labels": [11, 12]},
            {"input_ids": [13, 14, 15], "labels": [16, 17, 18]}]
    assert pack_rows([4, 2, 3], 6) == [[0, 1], [2]]
    b = collate_packed(rows, 0, 6)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 9, 10], [13, 14, 15, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert b["labels"].tolist() == [[IGNORE_INDEX, 6, 7, 8, IGNORE_INDEX, 12],
                                    [IGNORE_INDEX, 17, 18] + [IGNORE_INDEX] * 3]
    assert count_targets(b) == count_targets(collate(rows, 0))  # same targets as padded
    masked = collate_packed(rows, 0, 6, block_mask=torch.float32)["attention_mask"]
    allowed = masked[0, 0] == 0
    assert allowed[5, 4] and not allowed[4, 3] and not allowed[0, 1]  # causal, per example


def test_collate_flat_is_one_unpadded_row_with_example_boundaries():
    from engine.datapath.data import BOUNDARY_KEYS, collate_flat, count_targets, to_device

    rows = [{"input_ids": [1, 2, 3, 4], "labels": [5, 6, 7, 8]},
            {"input_ids": [9, 10], "labels": [11, 12]},
            {"input_ids": [13, 14, 15], "labels": [16, 17, 18]}]
    b = collate_flat(rows, 0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 9, 10, 13, 14, 15]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert b["labels"].tolist() == [[IGNORE_INDEX, 6, 7, 8, IGNORE_INDEX, 12,
                                     IGNORE_INDEX, 17, 18]]
    assert b["cu_seq_lens_q"].tolist() == b["cu_seq_lens_k"].tolist() == [0, 4, 6, 9]
    assert b["cu_seq_lens_q"].dtype == torch.int32 and int(b["max_length_q"]) == 4
    assert b["attention_mask"].tolist() == [[1] * 9]
    assert count_targets(b) == count_targets(collate(rows, 0))  # same targets as padded
    moved = to_device(b, torch.device("meta"))
    assert all(moved[k].device.type == "cpu" for k in BOUNDARY_KEYS)
    assert moved["input_ids"].device.type == "meta"
    assert to_device(b, torch.device("meta"), host_keys=())["cu_seq_lens_q"].is_meta


def test_bucketed_flat_rows_take_a_few_shapes_and_train_the_same_targets():
    """padding_free with pad_to_multiple_of: the row is padded to a bucket with a tail that is
    always there (one sequence more, labels ignored) and the longest-sequence bound is a power
    of two, so 200 random micro-batches give a handful of shapes (compile and CUDA graphs
    reuse them), where unbucketed rows give nearly one shape per batch; the real tokens, their
    positions, boundaries and targets are those of the unbucketed row."""
    from engine.datapath.data import collate_flat, count_targets

    g = torch.Generator().manual_seed(0)
    shapes, plain_shapes = set(), set()
    for _ in range(200):
        lengths = torch.randint(20, 400, (8,), generator=g).tolist()
        rows = [{"input_ids": list(range(3, n + 3)), "labels": list(range(3, n + 3))}
                for n in lengths]
        b, plain = collate_flat(rows, 0, multiple=256), collate_flat(rows, 0)
        total = sum(lengths)
        width = b["input_ids"].shape[1]
        assert width % 256 == 0 and width > total
        assert torch.equal(b["input_ids"][0, :total], plain["input_ids"][0])
        assert torch.equal(b["position_ids"][0, :total], plain["position_ids"][0])
        assert (b["labels"][0, total:] == IGNORE_INDEX).all()
        assert count_targets(b) == count_targets(plain)
        cu = b["cu_seq_lens_q"].tolist()
        assert cu[:-1] == plain["cu_seq_lens_q"].tolist() and cu[-1] == width
        longest = b["max_length_q"]
        assert longest >= max(max(lengths), width - total) and longest & (longest - 1) == 0
        shapes.add((width, len(cu), longest))
        plain_shapes.add((plain["input_ids"].shape[1], plain["max_length_q"]))
    assert len(shapes) <= 16 and len(plain_shapes) > 150


def test_varlen_attention_equals_separate_forwards_and_leaves_padded_batches_alone():
    """The padding-free row gives each example's own logits (one shared causal attention
    would not: checked by comparing with the stock SDPA run on the same row), and padded
    batches through the switched model still give the stock model's logits."""
    from engine.datapath.attention import VARLEN_ATTENTION
    from engine.datapath.data import collate_flat, model_inputs
    from engine.datapath.packing import enable_varlen

    model = _stories().eval()
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 500, (n,), generator=g).tolist(), "labels": [0] * n}
            for n in (11, 4, 23)]
    flat, padded = collate_flat(rows, 0), collate(rows, 0)
    with torch.no_grad():
        stock_flat = model(**model_inputs(flat)).logits[0]
        stock_padded = model(**model_inputs(padded)).logits
        enable_varlen(model, "sdpa_per_example", torch.device("cpu"))
        assert model.config._attn_implementation == VARLEN_ATTENTION
        out = model(**model_inputs(flat)).logits[0]
        assert torch.equal(model(**model_inputs(padded)).logits, stock_padded)
    at = 0
    for r in rows:
        n = len(r["input_ids"])
        alone = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
        torch.testing.assert_close(out[at:at + n], alone, atol=1e-5, rtol=1e-5)
        at += n
    assert not torch.allclose(stock_flat[11:], out[11:], atol=1e-3)


def _attention_grads(attend, dtype, lengths=(11, 4, 23), heads=(4, 2), dim=16):
    """Output and q/k/v gradients (float64) of `attend(q, k, v)` on fixed random inputs in
    `dtype`, for examples of `lengths` laid end to end (grouped-query heads)."""
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(1, n, total, dim, generator=g).to(dtype).requires_grad_()
               for n in (heads[0], heads[1], heads[1]))
    out = attend(q, k, v)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return [t.double() for t in (out, q.grad, k.grad, v.grad)]


def test_short_examples_on_a_cpu_in_bf16_take_padded_matmuls_as_close_as_flash_per_example():
    """The padded-matmul path (bf16 on a CPU, short examples) computes each example's causal
    attention and its gradients: against the float64 per-example computation it is within
    twice the error of torch's flash kernel per example in the same bf16 (a missing causal
    mask or a leak between examples would be off by O(1))."""
    import torch.nn.functional as F

    from engine.datapath.attention import _per_example, _short_on_cpu

    lengths = (11, 4, 23)
    cu = torch.tensor([0, 11, 15, 38])
    bounds = cu.tolist()

    def ours(q, k, v):
        return _per_example(q, k, v, cu, None, 0.0)

    def flash(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True)
            for s, e in zip(bounds[:-1], bounds[1:])], dim=2).transpose(1, 2)

    exact = _attention_grads(ours, torch.float64, lengths)
    torch.testing.assert_close(exact[0], _attention_grads(flash, torch.float64, lengths)[0])
    assert _short_on_cpu(torch.zeros(1, 4, 38, 16, dtype=torch.bfloat16), bounds) == 23
    padded, per_example = (_attention_grads(f, torch.bfloat16, lengths) for f in (ours, flash))
    for name, got, theirs, want in zip(("out", "dq", "dk", "dv"), padded, per_example, exact):
        err, flash_err = ((x - want).abs().max().item() for x in (got, theirs))
        assert err <= 2 * flash_err, (name, err, flash_err)
    # under bf16 autocast (fp32 q/k from the rotary embedding) it is the same computation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _attention_grads(ours, torch.float32, lengths)
    assert torch.equal(autocast[0], padded[0])


def test_the_padded_matmul_path_is_only_for_short_examples_computing_in_bf16_on_a_cpu():
    from engine.datapath.attention import (SHORT_EXAMPLE_TOKENS, SHORT_SCORE_ELEMENTS,
                                           _short_on_cpu)

    def q(dtype=torch.bfloat16, heads=9):
        return torch.zeros(1, heads, 8, 4, dtype=dtype)

    assert _short_on_cpu(q(), [0, 5, 8]) == 5
    assert _short_on_cpu(q(torch.float32), [0, 5, 8]) == 0  # fp32: flash per example
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _short_on_cpu(q(torch.float32), [0, 5, 8]) == 5
    assert _short_on_cpu(q(), [0, SHORT_EXAMPLE_TOKENS + 1]) == 0
    assert _short_on_cpu(q(), [0, SHORT_EXAMPLE_TOKENS]) == SHORT_EXAMPLE_TOKENS
    many = SHORT_SCORE_ELEMENTS // (9 * 100 * 100) + 1  # examples of 100 tokens, 9 heads
    assert _short_on_cpu(q(), list(range(0, 100 * (many + 1), 100))) == 0
    assert _short_on_cpu(q(), list(range(0, 100 * many, 100))) == 100


def test_padding_free_logits_in_bf16_on_a_cpu_keep_examples_apart():
    """The whole model on a padding-free row under bf16 autocast, where short examples take
    the padded-matmul path: against the fp32 logits each example's are within twice the error
    of the flash kernel per example in the same autocast, and one causal attention over the
    row (examples leaking into each other) is far off."""
    from engine.datapath import attention
    from engine.datapath.data import collate_flat, model_inputs
    from engine.datapath.packing import enable_varlen

    model = _stories().eval()
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 500, (n,), generator=g).tolist(), "labels": [0] * n}
            for n in (11, 4, 23)]
    flat = model_inputs(collate_flat(rows, 0))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            leaky = model(**flat).logits[0].float()
        enable_varlen(model, "sdpa_per_example", torch.device("cpu"))
        exact = model(**flat).logits[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            padded = model(**flat).logits[0].float()
            limit, attention.SHORT_EXAMPLE_TOKENS = attention.SHORT_EXAMPLE_TOKENS, 0
            try:
                per_example = model(**flat).logits[0].float()
            finally:
                attention.SHORT_EXAMPLE_TOKENS = limit
    err, flash_err = ((x - exact).abs().max() for x in (padded, per_example))
    assert err <= 2 * flash_err
    assert (leaky - exact)[11:].abs().max() > 10 * err


def test_packed_rows_carry_varlen_boundaries_over_the_flattened_rows():
    """For a varlen kernel, packed rows (width 6 here) are one flat sequence of segments:
    each example, then each row's padding tail as a segment of its own (its labels ignored)."""
    from engine.datapath.data import collate_packed

    rows = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]},
            {"input_ids": [5, 6], "labels": [5, 6]},
            {"input_ids": [7, 8, 9], "labels": [7, 8, 9]}]
    b = collate_packed(rows, 0, 6, varlen=True)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]]
    assert b["cu_seq_lens_q"].tolist() == [0, 4, 6, 9, 12]
    assert int(b["max_length_q"]) == 4
    assert "cu_seq_lens_q" not in collate_packed(rows, 0, 6)


def test_varlen_kernel_choice_follows_the_machine():
    """On a CPU only per-example SDPA trains; asking for a flash kernel or flex is one line
    naming the key, why, and what is usable (the CUDA kernels are exercised by
    bench/engine_smoke.py and bench/gpu.py on a GPU)."""
    from engine.datapath.attention import available_kernels, choose_kernel
    from finetune.errors import PipelineError

    cpu = torch.device("cpu")
    assert available_kernels(cpu) == ["sdpa_per_example"]
    assert choose_kernel(cpu, torch.bfloat16) == "sdpa_per_example"
    with pytest.raises(PipelineError, match="training.varlen_kernel: torch_varlen cannot run "
                       "here .this machine does not have it.; usable: sdpa_per_example"):
        choose_kernel(cpu, torch.bfloat16, "torch_varlen")
    with pytest.raises(PipelineError, match="training.varlen_kernel: flex cannot run here "
                       ".torch's FlexAttention has no backward on a CPU."):
        choose_kernel(cpu, torch.float32, "flex")


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_document_mask_equals_separate_forwards(compiled):
    """The GPU's portable varlen fallback, run here forward only (torch has no FlexAttention
    backward on a CPU): packed rows laid end to end under the document mask give each
    example's own logits, eager and compiled; a causal mask alone would not."""
    from engine.datapath.attention import use_varlen_attention
    from engine.datapath.data import collate_packed, model_inputs

    model = _stories().eval()
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 500, (n,), generator=g).tolist(), "labels": [0] * n}
            for n in (11, 4, 23, 9)]
    packed = model_inputs(collate_packed(rows, 0, 30, varlen=True))  # 2 rows of 30
    with torch.no_grad():
        stock = model(**{k: v for k, v in packed.items() if k == "input_ids"}).logits
        use_varlen_attention(model, "flex")
        forward = torch.compile(model) if compiled else model
        out = forward(**packed, use_cache=False).logits.reshape(-1, stock.shape[-1])
        alone = {n: model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
                 for n, r in zip((11, 4, 23, 9), rows)}
    starts = collate_packed(rows, 0, 30, varlen=True)["cu_seq_lens_q"].tolist()
    lengths = dict(zip(starts[:-1], (b - a for a, b in zip(starts[:-1], starts[1:]))))
    seen = 0
    for start, n in lengths.items():
        if n in alone:  # an example (the rest are the rows' padding tails)
            torch.testing.assert_close(out[start:start + n], alone[n], atol=1e-4, rtol=1e-4)
            seen += 1
    assert seen == 4
    assert not torch.allclose(stock.reshape(-1, stock.shape[-1]), out, atol=1e-3)


def test_layout_aware_linear_computes_the_same_products_as_autograd_in_bf16():
    """Forward is bitwise autocast's; input, weight and bias gradients match the exact
    products of the bf16-rounded operands (as stock autograd's do), with and without a frozen
    weight; `restore_linear` gives the class forward back."""
    from engine.modeling.cpu_linear import restore_linear, use_layout_aware_linear

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 5, 16, generator=g)
    upstream = torch.randn(2, 5, 24, generator=g)

    def run(layer, patched):
        x = x0.clone().requires_grad_()
        if patched:
            assert use_layout_aware_linear(layer) == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(upstream.to(y.dtype))
        restore_linear(layer)
        assert "forward" not in layer.__dict__
        return y, x.grad, layer.weight.grad, layer.bias.grad

    for frozen in (False, True):
        torch.manual_seed(3)
        layer = torch.nn.Linear(16, 24)
        layer.weight.requires_grad_(not frozen)
        stock = run(layer, False)
        layer.zero_grad()
        ours = run(layer, True)
        assert torch.equal(ours[0], stock[0])
        xb, wb = x0.bfloat16().double(), layer.weight.bfloat16().double()
        gb = upstream.bfloat16().double()
        exact = (gb @ wb, None if frozen else (gb.reshape(-1, 24).t() @ xb.reshape(-1, 16)),
                 gb.reshape(-1, 24).sum(0))
        for got, want, theirs in zip(ours[1:], exact, stock[1:]):
            if want is None:
                assert got is None and theirs is None
                continue
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(theirs.double(), want, rtol=2e-2, atol=2e-2)


def test_fast_bf16_kernels_switch_on_only_for_bf16_on_cpu_without_native_bf16_gemm():
    from engine.modeling.runtime import use_fast_bf16_cpu_kernels

    model = _stories()
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    # the last but one argument: Strategy.param_dtype (None without FSDP2 mixed precision; an
    # fsdp2 config's fsdp.param_dtype bfloat16 gives torch.bfloat16:
    # tests/test_strategy_placement.py); the last: whether the CPU multiplies bf16 natively
    cpu, single, slow = torch.device("cpu"), None, False
    assert use_fast_bf16_cpu_kernels(model, cpu, None, single, slow) == 0
    assert use_fast_bf16_cpu_kernels(model, torch.device("cuda"), torch.bfloat16, single,
                                     slow) == 0
    assert use_fast_bf16_cpu_kernels(model, cpu, torch.bfloat16, single, native=True) == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    fsdp_bf16 = torch.bfloat16
    assert use_fast_bf16_cpu_kernels(model, cpu, None, fsdp_bf16, slow) == n_linear > 0
    assert use_fast_bf16_cpu_kernels(_stories(), cpu, torch.bfloat16, single, slow) == n_linear
    assert use_fast_bf16_cpu_kernels(_stories().bfloat16(), cpu, None, single, slow) == n_linear


@pytest.mark.parametrize("flags, ceiling, native", [
    ("avx2,fma", "", False),  # no bf16 instructions
    ("avx2,avx512f,avx512_bf16", "", True),
    ("avx2,avx512f,avx512_bf16", "AVX2", False),  # portable numerics' cap
    ("avx2,avx512f,avx512_bf16", "AVX512_CORE", False),  # capped just below them
    ("avx2,avx512f,avx512_bf16", "avx512_core_bf16", True),
    ("avx2,avx512f,amx_tile,amx_bf16", "AVX512_CORE_AMX", True),
    ("avx2,avx512f,amx_bf16", "ALL", True),
])
def test_native_bf16_gemm_needs_the_instructions_and_onednn_allowed_to_use_them(
        flags, ceiling, native):
    from engine.modeling.cpu_linear import native_bf16_gemm

    env = {"ONEDNN_MAX_CPU_ISA": ceiling} if ceiling else {}
    assert native_bf16_gemm(flags, env) is native


def test_packing_probe_refuses_models_that_cannot_separate_examples():
    from types import SimpleNamespace

    from engine.datapath.packing import enable_varlen, probe_packing
    from finetune.errors import PipelineError

    class Leaky(torch.nn.Module):  # takes position_ids but mixes every earlier token in
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return SimpleNamespace(logits=torch.nn.functional.one_hot(input_ids, 32).float()
                                   .cumsum(1) + 1)

    class NoPositions(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return SimpleNamespace(logits=input_ids.float())

    with pytest.raises(PipelineError, match="Leaky lets packed examples attend"):
        probe_packing(Leaky(), 32, torch.device("cpu"))
    with pytest.raises(PipelineError, match="NoPositions.forward takes no position_ids"):
        probe_packing(NoPositions(), 32, torch.device("cpu"))
    with pytest.raises(PipelineError, match="training.padding_free: Leaky cannot train on "
                       "varlen attention .its attention does not go through"):
        enable_varlen(Leaky(), "sdpa_per_example", torch.device("cpu"))


def test_group_by_length_batches_similar_lengths_and_keeps_the_epoch():
    import random

    rnd = random.Random(0)
    lengths = tuple(rnd.randint(10, 500) for _ in range(400))
    plain = ShardedBatches(400, 4, 0, 2, seed=3)
    grouped = ShardedBatches(400, 4, 0, 2, seed=3, lengths=lengths)

    def waste(batches):
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b)
                   for b in batches.epoch(0))

    assert waste(grouped) < waste(plain) / 3
    both = (grouped.epoch(0).tolist()
            + ShardedBatches(400, 4, 1, 2, seed=3, lengths=lengths).epoch(0).tolist())
    assert sorted(i for b in both for i in b) == list(range(400))  # every example once
    assert grouped.epoch(0).tolist() == grouped.epoch(0).tolist()
    assert grouped.epoch(0).tolist() != grouped.epoch(1).tolist()


def _stories():
    from helpers import ROOT
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ROOT / "data/models/stories260K")


def test_runtime_flags_follow_the_config():
    from engine.modeling.runtime import configure_torch
    from finetune.config.training import TrainingConfig

    before = torch.get_float32_matmul_precision()
    try:
        configure_torch(TrainingConfig(full_determinism=True, detect_anomaly=True,
                                       float32_matmul_precision="medium"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        torch.set_float32_matmul_precision(before)
    configure_torch(TrainingConfig())
    assert not torch.are_deterministic_algorithms_enabled() and not torch.is_anomaly_enabled()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_blocks_in_backward(reentrant):
    from engine.modeling.adapter import apply_peft
    from engine.modeling.runtime import enable_gradient_checkpointing
    from finetune.config.model import PeftSection
    from finetune.config.training import TrainingConfig

    def forward_calls(checkpointing: bool) -> tuple[int, torch.Tensor]:
        torch.manual_seed(0)
        base = _stories()
        enable_gradient_checkpointing(base, TrainingConfig(
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}))
        model = apply_peft(base, PeftSection(r=4))
        model.train()
        calls = []
        # a pre-hook: non-reentrant recomputation stops early, before post-hooks would fire
        base.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grad = next(p.grad for n, p in model.named_parameters() if "lora_B" in n)
        return len(calls), grad

    plain_calls, plain_grad = forward_calls(False)
    ckpt_calls, ckpt_grad = forward_calls(True)
    assert (plain_calls, ckpt_calls) == (1, 2)  # the block runs again during backward
    assert torch.allclose(plain_grad, ckpt_grad, atol=1e-6) and plain_grad.abs().sum() > 0


POLICIES = """
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def first_mlp(module, name):
    return name == "model.layers.0.mlp"


def blocks(module):  # torch's check_fn: the module alone
    return isinstance(module, LlamaDecoderLayer)


def nothing(module, name):
    return False


def unsure(module, name):
    return None
"""


@pytest.mark.parametrize("policy", ["first_mlp", "blocks"])
def test_activation_checkpoint_fn_recomputes_the_modules_it_chooses(tmp_path, policy):
    """training.enable_activation_checkpoint_fn: only the chosen modules run again in backward,
    the gradients and the parameter names are those without checkpointing."""
    from engine.modeling.adapter import apply_peft
    from engine.modeling.runtime import enable_gradient_checkpointing
    from finetune.config.model import PeftSection
    from finetune.config.training import TrainingConfig

    (tmp_path / "policies.py").write_text(POLICIES)

    def forward_calls(fn: str | None) -> tuple[list[int], torch.Tensor, list[str]]:
        torch.manual_seed(0)
        base = _stories()
        logged: list[str] = []
        enable_gradient_checkpointing(base, TrainingConfig(enable_activation_checkpoint_fn=fn),
                                      logged.append)
        model = apply_peft(base, PeftSection(r=4))
        model.train()
        calls = [0, 0]
        for i in (0, 1):
            base.model.layers[i].mlp.register_forward_pre_hook(
                lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grad = next(p.grad for n, p in model.named_parameters() if "lora_B" in n)
        return calls, grad, [n for n, _ in model.named_parameters()], logged

    plain_calls, plain_grad, plain_names, _ = forward_calls(None)
    calls, grad, names, logged = forward_calls(f"{tmp_path}/policies.py:{policy}")
    assert plain_calls == [1, 1]
    assert calls == ([2, 1] if policy == "first_mlp" else [2, 2])
    assert torch.allclose(plain_grad, grad, atol=1e-6) and plain_grad.abs().sum() > 0
    assert names == plain_names  # hooks, not wrappers: the adapter and checkpoints' keys stay
    n = 1 if policy == "first_mlp" else len(_stories().model.layers)
    assert f"{n} modules recomputed in backward" in logged[0]


@pytest.mark.parametrize("policy, says", [
    ("nothing", "'{ref}' chose none of the LlamaForCausalLM's modules"),
    ("unsure", "'{ref}' must return True or False; it returned None for module ''"),
])
def test_an_activation_checkpoint_fn_that_chooses_badly_is_one_line(tmp_path, policy, says):
    from engine.modeling.runtime import enable_gradient_checkpointing
    from finetune.config.training import TrainingConfig
    from finetune.errors import PipelineError

    (tmp_path / "policies.py").write_text(POLICIES)
    ref = f"{tmp_path}/policies.py:{policy}"
    with pytest.raises(PipelineError, match=re.escape(
            "training.enable_activation_checkpoint_fn: " + says.format(ref=ref))):
        enable_gradient_checkpointing(_stories(), TrainingConfig(
            enable_activation_checkpoint_fn=ref))


def test_torch_compile_captures_graphs_and_refuses_cudagraphs_with_accumulation():
    from engine.modeling.compile import compile_stats, decoder_blocks, maybe_compile
    from finetune.config.training import TrainingConfig

    torch._dynamo.reset()
    model = _stories()
    assert maybe_compile(model, TrainingConfig()) is model
    ids = torch.tensor([[1, 40, 50, 60]])
    plain = model(input_ids=ids, use_cache=False).logits
    names = list(model.state_dict())
    # regional (the default): every decoder block compiled in place, names unchanged
    compiled = maybe_compile(model, TrainingConfig(torch_compile=True,
                                                   torch_compile_backend="aot_eager"))
    assert compiled is model and list(model.state_dict()) == names
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable")
               for b in decoder_blocks(model)) and len(decoder_blocks(model)) == 5
    assert torch.allclose(compiled(input_ids=ids, use_cache=False).logits, plain, atol=1e-5)
    assert compile_stats()["torch_compile_graphs"] >= 1
    whole = maybe_compile(_stories(), TrainingConfig(
        torch_compile=True, torch_compile_backend="aot_eager", torch_compile_scope="model"))
    assert torch.allclose(whole(input_ids=ids, use_cache=False).logits, plain, atol=1e-5)
    with pytest.raises(ValueError, match="the chunked loss runs eager, a graph break"):
        TrainingConfig(torch_compile=True, torch_compile_fullgraph=True,
                       torch_compile_scope="model")
    with pytest.raises(ValueError, match="max-autotune captures CUDA graphs"):
        TrainingConfig(torch_compile=True, torch_compile_mode="max-autotune",
                       gradient_accumulation_steps=2)


def test_progress_bar_rules_and_output():
    import io

    from engine.reporting.callbacks import TrainState
    from engine.reporting.reporters import ProgressBar, progress_enabled

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_enabled(None, Tty()) and not progress_enabled(None, io.StringIO())
    assert not progress_enabled(True, Tty()) and progress_enabled(False, io.StringIO())
    for kind in ("tqdm", "rich"):
        out = io.StringIO()
        bar, state = ProgressBar(kind, file=out), TrainState(step=0, max_steps=4)
        bar.on_train_begin(state)
        for step in range(1, 5):
            state.step = step
            bar.on_step_end(state)
            bar.on_log(state, {"loss": 1.5})
        bar.on_train_end(state)
        assert "4/4" in out.getvalue() and "1.5" in out.getvalue(), (kind, out.getvalue())


def test_drop_last_false_fills_the_last_step_from_the_epoch_start():
    kept = ShardedBatches(10, 2, 0, 2, seed=1)
    filled = ShardedBatches(10, 2, 0, 2, seed=1, drop_last=False)
    assert (len(kept), len(filled)) == (2, 3)
    both = (filled.epoch(0).tolist()
            + ShardedBatches(10, 2, 1, 2, seed=1, drop_last=False).epoch(0).tolist())
    seen = [i for b in both for i in b]
    assert len(seen) == 12 and set(seen) == set(range(10))  # all 10, two of them twice
    assert all(len(b) == 2 for b in both)


def test_dataloader_options_reach_the_loader():
    from engine.datapath.data import collate
    from engine.datapath.loader import make_loader, micro_batches
    from finetune.config.training import TrainingConfig

    rows = [{"input_ids": [1] * (i + 1), "labels": [1] * (i + 1)} for i in range(12)]

    class Rows(list):
        def __getitem__(self, idx):  # the Arrow column access take_rows uses
            if isinstance(idx, list):
                return {k: [list.__getitem__(self, i)[k] for i in idx] for k in ("input_ids",
                                                                                 "labels")}
            return list.__getitem__(self, idx)

    batches = ShardedBatches(12, 2, 0, 1, seed=0)
    cfg = TrainingConfig(dataloader_num_workers=2, dataloader_prefetch_factor=3,
                         dataloader_persistent_workers=True)
    loader = make_loader(Rows(rows), batches, lambda r: collate(r, 0), cfg, torch.device("cuda"))
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers,
            loader.pin_memory) == (2, 3, True, True)
    assert not make_loader(Rows(rows), batches, lambda r: collate(r, 0), cfg,
                           torch.device("cpu")).pin_memory  # pinning is for accelerators
    plain = make_loader(Rows(rows), batches, lambda r: collate(r, 0), TrainingConfig(),
                        torch.device("cpu"))
    assert plain.num_workers == 0 and not plain.persistent_workers
    # resumable mid-epoch, and the keys say what was consumed
    stream = micro_batches(plain, epoch=1, start=4)
    keys = [next(stream)["key"].tolist() for _ in range(4)]
    assert keys == [[1, 4], [1, 5], [2, 0], [2, 1]]
