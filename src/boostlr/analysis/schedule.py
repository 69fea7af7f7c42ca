"""A pipeline schedule's step, timed as torch's schedules run it.

``Schedule1F1B`` and ``ScheduleGPipe`` (torch.distributed.pipelining, what
``parallel/pipeline.py`` builds) are short programs per pipeline rank: forward and backward
chunks of each micro-batch in a fixed order, with batched point-to-point exchanges between
them, some waited at once, some fired and waited later (:func:`program` writes them out,
call for call). Neighbouring ranks are coupled only through those exchanges, so the step's
length follows from the programs and each chunk's time: :func:`simulate` runs them.

Why simulate instead of ``(m + p - 1)`` slots of the slowest stage: the closed form is exact
only for equal stages and free transfers. The last stage also runs the head and the loss, the
first the embedding; 1F1B's fill and drain pass every stage once (``sum`` of the stages, not
``p`` times the slowest); and a transfer sits on the critical path only where a rank waits
for it: each receive before a chunk, and a send's completion where the program waits for
it, which with NCCL's rendezvous is when the peer has posted the matching receive.

Which program a schedule runs is its spec's ``timing`` (``specs/schedule.py``); the
interleaved schedule is not simulated: it keeps Megatron's ``(m*v + p - 1)`` slots of one
virtual stage (:func:`interleaved_span`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from boostlr.specs.schedule import FORWARDS_FIRST, ONE_FORWARD_ONE_BACKWARD, schedule_spec

# A point-to-point op: (direction "send"|"recv", what "act"|"grad", micro-batch, peer rank).
Op = tuple[str, str, int, int]


@dataclass(frozen=True)
class Step:
    """One entry of a rank's program: a chunk of compute, or p2p ops posted and/or waited.

    ``kind``: ``"F"``/``"B"`` (compute micro-batch ``mb``), ``"post"`` (fire ``ops`` as group
    ``group``), ``"wait"`` (block until group ``group`` is done)."""

    kind: str
    mb: int = -1
    group: int = -1
    ops: tuple[Op, ...] = ()


class _Program:
    """Builds one rank's program; groups are numbered in issue order."""

    def __init__(self, rank: int, stages: int):
        self.rank, self.stages, self.steps, self._groups = rank, stages, [], 0

    def fwd_recv(self, mb: int) -> list[Op]:
        return [("recv", "act", mb, self.rank - 1)] if self.rank > 0 else []

    def fwd_send(self, mb: int) -> list[Op]:
        return [("send", "act", mb, self.rank + 1)] if self.rank < self.stages - 1 else []

    def bwd_recv(self, mb: int) -> list[Op]:
        return [("recv", "grad", mb, self.rank + 1)] if self.rank < self.stages - 1 else []

    def bwd_send(self, mb: int) -> list[Op]:
        return [("send", "grad", mb, self.rank - 1)] if self.rank > 0 else []

    def post(self, ops: list[Op]) -> int:
        """Fire ``ops`` (torch's ``_batch_p2p``); -1 when there is nothing to fire."""
        if not ops:
            return -1
        self._groups += 1
        self.steps.append(Step("post", group=self._groups, ops=tuple(ops)))
        return self._groups

    def wait(self, group: int) -> None:
        """torch's ``_wait_batch_p2p``."""
        if group >= 0:
            self.steps.append(Step("wait", group=group))

    def compute(self, kind: str, mb: int) -> None:
        self.steps.append(Step(kind, mb))


def _forwards_first(g: _Program, m: int) -> None:
    """``ScheduleGPipe._step_microbatches``: every forward, then every backward, each half
    alike."""
    for kind, recv, send in (("F", g.fwd_recv, g.fwd_send), ("B", g.bwd_recv, g.bwd_send)):
        sends: list[int] = []
        for i in range(m):
            g.wait(g.post(recv(i)))
            g.compute(kind, i)
            sends.append(g.post(send(i)))
        for s in sends:
            g.wait(s)


def _one_forward_one_backward(g: _Program, m: int) -> None:
    """``Schedule1F1B._step_microbatches``: warm-up forwards, steady 1F1B, drain."""
    warmup = min(m, g.stages - g.rank)
    send_work, fwd_sends = -1, []
    for i in range(warmup):
        g.wait(g.post(g.fwd_recv(i)))
        g.compute("F", i)
        g.wait(send_work)
        send_work = -1
        fwd_sends = g.fwd_send(i)
        if i != warmup - 1:  # the last warm-up send is fused with the first backward's recv
            send_work, fwd_sends = g.post(fwd_sends), []
    fwd, bwd = warmup, 0
    while True:
        g.wait(g.post(fwd_sends + g.bwd_recv(bwd)))
        g.compute("B", bwd)
        bwd_sends = g.bwd_send(bwd)
        bwd += 1
        if fwd == m:
            break
        g.wait(g.post(bwd_sends + g.fwd_recv(fwd)))
        g.compute("F", fwd)
        fwd_sends = g.fwd_send(fwd)
        fwd += 1
    send_work = g.post(bwd_sends)
    while bwd < m:
        g.wait(g.post(g.bwd_recv(bwd)))
        g.compute("B", bwd)
        g.wait(send_work)
        send_work = g.post(g.bwd_send(bwd))
        bwd += 1
    g.wait(send_work)


# The programs simulated, by the spec's ``timing`` (``specs/schedule.py``).
PROGRAMS: dict[str, Callable[[_Program, int], None]] = {
    FORWARDS_FIRST: _forwards_first,
    ONE_FORWARD_ONE_BACKWARD: _one_forward_one_backward,
}


def program(schedule: str, rank: int, stages: int, microbatches: int) -> list[Step]:
    """Rank ``rank``'s program for one step of ``schedule``, in the order torch issues it."""
    write = PROGRAMS.get(schedule_spec(schedule).timing)
    if write is None:
        raise ValueError(f"no program for schedule {schedule!r}")
    g = _Program(rank, stages)
    write(g, microbatches)
    return g.steps


def _match(rank: int, op: Op) -> tuple:
    """The key both ends of a transfer share: (what, micro-batch, sender, receiver)."""
    direction, what, mb, peer = op
    return (what, mb, rank, peer) if direction == "send" else (what, mb, peer, rank)


def simulate(
    programs: list[list[Step]],
    fwd: list[float],
    bwd: list[float],
    transfer: dict[str, float],
) -> list[float]:
    """When each rank finishes its program.

    Each rank runs its steps in order on one timeline (the compute stream): ``F``/``B`` take
    ``fwd[rank]``/``bwd[rank]``; a ``post`` takes no time; a ``wait`` holds the rank until
    every op of its group is done, an op being done ``transfer[what]`` seconds after both
    ends have posted it (NCCL's point-to-point is a rendezvous).
    """
    posted: dict[tuple, float] = {}  # (key, end "send"|"recv") -> time posted
    groups: list[dict[int, tuple[Op, ...]]] = [{} for _ in programs]
    clock = [0.0] * len(programs)
    pc = [0] * len(programs)
    blocked: dict[tuple, list[int]] = {}  # an end not yet posted -> ranks waiting for it
    ready = deque(range(len(programs)))
    while ready:
        r = ready.popleft()
        steps = programs[r]
        while pc[r] < len(steps):
            st = steps[pc[r]]
            if st.kind == "F":
                clock[r] += fwd[r]
            elif st.kind == "B":
                clock[r] += bwd[r]
            elif st.kind == "post":
                groups[r][st.group] = st.ops
                for op in st.ops:
                    key = (_match(r, op), op[0])
                    posted[key] = clock[r]
                    ready.extend(blocked.pop(key, []))
            else:  # wait
                done = clock[r]
                missing = None
                for op in groups[r][st.group]:
                    other = (_match(r, op), "recv" if op[0] == "send" else "send")
                    if other not in posted:
                        missing = other
                        break
                    mine = posted[(_match(r, op), op[0])]
                    done = max(done, max(mine, posted[other]) + transfer[op[1]])
                if missing is not None:
                    blocked.setdefault(missing, []).append(r)
                    break
                clock[r] = done
            pc[r] += 1
    stuck = [r for r in range(len(programs)) if pc[r] < len(programs[r])]
    if stuck:
        raise RuntimeError(f"pipeline programs deadlock on ranks {stuck}")
    return clock


def pipeline_span(
    schedule: str,
    microbatches: int,
    fwd: list[float],
    bwd: list[float],
    transfer: dict[str, float],
) -> float:
    """Seconds one schedule step takes: the last rank to finish (one stage per rank)."""
    stages = len(fwd)
    programs = [program(schedule, r, stages, microbatches) for r in range(stages)]
    return max(simulate(programs, fwd, bwd, transfer))


def interleaved_span(microbatches: int, virtual: int, stages: int, slot: float) -> float:
    """Interleaved 1F1B: ``m*v + p - 1`` slots of one virtual stage (``slot`` = one rank's
    forward and backward of one micro-batch over all its ``v`` stages)."""
    return (microbatches * virtual + stages - 1) * slot / virtual
