"""parallel.activation_checkpointing: none | full | selective (#44 item 2), in one process on the CPU.
Selective by operator (torchtitan's policy) keeps the matmul and attention outputs, every other
matmul's, and recomputes the rest; selective_ac=N checkpoints every Nth block in full. Each gives the
same loss and gradients as no checkpointing, and the ops that run again in backward are counted
(a dispatch mode around backward sees the recompute; what a block saved is returned without running)."""

import collections

import pytest
import torch

from trainer import models
from trainer.config import AC_DEPRECATED, ConfigError, load, resolve
from trainer.parallel import activation_checkpointing, plan
from trainer.torch_compat import dispatch_mode_base

SEQ = ["model.seq_len=32", "parallel.strategy=none"]  # the tiny transformer: 2 blocks, 7 matmuls each


class _Ops(dispatch_mode_base()):
    """Counts the ops dispatched while it is on, by name."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(*overrides: str):
    """(loss, gradients by name, ops run in backward, blocks) of the tiny transformer built as the
    trainer builds it, one forward and backward of a fixed batch."""
    cfg = resolve(load(None, [*SEQ, *overrides]))
    family = models.spec(cfg.model)
    torch.manual_seed(0)
    model = plan.Plan(cfg.parallel, 1).apply(family.build(cfg.model), family)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = family.loss(model(x), x)
    with _Ops() as ops:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, ops.count, len(family.blocks(model))


@pytest.fixture(scope="module")
def plain():
    return _backward_ops("parallel.activation_checkpointing=none")


MM, SILU, ATTENTION = "aten.mm.default", "aten.silu.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.mark.parametrize(
    "overrides, mm, silu, attention",
    [
        # full: each block's forward again, up to the last matmul its backward needs (6 of 7: w2's output is not)
        (["parallel.activation_checkpointing=full"], 6, 1, 1),
        # by operator: matmuls 2, 4 and 6 of each block again, none of the odd ones, no attention; the
        # element-wise rest (SiLU, the norms) again
        (["parallel.activation_checkpointing=selective"], 3, 1, 0),
        # every 2nd block in full: the second of the two blocks
        (["parallel.activation_checkpointing=selective", "parallel.selective_ac=2"], 3, 0.5, 0.5),
    ],
    ids=["full", "selective-op", "selective-every-2nd-block"],
)
def test_checkpointing_recomputes_what_it_should_and_matches(plain, overrides, mm, silu, attention):
    base_loss, base_grads, base_ops, blocks = plain
    loss, grads, ops, _ = _backward_ops(*overrides)
    assert loss == base_loss
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    assert base_ops[SILU] == base_ops[ATTENTION] == 0  # nothing of the forward runs again without checkpointing
    recomputed = {op: ops[op] - base_ops[op] for op in (MM, SILU, ATTENTION)}
    assert recomputed == {MM: mm * blocks, SILU: silu * blocks, ATTENTION: attention * blocks}, ops


def test_the_policy_keeps_every_other_matmul_and_the_attention():
    """torchtitan's policy, asked as torch's selective checkpoint asks it: odd matmuls, attention and
    float8's abs-max kept; even matmuls and the element-wise ops recomputed; the counts restart with
    the recompute (torch < 2.14 asks the policy again there)."""
    from torch.utils.checkpoint import CheckpointPolicy

    class Context:
        is_recompute = False

    ctx, policy = Context(), activation_checkpointing.selective_policy(collections.Counter())
    aten = torch.ops.aten
    kept = [policy(ctx, op) for op in (aten.mm.default, aten.mm.default, aten.mm.default, aten.silu.default)]
    assert kept == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] + [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]
    assert policy(ctx, aten._scaled_dot_product_flash_attention_for_cpu.default) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, aten.max.default) == CheckpointPolicy.MUST_SAVE
    ctx.is_recompute = True
    assert policy(ctx, aten.mm.default) == CheckpointPolicy.MUST_SAVE  # the recompute's first matmul


@pytest.mark.parametrize("value, mode", [("true", "full"), ("false", "none")])
def test_the_old_true_and_false_keep_working_with_one_deprecation_line(value, mode):
    cfg = load(None, [f"parallel.activation_checkpointing={value}"])
    assert cfg.parallel.activation_checkpointing == mode
    assert cfg.parallel.deprecated == AC_DEPRECATED.format(value, mode)
    assert load(None, [f"parallel.activation_checkpointing={mode}"]).parallel.deprecated is None


@pytest.mark.parametrize(
    "override, words",
    [
        ("parallel.activation_checkpointing=some", "expected 'none' or 'full' or 'selective' or bool"),
        ("parallel.selective_ac=0", "parallel.selective_ac"),
        ("parallel.selective_ac=ops", "expected int or 'op'"),
        ("parallel.grad_sync=always", "choose one of auto, every_micro_batch, last_micro_batch"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(override, words):
    from trainer.preflight.check import validate

    with pytest.raises(ConfigError, match=None) as e:
        validate(load(None, [override]), 1, overrides=[override])
    assert words in str(e.value) and "\n" not in str(e.value), e.value
