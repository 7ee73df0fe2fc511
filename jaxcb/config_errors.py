"""Hydra's and OmegaConf's composition errors as one sentence naming the override and what to change.

Hydra prints its own multi-line report and exits 1; for an unknown key it suggests `+key=value`,
which jaxcb then refuses (a key no config group has would be dropped). The scripts check their
overrides here first, so every config mistake ends the same way: `error: <sentence>`, exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Optional, Sequence

from omegaconf import DictConfig

from jaxcb.config import CONF_DIR, ConfigError, presets

# Hydra's own flags that take no value or that do not change the config.
_RUN_FLAGS = ("-m", "--multirun", "-r", "--run")


def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_field(path: str, kind: Any) -> str:
    """The sentence for a key that the dataclass `kind` has no field for."""
    parent, _, key = path.rpartition(".")
    if parent and not dataclasses.is_dataclass(kind):  # under a free mapping (lora.adapters), or a null field
        return (f"{path}: {parent} has no key {key} (or is null); set {parent} whole, "
                f"as {parent}={{{key}: ...}}, or add the key with +{path}=...")
    fields = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []
    guess = did_you_mean(key, fields)
    if guess:
        guess = guess.replace("mean ", f"mean {parent}." if parent else "mean ")
    where = f"conf/{parent.split('.')[0]}/" if parent else "conf/config.yaml"
    return f"{path} is not a config field jaxcb knows{guess}; the fields are listed in {where}"


def describe(error: BaseException) -> Optional[str]:
    """One sentence for a Hydra/OmegaConf composition error, or None for an error of another kind."""
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = error.__cause__
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MissingConfigException):
        found = re.search(r"Could not find '([^'/]+)/([^']+)'", str(error))
        if found:
            group, name = found.groups()
            return (f"{group}={name} is not a preset{did_you_mean(name, presets(group))}; the presets of {group} are "
                    f"{', '.join(presets(group))} (conf/{group}/)")
        return first
    if isinstance(error, OverrideParseException):
        return parse_error(error)
    if isinstance(error, ConfigCompositionException):
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
            return unknown_field(str(cause.full_key), getattr(cause, "object_type", None))
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            return f"{cause.full_key}: {str(cause).splitlines()[0]}"
        if first.startswith("Ambiguous value"):
            return (f"{first}: for a list write key=[a,b], for a string quote it, key='a,b'; to sweep over "
                    f"the values, add --multirun")
        return first
    if isinstance(error, OmegaConfBaseException) and getattr(error, "full_key", None):
        if "NoneType" in first or "has no attribute 'get'" in first:
            return _null_parent(str(error.full_key))
        return f"{error.full_key}: {first}"
    if isinstance(error, AssertionError) and "Unexpected type for root: NoneType" in first:
        return "a key under a field that is null in this preset cannot be set alone; set the field whole, e.g. " \
               "model.rope_scaling={rope_type: yarn, factor: 4.0}"
    return first if isinstance(error, (HydraException, OmegaConfBaseException)) else None


def parse_error(error: BaseException, override: str = "") -> str:
    lines = [line for line in str(error).splitlines() if line and not line.startswith(("See ", "Error parsing"))]
    what = f"cannot read the override {override!r}" if override else "cannot read an override"
    return f"{what}: {lines[0] if lines else error}; an override is key=value (a list: key=[a,b]; a mapping: key={{a: 1}})"


def _null_parent(path: str) -> str:
    return (f"{path} is null in this preset and cannot be merged into; set it whole, e.g. "
            f"model.rope_scaling={{rope_type: yarn, factor: 4.0}}")


def compose_overrides(overrides: Sequence[str]) -> DictConfig:
    """Hydra's composition of conf/config.yaml with `overrides`; ConfigError with one sentence if it fails."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=list(overrides))
    except Exception as e:
        sentence = describe(e)
        if sentence is None:
            raise
        raise ConfigError(sentence) from e


def check_overrides(argv: Sequence[str]) -> None:
    """Compose the config that `argv` (a script's command line) asks Hydra for; raise ConfigError with
    one sentence if Hydra cannot. A sweep (under --multirun) is checked with its first value; command
    lines with other Hydra flags (--cfg, --help, -cn, ...) and hydra.* overrides are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    flags = [a for a in argv if a.startswith("-")]
    if any(flag not in _RUN_FLAGS for flag in flags):
        return
    multirun = any(flag in ("-m", "--multirun") for flag in flags)
    parser, kept = OverridesParser.create(), []
    for line in (a for a in argv if not a.startswith("-")):
        try:
            [override] = parser.parse_overrides([line])
        except HydraException as e:
            raise ConfigError(parse_error(e, line)) from e
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if override.is_sweep_override() and multirun:
            first = next(iter(override.sweep_string_iterator()), None)
            if first is not None:
                kept.append(f"{override.get_key_element()}={first}")
        else:  # a sweep without --multirun: compose reports it, with Hydra's hint
            kept.append(line)
    compose_overrides(kept)
