"""What the `scripts/` entry points share: config loading and errors a user can act on."""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Callable

from omegaconf import DictConfig

from jaxcb.config import Config, ConfigError, load_config
from jaxcb.config_unused import unused_settings
from jaxcb.errors import UserError  # noqa: F401  (re-exported: the scripts catch it)

log = logging.getLogger("jaxcb")


def checked_overrides(hydra_main: Callable[[], None]) -> Callable[[], None]:
    """Wrap a script's `hydra.main`: a command line whose config Hydra cannot compose (an unknown key,
    a preset that does not exist, a value of the wrong type) ends as `error: <sentence>`, exit 2, as
    load_config's refusals do, instead of Hydra's multi-line report."""

    @functools.wraps(hydra_main)
    def wrapper() -> None:
        from jaxcb.config_errors import check_overrides

        try:
            check_overrides(sys.argv[1:])
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        hydra_main()

    return wrapper


def entry_point(main: Callable[[Config], None]) -> Callable[[DictConfig], None]:
    """Wrap a script's main: validate the config first; print config/checkpoint errors as one sentence."""
    from jaxcb.model.loader import CheckpointError

    @functools.wraps(main)
    def wrapper(cfg: DictConfig) -> None:
        logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing is noise to a user
        try:
            config = load_config(cfg)
            for sentence in unused_settings(config, os.path.splitext(os.path.basename(sys.argv[0]))[0]):
                log.warning("%s", sentence)
            main(config)
        except (ConfigError, CheckpointError, UserError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
