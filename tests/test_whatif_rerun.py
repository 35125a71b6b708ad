"""`memdiff whatif --emulate GPU -- python train.py`: each change made inside the emulator to the unmodified
script must be the run of the same script with the change made by hand (tests/scenarios/whatif_llama.py's
flags, the ordinary way: `checkpoint(layer, x, use_reentrant=False)`, `model.to(bf16)`, `torch.autocast`
around the model's call, `torch.optim.SGD`, `zero_grad(set_to_none=False)`, two micro-batches of half the
batch), to the byte: the allocated and reserved peaks of its snapshot and the max_memory_allocated the
script prints.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_held_to_real

from memdiff.analyse.classify import load_rules
from memdiff.read.inputs import read_summary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scenarios" / "whatif_llama.py"
SMALL = ["--layers", "4", "--dim", "128", "--vocab", "1024", "--batch", "4", "--seq", "64", "--steps", "2"]
# Each change, the file its re-run is kept as, and the script's own flag for it.
BY_HAND = {"checkpoint": ("checkpoint", ["--checkpoint", "1"]),
           "checkpoint=0.5": ("checkpoint-0.5", ["--checkpoint", "0.5"]),
           "weights=bf16": ("weights-bf16", ["--weights", "bf16"]),
           "autocast=bf16": ("autocast-bf16", ["--autocast", "bf16"]),
           "optimizer=sgd": ("optimizer-sgd", ["--optimizer", "sgd"]),
           # AdamW built as AdamW with amsgrad: Python calls __init__ again on an instance of the class asked
           "optimizer=adamw-amsgrad": ("optimizer-adamw-amsgrad", ["--optimizer", "adamw-amsgrad"]),
           "zero-grad=zeros": ("zero-grad-zeros", ["--zero-grad", "zeros"]),
           "step=fused": ("step-fused", ["--step", "fused"]),
           "step=single": ("step-single", ["--step", "single"]),
           "accumulate=2": ("accumulate-2", ["--accumulate", "2"])}
MAX_ALLOCATED = re.compile(r"max_memory_allocated (\d+)")


def memdiff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], capture_output=True, text=True, cwd=ROOT)


def whatif(out: Path, *flags: str, script=()) -> subprocess.CompletedProcess:
    return memdiff("whatif", "--emulate", "h100", "-o", f"{out}/", *flags, "--", "python", str(SCRIPT), *SMALL,
                   "--accumulate", "{accumulate}", *script)


def peaks(snapshot: Path, output: str):
    device = read_summary(str(snapshot), load_rules()).devices[0]
    printed = MAX_ALLOCATED.search(output)
    return device.peak_bytes, device.reserved_peak_bytes, int(printed.group(1)) if printed else None


@pytest.fixture(scope="module")
def rerun(tmp_path_factory, torch):
    out = tmp_path_factory.mktemp("whatif") / "runs"
    changes = [a for change in BY_HAND for a in ("--change", change)]
    done = whatif(out, "--format", "json", "--budget", "100GiB", *changes)
    assert done.returncode == 0, done.stderr
    return out, json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("change", list(BY_HAND))
def test_each_rerun_is_the_run_with_the_change_made_by_hand_to_the_byte(rerun, tmp_path, change):
    out, doc = rerun
    name, flags = BY_HAND[change]
    hand = tmp_path / "hand.pickle"
    done = memdiff("record", "--emulate", "h100", "-o", str(hand), "--", "python", str(SCRIPT), *SMALL, *flags)
    assert done.returncode == 0, done.stderr
    emulated = peaks(out / f"{name}.pickle", (out / f"{name}.log").read_text())
    assert emulated == peaks(hand, done.stdout)
    assert emulated[2] is not None  # the script's own max_memory_allocated was compared too
    row = next(c for c in doc["devices"][0]["changes"] if c["change"] == change)
    assert row["applies"] and row["predicted_peak_bytes"] == emulated[0]


@pytest.mark.slow
def test_the_baseline_is_the_script_as_given(rerun, tmp_path):
    out, doc = rerun
    hand = tmp_path / "hand.pickle"
    done = memdiff("record", "--emulate", "h100", "-o", str(hand), "--", "python", str(SCRIPT), *SMALL)
    assert done.returncode == 0, done.stderr
    assert peaks(out / "baseline.pickle", (out / "baseline.log").read_text()) == peaks(hand, done.stdout)


@pytest.mark.slow
def test_the_table_is_the_whatif_table_marked_rerun_against_the_baseline_run(rerun):
    out, doc = rerun
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "memdiff" / "schemas" / "whatif.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert doc["rerun_on"] == "h100" and doc["file"] == str(out / "baseline.pickle")
    base = read_summary(str(out / "baseline.pickle"), load_rules()).devices[0].peak_bytes
    device = doc["devices"][0]
    assert device["base_peak_bytes"] == base and device["optimizer"] == "adamw"
    assert [c["change"] for c in device["changes"]] == list(BY_HAND)
    for c in device["changes"]:
        assert c["delta_bytes"] == c["predicted_peak_bytes"] - base and c["fits_budget"] is True
        # each row carries its run's own phase peaks and categories at the peak, as its snapshot says
        run = read_summary(str(out / f"{BY_HAND[c['change']][0]}.pickle"), load_rules()).devices[0]
        assert c["categories"] == run.categories and sum(c["categories"].values()) == c["predicted_peak_bytes"]
        assert c["phase_peaks"][c["predicted_peak_phase"]] == c["predicted_peak_bytes"]
        # and the reserved peak (what runs out) of the snapshot it names
        assert c["snapshot"] == str(out / f"{BY_HAND[c['change']][0]}.pickle")
        assert c["reserved_peak_bytes"] == run.reserved_peak_bytes > c["predicted_peak_bytes"]
    # A change made by hand the script already has its own way: the baseline is the script as given.
    assert next(c for c in device["changes"] if c["change"] == "zero-grad=zeros")["delta_bytes"] > 0
    text = memdiff("whatif", str(out / "baseline.pickle"))  # the baseline is an ordinary snapshot
    assert text.returncode == 0, text.stderr


@pytest.mark.slow
def test_text_output_says_re_run_and_a_change_that_finds_nothing_to_change_says_why(tmp_path, torch):
    done = whatif(tmp_path / "runs", "--change", "optimizer=rmsprop", "--change", "zero-grad=none",
                  script=["--steps", "1"])
    assert done.returncode == 0, done.stderr
    assert "(re-run on emulated h100, each change a run)" in done.stdout
    assert "re-run peak" in done.stdout and "predicted" not in done.stdout
    header = next(line for line in done.stdout.splitlines() if line.startswith("change"))
    assert header.split() == ["change", "re-run", "peak", "reserved", "phase", "delta", "%"]
    assert "RMSprop(lr) built where the script builds AdamW" in done.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "baseline.log", "baseline.pickle", "optimizer-rmsprop.log", "optimizer-rmsprop.pickle",
        "zero-grad-none.log", "zero-grad-none.pickle"]


@pytest.mark.slow
def test_a_script_failure_is_one_line_exit_2(tmp_path, torch):
    done = whatif(tmp_path / "runs", "--change", "checkpoint", script=["--fail"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "the script failed" in done.stderr and "ValueError: the data set is missing" in done.stderr


BF16_INPUT = """import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    x = torch.randn(16, 64, device="cuda")
    model(x).float().pow(2).mean().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_change_the_script_fails_under_leads_with_the_error_and_its_line(tmp_path, torch):
    """bf16 weights fed an fp32 batch fail as CUDA's addmm does (dtypes.check). The one line led with ~1,500
    characters of the log's traceback (torch's and memdiff's frames) before the error: it leads with the error
    and the script's line now, as the emulator's refusals read, and names the log."""
    script = tmp_path / "train.py"
    script.write_text(BF16_INPUT)
    done = memdiff("whatif", "--emulate", "h100", "-o", f"{tmp_path}/runs/", "--change", "weights=bf16", "--",
                   "python", str(script))
    log = tmp_path / "runs" / "weights-bf16.log"
    assert done.returncode == 2 and done.stderr == (
        "memdiff: whatif: the script failed with weights=bf16: RuntimeError: expected mat1 and mat2 to have the "
        "same dtype, but got: float != c10::BFloat16, called at train.py:6 (exit 1, not out of memory); its "
        f"output: {log}\n"), done.stderr
    assert "Traceback" in log.read_text()  # the traceback is kept where the line says


SEQUENTIAL_WITH_HEAD = """import torch


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


net = torch.nn.Sequential(*[Block(64) for _ in range(8)], torch.nn.Linear(64, 8)).cuda()
opt = torch.optim.AdamW(net.parameters())
for _ in range(2):
    net(torch.randn(256, 64, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_the_rerun_checkpoints_the_blocks_of_a_sequential_with_a_head_as_the_replay_finds_them(tmp_path, torch):
    """nn.Sequential(8 x Block, Linear): the re-run's checkpoint looked for a container whose children were all
    of one class and found none (the head is a Linear), where the replay of the same run finds the 8 blocks on
    its stacks. Both find the model's 8 now."""
    script = tmp_path / "train.py"
    script.write_text(SEQUENTIAL_WITH_HEAD)
    done = memdiff("whatif", "--emulate", "h100", "-o", f"{tmp_path}/runs/", "--change", "checkpoint", "--format",
                   "json", "--", "python", str(script))
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["devices"][0]["changes"][0]
    assert row["applies"], row
    assert any(a.startswith("8 of the 8 Block blocks of Sequential checkpointed") for a in row["assumptions"]), row
    replay = memdiff("whatif", str(tmp_path / "runs" / "baseline.pickle"), "--change", "checkpoint", "--format", "json")
    assert replay.returncode == 0, replay.stderr
    assert len(json.loads(replay.stdout)["devices"][0]["blocks"]) == 8


# The same model with its 8 blocks checkpointed by hand (torch.utils.checkpoint, non-reentrant).
SEQUENTIAL_BY_HAND = SEQUENTIAL_WITH_HEAD.replace(
    "return x + self.down(torch.relu(self.up(x)))",
    "return torch.utils.checkpoint.checkpoint(lambda t: t + self.down(torch.relu(self.up(t))), x, "
    "use_reentrant=False)").replace("import torch\n", "import torch\nimport torch.utils.checkpoint\n", 1)


@pytest.mark.slow
def test_the_replays_checkpoint_makes_the_backward_threads_cublaslt_workspace_as_the_run_by_hand(tmp_path, torch):
    """Sequential(8 x Block, Linear) with biases: the checkpointed forward is recomputed on autograd's
    backward thread, whose handle then runs addmm (cuBLASLt) for the first time, where the backward's own
    products (mm) never did: its 1 MiB cuBLASLt workspace stays to the end. The replay predicted 1 MiB
    under the run checkpointed by hand (-1.10 MiB for -106 KiB, in the optimizer step); now to the byte."""
    for name, text in (("train.py", SEQUENTIAL_WITH_HEAD), ("by_hand.py", SEQUENTIAL_BY_HAND)):
        (tmp_path / name).write_text(text)
        done = memdiff("record", "--emulate", "h100", "-o", str(tmp_path / f"{name}.pickle"), "--", "python",
                       str(tmp_path / name))
        assert done.returncode == 0, done.stderr
    replay = memdiff("whatif", str(tmp_path / "train.py.pickle"), "--change", "checkpoint", "--format", "json")
    assert replay.returncode == 0, replay.stderr
    row = json.loads(replay.stdout)["devices"][0]["changes"][0]
    by_hand = read_summary(str(tmp_path / "by_hand.py.pickle"), load_rules()).devices[0]
    assert (row["predicted_peak_bytes"], row["predicted_peak_phase"]) == (by_hand.peak_bytes, by_hand.phase_at_peak)
    assert any("cuBLASLt workspace (1.00 MiB)" in a for a in row["assumptions"]), row["assumptions"]


def test_accumulation_without_the_scripts_flag_is_refused_before_any_run(tmp_path):
    done = memdiff("whatif", "--emulate", "h100", "-o", f"{tmp_path}/runs/", "--change", "accumulate=2", "--",
                   "python", str(SCRIPT))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "{accumulate}" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_emulate_needs_an_output_folder_and_a_run_is_not_a_command():
    done = memdiff("whatif", "--emulate", "h100", "--", "python", str(SCRIPT))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "-o DIR/" in done.stderr
    done = memdiff("whatif", "run.pickle", "--", "python", str(SCRIPT))
    assert done.returncode == 2 and done.stderr.count("\n") == 1


# Each change re-run on tests/scenarios/train.py's GPT-2 (as the real windows were captured) and the real
# H100 window of the same script with the change made by its own flag (tests/data/cuda/README.md).
REAL = {"weights=bf16": "gpt2-bf16", "optimizer=sgd": "gpt2-sgd", "optimizer=sgd-momentum": "gpt2-sgd-momentum",
        "optimizer=adafactor": "gpt2-adafactor", "checkpoint": "gpt2-checkpoint",
        "checkpoint=0.5": "gpt2-checkpoint-half", "zero-grad=zeros": "gpt2-keep-grads",
        "autocast=bf16": "gpt2-autocast", "step=fused": "gpt2-fused"}


@pytest.mark.slow
def test_each_rerun_of_the_gpt2_script_is_within_1pct_of_the_real_h100_run_with_that_change(tmp_path, torch):
    pytest.importorskip("transformers")
    cuda = ROOT / "tests" / "data" / "cuda"
    sys.path.insert(0, str(cuda))
    from capture import GPT2  # the arguments the real runs were captured with

    out = tmp_path / "runs"
    changes = [a for change in REAL for a in ("--change", change)]
    done = memdiff("whatif", "--emulate", "h100", "-o", f"{out}/", "--format", "json", *changes, "--", "python",
                   str(ROOT / "tests" / "scenarios" / "train.py"), *GPT2, "--out", str(tmp_path / "own.pickle"))
    assert done.returncode == 0, done.stderr
    rows = {c["change"]: c for c in json.loads(done.stdout)["devices"][0]["changes"]}
    assert rows and all(row["applies"] for row in rows.values())
    rules = load_rules()
    real = {window: read_summary(str(cuda / f"{window}.pickle.gz"), rules).devices[0]
            for window in ("gpt2-base", *REAL.values())}
    # Each re-run is an emulated run of the script as any other, held as tests/test_emulate_gpt2.py holds
    # the script's own recording.
    assert_held_to_real(read_summary(str(out / "baseline.pickle"), rules).devices[0], real["gpt2-base"], "baseline")
    for change, window in REAL.items():
        emu = read_summary(rows[change]["snapshot"], rules).devices[0]
        assert_held_to_real(emu, real[window], window)
        # what the table says is that run's figure
        assert rows[change]["predicted_peak_bytes"] == emu.peak_bytes, change
        # the saving, as the real pair measures it, within 1% of the real peak too
        saving, really = rows[change]["delta_bytes"], real[window].peak_bytes - real["gpt2-base"].peak_bytes
        assert abs(saving - really) <= 0.01 * real[window].peak_bytes, change
    # the fused step's saving is in the optimizer step, below this run's peak: its phase peak is the real one's
    fused = max(p.peak_bytes for p in real["gpt2-fused"].phase_peaks if p.phase == "optimizer")
    assert abs(rows["step=fused"]["phase_peaks"]["optimizer"] / fused - 1) <= 0.01


@pytest.mark.slow
def test_a_model_built_on_the_gpu_is_found_through_its_optimizer(tmp_path, torch):
    # `with torch.device("cuda"): model = ...` moves nothing; the changes on the trained root still apply,
    # and equal the same script changed by hand.
    out = tmp_path / "runs"
    done = whatif(out, "--format", "json", "--change", "weights=bf16", "--change", "checkpoint",
                  "--change", "autocast=bf16", script=["--on-gpu"])
    assert done.returncode == 0, done.stderr
    rows = {c["change"]: c for c in json.loads(done.stdout)["devices"][0]["changes"]}
    for change, flags in (("weights=bf16", ["--weights", "bf16"]), ("checkpoint", ["--checkpoint", "1"]),
                          ("autocast=bf16", ["--autocast", "bf16"])):
        assert rows[change]["applies"], rows[change]
        hand = tmp_path / "hand.pickle"
        made = memdiff("record", "--emulate", "h100", "-o", str(hand), "--", "python", str(SCRIPT), *SMALL,
                       "--on-gpu", *flags)
        assert made.returncode == 0, made.stderr
        name = BY_HAND[change][0]
        assert peaks(out / f"{name}.pickle", (out / f"{name}.log").read_text()) == peaks(hand, made.stdout), change


@pytest.mark.slow
def test_each_rerun_row_is_categorized_by_the_rules_the_command_was_given(tmp_path, torch):
    # the category rules are read once at the entry and travel to every run; the runs do not reload the defaults
    done = whatif(tmp_path / "runs", "--format", "json", "--change", "optimizer=sgd",
                  "--custom-profile", '{"head_logits": "^forward$"}', script=["--steps", "1"])
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["devices"][0]["changes"][0]
    assert row["categories"].get("head_logits", 0) > 0, row["categories"]
