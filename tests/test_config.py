"""The shared from_dict check of every frozen config (mar_probe._config.checked_fields)."""
import pytest

from mar_probe._config import checked_fields
from mar_probe.compare import CompareConfig, StrategyRun
from mar_probe.models.config import MARConfig
from mar_probe.store.spec import SelectionSpec
from mar_probe.quality.classifier import ClassifierConfig
from mar_probe.study import StudyConfig
from mar_probe.train import TrainConfig

CONFIGS = (MARConfig, SelectionSpec, StudyConfig, CompareConfig, ClassifierConfig, TrainConfig)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_from_dict_names_unknown_keys_and_lists_the_fields(cls):
    fields = sorted(cls.__dataclass_fields__)
    with pytest.raises(ValueError) as err:
        cls.from_dict({"zeta": 1, fields[0]: None, "alpha": 2})
    assert str(err.value) == f"unknown {cls.__name__} field(s) ['alpha', 'zeta']; expected a subset of {fields!r}"
    with pytest.raises(TypeError, match=rf"{cls.__name__}.from_dict expects a mapping .* got 'list'"):
        cls.from_dict(["alpha"])


def test_checked_fields_returns_a_copy_and_round_trips():
    data = {"runs": [StrategyRun(label="full", name="full").to_dict()], "num_samples": 2}
    out = checked_fields(CompareConfig, data)
    assert out == data and out is not data
    out["num_samples"] = 3
    assert data["num_samples"] == 2
    config = CompareConfig(runs=(StrategyRun(label="full", name="full"),), num_samples=2, seeds=(0, 4))
    assert CompareConfig.from_dict(config.to_dict()) == config
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()
    assert ClassifierConfig.from_dict(ClassifierConfig().to_dict()) == ClassifierConfig()
