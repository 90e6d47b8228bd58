"""--optimizer's name to its OptimizerSpec (raychat.config.OPTIMIZERS lists the modules), and the one
rule that names impose on a resume."""

import importlib

from raychat.common import RaychatError
from raychat.config import OPTIMIZERS
from raychat.optim.base import OptimizerSpec

# What every checkpoint saved before --optimizer existed was trained with
BEFORE_THE_FLAG = "muon_adamw"


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of --optimizer `name` (TrainConfig has checked the name), its module imported at first use."""
    return importlib.import_module(OPTIMIZERS[name]).SPEC


def check_same_optimizer(saved: str | None, wanted: str, checkpoint: str) -> None:
    """A checkpoint's optimizer state continues only under the optimizer that saved it (`saved`;
    None: a checkpoint from before --optimizer existed)."""
    saved = saved or BEFORE_THE_FLAG
    if saved != wanted:
        raise RaychatError(f"{checkpoint} was saved with --optimizer {saved}, not {wanted}: its optimizer "
                           f"state cannot continue under another optimizer; resume with --optimizer {saved} "
                           "or start a new --run-name")
