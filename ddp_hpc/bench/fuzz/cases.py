"""Drawing a recovery case from one integer seed (``python -m ddp_hpc.bench.recovery_fuzz``).

A case is a model shape, a loop shape and the faults put into one run of it. The shape is
drawn from ``random.Random(seed >> SHAPE_BITS)`` and the faults from ``random.Random(seed)``:
the ``2**SHAPE_BITS`` case seeds of one shape seed share their shape, hence their
uninterrupted reference run (the runner runs it once). ``case_seeds(run_seed, n)`` deals
the seeds of a fuzz run that way. Torch-free: the runner and the tests draw without it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any

#: Low bits of a case seed that vary only the faults (so 16 cases may share one shape).
SHAPE_BITS = 4
#: Cases drawn per shape by ``case_seeds``: each shape's reference serves that many.
CASES_PER_SHAPE = 4

#: Moments a rank of the first group can die at; ``snapshot`` is a sharded model's only.
MOMENTS = ("forward", "backward", "optimizer", "window", "snapshot", "save")
#: Moments a replacement dies at: while it starts (before ``InJobRecovery`` returns), or
#: once its group formed, as the state transfer begins.
REPLACEMENT_MOMENTS = ("appear", "transfer")
SIGNALS = ("KILL", "STOP")


@dataclass(frozen=True)
class Block:
    """Linear, a norm, GELU, a dropout, maybe a registered buffer the forward updates, maybe
    a block nested inside; ``unit``: under FSDP2 a ``fully_shard`` unit of its own (else its
    parameters belong to the unit around it, the root at the top)."""

    unit: bool
    norm: str  # none | layer | batch (BatchNorm1d: running statistics)
    dropout: float
    counter: bool
    inner: Block | None = None


@dataclass(frozen=True)
class Shape:
    """What a case trains and how: everything but its faults (the reference's key)."""

    strategy: str  # ddp | fsdp2
    world_size: int
    hidden: int
    features: int
    classes: int
    tied: bool  # a token embedding whose weight the head shares
    input_unit: bool  # fsdp2: the input Linear is a unit of its own (else the root owns it)
    head_unit: bool  # fsdp2: the head is a unit of its own (never when tied)
    blocks: tuple[Block, ...]
    accumulation: int  # micro-batches per optimizer step
    sync: str  # ddp: no_sync; fsdp2: flag (set_requires_gradient_sync) or plain
    optimizer: str  # adamw | sgd (with momentum)
    scheduler: str  # none | lambda | step
    step_work: str  # none | allreduce (a logged loss, before the optimizer step) | host (before step_done)
    checkpoint_every: int
    checkpoint_format: str  # file (ddp) | dcp
    snapshot_every: int  # fsdp2
    epochs: int
    steps: int  # optimizer steps in all
    batch: int  # samples per micro-batch per rank
    model_seed: int

    @property
    def root_owned(self) -> bool:
        """Under FSDP2, parameters the root's own unit holds (not in a unit below it)."""
        return self.tied or not self.input_unit or not self.head_unit or not all(b.unit for b in self.blocks)

    @property
    def steps_per_epoch(self) -> int:
        return self.steps // self.epochs

    def modules(self) -> list[str]:
        """The submodules a forward or backward fault may hook (names as ``named_modules``)."""
        names = ["", "inp", "head"] + (["embed"] if self.tied else [])
        for index, block in enumerate(self.blocks):
            name = f"blocks.{index}"
            while block is not None:
                names.append(name)
                block, name = block.inner, f"{name}.inner"
        return names

    def summary(self) -> str:
        def depth(block: Block | None) -> int:
            return 0 if block is None else 1 + depth(block.inner)

        parts = [self.strategy, f"w{self.world_size}", f"h{self.hidden}",
                 "blocks " + "+".join(str(depth(b)) for b in self.blocks)]
        if self.strategy == "fsdp2" and self.root_owned:
            parts.append("root-owned")
        norms = {b.norm for b in _all_blocks(self.blocks)} - {"none"}
        parts += [n + "norm" for n in sorted(norms)]
        if self.tied:
            parts.append("tied")
        if any(b.counter for b in _all_blocks(self.blocks)):
            parts.append("buffer")
        if any(b.dropout for b in _all_blocks(self.blocks)):
            parts.append("dropout")
        if self.accumulation > 1:
            parts.append(f"accum{self.accumulation}/{self.sync}")
        parts.append(self.optimizer + (f"+{self.scheduler}" if self.scheduler != "none" else ""))
        if self.step_work != "none":
            parts.append(f"work:{self.step_work}")
        parts.append(f"ckpt{self.checkpoint_every}/{self.checkpoint_format}")
        if self.strategy == "fsdp2":
            parts.append(f"snap{self.snapshot_every}")
        parts.append(f"{self.steps}steps/{self.epochs}ep")
        return " ".join(parts)


@dataclass(frozen=True)
class Fault:
    """``signal`` (KILL, or STOP: the launch's hang detection ends the frozen rank) sent by
    the rank in each of ``slots`` to itself, at ``moment`` of step ``step`` (the step being
    done, counted from 1). ``replacement``: the rank that dies is the one that replaces
    ``slots[0]`` after an earlier fault (``moment`` one of ``REPLACEMENT_MOMENTS``).
    ``module``/``micro``: for forward and backward, the submodule whose hook fires and the
    micro-batch of the step. ``sub``: for a snapshot, ``take`` (as it copies) or ``keep``
    (in its background thread, its own copy written, before the swap with its buddy)."""

    signal: str
    slots: tuple[int, ...]
    moment: str
    step: int
    module: str = ""
    micro: int = 0
    sub: str = ""
    replacement: bool = False

    def summary(self) -> str:
        who = "+".join(map(str, self.slots)) + ("'" if self.replacement else "")
        where = self.moment
        if self.moment in ("forward", "backward"):
            where += f"[{self.module or 'root'}#{self.micro}]"
        if self.sub:
            where += f"[{self.sub}]"
        return f"{self.signal} {who} {where}@{self.step}"


@dataclass(frozen=True)
class Case:
    seed: int
    shape: Shape
    faults: tuple[Fault, ...]
    recover: int  # --recover
    shrink: bool  # --shrink (ddp only): a stated exception, the data is dealt anew

    @property
    def losses(self) -> int:
        return sum(len(f.slots) for f in self.faults)

    def summary(self) -> str:
        return self.shape.summary()

    def faults_summary(self) -> str:
        text = ", ".join(f.summary() for f in self.faults) or "none"
        return f"{text} (recover {self.recover}{', shrink' if self.shrink else ''})"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Case:
        raw = json.loads(text)
        shape = dict(raw["shape"])
        shape["blocks"] = tuple(_block(b) for b in shape["blocks"])
        faults = tuple(Fault(**{**f, "slots": tuple(f["slots"])}) for f in raw["faults"])
        return cls(seed=raw["seed"], shape=Shape(**shape), faults=faults, recover=raw["recover"],
                   shrink=raw["shrink"])

    def reference_key(self) -> str:
        """What the uninterrupted run depends on: the shape only."""
        return json.dumps(dataclasses.asdict(self.shape), sort_keys=True)


def _block(raw: dict[str, Any] | None) -> Block | None:
    if raw is None:
        return None
    return Block(**{**raw, "inner": _block(raw.get("inner"))})


def _all_blocks(blocks: tuple[Block, ...]) -> list[Block]:
    found = []
    for block in blocks:
        while block is not None:
            found.append(block)
            block = block.inner
    return found


def case_seeds(run_seed: int, count: int) -> list[int]:
    """``count`` case seeds of a fuzz run, ``CASES_PER_SHAPE`` of each shape seed."""
    rng = random.Random(run_seed)
    seeds: list[int] = []
    while len(seeds) < count:
        shape_seed = rng.getrandbits(28)
        seeds += [(shape_seed << SHAPE_BITS) | k for k in range(CASES_PER_SHAPE)]
    return seeds[:count]


def draw_shape(rng: random.Random) -> Shape:
    strategy = rng.choice(("ddp", "fsdp2"))
    fsdp2 = strategy == "fsdp2"
    world_size = 4 if rng.random() < 0.1 else rng.choice((2, 3))
    tied = rng.random() < 0.3
    blocks = tuple(_draw_block(rng, depth=0) for _ in range(rng.randint(1, 3)))
    epochs = rng.choice((1, 2))
    steps = rng.randint(10, 16)
    steps -= steps % epochs
    accumulation = rng.randint(1, 3)
    sync = "no_sync" if not fsdp2 else rng.choice(("flag", "plain"))
    return Shape(
        strategy=strategy, world_size=world_size, hidden=rng.choice((16, 32, 48)), features=rng.choice((8, 12)),
        classes=rng.choice((6, 10)), tied=tied, input_unit=rng.random() < 0.5,
        head_unit=not tied and rng.random() < 0.5, blocks=blocks, accumulation=accumulation, sync=sync,
        optimizer=rng.choice(("adamw", "sgd")), scheduler=rng.choice(("none", "none", "lambda", "step")),
        step_work=rng.choice(("none", "allreduce", "host")), checkpoint_every=rng.randint(3, 7),
        checkpoint_format="dcp" if fsdp2 else rng.choice(("file", "dcp")),
        snapshot_every=rng.randint(1, 3) if fsdp2 else 1, epochs=epochs, steps=steps, batch=4,
        model_seed=rng.getrandbits(16))


def _draw_block(rng: random.Random, depth: int) -> Block:
    inner = _draw_block(rng, depth + 1) if depth < 2 and rng.random() < 0.35 else None
    return Block(unit=rng.random() < 0.7, norm=rng.choice(("none", "layer", "batch")),
                 dropout=rng.choice((0.0, 0.0, 0.1, 0.25)), counter=rng.random() < 0.25, inner=inner)


def draw_case(seed: int) -> Case:
    """The case of ``seed``: its shape from ``seed >> SHAPE_BITS``, its faults from ``seed``."""
    shape = draw_shape(random.Random(seed >> SHAPE_BITS))
    rng = random.Random(seed)
    faults: list[Fault] = []
    first = _draw_fault(rng, shape, low=2, high=shape.steps - 2)
    faults.append(first)
    if rng.random() < 0.25:  # the replacement of the first fault's rank dies too
        faults.append(Fault(signal=rng.choice(SIGNALS), slots=first.slots[:1], moment=rng.choice(REPLACEMENT_MOMENTS),
                            step=first.step, replacement=True))
    elif rng.random() < 0.3 and first.step + 2 <= shape.steps - 2:  # a second loss, later on
        faults.append(_draw_fault(rng, shape, low=first.step + 2, high=shape.steps - 2, single=True))
    losses = sum(len(f.slots) for f in faults)
    # Mostly enough recoveries for every loss; sometimes one short, so the launch gives up
    # and the job restarts in place (--max-restarts 1): that path must end identical too.
    recover = losses - 1 if losses > 1 and rng.random() < 0.3 else losses
    shrink = shape.strategy == "ddp" and rng.random() < 0.05 and recover == losses
    return Case(seed=seed, shape=shape, faults=tuple(faults), recover=recover, shrink=shrink)


def _draw_fault(rng: random.Random, shape: Shape, low: int, high: int, single: bool = False) -> Fault:
    moments = [m for m in MOMENTS if m != "snapshot" or shape.strategy == "fsdp2"]
    moment = rng.choice(moments)
    slots: tuple[int, ...] = (rng.randrange(shape.world_size),)
    if not single and rng.random() < 0.15:  # two ranks at once
        slots = tuple(sorted(rng.sample(range(shape.world_size), 2)))
    steps = list(range(low, high + 1))
    if moment == "save":
        steps = [s for s in steps if s % shape.checkpoint_every == 0] or steps
        if not any(s % shape.checkpoint_every == 0 for s in steps):
            moment = "window"
    if moment == "snapshot":
        steps = [s for s in steps if s % shape.snapshot_every == 0] or steps
        if not any(s % shape.snapshot_every == 0 for s in steps):
            moment = "window"
    step = rng.choice(steps)
    module = rng.choice(shape.modules()) if moment in ("forward", "backward") else ""
    micro = rng.randrange(shape.accumulation) if moment in ("forward", "backward") else 0
    sub = rng.choice(("take", "keep")) if moment == "snapshot" else ""
    return Fault(signal=rng.choice(SIGNALS), slots=slots, moment=moment, step=step, module=module, micro=micro,
                 sub=sub)


def stated_exception(case: Case) -> str | None:
    """Why the docs say ``case`` cannot end bit-identical to its reference, or None."""
    if case.shrink:
        return "a shrink deals the rest of the epoch over fewer ranks (docs: After a shrink)"
    return None
