"""In-stack drafter training: `run_training(config, out, overrides)` (`specjax train CONFIG --out DIR`)."""

from specjax.train.base import DrafterTrainer  # noqa: F401
from specjax.train.config import TrainConfig, base_config, resolve  # noqa: F401
from specjax.train.loop import expected_tau, run_training  # noqa: F401
from specjax.train.trainers import TRAINERS, make_trainer  # noqa: F401
