"""Recording MAR's internals: the sampler observer, the ``record`` driver and step-aware interventions."""
from .intervention import Intervention
from .probe import Probe, StepRecord
from .record import RecordResult, record, sample_seeds
from ..store.spec import ACTIVATIONS, BOOKKEEPING, DEFAULT_VARIABLES, SelectionSpec

__all__ = ["ACTIVATIONS", "BOOKKEEPING", "DEFAULT_VARIABLES", "Intervention", "Probe", "RecordResult", "SelectionSpec",
           "StepRecord", "record", "sample_seeds"]
