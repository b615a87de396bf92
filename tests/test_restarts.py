"""A job that torchrun restarts after a process was killed resumes from its last checkpoint, on
as many processes or fewer, and ends where an uninterrupted run ends; the loader's position in
between."""
import pytest
import torch
from torch.utils.data import TensorDataset

from layerbraid.data import LayerParallelLoader
from layerbraid.tools import restarts


@pytest.mark.parametrize("mode", list(restarts.MODES))
def test_a_killed_process_restarts_and_resumes_to_the_uninterrupted_weights(mode):
    """The restart drill (layerbraid.tools.restarts), float64, exact solves, 9 batches with a
    checkpoint every 2.  fixed: torchrun --max-restarts 1 on 2 processes, rank 1 SIGKILLed
    before batch 5; both start again at batch 4 with the optimizer's momentum and the loader's
    position.  elastic: two agents of one process (--nnodes 1:2); the second is SIGKILLed with
    its process, and the first resumes alone at batch 4, the steps re-split.  Both end with the
    weights of a run that was never killed (one process, no launcher), to round-off."""
    result = restarts.run(mode, limit=150)
    log = "".join(result["lines"])[-4000:]
    assert not restarts.problems(mode, result), (restarts.problems(mode, result), log)
    size = 2 if mode == "fixed" else 1
    assert sorted(s for s in result["starts"] if s[2] == 1) == [
        (r, size, 1, 4) for r in range(size)], log
    assert result["max_diff"] <= 1e-12, log


def _loader(seed=3):
    data = TensorDataset(torch.arange(20.0))
    return LayerParallelLoader(data, 3, comm=None, seed=seed)


def test_the_loader_continues_after_its_saved_position():
    loader = _loader()
    whole = [b[0].tolist() for _ in range(2) for b in loader]  # two epochs, 7 batches each
    loader = _loader()
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 3
    again = _loader()
    again.load_state_dict(state)
    rest = [b[0].tolist() for b in again] + [b[0].tolist() for b in again]
    assert seen + rest == whole


def test_a_position_at_the_end_of_an_epoch_goes_on_with_the_next():
    loader = _loader()
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    state = loader.state_dict()
    assert state["batches"] == len(loader) == len(first)
    again = _loader()
    again.load_state_dict({"epoch": 0, "batches": len(first), "seed": state["seed"]})
    assert [b[0].tolist() for b in again] == second


def test_a_position_from_another_seed_is_refused_naming_both():
    with pytest.raises(ValueError, match="shuffling seed 3; this loader has seed 4"):
        _loader(seed=4).load_state_dict(_loader(seed=3).state_dict())
