"""Slots: the rows of the runner's persistent device state that scheduled sequences occupy.

The block table and the penalty counts stay on the device between steps, one row per slot
(`SlotState`), so that a step ships only what changed -- the blocks a sequence gained and the
tokens it computes -- and its host work follows the step, not `max_model_len`. A sequence
keeps its slot from step to step; slots are reused least-recently-scheduled first, and a
sequence that lands in a reused slot, or whose blocks were replaced since its last step
(preemption, swap: `Sequence.block_epoch`), is written afresh: its whole table, and the
counts of its tokens before the step. Correctness never depends on a sequence keeping its
slot, only the cost of the step that brings it back.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from jaxcb.core.sequence import SequenceId
from jaxcb.sampling import PenaltyCounts, record_tokens


@dataclasses.dataclass
class SlotEntry:
    slot: int
    block_epoch: int  # the sequence's block list this slot's table row holds
    num_blocks: int = 0  # blocks of that list already written to the row


class SlotTable:
    """Host side: which slot each sequence holds (least recently scheduled first)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._entries: collections.OrderedDict[SequenceId, SlotEntry] = collections.OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))

    def use(self, seq_id: SequenceId, block_epoch: int) -> tuple[SlotEntry, bool]:
        """The sequence's slot for this step, and whether it is fresh (nothing of it on the device).
        A step uses fewer slots than there are (`num_slots` > the largest sequence bucket), so the
        slot taken from the least recently scheduled sequence is never one this step uses."""
        entry = self._entries.get(seq_id)
        if entry is not None:
            self._entries.move_to_end(seq_id)
            if entry.block_epoch == block_epoch:
                return entry, False
            entry.block_epoch, entry.num_blocks = block_epoch, 0
            return entry, True
        slot = self._free.pop() if self._free else self._entries.popitem(last=False)[1].slot
        entry = self._entries[seq_id] = SlotEntry(slot, block_epoch)
        return entry, True

    def release(self, seq_id: SequenceId) -> None:
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry.slot)


@dataclasses.dataclass
class SlotState:
    """Device side, carried from step to step (donated, like the KV cache)."""

    block_tables: jax.Array  # i32[num_slots, max_blocks_per_seq]: each slot's sequence's blocks
    counts: PenaltyCounts  # bool[num_slots, V], i32[num_slots, V]: each slot's tokens so far


jax.tree_util.register_dataclass(SlotState, data_fields=[f.name for f in dataclasses.fields(SlotState)],
                                 meta_fields=[])


def empty_slot_state(num_slots: int, max_blocks: int, vocab_size: int, sharding=None) -> SlotState:
    return SlotState(
        jnp.zeros((num_slots, max_blocks), jnp.int32, device=sharding),
        PenaltyCounts(jnp.zeros((num_slots, vocab_size), jnp.bool_, device=sharding),
                      jnp.zeros((num_slots, vocab_size), jnp.int32, device=sharding)),
    )


def slot_state_bytes(num_slots: int, max_blocks: int, vocab_size: int) -> int:
    return num_slots * (4 * max_blocks + 5 * vocab_size)


def write_slots(state: SlotState, table_updates: jax.Array, reset_slots: jax.Array, counted: jax.Array) -> SlotState:
    """What does not fit in a step's own updates, written before it: `table_updates` i32[3, C] (slot,
    column, block; slot >= num_slots pads), `reset_slots` i32[K] slots whose counts start from zero
    (>= num_slots pads), then `counted` i32[3, C] (slot, token, is_output) recorded into them."""
    s, c, b = table_updates
    tables = state.block_tables.at[s, c].set(b, mode="drop")
    counts = PenaltyCounts(state.counts.seen.at[reset_slots].set(False, mode="drop"),
                           state.counts.output_counts.at[reset_slots].set(0, mode="drop"))
    return SlotState(tables, record_tokens(counts, counted[0], counted[1], counted[2] != 0))
