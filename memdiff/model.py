"""Plain data types that cross the stages: load -> normalize -> classify -> diff -> gate -> render.

The Summary is the contract: `memdiff summarize` writes it, baselines store it and the differ
reads it. Its JSON form is described by `schemas/summary.schema.json`; bump SCHEMA_VERSION
whenever a field changes meaning or disappears.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

SCHEMA_VERSION = 2
# Summaries of these versions can still be read (fields added since then take their defaults).
READABLE_SCHEMA_VERSIONS = (1, 2)


@dataclass
class Table:
    """A table as every output shows it: headers, cells, and which columns read left-aligned; the report
    stage fills it (a diff's, a forecast's, a what-if's, a fit's), the renderers lay it out."""

    headers: List[str]
    rows: List[List[str]]
    left: List[int] = field(default_factory=lambda: [0])


@dataclass(frozen=True)
class Frame:
    """One display frame: normalized file (library-relative or project-relative), line, function."""

    file: str
    line: int
    name: str


@dataclass
class Group:
    """Bytes live at the peak that share one stack signature."""

    signature: str
    site: str
    frames: List[Frame]
    count: int
    bytes: int
    category: Optional[str] = None
    # born / freed / outlives (see lifetimes.py); None in summaries written before lifetimes
    lifetime: Optional[Dict[str, str]] = None
    # Kept memory: allocated in a step before the moment's, or by a forward that a forward of the
    # same code followed in the moment's step (a validation loop keeping each batch's graph).
    bytes_from_earlier_steps: int = 0
    bytes_from_earlier_forwards: int = 0  # of those, the ones kept from earlier forwards
    earlier_forwards: int = 0  # how many earlier forwards they come from


@dataclass
class OomEvent:
    """An `oom` trace entry: the allocator could not satisfy a request."""

    event_index: int
    requested_bytes: int
    device_free_bytes: Optional[int]
    time_us: Optional[int]


@dataclass
class PhaseSpan:
    """One phase run of a step (consecutive events of one phase) and the highest memory inside it."""

    phase: str
    start_event: int
    end_event: int
    peak_bytes: int = 0
    peak_event_index: int = 0


@dataclass
class Step:
    """One training (or inference) step: its events and its phase runs, in order."""

    step: int
    start_event: int
    end_event: int
    phases: List[PhaseSpan]


@dataclass
class PhasePeak:
    """The highest memory of one phase over all steps, and what was live then.

    `groups` is None when this moment is the device's peak (its groups are the device's)."""

    phase: str
    step: Optional[int]
    peak_bytes: int
    peak_event_index: int
    groups: Optional[List[Group]] = None
    categories: Dict[str, int] = field(default_factory=dict)


@dataclass
class Bar:
    """One allocation live at the peak, from its allocation to its free (the report's bars)."""

    signature: str  # its group's
    start_event: int  # its first version's allocation; -1 when live before the trace
    end_event: int  # the event that frees it; the trace length when never freed
    bytes: int


@dataclass
class History:
    """A device's memory over its trace, downsampled for drawing: each point is the event with
    the largest total in its window, with the bytes of each category live after it."""

    events: List[int]
    totals: List[int]
    categories: Dict[str, List[int]]  # largest at the device's peak first
    time_us: Optional[List[int]] = None  # None when the trace has no times
    bars: List[Bar] = field(default_factory=list)


@dataclass
class Moment:
    """One moment of a device's trace (its peak, or a phase's): the bytes then and what held them."""

    peak_bytes: int
    groups: List[Group]
    categories: Dict[str, int]


@dataclass
class DeviceSummary:
    """Peak accounting for one device, following the rules in snapshot-format.md."""

    device: int
    trace_events: int
    static_bytes: int
    peak_bytes: int
    peak_event_index: Optional[int]
    peak_time_us: Optional[int]
    peak_event_signature: Optional[str]
    trace_start_time_us: Optional[int]
    trace_end_time_us: Optional[int]
    allocated_bytes_at_dump: int
    reserved_bytes_at_dump: Optional[int]  # None: no caching allocator (the profiler route)
    unmatched_free_count: int
    unmatched_free_bytes: int
    oom_events: List[OomEvent]
    timeline: List[List[int]]
    groups: List[Group]
    categories: Dict[str, int] = field(default_factory=dict)
    phase_at_peak: Optional[str] = None
    scope_at_peak: Optional[str] = None
    bytes_by_scope: Dict[str, int] = field(default_factory=dict)
    bytes_by_compile_context: Dict[str, int] = field(default_factory=dict)
    # Live at the peak by the user's own labels: an allocation's `user_metadata` and the
    # `annotate` entries attached to it since (torch's _set_memory_metadata, _annotate_tensor).
    bytes_by_label: Dict[str, int] = field(default_factory=dict)
    steps: List[Step] = field(default_factory=list)
    step_at_peak: Optional[int] = None
    phase_peaks: List[PhasePeak] = field(default_factory=list)
    history: Optional[History] = None  # only when asked for (the HTML report): it reads every allocation
    # The caching allocator's segments over the trace (None: none recorded, or the profiler route's
    # fake segment): the highest reserved total, and reserved minus allocated at the peak.
    reserved_peak_bytes: Optional[int] = None
    fragmentation_bytes: Optional[int] = None
    # A baseline keeps how many steps its run recorded, not the steps: that count, so that a gate
    # compares step counts as a diff of the two runs does (T010). None for a run (its steps are
    # `steps`) and for a baseline made before baselines kept it.
    step_count: Optional[int] = None
    # A baseline's too: the peaks of its run's steps after the first (compare.observe.step_peaks), so that
    # a gate tells a baseline whose memory grew step over step too (K004) as a diff does. None for a run.
    step_peaks: Optional[List[int]] = None
    # A baseline's too: whether its run's backward stacks name autograd nodes (compare.observe.names_nodes),
    # as its groups are stored without frames, so that a gate warns of runs recorded otherwise (T009) as a
    # diff does. None for a run, for a baseline whose stacks show no backward and one made before it was kept.
    autograd_nodes: Optional[bool] = None

    def steps_recorded(self, baseline: bool) -> Optional[int]:
        """How many steps the run recorded: a run's `steps`, a baseline's stored count (`baseline`);
        None when a baseline does not say."""
        return self.step_count if baseline else len(self.steps)

    def at(self, phase: Optional[str]) -> Optional["Moment"]:
        """What was live at the peak of `phase` (None or "peak": the device's peak); None when
        the trace has no such phase."""
        if phase in (None, "peak"):
            return Moment(self.peak_bytes, self.groups, self.categories)
        for p in self.phase_peaks:
            if p.phase == phase:
                if p.groups is None:
                    return Moment(self.peak_bytes, self.groups, self.categories)
                return Moment(p.peak_bytes, p.groups, p.categories)
        return None

    @classmethod
    def blank(cls, device: int, **values: Any) -> "DeviceSummary":
        """A device with nothing recorded (zeros, no events), `values` filled in: a side of a
        comparison that lacks the device, or a baseline that stores only some figures."""
        empty: Dict[str, Any] = dict(
            trace_events=0, static_bytes=0, peak_bytes=0, peak_event_index=None, peak_time_us=None,
            peak_event_signature=None, trace_start_time_us=None, trace_end_time_us=None,
            allocated_bytes_at_dump=0, reserved_bytes_at_dump=0, unmatched_free_count=0,
            unmatched_free_bytes=0, oom_events=[], timeline=[], groups=[])
        return cls(device=device, **{**empty, **values})


@dataclass
class Finding:
    """One thing memdiff observed beyond the numbers, under a stable code of the catalogue
    (findings.py): its code, short name and severity, the device and run it is about (None:
    the whole comparison), the sentence, and the figures the sentence was made from."""

    code: str
    name: str
    severity: str  # "error", "warning" or "info"
    device: Optional[int]
    message: str
    data: Dict[str, Any] = field(default_factory=dict)
    run: Optional[str] = None  # "base" or "head" when it is about one run of a pair
    rank: Optional[int] = None  # the rank of a job it is about

    @property
    def text(self) -> str:
        """The sentence with what it is about before it: `rank 1 head: device 0: ...`, as the checks
        name a rank (`rank 1 device 0 peak`)."""
        about = [self.run or "", f"device {self.device}" if self.device is not None else ""]
        said = ": ".join([a for a in about if a] + [self.message])
        return f"rank {self.rank} {said}" if self.rank is not None else said

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (`findings` items of the diff, gate and ranks documents)."""
        out = {"code": self.code, "name": self.name, "severity": self.severity, "device": self.device,
               "message": self.message, "data": self.data, "run": self.run}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True)
class Range:
    """A figure over repeated runs of one workload: lowest, highest and median bytes."""

    min: int
    max: int
    median: int


@dataclass
class Spread:
    """One device's figures over repeated runs of one workload (a baseline made from repeats):
    the peak's, each phase's peak's and each category's at the peak."""

    runs: int
    peak: Range
    phases: Dict[str, Range] = field(default_factory=dict)
    categories: Dict[str, Range] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form stored in baselines."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Spread":
        """From its JSON form (schema-checked)."""
        def rng(r: Dict[str, Any]) -> Range:
            return Range(r["min"], r["max"], r["median"])
        return cls(data["runs"], rng(data["peak"]), {k: rng(v) for k, v in data.get("phases", {}).items()},
                   {k: rng(v) for k, v in data.get("categories", {}).items()})


@dataclass
class TrendDevice:
    """One device of a main-branch run as a history keeps it: the peak and what held it."""

    device: int
    peak_bytes: int
    categories: Dict[str, int] = field(default_factory=dict)  # bytes at the peak
    reserved_peak_bytes: Optional[int] = None


@dataclass
class TrendEntry:
    """One line of a history file (`memdiff history append`): a workload's run at one commit."""

    commit: str
    date: str  # UTC, ISO 8601
    workload: str
    devices: List[TrendDevice]
    tool: str = ""
    schema_version: int = 1

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form of one line, keys in a stable order."""
        data = asdict(self)
        for d in data["devices"]:
            if d["reserved_peak_bytes"] is None:
                del d["reserved_peak_bytes"]
        return {"schema_version": data.pop("schema_version"), "tool": data.pop("tool"), **data}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrendEntry":
        """From one line's JSON form (schema-checked)."""
        return cls(commit=data["commit"], date=data["date"], workload=data["workload"],
                   devices=[TrendDevice(**_known(TrendDevice, d)) for d in data["devices"]],
                   tool=data.get("tool", ""), schema_version=data["schema_version"])


def largest_first(totals: Dict[str, int]) -> Dict[str, int]:
    """Bytes by name, largest first (ties by name), the order summaries keep."""
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


# The top-level key `memdiff slice` (and --steps/--events/--time-us) adds to a window of a snapshot:
# {"window": "--steps 3:4", "of": "big.pickle"}. PyTorch's viewer ignores keys it does not know.
WINDOW_KEY = "memdiff_window"
# The key a window adds to its trace entries and carried blocks: what the full trace makes of that
# memory ({"frames", "freed", "before_trace", "guess", "update", "lifetime"}), so that memory carried
# into a window keeps the stack, lifetime and so category it has in the full trace.
KIND_KEY = "memdiff_kind"


@dataclass
class Source:
    """Where a summary came from, so that two runs can be checked for comparability."""

    file: str
    sha256: str
    size_bytes: int
    container: str
    generation: str
    keys: List[str]
    allocator_settings: Optional[Dict[str, Any]] = None
    # The GPU memdiff's emulator ran the script as (`memdiff record --emulate`), and what it could
    # only approximate; None for a snapshot a real device recorded.
    emulated: Optional[Dict[str, Any]] = None
    # A baseline's figures no longer match the digest memdiff wrote beside them: edited by hand (G013).
    edited: bool = False

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form: every field but `edited`, which a baseline's finding says (G013)."""
        data = asdict(self)
        del data["edited"]
        return data

    def route(self) -> str:
        """How the run was recorded: `emulated NAME` or `recorded` (a real device or the CPU profiler)."""
        return f"emulated {self.emulated['gpu']}" if self.emulated else "recorded"

    def trace_overflowed(self) -> Optional[int]:
        """When torch says its trace's ring buffer wrapped (its first events are gone): its size in
        entries, or 0 when it does not say; None when it did not wrap (or the torch does not tell)."""
        settings = self.allocator_settings or {}
        if settings.get("trace_alloc_overflowed") is not True:
            return None
        size = settings.get("trace_alloc_max_entries")
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


@dataclass
class Summary:
    """One snapshot reduced to what the differ and the gate need."""

    source: Source
    devices: List[DeviceSummary]
    tool: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form, keys in a stable order so that stored summaries diff well.

        A stack is stored once: a phase peak's group that the device's peak also has (same
        signature) is written without frames, and `from_dict` takes them from there again.
        """
        data = asdict(self)
        data["source"] = self.source.to_dict()
        for d in data["devices"]:
            # A run's steps are its `steps` and its stacks its groups': only a baseline's summary has these.
            for key in ("step_count", "step_peaks", "autograd_nodes"):
                if d[key] is None:
                    del d[key]
            at_peak = {g["signature"] for g in d["groups"]}
            for p in d["phase_peaks"]:
                for g in p["groups"] or []:
                    if g["signature"] in at_peak:
                        g["frames"] = []
        return {"schema_version": data.pop("schema_version"), "tool": data.pop("tool"), **data}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Summary":
        """Rebuild a Summary from its JSON form (validate it against the schema first)."""
        devices = []
        for d in data["devices"]:
            d = _known(DeviceSummary, d)
            d["oom_events"] = [OomEvent(**_known(OomEvent, o)) for o in d["oom_events"]]
            d["groups"] = [_group(g) for g in d["groups"]]
            stacks = {g.signature: g.frames for g in d["groups"]}
            d["phase_peaks"] = [PhasePeak(**{**_known(PhasePeak, p), "groups": None if p.get("groups") is None
                                             else [_group(g, stacks) for g in p["groups"]]})
                                 for p in d.get("phase_peaks", [])]
            if d.get("history") is not None:
                h = _known(History, d["history"])
                d["history"] = History(**{**h, "bars": [Bar(**_known(Bar, b)) for b in h.get("bars", [])]})
            d["steps"] = [Step(**{**_known(Step, s),
                                  "phases": [PhaseSpan(**_known(PhaseSpan, p)) for p in s["phases"]]})
                          for s in d.get("steps", [])]
            devices.append(DeviceSummary(**d))
        return cls(
            source=Source(**_known(Source, data["source"])),
            devices=devices,
            tool=data.get("tool", ""),
            schema_version=data["schema_version"],
        )


def _group(g: Dict[str, Any], stacks: Optional[Dict[str, List[Frame]]] = None) -> Group:
    """A group from its JSON form; one stored without frames takes them from `stacks` by signature."""
    frames = [Frame(**_known(Frame, f)) for f in g["frames"]]
    if not frames and stacks:
        frames = list(stacks.get(g["signature"], []))
    return Group(**{**_known(Group, g), "frames": frames})


def _known(cls: type, data: Dict[str, Any]) -> Dict[str, Any]:
    """Keys of `data` that `cls` has: newer writers may add fields that older readers ignore."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
