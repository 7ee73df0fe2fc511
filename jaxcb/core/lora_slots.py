"""Which adapter sits in which of the `lora.max_loras` device slots (host only, no jax).

A sequence with an adapter holds its adapter's slot from admission until it leaves the running
set (finished, aborted or preempted): the scheduler calls `acquire` before admitting it and
`release` when it leaves. An adapter not in a slot takes a free one, or the least recently used
slot that no running sequence holds (the adapter there goes back to host memory only: its host
copy never left); with every slot held the sequence waits in the queue -- it is never refused --
and the scheduler admits the sequences behind it that need no new slot meanwhile (as vLLM does).
The slot writes this decides are `take_loads()`, which the engine makes on the device before it
dispatches the step that needs them. A running step keeps the buffers it was dispatched with (a
write makes new arrays), so replacing a slot never changes a step in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from jaxcb.core.sequence import Sequence, SequenceId


class LoraSlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}  # adapter name -> its slot, while in one
        self._holders: list[set[SequenceId]] = [set() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))  # never-used or emptied slots, lowest first
        self._idle: OrderedDict[int, None] = OrderedDict()  # slots no sequence holds, least recently used first
        self._held_by: dict[SequenceId, int] = {}
        self._loads: list[tuple[int, str]] = []
        self.num_loads = 0  # slot writes so far (an adapter brought to the device)

    def can_acquire(self, sequence: Sequence) -> bool:
        """Whether `acquire` would succeed now (it changes nothing)."""
        name = sequence.lora_name
        return (name is None or sequence.seq_id in self._held_by or name in self.slot_of or bool(self._free)
                or bool(self._idle))

    def acquire(self, sequence: Sequence) -> bool:
        """Give `sequence` its adapter's slot (`sequence.lora_slot`); False when every slot is held by
        running sequences of other adapters (it waits). Sequences on the base always succeed."""
        name = sequence.lora_name
        if name is None:
            sequence.lora_slot = -1
            return True
        if sequence.seq_id in self._held_by:
            return True
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return False
            self.slot_of[name] = slot
            self._loads.append((slot, name))
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._holders[slot].add(sequence.seq_id)
        self._held_by[sequence.seq_id] = slot
        sequence.lora_slot = slot
        return True

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)  # the least recently used slot no one holds
        evicted = next(n for n, s in self.slot_of.items() if s == slot)
        del self.slot_of[evicted]
        return slot

    def release(self, sequence: Sequence) -> None:
        """`sequence` left the running set: its slot may be reused once no other sequence holds it."""
        slot = self._held_by.pop(sequence.seq_id, None)
        if slot is None:
            return
        holders = self._holders[slot]
        holders.discard(sequence.seq_id)
        if not holders:
            self._idle[slot] = None

    def forget(self, name: str) -> None:
        """The adapter was unloaded (no sequence holds it): its slot is free again."""
        slot = self.slot_of.pop(name, None)
        if slot is None:
            return
        assert not self._holders[slot], f"adapter {name!r} is unloaded while sequences hold its slot"
        self._idle.pop(slot, None)
        self._loads = [(s, n) for s, n in self._loads if n != name]
        self._free.append(slot)
        self._free.sort(reverse=True)

    def take_loads(self) -> list[tuple[int, str]]:
        """(slot, adapter) writes decided since the last call, to make before the next dispatch."""
        loads, self._loads = self._loads, []
        return loads

    def is_held(self, name: str) -> bool:
        slot = self.slot_of.get(name)
        return slot is not None and bool(self._holders[slot])

    @property
    def num_held(self) -> int:
        return sum(1 for h in self._holders if h)
