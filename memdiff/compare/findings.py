"""findings: the catalogue of everything memdiff says beyond the numbers, each under a stable code.

A code is a family letter and a number (`P001`): T trace and format, P phases, K memory kept
from earlier steps or forwards, C categories, A the allocator (reserved memory, OOMs), W the
what-if and the forecast, G the gate. Each entry holds its short name, its severity, the
template of its sentence, and the documentation `memdiff rule CODE` prints and
docs/findings.md is generated from (what it means, why it matters, a real example, what to
do). The stages that observe something call `finding(CODE, ...)` with the figures; no other
module words a finding. A code never changes
meaning: a new meaning is a new code, and tests/test_findings.py pins the codes the real
snapshots emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from memdiff.errors import InputError, clip
from memdiff.model import Finding

ERROR, WARNING, INFO = "error", "warning", "info"
# How each surface names a severity before the code: `warning: P001 device 0: ...`.
SEVERITY_WORDS = {ERROR: "error", WARNING: "warning", INFO: "note"}

FAMILIES = {
    "T": "trace and format",
    "P": "phases and timing",
    "K": "memory kept from earlier steps or forwards (leaks)",
    "C": "categories and guesses",
    "A": "the allocator: reserved memory, out of memory",
    "W": "what-if and forecast",
    "G": "the gate",
}


@dataclass(frozen=True)
class Code:
    """One catalogue entry: a finding's stable code, name, severity, sentence and documentation."""

    code: str
    name: str
    severity: str
    template: str  # str.format with the finding's data
    means: str
    why: str
    fix: str
    example_command: str  # what shows it, on a real snapshot where one shows it
    example_output: str  # the line it printed

    @property
    def anchor(self) -> str:
        """The section's anchor in docs/findings.md (GitHub's: the heading lowercased, spaces as hyphens)."""
        return f"{self.code.lower()}-{self.name}"


CATALOGUE: Tuple[Code, ...] = (
    # --- T: trace and format ------------------------------------------------------------------
    Code("T001", "trace-overflowed", WARNING,
         "the trace overflowed {ring}: its first events are gone, so memory allocated before them counts as "
         "static and their stacks are unknown (record with a larger max_entries)",
         "torch says the allocator's trace ring buffer wrapped (`trace_alloc_overflowed`): the trace lacks the "
         "run's first events.",
         "Memory allocated before the first event kept counts as static memory, without a stack and without a "
         "category of its own; a diff against a run whose trace did not wrap compares different accounts of the "
         "same memory.",
         "Record with a larger `max_entries` (`torch.cuda.memory._record_memory_history(max_entries=...)`, "
         "`memdiff record --max-entries`), or record fewer steps (`memdiff record --steps`).",
         "hand-built in tests/test_diff.py (no real snapshot in tests/ says its buffer wrapped)",
         "warning: T001 the trace overflowed its ring buffer of 2 entries: its first events are gone, so memory "
         "allocated before them counts as static and their stacks are unknown (record with a larger max_entries)"),
    Code("T002", "trace-starts-mid-run", WARNING,
         "the trace starts mid-run: {frees:,} frees of allocations made before it ({freed}) count as static "
         "memory. Record with a larger max_entries to see their stacks.",
         "The trace frees memory it never saw allocated: recording started after the run did, or the ring buffer "
         "dropped the first events without saying so.",
         "Those allocations count as static memory from the start of the trace: their stacks, categories and "
         "lifetimes are unknown, and the peak's groups miss them.",
         "Start recording before the model is built, or with a larger `max_entries`; `--steps` on any command "
         "reads a window of a long trace without losing the memory carried into it.",
         "memdiff peak ../shared/snapshots/cs336-medium-ctx128-train.pickle",
         "warning: T002 device 0: the trace starts mid-run: 438 frees of allocations made before it (3.15 "
         "GiB) count as static memory. Record with a larger max_entries to see their stacks."),
    Code("T003", "mid-run-in-one-run", WARNING,
         "only the {which} trace starts mid-run (its ring buffer dropped events), so its static memory includes "
         "what the other run shows as allocations",
         "Of the two runs compared, one trace frees memory it never saw allocated (T002) and the other does not.",
         "The same memory reads as static in one run and as groups with stacks in the other: rows show as gone "
         "and new where nothing changed.",
         "Record both runs the same way, from the same point of the script and with the same `max_entries`; "
         "a job that always starts mid-run can `--ignore T003`.",
         "memdiff ../shared/snapshots/cs336-medium-ctx128-train.pickle "
         "../shared/snapshots/cs336-medium-ctx128-infer.pickle",
         "warning: T003 device 0: only the base trace starts mid-run (its ring buffer dropped events), so its "
         "static memory includes what the other run shows as allocations"),
    Code("T004", "window-of-trace", INFO,
         "this is a window of a longer trace: {frees:,} frees of memory allocated before it ({freed}) count as "
         "static memory.",
         "The snapshot is a window of a longer trace (`memdiff slice`, `--steps`): memory carried into the window "
         "is freed in it without being allocated in it.",
         "Nothing is lost: the window keeps the stack and category the full trace gives that memory; this only "
         "says why the window's static memory is what it is.",
         "Nothing to do; read the whole trace for the run's static memory.",
         "memdiff peak tests/data/cuda/gpt2-log-tensor.pickle.gz --steps 2",
         "note: T004 device 0: this is a window of a longer trace: 3 frees of memory allocated before it "
         "(32.00 KiB) count as static memory."),
    Code("T005", "devices-differ", WARNING,
         "devices differ: base has {base_devices}, head has {head_devices}",
         "The two runs allocated on different devices.",
         "A device only one run has compares with nothing: all its memory reads as new or gone.",
         "Compare runs recorded on the same devices, or choose one device with `--device` where the command "
         "has it.",
         "memdiff ../shared/snapshots/diffusion-segments-list.pickle ../shared/snapshots/linear-grad.pickle",
         "warning: T005 devices differ: base has [1], head has [0]"),
    Code("T006", "formats-differ", WARNING,
         "snapshot formats differ: base is {base_format}, head is {head_format}",
         "The snapshots were written by torch versions with different snapshot formats (how memdiff read each "
         "is in its input line).",
         "Older formats lack fields (times, stacks' C++ frames, categories' evidence): what one run shows, the "
         "other may not, and rows that differ only by what the format records show as changes.",
         "Record both runs with the same torch.",
         "memdiff tests/data/cuda/gpt2-base.pickle.gz tests/data/cpu/fsdp2-missed-free-rank1.pickle.gz",
         "warning: T006 snapshot formats differ: base is trace-timed, head is profiler"),
    Code("T007", "keys-differ", WARNING,
         "snapshot keys differ, so the torch versions may too ({detail})",
         "The snapshots have the same format but different top-level keys: torch wrote each with other fields.",
         "Different torch versions can allocate differently (kernels, workspaces, the allocator's rounding): "
         "part of the change may be torch's.",
         "Record both runs with the same torch; the rows still compare what each run allocated.",
         "memdiff ../shared/snapshots/cs336-ctx128-fwd-fp32.pickle "
         "../shared/snapshots/cs336-medium-ctx128-train.pickle",
         "warning: T007 snapshot keys differ, so the torch versions may too (only head has "
         "trace.compile_context, trace.user_metadata)"),
    Code("T008", "allocator-settings-differ", WARNING,
         "allocator settings differ ({detail})",
         "The caching allocator ran with different settings (`PYTORCH_CUDA_ALLOC_CONF`: expandable segments, "
         "split sizes, garbage collection threshold).",
         "Reserved memory and fragmentation depend on them, and an OOM can come and go with them while the "
         "tensors stay the same.",
         "Record both runs with the same `PYTORCH_CUDA_ALLOC_CONF`, or say in the pull request that the setting "
         "is the change.",
         "memdiff ../shared/snapshots/cs336-ctx128-fwd-fp32.pickle "
         "../shared/snapshots/cs336-medium-ctx128-train.pickle",
         "warning: T008 allocator settings differ (graph_capture_record_stream_reuse: not recorded -> False)"),
    Code("T009", "autograd-nodes-in-one-run", WARNING,
         "only the {which} run's stacks name autograd nodes (AddmmBackward0); the {other}'s backward memory "
         "reads run_backward (a CPU capture by an earlier memdiff, or CUDA stacks=\"python\"), so its backward "
         "rows show as gone and new: record both runs the same way",
         "The backward's memory is named by the autograd node that made it in one run, and by the engine's "
         "entry in the other. A baseline stores its groups without stacks and keeps whether its run's named "
         "nodes; one made before it kept that says nothing of it.",
         "Rows are aligned by their stacks: the same backward memory reads as gone from one and new in the other.",
         "Record both runs the same way (`memdiff record`, with C++ stacks on CUDA).",
         "hand-built in tests/test_cuda_snapshots.py (gpt2-base with its autograd nodes' frames taken out)",
         "warning: T009 device 0: only the head run's stacks name autograd nodes (AddmmBackward0); the base's "
         "backward memory reads run_backward (a CPU capture by an earlier memdiff, or CUDA stacks=\"python\"), so "
         "its backward rows show as gone and new: record both runs the same way"),
    Code("T010", "event-counts-differ", WARNING,
         "event counts differ {ratio:.1f}x ({base_events:,} -> {head_events:,} events{steps}): the runs may not "
         "record the same work",
         "One trace has many times the events of the other, and the runs do not record the same number of "
         "steps. Against a baseline, the step count it stores is compared; a baseline made before baselines "
         "kept one has none, and the sentence says the steps are unknown.",
         "A run that records more steps, a warm-up, or an evaluation loop is other work: its peak may be another "
         "moment's.",
         "Record the same steps in both runs (`memdiff record --steps 3:5`), or compare a window of each "
         "(`--steps`).",
         "memdiff tests/data/cuda/gpt2-base.pickle.gz tests/data/cuda/gpt2-oom.pickle.gz",
         "warning: T010 device 0: event counts differ 43.1x (9,922 -> 230 events, 3 -> 1 steps): the runs may "
         "not record the same work"),
    Code("T011", "rank-in-one-job", WARNING,
         "{ranks} only in {side}, not compared",
         "Comparing two jobs, ranks that only one of them has.",
         "Those ranks compare with nothing, so the verdict says nothing about them.",
         "Record every rank in both jobs; a gate fails on a rank the baseline has and the run lacks (G005).",
         "hand-built in tests/test_ranks.py",
         "warning: T011 rank 2 only in base, not compared"),
    Code("T012", "routes-differ", WARNING,
         "base was {base_route} and head {head_route}: the emulator reproduces the GPU's allocations, but compare "
         "like with like where you can (docs/emulate.md)",
         "One run was written by memdiff's emulator (`memdiff record --emulate GPU`, on a machine without that "
         "GPU) and the other recorded on a device, or the two were emulated as different GPUs.",
         "The emulator matches the real runs it was checked against (docs/emulate.md), but what it only "
         "approximates (torch.compile, kernels at shapes no real trace showed) then reads as a change. "
         "`memdiff gate` refuses such a pair unless given --mixed-routes.",
         "Gate an emulated run against a baseline made from an emulated run, and a recorded one against a "
         "recorded baseline.",
         "hand-built in tests/test_emulate_gpt2.py (the real gpt2-base against its emulated run)",
         "warning: T012 base was recorded and head emulated NVIDIA H100 80GB HBM3: the emulator reproduces the "
         "GPU's allocations, but compare like with like where you can (docs/emulate.md)"),
    Code("T013", "emulated-run", INFO,
         "emulated {gpu} by memdiff (memdiff record --emulate), not recorded on that GPU",
         "The snapshot was written by memdiff's emulator: the script ran on a CPU with its `cuda` tensors as "
         "shapes without data, and the allocations are the ones that GPU's kernels and caching allocator make.",
         "The figures are a model of the GPU, exact on the real runs docs/emulate.md lists; values read back "
         "from the device (a loss) were not computed.",
         "Nothing, when emulated runs are compared with emulated baselines; see docs/emulate.md for what the "
         "emulator covers.",
         "hand-built in tests/test_emulate_allocator.py (a snapshot marked as emulated)",
         "note: T013 emulated NVIDIA H100 80GB HBM3 by memdiff (memdiff record --emulate), not recorded on that "
         "GPU"),
    Code("T014", "emulation-approximation", WARNING,
         "{role}emulation: {note}",
         "The emulator wrote a note into the snapshot where the run did something a GPU's run does differently, "
         "or that memdiff could only approximate: a save that holds emulated tensors (written without their "
         "data), the run's writes kept in its overlay, a trace whose ring buffer dropped events, a kernel "
         "whose workspace is estimated.",
         "Each note says what it changes: most change no figure (files), some say where a figure is a model's "
         "(an estimate) or where the trace lacks events.",
         "Read the note: each names its remedy (`--max-entries` for a ring, `--keep-writes DIR` to see the "
         "run's files).",
         "hand-built in tests/test_emulate_scripts.py (six AdamW steps recorded with max_entries=40)",
         "warning: T014 emulation: GPU 0's trace keeps its last 40 events: its ring buffer (max_entries 40) "
         "dropped the first 117 of 157; a max_entries of 157 or more keeps them all (`memdiff record "
         "--max-entries 157`)"),
    Code("T015", "no-trace", WARNING,
         "the snapshot has no trace (memory history was off): its peak is what was live when it was dumped, "
         "not the run's highest, and the steps, phases and allocations freed before the dump are unknown",
         "The snapshot holds the allocator's segments but no trace events on this device: "
         "`torch.cuda.memory._dump_snapshot` was called without `_record_memory_history` on, or the snapshot "
         "predates the trace (a list of segments).",
         "The figure called the peak is the memory at the dump: a training step's activations and temporaries, "
         "freed by then, are not in it, so a gate on it misses what a real peak holds; a traced run cannot be "
         "gated against it.",
         "Turn memory history on before the run, `torch.cuda.memory._record_memory_history()`, or record with "
         "`memdiff record -o run.pickle -- python train.py`.",
         "memdiff peak ../shared/snapshots/empty-trace.pickle",
         "warning: T015 device 0: the snapshot has no trace (memory history was off): its peak is what was live "
         "when it was dumped, not the run's highest, and the steps, phases and allocations freed before the dump "
         "are unknown"),
    # --- P: phases ------------------------------------------------------------------------------
    Code("P001", "peaks-in-different-phases", WARNING,
         "the peaks are in different phases: base in {base_where}, head in {head_where}; rows compare different "
         "moments (compare like with like: {advice})",
         "The base run peaks in one phase (say the optimizer step, gradients live) and the head run in another "
         "(the forward, activations live).",
         "Rows at the two peaks compare different moments: gradients read as gone and activations as new though "
         "neither changed much. The phase table and `--at PHASE` compare like with like.",
         "Read the phase peaks, diff at one phase with `--at forward`, or gate a phase with `--phase-fail-over`.",
         "memdiff tests/data/cuda/gpt2-base.pickle.gz tests/data/cuda/gpt2-retain-graph.pickle.gz",
         "warning: P001 device 0: the peaks are in different phases: base in the backward of step 1, head in "
         "the optimizer step of step 0; rows compare different moments (compare like with like: --at "
         "optimizer)"),
    Code("P002", "phases-missing", ERROR,
         "the head runs no {missing} where the base does: its peak leaves out the memory of those phases, so it "
         "reads lower whatever the run allocates (compare runs of the same work)",
         "The base run trains (a backward, an optimizer step) and the head run does not, and its peak is lower: "
         "an inference run, or a training test whose loop stopped before its backward.",
         "Gradients, optimizer state and the backward's buffers are in the base's peak and cannot be in the "
         "head's: the peak falls whatever the head allocates, and a gate against a training baseline would pass "
         "having judged none of them. So it fails the gate by default, and the gate's hint to replace the "
         "baseline with the lower peak is not given.",
         "Compare a run with the phases of its baseline. If the run is meant to stop training, make a baseline of "
         "its own work (`memdiff baseline RUN -o BASELINE`), or pass `--ignore P002` to judge the peak alone.",
         "memdiff ../shared/snapshots/cs336-medium-ctx128-train.pickle "
         "../shared/snapshots/cs336-medium-ctx128-infer.pickle",
         "error: P002 device 0: the head runs no backward or optimizer step where the base does: its peak leaves out "
         "the memory of those phases, so it reads lower whatever the run allocates (compare runs of the same "
         "work)"),
    # --- K: kept memory -------------------------------------------------------------------------
    Code("K001", "kept-memory", INFO,
         "kept from {source} (not parameters, gradients, optimizer state or workspaces): {amount}{passes} "
         "({sites})",
         "Memory live at the peak that an earlier step allocated, or that a forward allocated and a forward of "
         "the same code followed in the step, and that is of no category meant to live across steps.",
         "Such memory is often a leak: a loss kept as a tensor with its graph, outputs appended to a list, a "
         "validation loop without `torch.no_grad()`. Some is meant (a cache, a running statistic).",
         "Look at the sites named: detach what is logged (`loss.item()`), run evaluation under "
         "`torch.no_grad()`, drop references at the end of a step.",
         "memdiff peak tests/data/cuda/gpt2-keep-weights.pickle.gz",
         "note: K001 device 0: kept from earlier steps (not parameters, gradients, optimizer state or "
         "workspaces): 949.40 MiB live at the peak (other: train.py:one_step <- clone 949.40 MiB)"),
    Code("K002", "kept-memory-grew", WARNING,
         "kept from {source} (not parameters, gradients, optimizer state or workspaces): {amount}{passes} "
         "({sites})",
         "The head run keeps more memory from earlier steps or forwards (K001) at the compared moment than the "
         "base run.",
         "Memory kept across steps is the usual shape of a leak; when it grows, the change added to it.",
         "Look at the sites named, as for K001; K004 fails the gate when the kept memory grows step over step.",
         "memdiff tests/data/cuda/gpt2-base.pickle.gz tests/data/cuda/gpt2-keep-weights.pickle.gz",
         "warning: K002 device 0: kept from earlier steps (not parameters, gradients, optimizer state or "
         "workspaces): 0 B -> 949.40 MiB (other: train.py:one_step <- clone +949.40 MiB)"),
    Code("K003", "kept-graphs-new", ERROR,
         "the head run keeps {kept} from earlier forwards of the same code ({forwards}) that the base run does not "
         "keep: a graph or outputs held from one forward to the next",
         "In the head run, memory allocated by a forward is still live when a forward of the same code runs "
         "again in the step (an evaluation loop with autograd on, outputs collected with their graphs), and in "
         "the base run none is.",
         "Each such forward keeps its whole graph: memory grows with the number of forwards until the run runs "
         "out of it, whatever the peak of a short test run says.",
         "Run evaluation under `torch.no_grad()` or `torch.inference_mode()`, keep `.item()` or `.detach()` of "
         "what is collected.",
         "memdiff ../shared/snapshots/cs336-medium-ctx128-infer.pickle ../shared/snapshots/linear-grad.pickle",
         "error: K003 device 0: the head run keeps 1.15 GiB from earlier forwards of the same code (1 earlier "
         "forward) that the base run does not keep: a graph or outputs held from one forward to the next"),
    Code("K004", "kept-grows-per-step", ERROR,
         "memory kept from earlier steps grows step over step: the steps after the first peak at {steps}; {kept} "
         "live at the peak was allocated by earlier steps{unknown}",
         "Each step after the first peaks higher than the one before, and memory allocated by earlier steps is "
         "live at the peak: the run keeps something of every step. Comparing two runs, it is said of the head run "
         "when the base run's steps do not grow so and the head keeps more memory from earlier steps than the "
         "base. A baseline keeps its run's step peaks for this; of one made before it did, whether its run grew "
         "is unknown, and the sentence says so.",
         "A leak that grows by a step's worth each step: the run fails some steps later, however small the "
         "growth of a three-step test run.",
         "Find what each step keeps (K001's sites): a loss logged as a tensor, tensors appended to a list, a "
         "hook storing outputs.",
         "memdiff peak tests/data/cuda/gpt2-log-tensor.pickle.gz",
         "error: K004 device 0: memory kept from earlier steps grows step over step: the steps after the "
         "first peak at 7.31 GiB, 9.85 GiB; 2.54 GiB live at the peak was allocated by earlier steps"),

    # --- C: categories --------------------------------------------------------------------------
    Code("C001", "category-guessed", INFO,
         "{amount} live before the trace has a category memdiff guessed, not read from the stack it was allocated "
         "with: {categories}",
         "Memory older than the trace has no allocation in it, so no stack of its own: memdiff infers its category "
         "from what the trace shows (docs/categories.md), and says how for each: by its lifetime (never freed, "
         "nothing else known: weights), by its size (optimizer state where the sizes repeat the gradients'; a BLAS "
         "workspace for each handle the trace runs products on without making its workspace), by the stack that "
         "freed it (CUDA captures: the free the trace saw), by the stack that updated it in place (CPU captures: "
         "an optimizer's or a backward's in-place update), or by the order of its in-place updates (CPU captures: "
         "the weight a step updates last, a buffer). `by_inference` in its data gives the bytes of each.",
         "The category table and category limits count them by the inference; a wrong one moves bytes between "
         "categories.",
         "Start recording before the model and optimizer are built to have their stacks, or give rules of your "
         "own (`--rules`); docs/categories.md says how each inference is made.",
         "memdiff peak tests/data/cuda/gpt2-warm.pickle.gz",
         "note: C001 device 0: 1.45 GiB live before the trace has a category memdiff guessed, not read from the "
         "stack it was allocated with: optimizer_state (949.40 MiB, by its size), parameter (474.70 MiB, by its "
         "lifetime), workspace (65.00 MiB, by its size)"),

    # --- A: the allocator ------------------------------------------------------------------------
    Code("A001", "reserved-moved-alone", INFO,
         "reserved moved while the allocated peak {allocated}: the tensors need the same memory, and the allocator "
         "caches {direction} blocks no tensor holds (its pool's history: the order of allocations and frees, "
         "block sizes, streams). {gated}",
         "The caching allocator's reserved peak moved by more than the allocated peak did.",
         "The tensors need the same memory; the allocator holds more or fewer cached blocks. An OOM depends on "
         "reserved memory, so the change can matter on a full GPU.",
         "Gate reserved memory with `--reserved-fail-over` when it matters; `expandable_segments:True` often "
         "lowers fragmentation.",
         "hand-built in tests/test_noise.py",
         "note: A001 device 0: reserved moved while the allocated peak is unchanged: the tensors need the same "
         "memory, and the allocator caches more blocks no tensor holds (its pool's history: the order of "
         "allocations and frees, block sizes, streams). The gate judges allocated memory; --reserved-fail-over "
         "gates reserved memory too."),
    Code("A002", "out-of-memory", ERROR,
         "OOM at event {event:,}: asked for {requested} with {free} free on the device",
         "The trace records an `oom` entry: the allocator could not satisfy a request.",
         "The run failed (or recovered by catching it); its peak is the memory held when it gave up, not what "
         "the work needs.",
         "Lower the batch or sequence, checkpoint activations, or see what `memdiff whatif` says lowers the peak.",
         "memdiff peak tests/data/cuda/gpt2-oom.pickle.gz",
         "error: A002 device 0: OOM at event 229: asked for 768.00 MiB with 666.19 MiB free on the "
         "device"),

    # --- W: what-if and forecast -------------------------------------------------------------------
    Code("W001", "whatif-not-run", INFO,
         "what-if not run: {why}",
         "`--whatif` on a regression could not replay the head run: a job, a summary or baseline instead of a "
         "snapshot, or a device the snapshot records nothing on.",
         "The report has no changes that buy the regression back; the verdict stands as judged.",
         "Give the gate or the diff the head's snapshot itself, one run at a time, or run `memdiff whatif` on it.",
         "hand-built in tests/test_buy_back.py",
         "note: W001 what-if not run: it replays one run, and this is a job"),
    Code("W002", "nothing-to-buy-back", INFO,
         "{why}: no change to buy back",
         "`--whatif` was asked on a regression, and no device's peak grew past its rule (another check failed).",
         "There is no peak to bring back, so no change is predicted.",
         "Read the failing check: a phase, a category, a site or a finding failed, not the peak.",
         "hand-built in tests/test_buy_back.py",
         "note: W002 no device's peak broke the rule: no change to buy back"),
    Code("W003", "no-change-lowers", WARNING,
         "no change memdiff whatif knows lowers this run's peak",
         "Of the changes `memdiff whatif` knows (checkpointing, lower-precision weights, autocast, another "
         "optimizer, zero_grad mode, accumulation), none lowers the regressed run's peak.",
         "The regression is not one of the usual memory savings away: the growth itself needs undoing.",
         "Read the rows that grew; `memdiff whatif --change` says what each change would do.",
         "hand-built in tests/test_buy_back.py",
         "warning: W003 device 0: no change memdiff whatif knows lowers this run's peak"),
    Code("W004", "no-change-enough", WARNING,
         "no single change brings the peak back to {base_name}'s {base_peak}; the one that saves most is shown",
         "Each change `memdiff whatif` knows was replayed on the regressed run, and none brings its peak within "
         "the rule; the one that saves most is listed.",
         "Buying the regression back takes more than one change, or undoing part of the growth.",
         "Combine changes (`memdiff whatif --change checkpoint+weights=bf16`), or undo the growth.",
         "hand-built in tests/test_buy_back.py",
         "warning: W004 device 0: no single change brings the peak back to base's 12.89 KiB; the one that saves "
         "most is shown"),
    Code("W005", "bought-back-by-replay", INFO,
         "predicted by replaying the head's trace with each change (memdiff whatif; docs/whatif.md)",
         "The changes listed under a regression were predicted by replaying the head run's own trace with each "
         "change's rules.",
         "They are predictions, with the accuracy docs/whatif.md measures on captured pairs, not measurements.",
         "Make the change and record the run again to measure it.",
         "hand-built in tests/test_buy_back.py",
         "note: W005 predicted by replaying the head's trace with each change (memdiff whatif; docs/whatif.md)"),
    Code("W006", "whatif-replayed", INFO,
         "a what-if replays the run's own trace with each change's rules; each change lists what it assumed",
         "`memdiff whatif`'s figures come from replaying the run's trace with each change's rules.",
         "Each prediction rests on the assumptions its change lists; docs/whatif.md gives the accuracy measured "
         "on captured pairs.",
         "Read each change's assumptions; record the run with the change made to measure it.",
         "memdiff whatif tests/data/cuda/gpt2-base.pickle.gz",
         "note: W006 a what-if replays the run's own trace with each change's rules; each change lists what it "
         "assumed"),
    Code("W014", "change-does-not-apply", INFO,
         "{change}: does not apply: {why}",
         "A change asked of `memdiff whatif` (or tried for `--whatif`) cannot be made to this run: checkpointing "
         "without repeated blocks, zero_grad(set_to_none) in a run that already frees its gradients, an "
         "optimizer the run does not use.",
         "The change has no prediction: the run already has it, or has nothing it changes.",
         "Read the reason; ask for another change.",
         "memdiff whatif tests/data/cuda/gpt2-generate.pickle.gz --change zero-grad=none",
         "note: W014 device 0: zero-grad=none: does not apply: the run shows no gradients (category gradient)"),
    Code("W016", "whatif-on-a-guessed-category", WARNING,
         "{change}: its figure rests on a guess: {amount} it changes has a category memdiff guessed, not read from "
         "the stack it was allocated with: {categories} (C001)",
         "A change of `memdiff whatif` (or of `--whatif`'s buy-back) edits memory older than the trace, whose "
         "category memdiff inferred (C001 says how: by its lifetime, by its size, by the stack that freed it, by "
         "the stack that updated it in place, by the order of its in-place updates; a snapshot with no trace "
         "holds only such memory). The change is "
         "computed from that category (halved as weights, dropped as optimizer state) with no stack of the "
         "allocation's own to confirm it. The amount is the most of such memory the change edits held at once "
         "(a tensor's in-place versions on CPU captures count once); `guessed_by` in its data gives each "
         "category's.",
         "Were the inference wrong (activations a data loader left, a cache read as weights, state a custom "
         "optimizer frees read as state when it was a copy), the change's figure is wrong by as much.",
         "Record with the trace on from before the model is built (`torch.cuda.memory._record_memory_history()` "
         "first), so every block has its stack; or give rules of your own (`--rules`).",
         "memdiff whatif ../shared/snapshots/empty-trace.pickle --change weights=bf16",
         "warning: W016 device 0: weights=bf16: its figure rests on a guess: 8.13 MiB it changes has a category "
         "memdiff guessed, not read from the stack it was allocated with: parameter (8.13 MiB, by its lifetime) "
         "(C001)"),
    Code("W017", "whatif-of-a-run-out-of-memory", WARNING,
         "the run ran out of memory at event {event:,} ({phase}): each change replays only the trace before it, "
         "so each predicted peak is a lower bound, and what the run never reached cannot apply",
         "`memdiff whatif` was given a run that stopped at an out-of-memory error (A002), the run A002 tells you "
         "to ask what lowers its peak. Its trace ends there: the rest of the step (the forward's later layers, "
         "the backward, the optimizer step) was never run, so no change can replay it.",
         "A change's predicted peak is the peak of the part that ran, not of the whole step the change would "
         "let it run: the real peak is that or higher, and a change of a phase the run never reached (the "
         "optimizer, gradients) reads as not applying. A budget is only failed by it, never met: such a row's "
         "`fits` is unknown unless its lower bound is already over the budget.",
         "Record a run that completes a step (a smaller batch or sequence) and ask it, or re-run the script "
         "with each change made (`memdiff whatif --emulate GPU -o DIR/ -- python train.py`).",
         "memdiff whatif tests/data/cuda/gpt2-oom.pickle.gz --change checkpoint",
         "warning: W017 device 0: the run ran out of memory at event 229 (the forward of step 0): each change "
         "replays only the trace before it, so each predicted peak is a lower bound, and what the run never "
         "reached cannot apply"),
    Code("W007", "runs-record-other-allocations", INFO,
         "{runs} record{s} other allocations than the largest run: left out of the fit, and predicted from the "
         "{fitted} runs that line up one for one, as a check",
         "Forecasting from runs at several knob values, some runs allocate differently from the largest one (a "
         "kernel chosen by size, a warm-up): they are left out of the fit and used to check it.",
         "The forecast rests on fewer runs; the error on the runs left out says how far to trust it.",
         "Record the runs the same way, or add a run that lines up with the largest.",
         "hand-built in docs/forecast.md (the scenario script's GPT-2 at batch 1, 2 and 4, on CPU)",
         "note: W007 device 0: gpt2-b1.pickle records other allocations than the largest run: left out of the fit, "
         "and predicted from the 2 runs that line up one for one, as a check"),
    Code("W008", "runs-not-aligned", INFO,
         "the runs do not record the same allocations: {aligned}{others}",
         "The forecast's runs do not allocate one for one: their allocations were lined up by stack and order.",
         "Allocations only some runs have are fitted from those runs, and those only the largest run has keep "
         "their size at every value (a fit through one run is a constant); the forecast is less exact.",
         "Record the runs with the same code path and steps.",
         "memdiff forecast tests/data/cuda/gpt2-base.pickle.gz=4 tests/data/cuda/gpt2-batch8.pickle.gz=8 --at "
         "16 --budget 80GiB",
         "note: W008 device 0: the runs do not record the same allocations: 98.8% of the largest run's "
         "allocations line up by stack in every run; the 42 others, which only the largest run records, keep their "
         "size in it at every value"),
    Code("W009", "quadratic-under-leave-one-out", INFO,
         "with three runs, leaving one out fits the other two with lines: the leave-one-out error overstates the "
         "forecast's for sizes that grow quadratically (a fourth run checks them)",
         "Three runs fit sizes that grow quadratically (attention scores with the sequence), and the "
         "leave-one-out check can only fit two.",
         "The error shown is pessimistic for those sizes.",
         "Add a fourth run to check the quadratic sizes.",
         "hand-built in tests/test_forecast.py (and docs/forecast.md's BERT at three lengths)",
         "note: W009 device 0: with three runs, leaving one out fits the other two with lines: the leave-one-out "
         "error overstates the forecast's for sizes that grow quadratically (a fourth run checks them)"),
    Code("W010", "two-runs-linear", INFO,
         "sizes are fitted from two runs: constant or linear only (a quadratic needs a third run that lines up one "
         "for one)",
         "The forecast fits each allocation's size from two runs.",
         "A size that grows quadratically is forecast as a line: far from the runs it is too small.",
         "Add a third run at another value.",
         "memdiff forecast tests/data/cuda/gpt2-base.pickle.gz=4 tests/data/cuda/gpt2-batch8.pickle.gz=8 --at "
         "16 --budget 80GiB",
         "note: W010 device 0: sizes are fitted from two runs: constant or linear only (a quadratic needs a "
         "third run that lines up one for one)"),
    Code("W015", "faster-than-linear-between-two-runs", WARNING,
         "between the two runs {sites}: a line through two sizes cannot follow that, and above the largest run "
         "it forecasts {count:,} such site{s} too low (a third run fits a quadratic){unlisted}",
         "The forecast fits sizes from two runs, so each is a line; yet some sites live at the predicted peak "
         "grew by more than the knob's ratio between them (4.0x for 2x: as the knob's power 2, as attention "
         "scores grow with the sequence). The two runs cannot tell the shape, but they show the growth. Each "
         "such site is a row of the growing-site table (up to 5 beside the 5 that grow most); the sentence "
         "counts any beyond those, and its JSON data names them all (`faster_sites`).",
         "A size is a polynomial of the knob with non-negative terms (batch x sequence x sequence): through "
         "two runs it lies above their line beyond the largest one, so the forecast there is too low for "
         "those sites, and with them the peak.",
         "Record a third run at another value: the sizes are then fitted with quadratics and checked by "
         "leaving one out.",
         "memdiff forecast ../shared/snapshots/cs336-medium-ctx128-train.pickle=128 "
         "../shared/snapshots/cs336-medium-ctx256-train.pickle=256 --at 512",
         "warning: W015 device 0: between the two runs nn_utils.py:softmax <- div_Tensor grew 4.00x for 2.00x "
         "the knob (128 to 256), as its power 2.00 (2 other sites faster than linearly too): a line through two "
         "sizes cannot follow that, and above the largest run it forecasts 3 such sites too low (a third run "
         "fits a quadratic)"),
    Code("W011", "sizes-fit-no-polynomial", WARNING,
         "{count:,} allocations ({amount} in the largest run) fit no polynomial up to quadratic; the quadratic "
         "through their three largest values stands in",
         "Some allocations' sizes follow no constant, linear or quadratic law over the runs (a cache that grows "
         "in steps, a size picked by the allocator).",
         "Their forecast is a stand-in: the further from the runs, the less it holds.",
         "Add runs near the value forecast, or read those allocations' rows.",
         "hand-built in tests/test_forecast.py",
         "warning: W011 device 0: 1 allocations (100 B in the largest run) fit no polynomial up to quadratic; the "
         "quadratic through their three largest values stands in"),
    Code("W012", "over-budget-at-one", WARNING,
         "even at 1 the predicted peak exceeds the budget of {budget}",
         "With `--budget`, the forecast's peak at the knob's smallest value is over the budget.",
         "Nothing fits: no value of the knob runs within the budget.",
         "Lower the memory at value 1 (checkpointing, bf16 weights: `memdiff whatif`), or raise the budget.",
         "memdiff forecast tests/data/cuda/gpt2-base.pickle.gz=4 tests/data/cuda/gpt2-batch8.pickle.gz=8 --at "
         "16 --budget 1GiB",
         "warning: W012 device 0: even at 1 the predicted peak exceeds the budget of 1.00 GiB"),
    Code("W013", "never-outgrows-budget", INFO,
         "the predicted peak does not outgrow the budget at any value",
         "With `--budget`, the forecast's peak stays within the budget at every value.",
         "The knob does not limit memory as forecast: nothing grows with it.",
         "Check that the runs really differ in the knob.",
         "hand-built in tests/test_forecast.py",
         "note: W013 device 0: the predicted peak does not outgrow the budget at any value"),
    # --- G: the gate ---------------------------------------------------------------------------
    Code("G001", "within-spread", INFO,
         "the peak's change ({change}) is within the spread of the baseline's {runs} runs ({span})",
         "The baseline was made from repeated runs, and this run's peak falls inside their spread.",
         "The change is as large as the workload's own noise: no regression to look for.",
         "Nothing to do.",
         "hand-built in tests/test_noise.py (a baseline of three repeats)",
         "note: G001 device 0: the peak's change (+0.5%) is within the spread of the baseline's 3 runs "
         "(-1.0% to +1.0%)"),
    Code("G007", "history-without-workload", INFO,
         "the history has no peak of {workload!r} on main yet ({holds}): `memdiff history append` on each push to "
         "main adds them",
         "`--history` was given and the history file has no line of this workload (the baseline's name).",
         "The report has no trend to show for it: the main branch's peaks are not being kept, or under another "
         "name.",
         "Run `memdiff history append RUN --to FILE --commit SHA --workload NAME` on each push to main, with the "
         "baseline's name.",
         "hand-built in tests/test_trend.py",
         "note: G007 the history has no peak of 'eval' on main yet (it holds train): `memdiff history append` on "
         "each push to main adds them"),
    Code("G002", "peak-grew", ERROR,
         "{moment} grew by {grew}; top growth: {sites}",
         "A peak limit failed: the peak grew past the rule.",
         "The run needs more memory than the baseline allowed.",
         "Read the rows named; if the growth is meant, refresh the baseline (`memdiff baseline`).",
         "memdiff tests/data/cuda/gpt2-base.pickle.gz tests/data/cuda/gpt2-batch8.pickle.gz",
         "error: G002 device 0: peak grew by 3.31 GiB; top growth: activations.py:forward <- mul_Tensor "
         "+576.00 MiB, pytorch_utils.py:forward <- addmm +504.00 MiB, LogSoftmaxBackward0 <- "
         "_log_softmax_backward_data +392.63 MiB"),
    Code("G003", "peak-went-down", INFO,
         "peak went down by {drop} ({pct}): consider updating the baseline: {command}",
         "Gated against a baseline, the peak went down.",
         "A baseline that does not follow improvements lets later growth back in unnoticed.",
         "Run the command given to refresh the baseline.",
         "memdiff baseline tests/data/cuda/gpt2-log-tensor.pickle.gz -o lt.json && memdiff gate "
         "tests/data/cuda/gpt2-base.pickle.gz --baseline lt.json",
         "note: G003 device 0: peak went down by 5.09 GiB (51.6%): consider updating the baseline: memdiff "
         "baseline tests/data/cuda/gpt2-base.pickle.gz -o lt.json"),
    Code("G004", "site-pattern-unmatched", WARNING,
         "sites /{pattern}/ matches no group of the base run, so its limit only sees groups that are new",
         "A site limit's pattern matches nothing in the base run.",
         "A misspelt or stale pattern checks 0 B against whatever is new and nothing else.",
         "Fix the pattern (a regular expression searched in the rows' sites).",
         "hand-built in tests/test_gate.py",
         "warning: G004 device 0: sites /^model\\.py:forwrad$/ matches no group of the base run, so its limit only "
         "sees groups that are new"),
    Code("G005", "rank-missing", ERROR,
         "{ranks}: in the baseline but not in the run (a rank that crashed?); --allow-missing-ranks gates the "
         "others only",
         "Gating a job, a rank the baseline has is missing from the run.",
         "A crashed rank must not pass the gate by being absent.",
         "Find why the rank wrote no snapshot, or pass `--allow-missing-ranks`.",
         "hand-built in tests/test_ranks.py",
         "error: G005 rank 3: in the baseline but not in the run (a rank that crashed?); --allow-missing-ranks "
         "gates the others only"),
    Code("G008", "no-baseline", WARNING,
         "{snapshot}: no baseline at {path}: make it with `{command}`{absent}{gated}",
         "Gating runs against a folder of baselines, a run has none of its name (its stem).",
         "Nothing was compared for that run. With --require-baseline (the Action's default) it fails the gate, "
         "exit 2; without, the others are gated and it is reported; a gate where no run had its baseline is "
         "never green. Where it fails the gate the line reads `error: G008` (and the GitHub annotation is an "
         "error); where it does not, `warning: G008`.",
         "Make the baseline with the command the line gives and commit it, or name the run after the baseline.",
         "hand-built in tests/test_gate.py",
         "warning: G008 eval.pickle: no baseline at baselines/eval.json: make it with `memdiff baseline "
         "eval.pickle -o baselines/eval.json` (not gated; --require-baseline makes this fail)"),
    Code("G009", "unreadable-baseline-replaced", WARNING,
         "{path}: {problem}: replaced by --memdiff-update",
         "`pytest --memdiff-update` found a marked test's own baseline that it cannot read (not JSON, another "
         "schema version, cut short) and wrote a new one in its place.",
         "The old file's thresholds are gone with it: the new baseline has only the marker's.",
         "Look at the file's history (`git log -p baselines/...`) if its thresholds were set by hand, and put "
         "them in the marker, where they are kept.",
         "hand-built in tests/test_pytest_plugin.py",
         "warning: G009 baselines/test_model.py-test_step.json: invalid JSON at line 1 column 10: Expecting "
         "value: replaced by --memdiff-update"),
    Code("G010", "history-not-yet", WARNING,
         "history {path} does not exist yet: no trend (`memdiff history append` on pushes to main makes it)",
         "`--history` (the Action's `history` input) names a file that is not there: the main branch has not "
         "appended a peak yet, or the path is wrong.",
         "The report has no trend of the main branch's peaks; the gate itself is unchanged.",
         "Run `memdiff history append RUN --to FILE --commit SHA` on each push to main, or fix the path.",
         "hand-built in tests/test_action.py",
         "warning: G010 history main.jsonl does not exist yet: no trend (`memdiff history append` on pushes to "
         "main makes it)"),
    Code("G011", "fit-value-dropped", ERROR,
         "fit: {gpu} {knob} {old} -> {new} ({what}, baseline {baseline})",
         "`memdiff fit` found a smaller largest value on a GPU than the fit result its baseline holds (for "
         "`{nproc}`, more processes): the emulated run at the baseline's value now runs out of memory (or passes "
         "--max-memory's share).",
         "A change that costs capacity fails here even when the peak at the batch a test runs grew little: the "
         "team loses the batch size it trains with on that GPU.",
         "Read the fit's table: the failing request and where the run peaked; `memdiff BASE HEAD` of the two runs "
         "at the old value says what grew. If the loss is meant, write the baseline again "
         "(`memdiff fit ... --format json -o runs/ > baselines/fit.json`, or `memdiff baseline RUN --fit FIT.json`"
         " where the gate reads it).",
         "hand-built in tests/test_fit.py",
         "error: G011 fit: l4 batch 48 -> 40 (the largest value whose emulated run trains, baseline "
         "baselines/fit.json)"),
    Code("G012", "noise-margin-gates-nothing", WARNING,
         "the noise margin ({margin}) gates nothing: {why}",
         "A noise margin was set (`--noise-margin`, or stored in the baseline) where no peak is judged by it: it "
         "widens the spread of a baseline made from repeated runs whose peaks differ, and this device's baseline "
         "has none (one run, or repeats with one peak), or the peak has a limit of its own, or `--at` compares a "
         "phase's peak.",
         "The gate judged the peak by another rule than the one the margin was meant to loosen or tighten: a "
         "margin set and silently unused reads as a gate tuned to noise that is not.",
         "Make the baseline from repeated runs (`memdiff baseline RUN1 RUN2 RUN3`), or drop the margin.",
         "memdiff baseline tests/data/cuda/gpt2-base.pickle.gz -o b.json && memdiff gate "
         "tests/data/cuda/gpt2-base-again.pickle.gz --baseline b.json --noise-margin 5%",
         "warning: G012 device 0: the noise margin (5%) gates nothing: it widens the spread of a baseline made "
         "from repeated runs whose peaks differ, and this baseline has none on device 0 (make one with `memdiff "
         "baseline RUN1 RUN2 RUN3`), so the peak is judged by the rule above"),
    Code("G013", "baseline-edited-by-hand", WARNING,
         "{baseline}: its measured figures were edited by hand (they no longer match figures_sha256, the digest "
         "memdiff wrote beside them), so the gate judged against figures no run measured",
         "`memdiff baseline` (and the pytest plugin's `--memdiff-update`) writes the digest of what it measured, "
         "the source, devices or ranks and fit values, beside them; a figure changed since (a peak raised, a "
         "group removed, a merge conflict resolved by hand) no longer matches it. The name, the dates and the "
         "thresholds are a team's to set by hand and are not in the digest.",
         "A baseline's figures are the limit every run is held to: one raised by hand in a pull request lets "
         "the regression it was raised for pass, with a green check; a reviewer reads JSON, this reads the "
         "digest.",
         "Remake the baseline from a run (`memdiff baseline RUN -o FILE`, `pytest --memdiff-update`); to loosen "
         "the gate, change its thresholds (`--fail-over-pct`), which the digest leaves out.",
         "hand-built in tests/test_gate.py",
         "warning: G013 baseline train (train.pickle): its measured figures were edited by hand (they no longer "
         "match figures_sha256, the digest memdiff wrote beside them), so the gate judged against figures no run "
         "measured"),
    Code("G006", "rank-without-baseline", ERROR,
         "{ranks}: no baseline (--require-baseline)",
         "Gating a job with `--require-baseline`, a rank of the run has no baseline.",
         "An ungated rank could regress unseen.",
         "Make the job's baseline again with every rank (`memdiff baseline JOB`).",
         "hand-built in tests/test_ranks.py",
         "error: G006 rank 2: no baseline (--require-baseline)"),
)

BY_CODE: Dict[str, Code] = {c.code: c for c in CATALOGUE}

# The findings that fail a gate unless told otherwise: each says the run will fail or is failing,
# whatever its peak did in a short test run, or (P002) that the head's lower peak leaves out the
# phases its baseline was judged on, so a pass would judge nothing of them.
DEFAULT_FAIL_ON = ("K003", "K004", "A002", "P002")


def finding(code: str, device: Optional[int] = None, run: Optional[str] = None, **data: Any) -> Finding:
    """The catalogue's finding `code` about `device` (and `run`, of a pair), its sentence made from `data`."""
    c = BY_CODE[code]
    return Finding(code=c.code, name=c.name, severity=c.severity, device=device, message=c.template.format(**data),
                   data=data, run=run)


SEVERITY_ORDER = (ERROR, WARNING, INFO)


def in_order(findings: Iterable[Finding]) -> List[Finding]:
    """The one order every output shows a report's findings in: errors, then warnings, then notes;
    within a severity by code, then rank and device (what is about the whole comparison first);
    findings alike in all of these keep the order they were found in (one OOM after another)."""
    return sorted(findings, key=lambda f: (SEVERITY_ORDER.index(f.severity), f.code,
                                           -1 if f.rank is None else f.rank, -1 if f.device is None else f.device))


def shown(f: Finding) -> str:
    """A finding as every text surface shows it: `warning: P001 device 0: the peaks ...`."""
    return f"{SEVERITY_WORDS[f.severity]}: {f.code} {f.text}"


def parse_codes(where: str, codes: Sequence[str]) -> List[str]:
    """Codes as users write them (`k004`, `K004`), upper-cased, each checked against the catalogue;
    InputError naming the unknown one. A family letter alone (`K`) stands for all its codes."""
    out: List[str] = []
    for raw in codes:
        code = raw.strip().upper()
        if code in FAMILIES:
            out += [c.code for c in CATALOGUE if c.code.startswith(code) and c.code not in out]
        elif code in BY_CODE:
            if code not in out:
                out.append(code)
        else:
            raise InputError(where, f"{clip(raw)!r} is no finding code (`memdiff rule --all` lists them)")
    return out


# Where the public snapshots kept beside the project live (tests read them there); the repository does not ship them.
OUTSIDE = "../shared/snapshots/"


def _example_lines(c: Code) -> List[str]:
    """The example as the page shows it: a command a clone runs, or a comment saying where it was seen."""
    if c.example_command.startswith("hand-built"):
        return [f"# {c.example_command}", c.example_output]
    if OUTSIDE in c.example_command:
        # No capture the repository ships shows this finding: name the public run's snapshot without a
        # path that a clone would lack, so that nothing reads as a command to run.
        seen = c.example_command.replace(OUTSIDE, "")
        return [f"# seen by `{seen}`, on snapshots of public runs that the repository does not ship "
                "(no capture in tests/data shows it)", c.example_output]
    return [f"$ {c.example_command}", "...", c.example_output, "..."]


def rule_section(c: Code) -> str:
    """The documentation of one code in its fixed shape, as docs/findings.md and `memdiff rule CODE` show it."""
    return "\n".join([
        f"## {c.code} {c.name}", "",
        f"Severity: {c.severity}.{' Fails the gate by default.' if c.code in DEFAULT_FAIL_ON else ''}", "",
        f"Message: `{c.template}`", "",
        "### What it means", "", c.means, "",
        "### Why it matters", "", c.why, "",
        "### Example", "", "```text", *_example_lines(c), "```", "",
        "### What to do", "", c.fix, ""])


def rules_list() -> str:
    """One line per code: `P001  warning  peaks-in-different-phases` (`memdiff rule --all`)."""
    return "\n".join(f"{c.code}  {c.severity:<7}  {c.name}{'  (fails by default)' if c.code in DEFAULT_FAIL_ON else ''}"
                     for c in CATALOGUE) + "\n"


def docs_page() -> str:
    """docs/findings.md: how codes work, the default set, then one section per code (`python docs/gen_findings.py`)."""
    head = [
        "# Findings", "",
        "<!-- Generated from memdiff/compare/findings.py by `python docs/gen_findings.py`; "
        "do not edit by hand. -->", "",
        "Everything memdiff says beyond the numbers is a finding with a stable code: a family letter and a "
        "number. The JSON documents carry them as `findings` (`code`, `name`, `severity`, `device`, `run`, "
        "`message`, `data`); the text, markdown and HTML reports and the GitHub annotations show the code beside "
        "the message, all in one order: errors, then warnings, then notes, each by code, then rank and "
        "device; `memdiff rule CODE` prints a code's section below and `memdiff rule --all` lists them.", "",
        "| family | about |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in FAMILIES.items()), "",
        "## Gating on findings", "",
        "A finding of a code the gate fails on fails the gate (exit 1) whatever the peak did; an ignored code is "
        "not shown and fails nothing. By default these codes fail: "
        + ", ".join(f"[{c}](#{BY_CODE[c].anchor})" for c in DEFAULT_FAIL_ON)
        + ". `memdiff gate` and `memdiff BASE HEAD` choose others with `--fail-on CODE ...` and "
        "`--ignore CODE ...` (a family letter stands for its codes: `--ignore T`; codes repeat the flag or "
        "make a comma list: `--ignore K002 --ignore T003,T004`); a baseline's thresholds "
        "(`memdiff baseline --fail-on ...` stores them) and a rules file (`--rules`) keep the same as "
        "`\"findings\": {\"fail-on\": [\"K002\"], \"ignore\": [\"T003\"]}`; the Action takes the inputs "
        "`fail-on` and `ignore`, the pytest marker `fail_on=[...]` and `ignore=[...]`. The choices apply in that "
        "order, the last choice of a code winning: the default, the baseline's, each rules file's, the flags'. "
        "Given together, a code (or family) named in both fail-on and ignore is an error (exit 2), and a code "
        "named alone wins over its family in the other (`--fail-on K --ignore K004`: every K code but K004 "
        "fails). The rule in force is printed with every "
        "verdict and recorded in the JSON as `finding_rules` (`code`, `action`, `source`); a finding that failed "
        "is a `finding_checks` entry and a `FAIL` line.", "",
        "| code | name | severity |", "| --- | --- | --- |",
        *(f"| [{c.code}](#{c.anchor}) | {c.name} | {c.severity} |" for c in CATALOGUE), ""]
    return "\n".join(head + [rule_section(c) for c in CATALOGUE])
