"""Loader errors name the file and the problem (found by adversarial testing)."""
import json

import pytest

from xoffload.models import load_hf_dir


def test_malformed_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_hf_dir(str(tmp_path), device="cpu")


def test_config_missing_key_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json.*missing required key"):
        load_hf_dir(str(tmp_path), device="cpu")
