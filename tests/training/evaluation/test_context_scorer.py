import pytest

from service.artifacts.bundle import load_bundle
from service.errors import BundleError
from training.evaluation.context_scorer import context_scorer


def test_a_missing_stage_2_run_is_named_with_the_command_that_writes_it(small_bundle_dir,
                                                                       tmp_path):
    with pytest.raises(BundleError, match="synthesize --teacher ranker --among nearest"):
        context_scorer(load_bundle(small_bundle_dir), dataset=tmp_path / "none")
