"""Re-cuts of a repartitionable GPU's MIG layout, as the SJA engine and the best-fit baseline run them.

A ``Cut`` is one repartitionable GPU: its current layout, how long a re-cut takes, and whether one is
in progress. ``Cut.start`` begins a re-cut (the GPU offers nothing until it ends, and the recorder
counts that time as reconfiguration); ``Cut.finish`` installs the new layout and returns its slices,
whose ids carry the re-cut's generation so that no id names two instances in one run.

The rest is each caller's own: the layout a GPU starts in (the engine's is its slices' profiles in
its own order, best-fit's the canonical layout; both are what it compares new layouts with), which
layout to cut to, what stands for a slice (the engine's slices, best-fit's units), and how the end of
a re-cut is scheduled among its other events.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sja.sim.cluster import slices_of
from sja.sim.metrics import ScheduleRecorder
from sja.sim.model import SimConfig, SimGpu, SimSlice


@dataclass
class Cut:
    """A repartitionable GPU: its current layout and whether it is being re-cut."""

    gpu: SimGpu
    layout: tuple[str, ...]
    reconfig_s: float
    """Seconds one re-cut takes."""
    generation: int = 0
    """Re-cuts finished so far."""
    reconfiguring: bool = False

    @classmethod
    def of(cls, gpu: SimGpu, layout: tuple[str, ...], cfg: SimConfig) -> Cut:
        """``gpu`` in ``layout``, re-cut in the GPU's own reconfiguration time, else ``cfg.reconfig_s``."""
        cost = gpu.reconfig_s if gpu.reconfig_s is not None else cfg.reconfig_s
        return cls(gpu=gpu, layout=layout, reconfig_s=cost)

    def start(self, now: float, recorder: ScheduleRecorder) -> float:
        """Begin a re-cut at ``now``; returns when it ends. The GPU offers nothing meanwhile: the
        caller has retired its slices, and the recorder counts the whole GPU as reconfiguring."""
        self.reconfiguring = True
        ends = now + self.reconfig_s
        recorder.add_reconfig(now, ends, share=1.0)
        return ends

    def finish(self, layout: tuple[str, ...]) -> list[SimSlice]:
        """End the re-cut with ``layout`` in place; returns the new slices (freshly free)."""
        self.generation += 1
        self.layout = layout
        self.reconfiguring = False
        return slices_of(dataclasses.replace(self.gpu, layout=layout), self.generation)
