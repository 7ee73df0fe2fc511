"""The runner: SchedulerOutput -> padded step inputs (`step_inputs.py`) -> the compiled step of a
bucket (`buckets.py`) -> sampled tokens (`model_runner.py`)."""

from jaxcb.runner.buckets import Buckets, default_token_buckets, make_buckets, powers_up_to
from jaxcb.runner.model_runner import ModelRunner, StepHandle

__all__ = ["Buckets", "ModelRunner", "StepHandle", "default_token_buckets", "make_buckets", "powers_up_to"]
