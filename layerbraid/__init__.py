"""layerbraid: layer-parallel multigrid (MGRIT) training for PyTorch."""
from .errors import DivergenceError, MGRITError, RemoteRankError
from .mgrit import MGRIT, MGRITResult
from .module import LayerParallelModule, SolveStats
from .options import MGRITOptions

__all__ = ["MGRIT", "MGRITResult", "MGRITOptions", "LayerParallelModule", "SolveStats", "MGRITError", "RemoteRankError",
           "DivergenceError"]
__version__ = "0.1.0"
