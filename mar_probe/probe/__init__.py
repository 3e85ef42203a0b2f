"""Recording MAR's internals: the selection spec, the sampler observer and the ``record`` driver."""
from .probe import Probe, StepRecord
from .record import RecordResult, record, sample_seeds
from ..store.spec import ACTIVATIONS, BOOKKEEPING, DEFAULT_VARIABLES, SelectionSpec

__all__ = ["ACTIVATIONS", "BOOKKEEPING", "DEFAULT_VARIABLES", "Probe", "RecordResult", "SelectionSpec",
           "StepRecord", "record", "sample_seeds"]
