"""The engine's adapters: loaded on the host by name, brought into device slots as steps need them.

    load(name, path)   read and check a PEFT directory (`peft.load_peft_adapter`); from then on
                       requests may name it (at start-up: lora.adapters; at run time: the server's
                       POST /v1/load_lora_adapter)
    unload(name)       no new request may name it; it is dropped (host copy and slot) once its last
                       running or waiting sequence has finished (`finish_unloads`, every step)
    resolve(name)      the adapter a new request names, its weights read again from its directory
                       if the host copy was dropped (below)
    write_slots(...)   before a dispatch: the slot writes the scheduler decided (core/lora_slots.py)

Host copies, as vLLM's CPU LoRA cache: at most `lora.max_cpu_loras` adapters keep their weights in
host memory. Loading or naming one more drops the least recently named copy among adapters no
unfinished request uses (one in use is never dropped: its slot may need writing again after a
preemption); the adapter stays loaded, and the next request that names it reads it again from its
directory, checked against the digest it was loaded with, so that changed files are refused by
name rather than served under the old identity.

Requests are counted per adapter (`requests_per_adapter`, `tokens_per_adapter`) for the metrics.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Callable, Optional

from jaxcb.config import LoraConfig
from jaxcb.core.lora_slots import LoraSlotTable
from jaxcb.errors import InvalidRequestError
from jaxcb.lora.peft import LoraAdapter, check_adapter_name, load_peft_adapter
from jaxcb.model.config import LlamaConfig

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, cfg: LoraConfig, model_cfg: LlamaConfig, base_name: str):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.base_name = base_name
        self.max_cpu_loras = cfg.max_cpu_loras or max(cfg.max_loras, len(cfg.start_up_adapters))
        self.adapters: dict[str, LoraAdapter] = {}  # every loaded adapter; weights {} while its host copy is dropped
        self.resident: OrderedDict[str, None] = OrderedDict()  # adapters with host copies, least recently named first
        self.unloading: set[str] = set()
        self.slots = LoraSlotTable(cfg.max_loras)
        # Whether an adapter still has unfinished requests (the engine's answer; unload and dropping
        # a host copy wait for them).
        self.in_use: Callable[[str], bool] = lambda name: False
        self.num_reloads = 0  # host copies read again from their directories
        self.requests_per_adapter: Counter[str] = Counter()  # requests added to the engine, ever
        self.tokens_per_adapter: Counter[str] = Counter()  # tokens they generated
        self.load_seconds = 0.0

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter; InvalidRequestError naming what does not fit (nothing loaded)."""
        check_adapter_name(name, self.base_name)
        if name in self.unloading:
            raise InvalidRequestError(f"the LoRA adapter named {name!r} is being unloaded (its running requests "
                                      "finish first); load it again once the unload has answered", "lora_name")
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")
        adapter = load_peft_adapter(name, path, self.model_cfg, self.cfg.max_rank)
        self.adapters[name] = adapter
        self._hold(name)
        log.info("LoRA adapter %r loaded from %s: rank %d, %d projections, %.1f MiB on the host", name, path,
                 adapter.rank, len(adapter.weights), adapter.num_bytes / 2**20)
        return adapter

    def _hold(self, name: str) -> None:
        """The adapter's host copy is the most recently named; copies past max_cpu_loras are dropped,
        least recently named first, among those no unfinished request uses."""
        self.resident[name] = None
        self.resident.move_to_end(name)
        for other in list(self.resident):
            if len(self.resident) <= self.max_cpu_loras:
                break
            if other != name and not self.in_use(other):
                del self.resident[other]
                self.adapters[other].weights = {}
                log.info("LoRA adapter %r: host copy dropped (lora.max_cpu_loras=%d); read again when named",
                         other, self.max_cpu_loras)

    def _reload(self, adapter: LoraAdapter) -> None:
        """Read a dropped host copy again; InvalidRequestError naming the adapter if its files changed."""
        try:
            again = load_peft_adapter(adapter.name, adapter.path, self.model_cfg, self.cfg.max_rank)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"model {adapter.name!r}: its host copy was dropped (lora.max_cpu_loras="
                                      f"{self.max_cpu_loras}) and reading it again failed: {e}", "model") from e
        if again.digest != adapter.digest:
            raise InvalidRequestError(f"model {adapter.name!r}: the files in {adapter.path} changed since the adapter "
                                      "was loaded; unload it and load it again to serve the new weights", "model")
        adapter.weights = again.weights
        self.num_reloads += 1
        log.info("LoRA adapter %r read again from %s", adapter.name, adapter.path)

    def unload(self, name: str) -> bool:
        """Refuse new requests for the adapter and drop it once its requests are done; True if it is
        gone already (none was running)."""
        if name in self.unloading:
            raise InvalidRequestError(f"the LoRA adapter named {name!r} is being unloaded already", "lora_name")
        if name not in self.adapters:
            served = ", ".join(repr(n) for n in self.served()) or "none"
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: {served})", "lora_name")
        self.unloading.add(name)
        self.finish_unloads()
        return name not in self.adapters

    def finish_unloads(self) -> None:
        for name in list(self.unloading):
            if not self.in_use(name) and not self.slots.is_held(name):
                self.slots.forget(name)
                del self.adapters[name]
                self.resident.pop(name, None)
                self.unloading.discard(name)
                log.info("LoRA adapter %r unloaded", name)

    def resolve(self, name: Optional[str]) -> Optional[LoraAdapter]:
        """The adapter a request names (None or the base's name: the base model)."""
        if name is None or name == self.base_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None or name in self.unloading:
            known = ", ".join([repr(self.base_name)] + [repr(n) for n in self.adapters if n not in self.unloading])
            raise InvalidRequestError(f"model {name!r} is neither the base model nor a loaded LoRA adapter "
                                      f"(served: {known})", "model")
        if name not in self.resident:
            self._reload(adapter)
        self._hold(name)
        return adapter

    def identity(self, adapter: LoraAdapter) -> str:
        return f"{adapter.name}:{adapter.digest}"

    def write_slots(self, write: Callable[[int, Optional[dict]], None]) -> None:
        """Make the slot writes the scheduler decided: `write(slot, adapter weights)`."""
        for slot, name in self.slots.take_loads():
            adapter = self.adapters[name]
            if not adapter.weights:  # never so (a named adapter keeps its copy while in use); read, not zeros
                self._reload(adapter)
            write(slot, adapter.weights)

    def served(self) -> list[str]:
        return [n for n in self.adapters if n not in self.unloading]
