"""The reference trainer optimises the same global loss whatever the sharding.

FSDP2 averages the gradients it shards; the trainer averages the rest (replicated dense params over
the world, EP experts over their expert-DP group). If any of that were wrong, the strategies'
loss curves would drift apart within a few steps of Adam.
"""

from __future__ import annotations

from bounds import Bound, check_figure, relative_error
from nemo_moe_export.spawn import spawn

STRATEGIES = ("fsdp", "hsdp", "ep", "ep_fsdp")


def _train_worker(rank, world, root):
    from nemo_moe_export.config import ModelConfig, ParallelConfig, TrainerConfig
    from nemo_moe_export.job.data import build_tokenizer
    from nemo_moe_export.job.trainer import build_model, shard_model, train

    tokenizer = build_tokenizer(root)
    losses = {}
    for strategy in STRATEGIES:
        model = build_model(ModelConfig(family="deepseek_v3", n_experts=4, hidden_size=32, moe_intermediate_size=16),
                            len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        model, layout = shard_model(model, ParallelConfig(strategy=strategy, ep_size=2, replicate=2, timeout_s=60))
        state = train(model, layout, tokenizer, root, TrainerConfig(max_steps=8, batch_size=4, progress=False),
                      k_shot=0, log=lambda *_: None)
        losses[strategy] = (state.losses, state.grad_norms)
    return losses


# fp32 training under other shardings sums gradients in another order, and 8 Adam steps carry the
# rounding on: losses and global gradient norms relative to the largest of the curve.
TRAINING = Bound(1e-4, "fp32, 8 Adam steps from rounding-level differences, of the curve's largest value")


def test_every_strategy_follows_the_same_loss_curve(tmp_path):
    from nemo_moe_export.job.data import write_synthetic_mmlu

    root = str(write_synthetic_mmlu(tmp_path, n_train=40, n_test=4))
    per_rank = spawn(_train_worker, 4, root, timeout_s=300)
    loss_ref, norm_ref = per_rank[0]["fsdp"]
    assert loss_ref[-1] < loss_ref[0]
    for rank, runs in enumerate(per_rank):
        for strategy in STRATEGIES:
            losses, norms = runs[strategy]
            check_figure(relative_error(losses, loss_ref), TRAINING, f"rank {rank} {strategy} losses")
            # Adam forgives a uniformly mis-scaled gradient; the global norm does not.
            check_figure(relative_error(norms, norm_ref), TRAINING, f"rank {rank} {strategy} gradient norms")
