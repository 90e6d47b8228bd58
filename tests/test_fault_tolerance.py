"""The loop's fault tolerance where it decides alone (no collective): which steps a save is due at, and
the step observer a run is told to install."""

import sys
from types import ModuleType, SimpleNamespace

import pytest

from raychat.common import RaychatError
from raychat.elastic.signals import ElasticSignals
from raychat.worker.fault_tolerance import FaultTolerance
from raychat.worker.observer import OBSERVER_ENV, load_observer

pytestmark = pytest.mark.unit


def _fault_tolerance(save_every: int, first_step: int = 0) -> FaultTolerance:
    worker = SimpleNamespace(master=False, log=lambda _: None, saver=SimpleNamespace(poll=lambda: None),
                             cfg=SimpleNamespace(save_every=save_every, max_lost_minutes=5.0))
    return FaultTolerance(worker, ElasticSignals(), replicator=None, first_step=first_step)


@pytest.mark.parametrize(("save_every", "first_step", "due"), [
    (-1, 0, [12]),  # only at the end
    (5, 0, [5, 10, 12]),  # every 5 steps and at the end
    (5, 5, [10, 12]),  # never at the step the attempt resumed from: storage has it
])
def test_a_save_is_due_on_the_flags_cadence_and_at_the_end(save_every, first_step, due):
    ft = _fault_tolerance(save_every, first_step)
    assert [step for step in range(first_step, 13) if ft.save_due(step, last_step=step == 12)] == due


class _Recorder:
    records_documents = False

    def step_done(self, seen) -> None:
        pass


def _module(monkeypatch, **names) -> str:
    module = ModuleType("raychat_test_observers")
    for name, value in names.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def _raise() -> None:
    raise OSError("secret-token-in-a-message")


def test_the_observer_named_is_made_or_refused_in_one_line_naming_the_variable(monkeypatch):
    monkeypatch.delenv(OBSERVER_ENV, raising=False)
    assert load_observer() is None  # a run that names none has none
    name = _module(monkeypatch, Recorder=_Recorder, raising=_raise, plain=object, value=3)
    monkeypatch.setenv(OBSERVER_ENV, f"{name}:Recorder")
    assert isinstance(load_observer(), _Recorder)
    for spec in (f"{name}:missing", "no_such_module_here:Recorder", f"{name}:raising", f"{name}:plain",
                 f"{name}:value", name):
        monkeypatch.setenv(OBSERVER_ENV, spec)
        with pytest.raises(RaychatError) as refused:
            load_observer()
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"{OBSERVER_ENV}={spec!r}"), line
        assert "secret-token" not in line  # what the named code said stays out of the run's output
