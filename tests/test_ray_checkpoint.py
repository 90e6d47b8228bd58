"""Ray Train knows the run's checkpoints as they are written (metadata only): its Result names the newest,
which is the one a rerun resumes from, and Ray neither copies nor deletes any of raychat's checkpoints.

The run is conftest's `two_worker_run` (no extra training run): 16 steps in the bucket with
--keep-checkpoints 2, so raychat pruned checkpoints 4 to 12 that the first fit had named to Ray Train,
then a rerun to step 20, which Ray would refuse to start if its list of the first fit's checkpoints
were kept (raychat.run.driver.forget_ray_checkpoints)."""

import argparse

import pytest
from helpers import tiny_flags
from ray.train import Result

from raychat.checkpoint.catalog import list_checkpoints
from raychat.config import add_config_flags, config_from_args
from raychat.run.prepare import prepare_run
from raychat.storage import Storage


@pytest.mark.ray
def test_the_result_names_the_newest_checkpoint_which_a_rerun_resumes_from(two_worker_run, tiny_corpus):
    run = Storage(two_worker_run.storage).child(two_worker_run.name)
    assert two_worker_run.rerun.returncode == 0  # it started although checkpoints 4 to 12 are gone

    # The public Result of the rerun's fit, read back from the run's directory in the bucket.
    result = Result.from_path(run.root, storage_filesystem=run.fs)
    assert result.checkpoint is not None
    assert result.checkpoint.path == run.path("checkpoint_000020")
    assert result.metrics["step"] == 20 and result.metrics["train_done"]

    # A rerun of the run resumes from that checkpoint (the driver's own choice, before any worker).
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = tiny_flags(tiny_corpus, two_worker_run.storage, two_worker_run.name, *two_worker_run.flags,
                       "--num-iterations", "24")
    rerun = prepare_run(config_from_args(parser.parse_args(flags)), log=lambda _: None)
    assert rerun.resume_from is not None and rerun.resume_from.path() == result.checkpoint.path

    # Ray copied nothing (no directory of its own beside raychat's checkpoints) and deleted nothing
    # raychat keeps (--keep-checkpoints 2: 16 and 20).
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000016", "checkpoint_000020"]
    assert [d for d in run.subdirs() if d.startswith("checkpoint")] == ["checkpoint_000016",
                                                                         "checkpoint_000020"]
