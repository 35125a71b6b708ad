"""Mixture-of-experts training and sampling under `memdiff record --emulate` (routing.py): Hugging
Face's MoE models and a plain router run unmodified, hold what the model holds, and the kernels a
router and a sampler run (sort, unique, bincount, histc, cumsum, nonzero, multinomial) allocate
inside the op what their CUDA sources (torch 2.13) allocate for the shapes used."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from conftest import kept_write, read_back

pytest.importorskip("torch")

MOE = """
import json, sys
import torch
import transformers as T

name, out = sys.argv[1], sys.argv[2]
common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, output_router_logits=True)
if name.startswith("mixtral"):  # mixtral_eager: Transformers' own loop over the experts, by torch.where
    implementation = "eager" if name.endswith("_eager") else None
    model = T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                 experts_implementation=implementation))
elif name == "qwen2_moe":
    model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=64, shared_expert_intermediate_size=128))
elif name == "deepseek_v3":  # a group-limited router: 8 experts in 4 groups, 2 groups a token
    model = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **common, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
        v_head_dim=32, qk_nope_head_dim=16))
else:
    model = T.OlmoeForCausalLM(T.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2))
model = model.cuda()
routes = []  # per forward of the router: tokens per expert, and the most groups one token's experts span
for module in model.modules():
    if type(module).__name__ == "DeepseekV3TopkRouter":
        def spy(*args, _forward=module.forward, _group=8 // 4, **kwargs):
            out = _forward(*args, **kwargs)
            picks = out[2].cpu()
            routes.append([torch.bincount(picks.flatten(), minlength=8).tolist(),
                           max(len(set((row // _group).tolist())) for row in picks)])
            return out
        module.forward = spy
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 512, (2, 64), device="cuda")
for step in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay, so the second step's peak holds them all
# what model.cuda() moved: its parameters and buffers (the rotary embedding's inverse frequencies)
params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
          for t in [*model.parameters(), *model.buffers()]}
state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda]
json.dump({"parameter_bytes": sum(params.values()),
           "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "state_bytes": sum(t.numel() * t.element_size() for t in state),
           "max_allocated": torch.cuda.max_memory_allocated(), "routes": routes}, open(out, "w"))
"""


def _record(tmp_path: Path, script: str, *args: str, kept: Optional[Path] = None) -> subprocess.CompletedProcess:
    """`script` run under `memdiff record --emulate h100`; its writes kept in `kept` where given."""
    path = tmp_path / "script.py"
    path.write_text(script)
    keep = ["--keep-writes", str(kept)] if kept is not None else []
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), *keep, "--", sys.executable, str(path), *args],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_hugging_face_moe_models_train_and_hold_what_the_model_holds(tmp_path, name):
    # Transformers' default experts implementation on CUDA is torch's grouped_mm; in fp32 torch runs its
    # fallback (one cuBLAS product per expert), whose meta kernel refused anything but bf16.
    pytest.importorskip("transformers")
    from memdiff import api

    kept = tmp_path / "writes"  # the script's facts file is its own write: in the run's overlay
    done = _record(tmp_path, MOE, name, str(tmp_path / "facts.json"), kept=kept)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(kept_write(kept, tmp_path / "facts.json").read_text())
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["parameter"] == facts["parameter_bytes"]
    assert device.categories["gradient"] == facts["gradient_bytes"]
    # foreach AdamW's step counters stay on the CPU, as on a GPU: its exp_avg and exp_avg_sq are the state
    assert device.categories["optimizer_state"] == facts["state_bytes"] == 2 * facts["gradient_bytes"]
    held = facts["parameter_bytes"] + facts["gradient_bytes"] + facts["state_bytes"]
    assert held < device.peak_bytes <= facts["max_allocated"]
    if name == "deepseek_v3":
        # DeepSeek-V3 picks 2 of 4 groups, then 2 experts within them: balanced picks give each of the 8
        # experts 32 of the 128 tokens x 2 rows, and no token's experts span more than its 2 groups
        assert facts["routes"] == [[[32] * 8, 1]] * 2


def _trace(path: Path) -> List[Dict[str, Any]]:
    with open(path, "rb") as f:
        return list(pickle.load(f)["device_traces"][0])


def _inside(trace: List[Dict[str, Any]], op: str) -> List[int]:
    """Sizes of the allocations made under `op`'s frame, in order."""
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(f"at::_ops::{op}::" in frame["name"] for frame in e["frames"])]


ROUTER = """
import sys
import torch
tokens, experts = int(sys.argv[2]), 8
torch.cuda.memory._record_memory_history()
logits = torch.nn.Parameter(torch.randn(tokens, experts, device="cuda"))  # a weight's numbers: no values
weights, ids = logits.softmax(-1).topk(2, dim=-1)
flat = ids.reshape(-1)                                   # 2 x tokens expert ids: a balanced router's
order = flat.argsort(stable=True)
counts = torch.bincount(flat, minlength=experts)
hist = torch.histc(flat.float(), bins=experts, min=0, max=experts - 1)
offsets = counts.cumsum(0)
present, inverse = torch.unique(flat, return_inverse=True)
x = torch.randn(tokens, 16, device="cuda")
out = torch.zeros_like(x).index_add_(0, order[:tokens] // 2, x)
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(counts.shape[0], present.shape[0], offsets.shape[0])
"""


@pytest.mark.slow
def test_a_router_sorts_counts_and_dedups_with_the_buffers_its_kernels_allocate(tmp_path):
    tokens = 4096
    n = 2 * tokens  # the flattened top-2 ids: past sort's 4,096-element in-place limit (cuda/Sort.h)
    done = _record(tmp_path, ROUTER, str(tmp_path / "own.pickle"), str(tokens))
    assert done.returncode == 0, done.stderr[-3000:]
    # the choices have values (balanced routing): bincount and unique count the 8 experts chosen, as a
    # GPU's do when every expert is picked among 8,192 choices; unique's storage still holds every id
    assert "sized by its minlength" not in done.stderr
    assert done.stdout.split()[:3] == ["8", "8", "8"]
    trace = _trace(tmp_path / "own.pickle")

    sort = _inside(trace, "sort_stable")
    # the output's values and indices, then launch_stable_sort_kernel's one slice (cuda/SortStable.cu
    # segmented_sort_large_segments): an int64 arange of the slice, and cub's temporary storage
    assert sort[:3] == [n * 8, n * 8, n * 8]
    assert len(sort) == 4 and sort[3] > n * 16  # cub's alternate keys and values at least

    # cuda/SummaryOps.cu: the ids' min and max read to the host (8 B each), the int64 counts; 8 bins
    # fit shared memory, so no per-block copies
    assert _inside(trace, "bincount") == [64, 8, 8]
    assert _inside(trace, "histc") == [32]  # the range is given: no min and max, 8 fp32 bins

    # cuda/UniqueCub.cu with the inverse: output and inverse (every element), the sorted copy, the
    # sort's arange and index output, cub's pair sort, the scan's int64 copy, cub's scan, the count,
    # cub's run-length encoding
    unique = _inside(trace, "_unique2")
    assert unique[:5] == [n * 8, n * 8, n * 8, n * 8, n * 8]
    assert unique[6] == n * 8 and unique[8] == 8 and len(unique) == 10

    # cumsum of int64 counts over one dimension: cub's inclusive scan's temporary storage only
    assert len(_inside(trace, "cumsum")) == 2


SAMPLER = """
import sys
import torch
import transformers as T
torch.manual_seed(0)
model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000)).cuda().eval()
ids = torch.randint(0, 1000, (2, 8), device="cuda")
torch.cuda.memory._record_memory_history()
with torch.no_grad():
    seq = ids
    for _ in range(3):  # a hand-written top-k sampling loop
        logits = model(seq).logits[:, -1, :]
        kth = torch.topk(logits, 50).values[:, [-1]]
        logits[logits < kth] = -float("inf")
        seq = torch.cat([seq, torch.multinomial(logits.softmax(-1), 1)], 1)
    out = model.generate(ids, do_sample=True, top_k=50, top_p=0.9, max_new_tokens=4, pad_token_id=0)
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(tuple(seq.shape), tuple(out.shape))
"""


@pytest.mark.slow
def test_sampling_loops_run_and_generate_stops_at_its_length(tmp_path):
    # generate() stops on `unfinished & ~(max_length_done | eos_found)`: the end-of-sequence check reads
    # sampled tokens, which have no values; the known length decides it, as it would on a GPU.
    pytest.importorskip("transformers")
    done = _record(tmp_path, SAMPLER, str(tmp_path / "own.pickle"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "(2, 11) (2, 12)"
    # multinomial's one sample (native/Distributions.cpp): q = empty_like(probabilities), 2 x 1,000 fp32,
    # beside its 2 x 1 int64 output
    sizes = _inside(_trace(tmp_path / "own.pickle"), "multinomial")
    assert sizes[:2] == [16, 8000]


BEAMS = """
import sys
import torch
import transformers as T
torch.manual_seed(0)
# No end-of-sequence token: no beam can finish, so every GPU generates max_new_tokens for each of them
model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, bos_token_id=None,
                                       eos_token_id=None)).cuda().eval()
calls = []
model.transformer.register_forward_hook(lambda *_: calls.append(1))
ids = torch.randint(0, 1000, (2, 8), device="cuda")
torch.cuda.memory._record_memory_history()
with torch.no_grad():
    for early_stopping in (False, True):
        calls.clear()
        out = model.generate(ids, num_beams=4, max_new_tokens=12, early_stopping=early_stopping, pad_token_id=0)
        print(tuple(out.shape), len(calls))
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


@pytest.mark.slow
def test_beam_search_runs_every_beam_to_its_length(tmp_path):
    # Beam search goes on while a running beam's score (log-probabilities: no values here) beats its worst
    # finished one, -1e9 while none has finished: a sentinel that decides the comparison for any finite
    # score. It stopped after one token, its output 9 columns wide.
    pytest.importorskip("transformers")
    done = _record(tmp_path, BEAMS, str(tmp_path / "own.pickle"))
    assert done.returncode == 0, done.stderr[-3000:]
    # the prompt's 8 tokens and 12 new ones, one forward a token, with and without early stopping
    assert done.stdout.splitlines()[-2:] == ["(2, 20) 12", "(2, 20) 12"]
    # each layer's keys and values grow to the last step's 19 positions, for 2 prompts x 4 beams, 4 heads
    # of 16 fp32 channels: 2 layers x (key, value) x 2 generate() calls
    grown = [e for e in _trace(tmp_path / "own.pickle") if e["action"] == "alloc" and e["size"] == 8 * 4 * 19 * 16 * 4
             and any(frame["name"] == "update" and "cache_utils" in frame["filename"] for frame in e["frames"])]
    assert len(grown) == 2 * 2 * 2


BINCOUNT = """
import torch
ids = torch.nn.Parameter(torch.randn(16, 4, device="cuda")).argmax(-1)  # from a weight: no values
print(torch.bincount(ids, minlength=4).shape)
print(torch.bincount(ids).shape)
"""


def test_bincount_of_unknown_values_takes_minlength_and_is_refused_without(tmp_path):
    done = _record(tmp_path, BINCOUNT)
    # minlength's bins (the GPU's size when every id is below it), said
    assert done.stdout.splitlines()[0] == "torch.Size([4])" and "sized by its minlength (4 bins)" in done.stderr
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memdiff: aten::bincount: ") and "pass minlength" in last and "script.py:5" in last
    assert "Traceback" not in done.stderr


REPEAT = """
import torch
counts = torch.tensor([1, 0, 3], device="cuda")  # known: made from host data
print(torch.repeat_interleave(counts).tolist(), torch.repeat_interleave(torch.arange(3, device="cuda"), counts).shape)
drawn = torch.nn.Parameter(torch.randn(5, device="cuda")).argmax().reshape(1).repeat(3)  # from a weight: no values
print(torch.repeat_interleave(torch.arange(3, device="cuda"), drawn, output_size=7).shape)
torch.repeat_interleave(drawn)
"""


def test_repeat_interleave_by_counts_is_sized_by_known_counts_and_refused_without(tmp_path):
    done = _record(tmp_path, REPEAT)
    assert done.stdout.splitlines()[:2] == ["[0, 2, 2, 2] torch.Size([4])", "torch.Size([7])"]
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memdiff: aten::repeat_interleave: ") and "pass output_size" in last
    assert "script.py:7" in last and "Traceback" not in done.stderr


TOP_P = """
import sys
import torch
torch.cuda.memory._record_memory_history()
scores = torch.randn(2, 8192, device="cuda")
ranked, order = torch.sort(scores, descending=True)   # top-p's sort over the vocabulary, per row
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def test_a_top_p_sort_over_a_vocabulary_sorts_the_rows_as_one(tmp_path):
    # 2 slices of 8,192 (cuda/SortStable.cu, under 128 slices): the values and indices, then
    # (slice, index) int2 pairs twice (2 x 8,192 x 8 B), the sort's own fp32 key output, cub's pair sort,
    # and cub's sort of the pairs by slice; all freed before the op returns
    done = _record(tmp_path, TOP_P, str(tmp_path / "own.pickle"))
    assert done.returncode == 0, done.stderr[-3000:]
    trace = _trace(tmp_path / "own.pickle")
    n = 2 * 8192
    sizes = _inside(trace, "sort")
    assert sizes[:5] == [n * 4, n * 8, n * 8, n * 8, n * 4]
    assert len(sizes) == 7
    allocs = [k for k, e in enumerate(trace) if e["action"] == "alloc"
              and any("at::_ops::sort::" in frame["name"] for frame in e["frames"])]
    for k in allocs[2:]:  # each of the kernel's own buffers is freed after it is made
        assert any(e["action"] == "free_requested" and e["addr"] == trace[k]["addr"] for e in trace[k + 1:])
    assert not any(e["action"] == "free_requested" and e["addr"] == trace[k]["addr"]
                   for k in allocs[:2] for e in trace[k + 1:])  # the values and indices stay


EXPERT_CHOICE = """
import sys
import torch
torch.cuda.memory._record_memory_history()
affinity = torch.randn(4, 32768, device="cuda")        # 4 experts x 32,768 tokens
weights, chosen = affinity.topk(8192, dim=-1)          # each expert picks its capacity of tokens
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def test_an_expert_choice_topk_sorts_its_results_past_4096(tmp_path):
    # cuda/TensorTopK.cpp: 8,192 results per row are more than sort's in-place 4,096, so topk sorts them
    # out of place: sortedIndices and sortedValues like the results, the sort's buffers (4 slices of
    # 8,192: SortStable.cu's pair sort), then the gathered indices
    done = _record(tmp_path, EXPERT_CHOICE, str(tmp_path / "own.pickle"))
    assert done.returncode == 0, done.stderr[-3000:]
    n = 4 * 8192
    sizes = _inside(_trace(tmp_path / "own.pickle"), "topk")
    assert sizes[:4] == [n * 4, n * 8, n * 8, n * 4]  # values, indices, sortedIndices, sortedValues
    assert sizes[4:7] == [n * 8, n * 8, n * 4]  # the (slice, index) pairs twice, the sort's key output
    assert sizes[-1] == n * 8 and len(sizes) == 10  # the gather, after the two cub sorts


def _rows_at(trace: List[Dict[str, Any]], function: Any, text: str) -> List[int]:
    """Sizes of the allocations made at the line of `function`'s source that holds `text`."""
    import inspect

    function = inspect.unwrap(function)  # Transformers wraps the experts' forward in its dispatcher
    lines, first = inspect.getsourcelines(function)
    line = first + next(i for i, source in enumerate(lines) if text in source)
    path = inspect.getsourcefile(function)
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(f["filename"] == path and f["line"] == line for f in e["frames"])]


BALANCED = """
import sys
import torch
tokens, experts, k = int(sys.argv[1]), 8, 2
logits = torch.nn.Parameter(torch.randn(tokens, experts, device="cuda"))  # a weight's numbers: no values
weights, ids = logits.topk(k, dim=1)
# JetMoE's router: the counts its rows are split by
sizes = torch.zeros(tokens, experts, device="cuda").scatter(1, ids, 1).long().sum(0).tolist()
parts = torch.randn(tokens * k, 16, device="cuda").split(sizes)
# Mixtral's loop: each expert's tokens by torch.where of its one-hot mask
mask = torch.nn.functional.one_hot(ids, num_classes=experts).permute(2, 1, 0)
taken = [torch.where(mask[e])[1].shape[0] for e in range(experts)]
print(sizes, taken, bool((ids[:, 0] != ids[:, 1]).all()), weights.sum().item())
"""


@pytest.mark.slow
def test_a_routers_choices_are_balanced_at_any_batch_size(tmp_path):
    # 32,768 tokens: the top-2 ids (65,536), their one-hot masks (524,288) and JetMoE's gates (262,144)
    # are past the 65,536 elements other values are kept for; a GPU's counts sum to the rows whatever
    # the batch, and split refuses counts that do not
    tokens, experts, k = 32768, 8, 2
    done = _record(tmp_path, BALANCED, str(tokens))
    assert done.returncode == 0, done.stderr[-3000:]
    share = tokens * k // experts  # a balanced router's: every expert the same share of the choices
    # two distinct experts a token; topk's values are made from the weights and have none: their sum is
    # a single float made without values, which takes the run's first number (docs/emulate.md)
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"{[share] * experts} {[share] * experts} True {read_back(0)!r}"


MEGATRON_ROUTER = """
import sys
import torch
tokens, experts, k = int(sys.argv[1]), 8, 2
logits = torch.nn.Parameter(torch.randn(tokens, experts, device="cuda"))  # a weight's numbers: no values
probs, top = logits.topk(k, dim=1)
# Megatron-core 0.16.1's router (moe_utils.topk_routing_with_score_function): its choices scattered
# into zeros shaped like the logits, then the tokens each expert takes, which its experts split by
routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
counts = routing_map.sum(dim=0).long().tolist()
# its permutation (moe_utils.permute): each expert's probabilities, by the mask
permuted = routing_probs.T.contiguous().masked_select(routing_map.T.contiguous())
print(counts, permuted.shape[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [256, 32768])
def test_megatrons_router_counts_its_choices_scattered_into_zeros_like_its_logits(tmp_path, tokens):
    # 32,768 tokens x 8 experts: the routing map (262,144 elements) is past the 65,536 other values
    # are kept for. The logits have no values; zeros_like reads only their shape, so the map has the
    # choices' values, and masked_select keeps the map's true elements, one per choice, as on a GPU
    done = _record(tmp_path, MEGATRON_ROUTER, str(tokens))
    assert done.returncode == 0, done.stderr[-3000:]
    experts, k = 8, 2
    assert done.stdout.strip().splitlines()[-1] == f"{[tokens * k // experts] * experts} {tokens * k}"


JETMOE = """
import json, sys
import torch
import transformers as T
sys.path.insert(0, sys.argv[2])  # benchmarks/sweeps: the zoo's small config (two layers, 4 experts, 2 a token)
from zoo_transformers import small_config
model = T.AutoModelForCausalLM.from_config(small_config(T, "jetmoe")).cuda()
sizes = []  # what each expert linear is given: its rows, split by the router's counts
for module in model.modules():
    if type(module).__name__ == "JetMoeParallelExperts":
        module.register_forward_pre_hook(lambda module, args: sizes.append([int(args[0].shape[0]), list(args[1])]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(4, 1000, (2, 32), device="cuda")
for step in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda]
json.dump({"parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
           "state_bytes": sum(t.numel() * t.element_size() for t in state),
           "hidden": model.config.hidden_size, "experts": model.config.num_local_experts,
           "per_token": model.config.num_experts_per_tok, "sizes": sizes}, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_jetmoe_splits_its_rows_by_balanced_counts_and_trains(tmp_path):
    # JetMoE's router reads its experts' counts back (`expert_size.tolist()`) to split the rows: they
    # read as zeros where the choices had no values, and split refused 128 rows into [0, 0, 0, 0]
    pytest.importorskip("transformers")
    from transformers.models.jetmoe import modeling_jetmoe

    from memdiff import api

    kept = tmp_path / "writes"
    done = _record(tmp_path, JETMOE, str(tmp_path / "facts.json"), str(Path(__file__).resolve().parent.parent /
                                                                       "benchmarks" / "sweeps"), kept=kept)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(kept_write(kept, tmp_path / "facts.json").read_text())
    tokens, k, n, hidden = 2 * 32, facts["per_token"], facts["experts"], facts["hidden"]
    # every call of an expert linear (attention's and the MLP's, 2 layers, 2 forwards) gets tokens x k
    # rows, and the counts sum to them: a balanced router's, the same share for each expert
    assert len(facts["sizes"]) == 2 * 2 * 4  # attention's two (map, reduce) and the MLP's two
    assert all(rows == tokens * k and counts == [tokens * k // n] * n for rows, counts in facts["sizes"])
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["parameter"] == facts["parameter_bytes"] + facts["buffer_bytes"]
    assert device.categories["gradient"] == facts["parameter_bytes"]
    assert device.categories["optimizer_state"] == facts["state_bytes"] == 2 * facts["parameter_bytes"]
    # the MLP experts' input (saved for the backward of their products) is tokens x k rows of the hidden
    # size, in each layer's forward, whatever the routing
    saved = _rows_at(_trace(tmp_path / "run.pickle"), modeling_jetmoe.JetMoeMoE.forward,
                     "expert_inputs = layer_input[batch_index]")
    assert saved == [tokens * k * hidden * 4] * 4


@pytest.mark.slow
def test_mixtrals_loop_over_experts_gives_them_tokens_x_k_rows(tmp_path):
    # Transformers' eager experts: `torch.where(expert_mask[e])` picks each expert's tokens. Without
    # values every expert (and the mask's extra class) took every token and choice, 5 x 256 rows a layer
    pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral

    from memdiff import api

    kept = tmp_path / "writes"
    done = _record(tmp_path, MOE, "mixtral_eager", str(tmp_path / "facts.json"), kept=kept)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(kept_write(kept, tmp_path / "facts.json").read_text())
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["parameter"] == facts["parameter_bytes"]
    assert device.categories["gradient"] == facts["gradient_bytes"]
    assert device.categories["optimizer_state"] == facts["state_bytes"] == 2 * facts["gradient_bytes"]
    tokens, k, hidden = 2 * 64, 2, 64
    states = _rows_at(_trace(tmp_path / "run.pickle"), modeling_mixtral.MixtralExperts.forward,
                      "current_state = hidden_states[token_idx]")
    # each layer's experts together take the tokens x k rows a GPU routes (2 layers, 2 steps), fp32
    assert len(states) == 2 * 2 * 4 and sum(states) == 2 * 2 * tokens * k * hidden * 4
