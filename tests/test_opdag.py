"""OP-DAG tracing, cuts and stage rebuilding: stages one after another must give
the whole model's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from coordinator.opdag import balanced_cut, build_opdag
from fusionllm.local import check_stages
from protocol.model.graph import Cut, CutError, TraceFailure, partition, trace
from protocol.model.job import JobSpec, split_batch
from tests.models import Tied, Untraceable

SMALL_GPT = JobSpec(model="tests/models.py:small_gpt", data="tests/models.py:small_text", micro_batches=2)
BRANCHY = JobSpec(model="branchy", data="branchy", micro_batches=2)
TIED = JobSpec(model="tests/models.py:tied", data="tests/models.py:tied_data", micro_batches=2)


def _dag(job: JobSpec):
    return build_opdag(job.build_model(), job.first_micro_batch())


def _op_index(dag, predicate) -> int:
    return next(o.index for o in dag.ops if predicate(o))


def test_gpt_ops_have_costs() -> None:
    dag = _dag(SMALL_GPT)
    assert dag.ops[-1].target == "cross_entropy", "the loss is the last op"
    linear = [o for o in dag.ops if o.kind == "call_module" and o.name.endswith("c_attn")]
    assert linear and all(o.flops > 0 and o.param_bytes > 0 for o in linear)
    # a [B*T, C] x [C, 3C] matmul: 2*B*T*C*3C FLOPs (+ bias), B=4, T=16, C=32
    assert linear[0].flops >= 2 * 4 * 16 * 32 * 96
    assert dag.total_param_bytes == sum(p.numel() * 4 for p in SMALL_GPT.build_model().parameters())
    assert all(o.out_bytes > 0 for o in dag.ops if o.kind == "call_module")


@pytest.mark.parametrize(
    "where",
    [
        "mid_attention",  # inside the first block's attention, between q/k/v and SDPA
        "attn_mlp",  # between the attention residual add and the MLP's layer norm
        "next_to_loss",  # right before cross_entropy
        "after_embedding",
    ],
)
def test_gpt_cut_at_named_places_matches_whole_model(where: str) -> None:
    dag = _dag(SMALL_GPT)
    idx = {
        "mid_attention": _op_index(dag, lambda o: "scaled_dot_product_attention" in o.target),
        "attn_mlp": _op_index(dag, lambda o: o.name == "blocks_0_ln_2"),
        "next_to_loss": dag.num_ops - 1,
        "after_embedding": _op_index(dag, lambda o: o.name == "wpe") + 1,
    }[where]
    errors = check_stages(SMALL_GPT, Cut((idx,)))
    assert errors["max"] <= 1e-5, errors


def test_gpt_every_boundary_two_and_three_stages() -> None:
    dag = _dag(SMALL_GPT)
    for b in range(1, dag.num_ops, 7):
        assert check_stages(SMALL_GPT, Cut((b,)))["max"] <= 1e-5, b
    for b in range(3, dag.num_ops - 10, 11):
        cut = Cut((b, b + 9))
        assert check_stages(SMALL_GPT, cut)["max"] <= 1e-5, cut


def test_skip_connection_over_several_stages_and_multi_reader() -> None:
    dag = _dag(BRANCHY)
    cut = balanced_cut(dag, 5)
    part = dag.partition(cut)
    # h0 (tanh of the input layer) is read by every layer: it crosses every boundary after its stage
    h0 = next(n for n in part.gm.graph.nodes if n.name == "tanh")
    crossing = [s for s in range(cut.num_stages - 1) if h0 in part.outputs[s]]
    assert len(crossing) >= 2, crossing
    # the model input x is read again at the very end: it crosses every boundary
    x = next(n for n in part.gm.graph.nodes if n.name == "x")
    assert all(x in outs for outs in part.outputs[:-1])
    assert check_stages(BRANCHY, cut)["max"] <= 1e-5


def test_tied_weights_refuse_a_split_and_work_inside_one_stage() -> None:
    dag = _dag(TIED)
    # shared.weight is read by the `shared` module (op 4) and by `.t()` of the weight (op 6)
    first = _op_index(dag, lambda o: o.name == "shared")
    second = _op_index(dag, lambda o: o.name == "t")
    for b in range(first + 1, second + 1):
        with pytest.raises(CutError, match="shared.weight"):
            dag.partition(Cut((b,)))
    cut = balanced_cut(dag, 3)
    assert not any(first < b <= second for b in cut.boundaries)
    assert check_stages(TIED, cut)["max"] <= 1e-5
    # right after `.t()` the transposed weight travels as an activation; its gradient comes back
    assert check_stages(TIED, Cut((second + 1,)))["max"] <= 1e-5


def test_tied_embeddings_gpt_keeps_embedding_and_head_together() -> None:
    job = JobSpec(
        model="gpt",
        model_args="n_layer=1,n_embd=16,n_head=2,block_size=32,tie_weights=true",
        data="stdlib",
        data_args="batch_size=4,ctx=16",
        micro_batches=2,
    )
    dag = _dag(job)
    wte = _op_index(dag, lambda o: o.name == "wte")
    head = _op_index(dag, lambda o: o.name == "lm_head")
    with pytest.raises(CutError, match="wte.weight"):
        dag.partition(Cut(((wte + head) // 2,)))
    cut = balanced_cut(dag, 2)
    assert not wte < cut.boundaries[0] <= head
    assert check_stages(job, cut)["max"] <= 1e-5


def test_untraceable_model_names_the_line() -> None:
    with pytest.raises(TraceFailure) as info:
        trace(Untraceable())
    msg = str(info.value)
    assert "\n" not in msg
    assert "models.py" in msg and "if h.sum() > 0" in msg and "control flow" in msg


def test_invalid_cuts_are_refused() -> None:
    gm = trace(Tied())
    for bad in [(0,), (99,), (3, 2), (2, 2)]:
        with pytest.raises(CutError):
            partition(gm, Cut(bad))
    dag = _dag(TIED)
    with pytest.raises(CutError, match="at most"):
        balanced_cut(dag, dag.num_ops + 1)


def test_split_batch_is_along_dim0() -> None:
    batch = (torch.arange(10).reshape(5, 2), torch.arange(5))
    parts = split_batch(batch, 2)
    assert [p[0].shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p[1] for p in parts]), batch[1])


def test_stage_keeps_original_parameter_names() -> None:
    from protocol.model.graph import stage_modules

    model = SMALL_GPT.build_model()
    _, stages = stage_modules(model, Cut((20,)))
    names = set()
    for st in stages:
        names |= set(dict(st.named_parameters()))
    assert names == set(dict(model.named_parameters()))
