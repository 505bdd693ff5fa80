"""Which Hypothesis profile a run loads (tests/conftest.py): GPU_EXAMPLES must reach the examples a test runs."""
import os

from hypothesis import settings

from conftest import hypothesis_profile


def test_profile_choice():
    assert hypothesis_profile({}) == "dev"
    assert hypothesis_profile({"CI": "true"}) == "ci"
    assert hypothesis_profile({"GPU_EXAMPLES": "1000"}) == "gpu"
    assert hypothesis_profile({"GPU_EXAMPLES": "1000", "CI": "true"}) == "gpu"
    assert hypothesis_profile({"GPU_EXAMPLES": "1000", "HYPOTHESIS_PROFILE": "thorough"}) == "thorough"
    assert hypothesis_profile({"HYPOTHESIS_PROFILE": "ci"}) == "ci"


def test_the_loaded_profile_is_the_chosen_one():
    chosen = settings.get_profile(hypothesis_profile(os.environ))
    assert settings.default.max_examples == chosen.max_examples
    assert settings.get_profile("gpu").max_examples == int(os.environ.get("GPU_EXAMPLES", "150"))
